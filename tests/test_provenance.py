"""Provenance: the commit a result names when the checkout's ``.git`` cannot be trusted (a copy sent to a GPU)."""

from __future__ import annotations

import pytest

from lragent import provenance as prov


@pytest.mark.parametrize("var", ["LRAGENT_GIT_COMMIT", "LRAGENT_COMMIT"])
def test_commit_handed_over_in_the_environment_wins(monkeypatch, var: str) -> None:
    """The GPU machine's copy carried a stale ``.git`` (it named the session's first commit for code two commits
    later): a commit handed over by the sender, under either name, is the one recorded."""
    monkeypatch.delenv("LRAGENT_GIT_COMMIT", raising=False)
    monkeypatch.delenv("LRAGENT_COMMIT", raising=False)
    monkeypatch.setenv(var, "0123abc")
    monkeypatch.setenv("LRAGENT_GIT_DIRTY", "1")
    prov._git.cache_clear()
    try:
        rec = prov.provenance(device="cpu")
        assert rec["git_commit"] == "0123abc" and rec["git_dirty"] is True
    finally:
        prov._git.cache_clear()


def test_every_record_names_the_hash_of_the_code_that_ran() -> None:
    """A handed-over commit can be wrong (a call carried a stale ``.commit``); the record's ``source_hash`` is the
    ``sha256sum`` listing's hash of the tree's code (computed here with the shell tools, independently), the one
    ``bash scripts/gpu_tests.sh --hash`` prints, so a record can be matched to a commit; the footer shows it."""
    import subprocess

    def run(cmd: list[str]) -> str:
        return subprocess.run(cmd, cwd=prov.ROOT, capture_output=True, text=True, check=True).stdout.strip()

    prov.source_hash.cache_clear()
    rec = prov.provenance(device="cpu")
    reference = run(["bash", "-c", f"find {' '.join(prov.SOURCE_PATHS)} -name '*.py' -o -name '*.sh' | LC_ALL=C sort "
                                   "| xargs sha256sum | sha256sum | cut -c1-16"])  # fmt: skip
    assert rec["source_hash"] == reference and len(reference) == 16
    assert run(["bash", "scripts/gpu_tests.sh", "--hash"]) == reference
    assert f"source {reference}" in prov.provenance_footer(rec)


def test_the_source_hash_changes_with_any_source_file(tmp_path) -> None:
    """One byte more in one file, or one more file, gives another hash; other files do not count."""
    (tmp_path / "lragent").mkdir()
    (tmp_path / "lragent" / "a.py").write_text("x = 1\n")
    (tmp_path / "cli.py").write_text("")
    first = prov.source_hash.__wrapped__(tmp_path)
    (tmp_path / "lragent" / "notes.md").write_text("not code")
    assert prov.source_hash.__wrapped__(tmp_path) == first
    (tmp_path / "lragent" / "a.py").write_text("x = 1 \n")
    second = prov.source_hash.__wrapped__(tmp_path)
    (tmp_path / "lragent" / "b.sh").write_text("")
    assert len({first, second, prov.source_hash.__wrapped__(tmp_path)}) == 3


def test_a_record_names_the_switches_that_were_set(monkeypatch) -> None:
    """Two runs of one command line that differ by a kernel switch (``LRAGENT_PDL=0``) say so in their records and
    footers; unset or empty switches and other variables are left out."""
    from lragent.provenance import SWITCHES, provenance, provenance_footer, switches

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRAGENT_PDL", "0")
    monkeypatch.setenv("LRAGENT_DECODE_PLAN", "")
    monkeypatch.setenv("LRAGENT_NOT_A_SWITCH", "1")
    assert switches() == {"LRAGENT_PDL": "0"}
    both = {"LRAGENT_FUSED_GEMV": "2", "OMP_NUM_THREADS": "4"}
    assert switches({**both, "PATH": "/bin"}) == both
    cmd = "cli.py bench decode"
    prov = provenance(device="cpu", command=cmd)
    assert prov["switches"] == {"LRAGENT_PDL": "0"}
    assert f"Command: `LRAGENT_PDL=0 {cmd}`" in provenance_footer(prov)
    monkeypatch.delenv("LRAGENT_PDL")
    assert f"Command: `{cmd}`" in provenance_footer(provenance(device="cpu", command=cmd))
