"""--batch_invariant on a GPU: an episode's records do not depend on which other episodes share its batch. The same
questions run with twice as many others beside them (another --limit, the same --batch) give the same records, and
so do two shards (--devices 2 where two GPUs are present). The embedded model with its shipped adapters, sampled as
the evaluation protocol, short episodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.model]
ROOT = Path(__file__).resolve().parent.parent


def _eval(out: Path, limit: int, *extra: str) -> None:
    cmd = [sys.executable, "cli.py", "eval", "--benchmark", "hotpotqa", "--scheme", "base_lr_shared", "--limit",
           str(limit), "--runs", "2", "--max_steps", "3", "--batch", "8", "--batch_invariant", "true", "--dtype",
           "bfloat16", "--quiet", "true", "--out", str(out), *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]


def _records(out: Path) -> dict[tuple, tuple]:
    rows = []
    for f in sorted(out.rglob("episodes.jsonl")):
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return {(r["qid"], r["run"], r["seed"]): (r["actions"], r["prediction"], r["num_tokens"]) for r in rows}


def test_records_do_not_depend_on_the_other_episodes_in_the_batch(tmp_path: Path) -> None:
    _eval(tmp_path / "few", 3)  # 6 episodes in 8 rows
    _eval(tmp_path / "many", 9)  # 18 episodes: the first 6 share their batch with others
    few, many = _records(tmp_path / "few"), _records(tmp_path / "many")
    assert len(few) == 6 and len(many) == 18
    assert {k: many[k] for k in few} == few
    # an eval on a GPU caps its host threads (lragent/host_threads.py: GPU_HOST_THREADS) unless the user set them
    import os

    threads = json.loads((tmp_path / "few" / "timing.json").read_text())["torch_threads"]
    user = os.environ.get("OMP_NUM_THREADS")
    assert threads == int(user) if user else 1 <= threads <= 4, threads


def test_two_shards_give_the_records_of_one_process(tmp_path: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _eval(tmp_path / "one", 8)
    _eval(tmp_path / "two", 8, "--devices", "2")
    one, two = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert len(one) == 16 and one == two
