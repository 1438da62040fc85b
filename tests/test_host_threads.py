"""The torch thread count of a process whose model runs on a GPU, and ``LRAGENT_PIN_CORES`` (lragent/host_threads.py):
the cap, where it applies, the values the switch takes, and how the cores are shared (tests/test_rank_pinning.py has
the rest of the pinning)."""

from __future__ import annotations

import os

import pytest
import torch

import lragent.host_threads as ht
from lragent.host_threads import GPU_HOST_THREADS, PIN_ENV, host_threads, pin_rank, pin_requested, rank_cpu_share


@pytest.mark.parametrize(
    ("device", "env", "current", "expected"),
    [
        ("cuda", {}, 64, 4),
        ("cuda:1", {"PATH": "/bin"}, 16, 4),
        (torch.device("cuda", 0), {}, 8, 4),  # a torch.device is read by its name
        ("cuda", {}, 5, 4),  # one thread over the cap: capped
        ("cuda", {}, 4, None),  # at the cap: left alone
        ("cuda", {}, 2, None),
        ("cuda", {"OMP_NUM_THREADS": "64"}, 64, None),  # the user's setting holds
        ("cuda", {"OMP_NUM_THREADS": ""}, 64, 4),  # set but empty is no setting
        ("cpu", {}, 64, None),  # a CPU process keeps its pool
        ("mps", {}, 64, None),
        (torch.device("cpu"), {}, 64, None),
    ],
)
def test_a_gpu_process_is_capped_at_gpu_host_threads(device, env, current, expected) -> None:
    assert GPU_HOST_THREADS == 4
    assert host_threads(device, env, current) == expected


def test_the_pin_switch_reads_on_off_and_names_a_bad_value() -> None:
    assert PIN_ENV == "LRAGENT_PIN_CORES"
    assert pin_requested({PIN_ENV: "1"}) is True and pin_requested({PIN_ENV: " 1 "}) is True
    for off in ({}, {PIN_ENV: ""}, {PIN_ENV: "0"}, {PIN_ENV: " 0\n"}, {"OTHER": "1"}):
        assert pin_requested(off) is False, off
    for bad in ("2", "yes", "true"):
        with pytest.raises(ValueError) as err:
            pin_requested({PIN_ENV: f" {bad} "})
        assert str(err.value) == f"{PIN_ENV}={bad!r}: expected 1 (pin each local rank to its share of the cores) or 0"


def test_as_many_cores_as_ranks_gives_each_rank_one_core() -> None:
    smt = {0: (0, 0), 1: (0, 1), 8: (0, 0), 9: (0, 1)}  # two cores, two hyperthreads each
    assert [rank_cpu_share([0, 1, 8, 9], smt, r, 2) for r in range(2)] == [[0, 8], [1, 9]]


def test_cores_are_taken_in_package_order_not_cpu_order() -> None:
    # CPUs 0-1 on package 1, CPUs 2-3 on package 0: rank 0 gets package 0's cores
    core_of = {0: (1, 0), 1: (1, 1), 2: (0, 0), 3: (0, 1)}
    assert [rank_cpu_share([0, 1, 2, 3], core_of, r, 2) for r in range(2)] == [[2, 3], [0, 1]]


def test_pin_rank_reads_and_sets_the_calling_process_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPUs allowed are this process's (pid 0), and this process is pinned to its share of them."""
    asked: list[int] = []
    pinned: list[tuple[int, list[int]]] = []

    def getaffinity(pid: int) -> set[int]:
        asked.append(pid)
        return {0, 1, 2, 3, 4, 5} if pid == 0 else {0, 1}

    monkeypatch.setattr(os, "sched_getaffinity", getaffinity)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append((pid, list(cpus))))
    monkeypatch.setattr(ht, "physical_core", lambda cpu: (0, cpu % 3))  # CPUs n and n + 3 are siblings
    assert pin_rank(1, 3, {PIN_ENV: "1"}) == [1, 4]
    assert asked == [0] and pinned == [(0, [1, 4])]
