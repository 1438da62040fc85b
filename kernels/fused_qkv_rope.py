"""The q/k/v GEMV of a one-row decode step with its RMSNorm before it and RoPE and the cache stores after it.

Why: at batch 1 an 8B decode step is a chain of latency-bound launches. After the norms moved into the GEMVs
(:mod:`kernels.fused_gemv`), every layer still ran the q/k/v GEMV, then a RoPE-and-store kernel
(:func:`kernels.fused_ops.rope_store`: 4 µs on an H100, plus a graph node's gap before the attention) that reads the
GEMV's output back, adds q's LoRA term, rotates q and k and writes k, v and V_lr into the cache. Here the GEMV's
programs do that work on the outputs they hold: one launch and one graph node fewer per layer.

How: the fused weight holds q's, k's and v's rows, head after head, then the adapters' shared ``A`` rows
(:class:`~lragent.fused_weights.FusedGroup`). A head program takes ``HB`` dims of each half of one head, so the pairs
``(d, d + D/2)`` that RoPE mixes meet in one program; it rotates q's base part (or k, stored into the cache) or stores
v. q's LoRA term needs ``X·A_q``, which other rows of the GEMV produce: waiting for them inside the launch cost as much
as the kernel it saves (``results/engine_h100/qkv_rope_2026-11-28``). Instead a few more programs each multiply the
``A_q`` rows themselves and compute the term for ``HPP`` heads, rotated (RoPE is linear:
``RoPE(q + s·X·A·Bᵀ) = RoPE(q) + s·X·A·RoPE(B)ᵀ``), into a float32 buffer that the decode attention adds to q as it
loads it (:func:`kernels.flash_lora_decode.flash_lora_decode`'s ``q_add``). One more program multiplies v's ``A`` rows
into the V_lr cache. Nobody waits for anybody. Rounding: k, v and V_lr are bit for bit what the replaced path writes
(up to the GEMV's summation order); q is ``RoPE(q_base) + RoPE(term)`` rounded once where the replaced path rounded
``q_base + term`` and then each RoPE product: a last-place difference.

A full cache (``full_shared``, ``non_shared``) stores ``v + s·X·A_v·B_roleᵀ``, not V_lr: there each v program multiplies
v's ``A`` rows too, in the same pass over the row as its own rows (the ``A`` rows read from L2 by every v program; 24
live rows where the others have 16), and adds its dims of the term before the store, rounded as the replaced path's
``addmm`` (the products summed in float32 onto the rounded base, one rounding). Before this the full-cache step kept the
unfused path, 0.2 ms slower than ``base_lr_shared``'s at batch 1 on an H200 (8B, 2k: 4.73 against 4.53 ms,
``results/engine_h200/pdl_2026-11-29``).

Limits: one row (batch-1 decode), CUDA fp16/bf16 or ``TRITON_INTERPRET=1``, head dim a power of two of at least
``2 · HB``, LoRA rank at most ``2 · HB``, only q and v adapted; :func:`usable` says whether a call may take it (the
decoder keeps the unfused path otherwise). On by default; ``LRAGENT_QKV_ROPE=0`` switches it off (``bench decode
--plans '["", "qkv_rope=0"]'`` times both).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device
from kernels.fused_ops import kernels_usable
from kernels.pdl import pdl_launch

try:
    import triton
    import triton.language as tl

    from kernels.fused_gemv import _normed_input, _rms_inverse, _row_times_w_deferred
    from kernels.fused_ops import _rope_half
except ImportError:  # pragma: no cover
    triton = None
    tl = None

SWITCH_ENV = "LRAGENT_QKV_ROPE"
"""1 (the default, unset too): one-row decode steps take :func:`qkv_rope_store` (a full cache's too, since it adds v's
LoRA term itself); 0: the q/k/v GEMV then the RoPE-and-store kernel. On an H100 it made the 8B batch-1 step 0.02-0.06
ms faster in all five paired turns of two runs (``results/engine_h100/qkv_rope_2026-11-28``); on by default since the
whole GPU suite passed with it on (4 × H200, 0674d5a: ``results/gpu_tests/``)."""

HALF_BLOCK = 8
"""Dims a head program takes from each half of a head: 16 outputs a program, as the norm GEMV's measured launch."""

HEADS_PER_TERM_PROGRAM = 4
"""Query heads whose LoRA term one program computes (8 programs for 32 heads)."""

BLOCK_K = 512
NUM_WARPS = 8


MAXNREG_ENV = "LRAGENT_QKV_MAXNREG"
"""Registers per thread the one-launch q/k/v kernel may take in the decoder: :data:`DEFAULT_MAXNREG` when unset, 0 the
compiler's choice, else that cap (Triton's ``maxnreg``). Why a cap: compiled for sm_90 the kernel takes 93-99
registers, so two 8-warp programs fit an SM and the 8B grid (393 programs) runs in two waves on 132 SMs; at 80 (no
spill, offline compile with Triton 3.6) three fit and it runs in one. On an H200 (2026-11-28, bench decode, 8B, 2k,
four paired turns) the `base_lr_shared` batch-1 step took 4.705-4.724 ms at 80 against 4.839-4.871 at the compiler's
count, every output bit for bit the same (tests/test_fused_qkv_rope.py); ``results/engine_h200/readme_2026-11-28``."""

DEFAULT_MAXNREG = 80
MAXNREG_RANGE = (32, 255)


def qkv_maxnreg(value: str | None = None) -> int:
    """``LRAGENT_QKV_MAXNREG`` (or ``value``): unset or empty :data:`DEFAULT_MAXNREG`; 0 the compiler's register
    count; else the cap.

    Raises:
        ValueError: anything but 0 or a whole number in :data:`MAXNREG_RANGE`, named with what is allowed.
    """
    raw = (os.environ.get(MAXNREG_ENV, "") if value is None else value).strip() or str(DEFAULT_MAXNREG)
    lo, hi = MAXNREG_RANGE
    if not raw.isdigit() or not (int(raw) == 0 or lo <= int(raw) <= hi):
        raise ValueError(f"{MAXNREG_ENV}={raw!r}: allowed 0 (the compiler's choice) or registers {lo}-{hi}")
    return int(raw)


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


if triton is not None:

    @triton.jit
    def _normed_rows(X, NW, W, offs_n, n_ok, n_in, inv, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """``Σ_k W[n, k] · xin[k]`` (float32, the sum over K taken once after the loop) for the ``BLOCK_N`` rows
        ``offs_n`` of W: the norm GEMV's one-row deferred launch, from its own pieces, so the sums are its sums."""
        ks = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, 1)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k_ok = k0 + ks < n_in
            xin = _normed_input(X, X, NW, rows, rows < 1, n_in, inv, k0, ks, k_ok, False)
            acc2 = _row_times_w_deferred(W, offs_n, n_ok, k0 + ks, k_ok, n_in, xin, acc2)
        return tl.sum(acc2, axis=1)

    @triton.jit
    def _qkv_rope_store_kernel(
        X, NW, W, COS, SIN, QOUT, QADD, KP, VP, LRP, POS, KV_SLOT, LR_SLOT, ROLE, QB, VB,
        n_in, eps, n_q_heads, n_kv_heads, rank, a_q, a_v, s_q, s_v, n_term,
        stride_kps, stride_kph, stride_kpl, stride_vps, stride_vph, stride_vpl, stride_lrs, stride_lrl, stride_qbr,
        stride_vbr,
        HEAD_D: tl.constexpr, HB: tl.constexpr, HPP: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr,
        FULL_V: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (1 + n_term + (H_q + 2·H_kv) · D / (2·HB),): program 0 multiplies v's A rows into the V_lr cache
        (``FULL_V``, a full cache: nothing); programs 1..n_term multiply q's A rows and write q's rotated LoRA term of
        ``HPP`` heads each into ``QADD`` (n_term = 0: q has no adapter); program ``1 + n_term + t`` takes head
        ``t // (D / 2HB)`` of q, then k, then v (their rows follow each other in W) and dims ``blk·HB + [0, HB)`` of
        each half, ``blk = t % (D / 2HB)``; with ``FULL_V`` a v program multiplies v's A rows too and adds its dims of
        v's LoRA term ``s_v · X·A_v · VB[role]ᵀ`` before the store."""
        HALF: tl.constexpr = HEAD_D // 2
        PER_HEAD: tl.constexpr = HALF // HB
        BLOCK_N: tl.constexpr = 2 * HB
        dt = W.dtype.element_ty
        pid = tl.program_id(0)
        i = tl.arange(0, BLOCK_N)
        is_vlr = pid == 0
        is_term = (pid >= 1) & (pid < 1 + n_term)
        t = tl.maximum(pid - 1 - n_term, 0)
        unit = t // PER_HEAD
        blk = t % PER_HEAD
        dims = (i // HB) * HALF + blk * HB + i % HB  # a head program's dims of its head: HB of each half
        offs_n = tl.where(is_vlr, a_v + i, tl.where(is_term, a_q + i, unit * HEAD_D + dims))
        n_ok = tl.where(is_vlr | is_term, i < rank, dims >= 0)
        rows = tl.arange(0, 1)
        if PDL:  # kernels/pdl.py: the previous kernel's output (x, the positions, cos/sin) is visible past this point
            tl.extra.cuda.gdc_wait()
        inv = _rms_inverse(X, X, X, rows, rows < 1, n_in, eps, pid, False, 1, BLOCK_K)  # the norm GEMV's
        if FULL_V:
            is_v = (pid > n_term) & (unit >= n_q_heads + n_kv_heads)
        else:
            is_v = pid < 0
        if is_v:
            # a full cache's v program: its v rows and v's A rows in one pass (2·BLOCK_N rows, of which BLOCK_N +
            # rank live; half the K block keeps the accumulator's registers); the halves apart by a select and a sum
            j = tl.arange(0, 2 * BLOCK_N)
            jv = j % BLOCK_N
            own = j < BLOCK_N
            offs2 = tl.where(own, unit * HEAD_D + (jv // HB) * HALF + blk * HB + jv % HB, a_v + jv)
            yv = _normed_rows(X, NW, W, offs2, own | (jv < rank), n_in, inv, 2 * BLOCK_N, BLOCK_K // 2)
            yv = tl.reshape(yv, (2, BLOCK_N))
            part = tl.arange(0, 2)[:, None]
            y = tl.sum(tl.where(part == 0, yv, 0.0), axis=0).to(dt)
            xa_v = tl.sum(tl.where(part == 1, yv, 0.0), axis=0).to(dt)  # X·A_v, rounded as the GEMV stores it
        else:
            y = _normed_rows(X, NW, W, offs_n, n_ok, n_in, inv, BLOCK_N, BLOCK_K).to(dt)
            xa_v = y  # unused here; both branches must define it alike (Triton)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        pos = tl.load(POS).to(tl.int64)
        if is_vlr:  # v_proj's X·A is the cache's V_lr (a full cache has none: its v programs add v's term)
            if not FULL_V:
                lslot = tl.load(LR_SLOT).to(tl.int64)
                tl.store(LRP + lslot * stride_lrs + pos * stride_lrl + i, y, mask=i < rank)
        elif is_term:
            # s · X·A_q · B_roleᵀ for HPP heads, both halves, rotated in float32
            heads = (pid - 1) * HPP + tl.arange(0, HPP)
            h_ok = heads < n_q_heads
            jj = tl.arange(0, HALF)
            role = tl.load(ROLE).to(tl.int64)
            # X·A rounded as the GEMV stores it, its first R_PAD entries (zero past the rank; a select and a sum)
            y2 = tl.reshape(y.to(tl.float32), (BLOCK_N // R_PAD, R_PAD))
            lr = tl.sum(tl.where(tl.arange(0, BLOCK_N // R_PAD)[:, None] == 0, y2, 0.0), axis=0)
            rr = tl.arange(0, R_PAD)
            out_row = heads[:, None] * HEAD_D + jj[None, :]  # (HPP, HALF): rows of B for the first half
            bp = QB + role * stride_qbr + (out_row * rank)[:, :, None] + rr[None, None, :]
            m3 = h_ok[:, None, None] & (rr < rank)[None, None, :]
            t1 = tl.sum(tl.load(bp, mask=m3, other=0.0).to(tl.float32) * lr[None, None, :], axis=2) * s_q
            t2 = tl.sum(tl.load(bp + HALF * rank, mask=m3, other=0.0).to(tl.float32) * lr[None, None, :], axis=2) * s_q
            c1 = tl.load(COS + jj).to(tl.float32)[None, :]
            c2 = tl.load(COS + HALF + jj).to(tl.float32)[None, :]
            s1 = tl.load(SIN + jj).to(tl.float32)[None, :]
            s2 = tl.load(SIN + HALF + jj).to(tl.float32)[None, :]
            dst = QADD + heads[:, None] * HEAD_D + jj[None, :]
            tl.store(dst, t1 * c1 - t2 * s1, mask=h_ok[:, None])
            tl.store(dst + HALF, t2 * c2 + t1 * s2, mask=h_ok[:, None])
        else:
            slot = tl.load(KV_SLOT).to(tl.int64)
            if unit >= n_q_heads + n_kv_heads:
                g = unit - n_q_heads - n_kv_heads
                if FULL_V:
                    # v + s · X·A_v · B_roleᵀ on this program's dims, as the replaced path's addmm: X·A rounded as
                    # the GEMV stores it, the products summed in float32 onto v's rounded base, rounded once
                    role = tl.load(ROLE).to(tl.int64)
                    bp = VB + role * stride_vbr + (g * HEAD_D + dims)[:, None] * rank + i[None, :]
                    bv = tl.load(bp, mask=(i < rank)[None, :], other=0.0).to(tl.float32)
                    term = tl.sum(bv * xa_v.to(tl.float32)[None, :], axis=1)
                    y = (y.to(tl.float32) + s_v * term).to(dt)
                tl.store(VP + slot * stride_vps + g * stride_vph + pos * stride_vpl + dims, y)
            else:
                # the two halves apart (a select and a sum over 2: exact), rotated, stored where they belong
                y2 = tl.reshape(y.to(tl.float32), (2, HB))
                half = tl.arange(0, 2)[:, None]
                x1 = tl.sum(tl.where(half == 0, y2, 0.0), axis=0).to(dt)
                x2 = tl.sum(tl.where(half == 1, y2, 0.0), axis=0).to(dt)
                d1 = blk * HB + tl.arange(0, HB)
                o1, o2 = _rope_half(
                    x1, x2, tl.load(COS + d1), tl.load(COS + HALF + d1), tl.load(SIN + d1), tl.load(SIN + HALF + d1)
                )
                if unit < n_q_heads:
                    dst = QOUT + unit * HEAD_D
                else:
                    dst = KP + slot * stride_kps + (unit - n_q_heads) * stride_kph + pos * stride_kpl
                tl.store(dst + d1, o1)
                tl.store(dst + HALF + d1, o2)


def usable(h: Tensor, weight: Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int, rank: int) -> bool:
    """Whether :func:`qkv_rope_store` takes this call: one row on a device the kernels run on, the fused weight's
    dtype, a head dim it can split (a power of two, at least two blocks of :data:`HALF_BLOCK`), a rank of at most
    ``2 · HALF_BLOCK``, and q/k/v rows that fill the start of the weight."""
    if not kernels_usable(h) or h.numel() != h.shape[-1] or weight.dtype != h.dtype or not weight.is_contiguous():
        return False
    if head_dim < 2 * HALF_BLOCK or head_dim & (head_dim - 1) or weight.shape[1] != h.shape[-1]:
        return False
    return 1 <= rank <= 2 * HALF_BLOCK and weight.shape[0] >= (n_q_heads + 2 * n_kv_heads) * head_dim + rank


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
    v_a_row: int,
    q_lora: tuple[int, Tensor, float, Tensor] | None,
    maxnreg: int = 0,
    v_lora: tuple[Tensor, float, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One launch: ``y = rms_norm(h) @ Wᵀ`` for q/k/v, RoPE on q's base part and on k, k and v written into the pools
    at the row's slot and position, v_proj's ``X·A`` into ``lr_pool`` (a decomposed cache) or v's LoRA term added to
    v before it is stored (a full cache, ``v_lora``), and q_proj's LoRA term rotated into a float32 buffer for the
    attention to add.

    Args:
        h: ``(1, hidden)`` (any shape of one row) the residual stream entering the layer.
        norm_weight: ``(hidden,)`` the input RMSNorm's weight; ``eps`` its epsilon.
        weight: ``(H_q·D + 2·H_kv·D + Σ r, hidden)`` the fused q/k/v weight with its ``A`` rows.
        n_q_heads: H_q; ``n_kv_heads`` H_kv; ``head_dim`` D.
        cos: ``(D,)`` (any shape of D values) and ``sin``: the row's position's RoPE table, in h's dtype.
        k_pool: ``(S, H_kv, C, D)``; ``v_pool`` the same (V_base).
        lr_pool: ``(S_lr, C, r)`` the V_lr pool; None for a full cache (then ``v_lora`` is required).
        kv_slot: ``(1,)`` the row's slot; ``lr_slot`` ``(1,)`` its V_lr slot; ``pos`` ``(1,)`` its position.
        v_a_row: first row of v_proj's ``A`` in ``weight``.
        q_lora: ``(a_row, b, s, role)``: q_proj's first ``A`` row, every role's B ``(n_roles, H_q·D, r)`` (contiguous,
            the weight's dtype), its scaling and the row's role ``(1,)``; None: q has no adapter.
        maxnreg: registers per thread the launch may take; 0 the compiler's choice (the decoder passes
            :data:`MAXNREG_ENV`'s value, :data:`DEFAULT_MAXNREG` unless set).
        v_lora: ``(b, s, role)`` for a full cache: v_proj's B for every role ``(n_roles, H_kv·D, r)`` (contiguous,
            the weight's dtype), its scaling and the row's role ``(1,)``; the stored v is
            ``v + s · X·A_v · B_roleᵀ``. None with a V_lr pool.

    Returns:
        ``(q, q_add)``: ``(1, H_q, D)`` the rotated base queries and ``(1, H_q, D)`` float32 their rotated LoRA term
        (None without ``q_lora``), which :func:`~kernels.flash_lora_decode.flash_lora_decode` adds.

    Raises:
        ValueError: a call :func:`usable` refuses.
    """
    if (lr_pool is None) == (v_lora is None):
        given = "neither" if lr_pool is None else "both"
        raise ValueError(
            f"qkv_rope_store: give one of lr_pool (a decomposed cache) and v_lora (a full cache), got {given}"
        )
    rank = lr_pool.shape[-1] if lr_pool is not None else v_lora[0].shape[-1]
    if not usable(h, weight, n_q_heads, n_kv_heads, head_dim, rank):
        raise ValueError("qkv_rope_store: this call is not one it takes (see kernels.fused_qkv_rope.usable)")
    if q_lora is not None and (q_lora[1].shape[-1] != rank or not q_lora[1].is_contiguous()):
        raise ValueError(f"qkv_rope_store: q's B must be contiguous of rank {rank}, got {tuple(q_lora[1].shape)}")
    if v_lora is not None and (
        v_lora[0].shape[-2:] != (n_kv_heads * head_dim, rank)
        or not v_lora[0].is_contiguous()
        or v_lora[0].dtype != weight.dtype
    ):
        raise ValueError(
            f"qkv_rope_store: v's B must be contiguous (n_roles, {n_kv_heads * head_dim}, {rank}) in {weight.dtype}, "
            f"got {tuple(v_lora[0].shape)} {v_lora[0].dtype}"
        )
    x = h.reshape(-1).contiguous()
    q_out = torch.empty((1, n_q_heads, head_dim), dtype=h.dtype, device=h.device)
    q_add = torch.empty((1, n_q_heads, head_dim), dtype=torch.float32, device=h.device) if q_lora else None
    a_q, b_q, s_q, role = q_lora if q_lora is not None else (v_a_row, weight, 0.0, kv_slot)
    b_v, s_v, v_role = v_lora if v_lora is not None else (weight, 0.0, role)
    role = v_role if q_lora is None else role  # the one row's role: both name it (no host check: graph capture)
    n_term = -(-n_q_heads // HEADS_PER_TERM_PROGRAM) if q_lora is not None else 0
    grid = (1 + n_term + (n_q_heads + 2 * n_kv_heads) * head_dim // (2 * HALF_BLOCK),)
    lr_arg = lr_pool if lr_pool is not None else v_pool  # a full cache's program 0 stores nothing
    _qkv_rope_store_kernel[grid](
        x, norm_weight, weight, cos.reshape(-1), sin.reshape(-1), q_out, q_add if q_add is not None else q_out,
        k_pool, v_pool, lr_arg, pos, kv_slot, lr_slot, role, b_q, b_v,
        x.numel(), float(eps), n_q_heads, n_kv_heads, rank, a_q, v_a_row, float(s_q), float(s_v), n_term,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        lr_arg.stride(0), lr_arg.stride(1), b_q.stride(0), b_v.stride(0),
        HEAD_D=head_dim, HB=HALF_BLOCK, HPP=HEADS_PER_TERM_PROGRAM, BLOCK_K=BLOCK_K,
        R_PAD=max(2, triton.next_power_of_2(rank)), FULL_V=v_lora is not None, num_warps=NUM_WARPS,
        **({"maxnreg": maxnreg} if maxnreg else {}), **pdl_launch(x),
    )  # fmt: skip
    return q_out, q_add
