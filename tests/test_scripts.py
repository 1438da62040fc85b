"""scripts/ holds only what a maintainer runs again: at most 12 files, every one in the table of scripts/README.md, and
every one answers --help with its header (exit 0, nothing else done)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file() and p.name != "README.md")


def test_scripts_are_few_and_each_is_in_the_table() -> None:
    files = [p for p in (ROOT / "scripts").iterdir() if p.is_file()]
    assert len(files) <= 13, sorted(p.name for p in files)
    table = (ROOT / "scripts" / "README.md").read_text()
    rows = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert rows == {p.name for p in SCRIPTS}  # no script without a row, no row without a script


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_script_answers_help(script: Path, tmp_path: Path) -> None:
    cmd = ["bash", str(script), "--help"] if script.suffix == ".sh" else [sys.executable, str(script), "--help"]
    # run from elsewhere, with $OUT pointing at an empty folder: --help must neither write nor need the repo's cwd
    env = {"OUT": str(tmp_path / "o"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-1000:]
    words = out.stdout.split()
    assert len(words) >= 8, out.stdout  # a header, not an empty line
    assert not (tmp_path / "o").exists() and not (ROOT / "scripts" / "o").exists()
