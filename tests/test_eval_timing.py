"""timing.json across resumed runs (eval_suite/evaluate/eval_timing.py): parts kept, their figures summed at the top
level."""

from __future__ import annotations

import json
from pathlib import Path

from eval_suite.evaluate.eval_timing import EvalTiming, totals


def test_totals_sum_the_seconds_and_counts_and_keep_the_last_settings() -> None:
    a = {"episodes_s": 10.0, "episodes": 4, "startup_s": None, "batch": 16, "decode_steps": 100, "feed_rows": 512,
         "feed_tokens": 300}  # fmt: skip
    b = {"episodes_s": 5.0, "episodes": 2, "startup_s": 3.0, "batch": 8, "decode_steps": 50, "capture_s": 1.0,
         "feed_rows": 256, "feed_tokens": 100}  # fmt: skip
    t = totals([a, b])
    assert (t["episodes_s"], t["episodes"], t["decode_steps"]) == (15.0, 6, 150)
    assert (t["feed_rows"], t["feed_tokens"]) == (768, 400)
    assert t["startup_s"] == 3.0 and t["capture_s"] == 1.0  # a part without a figure adds nothing
    assert t["batch"] == 8  # a setting, not a sum: the last part's
    assert "wait_s" not in t  # no part has it: not made up
    assert totals([{"startup_s": None}])["startup_s"] is None


def test_each_run_adds_its_part_after_the_earlier_ones(tmp_path: Path) -> None:
    path = tmp_path / "timing.json"
    first = EvalTiming(path)
    assert first.earlier == []
    first.write({"episodes": 1, "episodes_s": 2.0}, complete=False)
    first.write({"episodes": 3, "episodes_s": 6.0}, complete=False)  # rewritten as it goes: one part, the latest
    body = json.loads(path.read_text())
    assert body["episodes"] == 3 and body["complete"] is False and body["runs_resumed"] == 0
    second = EvalTiming(path)  # the run that resumes it
    second.write({"episodes": 2, "episodes_s": 4.0}, complete=True)
    body = json.loads(path.read_text())
    assert (body["episodes"], body["episodes_s"], body["complete"], body["runs_resumed"]) == (5, 10.0, True, 1)
    assert [(p["episodes"], p["complete"]) for p in body["parts"]] == [(3, False), (2, True)]
    assert not path.with_name("timing.json.tmp").exists()
    EvalTiming(path).write({"episodes": 1, "episodes_s": 1.0}, complete=True)  # a second resume: three flat parts
    body = json.loads(path.read_text())
    assert body["runs_resumed"] == 2 and [p["episodes"] for p in body["parts"]] == [3, 2, 1]
    assert all(set(p) == {"episodes", "episodes_s", "complete"} for p in body["parts"])  # no part nests another


def test_a_file_from_before_parts_counts_as_one_part(tmp_path: Path) -> None:
    path = tmp_path / "timing.json"
    path.write_text(json.dumps({"episodes": 7, "episodes_s": 30.0, "batch": 16}))
    EvalTiming(path).write({"episodes": 1, "episodes_s": 5.0, "batch": 16}, complete=True)
    body = json.loads(path.read_text())
    assert body["episodes"] == 8 and body["episodes_s"] == 35.0 and len(body["parts"]) == 2
    path.write_text("{not json")  # a torn or foreign file: this run starts the parts
    assert EvalTiming(path).earlier == []
