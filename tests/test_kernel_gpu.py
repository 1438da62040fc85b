"""GPU tests of the Flash-LoRA-Attention Triton kernels (marked ``gpu``, skipped without CUDA).

The kernel's max error against the fp32 reference must be at most twice eager PyTorch's at the same
precision (``flash_lora_attention_reference(..., upcast=False)``) plus a small atol, in the style of
flash-attention's tests. Inputs are strided views like the runtime passes (narrowed caches, transposed q,
the PEFT-layout view of B).
"""

from __future__ import annotations

import pytest
import torch

from kernels.flash_lora_attention import flash_lora_attention, flash_lora_attention_reference
from tests.test_kernel_reference import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = 1e-3


@pytest.fixture
def fixed_configs(monkeypatch):
    """Use the default tile configs (no autotuning) so the sweep compiles one kernel per shape class."""
    from kernels.flash_lora_attention import set_autotune

    set_autotune(False)


def check_against_reference(x: dict, scaling: float, role_ids, kv_lens) -> tuple[float, float]:
    kw = {"scaling": scaling, "role_ids": role_ids, "kv_lens": kv_lens}
    out = flash_lora_attention(**x, **kw)
    exact = flash_lora_attention_reference(**x, **kw).float()
    eager = flash_lora_attention_reference(**x, **kw, upcast=False).float()
    assert out.dtype == x["q"].dtype and out.shape == x["q"].shape
    assert torch.isfinite(out).all()
    err = (out.float() - exact).abs().max().item()
    eager_err = (eager - exact).abs().max().item()
    assert err <= 2 * eager_err + ATOL, f"kernel err {err:.3e} vs eager err {eager_err:.3e}"
    return err, eager_err


# (Lc, L): decode (G*Lc <= 64 -> split-K kernel) and chunks (prefill kernel for G*Lc > 64)
LENGTHS = [(1, 1), (1, 4097), (5, 1000), (17, 1000), (200, 4097), (1000, 1000)]
RANK_GROUP = [(1, 1), (8, 4), (16, 8), (64, 4)]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda t: f"Lc{t[0]}-L{t[1]}")
@pytest.mark.parametrize("rank_group", RANK_GROUP, ids=lambda t: f"r{t[0]}-G{t[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernel_matches_reference(fixed_configs, record_property, dtype, head_dim, rank_group, lengths):
    rank, group = rank_group
    lc, seq = lengths
    hkv = 2
    # three sequences: full length, about half, and the shortest allowed (kv_len == Lc); mixed roles
    kv_lens = torch.tensor([seq, max(lc, seq // 2 + 1), lc], device="cuda", dtype=torch.int32)
    role_ids = torch.tensor([2, 0, 1], device="cuda")
    x = make_inputs(3, hkv * group, hkv, lc, seq, head_dim, rank, dtype, device="cuda", seed=seq + rank)
    err, eager_err = check_against_reference(x, 2.0, role_ids, kv_lens)
    record_property("kernel_err", err)  # lands in --junitxml, for the notes
    record_property("eager_err", eager_err)


@pytest.mark.parametrize("lengths", [(1, 8192), (3, 3000), (300, 3000)], ids=lambda t: f"Lc{t[0]}-L{t[1]}")
def test_kernel_autotuned_llama_shapes(record_property, lengths):
    """The autotuned path (as the benchmark runs it) on LLaMA-3.1-8B head layout: 32 q heads, 8 KV heads."""
    lc, seq = lengths
    x = make_inputs(2, 32, 8, lc, seq, 128, 8, torch.bfloat16, device="cuda", seed=lc)
    kv_lens = torch.tensor([seq, seq - 77], device="cuda", dtype=torch.int32)
    role_ids = torch.tensor([1, 0], device="cuda")
    if lc == 3:  # also the defaults: role 0 and full length for every sequence
        kv_lens = role_ids = None
    err, eager_err = check_against_reference(x, 2.0, role_ids, kv_lens)
    record_property("kernel_err", err)
    record_property("eager_err", eager_err)


def test_mixed_roles_batch_equals_each_sequence_alone(fixed_configs):
    """One launch with mixed roles and lengths equals running each sequence alone with its own role."""
    x = make_inputs(3, 8, 2, 1, 2000, 128, 8, torch.bfloat16, device="cuda", seed=7)
    roles = torch.tensor([1, 2, 0], device="cuda")
    lens = torch.tensor([2000, 1234, 1], device="cuda", dtype=torch.int32)
    batched = flash_lora_attention(**x, scaling=2.0, role_ids=roles, kv_lens=lens)
    for b in range(3):
        n = int(lens[b])
        alone = flash_lora_attention(
            x["q"][b : b + 1], x["k"][b : b + 1, :, :n], x["v_base"][b : b + 1, :, :n], x["v_lr"][b : b + 1, :n],
            x["lora_b"], 2.0, role_ids=roles[b : b + 1],
        )  # fmt: skip
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=2e-2, atol=2e-2)
    other_role = flash_lora_attention(**x, scaling=2.0, role_ids=(roles + 1) % 3, kv_lens=lens)
    assert (other_role.float() - batched.float()).abs().max() > 1e-2  # the role really is gathered per item


def test_kernel_is_deterministic(fixed_configs):
    """Same inputs, same bits: catches races between the split-K partials and the combine."""
    x = make_inputs(1, 32, 8, 1, 20000, 128, 8, torch.bfloat16, device="cuda", seed=3)
    a = flash_lora_attention(**x, scaling=2.0)
    b = flash_lora_attention(**x, scaling=2.0)
    assert torch.equal(a, b)


def test_kernel_bad_inputs_on_gpu():
    x = make_inputs(1, 8, 2, 1, 64, 64, 8, torch.bfloat16, device="cuda")
    cases = [
        ({"k": x["k"].cpu()}, "k is on cpu"),
        ({"q": x["q"].float()}, "q dtype"),
        ({"v_lr": x["v_lr"].half()}, "v_lr dtype"),
        ({"role_ids": torch.tensor([0])}, "role_ids is on cpu"),
        ({"lora_b": x["lora_b"][:, :1]}, "lora_b shape"),
    ]
    for override, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            flash_lora_attention(**{**x, **override}, scaling=1.0)
        assert "\n" not in str(info.value)
