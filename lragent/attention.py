"""Attention over a plain cache and over the decomposed cache (V_base + V_lr B s).

``decomposed_attention`` computes, per query head h with KV head g,
``O = softmax(Q Kᵀ / sqrt(D) + mask) · V_base + ((softmax(...) · V_lr) · B_g) · s``
without ever forming ``V_lr B`` for the cached keys. On CUDA it calls the fused Triton kernel
(:mod:`kernels.flash_lora_attention`); elsewhere (and when the kernel is switched off) it uses the PyTorch path
below, which is also the kernel's test oracle at the model level.

Queries are the last ``Lq`` of the ``L`` keys (causal, aligned bottom-right).

``two_piece_attention`` is the same quantity for the training step's shared pass (λ > 0) when each sequence is a
producer's prefix and a consumer's suffix (:class:`RoleSplit`): two D-wide causal attentions over dense values
``V_base + (V_lr B_role) s``, one per role, instead of one over ``[V_base | V_lr]`` (head width D + r).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # the kernel's dtypes; fp32 takes the PyTorch path


def kernel_available() -> bool:
    """True when the fused kernel can run here (CUDA + Triton); callers switch it off with ``use_kernel=False``."""
    if not torch.cuda.is_available():
        return False
    try:
        import kernels.flash_lora_attention  # noqa: F401
    except ImportError as exc:  # triton missing
        log.warning("fused kernel unavailable (%s); using the PyTorch path", exc)
        return False
    return True


def attention_mask(q_len: int, k_len: int, key_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Boolean mask ``(B|1, 1, q_len, k_len)`` (True = attend) or ``None`` when plain causal SDPA suffices.

    Args:
        q_len: number of queries; query i sits at key position ``k_len - q_len + i``.
        k_len: number of keys.
        key_mask: ``(B, k_len)`` with 1 for real tokens and 0 for padding, or ``None``.
        device: device of the mask.
    """
    if key_mask is None and q_len == 1:
        return None
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    k_pos = torch.arange(k_len, device=device)
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, q, k)
    if key_mask is not None:
        mask = mask & key_mask.bool()[:, None, None, :]
        # A padding query may see no real key; let it see itself so softmax stays finite (its output is unused).
        mask = mask | (k_pos[None, :] == q_pos[:, None])[None, None]
    return mask


def flash_takes_wide_values(q: torch.Tensor, v: torch.Tensor) -> bool:
    """True when FlashAttention can run Q/K zero-padded to V's head width (``(B, H, L, D)`` each): half precision
    and a width of at most 256 that is a multiple of 8 (its kernels' limits)."""
    width = v.shape[-1]
    return compute_dtype(q) in _KERNEL_DTYPES and width <= 256 and width % 8 == 0


_CUDNN_WIDE_VALUES = {"ok": True}


def _cudnn_wide_values_ok() -> bool:
    """cuDNN is tried for values wider than Q/K until it refuses once; ``LRAGENT_WIDE_CUDNN=0`` skips it."""
    return _CUDNN_WIDE_VALUES["ok"] and os.environ.get("LRAGENT_WIDE_CUDNN", "1") != "0"


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes ``t`` in: autocast's on CUDA when it is on (training: RoPE leaves Q in float32 and
    autocast casts it at the SDPA call), else ``t``'s own."""
    if t.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return t.dtype


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    q_len, k_len = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if key_mask is None and q_len == k_len:
        if q.is_cuda and v.shape[-1] != q.shape[-1] and flash_takes_wide_values(q, v):
            # [V_base | V_lr] is wider than Q and K, and FlashAttention wants one head width: Q and K get zero
            # columns (Q Kᵀ unchanged, the scale stays 1/sqrt(D)) and FlashAttention runs with GQA, no expanded KV
            # heads. The training step's shared pass (λ > 0) spends its attention here.
            scale = q.shape[-1] ** -0.5
            dt = compute_dtype(q)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
            if _cudnn_wide_values_ok():
                # cuDNN takes values wider than Q and K as they are (no zero columns): the fastest of the exact
                # candidates at 8B shapes on an H200 (scripts/probe_wide_attention.py)
                try:
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
                except RuntimeError as exc:  # no cuDNN kernel for these shapes/GPU: the padded flash path
                    if isinstance(exc, torch.OutOfMemoryError):
                        raise  # not a refusal of the shapes: padding would need more memory still
                    _CUDNN_WIDE_VALUES["ok"] = False
                    log.info("cuDNN attention refused values wider than Q/K (%s); padding Q/K", exc)
            pad = v.shape[-1] - q.shape[-1]
            q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
        if gqa and q.is_cuda and v.shape[-1] != q.shape[-1]:
            # float32 (no FlashAttention): GQA would fall to the math kernel; expanded KV heads take the
            # memory-efficient kernel (as the masked case below). Same values.
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if key_mask is None and q.is_cuda and compute_dtype(q) in _KERNEL_DTYPES:
        # A chunk at the end of the keys: FlashAttention's bottom-right causal variant, no mask tensor.
        from torch.nn.attention.bias import causal_lower_right

        # the causal-bias dispatch checks dtypes before autocast casts them (RoPE leaves Q/K in float32)
        dt = compute_dtype(q)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len), enable_gqa=gqa)
    mask = attention_mask(q_len, k_len, key_mask, q.device)
    if gqa and mask is not None and q.is_cuda:
        # Masked GQA would go to cuDNN's kernel, which failed on an H200 (mha_graph.execute); expanded KV heads take
        # the memory-efficient kernel instead. Same values.
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def plain_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal GQA attention over a plain cache.

    Args:
        q: ``(B, H_q, Lq, D)``.
        k: ``(B, H_kv, L, D)``.
        v: ``(B, H_kv, L, D)``.
        key_mask: ``(B, L)`` padding mask or ``None``.

    Returns:
        ``(B, H_q, Lq, D)``.
    """
    return _sdpa(q, k, v, key_mask)


def lora_b_per_head(lora_b: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """View the PEFT-layout up-projections ``(n_roles, H_kv·D, r)`` as ``(n_roles, H_kv, r, D)`` (no copy)."""
    n_roles, d_out, r = lora_b.shape
    return lora_b.view(n_roles, n_kv_heads, d_out // n_kv_heads, r).transpose(-1, -2)


def decomposed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    role_ids: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    use_kernel: bool = True,
) -> torch.Tensor:
    """Attention over the decomposed cache: ``P V_base + ((P V_lr) B_role) s``.

    Args:
        q: ``(B, H_q, Lq, D)`` queries (RoPE applied).
        k: ``(B, H_kv, L, D)`` keys.
        v_base: ``(B, H_kv, L, D)`` base values ``X W0 (+ b)``.
        v_lr: ``(B, L, r)`` low-rank cache ``X A``, shared by all KV heads.
        lora_b: ``(n_roles, H_kv·D, r)`` stacked up-projections of ``v_proj`` (PEFT layout).
        scaling: LoRA scaling alpha / r.
        role_ids: ``(B,)`` role whose B each sequence applies, or ``(B, Lq)`` each query's (the PyTorch path).
        key_mask: ``(B, L)`` padding mask or ``None``.
        use_kernel: allow the fused Triton kernel on CUDA.

    Returns:
        ``(B, H_q, Lq, D)`` in q's dtype.
    """
    b, h_q, q_len, d = q.shape
    h_kv = k.shape[1]
    b_heads = lora_b_per_head(lora_b, h_kv)  # (n_roles, H_kv, r, D)
    per_query = role_ids.dim() == 2
    if (
        use_kernel
        and not per_query
        and key_mask is None
        and q.is_cuda
        and q.dtype in _KERNEL_DTYPES
        and kernel_available()
    ):
        from kernels.flash_lora_attention import flash_lora_attention

        return flash_lora_attention(q, k, v_base, v_lr, b_heads, scaling, role_ids=role_ids)
    r = v_lr.shape[-1]
    # One SDPA over [V_base | V_lr]: the low-rank columns share the softmax with the base columns.
    v_cat = torch.cat([v_base, v_lr[:, None].expand(b, h_kv, v_lr.shape[1], r)], dim=-1)  # (B, H_kv, L, D + r)
    out = _sdpa(q, k, v_cat, key_mask)  # (B, H_q, Lq, D + r)
    o_base, o_lr = out[..., :d], out[..., d:]
    group = h_q // h_kv
    o_lr = o_lr.reshape(b, h_kv, group, q_len, r)
    if per_query:  # each query's own B: o_lr in its role's r columns, times every role's B side by side
        n_roles = b_heads.shape[0]
        onehot = F.one_hot(role_ids, n_roles).to(o_lr.dtype)[:, None, None, :, :, None]  # (B, 1, 1, Lq, n, 1)
        o_roles = (onehot * o_lr[..., None, :]).flatten(-2)  # (B, H_kv, group, Lq, n·r)
        b_cat = b_heads.transpose(0, 1).reshape(h_kv, n_roles * r, d)  # (H_kv, n·r, D)
        o_up = torch.einsum("bhgqk,hkd->bhgqd", o_roles, b_cat.to(o_lr.dtype)).reshape(b, h_q, q_len, d)
        return o_base + o_up * scaling
    b_sel = b_heads[role_ids]  # (B, H_kv, r, D)
    o_up = torch.einsum("bhgqr,bhrd->bhgqd", o_lr, b_sel.to(o_lr.dtype)).reshape(b, h_q, q_len, d)
    return o_base + o_up * scaling


TWO_PIECE_UNIT = 128
""":class:`RoleSplit` rounds its row range ``[lo, hi)`` to multiples of this: few distinct attention shapes (cuDNN
builds a graph per shape)."""


def two_piece_enabled() -> bool:
    """The shared pass's two-piece attention (:func:`two_piece_attention`) is on; ``LRAGENT_TWO_PIECE=0`` gives the
    per-query path over ``[V_base | V_lr]`` instead (side-by-side timing)."""
    return os.environ.get("LRAGENT_TWO_PIECE", "1") != "0"


VarlenFn = Callable[..., torch.Tensor]
"""``fn(q, k, v, cu_q, cu_k, max_q, max_k, scale)`` -> ``(Nq, H_q, D)``: causal attention of each packed query
segment over its key segment, the queries aligned with the segment's *last* keys (bottom-right)."""


@functools.cache
def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    """torch's variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``) or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """:data:`VarlenFn` by torch's variable-length FlashAttention (CUDA, half precision; GQA natively)."""
    fn = _torch_varlen()
    if fn is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available in this torch")
    # window (everything before, nothing after): FlashAttention aligns it bottom-right when queries < keys
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0))


def reference_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """:data:`VarlenFn` segment by segment with masked SDPA (any device): the oracle of :func:`flash_varlen`'s
    packing in CPU tests."""
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


@dataclass(frozen=True)
class RoleSplit:
    """Each sequence's first ``split[b]`` tokens belong to a producer role, the rest to a consumer role.

    Attributes:
        producer: ``(B,)`` role of each sequence's first ``split[b]`` tokens.
        consumer: ``(B,)`` role of the remaining tokens.
        split: ``(B,)`` long, tokens of each sequence written by the producer.
        lo: ``min(split)`` rounded down to a multiple of the unit (capped at ``T``): rows below are all producer's.
        hi: ``max(split)`` rounded up to a multiple of the unit (capped at ``T``): rows from here on are all the
            consumer's.
        length: tokens per sequence ``T``.
        consumer_rows: ``(N_c,)`` long, flat positions ``b * T + t`` of the consumer rows (``t >= split[b]``),
            sequence by sequence.
        cu_q: ``(B + 1,)`` int32, where each sequence's consumer rows start in ``consumer_rows`` (and end).
        cu_k: ``(B + 1,)`` int32, ``b * T``: each sequence's keys.
        max_q: the most consumer rows of one sequence.
    """

    producer: torch.Tensor
    consumer: torch.Tensor
    split: torch.Tensor
    lo: int
    hi: int
    length: int = 0
    consumer_rows: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0

    @classmethod
    def make(
        cls,
        producer: torch.Tensor,
        consumer: torch.Tensor,
        split: torch.Tensor,
        length: int,
        unit: int | None = None,
    ) -> RoleSplit:
        """The layout of sequences of ``length`` tokens; reads ``split`` on the host (one device-to-host sync:
        once per forward, not per layer) and builds the consumer rows' packing once for every layer.

        Args:
            producer: ``(B,)`` producer roles.
            consumer: ``(B,)`` consumer roles.
            split: ``(B,)`` producer tokens per sequence (clamped to ``[0, length]``).
            length: tokens per sequence ``T``.
            unit: rounding multiple of ``lo`` and ``hi`` (default :data:`TWO_PIECE_UNIT`).
        """
        unit = TWO_PIECE_UNIT if unit is None else unit
        dev = producer.device
        split = split.to(device=dev, dtype=torch.long).clamp(0, length)
        splits = split.tolist()
        smin, smax = (min(splits), max(splits)) if splits else (length, length)
        lo = min(smin // unit * unit, length)
        hi = min(-(-smax // unit) * unit, length)
        counts = [length - s for s in splits]
        rows = [torch.arange(i * length + s, (i + 1) * length) for i, s in enumerate(splits)]
        consumer_rows = torch.cat(rows).to(dev, non_blocking=True) if rows else torch.zeros(0, dtype=torch.long)
        cu_q = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32).to(dev, non_blocking=True)
        cu_k = (torch.arange(len(splits) + 1, dtype=torch.int32) * length).to(dev, non_blocking=True)
        return cls(producer, consumer, split, lo, hi, length, consumer_rows, cu_q, cu_k, max(counts, default=0))


def _role_values(
    v_rows: torch.Tensor, v_lr: torch.Tensor, lora_b: torch.Tensor, roles: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``V_base + (V_lr B_role) s`` per sequence in one batched GEMM (its backward is two more, no elementwise
    passes over the heads).

    Args:
        v_rows: ``(B, L, H_kv·D)`` base values, token-major.
        v_lr: ``(B, L, r)``.
        lora_b: ``(n_roles, H_kv·D, r)`` stacked up-projections (PEFT layout).
        roles: ``(B,)``.

    Returns:
        ``(B, L, H_kv·D)``.
    """
    return torch.baddbmm(v_rows, v_lr, lora_b[roles].transpose(1, 2).to(v_lr.dtype), alpha=scaling)


def two_piece_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    layout: RoleSplit,
    varlen: VarlenFn | None = None,
) -> torch.Tensor:
    """:func:`decomposed_attention` with per-query roles, for sequences that are a producer's prefix and a
    consumer's suffix (the shared pass; no padding mask, queries = keys).

    Causality leaves two value tensors per sequence: producer rows ``t < split[b]`` see only keys ``< split[b]``,
    all with the producer's values; consumer rows see keys ``<= t`` with the consumer's values. So ``P`` = causal
    attention of rows ``[0, hi)`` over keys ``[0, hi)`` with the producer's values (the plain pass's D-wide
    attention), and the consumer rows over all keys with the consumer's values: exactly those rows through
    variable-length FlashAttention (``varlen``; on CUDA in half precision by default), else the rows ``[lo, T)``
    as one bottom-right causal call. Consumer rows replace ``P``'s rows.

    Args:
        q: ``(B, H_q, T, D)`` queries (RoPE applied; float32 under autocast is cast as SDPA would).
        k: ``(B, H_kv, T, D)`` keys.
        v_base: ``(B, H_kv, T, D)`` base values.
        v_lr: ``(B, T, r)`` low-rank cache.
        lora_b: ``(n_roles, H_kv·D, r)`` stacked up-projections of ``v_proj`` (PEFT layout).
        scaling: LoRA scaling.
        layout: the sequences' producer/consumer layout.
        varlen: the variable-length attention for the consumer rows (:func:`reference_varlen` in CPU tests);
            ``None``: :func:`flash_varlen` where it runs, else the dense ``[lo, T)`` call.

    Returns:
        ``(B, H_q, T, D)`` in the compute dtype (:func:`compute_dtype` of ``q``), token-major underneath (the
        output projection's reshape is a view).
    """
    b, h_q, t, d = q.shape
    h_kv = k.shape[1]
    if k.shape[2] != t:
        raise ValueError(f"two-piece attention needs as many queries as keys, got {t} and {k.shape[2]}")
    hi = layout.hi
    dt = compute_dtype(q)
    q, k = q.to(dt), k.to(dt)
    v_rows = v_base.transpose(1, 2).reshape(b, t, h_kv * d).to(dt)  # a view when V_base is token-major
    lr = v_lr.to(dt)

    def heads(x: torch.Tensor) -> torch.Tensor:  # (B, L, H_kv·D) -> (B, H_kv, L, D), a view
        return x.view(b, x.shape[1], h_kv, d).transpose(1, 2)

    if varlen is None and q.is_cuda and dt in _KERNEL_DTYPES and _torch_varlen() is not None:
        varlen = flash_varlen
    p = None  # the producer's piece; hi == 0 only when every row is the consumer's
    if hi > 0:
        v_prod = _role_values(v_rows[:, :hi], lr[:, :hi], lora_b, layout.producer, scaling)
        p = _sdpa(q[:, :, :hi], k[:, :, :hi], heads(v_prod), None)  # (B, H_q, hi, D)
    if varlen is None or layout.consumer_rows is None or layout.length != t:
        return _two_piece_dense(q, k, v_rows, lr, lora_b, scaling, layout, heads, p)
    out = None
    if p is not None:
        out = p.transpose(1, 2)  # (B, hi, H_q, D)
        if hi < t:
            out = F.pad(out, (0, 0, 0, 0, 0, t - hi))  # rows from hi on are all the consumer's
        out = out.reshape(b * t, h_q, d)
    if layout.consumer_rows.numel():
        v_cons = _role_values(v_rows, lr, lora_b, layout.consumer, scaling).view(b * t, h_kv, d)
        k_rows = k.transpose(1, 2).reshape(b * t, h_kv, d)
        q_c = q.transpose(1, 2).reshape(b * t, h_q, d).index_select(0, layout.consumer_rows)  # (N_c, H_q, D)
        o_c = varlen(q_c, k_rows, v_cons, layout.cu_q, layout.cu_k, layout.max_q, t, d**-0.5)
        out = o_c if out is None else out.index_copy(0, layout.consumer_rows, o_c.to(out.dtype))
    return out.view(b, t, h_q, d).transpose(1, 2)


def _two_piece_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v_rows: torch.Tensor,
    lr: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    layout: RoleSplit,
    heads: Callable[[torch.Tensor], torch.Tensor],
    p: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`two_piece_attention`'s consumer rows as one dense bottom-right causal call over rows ``[lo, T)`` (no
    variable-length kernel here), merged with the producer's piece ``p`` (``(B, H_q, hi, D)`` or None)."""
    t = q.shape[2]
    lo, hi = layout.lo, layout.hi
    c = None
    if lo < t:
        v_cons = _role_values(v_rows, lr, lora_b, layout.consumer, scaling)
        c = _sdpa(q[:, :, lo:], k, heads(v_cons), None)  # (B, H_q, T - lo, D), bottom-right causal
    if c is None:
        return p
    if p is None:
        return c
    rows = torch.arange(lo, hi, device=q.device)
    producer_row = (rows[None, :] < layout.split[:, None])[:, None, :, None]  # (B, 1, hi - lo, 1)
    mid = torch.where(producer_row, p[:, :, lo:], c[:, :, : hi - lo])
    return torch.cat([p[:, :, :lo], mid, c[:, :, hi - lo :]], dim=2)
