"""scripts/plant_bugs.py keeps what finished when it is cut short: each entry's outcome is in the results file as soon
as it ends, and an interrupt (a device call's ``timeout -s INT``) ends the run with one line and no traceback. Each
entry is planted in a fresh scratch copy (the repository itself untouched), and the results file is merged through a
temporary file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
FAST = "q/k/v in one launch: off again when LRAGENT_QKV_ROPE is unset"  # its test takes about a second
SLOW = "decoder: full caches kept off the one q/k/v launch"  # an engine under the interpreter: about a minute


def _calc_repo(root: Path, junk: tuple[str, ...], extra: str = "") -> str:
    """A tiny repository at ``root``: pkg/calc.py (add, neg, then ``extra``), its two tests, pytest.ini, and a folder
    with one file for each name of ``junk``; returns calc.py's text."""
    (root / "pkg").mkdir(parents=True)
    calc = "def add(a, b):\n    return a + b\n\n\ndef neg(a):\n    return -a\n" + extra
    (root / "pkg" / "calc.py").write_text(calc)
    (root / "tests").mkdir()
    (root / "tests" / "test_calc.py").write_text(
        "from pkg.calc import add, neg\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_neg():\n    assert neg(2) == -2\n"
    )
    (root / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    for name in junk:
        (root / name).mkdir()
        (root / name / "f").write_text(name)
    return calc


def test_an_interrupted_run_keeps_the_entries_it_finished(tmp_path: Path) -> None:
    results = tmp_path / "planted.json"
    env = {**os.environ, "LRAGENT_PLANTED_RESULTS": str(results), "LRAGENT_PLANT_SCRATCH": str(tmp_path / "scratch")}
    proc = subprocess.Popen(
        [sys.executable, "scripts/plant_bugs.py", FAST, SLOW],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as under `timeout`
        # started with SIGINT ignored, as a background job of a non-interactive shell starts (the suite run as
        # `pytest ... &` from a script): the script must still stop on the interrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        deadline = time.monotonic() + 120
        while not (results.exists() and FAST in json.loads(results.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, "the first entry was never written"
            time.sleep(0.2)
        time.sleep(3)  # the second entry's tests are running now
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert f"plant_bugs: interrupted during {SLOW!r}: 1 of 2 run, kept in {results}" in err, err[-2000:]
    kept = json.loads(results.read_text())
    assert list(kept) == [FAST] and kept[FAST]["exit"] != 0, kept


def test_an_entry_is_planted_in_a_fresh_copy_and_its_failing_test_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_one deletes the previous scratch copy, copies the repository without .git, __pycache__ and data (linked),
    replaces each old/new pair in the entry's file there, runs the entry's tests in the copy and records their
    failure; the repository's own file is untouched."""
    pb = load_script("plant_bugs")
    root, scratch = tmp_path / "repo", tmp_path / "scratch"
    calc = _calc_repo(root, (".git", "__pycache__", "data"))
    scratch.mkdir()
    (scratch / "stale.txt").write_text("the previous entry's copy")
    monkeypatch.setattr(pb, "ROOT", str(root))
    monkeypatch.setattr(pb, "SCRATCH", str(scratch))
    bug = ("pkg/calc.py", ("return a + b", "return -a"), ("return a - b", "return a"), "tests/test_calc.py")
    monkeypatch.setattr(pb, "BUGS", {"add subtracts, neg is identity": bug})
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the copy's pytest starts in 1 s, not 3
    monkeypatch.setenv("PYTEST_PLUGINS", "xdist.plugin")  # but knows the runner's `-n 0`
    results: dict = {}
    pb.run_one("add subtracts, neg is identity", results)
    assert (scratch / "pkg" / "calc.py").read_text() == calc.replace("a + b", "a - b").replace("-a\n", "a\n")
    assert (root / "pkg" / "calc.py").read_text() == calc
    assert not (scratch / "stale.txt").exists()
    assert not (scratch / ".git").exists() and not (scratch / "__pycache__").exists()
    assert (scratch / "data").is_symlink() and (scratch / "data" / "f").read_text() == "data"
    entry = results["add subtracts, neg is identity"]
    assert entry["exit"] == 1 and entry["failed"] == ["tests/test_calc.py::test_add"], entry  # -x: first failure


def test_saving_merges_into_the_results_file_through_a_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save() keeps the entries already in the results file, adds (or replaces) the new ones, and leaves no
    temporary .part file behind."""
    pb = load_script("plant_bugs")
    results = tmp_path / "planted.json"
    results.write_text(json.dumps({"earlier": {"exit": 1}, "rerun": {"exit": 0}}))
    monkeypatch.setattr(pb, "RESULTS", str(results))
    pb.save({"rerun": {"exit": 2}, "new": {"exit": 1}})
    assert json.loads(results.read_text()) == {"earlier": {"exit": 1}, "rerun": {"exit": 2}, "new": {"exit": 1}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["planted.json"]


def test_the_command_runs_the_chosen_entries_of_a_catalogue_and_writes_one_line_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A catalogue read by load() (lists of old/new as tuples, a single string kept), the entries whose names hold
    the filter run in order, each printed in one line and saved one JSON line each (non-ASCII names as they are);
    the copy leaves out wheels, GGUF pieces, .hypothesis; an old text found twice is refused naming the entry."""
    pb = load_script("plant_bugs")
    root, scratch, out = tmp_path / "repo", tmp_path / "scratch", tmp_path / "planted.json"
    _calc_repo(root, (".whl", ".gguf3", ".hypothesis", "data"), extra="\n\nTWICE = 1\nTWICE = 1\n")
    catalogue = tmp_path / "bugs.yaml"
    catalogue.write_text(
        "'calc: add subtracts':\n  file: pkg/calc.py\n  old: return a + b\n  new: return a - b\n"
        "  tests: tests/test_calc.py\n"
        "'calc: négation kept':\n  file: pkg/calc.py\n  old: [return -a, 'def neg(a):']\n"
        "  new: [return a, 'def neg(a, b=0):']\n  tests: tests/test_calc.py::test_neg\n"
        "'other: not chosen':\n  file: pkg/calc.py\n  old: a\n  new: b\n  tests: tests\n"
    )
    bugs = pb.load(str(catalogue))
    assert bugs == {
        "calc: add subtracts": ("pkg/calc.py", "return a + b", "return a - b", "tests/test_calc.py"),
        "calc: négation kept": ("pkg/calc.py", ("return -a", "def neg(a):"), ("return a", "def neg(a, b=0):"),
                                "tests/test_calc.py::test_neg"),
        "other: not chosen": ("pkg/calc.py", "a", "b", "tests"),
    }  # fmt: skip
    for name, value in (("ROOT", str(root)), ("SCRATCH", str(scratch)), ("RESULTS", str(out)), ("BUGS", bugs)):
        monkeypatch.setattr(pb, name, value)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "xdist.plugin")
    assert pb.main(["calc"]) == 0
    results = json.loads(out.read_text())
    assert list(results) == ["calc: add subtracts", "calc: négation kept"]
    assert [r["failed"] for r in results.values()] == [
        ["tests/test_calc.py::test_add"],
        ["tests/test_calc.py::test_neg"],
    ]
    assert all(r["exit"] == 1 and r["summary"].startswith("1 failed") for r in results.values())
    lines = out.read_text().splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == 4 and '"calc: négation kept": {' in lines[2]
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{n} -> 1 {r['summary']} {r['failed']}" for n, r in results.items()]
    assert sorted(p.name for p in scratch.iterdir()) == ["data", "pkg", "pytest.ini", "tests"]  # junk left out
    assert "def neg(a, b=0):\n    return a\n" in (scratch / "pkg" / "calc.py").read_text()
    monkeypatch.setattr(pb, "BUGS", {"twice": ("pkg/calc.py", "TWICE = 1", "TWICE = 2", "tests")})
    with pytest.raises(AssertionError, match=r"\('twice', 2\)"):
        pb.main(["twice"])
    assert pb.main(["--help"]) == 0
    assert capsys.readouterr().out.endswith("\nentries:\n  twice\n")


def test_help_lists_every_entry_and_an_interrupt_in_process_keeps_what_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """-h / --help (from the command line too) print the usage and every entry, one an indented line; an entry whose
    old and new lists differ in length is refused; a Ctrl-C during the second entry returns 130 with one line naming
    it, the first entry's result saved."""
    pb = load_script("plant_bugs")
    out = tmp_path / "planted.json"
    monkeypatch.setattr(pb, "RESULTS", str(out))
    monkeypatch.setattr(pb, "BUGS", {"first": ("f.py", "a", "b", "t"), "second": ("f.py", "c", "d", "t")})
    for argv in (["-h"], ["x", "--help"]):
        assert pb.main(argv) == 0
        assert capsys.readouterr().out == pb.__doc__.strip() + "\n\nentries:\n  first\n  second\n"
    monkeypatch.setattr(sys, "argv", ["plant_bugs.py", "-h"])
    assert pb.main() == 0 and capsys.readouterr().out.endswith("entries:\n  first\n  second\n")

    def run_one(name: str, results: dict) -> None:
        if name == "second":
            raise KeyboardInterrupt
        results[name] = {"exit": 1, "summary": "1 failed", "failed": ["t"]}

    monkeypatch.setattr(pb, "run_one", run_one)
    assert pb.main([]) == 130
    assert capsys.readouterr().err == f"plant_bugs: interrupted during 'second': 1 of 2 run, kept in {out}\n"
    assert json.loads(out.read_text()) == {"first": {"exit": 1, "summary": "1 failed", "failed": ["t"]}}


def test_an_entry_whose_old_and_new_lists_differ_in_length_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pb = load_script("plant_bugs")
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    (root / "f.py").write_text("a = 1\nb = 2\n")
    monkeypatch.setattr(pb, "ROOT", str(root))
    monkeypatch.setattr(pb, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(pb, "BUGS", {"uneven": ("f.py", ("a = 1", "b = 2"), ("a = 2",), "t")})
    with pytest.raises(ValueError, match="zip"):
        pb.run_one("uneven", {})
