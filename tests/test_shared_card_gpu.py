"""Six evaluations on one GPU at once, each with ``--batch auto --memory_fraction 0.15``: every one finishes, with
the same episode records as when it runs alone (the six commands of the issue that found the crash: ScienceQA and
HotpotQA, ``non_shared`` and ``base_lr_shared``, two with ``--constrain answer_text``). The embedded model with its
shipped adapters, a few questions and short episodes so that the test takes about a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.model]
ROOT = Path(__file__).resolve().parent.parent
JOBS = [
    ("scienceqa", "non_shared", []),
    ("scienceqa", "base_lr_shared", []),
    ("scienceqa", "non_shared", ["--constrain", "answer_text"]),
    ("scienceqa", "base_lr_shared", ["--constrain", "answer_text"]),
    ("hotpotqa", "non_shared", []),
    ("hotpotqa", "base_lr_shared", []),
]


def _cmd(bench: str, scheme: str, extra: list[str], out: Path) -> list[str]:
    return [sys.executable, "cli.py", "eval", "--benchmark", bench, "--scheme", scheme, *extra, "--limit", "6",
            "--runs", "1", "--max_steps", "3", "--batch", "auto", "--memory_fraction", "0.15", "--dtype", "bfloat16",
            "--quiet", "true", "--out", str(out)]  # fmt: skip


def _records(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines() if x.strip()]
    return sorted((r["qid"], r["row"], r["seed"], r["actions"], r["prediction"], r["num_tokens"]) for r in rows)


def test_six_evaluations_share_one_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    together = [
        subprocess.Popen(
            _cmd(b, s, x, tmp_path / f"together{i}"),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i, (b, s, x) in enumerate(JOBS)
    ]
    logs = [p.communicate(timeout=900)[0] for p in together]
    for p, log in zip(together, logs, strict=True):
        assert p.returncode == 0, log[-2000:]
        assert "Traceback" not in log
    for i, (b, s, x) in enumerate(JOBS):
        alone = subprocess.run(_cmd(b, s, x, tmp_path / f"alone{i}"), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=900)  # fmt: skip
        assert alone.returncode == 0, alone.stderr[-2000:]
        assert _records(tmp_path / f"together{i}") == _records(tmp_path / f"alone{i}"), JOBS[i]
