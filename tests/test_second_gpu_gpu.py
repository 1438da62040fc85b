"""A model on the second GPU (marked ``gpu``; skipped with fewer than two): the kernels run on their tensors' device
whatever the current device, and give the same bits as on the first GPU (``eval --devices N`` shards put shard i on
cuda:i; before kernels/device_guard.py shards 1..N-1 failed inside Triton)."""

from __future__ import annotations

import pytest
import torch

import kernels.fused_ops as fo
from kernels.flash_lora_decode import flash_lora_decode
from tests.test_kernel_decode import make_decode_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def _decode_on(device: str) -> torch.Tensor:
    x = make_decode_inputs(4, 8, 2, 256, 64, 8, torch.bfloat16, device=device, seed=3)
    lens = torch.tensor([256, 1, 100, 37], device=device, dtype=torch.int32)
    rows = {"kv_lens": lens, "role_ids": torch.tensor([0, 1, 2, 0], device=device),
            "kv_slot": torch.arange(4, device=device, dtype=torch.int32),
            "lr_slot": torch.arange(4, device=device, dtype=torch.int32)}  # fmt: skip
    return flash_lora_decode(**x, **rows, scaling=2.0)


def test_decode_on_the_second_gpu_while_the_first_is_current() -> None:
    torch.cuda.set_device(0)
    want = _decode_on("cuda:0")
    got = _decode_on("cuda:1")
    assert torch.cuda.current_device() == 0  # the guard switched back
    assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), want.cpu())


def test_fused_ops_on_the_second_gpu() -> None:
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 576, generator=gen).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    want = fo.rms_norm(x.cuda(0), w.cuda(0), 1e-5)[0]
    got = fo.rms_norm(x.cuda(1), w.cuda(1), 1e-5)[0]
    assert torch.equal(got.cpu(), want.cpu())
    g, u = torch.randn(64, 1536, generator=gen).bfloat16(), torch.randn(64, 1536, generator=gen).bfloat16()
    assert torch.equal(fo.silu_mul(g.cuda(1), u.cuda(1)).cpu(), fo.silu_mul(g.cuda(0), u.cuda(0)).cpu())
