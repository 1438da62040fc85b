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
