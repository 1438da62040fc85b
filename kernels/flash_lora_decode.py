"""Flash-LoRA decode: one query per row over a static KV cache, batched rows, one launch, CUDA-graph capturable.

What it computes, per row b, query head h and its KV head g = h // G (G = Hq / Hkv), with n = kv_lens[b]::

    K = k_cache[kv_slot[b], g, :n]      V = v_cache[kv_slot[b], g, :n]      V_lr = v_lr_cache[lr_slot[b], :n]
    p = softmax(q_h Kᵀ / sqrt(D))                                             # (n,); the query sits at n - 1
    O_h = p · V + ((p · V_lr) · B_{role[b], g}) · scaling                    # (D,); without v_lr_cache: p · V
    n == 0 (an idle row of a batch bucket): O_h = 0

``V`` is ``V_base`` of the decomposed cache (``V_lr = X A`` beside it, shared by all KV heads) or the full values
of a plain cache (``v_lr_cache=None``). Rows carry their own length, role and cache slots, all device tensors.

Design (``kernels/NOTES.md`` has the measurements):

- The grid is ``(B * Hkv * row_blocks, N_SPLITS)``, fixed by (B, Hkv, capacity C, head dim, SM count), never
  by the lengths: a CUDA graph captured once replays for every length. N_SPLITS fills about two programs per
  SM (one wave) when every row is at capacity.
- A row of n keys uses ``min(N_SPLITS, ceil(n / MIN_SPLIT))`` splits of equal length; the grid's other
  programs for that row exit after one load. Splits are the slow grid axis, so the splits in use run first.
- Each program runs the online softmax over its key range for the G query heads of one KV head at once (one
  K/V tile feeds the group), with a D-wide accumulator for ``p · V`` and an r-wide one for ``p · V_lr``, and
  applies ``B`` to its own partial (the merge is linear, so this is exact).
- A row that uses one split writes O directly. Otherwise the splits write fp32 partials (acc, max, sum) to a
  workspace, and the last split of a (row, KV head) to finish (an atomic counter) merges them in one or a few
  wide loads and writes O, then resets the counter for the next launch or graph replay: one launch.
- ``group_rows=T``: T consecutive rows of one sequence (fed tokens at consecutive positions) in one program per KV
  head and split, their T·G queries over each K/V tile once, each masked to its own length; the group reads its first
  row's slots and role.
- Workspace and counters are cached per (device, shape) and reused; the launcher never synchronises with the
  host and allocates nothing whose size depends on lengths. Configs are fixed by a rule (``_plan``), never
  autotuned, so capture compiles nothing new after a warm-up call.

Whatever the kernel does not cover (CPU, fp32, a head dim other than 16-256 powers of two, rank > 64) runs
the torch path: on CPU :func:`flash_lora_decode_reference` (gathers the slots up to the longest row); on CUDA
the same math over the whole capacity, which needs no host synchronisation (still graph-capturable), logged
once per reason.

Limits: device values of kv_lens are clamped to [0, C]; device values of role_ids / kv_slot / lr_slot are not
range-checked (that would need a host sync); CPU tensors are. One stream at a time per shape (the workspace is
shared). Call once before capturing a graph (the first call compiles). Tested GPU: NVIDIA H200 (Triton 3.6,
PyTorch 2.11), see ``kernels/NOTES.md``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device
from kernels.flash_lora_attention import _interpreting, _next_pow2, _num_sms
from kernels.pdl import pdl_launch
from kernels.split_workspace import split_workspace

try:
    import triton
    import triton.language as tl

    from kernels.flash_lora_attention import _lora_up
except ImportError:  # pragma: no cover - platforms without Triton: only the torch path is available
    triton = None
    tl = None

__all__ = ["flash_lora_decode", "flash_lora_decode_reference"]

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_MAX_RANK = 64
_INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# --------------------------------------------------------------------------------------------------
# Input checks (shared by the reference and the kernel launcher)
# --------------------------------------------------------------------------------------------------


def _check_decode_inputs(
    fn: str,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_lens: Tensor,
    v_lr_cache: Tensor | None,
    lora_b: Tensor | None,
    scaling: float,
    role_ids: Tensor | None,
    kv_slot: Tensor | None,
    lr_slot: Tensor | None,
    out: Tensor | None,
) -> None:
    """Validate the arguments of ``flash_lora_decode`` / its reference.

    Raises:
        ValueError: naming the offending argument, on one line.
    """
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "kv_lens": kv_lens}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, ndim in (("q", 3), ("k_cache", 4), ("v_cache", 4)):
        if named[name].dim() != ndim:
            raise ValueError(f"{fn}: {name} must have {ndim} dims, got shape {tuple(named[name].shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"{fn}: q dtype must be float16, bfloat16, float32 or float64, got {q.dtype}")
    bsz, hq, d = q.shape
    n_slots, hkv, cap, _ = k_cache.shape
    if bsz < 1:
        raise ValueError(f"{fn}: q must hold at least one row, got shape {tuple(q.shape)}")
    if k_cache.shape[3] != d or hkv == 0 or hq % hkv != 0 or n_slots < 1 or cap < 1:
        raise ValueError(f"{fn}: k_cache shape {tuple(k_cache.shape)} must be (S>=1, Hkv, C>=1, D={d}), Hkv | Hq={hq}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{fn}: {name} dtype {t.dtype} must match q dtype {q.dtype}")
    if (v_lr_cache is None) != (lora_b is None):
        raise ValueError(f"{fn}: v_lr_cache and lora_b must be given together (both None = plain attention)")
    n_lr_slots = n_slots
    if v_lr_cache is not None:
        if not isinstance(v_lr_cache, Tensor) or v_lr_cache.dim() != 3 or v_lr_cache.shape[1] != cap:
            shape = tuple(v_lr_cache.shape) if isinstance(v_lr_cache, Tensor) else type(v_lr_cache).__name__
            raise ValueError(f"{fn}: v_lr_cache must be a tensor of shape (S_lr, C={cap}, r), got {shape}")
        if v_lr_cache.dtype != q.dtype:
            raise ValueError(f"{fn}: v_lr_cache dtype {v_lr_cache.dtype} must match q dtype {q.dtype}")
        n_lr_slots, rank = v_lr_cache.shape[0], v_lr_cache.shape[2]
        if rank < 1 or n_lr_slots < 1:
            raise ValueError(f"{fn}: v_lr_cache shape {tuple(v_lr_cache.shape)} needs S_lr >= 1 and rank r >= 1")
        if not isinstance(lora_b, Tensor) or lora_b.dim() != 4 or lora_b.shape[0] < 1:
            shape = tuple(lora_b.shape) if isinstance(lora_b, Tensor) else type(lora_b).__name__
            raise ValueError(f"{fn}: lora_b must be a (n_roles, Hkv={hkv}, r={rank}, D={d}) tensor, got {shape}")
        if tuple(lora_b.shape[1:]) != (hkv, rank, d):
            raise ValueError(f"{fn}: lora_b shape {tuple(lora_b.shape)} must be (n_roles, Hkv={hkv}, r={rank}, D={d})")
        if not lora_b.is_floating_point():
            raise ValueError(f"{fn}: lora_b must be a floating-point tensor, got {lora_b.dtype}")
    if not math.isfinite(float(scaling)):
        raise ValueError(f"{fn}: scaling must be a finite float, got {scaling}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("v_lr_cache", v_lr_cache), ("lora_b", lora_b)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")

    n_roles = lora_b.shape[0] if lora_b is not None else None
    _check_rows(fn, "kv_lens", kv_lens, bsz, q.device, 0, cap)
    _check_rows(fn, "role_ids", role_ids, bsz, q.device, 0, None if n_roles is None else n_roles - 1)
    _check_rows(fn, "kv_slot", kv_slot, bsz, q.device, 0, n_slots - 1)
    _check_rows(fn, "lr_slot", lr_slot, bsz, q.device, 0, n_lr_slots - 1)
    if kv_slot is None and n_slots < bsz:
        raise ValueError(f"{fn}: without kv_slot row b reads slot b, so k_cache needs >= B={bsz} slots, has {n_slots}")
    if v_lr_cache is not None and lr_slot is None:
        if kv_slot is None and n_lr_slots < bsz:
            raise ValueError(f"{fn}: without lr_slot row b reads v_lr_cache slot b; it has {n_lr_slots} < B={bsz}")
        if kv_slot is not None and kv_slot.device.type == "cpu" and int(kv_slot.max()) >= n_lr_slots:
            raise ValueError(f"{fn}: lr_slot defaults to kv_slot, whose values must be < S_lr={n_lr_slots}")
    if out is not None:
        if not isinstance(out, Tensor) or tuple(out.shape) != (bsz, hq, d):
            shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"{fn}: out must be a tensor of shape (B={bsz}, Hq={hq}, D={d}), got {shape}")
        if out.dtype != q.dtype or out.device != q.device:
            got = f"{out.dtype} on {out.device}"
            raise ValueError(f"{fn}: out must have q's dtype {q.dtype} and device {q.device}, got {got}")


def _check_group_rows(fn: str, group_rows: int, group: int) -> None:
    """``group_rows``: an int >= 1 whose groups hold at most :data:`_MAX_GROUP_QUERIES` queries (rows x G heads)."""
    if isinstance(group_rows, bool) or not isinstance(group_rows, int) or group_rows < 1:
        raise ValueError(f"{fn}: group_rows must be an int >= 1, got {group_rows!r}")
    if group_rows > 1 and group_rows * group > _MAX_GROUP_QUERIES:
        raise ValueError(
            f"{fn}: group_rows={group_rows} x {group} query heads per KV head = {group_rows * group} queries a group; "
            f"at most {_MAX_GROUP_QUERIES} (group_rows <= {max(1, _MAX_GROUP_QUERIES // group)})"
        )


def _check_rows(fn: str, name: str, t: Tensor | None, bsz: int, device: torch.device, lo: int, hi: int | None) -> None:
    """Check a per-row integer tensor of shape (B,) on q's device (its values only when it lives on the CPU)."""
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != bsz:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a tensor of shape (B={bsz},), got {shape}")
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{fn}: {name} must be an integer tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but q is on {device}")
    if t.device.type == "cpu" and hi is not None and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(f"{fn}: {name} values must be in [{lo}, {hi}], got {t.tolist()}")


# --------------------------------------------------------------------------------------------------
# Torch path: the reference, and the CUDA fallback for what the kernel does not cover
# --------------------------------------------------------------------------------------------------


def _decode_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_lens: Tensor,
    v_lr_cache: Tensor | None,
    lora_b: Tensor | None,
    scaling: float,
    role_ids: Tensor | None,
    kv_slot: Tensor | None,
    lr_slot: Tensor | None,
    *,
    upcast: bool,
    trim: bool,
    group_rows: int = 1,
) -> Tensor:
    """Eager decode. ``trim`` gathers keys only up to the longest row (a host sync); else the whole capacity.
    ``group_rows`` > 1: each group of that many rows reads its first row's slots and role."""
    bsz, hq, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    lens = kv_lens.long().clamp(0, cap)
    n = int(lens.max()) if trim else cap
    cdt = torch.float32 if upcast and q.dtype != torch.float64 else q.dtype
    if n == 0:
        return torch.zeros_like(q)
    rows = kv_slot.long() if kv_slot is not None else torch.arange(bsz, device=q.device)
    lr_rows = lr_slot.long() if lr_slot is not None else rows
    if group_rows > 1:
        first = torch.arange(bsz, device=q.device) // group_rows * group_rows
        rows, lr_rows = rows[first], lr_rows[first]
        role_ids = role_ids[first] if role_ids is not None else None
    k = k_cache[rows, :, :n].to(cdt)  # (B, Hkv, n, D)
    v = v_cache[rows, :, :n].to(cdt)
    qf = q.to(cdt).view(bsz, hkv, group, d)  # head h = g * G + j
    scores = torch.einsum("bhgd,bhnd->bhgn", qf, k) * (1.0 / math.sqrt(d))  # (B, Hkv, G, n)
    visible = (torch.arange(n, device=q.device) < lens[:, None])[:, None, None]  # (B, 1, 1, n)
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).masked_fill(~visible, 0.0)  # n=0 rows: 0
    o = torch.einsum("bhgn,bhnd->bhgd", p, v)
    if v_lr_cache is not None:
        roles = role_ids.long() if role_ids is not None else torch.zeros(bsz, dtype=torch.long, device=q.device)
        o_lr = torch.einsum("bhgn,bnr->bhgr", p, v_lr_cache[lr_rows, :n].to(cdt))  # (B, Hkv, G, r)
        o = o + torch.einsum("bhgr,bhrd->bhgd", o_lr, lora_b[roles].to(cdt)) * scaling
    return o.reshape(bsz, hq, d).to(q.dtype)


def flash_lora_decode_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_lens: Tensor,
    v_lr_cache: Tensor | None = None,
    lora_b: Tensor | None = None,
    scaling: float = 1.0,
    role_ids: Tensor | None = None,
    kv_slot: Tensor | None = None,
    lr_slot: Tensor | None = None,
    out: Tensor | None = None,
    *,
    upcast: bool = True,
    group_rows: int = 1,
) -> Tensor:
    """Eager PyTorch decode step (any device), the ground truth of :func:`flash_lora_decode`.

    Gathers the rows' cache slots up to the longest row (one host sync), masks each row by its length.
    Arguments as :func:`flash_lora_decode`, plus ``upcast``: compute in float32 (True, the reference) or in q's
    dtype (False: "eager PyTorch at the same precision", the error yardstick of the kernel tests).

    Returns:
        (B, Hq, D) in q's dtype (written into ``out`` when given).
    """
    fn = "flash_lora_decode_reference"
    _check_decode_inputs(fn, q, k_cache, v_cache, kv_lens, v_lr_cache, lora_b, scaling, role_ids, kv_slot, lr_slot, out)
    _check_group_rows(fn, group_rows, q.shape[1] // k_cache.shape[1])
    res = _decode_torch(
        q, k_cache, v_cache, kv_lens, v_lr_cache, lora_b, scaling, role_ids, kv_slot, lr_slot, upcast=upcast,
        trim=True, group_rows=group_rows,
    )  # fmt: skip
    if out is None:
        return res
    return out.copy_(res)


# --------------------------------------------------------------------------------------------------
# Launch configuration: a fixed rule (no autotuning, so nothing runs during graph capture)
# --------------------------------------------------------------------------------------------------

_PROGRAMS_PER_SM = 2  # grid: programs per SM when every row is at capacity (about the resident CTAs per SM)
_MAX_SPLITS = 128
# keys per split at least, in tiles: at batch 1 and a 2k cache, 4 tiles (9 splits) beat 1 tile (33 splits) by
# 0.08 ms per 8B decode step on an H100 (scripts/sweep_decode_plan.py at commit d89e4ca,
# results/engine_h100/decode_plan_2026-11-25/)
_MIN_SPLIT_TILES = 4
# a LoRA kernel (the V_lr accumulator beside V's) that splits each row 3 ways or more at 64-key tiles takes 32-key
# tiles (twice the splits): with the L2 cold, as in a decode step (32 layers' caches, one launch each), 8B shapes on
# an H100 at a 2k cache 12.96 -> 10.85 us at batch 1, 23.6 -> 20.6 at 4, 35.8 -> 32.5 at 8, 35.9 -> 34.5 at batch 1 of
# a 16k cache; at 2 splits or 1 (batch 16 and up) 32-key tiles are slower (54.1 -> 55.5 at 16, 95.9 -> 98.5 at 32),
# and the plain kernel gains nothing (kernels/NOTES.md, 2026-11-27 night)
_SMALL_TILE_SPLITS = 3
# queries of one program of a token group (group_rows x G heads): its accumulators stay in registers at 4 warps
_MAX_GROUP_QUERIES = 128


@dataclass(frozen=True)
class _DecodePlan:
    """Launch configuration of one decode shape (all compile-time constants of the kernel but the lengths)."""

    n_splits: int  # programs per (row or token group, KV head, row block): grid dim 1
    min_split: int  # keys per split at least: a row of n keys uses min(n_splits, ceil(n / min_split)) splits
    block_m: int  # query heads per program (the G heads of a KV head, padded; >= 16 for tl.dot)
    rows: int  # heads per program kept in the workspace: min(block_m, next_pow2(G))
    row_blocks: int  # programs along the group when G > 64
    block_n: int  # keys per tile
    s_chunk: int  # splits merged per step
    num_warps: int
    num_stages: int
    tokens: int = 1  # token rows per program (a group sharing its first row's slots); 1: one row per program


def _plan(
    bsz: int,
    hkv: int,
    group: int,
    capacity: int,
    head_dim: int,
    sms: int,
    *,
    programs_per_sm: int = _PROGRAMS_PER_SM,
    min_split_tiles: int = _MIN_SPLIT_TILES,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    lora: bool = False,
    tokens: int = 1,
) -> _DecodePlan:
    """The rule; the keyword arguments exist for the benchmark's sweep (``kernels/NOTES.md`` has the one that chose
    the defaults). Splits fill ``programs_per_sm`` programs per SM without starting a second wave; ``lora`` (the
    kernel accumulates ``p · V_lr`` too) takes 32-key tiles where 64-key ones would split a row
    :data:`_SMALL_TILE_SPLITS` ways or more. ``tokens`` > 1: one program per group of that many token rows
    (``tokens · group`` queries, at most :data:`_MAX_GROUP_QUERIES`), 4 warps from 64 queries up, 8 from 128."""
    if tokens > 1:
        block_m = max(16, _next_pow2(tokens * group))
        rows, row_blocks = block_m, 1
        base = -(-bsz // tokens) * hkv
    else:
        block_m = min(64, max(16, _next_pow2(group)))
        rows = min(block_m, _next_pow2(group))
        row_blocks = -(-group // block_m)
        base = bsz * hkv * row_blocks
    if num_warps is None:
        num_warps = (8 if block_m >= 128 else 4 if block_m >= 64 else 2) if tokens > 1 else 2

    def splits(tile: int) -> int:
        return max(1, min(programs_per_sm * sms // base, -(-capacity // (min_split_tiles * tile)), _MAX_SPLITS))

    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
        if lora and block_n == 64 and splits(64) >= _SMALL_TILE_SPLITS:
            block_n = 32
    min_split = min_split_tiles * block_n
    n_splits = splits(block_n)
    s_chunk = max(1, min(_next_pow2(n_splits), (4096 * num_warps) // (rows * head_dim)))  # <= 128 fp32 regs/thread
    return _DecodePlan(
        n_splits=n_splits,
        min_split=min_split,
        block_m=block_m,
        rows=rows,
        row_blocks=row_blocks,
        block_n=block_n,
        s_chunk=1 << (s_chunk.bit_length() - 1),
        num_warps=num_warps,
        num_stages=num_stages or (3 if head_dim <= 128 else 2),
        tokens=tokens,
    )


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _decode_keys(
        acc, acc_lr, l_i, m_i, q,
        k_ptr, v_ptr, lr_ptr, stride_kl, stride_vl, stride_lrl, stride_lrr,
        rank, lo, hi, qk_scale, q_lens,
        HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LORA: tl.constexpr,
        MASKED: tl.constexpr, PER_QUERY: tl.constexpr,
    ):  # fmt: skip
        """Online softmax over keys [lo, hi) in BLOCK_N tiles; MASKED drops keys >= hi (the last, partial tile) and,
        with PER_QUERY, the keys at or past each query's own length (``q_lens``, (BLOCK_M,): a group's token rows)."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < rank
        for start in range(lo, hi, BLOCK_N):
            n = start + offs_n
            kt_ptrs = k_ptr + n[None, :] * stride_kl + offs_d[:, None]  # (D, BLOCK_N)
            v_ptrs = v_ptr + n[:, None] * stride_vl + offs_d[None, :]  # (BLOCK_N, D)
            lr_ptrs = lr_ptr + n[:, None] * stride_lrl + offs_r[None, :] * stride_lrr  # (BLOCK_N, R_PAD)
            if MASKED:
                n_ok = n < hi
                kt = tl.load(kt_ptrs, mask=n_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                v = tl.load(v_ptrs)
            qk = tl.dot(q, kt) * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
            if MASKED:
                if PER_QUERY:
                    qk = tl.where(n_ok[None, :] & (n[None, :] < q_lens[:, None]), qk, float("-inf"))
                else:
                    qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            p16 = p.to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p16, v)
            if HAS_LORA:
                if MASKED:
                    vlr = tl.load(lr_ptrs, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                else:
                    vlr = tl.load(lr_ptrs, mask=r_ok[None, :], other=0.0)
                acc_lr = acc_lr * alpha[:, None] + tl.dot(p16, vlr)
            m_i = m_new
        return acc, acc_lr, l_i, m_i

    @triton.jit
    def _merge_splits(
        WS_ACC, WS_M, WS_L, OUT, pid, b, g, rb, n_act, stride_ob, stride_oh, n_rows,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
        N_SPLITS: tl.constexpr, S_CHUNK: tl.constexpr, TOKENS: tl.constexpr,
    ):  # fmt: skip
        """Merge the n_act partials (acc, max, sum) of program column pid's ROWS heads and write O.

        Every head of the column in one (S_CHUNK, ROWS, D) load per step, so a merge is one or a few round trips.
        """
        offs_s = tl.arange(0, S_CHUNK)
        offs_r = tl.arange(0, ROWS)
        offs_d = tl.arange(0, HEAD_DIM)
        base = pid.to(tl.int64) * N_SPLITS
        m_run = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_run = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for s0 in range(0, n_act, S_CHUNK):
            s_ok = (s0 + offs_s < n_act)[:, None]
            slot = (base + s0 + offs_s)[:, None] * ROWS + offs_r[None, :]  # (S_CHUNK, ROWS)
            # .cg: read through L2, where the other programs' partials are (L1 is not coherent)
            m_s = tl.load(WS_M + slot, mask=s_ok, other=-1.0e30, cache_modifier=".cg")
            l_s = tl.load(WS_L + slot, mask=s_ok, other=0.0, cache_modifier=".cg")
            part = tl.load(WS_ACC + slot[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=s_ok[:, :, None],
                           other=0.0, cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m_run, tl.max(m_s, 0))
            alpha = tl.math.exp2(m_run - m_new)
            w = tl.math.exp2(m_s - m_new[None, :])  # (S_CHUNK, ROWS); 0 for masked or empty splits
            acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], 0)
            l_run = l_run * alpha + tl.sum(l_s * w, 0)
            m_run = m_new
        inv = tl.where(l_run > 0, 1.0 / tl.maximum(l_run, 1e-30), 0.0)
        if TOKENS == 1:
            j = rb * BLOCK_M + offs_r  # query heads of the group
            o_ptrs = OUT + b.to(tl.int64) * stride_ob + (g * GROUP + j)[:, None].to(tl.int64) * stride_oh
            ok = j < GROUP
        else:  # workspace row i is token row b + i // GROUP, query head g * GROUP + i % GROUP
            row = b + offs_r // GROUP
            o_ptrs = (
                OUT
                + row[:, None].to(tl.int64) * stride_ob
                + (g * GROUP + offs_r % GROUP)[:, None].to(tl.int64) * stride_oh
            )
            ok = (offs_r < TOKENS * GROUP) & (row < n_rows)
        tl.store(o_ptrs + offs_d[None, :], (acc * inv[:, None]).to(OUT.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _flash_lora_decode_kernel(
        Q, K, V, VLR, LB, KVLEN, ROLE, KVSLOT, LRSLOT, OUT, WS, CNT, QADD,
        stride_qb, stride_qh, stride_qab,
        stride_ks, stride_kh, stride_kl,
        stride_vs, stride_vh, stride_vl,
        stride_lrs, stride_lrl, stride_lrr,
        stride_bn, stride_bh, stride_br, stride_bd,
        stride_ob, stride_oh,
        qk_scale, lora_scaling, capacity, rank, n_rows,
        N_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, ROWS: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
        N_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, S_CHUNK: tl.constexpr,
        HAS_LORA: tl.constexpr, HAS_ROLE: tl.constexpr, HAS_KVSLOT: tl.constexpr, HAS_LRSLOT: tl.constexpr,
        HAS_QADD: tl.constexpr, PDL: tl.constexpr, TOKENS: tl.constexpr,
    ):  # fmt: skip
        """Grid (B * Hkv * ROW_BLOCKS, N_SPLITS): program (pid, s) runs split s of row b, KV head g, row block rb.
        With TOKENS > 1 (ROW_BLOCKS 1) ``b`` is a group of TOKENS token rows from row ``b * TOKENS`` that read the
        group's first row's slots and role: the program's queries are the group's rows × the G heads (query i is
        token row i // G, head i % G), each masked to its own length, so every K/V tile is read once for them all.

        Splits are the slow grid axis, so the first splits of every row (the only ones short rows use) are
        scheduled first; a program whose split is past the row's active count exits after one load.
        """
        pid = tl.program_id(0)
        pid_s = tl.program_id(1)
        b = pid // (N_KV_HEADS * ROW_BLOCKS)
        g = (pid // ROW_BLOCKS) % N_KV_HEADS
        rb = pid % ROW_BLOCKS
        if PDL:  # kernels/pdl.py: every program waits (those that exit at once too), so the grid ends after its
            tl.extra.cuda.gdc_wait()  # predecessor; the lengths, q and the cache are visible past this point
        local = tl.arange(0, BLOCK_M)
        if TOKENS == 1:
            kv_len = tl.minimum(tl.maximum(tl.load(KVLEN + b).to(tl.int32), 0), capacity)
            kv_min = kv_len
            q_lens = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len
            j = rb * BLOCK_M + local  # query heads of the group in this program
            row_ok = j < GROUP
            q_row = tl.zeros([BLOCK_M], dtype=tl.int64) + b.to(tl.int64)
            head = (g * GROUP + j).to(tl.int64)
        else:
            b = b * TOKENS  # the group's first token row: its slots and role serve the group
            row = b + local // GROUP
            row_ok = (local < TOKENS * GROUP) & (row < n_rows)
            q_lens = tl.load(KVLEN + row, mask=row_ok, other=0).to(tl.int32)
            q_lens = tl.where(row_ok, tl.minimum(tl.maximum(q_lens, 0), capacity), 0)
            kv_len = tl.max(q_lens, 0)
            kv_min = tl.min(tl.where(row_ok, q_lens, capacity), 0)
            q_row = row.to(tl.int64)
            head = (g * GROUP + local % GROUP).to(tl.int64)
        n_act = tl.minimum(tl.maximum(tl.cdiv(kv_len, MIN_SPLIT), 1), N_SPLITS)  # splits this row uses
        if pid_s < n_act:
            b64 = b.to(tl.int64)
            g64 = g.to(tl.int64)
            if HAS_KVSLOT:
                kv_row = tl.load(KVSLOT + b).to(tl.int64)
            else:
                kv_row = b64
            if HAS_LRSLOT:
                lr_row = tl.load(LRSLOT + b).to(tl.int64)
            else:
                lr_row = kv_row
            split_len = tl.cdiv(tl.cdiv(kv_len, n_act), BLOCK_N) * BLOCK_N
            lo = pid_s * split_len
            hi = tl.minimum(lo + split_len, kv_len)
            # tiles before full_hi need no mask: every query of the program sees all their keys
            full_hi = lo + (tl.maximum(tl.minimum(hi, kv_min) - lo, 0) // BLOCK_N) * BLOCK_N

            offs_d = tl.arange(0, HEAD_DIM)
            q_ptrs = Q + q_row[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
            if HAS_QADD:  # a float32 term the step that made q left to add (q_proj's rotated LoRA term)
                qa_ptrs = QADD + q_row[:, None] * stride_qab + head[:, None] * HEAD_DIM + offs_d[None, :]
                q = (q.to(tl.float32) + tl.load(qa_ptrs, mask=row_ok[:, None], other=0.0)).to(q.dtype)
            k_ptr = K + kv_row * stride_ks + g64 * stride_kh
            v_ptr = V + kv_row * stride_vs + g64 * stride_vh
            lr_ptr = VLR + lr_row * stride_lrs

            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row with no keys stays NaN-free
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            acc_lr = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
            acc, acc_lr, l_i, m_i = _decode_keys(
                acc, acc_lr, l_i, m_i, q, k_ptr, v_ptr, lr_ptr, stride_kl, stride_vl, stride_lrl, stride_lrr,
                rank, lo, full_hi, qk_scale, q_lens, HEAD_DIM, R_PAD, BLOCK_N, HAS_LORA, False, False,
            )  # fmt: skip
            acc, acc_lr, l_i, m_i = _decode_keys(
                acc, acc_lr, l_i, m_i, q, k_ptr, v_ptr, lr_ptr, stride_kl, stride_vl, stride_lrl, stride_lrr,
                rank, full_hi, hi, qk_scale, q_lens, HEAD_DIM, R_PAD, BLOCK_N, HAS_LORA, True, TOKENS > 1,
            )  # fmt: skip
            if HAS_LORA:
                # B applied per split: the merge is linear in acc, so merging (acc + acc_lr B s) is exact
                if HAS_ROLE:
                    role = tl.load(ROLE + b).to(tl.int64)
                else:
                    role = tl.zeros([], dtype=tl.int64)
                acc += _lora_up(acc_lr, LB, role, g64, stride_bn, stride_bh, stride_br, stride_bd, rank,
                                HEAD_DIM, R_PAD) * lora_scaling  # fmt: skip

            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
            if n_act == 1:  # the whole row in this program: write O
                inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
                o_ptrs = OUT + q_row[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
                tl.store(o_ptrs, (acc * inv[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
            else:
                # fp32 partials: slot (pid, split, head i) = (pid * N_SPLITS + split) * ROWS + i
                total = tl.num_programs(0).to(tl.int64) * N_SPLITS * ROWS
                ws_m = WS + total * HEAD_DIM
                ws_l = ws_m + total
                keep = row_ok & (local < ROWS)
                slot = (pid.to(tl.int64) * N_SPLITS + pid_s) * ROWS + local
                tl.store(WS + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=keep[:, None])
                tl.store(ws_m + slot, m_i, mask=keep)
                tl.store(ws_l + slot, l_i, mask=keep)
                tl.debug_barrier()  # every thread's partial stores precede the release below
                done = tl.atomic_add(CNT + pid, 1, sem="acq_rel", scope="gpu")
                if done == n_act - 1:  # the last split of this row to finish merges
                    tl.store(CNT + pid, 0)  # ready for the next launch / graph replay
                    _merge_splits(
                        WS, ws_m, ws_l, OUT, pid, b, g, rb, n_act, stride_ob, stride_oh, n_rows,
                        GROUP, HEAD_DIM, BLOCK_M, ROWS, N_SPLITS, S_CHUNK, TOKENS,
                    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

_PLANS: dict[tuple, _DecodePlan] = {}
_PLAN_KNOBS = ("programs_per_sm", "min_split_tiles", "block_n", "num_warps", "num_stages")  # _plan's integer knobs


def parse_plan(spec: str) -> dict[str, int]:
    """The rule's keyword arguments that ``spec`` sets (``"min_split_tiles=4,num_warps=4"``; ``""``: none).

    Raises:
        ValueError: an unknown name or a value that is not a positive integer, naming it and what is allowed.
    """
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in spec.strip().split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in _PLAN_KNOBS:
            raise ValueError(f"LRAGENT_DECODE_PLAN: unknown setting {name!r}; allowed: {', '.join(_PLAN_KNOBS)}")
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"LRAGENT_DECODE_PLAN: {name} must be a positive integer, got {value.strip()!r}")
        out[name] = int(value)
    return out


def plan_overrides() -> dict[str, int]:
    """The rule's keyword arguments set in ``LRAGENT_DECODE_PLAN`` (:func:`parse_plan`'s syntax), for sweeps (``bench
    decode --plans`` times several side by side); empty when unset. Plans are cached per shape: clear ``_PLANS`` after
    changing it.

    Raises:
        ValueError: an unknown name or a value that is not a positive integer, naming it and what is allowed.
    """
    return parse_plan(os.environ.get("LRAGENT_DECODE_PLAN", ""))


_FALLBACK_LOGGED: set[str] = set()


def _workspace(device: torch.device, n_programs: int, plan: _DecodePlan, head_dim: int) -> tuple[Tensor, Tensor]:
    """The cached (workspace, counters) of this shape (:func:`kernels.split_workspace.split_workspace`)."""
    slots = n_programs * plan.n_splits * plan.rows
    key = ("flash_lora_decode", n_programs, plan.n_splits, plan.rows, head_dim)
    return split_workspace(key, slots * (head_dim + 2), n_programs, device)


@on_tensor_device
def _launch_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_lens: Tensor,
    v_lr_cache: Tensor | None,
    lora_b: Tensor | None,
    scaling: float,
    role_ids: Tensor | None,
    kv_slot: Tensor | None,
    lr_slot: Tensor | None,
    out: Tensor,
    plan: _DecodePlan,
    q_add: Tensor | None = None,
) -> Tensor:
    """Run the decode kernel: one launch, grid (groups * Hkv * row_blocks, n_splits) with groups the B rows or their
    groups of ``plan.tokens``. Inputs are validated."""
    bsz, hq, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    has_lora = v_lr_cache is not None
    rank = v_lr_cache.shape[2] if has_lora else 1
    n_programs = -(-bsz // plan.tokens) * hkv * plan.row_blocks
    ws, cnt = _workspace(q.device, n_programs, plan, d) if plan.n_splits > 1 else (out, out)
    _flash_lora_decode_kernel[(n_programs, plan.n_splits)](
        q, k_cache, v_cache, v_lr_cache if has_lora else out, lora_b if has_lora else out, kv_lens,
        role_ids if role_ids is not None else kv_lens, kv_slot if kv_slot is not None else kv_lens,
        lr_slot if lr_slot is not None else kv_lens, out, ws, cnt, q_add if q_add is not None else out,
        q.stride(0), q.stride(1), q_add.stride(0) if q_add is not None else 0, *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *(v_lr_cache.stride() if has_lora else (0, 0, 0)), *(lora_b.stride() if has_lora else (0, 0, 0, 0)),
        out.stride(0), out.stride(1), 1.4426950408889634 / math.sqrt(d), float(scaling), cap, rank, bsz,
        N_KV_HEADS=hkv, GROUP=hq // hkv, HEAD_DIM=d, R_PAD=max(8, _next_pow2(rank)) if has_lora else 8,
        BLOCK_M=plan.block_m, ROWS=plan.rows, ROW_BLOCKS=plan.row_blocks, BLOCK_N=plan.block_n,
        N_SPLITS=plan.n_splits, MIN_SPLIT=plan.min_split, S_CHUNK=plan.s_chunk, HAS_LORA=has_lora,
        HAS_ROLE=has_lora and role_ids is not None, HAS_KVSLOT=kv_slot is not None, HAS_LRSLOT=lr_slot is not None,
        HAS_QADD=q_add is not None, TOKENS=plan.tokens, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **pdl_launch(q),
    )  # fmt: skip
    return out


def _kernel_unsupported(q: Tensor, k_cache: Tensor, v_lr_cache: Tensor | None) -> str | None:
    """Why the Triton kernel cannot serve these inputs (None when it can)."""
    if triton is None:
        return "Triton is not installed"
    if not q.is_cuda and not _interpreting():
        return f"q is on {q.device}"
    if q.dtype not in _KERNEL_DTYPES:
        return f"dtype {q.dtype}"
    if q.shape[-1] not in _HEAD_DIMS:
        return f"head dim {q.shape[-1]} (kernel: {_HEAD_DIMS})"
    if v_lr_cache is not None and v_lr_cache.shape[2] > _MAX_RANK:
        return f"rank {v_lr_cache.shape[2]} > {_MAX_RANK}"
    return None


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------


def flash_lora_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    kv_lens: Tensor,
    v_lr_cache: Tensor | None = None,
    lora_b: Tensor | None = None,
    scaling: float = 1.0,
    role_ids: Tensor | None = None,
    kv_slot: Tensor | None = None,
    lr_slot: Tensor | None = None,
    out: Tensor | None = None,
    q_add: Tensor | None = None,
    group_rows: int = 1,
) -> Tensor:
    """One decode step of a batch of rows over a static cache: ``p·V + ((p·V_lr)·B_role)·s`` per query head.

    No host synchronisation and a grid fixed by (B, Hkv, C, D, r, SM count), so a CUDA graph captured once (after
    one warm-up call) replays at any lengths. Inputs the kernel does not cover take the torch path (see the module
    docstring), never a wrong result.

    Args:
        q: (B, Hq, D) one query per row, RoPE applied, fp16/bf16 (fp32 takes the torch path); last dim contiguous.
        k_cache: (S, Hkv, C, D) key pool of capacity C; row b reads slot kv_slot[b]; last dim contiguous.
        v_cache: (S, Hkv, C, D) V_base (decomposed cache) or full V (plain cache), same layout rules.
        kv_lens: (B,) integer tensor on q's device: valid keys of row b, 0..C; its query sits at kv_lens[b] - 1;
            0 = an idle row, whose output is zeros.
        v_lr_cache: (S_lr, C, r) low-rank pool V_lr = X·A, any strides; None -> plain attention (no LoRA term).
        lora_b: (n_roles, Hkv, r, D) up-projections, any strides (e.g. ``lragent.attention.lora_b_per_head`` of
            the PEFT layout); required with v_lr_cache, None without.
        scaling: LoRA scale s (alpha / r).
        role_ids: (B,) integer role of each row on q's device; default 0.
        kv_slot: (B,) integer slot of k_cache / v_cache that row b reads; default arange(B).
        lr_slot: (B,) integer slot of v_lr_cache that row b reads; default kv_slot.
        out: (B, Hq, D) preallocated output (q's dtype; last dim contiguous); written and returned.
        q_add: (B, Hq, D) float32, contiguous, added to q (then rounded to q's dtype) before the attention: the rotated
            q_proj LoRA term of a step whose q/k/v GEMV rotated only q's base part (``kernels.fused_qkv_rope``).
        group_rows: T > 1: rows ``[i·T, i·T + T)`` form a group that reads its first row's ``kv_slot``, ``lr_slot``
            and ``role_ids`` (each row keeps its own query and length): one program runs the group's T·G queries
            over each K/V tile once. For several tokens of one sequence in one step (fed prompt tokens at
            consecutive positions), whose rows would otherwise each read the whole cache. At most
            ``_MAX_GROUP_QUERIES`` queries a group.

    Returns:
        (B, Hq, D) tensor in q's dtype (``out`` when given).

    Raises:
        ValueError: wrong shape, dtype, device or stride, naming the argument.
    """
    fn = "flash_lora_decode"
    _check_decode_inputs(fn, q, k_cache, v_cache, kv_lens, v_lr_cache, lora_b, scaling, role_ids, kv_slot, lr_slot, out)
    _check_group_rows(fn, group_rows, q.shape[1] // k_cache.shape[1])
    if q_add is not None:
        ok = isinstance(q_add, Tensor) and q_add.shape == q.shape and q_add.dtype == torch.float32
        if not ok or q_add.device != q.device or not q_add.is_contiguous():
            what = f"{tuple(q_add.shape)} {q_add.dtype} on {q_add.device}" if isinstance(q_add, Tensor) else q_add
            raise ValueError(f"{fn}: q_add must be a contiguous float32 tensor of q's shape {tuple(q.shape)} on "
                             f"{q.device}, got {what}")  # fmt: skip
    why = _kernel_unsupported(q, k_cache, v_lr_cache)
    if why is not None:
        if q_add is not None:
            q = (q.float() + q_add).to(q.dtype)
        if why not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(why)
            log.warning("flash_lora_decode: the Triton kernel does not cover %s; using the torch path", why)
        res = _decode_torch(
            q, k_cache, v_cache, kv_lens, v_lr_cache, lora_b, scaling, role_ids, kv_slot, lr_slot,
            upcast=True, trim=not q.is_cuda, group_rows=group_rows,
        )  # fmt: skip
        return res if out is None else out.copy_(res)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dim (strides {t.stride()})")
    bsz, hq, d = q.shape
    hkv, cap = k_cache.shape[1], k_cache.shape[2]
    lora = v_lr_cache is not None
    key = (bsz, hkv, hq // hkv, cap, d, q.device, lora) + ((group_rows,) if group_rows > 1 else ())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(
            bsz, hkv, hq // hkv, cap, d, _num_sms(q.device), lora=lora, tokens=group_rows, **plan_overrides()
        )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return _launch_decode(
        q, k_cache, v_cache, kv_lens, v_lr_cache, lora_b, scaling, role_ids, kv_slot, lr_slot, out, plan, q_add
    )
