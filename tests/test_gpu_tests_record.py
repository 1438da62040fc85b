"""The GPU-suite record (``scripts/gpu_tests_record.py``) names the collected tests a run never reached, from real
pytest output: a run stopped by its time budget must not read as complete."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
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


def _case(name: str, inner: str = "", classname: str = "tests.t") -> str:
    return f'<testcase classname="{classname}" name="{name}" time="1">{inner}</testcase>'


def test_the_whole_record_of_several_runs_with_provenance(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every field of the JSON and every line of the markdown, for runs that passed, failed, errored, skipped (reasons
    counted, cut at 160 characters), lacked their seconds or exit file, or were interrupted (exit 2, 124, 137, or the
    log saying so), with the collected tests and the planted bugs of a call cut short."""
    import platform
    from datetime import datetime, timezone

    import torch

    long_reason = "r" * 200
    cases = {
        "run1": [_case("test_a"), _case("test_b", "<failure/>"), _case("test_c", "<error/>"),
                 _case("test_d", '<skipped message="needs two GPUs"/>'),
                 _case("test_e", f'<skipped message="{long_reason}"/>'),
                 _case("test_f", '<skipped message="needs two GPUs"/>')],
        "run2": [_case("test_g", classname="tests.u")],
        "run3": [], "run4": [], "run5": [], "run6": [],
    }  # fmt: skip
    for run, body in cases.items():
        (tmp_path / f"{run}.xml").write_text(
            f'<testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>'
        )
    files = {"run1.seconds": "12.6\n", "run1.rc": "1\n", "run1.log": "x" * 5000 + "1 failed, 1 error",
             "run2.log": "!!! KeyboardInterrupt !!!", "run3.rc": "137", "run3.seconds": "3", "run4.rc": "2",
             "run4.seconds": "4", "run5.rc": "124", "run5.seconds": "5", "run6.rc": "0", "run6.seconds": "6",
             "run6.log": "Interrupted: 1 error during collection", "source.sha256": "abc123\n"}  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "collected.txt").write_text(
        "tests/t.py::test_a\ntests/t.py::test_z\n  tests/t.py::indented\n= tests/t.py::header\n\n2 tests collected\n"
    )
    gpu = record.planted_names("GPU:")
    (tmp_path / "planted.json").write_text(json.dumps({gpu[1]: {"exit": 1, "summary": "1 failed", "failed": ["t"]}}))
    monkeypatch.setenv("LRAGENT_COMMIT", "c0ffee")
    monkeypatch.delenv("GPU_TESTS_OUT", raising=False)  # set by the record (its folder, for provenance); restored
    monkeypatch.setattr(record, "_run", lambda argv: None)  # no nvidia-smi here (git is not asked: the commit is set)
    argv = [str(tmp_path), "the command", "--collected", str(tmp_path / "collected.txt"),
            "--planted", str(tmp_path / "planted.json"), "--planted_filter", "GPU:"]  # fmt: skip
    before = datetime.now(timezone.utc).replace(microsecond=0)
    assert record.main(argv) == 0
    (json_path,) = tmp_path.glob("gpu_tests_*.json")
    rec = json.loads(json_path.read_text())
    prov = rec["provenance"]
    stamp = datetime.strptime(prov.pop("date_utc"), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert before <= stamp <= datetime.now(timezone.utc)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    dev = "no_cuda_device" if device == "no CUDA device" else re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_").lower()
    assert json_path.name == f"gpu_tests_{dev}_{stamp.strftime('%Y-%m-%d')}.json"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from lragent.models import embedded_gguf_path, embedded_model_missing

    missing = embedded_model_missing()
    model = f"available ({embedded_gguf_path()})" if missing is None else f"missing, model tests skip ({missing})"
    assert prov == {"device": device, "nvidia_smi": None, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "triton": triton_version, "python": platform.python_version(), "commit": "c0ffee",
                    "source_sha256": "abc123", "embedded_model": model, "command": "the command"}  # fmt: skip
    nan = float("nan")  # run2's seconds
    both = ["tests/t.py::test_a", "tests/t.py::test_z"]
    none = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": [], "error_tests": [],
            "skip_reasons": {}, "collected": 2, "not_reached": both}  # fmt: skip
    want = [
        {"run": "run1", "passed": 1, "failed": 1, "errors": 1, "skipped": 3, "failed_tests": ["tests.t::test_b"],
         "error_tests": ["tests.t::test_c"], "skip_reasons": {"needs two GPUs": 2, "r" * 160: 1}, "seconds": 12.6,
         "exit_code": 1, "interrupted": False, "collected": 2, "not_reached": ["tests/t.py::test_z"]},
        {**none, "run": "run2", "passed": 1, "seconds": nan, "exit_code": None, "interrupted": True},
        {**none, "run": "run3", "seconds": 3.0, "exit_code": 137, "interrupted": True},
        {**none, "run": "run4", "seconds": 4.0, "exit_code": 2, "interrupted": True},
        {**none, "run": "run5", "seconds": 5.0, "exit_code": 124, "interrupted": True},
        {**none, "run": "run6", "seconds": 6.0, "exit_code": 0, "interrupted": True},
    ]  # fmt: skip
    got = rec["runs"]
    seconds = [r.pop("seconds") for r in got]  # a run without its seconds file: NaN (not equal to itself)
    assert math.isnan(seconds[1]) and [seconds[0], *seconds[2:]] == [12.6, 3.0, 4.0, 5.0, 6.0]
    assert got == [{k: v for k, v in w.items() if k != "seconds"} for w in want]
    assert rec["planted_bugs"] == {gpu[1]: {"exit": 1, "summary": "1 failed", "failed": ["t"]}}
    assert rec["planted_not_reached"] == [gpu[0], *gpu[2:]]
    md = json_path.with_suffix(".md").read_text()
    head = (
        f"# GPU test suite: {device}, {stamp.strftime('%Y-%m-%dT%H:%M:%SZ')}\n\n"
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}, python "
        f"{platform.python_version()}; commit c0ffee; source sha256 abc123; embedded model: {model}\n"
        "command: `the command`\n\n"
        "| run | collected | passed | failed | errors | skipped | not reached | seconds | interrupted |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        "| run1 | 2 | 1 | 1 | 1 | 3 | 1 | 13 | False |\n"
        "| run2 | 2 | 1 | 0 | 0 | 0 | 2 | nan | True |\n"
        "| run3 | 2 | 0 | 0 | 0 | 0 | 2 | 3 | True |\n"
        "| run4 | 2 | 0 | 0 | 0 | 0 | 2 | 4 | True |\n"
        "| run5 | 2 | 0 | 0 | 0 | 0 | 2 | 5 | True |\n"
        "| run6 | 2 | 0 | 0 | 0 | 0 | 2 | 6 | True |\n"
        "- run1 failed: `tests.t::test_b`\n- run1 failed: `tests.t::test_c`\n"
        "- run1 did not reach: `tests/t.py::test_z`\n"
    )
    head += "".join(f"- {r} did not reach: `tests/t.py::test_{t}`\n" for r in ("run2", "run3", "run4", "run5", "run6")
                    for t in ("a", "z"))  # fmt: skip
    head += "\nPlanted bugs (exit != 0: the tests caught it):\n\n" + f"- {gpu[1]}: exit 1, 1 failed\n"
    head += "".join(f"- {n}: not reached\n" for n in [gpu[0], *gpu[2:]])
    assert md == head
    assert capsys.readouterr().out == head + "\n" + f"record: {json_path.with_suffix('')}.json / .md\n"
    assert os.environ["GPU_TESTS_OUT"] == str(tmp_path)
    assert json_path.read_text().startswith('{\n "provenance": {\n  "date_utc": ')  # indent 1


def test_commands_read_for_provenance_and_their_failures(tmp_path: Path, monkeypatch) -> None:
    """_run gives a command's stripped stdout, None when it fails or does not exist; provenance asks git for the
    commit only without LRAGENT_COMMIT and says how to set it when git cannot answer, asks nvidia-smi for name,
    memory and driver, and has no source hash without its file."""
    assert record._run([sys.executable, "-c", "print('  out  ')"]) == "out"
    assert record._run([sys.executable, "-c", "import sys; print('x'); sys.exit(1)"]) is None
    assert record._run([str(tmp_path / "no-such-command")]) is None
    asked = []
    answers = {"git": "f00d", "nvidia-smi": "NVIDIA H100, 81559 MiB, 550.54"}
    monkeypatch.setattr(record, "_run", lambda argv: asked.append(argv) or answers.get(argv[0]))
    monkeypatch.delenv("LRAGENT_COMMIT", raising=False)
    monkeypatch.setenv("GPU_TESTS_OUT", str(tmp_path))  # no source.sha256 there
    prov = record.provenance("cmd")
    smi = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    assert asked == [["git", "rev-parse", "HEAD"], smi]
    assert (prov["commit"], prov["nvidia_smi"], prov["source_sha256"]) == ("f00d", answers["nvidia-smi"], None)
    answers.clear()
    assert record.provenance("cmd")["commit"] == "unknown (no .git on the device; set LRAGENT_COMMIT)"


def test_junit_details_nameless_cases_and_node_ids(tmp_path: Path, capsys) -> None:
    """Failures and errors counted one by one, a case without a class named by its test alone, a skip without a
    message counted under "", nameless entries before named ones skipped (not the end of the file); node ids without
    a test part or a .py suffix; the command names itself."""
    xml = (
        '<testsuites><testsuite name="pytest"><testcase time="0.001" />'
        '<testcase classname="tests.t" name="a"><failure/></testcase><testcase name="b"><failure/></testcase>'
        '<testcase classname="tests.t" name="c"><error/></testcase><testcase classname="tests.t" name="d"><error/>'
        '</testcase><testcase classname="tests.t" name="e"><skipped/></testcase></testsuite></testsuites>'
    )
    (tmp_path / "run1.xml").write_text(xml)
    got = record.parse_junit(str(tmp_path / "run1.xml"))
    assert (got["failed"], got["errors"], got["skipped"], got["passed"]) == (2, 2, 1, 0)
    assert got["failed_tests"] == ["tests.t::a", "::b"] and got["skip_reasons"] == {"": 1}
    assert record.junit_cases(str(tmp_path / "run1.xml")) == {("", ""), ("tests.t", "a"), ("", "b"), *(
        ("tests.t", n) for n in "cde")}  # fmt: skip
    assert record.junit_key("tests/test_a.py") == ("tests.test_a", "")
    assert record.junit_key("tests/test_a::test_b") == ("tests.test_a", "test_b")
    assert record.junit_key("tests/test_a.py::K::test_b[p::q]") == ("tests.test_a.K", "test_b[p::q]")
    with pytest.raises(SystemExit):
        record.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: scripts/gpu_tests_record.py")


def test_a_record_without_collected_tests_or_planted_filter(tmp_path: Path, monkeypatch) -> None:
    """Without --collected the table says '?' for both counts and lists nothing as not reached; planted results
    without a filter name none as not reached; no planted results, no planted section; a negative exit status (a
    signal) is read as such."""
    (tmp_path / "run1.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="a"/></testsuite></testsuites>'
    )
    (tmp_path / "run1.rc").write_text("-9\n")
    (tmp_path / "run1.seconds").write_text("7")
    monkeypatch.setattr(record, "_run", lambda argv: None)
    monkeypatch.setenv("LRAGENT_COMMIT", "c")
    monkeypatch.delenv("GPU_TESTS_OUT", raising=False)
    assert record.main([str(tmp_path), "cmd"]) == 0
    json_path = next(tmp_path.glob("gpu_tests_*.json"))
    rec = json.loads(json_path.read_text())
    assert "planted_bugs" not in rec and "planted_not_reached" not in rec
    (run,) = rec["runs"]
    assert run["exit_code"] == -9 and "not_reached" not in run and "collected" not in run
    md = json_path.with_suffix(".md").read_text()
    assert md.endswith("|---|---|---|---|---|---|---|---|---|\n| run1 | ? | 1 | 0 | 0 | 0 | ? | 7 | False |\n")
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({"x": {"exit": 1, "summary": "1 failed"}}))
    assert record.main([str(tmp_path), "cmd", "--planted", str(planted)]) == 0
    rec = json.loads(json_path.read_text())
    assert rec["planted_bugs"] == {"x": {"exit": 1, "summary": "1 failed"}} and "planted_not_reached" not in rec
    assert (
        json_path.with_suffix(".md")
        .read_text()
        .endswith("\nPlanted bugs (exit != 0: the tests caught it):\n\n- x: exit 1, 1 failed\n")
    )
