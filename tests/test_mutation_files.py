"""scripts/mutation.py's files: the scratch copy holds the repository's tracked and untracked files (not the ignored
or deleted ones), is rebuilt for a changed module, takes in changed tests while keeping mutmut's kills, and is left
alone (to resume) when nothing changed; a run stopped by its timeout is recorded as incomplete; the result and the
README table are written; a name that matches no module, or a missing mutmut, is refused with one line.

mutmut itself is replaced by a fake on PATH (a shell script that records its arguments and prints a given listing):
a real ``mutmut run`` of even a one-mutant module takes over 4 s (its stats pass plus a pytest per mutant), and what
these tests check is the script's own handling of the scratch copy and of mutmut's output, not mutmut's verdicts."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import stat
import subprocess
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from conftest import load_script

MODULE = "def f(\n    x,\n):\n    return x\n"
TESTS = "from pkg.mod import f\n\n\ndef test_f():\n    assert f(1) == 1\n"
FAKE_MUTMUT = """#!/bin/sh
echo "$*" >> "$FAKE_MUTMUT_LOG"
if [ -n "$FAKE_MUTMUT_ENV" ]; then
  echo "$1 cwd=$(pwd -P) PYTHONPATH=$PYTHONPATH OMP=$OMP_NUM_THREADS MKL=$MKL_NUM_THREADS" >> "$FAKE_MUTMUT_ENV"
fi
case "$1" in
  run) [ -n "$FAKE_MUTMUT_SLEEP" ] && exec sleep "$FAKE_MUTMUT_SLEEP"
    [ -n "$FAKE_MUTMUT_OUT" ] && cat "$FAKE_MUTMUT_OUT" && printf 'on stderr' >&2
    exit "${FAKE_MUTMUT_RC:-0}" ;;
  results) cat "$FAKE_MUTMUT_RESULTS" 2>/dev/null; exit 0 ;;
  show) printf '# %s\\n-    return x\\n+    return None\\n' "$2" ;;
esac
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True, capture_output=True
    )


def _repo(root: Path) -> Path:
    """A git repository with a module, its test file, a pyproject.toml and an ignore rule, committed."""
    root.mkdir()
    (root / "pkg").mkdir()
    (root / "pkg" / "mod.py").write_text(MODULE)
    (root / "tests").mkdir()
    (root / "tests" / "test_mod.py").write_text(TESTS)
    (root / "pyproject.toml").write_text('[project]\nname = "x"\n')
    (root / ".gitignore").write_text("*.log\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "init")
    return root


@pytest.fixture
def mm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """scripts/mutation.py on a tiny repository (ROOT), with its scratch copies and results under tmp_path and the
    fake mutmut first on PATH."""
    m = load_script("mutation")
    monkeypatch.setattr(m, "ROOT", _repo(tmp_path / "repo"))
    monkeypatch.setattr(m, "OUT", tmp_path / "out")
    monkeypatch.setattr(m, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(m, "MODULES", {"mod": ("pkg/mod.py", "", ["tests/test_mod.py", "tests/test_gone.py"])})
    monkeypatch.setattr(m, "UNWRAPPED", {})
    monkeypatch.setattr(m, "DESELECT", {})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mutmut").write_text(FAKE_MUTMUT)
    (bin_dir / "mutmut").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MUTMUT_LOG", str(tmp_path / "mutmut.log"))
    monkeypatch.setenv("FAKE_MUTMUT_RESULTS", str(tmp_path / "listing.txt"))
    for name in ("FAKE_MUTMUT_SLEEP", "FAKE_MUTMUT_ENV", "FAKE_MUTMUT_OUT", "FAKE_MUTMUT_RC"):
        monkeypatch.delenv(name, raising=False)
    return m


def _stamp(root: Path, tests: list[str]) -> str:
    module_hash = hashlib.sha256((root / "pkg" / "mod.py").read_bytes()).hexdigest()
    tests_hash = hashlib.sha256("".join(tests).encode() + b"".join((root / t).read_bytes() for t in tests)).hexdigest()
    return f"{module_hash} {tests_hash}"


def _meta(work: Path, codes: dict) -> Path:
    meta = work / "mutants" / "pkg" / "mod.py.meta"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {"pkg.mod.x_f__mutmut_1": 0.5}}))
    return meta


def test_the_scratch_copy_holds_tracked_and_untracked_files_but_not_ignored_or_deleted_ones(
    mm: ModuleType, tmp_path: Path
) -> None:
    """_copy_repo copies what a CI checkout has (nested directories made); a tracked file deleted from the work tree
    and an ignored file are not copied (and do not stop the copy)."""
    root = mm.ROOT
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "deep.txt").write_text("deep")
    (root / "gone.txt").write_text("gone")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "more")
    (root / "gone.txt").unlink()  # tracked, deleted from the work tree
    (root / "new.txt").write_text("untracked")
    (root / "run.log").write_text("ignored")
    dest = tmp_path / "copy"
    dest.mkdir()
    mm._copy_repo(dest)
    assert (dest / "a" / "b" / "deep.txt").read_text() == "deep"
    assert (dest / "pkg" / "mod.py").read_text() == MODULE
    assert (dest / "new.txt").read_text() == "untracked"
    assert not (dest / "gone.txt").exists() and not (dest / "run.log").exists()


def test_resetting_the_unkilled_mutants_forgets_survivors_and_keeps_kills_and_timeouts(
    mm: ModuleType, tmp_path: Path
) -> None:
    """_reset_unkilled rewrites each .meta file: a killed or timed-out mutant keeps its exit code (tests are only
    added), every other verdict is forgotten (None: tested again); the file's other data stays."""
    codes = {"killed": 1, "timeout": 36, "survived": 0, "no_tests": 5, "unchecked": None}
    meta = _meta(tmp_path / "work", {f"pkg.mod.x_f__mutmut_{k}": v for k, v in codes.items()})
    mm._reset_unkilled(tmp_path / "work")
    data = json.loads(meta.read_text())
    assert data["exit_code_by_key"] == {
        "pkg.mod.x_f__mutmut_killed": 1,
        "pkg.mod.x_f__mutmut_timeout": 36,
        "pkg.mod.x_f__mutmut_survived": None,
        "pkg.mod.x_f__mutmut_no_tests": None,
        "pkg.mod.x_f__mutmut_unchecked": None,
    }
    assert data["durations_by_key"] == {"pkg.mod.x_f__mutmut_1": 0.5}


def test_a_changed_module_rebuilds_the_scratch_copy_from_scratch(mm: ModuleType) -> None:
    """A scratch copy stamped with another module hash is deleted and copied afresh: its stale files go, the copy
    gets the [tool.mutmut] table (the module, its existing test files only) and the new stamp."""
    work = mm.SCRATCH / "mod"
    (work / "pkg").mkdir(parents=True)
    (work / "stale.txt").write_text("from an older module")
    (work / "pkg" / "mod.py").write_text("def f(x):\n    return 0\n")
    (work / ".lragent_source").write_text("0ld 0ld")
    result = mm.run_module("mod", 1, 60)
    assert not (work / "stale.txt").exists()
    assert (work / "pkg" / "mod.py").read_text() == MODULE
    assert (work / "tests" / "test_mod.py").read_text() == TESTS
    config = (work / "pyproject.toml").read_text()
    assert config.startswith('[project]\nname = "x"\n\n[tool.mutmut]\n')
    assert 'only_mutate = ["pkg/mod.py"]' in config
    assert 'pytest_add_cli_args_test_selection = ["tests/test_mod.py"]' in config  # tests/test_gone.py: no file
    assert result["tests"] == ["tests/test_mod.py"]
    assert (work / ".lragent_source").read_text() == _stamp(mm.ROOT, ["tests/test_mod.py"])
    assert (mm.ROOT / "pkg" / "mod.py").read_text() == MODULE  # the repository's copy untouched


def test_the_unwrapped_functions_are_marked_no_mutate_in_the_scratch_copy_only(mm: ModuleType) -> None:
    """A function of UNWRAPPED gets ``# pragma: no mutate block`` on its header's last line (the colon) in the
    scratch copy; the repository's module stays clean."""
    mm.UNWRAPPED["mod"] = ["def f("]
    mm.run_module("mod", 1, 60)
    assert (mm.SCRATCH / "mod" / "pkg" / "mod.py").read_text() == MODULE.replace(
        "):\n", "):  # pragma: no mutate block\n"
    )
    assert (mm.ROOT / "pkg" / "mod.py").read_text() == MODULE


def test_changed_tests_are_brought_in_and_only_the_unkilled_mutants_reset(mm: ModuleType) -> None:
    """Same module, changed tests: the scratch copy is kept (not rebuilt), the new test file replaces the old one in
    the copy and in mutmut's mutants/ tree, survivors are reset, kills kept, and the stamp names the new tests."""
    work = mm.SCRATCH / "mod"
    mm.run_module("mod", 1, 60)
    (work / "kept.txt").write_text("mutmut's cache")
    meta = _meta(work, {"pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_2": 0})
    new_tests = TESTS + "\n\ndef test_f_again():\n    assert f(2) == 2\n"
    (mm.ROOT / "tests" / "test_mod.py").write_text(new_tests)
    mm.run_module("mod", 1, 60)
    assert (work / "kept.txt").read_text() == "mutmut's cache"
    assert (work / "tests" / "test_mod.py").read_text() == new_tests
    assert (work / "mutants" / "tests" / "test_mod.py").read_text() == new_tests
    assert json.loads(meta.read_text())["exit_code_by_key"] == {
        "pkg.mod.x_f__mutmut_1": 1,
        "pkg.mod.x_f__mutmut_2": None,
    }
    assert (work / ".lragent_source").read_text() == _stamp(mm.ROOT, ["tests/test_mod.py"])


def test_a_rerun_with_nothing_changed_resumes_on_the_kept_scratch_copy(mm: ModuleType, tmp_path: Path) -> None:
    """Same module and tests: nothing is copied or reset (mutmut's cache and verdicts resume as they were); mutmut
    runs again on the same copy."""
    work = mm.SCRATCH / "mod"
    mm.run_module("mod", 1, 60)
    (work / "kept.txt").write_text("mutmut's cache")
    meta = _meta(work, {"pkg.mod.x_f__mutmut_1": 1, "pkg.mod.x_f__mutmut_2": 0})
    before = meta.read_text()
    mm.run_module("mod", 1, 60)
    assert (work / "kept.txt").read_text() == "mutmut's cache"
    assert meta.read_text() == before
    runs = [ln for ln in (tmp_path / "mutmut.log").read_text().splitlines() if ln.startswith("run ")]
    assert runs == ["run --max-children 1"] * 2


def test_a_run_stopped_by_its_timeout_is_recorded_incomplete_and_resumable(
    mm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mutmut run that outlives the timeout is stopped; the result says so (not complete, log_tail says rerun to
    resume) and is written; the scratch copy and its stamp stay for the rerun."""
    monkeypatch.setenv("FAKE_MUTMUT_SLEEP", "30")
    result = mm.run_module("mod", 1, 1)
    assert result["complete"] is False
    assert result["log_tail"] == "stopped after 1 s (rerun to resume)"
    assert json.loads((mm.OUT / "mod.json").read_text())["log_tail"] == "stopped after 1 s (rerun to resume)"
    assert (mm.SCRATCH / "mod" / ".lragent_source").read_text() == _stamp(mm.ROOT, ["tests/test_mod.py"])


def test_a_pattern_keeps_only_its_mutants_and_the_result_file_is_written(mm: ModuleType, tmp_path: Path) -> None:
    """With a mutant-name pattern mutmut runs only those and the result counts only those; a mutant marked
    equivalent is left out of the score and the survivors; results/mutation/KEY.json holds the result."""
    mm.MODULES["mod"] = ("pkg/mod.py", "pkg.mod.*loss*", ["tests/test_mod.py"])
    (tmp_path / "listing.txt").write_text(
        "    pkg.mod.x_loss__mutmut_1: killed\n"
        "    pkg.mod.x_loss__mutmut_2: survived\n"
        "    pkg.mod.x_loss__mutmut_3: survived\n"
        "    pkg.mod.x_other__mutmut_1: survived\n"
        "    pkgXmod.x_loss__mutmut_9: survived\n"  # the pattern's dots are dots, not any character
    )
    (mm.OUT / "equivalent").mkdir(parents=True)
    (mm.OUT / "equivalent" / "mod.json").write_text(json.dumps({"pkg.mod.x_loss__mutmut_3": "same value"}))
    result = mm.run_module("mod", 1, 60)
    assert result["counts"] == {"killed": 1, "survived": 2}
    assert result["equivalent"] == {"pkg.mod.x_loss__mutmut_3": "same value"}
    assert result["score"] == 50.0 and result["considered"] == 2
    assert result["survivors"] == [
        {"mutant": "pkg.mod.x_loss__mutmut_2", "status": "survived", "diff": "-    return x\n+    return None"}
    ]
    assert json.loads((mm.OUT / "mod.json").read_text()) == result
    assert "run --max-children 1 pkg.mod.*loss*" in (tmp_path / "mutmut.log").read_text().splitlines()


def test_the_report_lists_a_module_not_run_yet_next_to_one_that_ran(mm: ModuleType) -> None:
    """write_report writes results/mutation/README.md with a row per module: ``not run yet`` where there is no
    KEY.json, the score and counts where there is."""
    mm.MODULES["other"] = ("pkg/other.py", "", [])
    mm.OUT.mkdir(parents=True)
    result = {
        "module": "pkg/mod.py", "pattern": None, "counts": {"killed": 3, "survived": 1}, "equivalent": {},
        "killed_or_timeout": 3, "considered": 4, "score": 75.0, "survivors": [{}], "complete": True,
        "seconds": 12.0, "workers": 2, "host_cpus": 2, "commit": "abcdef0123",
    }  # fmt: skip
    (mm.OUT / "mod.json").write_text(json.dumps(result))
    path = mm.write_report()
    assert path == mm.OUT / "README.md"
    rows = [ln for ln in path.read_text().splitlines() if ln.startswith("| `")]
    assert rows == [
        "| `pkg/mod.py` | 75.0% | 3 of 4 | 0 | 1 | "
        "complete, 12 s on 2 workers (2 CPUs), abcdef0; killed 3, survived 1 |",
        "| `pkg/other.py` | not run yet | | | | |",
    ]


def test_the_report_names_every_module_of_the_packages_without_a_score_and_why(mm: ModuleType) -> None:
    """Below the table, every module of PACKAGES that no MODULES entry covers: with its LEFT_OUT reason, or ``not run
    yet`` (a package's __init__.py is not a module to score)."""
    for name in ("slow", "new", "__init__"):
        (mm.ROOT / "pkg" / f"{name}.py").write_text("X = 1\n")
    mm.PACKAGES = ["pkg"]
    mm.LEFT_OUT = {"pkg/slow.py": "times a GPU"}
    mm.OUT.mkdir(parents=True)
    assert mm.unscored_modules() == [("pkg/new.py", "not run yet"), ("pkg/slow.py", "times a GPU")]
    text = mm.write_report().read_text()
    assert "## Not scored (2 modules)" in text
    assert text.endswith("| `pkg/new.py` | not run yet |\n| `pkg/slow.py` | times a GPU |\n")


def test_every_module_left_out_of_mutation_testing_exists() -> None:
    """A LEFT_OUT entry names a module of the repository (one renamed or moved would keep a reason for nothing)."""
    m = load_script("mutation")
    missing = [path for path in m.LEFT_OUT if not (m.ROOT / path).is_file()]
    assert not missing, missing


def test_a_name_that_matches_no_module_is_refused_naming_the_allowed_ones(mm: ModuleType) -> None:
    """mutation() with names matching no key raises one line listing the keys, and writes nothing."""
    mm.MODULES["other"] = ("pkg/other.py", "", [])
    with pytest.raises(ValueError, match=r"^no module matches \['nosuch'\]; allowed: mod, other$"):
        mm.mutation(["nosuch"])
    assert not mm.OUT.exists() and not mm.SCRATCH.exists()


def test_a_missing_mutmut_is_refused_with_how_to_install_it(
    mm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without mutmut on PATH, mutation() raises one line saying how to install it, before any scratch copy or
    result is made."""
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"^mutmut is not installed: pip install mutmut==3\.8\.1$"):
        mm.mutation(["mod"])
    assert not mm.OUT.exists() and not mm.SCRATCH.exists()


def test_a_module_whose_mutants_no_test_reaches_is_reported_as_none_checked_not_as_incomplete(mm: ModuleType) -> None:
    """A run that mutmut stopped because no test reached its mutants (it cannot trace calls into a property or a
    decorator's nested function) is reported as checking none, with why, instead of as an interrupted run."""
    mm.OUT.mkdir(parents=True)
    result = {
        "module": "pkg/mod.py", "pattern": None, "counts": {}, "equivalent": {}, "killed_or_timeout": 0,
        "considered": 0, "score": None, "survivors": [], "complete": False, "seconds": 9.0, "workers": 1,
        "host_cpus": 2, "commit": "abcdef0123", "log_tail": f"...\nStopping early, because we {mm.UNREACHED}.\n",
    }  # fmt: skip
    (mm.OUT / "mod.json").write_text(json.dumps(result))
    row = next(ln for ln in mm.write_report().read_text().splitlines() if ln.startswith("| `pkg/mod.py`"))
    assert row.startswith("| `pkg/mod.py` | no mutant checked | | | | mutmut generated mutants but found no test")
    assert row.endswith("abcdef0 |")
    result["log_tail"] = "killed by its timeout"  # a run cut short before any count stays an interrupted run
    (mm.OUT / "mod.json").write_text(json.dumps(result))
    row = next(ln for ln in mm.write_report().read_text().splitlines() if ln.startswith("| `pkg/mod.py`"))
    assert row.startswith("| `pkg/mod.py` | incomplete (0 of 0 checked) |")


def test_the_committed_report_is_what_the_committed_results_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_report over the repository's own results/mutation/*.json (in a copy) gives results/mutation/README.md
    byte for byte: every row, the not-run and left-out tables, the header (a report edited by hand, or results
    committed without their report, fail here)."""
    import shutil

    m = load_script("mutation")
    out = tmp_path / "mutation"
    shutil.copytree(m.ROOT / "results" / "mutation", out)
    (out / "README.md").unlink()
    monkeypatch.setattr(m, "OUT", out)
    assert m.write_report() == out / "README.md"
    assert (out / "README.md").read_text() == (m.ROOT / "results" / "mutation" / "README.md").read_text()


def test_the_mutmut_configuration_of_a_module(tmp_path: Path) -> None:
    """The [tool.mutmut] table: the packages as sources, one module mutated, the copies its tests read, the test files,
    pytest in one process with the deselected tests, and a timeout multiplier only where one is set."""
    m = load_script("mutation")
    pkgs = '["lragent", "eval_suite", "datamodules", "lit_modules", "kernels", "scripts"]'
    also = '["cli.py", "configs", "data", "docs", "README.md", "results/mutation"]'
    assert m._config("pkg/a.py", ["tests/test_a.py", "tests/test_b.py"], ["tests/test_a.py::slow"], 3.0) == (
        f'\n[tool.mutmut]\nsource_paths = {pkgs}\nonly_mutate = ["pkg/a.py"]\nalso_copy = {also}\n'
        'pytest_add_cli_args_test_selection = ["tests/test_a.py", "tests/test_b.py"]\n'
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-n", "0", "--deselect", "tests/test_a.py::slow"]\n'
        "timeout_multiplier = 3.0\n"
    )
    assert m._config("pkg/a.py", []).endswith('pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-n", "0"]\n')


def _head(repo: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def test_a_whole_run_is_recorded_field_by_field_from_mutmuts_own_verdicts(
    mm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run with every verdict mutmut gives: the counts, the equivalents (a killed mutant listed as equivalent stays
    a kill), the score to one decimal, the survivors sorted with their diffs, the seconds, the commit read in the
    repository (not in the caller's directory), the tool's version; the JSON file written with one-space indent; the
    stamp over both test files; the deselected tests and the timeout multiplier in the copy's table; every mutmut
    call made in the scratch copy with it first on PYTHONPATH and one OpenMP/MKL thread; a finished run's output not
    kept."""
    (mm.ROOT / "tests" / "test_more.py").write_text("def test_more():\n    assert True\n")
    _git(mm.ROOT, "add", "-A")
    _git(mm.ROOT, "commit", "-qm", "more")
    tests = ["tests/test_mod.py", "tests/test_more.py"]
    mm.MODULES["mod"] = ("pkg/mod.py", "", tests)
    monkeypatch.setattr(mm, "DESELECT", {"mod": ["tests/test_more.py::test_more"]})
    monkeypatch.setattr(mm, "TIMEOUT_MULTIPLIER", {"mod": 4.0})
    clock = iter([100.0, 112.345])
    monkeypatch.setattr(mm, "time", SimpleNamespace(time=lambda: next(clock)))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    monkeypatch.setenv("FAKE_MUTMUT_ENV", str(tmp_path / "env.log"))
    (tmp_path / "run_output.txt").write_text("mutmut's progress\n")
    monkeypatch.setenv("FAKE_MUTMUT_OUT", str(tmp_path / "run_output.txt"))
    verdicts = ["killed", "timeout", "survived", "skipped", "no tests", "survived", "killed", "survived", "suspicious"]
    (tmp_path / "listing.txt").write_text(
        "".join(f"    pkg.mod.x_f__mutmut_{i}: {v}\n" for i, v in enumerate(verdicts, 1))
    )
    (mm.OUT / "equivalent").mkdir(parents=True)
    (mm.OUT / "equivalent" / "mod.json").write_text(
        json.dumps({"pkg.mod.x_f__mutmut_6": "same value", "pkg.mod.x_f__mutmut_7": "thought equivalent, killed"})
    )
    monkeypatch.chdir(tmp_path)  # no repository here: the commit must be read in ROOT
    result = mm.run_module("mod", 3, 60)
    diff = "-    return x\n+    return None"
    assert result == {
        "module": "pkg/mod.py",
        "pattern": None,
        "tests": tests,
        "counts": {"killed": 2, "timeout": 1, "survived": 3, "skipped": 1, "no tests": 1, "suspicious": 1},
        "equivalent": {"pkg.mod.x_f__mutmut_6": "same value"},
        "killed_or_timeout": 3,
        "considered": 7,
        "score": 42.9,
        "survivors": [
            {"mutant": f"pkg.mod.x_f__mutmut_{i}", "status": verdicts[i - 1], "diff": diff} for i in (3, 5, 8, 9)
        ],
        "complete": True,
        "seconds": 12.3,
        "workers": 3,
        "tool": f"mutmut {importlib.metadata.version('mutmut')}",
        "commit": _head(mm.ROOT),
        "host_cpus": os.cpu_count(),
        "log_tail": "",
    }
    assert (mm.OUT / "mod.json").read_text() == json.dumps(result, indent=1) + "\n"
    work = mm.SCRATCH / "mod"
    assert (work / ".lragent_source").read_text() == _stamp(mm.ROOT, tests)
    config = (work / "pyproject.toml").read_text()
    assert '"--deselect", "tests/test_more.py::test_more"]\n' in config
    assert config.endswith("timeout_multiplier = 4.0\n")
    calls = (tmp_path / "env.log").read_text().splitlines()
    where = f"cwd={work.resolve()} PYTHONPATH={work} OMP=1 MKL=1"
    assert calls == [f"run {where}", f"results {where}"] + [f"show {where}"] * 4
    assert "results --all true" in (tmp_path / "mutmut.log").read_text().splitlines()


def test_the_result_folder_is_made_with_its_parents(mm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """results/mutation and the folders above it are made when missing (a fresh checkout's first run)."""
    monkeypatch.setattr(mm, "OUT", mm.OUT / "results" / "mutation")
    mm.run_module("mod", 1, 60)
    assert json.loads((mm.OUT / "mod.json").read_text())["module"] == "pkg/mod.py"


def test_a_run_that_fails_keeps_the_end_of_its_output_and_is_incomplete(
    mm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mutmut exiting non-zero: the result is not complete and keeps the last 2,000 characters of its stdout then
    stderr, as text."""
    out = "".join(f"line {i}\n" for i in range(500))
    (tmp_path / "run_output.txt").write_text(out)
    monkeypatch.setenv("FAKE_MUTMUT_OUT", str(tmp_path / "run_output.txt"))
    monkeypatch.setenv("FAKE_MUTMUT_RC", "1")
    (tmp_path / "listing.txt").write_text("    pkg.mod.x_f__mutmut_1: killed\n")
    result = mm.run_module("mod", 1, 60)
    assert result["complete"] is False
    assert result["log_tail"] == (out + "on stderr")[-2000:]
    assert json.loads((mm.OUT / "mod.json").read_text())["log_tail"] == result["log_tail"]


def test_unchecked_mutants_make_the_run_incomplete_and_are_neither_scored_nor_listed(
    mm: ModuleType, tmp_path: Path
) -> None:
    """A mutant mutmut has not checked yet is counted (the run is incomplete) but is in neither the score nor the
    survivors."""
    (tmp_path / "listing.txt").write_text(
        "    pkg.mod.x_f__mutmut_1: killed\n"
        "    pkg.mod.x_f__mutmut_2: not checked\n"
        "    pkg.mod.x_f__mutmut_3: survived\n"
    )
    result = mm.run_module("mod", 1, 60)
    assert result["counts"] == {"killed": 1, "not checked": 1, "survived": 1}
    assert (result["considered"], result["killed_or_timeout"], result["score"]) == (2, 1, 50.0)
    assert [s["mutant"] for s in result["survivors"]] == ["pkg.mod.x_f__mutmut_3"]
    assert result["complete"] is False and result["log_tail"] == ""


def test_a_new_test_file_in_new_folders_is_brought_into_the_copy_and_its_mutants_tree(mm: ModuleType) -> None:
    """A test file added under folders the scratch copy lacks is copied there and into mutants/ (folders made)."""
    mm.run_module("mod", 1, 60)
    deep = mm.ROOT / "tests" / "deep" / "er" / "test_deep.py"
    deep.parent.mkdir(parents=True)
    deep.write_text("def test_deep():\n    assert True\n")
    mm.MODULES["mod"] = ("pkg/mod.py", "", ["tests/test_mod.py", "tests/deep/er/test_deep.py"])
    mm.run_module("mod", 1, 60)
    work = mm.SCRATCH / "mod"
    for dest in (work / "tests/deep/er/test_deep.py", work / "mutants/tests/deep/er/test_deep.py"):
        assert dest.read_text() == deep.read_text()


def test_an_unwrapped_function_is_found_by_its_whole_header_line_after_other_functions(mm: ModuleType) -> None:
    """The pragma goes on the named function's own header colon, not on an earlier function's, nor on a line that
    merely starts the same way."""
    module = "def g(\n    y,\n):\n    return y\n\n\ndef f(x):\n    return x\n\n\ndef f(\n    x,\n):\n    return x\n"
    (mm.ROOT / "pkg" / "mod.py").write_text(module)
    mm.UNWRAPPED["mod"] = ["def f("]
    mm.run_module("mod", 1, 60)
    marked = (mm.SCRATCH / "mod" / "pkg" / "mod.py").read_text()
    assert marked == module.replace("def f(\n    x,\n):\n", "def f(\n    x,\n):  # pragma: no mutate block\n")


def test_a_meta_file_without_verdicts_is_left_as_it_is(mm: ModuleType, tmp_path: Path) -> None:
    """_reset_unkilled on a .meta file that holds no verdicts yet (mutmut wrote only durations) changes nothing."""
    meta = tmp_path / "work" / "mutants" / "pkg" / "mod.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"durations_by_key": {"pkg.mod.x_f__mutmut_1": 0.5}}))
    mm._reset_unkilled(tmp_path / "work")
    assert json.loads(meta.read_text()) == {"durations_by_key": {"pkg.mod.x_f__mutmut_1": 0.5}}


def test_the_report_rows_for_each_kind_of_result_in_order(mm: ModuleType) -> None:
    """A module not run, one whose mutants no test reached, an interrupted run (checked = all but the unchecked) and
    a result written before log_tail existed: one row each, in MODULES' order (none stops the table)."""
    mm.MODULES.clear()
    mm.MODULES.update({k: (f"pkg/{k}.py", "", []) for k in ("a", "b", "c", "d")})
    mm.OUT.mkdir(parents=True)
    base = {
        "pattern": None, "equivalent": {}, "killed_or_timeout": 3, "considered": 4, "score": 75.0,
        "survivors": [{}], "seconds": 12.0, "workers": 2, "host_cpus": 2, "commit": "abcdef0123",
    }  # fmt: skip
    (mm.OUT / "b.json").write_text(
        json.dumps({**base, "module": "pkg/b.py", "counts": {}, "complete": False, "log_tail": mm.UNREACHED})
    )
    counts = {"killed": 3, "survived": 1, "not checked": 2}
    (mm.OUT / "c.json").write_text(json.dumps({**base, "module": "pkg/c.py", "counts": counts, "complete": False}))
    (mm.OUT / "d.json").write_text(json.dumps({**base, "module": "pkg/d.py", "counts": {}, "complete": True}))
    rows = [ln for ln in mm.write_report().read_text().splitlines() if ln.startswith("| `")]
    assert rows[0] == "| `pkg/a.py` | not run yet | | | | |"
    assert rows[1].startswith("| `pkg/b.py` | no mutant checked | |")
    assert rows[2] == (
        "| `pkg/c.py` | incomplete (4 of 6 checked) | 3 of 4 | 0 | 1 | interrupted, 12 s on 2 workers (2 CPUs), "
        "abcdef0; killed 3, not checked 2, survived 1 |"
    )
    assert rows[3] == "| `pkg/d.py` | 75.0% | 3 of 4 | 0 | 1 | complete, 12 s on 2 workers (2 CPUs), abcdef0;  |"
    assert len(rows) == 4


def test_listing_the_modules_by_part_of_a_key_or_by_whole_keys(mm: ModuleType, capsys: pytest.CaptureFixture) -> None:
    """--list prints key, module and test files, one line each; a name matches every key containing it unless
    ``exact``."""
    mm.MODULES.clear()
    mm.MODULES.update({"sim": ("pkg/sim.py", "", ["tests/a.py", "tests/b.py"]), "sim_report": ("pkg/r.py", "", [])})
    assert mm.mutation(["sim"], list=True) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{'sim':24s} {'pkg/sim.py':36s} tests/a.py tests/b.py", f"{'sim_report':24s} {'pkg/r.py':36s} "]
    assert mm.mutation(["sim"], list=True, exact=True) == 0
    assert capsys.readouterr().out.splitlines() == [lines[0]]
    assert mm.mutation(["report"], list=True) == 0
    assert capsys.readouterr().out.splitlines() == [lines[1]]
    assert not mm.SCRATCH.exists()


def test_running_modules_prints_each_score_then_the_report(
    mm: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Each module's line (score, killed of considered, survivors left), then the report's path; exit 0; mutmut is
    found on PATH under its own name."""
    mm.MODULES["mod2"] = ("pkg/mod.py", "", ["tests/test_mod.py"])
    (tmp_path / "listing.txt").write_text("    pkg.mod.x_f__mutmut_1: killed\n    pkg.mod.x_f__mutmut_2: survived\n")
    assert mm.mutation(["mod"], workers=2) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mod: 50.0% (1 of 2), 1 left",
        "mod2: 50.0% (1 of 2), 1 left",
        str(mm.OUT / "README.md"),
    ]
    assert (mm.OUT / "mod2.json").is_file() and (mm.OUT / "README.md").is_file()


def test_the_workers_and_the_timeout_reach_mutmut(
    mm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mutation(workers=3, timeout=1): mutmut runs with --max-children 3 and is stopped after 1 s."""
    monkeypatch.setenv("FAKE_MUTMUT_SLEEP", "30")
    assert mm.mutation(["mod"], workers=3, timeout=1) == 0
    assert "run --max-children 3" in (tmp_path / "mutmut.log").read_text().splitlines()
    assert json.loads((mm.OUT / "mod.json").read_text())["log_tail"] == "stopped after 1 s (rerun to resume)"


def test_a_module_whose_tests_fail_unmutated_is_named_and_the_others_still_run(
    mm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """mutmut cannot start where a selected test fails on the unmutated code: one error line per such module, the
    next module still runs, the report is written, exit 2."""
    mm.MODULES["mod2"] = ("pkg/mod.py", "", ["tests/test_mod.py"])
    (tmp_path / "run_output.txt").write_text("failed to collect stats\n")
    monkeypatch.setenv("FAKE_MUTMUT_OUT", str(tmp_path / "run_output.txt"))
    monkeypatch.setenv("FAKE_MUTMUT_RC", "1")
    assert mm.mutation(["mod"]) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [
        f"error: {k}: a selected test fails on the unmutated code (mutmut cannot start): see the end of "
        f"results/mutation/{k}.json's log_tail"
        for k in ("mod", "mod2")
    ]
    assert out.out.splitlines() == [str(mm.OUT / "README.md")]


@pytest.fixture
def run_calls(mm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """run_module's arguments, one tuple a call, for a run_module that answers at once with a finished module."""
    calls: list[tuple] = []
    done = {"log_tail": "", "score": 100.0, "killed_or_timeout": 1, "considered": 1, "survivors": []}
    monkeypatch.setattr(mm, "run_module", lambda *args: calls.append(args) or done)
    return calls


def test_the_command_line_takes_module_names_first_and_its_defaults(
    mm: ModuleType, capsys: pytest.CaptureFixture, run_calls: list[tuple]
) -> None:
    """``scripts/mutation.py NAME ...``: the names come first, before options; --help names the script; by default
    every core works and a module may take an hour."""
    assert mm.main(["mod", "--list", "true"]) == 0
    assert capsys.readouterr().out.startswith("mod ")
    with pytest.raises(SystemExit) as stop:
        mm.main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: scripts/mutation.py")
    assert run_calls == []  # --list and --help run no module
    assert mm.main(["mod"]) == 0
    assert run_calls == [("mod", os.cpu_count(), 3600)]


def test_called_from_python_every_core_works_and_a_module_may_take_an_hour(
    mm: ModuleType, run_calls: list[tuple]
) -> None:
    """mutation(names) without options: run_module gets os.cpu_count() workers and 3,600 s."""
    assert mm.mutation(["mod"]) == 0
    assert run_calls == [("mod", os.cpu_count(), 3600)]


def test_the_report_is_written_where_no_results_folder_exists_yet(
    mm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_report on a fresh checkout (no results/mutation, no results/): the folders are made, the table says
    not run yet."""
    monkeypatch.setattr(mm, "OUT", mm.OUT / "results" / "mutation")
    assert mm.write_report().read_text().count("| not run yet |") == 1
