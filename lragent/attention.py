"""Attention over a plain cache and over the decomposed cache (V_base + V_lr B s).

``decomposed_attention`` computes, per query head h with KV head g,
``O = softmax(Q Kᵀ / sqrt(D) + mask) · V_base + ((softmax(...) · V_lr) · B_g) · s``
without ever forming ``V_lr B`` for the cached keys. On CUDA it calls the fused Triton kernel
(:mod:`kernels.flash_lora_attention`); elsewhere (and when the kernel is switched off) it uses the PyTorch path
below, which is also the kernel's test oracle at the model level.

Queries are the last ``Lq`` of the ``L`` keys (causal, aligned bottom-right).

``two_piece_attention`` is the same quantity for the training step's shared pass (λ > 0) when each sequence is a
producer's prefix and a consumer's suffix (:class:`RoleSplit`): the plain D-wide causal attention over the
producer's values ``V_base + (V_lr B_producer) s``, plus an r-wide correction of the consumer rows
(:mod:`kernels.consumer_rows`), instead of one attention over ``[V_base | V_lr]`` (head width D + r).
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.consumer_rows import (
    ConsumerRows,
    add_dq_rows,
    consumer_backward,
    consumer_lr_forward,
    read_rows,
    restore_rows,
)

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # the kernel's dtypes; fp32 takes the PyTorch path
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # SDPA, cuDNN left out


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


def _cuda_route(t: torch.Tensor) -> bool:
    """True when ``t`` is on CUDA, where SDPA's backend choices below apply (FlashAttention, cuDNN, the
    memory-efficient kernel). The routes' arithmetic (padding, scale, expanded heads, casts) is device-independent:
    the CPU tests run it by answering True here."""
    return t.is_cuda


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes ``t`` in: autocast's on CUDA when it is on (training: RoPE leaves Q in float32 and
    autocast casts it at the SDPA call), else ``t``'s own."""
    if _cuda_route(t) and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return t.dtype


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    q_len, k_len = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if key_mask is None and q_len == k_len:
        if _cuda_route(q) and v.shape[-1] != q.shape[-1] and flash_takes_wide_values(q, v):
            # [V_base | V_lr] is wider than Q and K, and FlashAttention wants one head width: Q and K get zero
            # columns (Q Kᵀ unchanged, the scale stays 1/sqrt(D)) and FlashAttention runs with GQA, no expanded KV
            # heads. The training step's shared pass (λ > 0) spends its attention here.
            scale = q.shape[-1] ** -0.5
            dt = compute_dtype(q)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
            if _cudnn_wide_values_ok():
                # cuDNN takes values wider than Q and K as they are (no zero columns): the fastest of the exact
                # candidates at 8B shapes on an H200 (scripts/probe_wide_attention.py at commit d89e4ca)
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
        if gqa and _cuda_route(q) and v.shape[-1] != q.shape[-1]:
            # float32 (no FlashAttention): GQA would fall to the math kernel; expanded KV heads take the
            # memory-efficient kernel (as the masked case below). Same values.
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if _cuda_route(q) and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # Training: not cuDNN, which torch picks first on Hopper: it builds a plan per new sequence length,
            # 120-240 ms (forward + backward, H200), so an epoch of length-bucketed batches paid ~300 ms a new batch
            # shape; FlashAttention takes any length at once (results/ddp_embedded_h200x4_2026-11-28/). Inference
            # (the plain caches' prefill) keeps torch's choice: not measured there.
            with sdpa_kernel(_NO_CUDNN):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if key_mask is None and _cuda_route(q) and compute_dtype(q) in _KERNEL_DTYPES:
        # A chunk at the end of the keys: FlashAttention's bottom-right causal variant, no mask tensor.
        from torch.nn.attention.bias import causal_lower_right

        # the causal-bias dispatch checks dtypes before autocast casts them (RoPE leaves Q/K in float32)
        dt = compute_dtype(q)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q_len, k_len), enable_gqa=gqa)
    mask = attention_mask(q_len, k_len, key_mask, q.device)
    if gqa and mask is not None and _cuda_route(q):
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
        and _cuda_route(q)
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


def two_piece_enabled() -> bool:
    """The shared pass's two-piece attention (:func:`two_piece_attention`) is on; ``LRAGENT_TWO_PIECE=0`` gives the
    per-query path over ``[V_base | V_lr]`` instead (side-by-side timing)."""
    return os.environ.get("LRAGENT_TWO_PIECE", "1") != "0"


@dataclass(frozen=True)
class RoleSplit:
    """Each sequence's first ``split[b]`` tokens belong to a producer role, the rest to a consumer role.

    Attributes:
        producer: ``(B,)`` role of each sequence's first ``split[b]`` tokens.
        consumer: ``(B,)`` role of the remaining tokens.
        split: ``(B,)`` long, tokens of each sequence written by the producer.
        length: tokens per sequence ``T``.
        rows: the consumer rows that need their own values, ``split[b] <= t < ends[b]`` (packed sequence by
            sequence; rows from ``ends[b]`` on are right padding: no real row reads them and none is scored).
    """

    producer: torch.Tensor
    consumer: torch.Tensor
    split: torch.Tensor
    length: int
    rows: ConsumerRows

    @classmethod
    def make(
        cls,
        producer: torch.Tensor,
        consumer: torch.Tensor,
        split: torch.Tensor,
        length: int,
        ends: torch.Tensor | None = None,
    ) -> RoleSplit:
        """The layout of sequences of ``length`` tokens; reads ``split`` (and ``ends``) on the host: one
        device-to-host sync per forward, not per layer, and the packed rows are built once for every layer.

        Args:
            producer: ``(B,)`` producer roles.
            consumer: ``(B,)`` consumer roles.
            split: ``(B,)`` producer tokens per sequence (clamped to ``[0, length]``); on the host, no sync.
            length: tokens per sequence ``T``.
            ends: ``(B,)`` real tokens per sequence (the rest is padding), on split's device; ``None``: ``length``.
        """
        dev = producer.device
        if ends is None:
            starts, stops = split.tolist(), [length] * split.numel()
        else:  # one transfer for both (none when they are on the host: the training step passes host copies)
            starts, stops = torch.stack([split.long(), ends.to(split.device, torch.long)]).tolist()
        starts = [min(max(int(x), 0), length) for x in starts]
        stops = [min(max(int(x), 0), length) for x in stops]
        split = torch.tensor(starts, dtype=torch.long).to(dev, non_blocking=True)
        counts = [max(0, e - s) for s, e in zip(starts, stops, strict=True)]
        pos = [torch.arange(s, s + c) for s, c in zip(starts, counts, strict=True)]
        row_pos = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
        row_seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))

        def dev32(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32).to(dev, non_blocking=True)

        rows = ConsumerRows(
            start=dev32(starts),
            count=dev32(counts),
            cu=dev32([0, *itertools.accumulate(counts)]),
            row_seq=row_seq.to(dev, non_blocking=True),
            row_pos=row_pos.to(dev, non_blocking=True),
            max_count=max(counts, default=0),
            max_end=max((s + c for s, c in zip(starts, counts, strict=True) if c), default=0),
        )
        return cls(producer, consumer, split, length, rows)


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
    # B scaled first (r x D per sequence): no alpha pass over the (B, L, H_kv·D) product, forward or backward
    return torch.baddbmm(v_rows, v_lr, (lora_b[roles].transpose(1, 2) * scaling).to(v_lr.dtype))


def _delta_b(lora_b: torch.Tensor, layout: RoleSplit, h_kv: int, scaling: float) -> torch.Tensor:
    """``s · (B_consumer - B_producer)`` per sequence and KV head, ``(B, H_kv, r, D)`` float32 (float64 stays)."""
    heads = lora_b_per_head(lora_b, h_kv)
    dt = torch.float64 if lora_b.dtype == torch.float64 else torch.float32
    return ((heads[layout.consumer] - heads[layout.producer]) * scaling).to(dt)


class _InputsTap(torch.autograd.Function):
    """Identity on the plain piece's inputs (queries, keys, values). Its backward runs right after that attention's
    backward and finishes :class:`_ConsumerCorrection`'s, from what it left in ``stash``: the correction's ``dq`` rows
    go into the attention's ``dq`` in place (the few rows never become a full-size gradient to be summed), and the
    corrected output rows go back into the output buffer, which the correction had restored for the attention's
    backward (so the output a caller holds does not change under a backward). The incoming ``dq`` is the attention
    backward's own (the tapped queries feed only the attention and the correction, which returns no ``dq``)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stash: dict):  # type: ignore[override]
        ctx.stash = stash
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq, gk, gv):  # type: ignore[override]
        redo = ctx.stash.pop("redo", None)
        if redo is not None:
            restore_rows(*redo)
        item = ctx.stash.pop("dq", None)
        if item is not None and gq is not None:
            add_dq_rows(gq, *item)
        return gq, gk, gv, None


class _ConsumerCorrection(torch.autograd.Function):
    """``out[b, :, t] += (P_t V_lr) ΔB_b`` for the consumer rows, where ``out`` is the causal attention over the
    producer's values ``V_prod`` (every row's softmax row ``P_t`` is the same whichever values it reads, so this
    turns a consumer row's output into ``P_t (V_base + s V_lr B_consumer)``).

    The update is written into ``out``'s storage without an autograd version bump. The backward writes the saved
    rows back before the attention's backward reads its output (FlashAttention derives ``rowsum(dO ∘ O)`` from it;
    :class:`_InputsTap` puts the corrected rows back after), and adds the correction's share of every gradient:
    through ``P`` (``dq``, ``dk``, ``dV_lr``: :func:`~kernels.consumer_rows.consumer_lr_backward`) and through ``ΔB``
    (``+`` to the consumer's B, ``-`` to the producer's).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v_lr: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
        layout: RoleSplit,
        stash: dict,
        use_kernel: bool,
    ) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):
            delta_b = _delta_b(lora_b.detach(), layout, k.shape[1], scaling)
            lse, o_lr, saved = consumer_lr_forward(q, k, v_lr, delta_b, out, layout.rows, use_kernel)
        ctx.save_for_backward(out, q, k, v_lr, delta_b, lse, o_lr, saved)
        ctx.scaling, ctx.layout, ctx.stash, ctx.use_kernel = scaling, layout, stash, use_kernel
        ctx.lora_b_shape, ctx.lora_b_dtype = lora_b.shape, lora_b.dtype
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out, q, k, v_lr, delta_b, lse, o_lr, saved = ctx.saved_tensors
        layout, rows, s, stash = ctx.layout, ctx.layout.rows, ctx.scaling, ctx.stash
        if "tapped" in stash:  # the attention has a backward: it must see its own output
            stash["redo"] = (out, rows, read_rows(out, rows))
            restore_rows(out, rows, saved)
        with torch.autocast(q.device.type, enabled=False):
            g = consumer_backward(grad, q, k, v_lr, delta_b, rows, lse, o_lr, ctx.use_kernel)
            if "tapped" in stash:
                stash["dq"] = (rows, g.dq_parts, k.shape[1], ctx.use_kernel)
            d_lora_b = None
            if ctx.needs_input_grad[4]:  # ΔB = s (B_consumer - B_producer): + to the consumer's B, - to the producer's
                x = g.x * s
                heads = x.new_zeros(ctx.lora_b_shape[0], *x.shape[1:])
                heads.index_add_(0, layout.consumer, x).index_add_(0, layout.producer, -x)
                d_lora_b = heads.transpose(-1, -2).reshape(ctx.lora_b_shape).to(ctx.lora_b_dtype)
        dk = g.dk.to(k.dtype).transpose(1, 2)  # (B, H_kv, T, D), token-major underneath like k
        return grad, None, dk, g.dv_lr.to(v_lr.dtype), d_lora_b, None, None, None, None


def two_piece_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_base: torch.Tensor,
    v_lr: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    layout: RoleSplit,
    use_kernel: bool = True,
) -> torch.Tensor:
    """:func:`decomposed_attention` with per-query roles, for sequences that are a producer's prefix and a
    consumer's suffix (the shared pass; no padding mask, queries = keys).

    A row's softmax row ``P_t`` does not depend on the values it reads, so with ``V_prod = V_base + s V_lr
    B_producer``: ``O_t = P_t V_prod`` for the producer's rows and ``O_t = P_t V_prod + (P_t V_lr) ΔB`` for the
    consumer's, ``ΔB = s (B_consumer - B_producer)``. The first piece is the plain pass's D-wide causal attention
    (same kernel, same cost); the second is an r-wide attention of the consumer rows only
    (:mod:`kernels.consumer_rows`: Triton on CUDA in half precision, PyTorch elsewhere), added in place.

    Args:
        q: ``(B, H_q, T, D)`` queries (RoPE applied; float32 under autocast is cast as SDPA would).
        k: ``(B, H_kv, T, D)`` keys.
        v_base: ``(B, H_kv, T, D)`` base values.
        v_lr: ``(B, T, r)`` low-rank cache.
        lora_b: ``(n_roles, H_kv·D, r)`` stacked up-projections of ``v_proj`` (PEFT layout).
        scaling: LoRA scaling.
        layout: the sequences' producer/consumer layout.
        use_kernel: allow the Triton kernels for the consumer rows.

    Returns:
        ``(B, H_q, T, D)`` in the compute dtype (:func:`compute_dtype` of ``q``), token-major underneath where the
        attention kernel makes it so (the output projection's reshape is then a view).
    """
    b, h_q, t, d = q.shape
    h_kv = k.shape[1]
    if k.shape[2] != t or layout.length != t:
        raise ValueError(f"two-piece attention needs as many queries as keys as the layout's length, got {t}, "
                         f"{k.shape[2]} and {layout.length}")  # fmt: skip
    dt = compute_dtype(q)
    q, k = q.to(dt), k.to(dt)
    v_rows = v_base.transpose(1, 2).reshape(b, t, h_kv * d).to(dt)  # a view when V_base is token-major
    lr = v_lr.to(dt)
    v_prod = _role_values(v_rows, lr, lora_b, layout.producer, scaling).view(b, t, h_kv, d).transpose(1, 2)
    stash: dict = {}
    if layout.rows.n_rows and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v_prod.requires_grad):
        q, k, v_prod = _InputsTap.apply(q, k, v_prod, stash)
        stash["tapped"] = True
    out = _sdpa(q, k, v_prod, None)  # (B, H_q, T, D): every row over the producer's values
    if not layout.rows.n_rows:
        return out
    return _ConsumerCorrection.apply(out, q, k, lr, lora_b, scaling, layout, stash, use_kernel)
