"""The λ term's two-role attention (:mod:`lragent.two_role_attention`) against the general per-query path.

On the CPU the variable-length call is the segment-by-segment SDPA oracle (:func:`reference_varlen`), so what is
checked here is the split detection, the segment layout (query and key ranges, which values each segment reads) and
the rebuilt values; ``tests/test_shared_pass_gpu.py`` checks the FlashAttention call itself on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from lragent.attention import decomposed_attention, lora_b_per_head
from lragent.two_role_attention import reference_varlen, two_role_attention, two_role_split


def inputs(splits, roles, t=12, h_q=4, h_kv=2, d=8, r=3, n_roles=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(splits)
    pairs = zip(splits, roles, strict=True)
    role_ids = torch.stack([torch.where(torch.arange(t) < s, torch.tensor(p), torch.tensor(c)) for s, (p, c) in pairs])
    return {
        "q": torch.randn(b, h_q, t, d, generator=g, dtype=torch.float64),
        "k": torch.randn(b, h_kv, t, d, generator=g, dtype=torch.float64),
        "v_base": torch.randn(b, h_kv, t, d, generator=g, dtype=torch.float64),
        "v_lr": torch.randn(b, t, r, generator=g, dtype=torch.float64),
        "lora_b": torch.randn(n_roles, h_kv * d, r, generator=g, dtype=torch.float64),
        "role_ids": role_ids,
    }


def test_split_reads_two_roles_and_refuses_three() -> None:
    x = inputs([5, 0, 12, 1], [(2, 1), (0, 1), (2, 0), (1, 2)])
    split, first, second = two_role_split(x["role_ids"])
    # a row of one role: split = T and both roles equal (split 0 reads as the consumer's role alone)
    assert split.tolist() == [5, 12, 12, 1]
    assert first.tolist() == [2, 1, 2, 1] and second.tolist() == [1, 1, 2, 2]
    three = x["role_ids"].clone()
    three[0, 8:] = 0  # plan, then action, then reflect: not two roles
    assert two_role_split(three) is None


@pytest.mark.parametrize("h_q,h_kv", [(4, 2), (2, 2)])
def test_two_role_attention_equals_per_query_path(h_q: int, h_kv: int) -> None:
    # split in the middle, at 1, at 0 (consumer only), at T (producer only); every producer/consumer pair differs
    x = inputs([5, 1, 0, 12], [(2, 1), (0, 2), (1, 0), (0, 1)], h_q=h_q, h_kv=h_kv)
    ref = decomposed_attention(scaling=1.5, use_kernel=False, **x)
    parts = two_role_split(x["role_ids"])
    b_heads = lora_b_per_head(x["lora_b"], h_kv)
    out = two_role_attention(
        x["q"], x["k"], x["v_base"], x["v_lr"], b_heads, 1.5, *parts, dtype=torch.float64, attn=reference_varlen
    )
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_gradients_equal_per_query_path() -> None:
    x = inputs([7, 3], [(0, 1), (2, 0)])
    leaves = ("q", "k", "v_base", "v_lr", "lora_b")
    grads = []
    for fast in (False, True):
        y = {k: v.clone().requires_grad_(k in leaves) for k, v in x.items()}
        if fast:
            parts = two_role_split(y["role_ids"])
            b_heads = lora_b_per_head(y["lora_b"], 2)
            out = two_role_attention(
                y["q"], y["k"], y["v_base"], y["v_lr"], b_heads, 2.0, *parts, dtype=torch.float64, attn=reference_varlen
            )
        else:
            out = decomposed_attention(scaling=2.0, use_kernel=False, **y)
        out.sin().sum().backward()
        grads.append([y[k].grad for k in leaves])
    for name, a, b in zip(leaves, *grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9, msg=name)
