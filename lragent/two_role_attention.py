"""The λ term's attention at the width of a plain pass: two roles per sequence, values rebuilt per role, one
variable-length FlashAttention call.

The shared pass of a training step (``MultiLoraModel.shared_sequence_forward``) processes each sequence's first
``split`` tokens as its *producer* role and the rest as its *consumer*: a query of role ρ needs
``softmax(Q Kᵀ / sqrt(D)) · (V_base + (V_lr B_ρ) s)`` over the keys it sees. The general path
(:func:`lragent.attention.decomposed_attention`, one role per query) runs one attention over ``[V_base | V_lr]``,
D + r wide, and applies each query's B afterwards; at LLaMA-3.1-8B shapes that wider attention is most of what makes
the shared pass dearer than a plain one (``results/train_8b_h200/lambda_cost_2026-11-24``).

Two roles per sequence allow the other order, which is the same quantity: each sequence becomes two segments,

* the producer's queries ``[0, split)`` over keys ``[0, split)`` (causal), values ``V_base + (V_lr B_p) s``;
* the consumer's queries ``[split, T)`` over keys ``[0, T)`` (causal, aligned at the end), values
  ``V_base + (V_lr B_c) s``;

and all segments of a batch go through one variable-length FlashAttention call at head width D, as a plain pass's
attention does. The queries keep their order (no copy); the keys of the context appear in both segments of their
sequence (a gather), and the values are rebuilt once per role (``V_lr B`` is a rank-r product, cheap beside the
attention). Sequences with one role (split 0 or T) have one segment.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

VarlenFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, cu_q, cu_k, max_q, max_k, scale)`` -> ``(Tq, H_q, D)``: causal attention of each query segment
over its key segment, the queries aligned with the *last* keys of their segment (bottom-right)."""


def two_role_split(role_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Reads each row of per-query roles as ``first`` for ``[0, split)`` and ``second`` for ``[split, T)``.

    Args:
        role_ids: ``(B, T)`` role of each query.

    Returns:
        ``(split, first, second)``, each ``(B,)`` (``split = T`` and ``second = first`` for a row of one role), or
        ``None`` when some row changes role more than once.
    """
    t = role_ids.shape[1]
    first, second = role_ids[:, 0], role_ids[:, -1]
    changed = role_ids != first[:, None]
    split = torch.where(changed.any(1), changed.int().argmax(1), torch.full_like(first, t))
    pos = torch.arange(t, device=role_ids.device)
    expected = torch.where(pos[None, :] < split[:, None], first[:, None], second[:, None])
    if not torch.equal(expected, role_ids):
        return None
    return split, first, second


@functools.cache
def _varlen_kwargs() -> tuple[VarlenFn, dict, bool] | None:
    """torch's variable-length FlashAttention, the keyword that makes it causal in this torch, and whether it takes
    fewer KV heads than query heads; None where it does not exist."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        causal = {"is_causal": True}
    elif "window_size" in params:
        causal = {"window_size": (-1, 0)}  # (left, right): everything before, nothing after
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> torch.Tensor:
    """:data:`VarlenFn` by ``torch.nn.attention.varlen.varlen_attn`` (CUDA, half precision)."""
    found = _varlen_kwargs()
    if found is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available in this torch")
    fn, causal, takes_gqa = found
    kwargs = dict(causal)
    if "scale" in inspect.signature(fn).parameters:
        kwargs["scale"] = scale
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            kwargs["enable_gqa"] = True
        else:  # one KV head per query head: same values
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> torch.Tensor:
    """:data:`VarlenFn` segment by segment with SDPA (any device; the test oracle of the packing)."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for i in range(cu_q.numel() - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if qb == qa:
            continue
        qs = q[qa:qb].transpose(0, 1)[None]  # (1, H_q, Lq, D)
        ks = k[ka:kb].transpose(0, 1).repeat_interleave(group, 0)[None]
        vs = v[ka:kb].transpose(0, 1).repeat_interleave(group, 0)[None]
        lq, lk = qb - qa, kb - ka
        mask = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)[0].transpose(0, 1))
    return torch.cat(outs, 0)


def varlen_available() -> bool:
    """True when :func:`flash_varlen` can run here (CUDA and a torch with ``varlen_attn``), unless switched off
    with ``LRAGENT_TWO_ROLE_ATTENTION=0`` (to time the general path against it)."""
    if os.environ.get("LRAGENT_TWO_ROLE_ATTENTION", "1") == "0":
        return False
    return torch.cuda.is_available() and _varlen_kwargs() is not None


def two_role_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    b_heads: torch.Tensor,
    scaling: float,
    split: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    dtype: torch.dtype,
    attn: VarlenFn = flash_varlen,
) -> torch.Tensor:
    """Causal attention over the decomposed cache for sequences of two roles (see the module docstring).

    Args:
        q: ``(B, H_q, T, D)`` queries (RoPE applied), the sequences' own positions ``0..T-1``.
        k: ``(B, H_kv, T, D)`` keys.
        v_base: ``(B, H_kv, T, D)`` base values.
        v_lr: ``(B, T, r)`` low-rank cache ``X A``.
        b_heads: ``(n_roles, H_kv, r, D)`` up-projections per KV head.
        scaling: LoRA scaling.
        split: ``(B,)`` queries of the first role per sequence (:func:`two_role_split`).
        first: ``(B,)`` role of queries ``[0, split)``.
        second: ``(B,)`` role of queries ``[split, T)``.
        dtype: the dtype attention computes in (autocast's under autocast).
        attn: the variable-length attention (:func:`flash_varlen`; :func:`reference_varlen` in CPU tests).

    Returns:
        ``(B, H_q, T, D)`` in ``dtype``.
    """
    b, h_q, t, d = q.shape
    h_kv = k.shape[1]
    dev = q.device
    lr = v_lr.to(dtype)

    def values(roles: torch.Tensor) -> torch.Tensor:  # (B, T, H_kv, D): V_base + (V_lr B_role) s
        up = torch.einsum("btr,bhrd->bthd", lr, b_heads[roles].to(dtype))
        return v_base.transpose(1, 2).to(dtype) + up * scaling

    k_src = k.transpose(1, 2).reshape(b * t, h_kv, d).to(dtype)
    v_src = torch.cat([values(first), values(second)], 0).reshape(2 * b * t, h_kv, d)
    splits = split.tolist()  # the segment layout is built on the host (B numbers)
    cu_q, cu_k, k_idx, v_idx = [0], [0], [], []
    for i, s in enumerate(splits):
        row = i * t
        if s > 0:  # the first role's queries over the context
            cu_q.append(row + s)
            cu_k.append(cu_k[-1] + s)
            k_idx.append(torch.arange(row, row + s))
            v_idx.append(torch.arange(row, row + s))
        if s < t:  # the second role's queries over everything before them
            cu_q.append(row + t)
            cu_k.append(cu_k[-1] + t)
            k_idx.append(torch.arange(row, row + t))
            v_idx.append(torch.arange(b * t + row, b * t + row + t))
    k_idx_t = torch.cat(k_idx).to(dev, non_blocking=True)
    v_idx_t = torch.cat(v_idx).to(dev, non_blocking=True)
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32).to(dev, non_blocking=True)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32).to(dev, non_blocking=True)
    q_flat = q.transpose(1, 2).reshape(b * t, h_q, d).to(dtype)
    out = attn(q_flat, k_src.index_select(0, k_idx_t), v_src.index_select(0, v_idx_t), cu_q_t, cu_k_t, t, t, d**-0.5)
    return out.view(b, t, h_q, d).transpose(1, 2)
