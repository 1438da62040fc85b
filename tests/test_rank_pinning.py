"""``LRAGENT_PIN_CORES=1``: each local rank of a several-GPU fit on its own contiguous share of the physical cores
(lragent/host_threads.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lragent.host_threads import physical_core, pin_rank, rank_cpu_share

# 16 logical CPUs on 2 packages, 4 cores each, two hyperthreads a core; siblings numbered n and n + 8 (Linux's usual)
SMT = {cpu: (cpu % 8 // 4, cpu % 4) for cpu in range(16)}


def test_shares_are_disjoint_whole_cores_covering_every_allowed_cpu() -> None:
    shares = [rank_cpu_share(range(16), SMT, r, 4) for r in range(4)]
    assert shares == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    for share in shares:  # siblings together: a share holds both threads of each of its cores
        assert {SMT[c] for c in share} == {SMT[c] for c in share if c < 8}
    # 8 cores over 3 ranks: 2, 3, 3 (no core split, none left out)
    shares = [rank_cpu_share(range(16), SMT, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [4, 6, 6] and sorted(sum(shares, [])) == list(range(16))


def test_a_restricted_cpuset_is_shared_not_left() -> None:
    allowed = [2, 3, 5, 10, 11, 13]  # a container's cpuset: cores (0,2), (0,3), (1,1), hyperthreads of each
    shares = [rank_cpu_share(allowed, SMT, r, 2) for r in range(2)]
    assert shares == [[2, 10], [3, 5, 11, 13]] and sorted(sum(shares, [])) == sorted(allowed)


def test_fewer_cores_than_ranks_leaves_every_rank_all_cpus() -> None:
    assert rank_cpu_share([0, 8], SMT, 1, 2) == [0, 8]


def test_a_rank_outside_the_ranks_is_named() -> None:
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 local ranks"):
        rank_cpu_share(range(16), SMT, 4, 4)


def test_physical_core_reads_sysfs_and_falls_back(tmp_path: Path) -> None:
    top = tmp_path / "cpu3" / "topology"
    top.mkdir(parents=True)
    (top / "physical_package_id").write_text("1\n")
    (top / "core_id").write_text("7\n")
    assert physical_core(3, tmp_path) == (1, 7)
    assert physical_core(4, tmp_path) == (0, 4)  # no topology: each CPU its own core


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_pin_rank_only_when_asked_and_names_a_bad_value() -> None:
    before = os.sched_getaffinity(0)
    try:
        assert pin_rank(0, 2, {}) is None and pin_rank(0, 2, {"LRAGENT_PIN_CORES": "0"}) is None
        assert pin_rank(0, 1, {"LRAGENT_PIN_CORES": "1"}) is None  # one rank: nothing to keep apart
        assert os.sched_getaffinity(0) == before
        with pytest.raises(ValueError, match=r"LRAGENT_PIN_CORES='yes': expected 1"):
            pin_rank(0, 2, {"LRAGENT_PIN_CORES": "yes"})
        share = pin_rank(1, 2, {"LRAGENT_PIN_CORES": "1"})
        core = {c: physical_core(c) for c in before}
        assert share == rank_cpu_share(sorted(before), core, 1, 2) and os.sched_getaffinity(0) == set(share)
    finally:
        os.sched_setaffinity(0, before)


def test_a_fit_pins_its_local_rank_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """MultiLoraModule.setup("fit") hands its trainer's local rank and device count to pin_rank under
    LRAGENT_PIN_CORES=1, and does not call it otherwise (nor for validate)."""
    from types import SimpleNamespace

    from test_training_recipe import module

    import lit_modules.multi_lora_module as mlm

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(mlm, "pin_rank", lambda rank, ranks, env: calls.append((rank, ranks)) or [0])
    m = module()
    m._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), datamodule=None,
                                 local_rank=1, num_devices=2)  # fmt: skip
    monkeypatch.delenv("LRAGENT_PIN_CORES", raising=False)
    m.setup("fit")
    monkeypatch.setenv("LRAGENT_PIN_CORES", "0")
    m.setup("fit")
    assert calls == []
    monkeypatch.setenv("LRAGENT_PIN_CORES", "1")
    m.setup("validate")
    assert calls == []
    m.setup("fit")
    assert calls == [(1, 2)]
