"""Rotary position embedding (RoPE) in PyTorch ops, shared by the decoder and every cache view.

Its own module so that the decoder (which runs the layers) and the cache views (which store K/V) both import it
without importing each other.
"""

from __future__ import annotations

from typing import Protocol

import torch


class _Stores(Protocol):
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None: ...


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies RoPE to ``x`` ``(B, H, T, D)`` with ``cos``/``sin`` ``(B, T, D)``."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def rope_store_unfused(
    view: _Stores,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_lr: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """:meth:`~lragent.cache_views.CacheView.rope_store` with PyTorch ops and the view's own ``store``.

    Args:
        view: the cache view (anything with ``store(layer, k, v, v_lr)``).
        layer: layer index.
        q: ``(B, T, H_q, D)`` queries before RoPE.
        k: ``(B, T, H_kv, D)`` keys before RoPE.
        v: ``(B, T, H_kv, D)`` values.
        v_lr: ``(B, T, r)`` low-rank values, or None.
        cos: ``(B, T, D)``.
        sin: ``(B, T, D)``.

    Returns:
        ``(B, H_q, T, D)`` queries after RoPE.
    """
    if torch.is_grad_enabled() and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3] and q.dtype == k.dtype:
        # training: q and k through one RoPE (the same element-wise ops on one tensor, so the same values and
        # gradients bit for bit): 6 kernels forward where two calls launch 10, and fewer in backward (host-bound step)
        qk = apply_rope(torch.cat([q, k], dim=2).transpose(1, 2), cos, sin)  # (B, H_q + H_kv, T, D)
        n_q = q.shape[2]
        view.store(layer, qk[:, n_q:], v.transpose(1, 2), v_lr)
        return qk[:, :n_q]
    view.store(layer, apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2), v_lr)
    return apply_rope(q.transpose(1, 2), cos, sin)
