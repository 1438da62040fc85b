"""GPU tests of the training step's shared pass (λ > 0): its attention is the plain causal attention over the
producer's values plus the consumer rows' r-wide correction (``two_piece_attention``, the default, Triton kernels for
the correction); with ``LRAGENT_TWO_PIECE=0`` over
``[V_base | V_lr]`` on cuDNN with values wider than Q/K, or (fallback, ``LRAGENT_WIDE_CUDNN=0``) on FlashAttention
with Q/K padded.

The shared pass gives each query its own role's B, so it attends with values wider than the queries (``D + r``).
SDPA took the memory-efficient kernel over expanded KV heads for them; Q and K padded with zero columns take a
flash kernel with GQA (same step time at 8B shapes on an H200, 2–3 GiB less peak memory). These tests allow
FlashAttention as the only SDPA backend, so a path that falls back to another kernel raises, and compare the
values with float32.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lragent.attention import RoleSplit, decomposed_attention, two_piece_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def inputs(b=2, h_q=8, h_kv=2, t=96, d=64, r=16, n_roles=3, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(b, h_q, t, d, generator=g),
        "k": torch.randn(b, h_kv, t, d, generator=g),
        "v_base": torch.randn(b, h_kv, t, d, generator=g),
        "v_lr": torch.randn(b, t, r, generator=g),
        "lora_b": torch.randn(n_roles, h_kv * d, r, generator=g) / r**0.5,
        # each token's role: a producer for the first part of a sequence, the consumer after (as the shared pass)
        "role_ids": torch.cat([torch.full((b, t // 3), 2), torch.ones(b, t - t // 3, dtype=torch.long)], 1),
    }


@pytest.mark.parametrize("wide_cudnn", ["1", "0"])
@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (4, 4)])
def test_per_query_decomposed_attention_runs_on_flash_and_matches_float32(
    h_q: int, h_kv: int, wide_cudnn: str, monkeypatch
) -> None:
    """``wide_cudnn=1``: cuDNN with values wider than Q/K (the default on GPUs that have it); ``0``: Q/K padded for
    FlashAttention (the fallback), the only backend allowed, so that any other raises."""
    monkeypatch.setenv("LRAGENT_WIDE_CUDNN", wide_cudnn)
    x = inputs(h_q=h_q, h_kv=h_kv)
    dev = {k: v.cuda() for k, v in x.items()}
    half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in dev.items()}
    for k in ("q", "k", "v_base", "v_lr"):
        half[k].requires_grad_(True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # any other backend: "No available kernel"
        out = decomposed_attention(scaling=2.0, use_kernel=False, **half)
        out.float().square().sum().backward()
    exact = decomposed_attention(scaling=2.0, use_kernel=False, **dev).float()
    eager = decomposed_attention(
        scaling=2.0, use_kernel=False, **{k: v.detach() if torch.is_tensor(v) else v for k, v in half.items()}
    )
    assert out.shape == x["q"].shape and out.dtype == torch.bfloat16
    err = (out.float() - exact).abs().max().item()
    scale = exact.abs().max().item()
    assert err <= 0.02 * scale, f"flash path off by {err} (values up to {scale})"
    # eager (whatever backend SDPA picks unconstrained) gives the same values within bf16 rounding
    assert (out.float() - eager.float()).abs().max().item() <= 0.02 * scale
    for k in ("q", "k", "v_base", "v_lr"):
        assert half[k].grad is not None and torch.isfinite(half[k].grad).all(), k


BACKENDS = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION], "default": None}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize(
    "t,split,ends",
    [
        (300, [280, 100, 150, 299], [300, 300, 220, 300]),
        (256, [0, 0, 0, 0], None),
        (256, [256, 256, 256, 256], None),
        (2048, [1990, 2000, 1900, 2047], None),
    ],
)
def test_two_piece_attention_matches_float32_with_gradients(t: int, split: list[int], ends, backend: str) -> None:
    """The training step's inputs (queries float32 from RoPE, the rest bf16, B float32, autocast bf16), the
    consumer-row Triton kernels on, each SDPA backend the plain piece may take (its backward must see its own
    output: the correction writes into it and restores it): values and the gradients of every input match the
    per-query path in float32 within bf16 rounding, and the Triton kernels match their PyTorch implementation."""
    x = inputs(b=4, t=t)
    dev = {k: v.cuda() for k, v in x.items() if k != "role_ids"}
    producer, consumer = torch.tensor([2, 0, 1, 2]).cuda(), torch.tensor([1, 1, 0, 0]).cuda()
    split_t = torch.tensor(split).cuda()
    layout = RoleSplit.make(producer, consumer, split_t, t, None if ends is None else torch.tensor(ends).cuda())
    roles = torch.where(torch.arange(t).cuda()[None, :] < split_t[:, None], producer[:, None], consumer[:, None])
    real = torch.ones(4, t, dtype=torch.bool, device="cuda")
    if ends is not None:
        real = torch.arange(t).cuda()[None, :] < torch.tensor(ends).cuda()[:, None]
    weight = torch.randn(4, 8, t, 64, generator=torch.Generator().manual_seed(3)).cuda() * real[:, None, :, None]

    def run(use_kernel: bool):
        half = {
            "q": dev["q"].clone().requires_grad_(),
            "k": dev["k"].bfloat16().requires_grad_(),
            "v_base": dev["v_base"].bfloat16().requires_grad_(),
            "v_lr": dev["v_lr"].bfloat16().requires_grad_(),
            "lora_b": dev["lora_b"].clone().requires_grad_(),
        }

        def ctx():  # a fresh context each time (sdpa_kernel's is single-use)
            return sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] else contextlib.nullcontext()

        with ctx(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = two_piece_attention(scaling=2.0, layout=layout, use_kernel=use_kernel, **half)
        with ctx():
            (out.float() * weight).sum().backward()
        return out, {k: v.grad.float() for k, v in half.items()}

    out, grads = run(use_kernel=True)
    exact_in = {k: v.clone().requires_grad_() for k, v in dev.items()}
    exact = decomposed_attention(scaling=2.0, role_ids=roles, use_kernel=False, **exact_in).float()
    (exact * weight).sum().backward()
    assert out.shape == x["q"].shape and out.dtype == torch.bfloat16
    scale = exact.abs().max().item()
    err = (out.float() - exact)[real[:, None, :, None].expand_as(exact)].abs().max().item()
    assert err <= 0.02 * scale, f"two-piece path off by {err} (values up to {scale})"
    for k, v in exact_in.items():
        g_scale = v.grad.abs().max().item()
        g_err = (grads[k] - v.grad).abs().max().item()
        assert g_err <= 0.03 * g_scale, f"{k}: gradient off by {g_err} (up to {g_scale})"
    out_t, grads_t = run(use_kernel=False)  # the consumer rows in PyTorch: the kernels' oracle at bf16 inputs
    assert (out.float() - out_t.float()).abs().max().item() <= 0.01 * scale
    for k, g in grads.items():
        assert (g - grads_t[k]).abs().max().item() <= 0.01 * grads_t[k].abs().max().item() + 1e-6, k


@pytest.mark.parametrize("two_piece", ["1", "0"])
def test_training_step_shared_pass_runs_on_flash(two_piece: str, monkeypatch) -> None:
    """A λ = 1 training step of a tiny model (bf16 autocast), forward and backward with FlashAttention only, the
    two-piece attention on and off."""
    monkeypatch.setenv("LRAGENT_TWO_PIECE", two_piece)
    import tempfile
    from pathlib import Path

    from datamodules import collate_examples
    from tests.test_training_recipe import data, module

    with tempfile.TemporaryDirectory() as tmp:
        dm = data(Path(tmp), pack_prefixes=False)
        dm.setup()
        batch = collate_examples(dm.train_set.examples[:4], pad_id=257)
    m = module(lambda_shared=1.0, val_schemes=[])
    m.configure_model()
    m = m.cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        out = m.compute_loss(batch)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out["loss"].backward()
    assert "shared" in out and "plain" not in out and torch.isfinite(out["loss"])
    grads = [p.grad for p in m.lora_model.lora_parameters()]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
