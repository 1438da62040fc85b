"""GPU tests of the training step's shared pass (λ > 0): its attention over ``[V_base | V_lr]`` runs on cuDNN with
values wider than Q/K, or (fallback, ``LRAGENT_WIDE_CUDNN=0``) on FlashAttention with Q/K padded.

The shared pass gives each query its own role's B, so it attends with values wider than the queries (``D + r``).
SDPA took the memory-efficient kernel over expanded KV heads for them; Q and K padded with zero columns take a
flash kernel with GQA (same step time at 8B shapes on an H200, 2–3 GiB less peak memory). These tests allow
FlashAttention as the only SDPA backend, so a path that falls back to another kernel raises, and compare the
values with float32.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lragent.attention import decomposed_attention

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


def test_training_step_shared_pass_runs_on_flash() -> None:
    """A λ = 1 training step of a tiny model (bf16 autocast), forward and backward with FlashAttention only."""
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
