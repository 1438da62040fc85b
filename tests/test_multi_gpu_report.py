"""The several-GPU report (eval_suite/multi_gpu_report.py) reads what gpu_multi.sh wrote, including cut calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def report():
    import eval_suite.multi_gpu_report

    return eval_suite.multi_gpu_report


def _speed(path: Path, tokens_per_s: float, world: int = 1) -> None:
    body = {"tokens_per_s": tokens_per_s / world, "global_step": 3, "ms_per_step": 1000.0, "steps": 2,
            "peak_memory_gib": 12.5, "provenance": {"device": {"type": "cuda"}}}  # fmt: skip
    if world > 1:
        ranks = [{"rank": r, "tokens_per_s": tokens_per_s / world, "steps": 2} for r in range(world)]
        body.update(world_size=world, global_tokens_per_s=tokens_per_s, ranks=ranks)
    path.write_text(json.dumps(body))


def test_cut_call_speedups_and_skipped_phases(tmp_path: Path, report) -> None:
    (tmp_path / "timings.txt").write_text("b1 rc=0 seconds=52\nf1 rc=0 seconds=58\nemb1s rc=124 seconds=19\n"
                                          "d8 rc=skipped seconds=0\n")  # fmt: skip
    _speed(tmp_path / "b1_speed.json", 8000.0)
    _speed(tmp_path / "f1_speed.json", 12000.0, world=2)
    t = report.timings(tmp_path)
    assert t["emb1s"] == {"rc": 124, "seconds": 19} and t["d8"] == {"rc": "skipped", "seconds": 0}
    res = report.collect(tmp_path, "cmd")
    f = res["fsdp_8b"]
    assert f["speed_fsdp2_speedup_tokens_per_s"] == pytest.approx(1.5)  # global tokens/s over one GPU's
    assert f["speed_ddp2"] is None and "speed_ddp2_speedup_tokens_per_s" not in f  # missing stays missing
    assert res["ddp_embedded"]["val_loss_1gpu"] is None
    md = report.markdown(res)
    assert "FSDP 1.50x, DDP missingx" in md and "| d8 | skipped | 0 |" in md
