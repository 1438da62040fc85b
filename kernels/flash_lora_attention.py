"""Flash-LoRA-Attention: attention over a base value cache plus a low-rank (LoRA) value cache.

What it computes, per sequence b, query head h and its KV head g = h // (Hq // Hkv)::

    P = softmax(Q_h K_gᵀ · sm_scale + causal mask)                    # (Lc, L)
    O_h = P · V_base,g + ((P · V_lr) · B_{role[b], g}) · scaling       # (Lc, D)

``V_lr`` (L × r, the LoRA down-projection output ``X A``) is shared by all KV heads and ``B_g`` (r × D) is
KV head g's slice of the role's up-projection. This equals attention over ``V = V_base + V_lr B s`` but
never materialises ``V_lr B`` for the L keys: the kernel keeps one D-wide accumulator for ``P · V_base``
and one r-wide accumulator for ``P · V_lr`` under the same online softmax, and applies ``B`` once per
query block after the key loop.

The Lc queries of sequence b sit at positions ``kv_lens[b] - Lc … kv_lens[b] - 1`` (causal mask aligned
bottom-right); keys at or after ``kv_lens[b]`` are ignored.

Kernels (one ``@triton.jit`` body, two launch modes):

- prefill / chunk (``G · Lc > 64`` rows per KV head): one program per (block of rows, sequence, KV head);
  the rows of a block are the G query heads of one KV head interleaved over query positions, so one K/V
  tile feeds every head of the group.
- decode (``G · Lc <= 64``, e.g. Lc = 1): the same body split over the key length (flash-decoding) into
  fp32 partials, then a small combine kernel that merges the splits and applies ``B``.

Limits: fp16/bf16 q/k/v_base/v_lr (lora_b may also be fp32); head dim 16, 32, 64, 128 or 256; rank 1-64;
any GQA group size; batch with per-sequence lengths and one role per sequence. Tensors may be strided
views (the last dim of q, k, v_base must be contiguous). Values of ``role_ids``/``kv_lens`` that live on
the GPU are not range-checked (that would need a host sync each call); the reference checks them.

Tested GPUs: NVIDIA H100 80GB HBM3 and NVIDIA H200 (Triton 3.6, PyTorch 2.11), see ``kernels/NOTES.md``.
Without CUDA the Triton kernels run only under ``TRITON_INTERPRET=1`` (CPU tensors, slow; used by a CPU test).
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.device_guard import on_tensor_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without Triton: only the reference is available
    triton = None
    tl = None

__all__ = ["flash_lora_attention", "flash_lora_attention_reference"]

log = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_MAX_RANK = 64
_DECODE_MAX_ROWS = 64  # G * Lc at or below this uses the split-K (flash-decoding) launch
_SPLIT_ALIGN = 256  # split lengths are multiples of this (and so of every BLOCK_N)


# --------------------------------------------------------------------------------------------------
# Input checks (shared by the reference and the kernel launcher)
# --------------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v_base: Tensor,
    v_lr: Tensor,
    lora_b: Tensor,
    scaling: float,
    role_ids: Tensor | None,
    kv_lens: Tensor | None,
    sm_scale: float | None,
    *,
    kernel: bool,
) -> tuple[Tensor | None, Tensor | None, float]:
    """Validate the arguments; return ``(role_ids, kv_lens, sm_scale)``; the index tensors stay None if not given.

    Raises:
        ValueError: naming the offending argument, on one line.
    """
    fn = "flash_lora_attention" if kernel else "flash_lora_attention_reference"
    named = {"q": q, "k": k, "v_base": v_base, "v_lr": v_lr, "lora_b": lora_b}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, ndim in (("q", 4), ("k", 4), ("v_base", 4), ("v_lr", 3), ("lora_b", 4)):
        if named[name].dim() != ndim:
            raise ValueError(f"{fn}: {name} must have {ndim} dims, got shape {tuple(named[name].shape)}")

    allowed = _KERNEL_DTYPES if kernel else (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if q.dtype not in allowed:
        raise ValueError(f"{fn}: q dtype must be one of {[str(d) for d in allowed]}, got {q.dtype}")
    for name in ("k", "v_base", "v_lr"):
        if named[name].dtype != q.dtype:
            raise ValueError(f"{fn}: {name} dtype {named[name].dtype} must match q dtype {q.dtype}")
    if not lora_b.is_floating_point() or (kernel and lora_b.dtype not in (*_KERNEL_DTYPES, torch.float32)):
        raise ValueError(f"{fn}: lora_b must be float16, bfloat16 or float32, got {lora_b.dtype}")

    bsz, hq, lc, d = q.shape
    if k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"{fn}: k shape {tuple(k.shape)} must be (B={bsz}, Hkv, L, D={d}) to match q")
    hkv, seq = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{fn}: q heads ({hq}) must be a positive multiple of k heads ({hkv})")
    if v_base.shape != k.shape:
        raise ValueError(f"{fn}: v_base shape {tuple(v_base.shape)} must equal k shape {tuple(k.shape)}")
    if lc < 1 or seq < lc:
        raise ValueError(f"{fn}: q length ({lc}) must be in 1..L where L = k.shape[2] = {seq}")
    if v_lr.shape[0] != bsz or v_lr.shape[1] != seq:
        raise ValueError(f"{fn}: v_lr shape {tuple(v_lr.shape)} must be (B={bsz}, L={seq}, r)")
    rank = v_lr.shape[2]
    if not 1 <= rank <= _MAX_RANK:
        raise ValueError(f"{fn}: v_lr rank (last dim) must be in 1..{_MAX_RANK}, got {rank}")
    if lora_b.shape[0] < 1 or tuple(lora_b.shape[1:]) != (hkv, rank, d):
        raise ValueError(f"{fn}: lora_b shape {tuple(lora_b.shape)} must be (n_roles>=1, Hkv={hkv}, r={rank}, D={d})")
    if not math.isfinite(float(scaling)):
        raise ValueError(f"{fn}: scaling must be a finite float, got {scaling}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    elif not (math.isfinite(float(sm_scale)) and sm_scale > 0):
        raise ValueError(f"{fn}: sm_scale must be a positive finite float, got {sm_scale}")

    n_roles = lora_b.shape[0]
    _check_index(fn, "role_ids", role_ids, bsz, q.device, 0, n_roles - 1)
    _check_index(fn, "kv_lens", kv_lens, bsz, q.device, lc, seq)
    if kernel:
        if d not in _HEAD_DIMS:
            raise ValueError(f"{fn}: head dim (q.shape[-1]) must be one of {_HEAD_DIMS}, got {d}")
        for name in ("q", "k", "v_base"):
            if named[name].stride(-1) != 1:
                raise ValueError(f"{fn}: {name} must be contiguous in its last dim (stride {named[name].stride()})")
        if not q.is_cuda and not _interpreting():
            raise ValueError(f"{fn}: q must be a CUDA tensor, got device {q.device}")
        for name, t in named.items():
            if t.device != q.device:
                raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
        if triton is None:
            raise ValueError(f"{fn}: Triton is not installed; use flash_lora_attention_reference")

    return role_ids, kv_lens, float(sm_scale)


def _check_index(fn: str, name: str, t: Tensor | None, bsz: int, device: torch.device, lo: int, hi: int) -> None:
    """Check a per-sequence integer tensor of shape (B,) (values only when it lives on the CPU)."""
    if t is None:
        return
    if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != bsz:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be a tensor of shape (B={bsz},), got {shape}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{fn}: {name} must be an integer tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but q is on {device}")
    if t.device.type == "cpu" and t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        raise ValueError(f"{fn}: {name} values must be in [{lo}, {hi}], got {t.tolist()}")


# --------------------------------------------------------------------------------------------------
# Torch reference
# --------------------------------------------------------------------------------------------------


def flash_lora_attention_reference(
    q: Tensor,
    k: Tensor,
    v_base: Tensor,
    v_lr: Tensor,
    lora_b: Tensor,
    scaling: float,
    role_ids: Tensor | None = None,
    kv_lens: Tensor | None = None,
    sm_scale: float | None = None,
    *,
    upcast: bool = True,
) -> Tensor:
    """Eager PyTorch Flash-LoRA-Attention (any device), the ground truth for the kernels.

    Args:
        q: (B, Hq, Lc, D) queries; the Lc queries of sequence b sit at positions kv_lens[b]-Lc … kv_lens[b]-1.
        k: (B, Hkv, L, D) keys.
        v_base: (B, Hkv, L, D) base values ``X W0``.
        v_lr: (B, L, r) low-rank values ``X A``, shared by all KV heads.
        lora_b: (n_roles, Hkv, r, D) per-role up-projection, KV head g's slice at ``[:, g]``; any strides.
        scaling: LoRA scale s (alpha / r).
        role_ids: (B,) integer role of each sequence; default all 0.
        kv_lens: (B,) integer number of valid keys per sequence, in [Lc, L]; default L.
        sm_scale: softmax scale; default 1/sqrt(D).
        upcast: compute in float32 (True, the reference) or in q's dtype (False: "eager PyTorch at the same
            precision", the error yardstick of the kernel tests).

    Returns:
        (B, Hq, Lc, D) tensor in q's dtype.
    """
    role_ids, kv_lens, sm_scale = _check_inputs(
        q, k, v_base, v_lr, lora_b, scaling, role_ids, kv_lens, sm_scale, kernel=False
    )
    if role_ids is None:
        role_ids = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    if kv_lens is None:
        kv_lens = torch.full((q.shape[0],), k.shape[2], dtype=torch.long, device=q.device)
    out_dtype = q.dtype
    cdt = torch.float32 if upcast and q.dtype != torch.float64 else q.dtype
    bsz, hq, lc, d = q.shape
    hkv, seq = k.shape[1], k.shape[2]
    group = hq // hkv
    qf = q.to(cdt).reshape(bsz, hkv, group, lc, d)  # (B, Hkv, G, Lc, D); head h = g * G + j
    kf, vf, lrf = k.to(cdt), v_base.to(cdt), v_lr.to(cdt)
    bsel = lora_b[role_ids.long()].to(cdt)  # (B, Hkv, r, D)

    scores = torch.einsum("bgjqd,bgkd->bgjqk", qf, kf) * sm_scale  # (B, Hkv, G, Lc, L)
    key_pos = torch.arange(seq, device=q.device)
    q_pos = kv_lens.to(q.device).long().view(bsz, 1) - lc + torch.arange(lc, device=q.device)  # (B, Lc)
    visible = key_pos.view(1, 1, seq) <= q_pos.unsqueeze(-1)  # (B, Lc, L); also masks keys >= kv_lens
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o_base = torch.einsum("bgjqk,bgkd->bgjqd", p, vf)
    o_lr = torch.einsum("bgjqk,bkr->bgjqr", p, lrf)  # (B, Hkv, G, Lc, r)
    out = o_base + torch.einsum("bgjqr,bgrd->bgjqd", o_lr, bsel) * scaling
    return out.reshape(bsz, hq, lc, d).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# Autotune configs
# --------------------------------------------------------------------------------------------------


_AUTOTUNE = [False]


def set_autotune(enabled: bool) -> None:
    """Autotune the prefill/chunk launch per (GROUP, HEAD_DIM, rank, length bucket) when ``enabled``.

    Off by default: at run time a new shape bucket must not stall a step for seconds of tuning (or re-tune inside a
    trace); the fixed configs are the ones the benchmark's sweeps chose. The kernel benchmark turns it on."""
    _AUTOTUNE[0] = bool(enabled)


def _autotune_enabled() -> bool:
    return _AUTOTUNE[0] and not _interpreting()


def _prefill_default(head_dim: int) -> dict:
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _decode_default(head_dim: int) -> dict:
    if head_dim <= 128:
        return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


if triton is not None:
    _PREFILL_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in [
            (128, 64, 8, 3),
            (128, 128, 8, 2),
            (128, 64, 4, 3),
            (64, 64, 4, 3),
            (128, 32, 4, 3),
            (64, 32, 4, 2),
        ]
    ]
    _DECODE_CONFIGS = [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bn, w, s in [
            (64, 4, 3),
            (64, 4, 4),
            (128, 4, 3),
            (128, 8, 3),
            (32, 4, 4),
            (32, 2, 3),
            (32, 2, 4),
            (64, 2, 3),
        ]
    ]

    def _prune_configs(configs, named_args, **kwargs):
        """Keep tiles whose K, V and Q blocks plausibly fit in shared memory for this head dim."""
        head_dim = kwargs["HEAD_DIM"]
        keep = []
        for c in configs:
            bm = c.kwargs.get("BLOCK_M", kwargs.get("BLOCK_M", 16))
            bn = c.kwargs["BLOCK_N"]
            if head_dim >= 256 and (bm > 64 or bn > 64):
                continue
            keep.append(c)
        return keep or configs[-1:]


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _key_block_loop(
        acc, acc_lr, l_i, m_i, q,
        k_base, v_base_ptr, lr_base,
        stride_kl, stride_kd, stride_vl, stride_vd, stride_lrl, stride_lrr,
        row_last_key, rank, lo, hi,
        qk_scale,
        HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        """Online-softmax over key blocks [lo, hi); MASKED applies the causal/length mask."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < rank
        for start_n in range(lo, hi, BLOCK_N):
            n = start_n + offs_n
            k_ptrs = k_base + n[None, :] * stride_kl + offs_d[:, None] * stride_kd  # (D, BLOCK_N)
            v_ptrs = v_base_ptr + n[:, None] * stride_vl + offs_d[None, :] * stride_vd  # (BLOCK_N, D)
            lr_ptrs = lr_base + n[:, None] * stride_lrl + offs_r[None, :] * stride_lrr  # (BLOCK_N, R_PAD)
            if MASKED:
                n_ok = n < hi
                kt = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
                vlr = tl.load(lr_ptrs, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
                vlr = tl.load(lr_ptrs, mask=r_ok[None, :], other=0.0)
            qk = tl.dot(q, kt) * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
            if MASKED:
                qk = tl.where(n[None, :] <= row_last_key[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            p16 = p.to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(p16, v)
            acc_lr = acc_lr * alpha[:, None] + tl.dot(p16, vlr)
            m_i = m_new
        return acc, acc_lr, l_i, m_i

    @triton.jit
    def _lora_up(
        acc_lr, LB, role, g, stride_bn, stride_bh, stride_br, stride_bd, rank,
        HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr,
    ):  # fmt: skip
        """``acc_lr @ B_{role, g}``: (BLOCK_M, R_PAD) fp32 times the role's (r, D) slice -> (BLOCK_M, D) fp32."""
        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        b_base = LB + role * stride_bn + g * stride_bh + offs_d[None, :] * stride_bd
        if R_PAD < 16:
            # tl.dot needs K >= 16 for fp32: interleave zero columns, [a0, 0, a1, 0, ...], and matching B rows
            acc_lr = tl.reshape(tl.join(acc_lr, tl.zeros_like(acc_lr)), [acc_lr.shape[0], 2 * R_PAD])
            offs_k = tl.arange(0, 2 * R_PAD)
            k_ok = (offs_k % 2 == 0) & (offs_k // 2 < rank)
            b_g = tl.load(b_base + (offs_k // 2)[:, None] * stride_br, mask=k_ok[:, None], other=0.0)
        else:
            b_g = tl.load(b_base + offs_r[:, None] * stride_br, mask=(offs_r < rank)[:, None], other=0.0)
        return tl.dot(acc_lr, b_g.to(tl.float32), input_precision="ieee")  # fp32 FMA dot, once per block

    @triton.jit
    def _apply_b_and_store(
        acc, acc_lr, l_i,
        LB, role, g, stride_bn, stride_bh, stride_br, stride_bd, rank, lora_scaling,
        o_ptrs, row_ok,
        HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr,
    ):  # fmt: skip
        """O = (acc + (acc_lr @ B_g) * s) / l, with B_g (r, D) of this sequence's role; stores valid rows."""
        lora = _lora_up(acc_lr, LB, role, g, stride_bn, stride_bh, stride_br, stride_bd, rank, HEAD_DIM, R_PAD)
        out = (acc + lora * lora_scaling) / l_i[:, None]
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _flash_lora_fwd_kernel(
        Q, K, V, VLR, LB, ROLE, KVLEN, OUT, WS_ACC, WS_LR, WS_ML,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        stride_lrb, stride_lrl, stride_lrr,
        stride_bn, stride_bh, stride_br, stride_bd,
        stride_ob, stride_oh, stride_ol, stride_od,
        qk_scale, lora_scaling, n_kv_heads, q_len, seq_len, rank, split_len, tune_bucket,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, HAS_KVLEN: tl.constexpr,
        HAS_ROLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_M rows (query head j of the group, query position p) x one key range.

        Grid (row blocks, B * Hkv, splits). Row i of the block is query head g*GROUP + i % GROUP at query
        position i // GROUP. Without SPLIT it writes O; with SPLIT it writes fp32 partials (acc, acc_lr, m, l)
        that ``_flash_lora_combine_kernel`` merges.
        """
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the longest row blocks start first
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        b64 = b.to(tl.int64)
        g64 = g.to(tl.int64)
        if HAS_KVLEN:
            kv_len = tl.load(KVLEN + b).to(tl.int32)
        else:
            kv_len = seq_len
        if HAS_ROLE:
            role = tl.load(ROLE + b).to(tl.int64)
        else:
            role = 0

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < GROUP * q_len
        head = g * GROUP + rows % GROUP
        qpos = tl.minimum(rows // GROUP, q_len - 1)
        first_q = kv_len - q_len  # absolute position of query 0
        row_last_key = first_q + qpos  # (BLOCK_M,) last key each row may see
        p_min = (pid_m * BLOCK_M) // GROUP
        p_max = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = first_q + p_max + 1  # keys [0, hi) are visible to some row of the block
        full_end = ((first_q + p_min + 1) // BLOCK_N) * BLOCK_N  # blocks before this need no mask
        if SPLIT:
            lo = pid_s * split_len
            end = tl.minimum(lo + split_len, hi)
        else:
            lo = 0
            end = hi

        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + b64 * stride_qb + head[:, None].to(tl.int64) * stride_qh + qpos[:, None] * stride_ql
        q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D)
        k_base = K + b64 * stride_kb + g64 * stride_kh
        v_base_ptr = V + b64 * stride_vb + g64 * stride_vh
        lr_base = VLR + b64 * stride_lrb

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        acc_lr = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)

        acc, acc_lr, l_i, m_i = _key_block_loop(
            acc, acc_lr, l_i, m_i, q, k_base, v_base_ptr, lr_base,
            stride_kl, stride_kd, stride_vl, stride_vd, stride_lrl, stride_lrr,
            row_last_key, rank, lo, tl.minimum(end, full_end), qk_scale,
            HEAD_DIM, R_PAD, BLOCK_N, False,
        )  # fmt: skip
        acc, acc_lr, l_i, m_i = _key_block_loop(
            acc, acc_lr, l_i, m_i, q, k_base, v_base_ptr, lr_base,
            stride_kl, stride_kd, stride_vl, stride_vd, stride_lrl, stride_lrr,
            row_last_key, rank, tl.maximum(lo, full_end), end, qk_scale,
            HEAD_DIM, R_PAD, BLOCK_N, True,
        )  # fmt: skip

        if SPLIT:
            # Workspace layout: (B*Hkv, row blocks, splits, BLOCK_M, ...), fp32.
            slot = ((pid_bh * tl.num_programs(0) + pid_m) * tl.num_programs(2) + pid_s).to(tl.int64) * BLOCK_M
            r_idx = slot + tl.arange(0, BLOCK_M)
            offs_r = tl.arange(0, R_PAD)
            tl.store(WS_ACC + r_idx[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
            tl.store(WS_LR + r_idx[:, None] * R_PAD + offs_r[None, :], acc_lr, mask=row_ok[:, None])
            tl.store(WS_ML + r_idx * 2, m_i, mask=row_ok)
            tl.store(WS_ML + r_idx * 2 + 1, l_i, mask=row_ok)
        else:
            o_ptrs = OUT + b64 * stride_ob + head[:, None].to(tl.int64) * stride_oh + qpos[:, None] * stride_ol
            _apply_b_and_store(
                acc, acc_lr, l_i, LB, role, g64, stride_bn, stride_bh, stride_br, stride_bd, rank, lora_scaling,
                o_ptrs + offs_d[None, :] * stride_od, row_ok, HEAD_DIM, R_PAD,
            )  # fmt: skip

    @triton.jit
    def _flash_lora_combine_kernel(
        LB, ROLE, KVLEN, OUT, WS_ACC, WS_LR, WS_ML,
        stride_bn, stride_bh, stride_br, stride_bd,
        stride_ob, stride_oh, stride_ol, stride_od,
        lora_scaling, n_kv_heads, q_len, seq_len, rank, split_len, n_splits, n_blocks,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, HAS_KVLEN: tl.constexpr,
        HAS_ROLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """Merge the split partials of one output row, apply B, store it. Grid (GROUP * Lc, B * Hkv).

        Splits are read BLOCK_S at a time as (BLOCK_S, D) tiles, so a row costs a few wide loads, not one
        dependent load per split.
        """
        row = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        if HAS_KVLEN:
            kv_len = tl.load(KVLEN + b).to(tl.int32)
        else:
            kv_len = seq_len
        if HAS_ROLE:
            role = tl.load(ROLE + b).to(tl.int64)
        else:
            role = 0
        pid_m = row // BLOCK_M
        head = g * GROUP + row % GROUP
        qpos = row // GROUP
        p_max = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = kv_len - q_len + p_max + 1  # as in the split kernel: splits starting at or after hi are empty
        n_used = tl.minimum(tl.cdiv(hi, split_len), n_splits)

        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        offs_s = tl.arange(0, BLOCK_S)
        base = (pid_bh * n_blocks + pid_m).to(tl.int64) * n_splits
        m_run = tl.full([], -1.0e30, dtype=tl.float32)
        l_run = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        acc_lr = tl.zeros([R_PAD], dtype=tl.float32)
        for s0 in range(0, n_used, BLOCK_S):
            s_ok = s0 + offs_s < n_used
            slot = (base + s0 + offs_s) * BLOCK_M + row % BLOCK_M  # (BLOCK_S,)
            m_s = tl.load(WS_ML + slot * 2, mask=s_ok, other=-1.0e30)
            l_s = tl.load(WS_ML + slot * 2 + 1, mask=s_ok, other=0.0)
            m_new = tl.maximum(m_run, tl.max(m_s, 0))
            alpha = tl.math.exp2(m_run - m_new)
            w = tl.math.exp2(m_s - m_new)  # (BLOCK_S,), 0 for masked splits
            part = tl.load(WS_ACC + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
            part_lr = tl.load(WS_LR + slot[:, None] * R_PAD + offs_r[None, :], mask=s_ok[:, None], other=0.0)
            acc = acc * alpha + tl.sum(part * w[:, None], 0)
            acc_lr = acc_lr * alpha + tl.sum(part_lr * w[:, None], 0)
            l_run = l_run * alpha + tl.sum(l_s * w, 0)
            m_run = m_new

        b_ptrs = LB + role * stride_bn + g.to(tl.int64) * stride_bh + offs_r[:, None] * stride_br
        b_g = tl.load(b_ptrs + offs_d[None, :] * stride_bd, mask=(offs_r < rank)[:, None], other=0.0).to(tl.float32)
        out = (acc + tl.sum(acc_lr[:, None] * b_g, 0) * lora_scaling) / l_run
        o_ptrs = OUT + b.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + qpos * stride_ol
        tl.store(o_ptrs + offs_d * stride_od, out.to(OUT.dtype.element_ty))

    _KEY = ["GROUP", "HEAD_DIM", "R_PAD", "tune_bucket"]
    _prefill_tuned = triton.autotune(
        configs=_PREFILL_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune_configs}
    )(_flash_lora_fwd_kernel)
    _decode_tuned = triton.autotune(
        configs=_DECODE_CONFIGS, key=_KEY + ["BLOCK_M"], prune_configs_by={"early_config_prune": _prune_configs}
    )(_flash_lora_fwd_kernel)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter on CPU: any small number exercises the split path
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _num_splits(seq: int, base_programs: int, device: torch.device) -> tuple[int, int]:
    """Split the key range so that about 4 programs per SM run; each split a multiple of _SPLIT_ALIGN keys."""
    target = 4 * _num_sms(device)
    splits = max(1, min(triton.cdiv(seq, _SPLIT_ALIGN), triton.cdiv(target, base_programs)))
    split_len = triton.cdiv(triton.cdiv(seq, splits), _SPLIT_ALIGN) * _SPLIT_ALIGN
    return triton.cdiv(seq, split_len), split_len


@on_tensor_device
def _launch(
    q: Tensor,
    k: Tensor,
    v_base: Tensor,
    v_lr: Tensor,
    lora_b: Tensor,
    scaling: float,
    role_ids: Tensor | None,
    kv_lens: Tensor | None,
    sm_scale: float,
    *,
    force_split: bool | None = None,
) -> Tensor:
    """Pick the prefill or split-K launch and run it. Inputs are already validated (None = default)."""
    bsz, hq, lc, d = q.shape
    hkv, seq = k.shape[1], k.shape[2]
    group = hq // hkv
    rank = v_lr.shape[2]
    r_pad = max(8, _next_pow2(rank))
    rows = group * lc
    out = torch.empty((bsz, hq, lc, d), dtype=q.dtype, device=q.device)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): the kernel works with exp2
    tune_bucket = seq.bit_length() * 32 + lc.bit_length()  # autotune once per power-of-two (L, Lc) bucket
    flags = {"GROUP": group, "HEAD_DIM": d, "R_PAD": r_pad, "HAS_KVLEN": kv_lens is not None}
    flags["HAS_ROLE"] = role_ids is not None
    role_arg = out if role_ids is None else role_ids  # never read when the flag is off
    kv_arg = out if kv_lens is None else kv_lens
    common = (
        *q.stride(), *k.stride(), *v_base.stride(), *v_lr.stride(), *lora_b.stride(), *out.stride(),
        qk_scale, float(scaling), hkv, lc, seq, rank,
    )  # fmt: skip
    use_split = rows <= _DECODE_MAX_ROWS if force_split is None else force_split
    tune = _autotune_enabled()

    if not use_split:
        meta = {} if tune else _prefill_default(d)
        kern = _prefill_tuned if tune else _flash_lora_fwd_kernel

        def grid(m):
            return (triton.cdiv(rows, m["BLOCK_M"]), bsz * hkv, 1)

        kern[grid](
            q, k, v_base, v_lr, lora_b, role_arg, kv_arg, out, out, out, out,
            *common, seq, tune_bucket, SPLIT=False, **flags, **meta,
        )  # fmt: skip
        return out

    block_m = max(16, _next_pow2(rows))
    n_blocks = triton.cdiv(rows, block_m)
    n_splits, split_len = _num_splits(seq, bsz * hkv * n_blocks, q.device)
    slots = bsz * hkv * n_blocks * n_splits * block_m
    ws = torch.empty(slots * (d + r_pad + 2), dtype=torch.float32, device=q.device)  # fp32 partials
    ws_acc, ws_lr, ws_ml = ws[: slots * d], ws[slots * d : slots * (d + r_pad)], ws[slots * (d + r_pad) :]
    meta = {} if tune else _decode_default(d)
    kern = _decode_tuned if tune else _flash_lora_fwd_kernel
    kern[(n_blocks, bsz * hkv, n_splits)](
        q, k, v_base, v_lr, lora_b, role_arg, kv_arg, out, ws_acc, ws_lr, ws_ml,
        *common, split_len, tune_bucket, BLOCK_M=block_m, SPLIT=True, **flags, **meta,
    )  # fmt: skip
    _flash_lora_combine_kernel[(rows, bsz * hkv)](
        lora_b, role_arg, kv_arg, out, ws_acc, ws_lr, ws_ml,
        *lora_b.stride(), *out.stride(),
        float(scaling), hkv, lc, seq, rank, split_len, n_splits, n_blocks,
        BLOCK_M=block_m, BLOCK_S=min(32, _next_pow2(n_splits)), num_warps=4, **flags,
    )  # fmt: skip
    return out


_CUDNN_REFUSED: set[tuple] = set()  # (device, dtype, D, G) where cuDNN attention raised: the kernel serves them


def _full_prefill_sdpa(
    q: Tensor, k: Tensor, v_base: Tensor, v_lr: Tensor, lora_b: Tensor, scaling: float, role_ids: Tensor | None,
    sm_scale: float,
) -> Tensor | None:  # fmt: skip
    """A full causal prefill (every sequence has Lc == L keys) as cuDNN attention over ``V = V_base + V_lr B s``.

    cuDNN's causal kernel beats the Triton kernel on full prefills (``kernels/NOTES.md``), and expanding V costs
    O(L·D) bytes next to the O(L²·D) attention work, so this is the faster exact path there. The expansion is one
    ``baddbmm`` (fp32 accumulate, one rounding to q's dtype). Returns None, and the caller runs the kernel, when
    cuDNN is not available, refuses the shape, or ``LRAGENT_FLA_PREFILL_SDPA=0``.
    """
    if not q.is_cuda or _interpreting() or os.environ.get("LRAGENT_FLA_PREFILL_SDPA", "1") == "0":
        return None
    bsz, hq, seq, d = q.shape
    hkv = k.shape[1]
    key = (q.device, q.dtype, d, hq // hkv)
    if key in _CUDNN_REFUSED:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not hasattr(SDPBackend, "CUDNN_ATTENTION"):
        return None
    roles = role_ids.long() if role_ids is not None else torch.zeros(bsz, dtype=torch.long, device=q.device)
    b_sel = lora_b[roles].to(q.dtype)  # (B, Hkv, r, D)
    lr = v_lr.unsqueeze(1).expand(bsz, hkv, seq, v_lr.shape[2])  # (B, Hkv, L, r), a view
    v = torch.baddbmm(v_base.flatten(0, 1), lr.flatten(0, 1), b_sel.flatten(0, 1), alpha=scaling)  # (B*Hkv, L, D)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(
                q, k, v.view(bsz, hkv, seq, d), is_causal=True, scale=sm_scale, enable_gqa=hq != hkv
            )
    except RuntimeError as err:  # no cuDNN kernel for this shape / GPU: remember it and use the Triton kernel
        _CUDNN_REFUSED.add(key)
        log.info("cuDNN attention refused a full prefill (%s); using the Triton kernel", str(err).splitlines()[0])
        return None


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------


def flash_lora_attention(
    q: Tensor,
    k: Tensor,
    v_base: Tensor,
    v_lr: Tensor,
    lora_b: Tensor,
    scaling: float,
    role_ids: Tensor | None = None,
    kv_lens: Tensor | None = None,
    sm_scale: float | None = None,
) -> Tensor:
    """Fused attention over a base value cache plus a low-rank value cache (Triton, CUDA).

    Computes ``softmax(Q Kᵀ sm_scale + causal) · (V_base + V_lr B_{role} · scaling)`` per query head, without
    materialising ``V_lr B``. Lc ≤ 64 / group rows per KV head run the split-K decode kernel, larger chunks
    the prefill kernel; a full causal prefill (kv_lens None, Lc == L) runs cuDNN attention over the expanded
    values where cuDNN accepts it (faster there, see ``_full_prefill_sdpa``). For batched decode over a static
    cache (CUDA graphs) use :func:`kernels.flash_lora_decode.flash_lora_decode`.

    Args:
        q: (B, Hq, Lc, D) fp16/bf16 queries; last dim contiguous. The Lc queries of sequence b sit at
            positions kv_lens[b]-Lc … kv_lens[b]-1 (causal, aligned bottom-right).
        k: (B, Hkv, L, D) keys, same dtype; Hq must be a multiple of Hkv (query head h uses KV head
            h // (Hq // Hkv)); may be a narrowed view of a larger cache; last dim contiguous.
        v_base: (B, Hkv, L, D) base values, same dtype and shape as k.
        v_lr: (B, L, r) low-rank values shared by all KV heads, 1 <= r <= 64, same dtype.
        lora_b: (n_roles, Hkv, r, D) up-projections (fp16/bf16/fp32), any strides, e.g. the view
            ``B.view(n_roles, Hkv, D, r).transpose(-1, -2)`` of a PEFT-layout (n_roles, Hkv*D, r) weight.
        scaling: LoRA scale s (alpha / r).
        role_ids: (B,) integer role per sequence (gathers lora_b per batch item); default all 0.
        kv_lens: (B,) integer valid key count per sequence, Lc <= kv_lens[b] <= L; default L.
        sm_scale: softmax scale; default 1/sqrt(D).

    Returns:
        (B, Hq, Lc, D) tensor in q's dtype.

    Raises:
        ValueError: wrong dtype, shape, device or stride, naming the argument.
    """
    role_ids, kv_lens, sm_scale = _check_inputs(
        q, k, v_base, v_lr, lora_b, scaling, role_ids, kv_lens, sm_scale, kernel=True
    )
    bsz, hq, lc, _ = q.shape
    if kv_lens is None and lc == k.shape[2] and (hq // k.shape[1]) * lc > _DECODE_MAX_ROWS:
        out = _full_prefill_sdpa(q, k, v_base, v_lr, lora_b, scaling, role_ids, sm_scale)
        if out is not None:
            return out
    return _launch(q, k, v_base, v_lr, lora_b, scaling, role_ids, kv_lens, sm_scale)
