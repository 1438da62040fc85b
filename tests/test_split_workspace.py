"""The split kernels' cached workspaces (kernels/split_workspace.py): one fp32 workspace and zeroed int32 counters per
key and device, an owner's own set inside :func:`workspace_owner`, dropped with the owner, and the counters zeroed by
the first eager call after a CUDA-graph capture allocated them (the capture, which a CPU cannot run, through a
stand-in for torch.cuda's capture flag and CUDA allocations made on the CPU)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kernels.split_workspace as sw
from kernels.split_workspace import split_workspace, workspace_owner

CPU = torch.device("cpu")


class Owner:
    """An engine stand-in: any object that takes weak references."""


@pytest.fixture(autouse=True)
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no workspace made (none left by another test, or by an earlier run in this process)."""
    monkeypatch.setattr(sw, "_SHARED", {})
    monkeypatch.setattr(sw, "_BY_OWNER", weakref.WeakKeyDictionary())


def test_a_key_gets_its_buffers_once_with_the_sizes_asked() -> None:
    ws, cnt = split_workspace(("sw-test", 1), 12, 5, CPU)
    assert ws.dtype == torch.float32 and ws.shape == (12,) and ws.device == CPU
    assert cnt.dtype == torch.int32 and torch.equal(cnt, torch.zeros(5, dtype=torch.int32))
    assert sw._SHARED[(CPU, "sw-test", 1)] == [ws, cnt, False]
    again = split_workspace(("sw-test", 1), 12, 5, CPU)
    assert again[0] is ws and again[1] is cnt
    other = split_workspace(("sw-test", 2), 3, 2, CPU)
    assert other[0] is not ws and other[0].shape == (3,) and other[1].shape == (2,)


def test_each_device_has_its_own_buffers() -> None:
    meta = torch.device("meta")
    ws_cpu, _ = split_workspace(("sw-test", "dev"), 4, 1, CPU)
    ws_meta, cnt_meta = split_workspace(("sw-test", "dev"), 4, 1, meta)
    assert ws_meta.device == meta and cnt_meta.device == meta and ws_cpu.device == CPU
    assert split_workspace(("sw-test", "dev"), 4, 1, CPU)[0] is ws_cpu


def test_an_owner_has_its_own_buffers_dropped_with_it() -> None:
    shared = split_workspace(("sw-test", "own"), 4, 2, CPU)
    a, b = Owner(), Owner()
    with workspace_owner(a):
        mine = split_workspace(("sw-test", "own"), 4, 2, CPU)
        assert mine[0] is not shared[0] and mine[1] is not shared[1]
        assert split_workspace(("sw-test", "own"), 4, 2, CPU)[0] is mine[0]
        assert sw._BY_OWNER[a] == {(CPU, "sw-test", "own"): [mine[0], mine[1], False]}
        assert (CPU, "sw-test", "own") in sw._SHARED and sw._SHARED[(CPU, "sw-test", "own")][0] is shared[0]
    with workspace_owner(b):
        theirs = split_workspace(("sw-test", "own"), 4, 2, CPU)
        assert theirs[0] is not mine[0] and theirs[0] is not shared[0]
    with workspace_owner(a):
        assert split_workspace(("sw-test", "own"), 4, 2, CPU)[0] is mine[0]  # the owner's set is kept
    assert split_workspace(("sw-test", "own"), 4, 2, CPU)[0] is shared[0]  # outside any owner: the shared set
    gone = weakref.ref(a)
    del a, mine
    gc.collect()
    assert gone() is None and list(sw._BY_OWNER.keys()) == [b]  # a's buffers went with it


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> dict:
    """torch.cuda.is_current_stream_capturing() reads state["capturing"]; CUDA buffers are made on the CPU."""
    state = {"capturing": False}
    empty, zeros = torch.empty, torch.zeros

    def on_cpu(make):
        def made(*args, device, **kwargs):
            return make(*args, device="cpu" if torch.device(device).type == "cuda" else device, **kwargs)

        return made

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(torch, "empty", on_cpu(empty))
    monkeypatch.setattr(torch, "zeros", on_cpu(zeros))
    return state


def test_counters_made_during_a_capture_are_zeroed_by_the_first_eager_call(fake_capture: dict) -> None:
    cuda = torch.device("cuda", 0)
    fake_capture["capturing"] = True
    ws, cnt = split_workspace(("sw-test", "graph"), 8, 3, cuda)
    assert sw._SHARED[(cuda, "sw-test", "graph")][2] is True  # their zeroing is a graph node, not run yet
    cnt.fill_(7)  # what the memory holds until the graph's first replay
    assert split_workspace(("sw-test", "graph"), 8, 3, cuda)[1] is cnt and cnt.tolist() == [7, 7, 7]  # not in capture
    fake_capture["capturing"] = False
    ws2, cnt2 = split_workspace(("sw-test", "graph"), 8, 3, cuda)
    assert ws2 is ws and cnt2 is cnt and cnt.tolist() == [0, 0, 0]  # the first eager call zeroes them
    assert sw._SHARED[(cuda, "sw-test", "graph")][2] is False
    cnt.fill_(2)  # from now on the kernels keep them zeroed: no call zeroes them again
    assert split_workspace(("sw-test", "graph"), 8, 3, cuda)[1].tolist() == [2, 2, 2]


def test_counters_made_eagerly_are_zeroed_once_and_a_cpu_device_is_never_capturing(fake_capture: dict) -> None:
    cuda = torch.device("cuda", 0)
    _, cnt = split_workspace(("sw-test", "eager"), 8, 2, cuda)
    assert sw._SHARED[(cuda, "sw-test", "eager")][2] is False
    cnt.fill_(5)
    assert split_workspace(("sw-test", "eager"), 8, 2, cuda)[1].tolist() == [5, 5]
    fake_capture["capturing"] = True  # a capture on a CUDA stream says nothing about a CPU buffer
    _, cpu_cnt = split_workspace(("sw-test", "eager"), 8, 2, CPU)
    assert sw._SHARED[(CPU, "sw-test", "eager")][2] is False
    cpu_cnt.fill_(4)
    fake_capture["capturing"] = False
    assert split_workspace(("sw-test", "eager"), 8, 2, CPU)[1].tolist() == [4, 4]


def test_the_workspace_is_float32_whatever_the_default_dtype() -> None:
    """The kernels read fp32 partials: a process whose default dtype is float64 still gets an fp32 workspace."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ws, cnt = split_workspace(("sw-test", "dtype"), 6, 2, CPU)
    finally:
        torch.set_default_dtype(before)
    assert ws.dtype == torch.float32 and cnt.dtype == torch.int32
