"""The GPU-suite record (``scripts/gpu_tests_record.py``) names the collected tests a run never reached, from real
pytest output: a run stopped by its time budget must not read as complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import load_script

record = load_script("gpu_tests_record")

SUITE = """
import pytest

@pytest.mark.parametrize("x", [1, "a::b", 3])
def test_param(x):
    assert x != 3

class TestGroup:
    def test_method(self):
        pass

    def test_method_left(self):
        pass

def test_left():
    pass
"""


def _pytest(cwd: Path, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    ).stdout


def test_not_reached_names_exactly_the_tests_a_run_left(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_suite.py").write_text(SUITE)
    (tmp_path / "collected.txt").write_text(_pytest(tmp_path, "-q", "--collect-only", "tests"))
    # the run reaches all but two tests (a failing one included: failed is reached, not left)
    _pytest(tmp_path, "-q", "--junitxml=run1.xml", "tests", "-k", "not left")
    collected = record.read_collected(str(tmp_path / "collected.txt"))
    assert len(collected) == 6, collected
    seen = record.junit_cases(str(tmp_path / "run1.xml"))
    left = [t for t in collected if record.junit_key(t) not in seen]
    assert left == ["tests/test_suite.py::TestGroup::test_method_left", "tests/test_suite.py::test_left"]


def test_record_counts_and_lists_the_tests_not_reached(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_suite.py").write_text(SUITE)
    (tmp_path / "collected.txt").write_text(_pytest(tmp_path, "-q", "--collect-only", "tests"))
    _pytest(tmp_path, "-q", "--junitxml=run1.xml", "tests", "-k", "param")
    (tmp_path / "run1.rc").write_text("124\n")
    (tmp_path / "run1.seconds").write_text("12\n")
    monkeypatch.setattr(
        sys, "argv", ["gpu_tests_record", str(tmp_path), "cmd", "--collected", str(tmp_path / "collected.txt")]
    )
    record.main()
    (rec,) = json.loads(next(tmp_path.glob("gpu_tests_*.json")).read_text())["runs"]
    assert (rec["collected"], rec["passed"], rec["failed"], rec["interrupted"]) == (6, 2, 1, True)
    assert len(rec["not_reached"]) == 3
    md = next(tmp_path.glob("gpu_tests_*.md")).read_text()
    assert "| run1 | 6 | 2 | 1 | 0 | 0 | 3 | 12 | True |" in md
    assert "did not reach: `tests/test_suite.py::test_left`" in md


def test_nameless_entries_of_an_interrupted_run_are_not_counted_as_passed(tmp_path: Path) -> None:
    """An xdist run stopped by its budget wrote three ``<testcase time="0.001" />`` (4 × H200, 2026-11-28): 306 passed
    and 3 skipped in its log, 309 passed in the record until these entries were left out."""
    xml = (
        '<testsuites><testsuite name="pytest" tests="3"><testcase classname="tests.t" name="test_a" time="1"/>'
        '<testcase classname="tests.t" name="test_b" time="1"><skipped message="needs two GPUs"/></testcase>'
        '<testcase time="0.001" /><testcase time="0.000" /></testsuite></testsuites>'
    )
    (tmp_path / "run1.xml").write_text(xml)
    counts = record.parse_junit(str(tmp_path / "run1.xml"))
    assert (counts["passed"], counts["skipped"], counts["failed"], counts["errors"]) == (1, 1, 0, 0)


def test_planted_bugs_a_call_never_ran_are_named(tmp_path: Path, monkeypatch) -> None:
    """A call whose budget ended during the planted GPU bugs (its JSON holds those that finished, written one by one)
    names every other ``GPU:`` entry of tests/planted_bugs.yaml as not reached, in the JSON and the markdown."""
    gpu = record.planted_names("GPU:")
    assert len(gpu) > 3 and all("GPU:" in n for n in gpu)
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({gpu[0]: {"exit": 1, "summary": "1 failed", "failed": ["t"]}}))
    monkeypatch.setattr(
        sys, "argv", ["gpu_tests_record", str(tmp_path), "cmd", "--planted", str(planted), "--planted_filter", "GPU:"]
    )
    record.main()
    rec = json.loads(next(tmp_path.glob("gpu_tests_*.json")).read_text())
    assert rec["planted_not_reached"] == gpu[1:]
    md = next(tmp_path.glob("gpu_tests_*.md")).read_text()
    assert f"- {gpu[0]}: exit 1, 1 failed" in md and f"- {gpu[-1]}: not reached" in md
