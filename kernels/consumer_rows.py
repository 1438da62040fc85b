"""The shared pass's consumer-row correction: the r-wide attention of a few query rows, forward and backward.

The training step's shared pass (λ > 0) runs each sequence's first ``start[b]`` tokens as a producer role and the
rest as a consumer role over the decomposed cache (DESIGN §2, ``base_lr_shared``). Every query row applies its own
role's ``B`` to the shared ``V_lr``. Row t's softmax row ``P_t`` is the same whichever values it reads, so

    O_t = P_t V_prod + [t is a consumer row] · (P_t V_lr) · ΔB,     ΔB = s · (B_consumer - B_producer)

where ``V_prod = V_base + s · V_lr B_producer``: the first term is one plain causal attention over the producer's
values (the plain pass's D-wide kernel), and the second needs, for the consumer rows only, attention with r-wide
values (``V_lr``). This module computes that second term and its gradients for the packed consumer rows
(``lragent.attention.two_piece_attention`` glues it to the first term):

- :func:`consumer_lr_forward` — for every consumer row and query head: the softmax statistic ``lse`` and
  ``O_lr = P V_lr``; adds ``O_lr ΔB`` to the output rows *in place* and returns the rows it overwrote.
- :func:`consumer_lr_backward` — given ``u = dO ΔBᵀ`` and ``c = rowsum(dO ∘ O_lr ΔB)`` per row: the correction's
  ``dq`` (packed rows), ``dk`` (every key) and ``dV_lr`` (every key), from ``dS = P ∘ (u V_lrᵀ - c)``.

Two implementations with one contract: Triton kernels (CUDA, fp16/bf16; :data:`TRITON_OK`) and eager PyTorch over
the rows padded per sequence (any device and dtype; the oracle of the kernels in the CPU tests, which run the kernels
under ``TRITON_INTERPRET=1``). The kernels stack the query heads of one KV head as rows (GQA: each K/V tile is loaded
once per group) and never expand K or V per query head.

Layout of the packed rows: sequence b's consumer rows are positions ``start[b] … start[b] + count[b] - 1``, stored at
packed indices ``cu[b] … cu[b + 1] - 1``; per packed row and query head: ``lse`` (natural log), ``O_lr`` (r, fp32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without Triton: the torch implementation only
    triton = None
    tl = None

__all__ = [
    "ConsumerRows",
    "ConsumerGrads",
    "add_dq_rows",
    "consumer_backward",
    "consumer_lr_forward",
    "kernels_usable",
    "read_rows",
    "restore_rows",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_BLOCK_M, _BLOCK_N = 64, 64


@dataclass(frozen=True)
class ConsumerRows:
    """Where the consumer rows are.

    Attributes:
        start: ``(B,)`` int32, each sequence's first consumer position.
        count: ``(B,)`` int32, its consumer rows (0 allowed).
        cu: ``(B + 1,)`` int32, packed offsets (``cu[b + 1] - cu[b] == count[b]``).
        row_seq: ``(N,)`` long, each packed row's sequence.
        row_pos: ``(N,)`` long, each packed row's position.
        max_count: ``max(count)`` (host int: the launch grid).
        max_end: ``max(start + count)``, the keys any row reads (host int: the key splits).
    """

    start: Tensor
    count: Tensor
    cu: Tensor
    row_seq: Tensor
    row_pos: Tensor
    max_count: int
    max_end: int = 0

    @property
    def n_rows(self) -> int:
        return int(self.row_seq.numel())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_usable(q: Tensor) -> bool:
    """The Triton kernels run for these queries: Triton present, half precision, CUDA (or the interpreter on CPU)."""
    if triton is None or q.dtype not in _KERNEL_DTYPES or q.shape[-1] not in (16, 32, 64, 128, 256):
        return False
    return q.is_cuda or _interpreting()


def _r_pad(rank: int) -> int:
    """r padded to a power of two of at least 16 (``tl.dot`` needs K >= 16); the padding columns load as zeros."""
    return max(16, 1 << max(0, rank - 1).bit_length())


# --------------------------------------------------------------------------------------------------
# PyTorch implementation (any device): rows padded to max_count per sequence
# --------------------------------------------------------------------------------------------------


def _padded(rows: ConsumerRows, n_seq: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(idx, ok, pos)``: ``(B, M)`` packed index (clamped), validity and position of the padded rows."""
    m = max(rows.max_count, 1)
    i = torch.arange(m, device=rows.cu.device)
    ok = i[None, :] < rows.count.long()[:, None]  # (B, M)
    idx = (rows.cu[:-1].long()[:, None] + i[None, :]).clamp(max=max(rows.n_rows - 1, 0))
    pos = rows.start.long()[:, None] + i[None, :]
    return idx, ok, pos


def _torch_scores(q: Tensor, k: Tensor, rows: ConsumerRows, sm_scale: float) -> tuple[Tensor, ...]:
    """Scores of the padded consumer rows: ``(s, visible, idx, ok, qr)``, ``s`` (B, H_kv, G, M, T) and the rows'
    queries ``qr`` (B, H_kv, G, M, D), float32 (float64 for float64 input)."""
    b, h_q, t, d = q.shape
    h_kv = k.shape[1]
    idx, ok, pos = _padded(rows, b)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qr = q.transpose(1, 2)[torch.arange(b, device=q.device)[:, None], pos.clamp(max=t - 1)]  # (B, M, H_q, D)
    qr = qr.to(cdt).view(b, -1, h_kv, h_q // h_kv, d).permute(0, 2, 3, 1, 4)  # (B, H_kv, G, M, D)
    s = torch.einsum("bkgmd,bktd->bkgmt", qr, k.to(cdt)) * sm_scale
    visible = (torch.arange(t, device=q.device)[None, None, :] <= pos[:, :, None]) & ok[:, :, None]  # (B, M, T)
    return s, visible[:, None, None], idx, ok, qr


def _torch_forward(q, k, v_lr, rows: ConsumerRows, sm_scale: float) -> tuple[Tensor, Tensor]:
    """``(lse, o_lr)``: ``(N, H_q)`` and ``(N, H_q, r)`` of the packed rows (float32, float64 for float64 input)."""
    b, h_q = q.shape[:2]
    s, visible, idx, ok, _ = _torch_scores(q, k, rows, sm_scale)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (B, H_kv, G, M); -inf on padding rows
    p = torch.exp(s - lse.masked_fill(~ok[:, None, None], 0)[..., None]).masked_fill(~visible, 0)
    o_lr = torch.einsum("bkgmt,btr->bkgmr", p, v_lr.to(s.dtype))
    sel = ok.flatten()
    lse = lse.permute(0, 3, 1, 2).reshape(b * ok.shape[1], h_q)[sel]  # (N, H_q): packed order is b-major
    o_lr = o_lr.permute(0, 3, 1, 2, 4).reshape(b * ok.shape[1], h_q, -1)[sel]
    return lse, o_lr


def _torch_backward(q, k, v_lr, rows: ConsumerRows, lse, u, c, sm_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv_lr)`` of the correction: ``(N, H_q, D)``, ``(B, T, H_kv, D)``, ``(B, T, r)`` float."""
    b, h_q, t, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    s, visible, idx, ok, qr = _torch_scores(q, k, rows, sm_scale)
    m = ok.shape[1]

    def padded(x: Tensor) -> Tensor:  # (N, H_q, ...) -> (B, H_kv, G, M, ...), zeros on padding rows
        y = x[idx.flatten()].view(b, m, h_kv, g, *x.shape[2:]) * ok.view(b, m, 1, 1, *([1] * (x.dim() - 2)))
        return y.permute(0, 2, 3, 1, *range(4, y.dim()))

    lse_p, u_p, c_p = padded(lse.to(s.dtype)), padded(u.to(s.dtype)), padded(c.to(s.dtype))
    p = torch.exp(s - lse_p[..., None]).masked_fill(~visible, 0)  # (B, H_kv, G, M, T)
    dp = torch.einsum("bkgmr,btr->bkgmt", u_p, v_lr.to(s.dtype))
    ds = p * (dp - c_p[..., None]) * sm_scale
    dq = torch.einsum("bkgmt,bktd->bkgmd", ds, k.to(s.dtype)).permute(0, 3, 1, 2, 4).reshape(b * m, h_q, d)
    dk = torch.einsum("bkgmt,bkgmd->btkd", ds, qr)
    dv_lr = torch.einsum("bkgmt,bkgmr->btr", p, u_p)
    return dq[ok.flatten()], dk, dv_lr


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------
# A few rows over every key, like decoding: the forward and dQ split the key range over programs (fp32 partials, then
# a merge), and dK/dV_lr run one program per key tile over the (few) row blocks that see it.

if triton is not None:

    @triton.jit
    def _rows_of_block(START, COUNT, CU, b, g, pid_m, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
        """Block pid_m of sequence b's consumer rows for KV head g: row i = query head g*GROUP + i % GROUP at
        consumer row i // GROUP. Returns (row_ok, head, packed row, position, count)."""
        start = tl.load(START + b)
        count = tl.load(COUNT + b)
        base = tl.load(CU + b)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < GROUP * count
        head = g * GROUP + rows % GROUP
        i = tl.minimum(rows // GROUP, tl.maximum(count - 1, 0))
        return row_ok, head, base + i, start + i, count

    @triton.jit
    def _load_q_rows(Q, b64, head, pos, row_ok, stride_qb, stride_qh, stride_ql, stride_qd, HEAD_DIM: tl.constexpr):
        """The block's query rows (M, D); rows off the block load as zeros."""
        offs_d = tl.arange(0, HEAD_DIM)
        ptrs = Q + b64 * stride_qb + head[:, None].to(tl.int64) * stride_qh + pos[:, None].to(tl.int64) * stride_ql
        return tl.load(ptrs + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)

    @triton.jit
    def _key_tile(K, LR, b64, g64, n, n_ok, stride_kb, stride_kh, stride_kl, stride_kd, stride_lrb, stride_lrl,
                  stride_lrr, rank, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
        """Keys (D, N) and low-rank values (N, R_PAD) of one tile; keys off the tile and columns past r are zeros."""
        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        k_ptrs = (
            K + b64 * stride_kb + g64 * stride_kh + n[None, :].to(tl.int64) * stride_kl + offs_d[:, None] * stride_kd
        )
        kt = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
        lr_ptrs = LR + b64 * stride_lrb + n[:, None].to(tl.int64) * stride_lrl + offs_r[None, :] * stride_lrr
        lr = tl.load(lr_ptrs, mask=n_ok[:, None] & (offs_r < rank)[None, :], other=0.0)
        return kt, lr

    @triton.jit
    def _load_delta_b(DB, b64, g, stride_db_b, stride_db_h, stride_db_r, stride_db_d, rank,
                      HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr):  # fmt: skip
        """ΔB of sequence b and KV head g, (R_PAD, D) fp32 (rows past r are zeros)."""
        offs_r = tl.arange(0, R_PAD)
        ptrs = DB + b64 * stride_db_b + g.to(tl.int64) * stride_db_h + offs_r[:, None] * stride_db_r
        return tl.load(ptrs + tl.arange(0, HEAD_DIM)[None, :] * stride_db_d, mask=(offs_r < rank)[:, None], other=0.0)

    @triton.jit
    def _consumer_fwd_kernel(
        Q, K, LR, START, COUNT, CU, WS_M, WS_L, WS_ACC,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_lrb, stride_lrl, stride_lrr,
        qk_scale, n_kv_heads, n_q_heads, rank, split_len, n_row_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Grid (row blocks, B * H_kv, splits): the online-softmax partials (m, l, P V_lr) of one key split with
        r-wide values V_lr, causal (key <= row position), in the log2 domain. Empty splits write neutral partials."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        row_ok, head, prow, pos, count = _rows_of_block(START, COUNT, CU, b, g, pid_m, GROUP, BLOCK_M)
        if pid_m * BLOCK_M < GROUP * count:
            b64 = b.to(tl.int64)
            q = _load_q_rows(Q, b64, head, pos, row_ok, stride_qb, stride_qh, stride_ql, stride_qd, HEAD_DIM)
            lo = pid_s * split_len
            hi = tl.minimum(lo + split_len, tl.max(tl.where(row_ok, pos, 0), 0) + 1)
            m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
            for n0 in range(lo, hi, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                kt, lr = _key_tile(K, LR, b64, g.to(tl.int64), n, n < hi, stride_kb, stride_kh, stride_kl,
                                   stride_kd, stride_lrb, stride_lrl, stride_lrr, rank, HEAD_DIM, R_PAD)  # fmt: skip
                qk = tl.dot(q, kt) * qk_scale
                qk = tl.where(n[None, :] <= pos[:, None], qk, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.math.exp2(qk - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(lr.dtype), lr)
                m_i = m_new
            ws = pid_s.to(tl.int64) * n_row_heads + prow.to(tl.int64) * n_q_heads + head
            tl.store(WS_M + ws, m_i, mask=row_ok)
            tl.store(WS_L + ws, l_i, mask=row_ok)
            tl.store(WS_ACC + ws[:, None] * R_PAD + tl.arange(0, R_PAD)[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _consumer_merge_kernel(
        DB, START, COUNT, CU, WS_M, WS_L, WS_ACC, OUT, O_SAVE, O_LR, LSE,
        stride_db_b, stride_db_h, stride_db_r, stride_db_d,
        stride_ob, stride_oh, stride_ol, stride_od,
        n_kv_heads, n_q_heads, rank, n_splits, n_row_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (row blocks, B * H_kv): merge the splits' partials into lse and O_lr, then O[pos, head] += O_lr ΔB
        (ΔB of the sequence, fp32) in place, the old rows saved to O_SAVE."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        row_ok, head, prow, pos, count = _rows_of_block(START, COUNT, CU, b, g, pid_m, GROUP, BLOCK_M)
        if pid_m * BLOCK_M < GROUP * count:
            b64 = b.to(tl.int64)
            offs_d = tl.arange(0, HEAD_DIM)
            offs_r = tl.arange(0, R_PAD)
            r_ok = offs_r < rank
            row64 = prow.to(tl.int64) * n_q_heads + head
            m_all = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
            for s in range(0, n_splits):
                m_all = tl.maximum(m_all, tl.load(WS_M + s * n_row_heads + row64, mask=row_ok, other=-1.0e30))
            l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
            for s in range(0, n_splits):
                ws = s * n_row_heads + row64
                w = tl.math.exp2(tl.load(WS_M + ws, mask=row_ok, other=-1.0e30) - m_all)
                l_all += w * tl.load(WS_L + ws, mask=row_ok, other=0.0)
                part = tl.load(WS_ACC + ws[:, None] * R_PAD + offs_r[None, :], mask=row_ok[:, None], other=0.0)
                acc += w[:, None] * part
            l_all = tl.where(row_ok, l_all, 1.0)
            o_lr = acc / l_all[:, None]
            tl.store(LSE + row64, (m_all + tl.math.log2(l_all)) * 0.6931471805599453, mask=row_ok)
            tl.store(O_LR + row64[:, None] * rank + offs_r[None, :], o_lr, mask=row_ok[:, None] & r_ok[None, :])
            db = _load_delta_b(DB, b64, g, stride_db_b, stride_db_h, stride_db_r, stride_db_d, rank, HEAD_DIM, R_PAD)
            delta = tl.dot(o_lr, db, input_precision="ieee")  # (M, D), once per block
            o_ptrs = (OUT + b64 * stride_ob + head[:, None].to(tl.int64) * stride_oh
                      + pos[:, None].to(tl.int64) * stride_ol + offs_d[None, :] * stride_od)  # fmt: skip
            o_old = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
            tl.store(O_SAVE + row64[:, None] * HEAD_DIM + offs_d[None, :], o_old, mask=row_ok[:, None])
            tl.store(o_ptrs, (o_old.to(tl.float32) + delta).to(o_old.dtype), mask=row_ok[:, None])

    @triton.jit
    def _softmax_grad_tile(q, kt, lr, lse2, u, c, pos, row_ok, n, qk_scale):
        """P (fp32) and dS = P ∘ (u V_lrᵀ - c) of one (rows, keys) tile; u in V_lr's dtype."""
        qk = tl.dot(q, kt) * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        p = tl.where((n[None, :] <= pos[:, None]) & row_ok[:, None], p, 0.0)
        dp = tl.dot(u, tl.trans(lr))
        return p, p * (dp - c[:, None])

    @triton.jit
    def _load_row_grads(LSE, U, C, row64, row_ok, R_PAD: tl.constexpr):
        """lse (log2 domain), u (M, R_PAD) and c of the block's rows."""
        lse2 = tl.load(LSE + row64, mask=row_ok, other=0.0) * 1.4426950408889634
        u = tl.load(U + row64[:, None] * R_PAD + tl.arange(0, R_PAD)[None, :], mask=row_ok[:, None], other=0.0)
        c = tl.load(C + row64, mask=row_ok, other=0.0)
        return lse2, u, c

    @triton.jit
    def _consumer_dk_kernel(
        Q, K, LR, START, COUNT, CU, LSE, U, C, DK, DLR,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_lrb, stride_lrl, stride_lrr,
        qk_scale, sm_scale, n_kv_heads, n_q_heads, rank, seq_len,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Grid (key tiles, B * H_kv): dK (B, T, H_kv, D) and this KV head's share of dV_lr (B, H_kv, T, R_PAD) of
        one key tile, summed over the consumer rows that see it. Tiles no row sees are written as zeros."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        b64 = b.to(tl.int64)
        g64 = g.to(tl.int64)
        start = tl.load(START + b)
        count = tl.load(COUNT + b)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        n0 = pid_n * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < seq_len
        kt, lr = _key_tile(K, LR, b64, g64, n, n_ok, stride_kb, stride_kh, stride_kl, stride_kd, stride_lrb,
                           stride_lrl, stride_lrr, rank, HEAD_DIM, R_PAD)  # fmt: skip
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dlr = tl.zeros([BLOCK_N, R_PAD], dtype=tl.float32)
        first = tl.maximum(n0 - start, 0) * GROUP  # rows before this see none of the tile
        for m0 in range((first // BLOCK_M) * BLOCK_M, GROUP * count, BLOCK_M):
            row_ok, head, prow, pos, _ = _rows_of_block(START, COUNT, CU, b, g, m0 // BLOCK_M, GROUP, BLOCK_M)
            q = _load_q_rows(Q, b64, head, pos, row_ok, stride_qb, stride_qh, stride_ql, stride_qd, HEAD_DIM)
            lse2, u, c = _load_row_grads(LSE, U, C, prow.to(tl.int64) * n_q_heads + head, row_ok, R_PAD)
            p, ds = _softmax_grad_tile(q, kt, lr, lse2, u, c, pos, row_ok, n, qk_scale)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            dlr += tl.dot(tl.trans(p.to(u.dtype)), u)
        dk_ptrs = DK + ((b64 * seq_len + n[:, None]) * n_kv_heads + g64) * HEAD_DIM + offs_d[None, :]
        tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok[:, None])
        dlr_ptrs = DLR + ((b64 * n_kv_heads + g64) * seq_len + n[:, None]) * R_PAD + offs_r[None, :]
        tl.store(dlr_ptrs, dlr, mask=n_ok[:, None])

    @triton.jit
    def _consumer_dq_kernel(
        Q, K, LR, START, COUNT, CU, LSE, U, C, WS_DQ,
        stride_qb, stride_qh, stride_ql, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_lrb, stride_lrl, stride_lrr,
        qk_scale, sm_scale, n_kv_heads, n_q_heads, rank, split_len, n_row_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """Grid (row blocks, B * H_kv, splits): one key split's share of dQ (splits, N * H_q, D), fp32."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        row_ok, head, prow, pos, count = _rows_of_block(START, COUNT, CU, b, g, pid_m, GROUP, BLOCK_M)
        if pid_m * BLOCK_M < GROUP * count:
            b64 = b.to(tl.int64)
            q = _load_q_rows(Q, b64, head, pos, row_ok, stride_qb, stride_qh, stride_ql, stride_qd, HEAD_DIM)
            row64 = prow.to(tl.int64) * n_q_heads + head
            lse2, u, c = _load_row_grads(LSE, U, C, row64, row_ok, R_PAD)
            lo = pid_s * split_len
            hi = tl.minimum(lo + split_len, tl.max(tl.where(row_ok, pos, 0), 0) + 1)
            dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for n0 in range(lo, hi, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                kt, lr = _key_tile(K, LR, b64, g.to(tl.int64), n, n < hi, stride_kb, stride_kh, stride_kl,
                                   stride_kd, stride_lrb, stride_lrl, stride_lrr, rank, HEAD_DIM, R_PAD)  # fmt: skip
                _, ds = _softmax_grad_tile(q, kt, lr, lse2, u, c, pos, row_ok, n, qk_scale)
                dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
            ws = pid_s.to(tl.int64) * n_row_heads + row64
            tl.store(WS_DQ + ws[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], dq * sm_scale,
                     mask=row_ok[:, None])  # fmt: skip

    @triton.jit
    def _consumer_prep_kernel(
        G, O_LR, DB, START, COUNT, CU, U, C, WS_X,
        stride_gb, stride_gh, stride_gl, stride_gd,
        stride_db_b, stride_db_h, stride_db_r, stride_db_d,
        n_kv_heads, n_q_heads, rank, n_blocks,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (row blocks, B * H_kv): from the output gradient's rows dO: u = dO ΔBᵀ (r-wide, stored in U's
        dtype), c = rowsum(u ∘ O_lr), and this block's share of O_lrᵀ dO (R_PAD, D) for ΔB's gradient (WS_X,
        zeros for blocks without rows)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        b64 = b.to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < rank
        row_ok, head, prow, pos, count = _rows_of_block(START, COUNT, CU, b, g, pid_m, GROUP, BLOCK_M)
        d_out = _load_q_rows(G, b64, head, pos, row_ok, stride_gb, stride_gh, stride_gl, stride_gd, HEAD_DIM)
        d_out = d_out.to(tl.float32)
        row64 = prow.to(tl.int64) * n_q_heads + head
        o_lr = tl.load(O_LR + row64[:, None] * rank + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        db = _load_delta_b(DB, b64, g, stride_db_b, stride_db_h, stride_db_r, stride_db_d, rank, HEAD_DIM, R_PAD)
        u = tl.dot(d_out, tl.trans(db), input_precision="ieee")  # (M, R_PAD)
        c = tl.sum(u * o_lr, 1)
        tl.store(U + row64[:, None] * R_PAD + offs_r[None, :], u.to(U.dtype.element_ty), mask=row_ok[:, None])
        tl.store(C + row64, c, mask=row_ok)
        x = tl.dot(tl.trans(o_lr), d_out, input_precision="ieee")  # (R_PAD, D); rows off the block are zeros
        ws = (pid_bh.to(tl.int64) * n_blocks + pid_m) * R_PAD
        tl.store(WS_X + (ws + offs_r[:, None]) * HEAD_DIM + offs_d[None, :], x)

    @triton.jit
    def _add_dq_rows_kernel(
        GQ, WS_DQ, START, COUNT, CU,
        stride_gb, stride_gh, stride_gl, stride_gd,
        n_kv_heads, n_q_heads, n_splits, n_row_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    ):  # fmt: skip
        """Grid (row blocks, B * H_kv): GQ[b, head, pos] += Σ_splits WS_DQ[split, row, head] in place (each
        (row, head) belongs to one program: no atomics, no sort)."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // n_kv_heads
        g = pid_bh % n_kv_heads
        row_ok, head, prow, pos, count = _rows_of_block(START, COUNT, CU, b, g, pid_m, GROUP, BLOCK_M)
        if pid_m * BLOCK_M < GROUP * count:
            offs_d = tl.arange(0, HEAD_DIM)
            row64 = prow.to(tl.int64) * n_q_heads + head
            dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for s in range(0, n_splits):
                ws = s * n_row_heads + row64
                dq += tl.load(WS_DQ + ws[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            ptrs = (GQ + b.to(tl.int64) * stride_gb + head[:, None].to(tl.int64) * stride_gh
                    + pos[:, None].to(tl.int64) * stride_gl + offs_d[None, :] * stride_gd)  # fmt: skip
            old = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
            tl.store(ptrs, (old.to(tl.float32) + dq).to(old.dtype), mask=row_ok[:, None])


_SPLIT_LEN = 256  # keys per program in the forward and dQ (4 tiles): ~8 splits at 2k keys
_BLOCK_N_DK = 128  # keys per program of dK / dV_lr


def _launch_shape(q: Tensor, k: Tensor, rows: ConsumerRows) -> tuple[int, int, int]:
    """(row blocks, B * H_kv, key splits) of the split launches."""
    b, h_q = q.shape[:2]
    h_kv = k.shape[1]
    return triton.cdiv((h_q // h_kv) * rows.max_count, _BLOCK_M), b * h_kv, triton.cdiv(rows.max_end, _SPLIT_LEN)


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


@on_tensor_device
def consumer_lr_forward(
    q: Tensor, k: Tensor, v_lr: Tensor, delta_b: Tensor, out: Tensor, rows: ConsumerRows, use_kernel: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """For every consumer row: ``lse``, ``O_lr = P V_lr``, and ``out[b, :, pos] += O_lr ΔB`` in place.

    The write into ``out`` goes to its storage without touching its autograd version counter: the caller owns
    ``out`` and restores the rows (:func:`restore_rows`) before anything reads them for a gradient.

    Args:
        q: ``(B, H_q, T, D)`` queries (any strides, last dim contiguous for the kernel).
        k: ``(B, H_kv, T, D)`` keys.
        v_lr: ``(B, T, r)`` low-rank values.
        delta_b: ``(B, H_kv, r, D)`` float32 ``s · (B_consumer - B_producer)`` per sequence and KV head.
        out: ``(B, H_q, T, D)`` the attention output over the producer's values; its consumer rows are updated.
        rows: the consumer rows.
        use_kernel: use the Triton kernels where they run (:func:`kernels_usable`).

    Returns:
        ``(lse, o_lr, saved)``: ``(N, H_q)`` float32 (natural log), ``(N, H_q, r)`` float32 and the overwritten rows
        of ``out`` ``(N, H_q, D)`` in its dtype.
    """
    b, h_q, t, d = q.shape
    h_kv, rank = k.shape[1], v_lr.shape[-1]
    n = rows.n_rows
    sm_scale = d**-0.5
    if use_kernel and kernels_usable(q):
        dev = q.device
        lse = torch.empty(n, h_q, device=dev, dtype=torch.float32)
        o_lr = torch.empty(n, h_q, rank, device=dev, dtype=torch.float32)
        saved = torch.empty(n, h_q, d, device=dev, dtype=out.dtype)
        if n:
            r_pad = _r_pad(rank)
            grid = _launch_shape(q, k, rows)
            ws_m = torch.empty(grid[2], n * h_q, device=dev, dtype=torch.float32)
            ws_l = torch.empty_like(ws_m)
            ws_acc = torch.empty(grid[2], n * h_q, r_pad, device=dev, dtype=torch.float32)
            flags = {"GROUP": h_q // h_kv, "HEAD_DIM": d, "R_PAD": r_pad, "BLOCK_M": _BLOCK_M}
            _consumer_fwd_kernel[grid](
                q, k, v_lr, rows.start, rows.count, rows.cu, ws_m, ws_l, ws_acc,
                *q.stride(), *k.stride(), *v_lr.stride(),
                sm_scale * _LOG2E, h_kv, h_q, rank, _SPLIT_LEN, n * h_q,
                **flags, BLOCK_N=_BLOCK_N, num_warps=4, num_stages=2,
            )  # fmt: skip
            _consumer_merge_kernel[grid[:2]](
                delta_b, rows.start, rows.count, rows.cu, ws_m, ws_l, ws_acc, out, saved, o_lr, lse,
                *delta_b.stride(), *out.stride(), h_kv, h_q, rank, grid[2], n * h_q,
                **flags, num_warps=4, num_stages=1,
            )  # fmt: skip
        return lse, o_lr, saved
    lse, o_lr = _torch_forward(q, k, v_lr, rows, sm_scale)
    rs = rows.row_seq
    delta = torch.einsum("nkgr,nkrd->nkgd", o_lr.view(n, h_kv, h_q // h_kv, rank), delta_b[rs].to(o_lr.dtype))
    o = out.data.transpose(1, 2)  # .data: an untracked write (the caller restores the rows)
    saved = o[rs, rows.row_pos].clone()  # (N, H_q, D)
    o[rs, rows.row_pos] = (saved.to(delta.dtype) + delta.reshape(n, h_q, d)).to(out.dtype)
    return lse, o_lr, saved


def read_rows(out: Tensor, rows: ConsumerRows) -> Tensor:
    """The consumer rows of ``out`` ``(B, H_q, T, D)``, packed: ``(N, H_q, D)`` (a copy)."""
    return out.data.transpose(1, 2)[rows.row_seq, rows.row_pos]


def restore_rows(out: Tensor, rows: ConsumerRows, saved: Tensor) -> None:
    """Write packed rows ``saved`` ``(N, H_q, D)`` into ``out``'s storage (untracked): undoes
    :func:`consumer_lr_forward`'s update with its saved rows, or redoes it with the updated rows."""
    if rows.n_rows:
        out.data.transpose(1, 2)[rows.row_seq, rows.row_pos] = saved


@dataclass
class ConsumerGrads:
    """The correction's gradients (:func:`consumer_backward`).

    Attributes:
        dq_parts: ``(S, N * H_q, D)`` float32 per key split (summed: ``dQ`` of the packed rows); added into the
            queries' gradient by :func:`add_dq_rows`.
        dk: ``(B, T, H_kv, D)`` in k's dtype (float32/float64 from the PyTorch implementation).
        dv_lr: ``(B, T, r)`` float32.
        x: ``(B, H_kv, r, D)`` ``Σ_rows O_lrᵀ dO`` per sequence and KV head (times ``s``: ΔB's gradient).
    """

    dq_parts: Tensor
    dk: Tensor
    dv_lr: Tensor
    x: Tensor


@on_tensor_device
def consumer_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v_lr: Tensor,
    delta_b: Tensor,
    rows: ConsumerRows,
    lse: Tensor,
    o_lr: Tensor,
    use_kernel: bool = True,
) -> ConsumerGrads:
    """Gradients of the correction ``O_lr ΔB`` of the consumer rows, from the output gradient ``grad``.

    With ``u = dO ΔBᵀ`` and ``c = rowsum(u ∘ O_lr)`` per row (r-wide), ``dS = P ∘ (u V_lrᵀ - c)`` gives ``dq``,
    ``dk`` and ``dV_lr = Pᵀ u``; ``ΔB`` gets ``O_lrᵀ dO``.

    Args:
        grad: ``(B, H_q, T, D)`` gradient of the output (any strides).
        q, k, v_lr, delta_b, rows: as in :func:`consumer_lr_forward`.
        lse: ``(N, H_q)`` and ``o_lr`` ``(N, H_q, r)`` from :func:`consumer_lr_forward`.
        use_kernel: use the Triton kernels where they run.
    """
    b, h_q, t, d = q.shape
    h_kv, rank = k.shape[1], v_lr.shape[-1]
    n = rows.n_rows
    sm_scale = d**-0.5
    if not (use_kernel and kernels_usable(q)):
        db_rows = delta_b[rows.row_seq]  # (N, H_kv, r, D)
        d_out = grad.transpose(1, 2)[rows.row_seq, rows.row_pos].to(delta_b.dtype).view(n, h_kv, -1, d)
        o_lr4 = o_lr.to(delta_b.dtype).view(n, h_kv, -1, rank)
        u = torch.einsum("nkgd,nkrd->nkgr", d_out, db_rows)
        c = (u * o_lr4).sum(-1)
        dq, dk, dv_lr = _torch_backward(q, k, v_lr, rows, lse, u.reshape(n, h_q, rank), c.reshape(n, h_q), sm_scale)
        x_rows = torch.einsum("nkgr,nkgd->nkrd", o_lr4, d_out)
        x = x_rows.new_zeros(b, h_kv, rank, d).index_add_(0, rows.row_seq, x_rows)
        return ConsumerGrads(dq.reshape(1, n * h_q, d), dk, dv_lr, x)
    dev = q.device
    r_pad = _r_pad(rank)
    blocks, bh, splits = _launch_shape(q, k, rows)
    flags = {"GROUP": h_q // h_kv, "HEAD_DIM": d, "R_PAD": r_pad, "BLOCK_M": _BLOCK_M}
    u = torch.empty(n, h_q, r_pad, device=dev, dtype=v_lr.dtype)  # the r-wide products run in V_lr's dtype
    c = torch.empty(n, h_q, device=dev, dtype=torch.float32)
    ws_x = torch.empty(bh, max(blocks, 1), r_pad, d, device=dev, dtype=torch.float32)
    if n:
        _consumer_prep_kernel[(blocks, bh)](
            grad, o_lr, delta_b, rows.start, rows.count, rows.cu, u, c, ws_x, *grad.stride(), *delta_b.stride(),
            h_kv, h_q, rank, blocks, **flags, num_warps=4, num_stages=1,
        )  # fmt: skip
    else:
        ws_x.zero_()
    x = ws_x.sum(1)[:, :rank].view(b, h_kv, rank, d)
    lse = lse.float().contiguous()
    dk = torch.empty(b, t, h_kv, d, device=dev, dtype=k.dtype)
    dlr = torch.empty(b, h_kv, t, r_pad, device=dev, dtype=torch.float32)
    common = (*q.stride(), *k.stride(), *v_lr.stride())
    _consumer_dk_kernel[(triton.cdiv(t, _BLOCK_N_DK), bh)](
        q, k, v_lr, rows.start, rows.count, rows.cu, lse, u, c, dk, dlr, *common,
        sm_scale * _LOG2E, sm_scale, h_kv, h_q, rank, t, **flags, BLOCK_N=_BLOCK_N_DK, num_warps=8, num_stages=2,
    )  # fmt: skip
    ws_dq = torch.empty(max(splits, 1), n * h_q, d, device=dev, dtype=torch.float32)
    if n:
        _consumer_dq_kernel[(blocks, bh, splits)](
            q, k, v_lr, rows.start, rows.count, rows.cu, lse, u, c, ws_dq, *common,
            sm_scale * _LOG2E, sm_scale, h_kv, h_q, rank, _SPLIT_LEN, n * h_q, **flags, BLOCK_N=_BLOCK_N,
            num_warps=4, num_stages=2,
        )  # fmt: skip
    return ConsumerGrads(ws_dq, dk, dlr[..., :rank].sum(1), x)


@on_tensor_device
def add_dq_rows(gq: Tensor, rows: ConsumerRows, dq_parts: Tensor, h_kv: int, use_kernel: bool = True) -> None:
    """``gq[b, :, pos] += Σ dq_parts`` for the packed rows, in place.

    Args:
        gq: ``(B, H_q, T, D)`` the queries' gradient (any strides).
        rows: the consumer rows.
        dq_parts: ``(S, N * H_q, D)`` from :func:`consumer_backward`.
        h_kv: KV heads.
    """
    n = rows.n_rows
    if not n:
        return
    b, h_q, _, d = gq.shape
    if use_kernel and kernels_usable(gq):
        grid = (triton.cdiv((h_q // h_kv) * rows.max_count, _BLOCK_M), b * h_kv)
        _add_dq_rows_kernel[grid](
            gq, dq_parts, rows.start, rows.count, rows.cu, *gq.stride(), h_kv, h_q, dq_parts.shape[0], n * h_q,
            GROUP=h_q // h_kv, HEAD_DIM=d, BLOCK_M=_BLOCK_M, num_warps=4, num_stages=1,
        )  # fmt: skip
        return
    dq = dq_parts.sum(0).view(n, h_q, d)
    gq.transpose(1, 2).index_put_((rows.row_seq, rows.row_pos), dq.to(gq.dtype), accumulate=True)
