"""The kernel launchers run on their first tensor's CUDA device (kernels/device_guard.py), checked on the CPU with a
stand-in for torch.cuda: a tensor on cuda:1 in a process whose current device is cuda:0 switches device for the call
and back; a tensor on the current device, a CPU tensor or an index-less device switches nothing."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import kernels.consumer_rows as cr
import kernels.flash_lora_attention as fla
import kernels.flash_lora_decode as fld
import kernels.fused_ops as fo
from kernels.device_guard import on_tensor_device


@pytest.fixture
def cuda_stub(monkeypatch: pytest.MonkeyPatch) -> list:
    """torch.cuda.current_device is 0; torch.cuda.device(d) records d and makes it current inside the block."""
    state = {"current": 0}
    entered: list = []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        before, state["current"] = state["current"], torch.device(d).index
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    entered.append(state)  # entered[0]: the state, then the devices switched to
    return entered


def _fake(index: int | None, is_cuda: bool = True) -> SimpleNamespace:
    return SimpleNamespace(is_cuda=is_cuda, device=torch.device("cuda", index) if index is not None else "cuda")


def test_a_tensor_on_another_device_runs_there(cuda_stub: list) -> None:
    state = cuda_stub[0]
    seen = on_tensor_device(lambda t, k=0: (state["current"], k))(_fake(1), k=5)
    assert seen == (1, 5)  # ran with cuda:1 current, keyword passed through
    assert cuda_stub[1:] == [torch.device("cuda", 1)] and state["current"] == 0  # and back to cuda:0 after


@pytest.mark.parametrize(
    "t", [_fake(0), _fake(3, is_cuda=False), SimpleNamespace(is_cuda=True, device=torch.device("cuda"))]
)
def test_no_switch_where_none_is_needed(cuda_stub: list, t) -> None:
    assert on_tensor_device(lambda t: "ran")(t) == "ran"
    assert cuda_stub[1:] == []


def test_a_real_cpu_tensor_passes_through() -> None:
    x = torch.ones(3)
    assert torch.equal(on_tensor_device(lambda t: t * 2)(x), torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "fn",
    [fo.rms_norm, fo.rope_store, fo.silu_mul, fla._launch, fld._launch_decode, cr.consumer_lr_forward,
     cr.consumer_backward, cr.add_dq_rows],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_every_kernel_launcher_is_guarded(fn) -> None:
    guarded = getattr(fn, "__wrapped__", None) is not None and fn.__code__.co_filename.endswith("device_guard.py")
    assert guarded, f"{fn.__name__} launches Triton kernels without the device guard"
