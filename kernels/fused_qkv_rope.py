"""The q/k/v GEMV of a one-row decode step with its RMSNorm before it and its RoPE, LoRA B and cache stores after it.

Why: at batch 1 an 8B decode step is a chain of latency-bound launches. After the norms moved into the GEMVs
(:mod:`kernels.fused_gemv`), every layer still ran the q/k/v GEMV, then a small RoPE-and-store kernel
(:func:`kernels.fused_ops.rope_store`: 4 µs on an H100, plus about 1 µs of gap before the attention) that reads the
GEMV's output back, adds q_proj's LoRA term, rotates q and k and writes k, v and V_lr into the cache. Here the GEMV's
programs do that work on the outputs they hold: one launch and one graph node fewer per layer. A ``full_shared`` step
also loses the two launches that applied v_proj's B (the role mask and its GEMM).

How: the fused weight holds q's, k's and v's rows, head after head, then the adapters' shared ``A`` rows
(:class:`~lragent.fused_weights.FusedGroup`). A program takes ``HB`` dims of each half of one head, so the pairs
``(d, d + D/2)`` that RoPE mixes meet in one program. One more program per 16 A rows multiplies them (every adapter's
``X·A``; v_proj's is stored as V_lr in a decomposed cache) and counts itself into a flag; the programs that add a LoRA
B (q_proj's; k_proj's and v_proj's where adapted and the cache is not decomposed) wait for the flag after their own
rows, then add ``s · X·A · B_roleᵀ``. Programs take tickets as they start and the first tickets do the A rows, so the
programs the others wait for are already running (no deadlock whatever order the GPU schedules them in); the last to
finish sets the counters back to zero for the next launch or graph replay. Both kinds of program run one loop, so the
kernel keeps the norm GEMV's registers (three programs an SM on an H100: one wave). Computing ``X·A`` in every q
program instead cost 11 µs a layer on an H100, more than the RoPE kernel it saves. Each value goes through the
roundings of the path it replaces (the GEMV's output rounded to the weight's dtype, the LoRA term added in float32 and
rounded, RoPE's products rounded as torch rounds), so only the GEMV's summation order can differ from
:func:`~kernels.fused_gemv.rms_norm_linear` followed by :func:`~kernels.fused_ops.rope_store`.

Limits: one row (batch-1 decode), CUDA fp16/bf16 or ``TRITON_INTERPRET=1``, head dim a power of two of at least
``2 · HB``, every adapter of one rank; :func:`usable` says whether a call may take it (the decoder keeps the unfused
path otherwise). One launch at a time per device and dtype (the counters are shared, as the decode attention's
workspace is). ``LRAGENT_QKV_ROPE=0`` switches it off (``bench decode --plans '["", "qkv_rope=0"]'`` times both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device
from kernels.fused_ops import kernels_usable

try:
    import triton
    import triton.language as tl

    from kernels.fused_ops import _rope_half
except ImportError:  # pragma: no cover
    triton = None
    tl = None

SWITCH_ENV = "LRAGENT_QKV_ROPE"
"""1 (default): one-row decode steps take :func:`qkv_rope_store`; 0: the q/k/v GEMV then the RoPE-and-store kernel."""

HALF_BLOCK = 8
"""Dims a program takes from each half of a head: 16 outputs a program, as the norm GEMV's measured launch
(``kernels.fused_gemv.NORM_CONFIG``)."""

BLOCK_K = 512
NUM_WARPS = 8
DEFERRED = True
MAXNREG: int | None = None


def qkv_rope_switch(value: str | None = None) -> int:
    """``LRAGENT_QKV_ROPE`` (or ``value``): 1 on (unset or empty too), 0 off.

    Raises:
        ValueError: anything else, named with what is allowed.
    """
    raw = (os.environ.get(SWITCH_ENV, "") if value is None else value).strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(
            f"{SWITCH_ENV}={raw!r}: allowed 0 (off) or 1 (on: RoPE and the cache stores in the q/k/v GEMV)"
        )
    return int(raw)


@dataclass(frozen=True)
class LoraTerm:
    """One adapted projection of the fused q/k/v weight.

    Attributes:
        a_row: first row of its shared ``A`` in the fused weight.
        b: ``(n_roles, d_out, r)`` every role's B, contiguous, in the weight's dtype.
        scaling: alpha / r.
    """

    a_row: int
    b: Tensor
    scaling: float


if triton is not None:

    @triton.jit
    def _norm_statistic(X, n_in, eps, BLOCK_K: tl.constexpr):
        """``1 / sqrt(mean(h²) + eps)`` of the one row ``X``, ``(1,)``, as ``_rms_norm_gemv_kernel`` computes it."""
        ks = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, 1)
        sq = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k_ok = k0 + ks < n_in
            hf = tl.load(X + rows[:, None] * n_in + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            sq += hf * hf
        return 1.0 / tl.sqrt(tl.sum(sq, axis=1) / n_in + eps)

    @triton.jit
    def _normed_rows(
        X, NW, W, offs_n, n_ok, n_in, inv, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEFERRED: tl.constexpr
    ):  # fmt: skip
        """``Σ_k W[n, k] · xin[k]`` (float32) for the ``BLOCK_N`` rows ``offs_n`` of W, ``xin`` the normed row rounded
        as the norm GEMV rounds it; ``DEFERRED``: the sum over K taken once after the loop (as the norm GEMV's one-row
        launch), else tile by tile (fewer registers)."""
        ks = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, 1)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K] if DEFERRED else [1, 1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k_ok = k0 + ks < n_in
            h = tl.load(X + rows[:, None] * n_in + (k0 + ks)[None, :], mask=k_ok[None, :], other=0.0)
            normed = (h.to(tl.float32) * inv[:, None]).to(X.dtype.element_ty)
            nw = tl.load(NW + k0 + ks, mask=k_ok, other=0.0)
            xin = (nw[None, :] * normed).to(X.dtype.element_ty).to(tl.float32)
            w = tl.load(W + offs_n[:, None] * n_in + (k0 + ks)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if DEFERRED:
                acc2 += w.to(tl.float32) * xin
            else:
                acc += tl.sum(w.to(tl.float32) * xin, axis=1)
        if DEFERRED:
            acc = tl.sum(acc2, axis=1)
        return acc

    @triton.jit
    def _qkv_rope_store_kernel(
        X, NW, W, COS, SIN, QOUT, KP, VP, LRP, LRBUF, SYNC, POS, KV_SLOT, LR_SLOT, ROLE, QB, KB, VB,
        n_in, eps, n_q_heads, n_kv_heads, n_base, n_a, rank, a_q, a_k, a_v, s_q, s_k, s_v, lora_q, lora_k, lora_v,
        stride_kps, stride_kph, stride_kpl, stride_vps, stride_vph, stride_vpl, stride_lrs, stride_lrl,
        stride_qbr, stride_kbr, stride_vbr,
        HEAD_D: tl.constexpr, HB: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr, A_PROGS: tl.constexpr,
        STORE_VLR: tl.constexpr, DEFERRED: tl.constexpr,
    ):  # fmt: skip
        """Grid (A_PROGS + (H_q + 2·H_kv) · D / (2·HB),). Each program takes a ticket as it starts. Tickets below
        ``A_PROGS`` multiply ``2·HB`` of the A rows each (every adapter's X·A, into ``LRBUF``; v's into the V_lr cache)
        and count themselves into the flag; ticket ``A_PROGS + t`` takes head ``t // (D / 2HB)`` of q, then k, then v
        (their rows follow each other in W) and dims ``blk·HB + [0, HB)`` of each half, ``blk = t % (D / 2HB)``, and
        waits for the flag only where it adds a LoRA B. Tickets rather than program ids: the programs others wait for
        are already running. One loop for both kinds keeps the registers of one (three programs an SM on an H100)."""
        HALF: tl.constexpr = HEAD_D // 2
        PER_HEAD: tl.constexpr = HALF // HB
        BLOCK_N: tl.constexpr = 2 * HB
        dt = W.dtype.element_ty
        if A_PROGS > 0:
            ticket = tl.atomic_add(SYNC, 1, sem="relaxed", scope="gpu")  # SYNC: (ticket, flag, finished)
        else:
            ticket = tl.program_id(0)
        inv = _norm_statistic(X, n_in, eps, BLOCK_K)  # needs no ticket: runs while the atomic is in flight
        i = tl.arange(0, BLOCK_N)
        is_a = ticket < A_PROGS
        t = tl.maximum(ticket - A_PROGS, 0)
        unit = t // PER_HEAD
        blk = t % PER_HEAD
        dims = (i // HB) * HALF + blk * HB + i % HB  # a head program's dims of its head: HB of each half
        a_at = tl.minimum(ticket, A_PROGS - 1) * BLOCK_N + i  # an A program's rows, from the first A row
        offs_n = tl.where(is_a, n_base + a_at, unit * HEAD_D + dims)
        n_ok = tl.where(is_a, a_at < n_a, dims >= 0)
        # what a head program's epilogue reads but the A rows do not decide, loaded before the loop (latency hidden)
        rr = tl.arange(0, R_PAD)
        is_q = unit < n_q_heads
        is_k = (unit >= n_q_heads) & (unit < n_q_heads + n_kv_heads)
        is_v = unit >= n_q_heads + n_kv_heads
        local = (unit - tl.where(is_q, 0, tl.where(is_k, n_q_heads, n_q_heads + n_kv_heads))) * HEAD_D + dims
        b_on = ((is_q & (lora_q != 0)) | (is_k & (lora_k != 0)) | (is_v & (lora_v != 0))) & (ticket >= A_PROGS)
        role = tl.load(ROLE).to(tl.int64)
        bp = tl.where(is_q, QB + role * stride_qbr, tl.where(is_k, KB + role * stride_kbr, VB + role * stride_vbr))
        b = tl.load(bp + local[:, None] * rank + rr[None, :], mask=rr[None, :] < tl.where(b_on, rank, 0), other=0.0)
        scale = tl.where(is_q, s_q, tl.where(is_k, s_k, s_v))
        d1 = blk * HB + tl.arange(0, HB)
        c1, c2 = tl.load(COS + d1), tl.load(COS + HALF + d1)
        s1, s2 = tl.load(SIN + d1), tl.load(SIN + HALF + d1)
        pos = tl.load(POS).to(tl.int64)
        y = _normed_rows(X, NW, W, offs_n, n_ok, n_in, inv, BLOCK_N, BLOCK_K, DEFERRED).to(dt)
        if is_a:
            tl.store(LRBUF + a_at, y, mask=n_ok)
            if STORE_VLR:  # v_proj's X·A is the cache's V_lr
                lslot = tl.load(LR_SLOT).to(tl.int64)
                at = n_base + a_at - a_v
                tl.store(LRP + lslot * stride_lrs + pos * stride_lrl + at, y, mask=n_ok & (at >= 0) & (at < rank))
            tl.debug_barrier()  # every thread's stores precede the release
            tl.atomic_add(SYNC + 1, 1, sem="release", scope="gpu")
        else:
            if b_on:
                # wait for every A program: plain loads poll (they do not queue at the L2 as atomics do), then one
                # acquire orders the X·A loads after the flag
                while tl.load(SYNC + 1, volatile=True) < A_PROGS:
                    pass
                tl.atomic_add(SYNC + 1, 0, sem="acquire", scope="gpu")
                a_row = tl.where(is_q, a_q, tl.where(is_k, a_k, a_v))
                lr = tl.load(LRBUF + a_row - n_base + rr, mask=rr < rank, other=0.0, cache_modifier=".cg")
                term = tl.sum(b.to(tl.float32) * lr.to(tl.float32)[None, :], axis=1)
                y = (y.to(tl.float32) + scale * term).to(dt)  # as the GEMM epilogue or addmm it replaces rounds
            slot = tl.load(KV_SLOT).to(tl.int64)
            if is_v:
                g = unit - n_q_heads - n_kv_heads
                tl.store(VP + slot * stride_vps + g * stride_vph + pos * stride_vpl + dims, y)
            else:
                # the two halves apart (a select and a sum over 2: exact), rotated, stored where they belong
                y2 = tl.reshape(y.to(tl.float32), (2, HB))
                half = tl.arange(0, 2)[:, None]
                x1 = tl.sum(tl.where(half == 0, y2, 0.0), axis=0).to(dt)
                x2 = tl.sum(tl.where(half == 1, y2, 0.0), axis=0).to(dt)
                o1, o2 = _rope_half(x1, x2, c1, c2, s1, s2)
                if is_q:
                    dst = QOUT + unit * HEAD_D
                else:
                    dst = KP + slot * stride_kps + (unit - n_q_heads) * stride_kph + pos * stride_kpl
                tl.store(dst + d1, o1)
                tl.store(dst + HALF + d1, o2)
        if A_PROGS > 0:  # the last program to finish leaves (ticket, flag, finished) at zero for the next launch
            tl.debug_barrier()
            done = tl.atomic_add(SYNC + 2, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(0) - 1:
                tl.store(SYNC + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32), mask=tl.arange(0, 4) < 3)


_SCRATCH: dict[tuple, list] = {}  # (device, dtype, A rows) -> [int32 (ticket, flag, finished), X·A rows, zero them]


def _scratch(device: torch.device, dtype: torch.dtype, n_a: int) -> tuple[Tensor, Tensor]:
    """The cached sync counters and X·A buffer of this device, dtype and A-row count; allocated on first use. Allocated
    during graph capture, the zeroing is a graph node that runs only on replay: an eager call before any replay
    zeroes the counters itself. One launch at a time per device (every launch leaves them at zero)."""
    key = (device, dtype, n_a)
    entry = _SCRATCH.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if entry is None:
        sync = torch.zeros(4, dtype=torch.int32, device=device)
        entry = _SCRATCH[key] = [sync, torch.empty(max(n_a, 1), dtype=dtype, device=device), capturing]
    elif entry[2] and not capturing:
        entry[0].zero_()
        entry[2] = False
    return entry[0], entry[1]


def usable(
    h: Tensor, weight: Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int, lora: dict[str, LoraTerm]
) -> bool:
    """Whether :func:`qkv_rope_store` takes this call: one row on a device the kernels run on, the fused weight's
    dtype, a head dim it can split (a power of two, at least two blocks of :data:`HALF_BLOCK`), q/k/v rows that fill
    the start of the weight, and adapters of one rank whose B are contiguous in the weight's dtype."""
    if not kernels_usable(h) or h.numel() != h.shape[-1] or weight.dtype != h.dtype or not weight.is_contiguous():
        return False
    if head_dim < 2 * HALF_BLOCK or head_dim & (head_dim - 1) or weight.shape[1] != h.shape[-1]:
        return False
    if weight.shape[0] < (n_q_heads + 2 * n_kv_heads) * head_dim:
        return False
    ranks = {t.b.shape[-1] for t in lora.values()}
    return len(ranks) <= 1 and all(t.b.is_contiguous() and t.b.dtype == weight.dtype for t in lora.values())


@on_tensor_device
def qkv_rope_store(
    h: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    cos: Tensor,
    sin: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    lr_pool: Tensor | None,
    kv_slot: Tensor,
    lr_slot: Tensor,
    pos: Tensor,
    role: Tensor,
    lora: dict[str, LoraTerm],
    v_lr_a_row: int | None = None,
) -> Tensor:
    """One launch: ``y = rms_norm(h) @ Wᵀ`` for q/k/v, each adapted module's ``s · X·A · B_roleᵀ`` added, RoPE on q
    and k, k and v written into the pools at the row's slot and position (and V_lr, v_proj's ``X·A``, into
    ``lr_pool``); returns the rotated queries.

    Args:
        h: ``(1, hidden)`` (any shape of one row) the residual stream entering the layer.
        norm_weight: ``(hidden,)`` the input RMSNorm's weight; ``eps`` its epsilon.
        weight: ``(H_q·D + 2·H_kv·D + Σ r, hidden)`` the fused q/k/v weight with its ``A`` rows.
        n_q_heads: H_q; ``n_kv_heads`` H_kv; ``head_dim`` D.
        cos: ``(D,)`` (any shape of D values) and ``sin``: the row's position's RoPE table, in h's dtype.
        k_pool: ``(S, H_kv, C, D)``; ``v_pool`` the same.
        lr_pool: ``(S_lr, C, r)`` with a decomposed cache, else None.
        kv_slot: ``(1,)`` the row's slot; ``lr_slot`` ``(1,)`` its V_lr slot; ``pos`` ``(1,)`` its position.
        role: ``(1,)`` the row's role.
        lora: ``{"q" | "k" | "v": LoraTerm}``: the modules whose B is applied here (not v_proj of a decomposed cache).
        v_lr_a_row: first row of v_proj's ``A`` where ``lr_pool`` is given (its ``X·A`` is stored, B not applied).

    Returns:
        ``(1, H_q, D)`` the rotated queries.

    Raises:
        ValueError: a call :func:`usable` refuses, or a pool without its A rows (a caller's bug, named).
    """
    if not usable(h, weight, n_q_heads, n_kv_heads, head_dim, lora):
        raise ValueError("qkv_rope_store: this call is not one it takes (see kernels.fused_qkv_rope.usable)")
    if (lr_pool is None) != (v_lr_a_row is None):
        raise ValueError("qkv_rope_store: lr_pool and v_lr_a_row go together (a decomposed cache stores v's X·A)")
    unknown = set(lora) - {"q", "k", "v"}
    if unknown:
        raise ValueError(f"qkv_rope_store: unknown modules {sorted(unknown)}; allowed q, k, v")
    x = h.reshape(-1).contiguous()
    n_base = (n_q_heads + 2 * n_kv_heads) * head_dim
    n_a = weight.shape[0] - n_base
    rank = next(iter(lora.values())).b.shape[-1] if lora else (lr_pool.shape[-1] if lr_pool is not None else 1)
    has_a = bool(lora) or lr_pool is not None
    a_progs = -(-n_a // (2 * HALF_BLOCK)) if has_a else 0
    q_out = torch.empty((1, n_q_heads, head_dim), dtype=h.dtype, device=h.device)
    sync, lr_buf = _scratch(h.device, weight.dtype, n_a)
    dummy = LoraTerm(n_base, weight, 0.0)
    tq, tk, tv = (lora.get(m, dummy) for m in "qkv")
    lrp = lr_pool if lr_pool is not None else k_pool
    lr_strides = (lrp.stride(0), lrp.stride(1)) if lr_pool is not None else (0, 0)
    a_v = v_lr_a_row if v_lr_a_row is not None else tv.a_row
    grid = (a_progs + (n_q_heads + 2 * n_kv_heads) * head_dim // (2 * HALF_BLOCK),)
    _qkv_rope_store_kernel[grid](
        x, norm_weight, weight, cos.reshape(-1), sin.reshape(-1), q_out, k_pool, v_pool, lrp, lr_buf, sync, pos,
        kv_slot, lr_slot, role, tq.b, tk.b, tv.b,
        x.numel(), float(eps), n_q_heads, n_kv_heads, n_base, n_a, rank, tq.a_row, tk.a_row, a_v,
        float(tq.scaling), float(tk.scaling), float(tv.scaling), int("q" in lora), int("k" in lora), int("v" in lora),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        *lr_strides, tq.b.stride(0), tk.b.stride(0), tv.b.stride(0),
        HEAD_D=head_dim, HB=HALF_BLOCK, BLOCK_K=BLOCK_K, R_PAD=max(2, triton.next_power_of_2(rank)), A_PROGS=a_progs,
        STORE_VLR=lr_pool is not None, DEFERRED=DEFERRED, num_warps=NUM_WARPS,
        **({"maxnreg": MAXNREG} if MAXNREG else {}),
    )  # fmt: skip
    return q_out
