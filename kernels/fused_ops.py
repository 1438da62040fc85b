"""Fused elementwise kernels of a decoder layer: RMSNorm (+ residual add), RoPE + cache store, SiLU·mul.

Why: a decode step of a small model, or of a large one at batch 1, is bound by kernel launches, not by
arithmetic or bytes: transformers' RMSNorm is six kernels, RoPE on q and k ten, and the cache stores three more.
Each function here is one launch that computes what the PyTorch expression next to it computes, with the same
intermediate roundings where the expression rounds (so outputs match the PyTorch path to the last bit in most
elements and to one unit in the last place otherwise):

- :func:`rms_norm`: ``w * (h.float() * rsqrt(mean(h.float()²) + eps)).to(dtype)``, optionally with
  ``h = x + residual`` computed first and returned (transformers' ``LlamaRMSNorm``);
- :func:`rope_store`: ``q·cos + rotate_half(q)·sin`` for the queries, the same for the keys, and the keys, values
  and low-rank values written into static cache pools at each token's slot and position;
- :func:`silu_mul`: ``silu(gate) * up``.

Limits: CUDA tensors in fp16/bf16 (anything else takes the PyTorch expression); last dims contiguous.
Tested GPUs: NVIDIA H200 (Triton 3.6, PyTorch 2.11). Without CUDA the Triton kernels run only under
``TRITON_INTERPRET=1`` (CPU tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device
from kernels.pdl import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_DTYPES = (torch.float16, torch.bfloat16)


def kernels_usable(t: Tensor) -> bool:
    """True where the Triton kernels run for ``t`` (CUDA fp16/bf16, or the interpreter on CPU)."""
    if triton is None or t.dtype not in _DTYPES:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- torch references ----------------------------------------------------------------------------------------------
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(norm(h), h)`` with ``h = x (+ residual)``, transformers' LlamaRMSNorm."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(h.dtype), h


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of ``x`` ``(N, H, D)`` with ``cos``/``sin`` ``(N, D)``."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def silu_mul_reference(gate: Tensor, up: Tensor) -> Tensor:
    return torch.nn.functional.silu(gate) * up


# ---- kernels ---------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        X, RES, W, OUT, H_OUT, n_cols, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One row per program: h = x (+ res); out = w * (h * rsqrt(mean(h^2) + eps)).to(dtype)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        if PDL:  # kernels/pdl.py: the previous kernel's results are visible past the wait; the next may launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(X + row * n_cols + cols, mask=ok, other=0.0)
        if HAS_RES:
            x = (x + tl.load(RES + row * n_cols + cols, mask=ok, other=0.0)).to(X.dtype.element_ty)
            tl.store(H_OUT + row * n_cols + cols, x, mask=ok)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * (1.0 / tl.sqrt(var + eps))).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=ok, other=0.0)
        tl.store(OUT + row * n_cols + cols, (w * normed).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_half(x1, x2, c1, c2, s1, s2):
        """(x1, x2) -> (x1·c1 - x2·s1, x2·c2 + x1·s2) with each product rounded to x's dtype, as torch does."""
        dt = x1.dtype
        o1 = ((x1 * c1).to(dt) + (-x2 * s1).to(dt)).to(dt)
        o2 = ((x2 * c2).to(dt) + (x1 * s2).to(dt)).to(dt)
        return o1, o2

    @triton.jit
    def _rope_store_kernel(
        Q, K, V, VLR, COS, SIN, QOUT, KP, VP, LRP, KV_SLOT, LR_SLOT, POS, QLR, QB, ROLE,
        stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_lrn,
        stride_kps, stride_kph, stride_kpl, stride_vps, stride_vph, stride_vpl, stride_lrs, stride_lrl,
        stride_qlrn, stride_qbr, stride_qbo, n_q_heads, n_kv_heads, rank, q_rank, q_scaling,
        HALF: tl.constexpr, HAS_LR: tl.constexpr, R_PAD: tl.constexpr, HAS_QLORA: tl.constexpr,
        QR_PAD: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (N tokens, Hq + Hkv): program (n, h) ropes query head h (after adding its LoRA term
        ``s · lr_q · B_roleᵀ`` with ``HAS_QLORA``, rounded to q's dtype first, as a GEMM's epilogue rounds), or ropes
        and stores key head h - Hq and stores its value head (and, for the first key head, the low-rank values)."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        if PDL:  # kernels/pdl.py: the previous kernel's results are visible past the wait; the next may launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        c1 = tl.load(COS + n * 2 * HALF + d)
        c2 = tl.load(COS + n * 2 * HALF + HALF + d)
        s1 = tl.load(SIN + n * 2 * HALF + d)
        s2 = tl.load(SIN + n * 2 * HALF + HALF + d)
        if h < n_q_heads:
            base = Q + n * stride_qn + h * stride_qh
            x1 = tl.load(base + d)
            x2 = tl.load(base + HALF + d)
            if HAS_QLORA:
                role = tl.load(ROLE + n).to(tl.int64)
                rr = tl.arange(0, QR_PAD)
                rm = rr < q_rank
                lq = tl.load(QLR + n * stride_qlrn + rr, mask=rm, other=0.0).to(tl.float32)
                bp = QB + role * stride_qbr + (h * 2 * HALF + d)[:, None] * stride_qbo + rr[None, :]
                b1 = tl.load(bp, mask=rm[None, :], other=0.0).to(tl.float32)
                b2 = tl.load(bp + HALF * stride_qbo, mask=rm[None, :], other=0.0).to(tl.float32)
                x1 = (x1.to(tl.float32) + q_scaling * tl.sum(b1 * lq[None, :], axis=1)).to(x1.dtype)
                x2 = (x2.to(tl.float32) + q_scaling * tl.sum(b2 * lq[None, :], axis=1)).to(x2.dtype)
            o1, o2 = _rope_half(x1, x2, c1, c2, s1, s2)
            out = QOUT + (n * n_q_heads + h) * 2 * HALF
            tl.store(out + d, o1)
            tl.store(out + HALF + d, o2)
        else:
            g = h - n_q_heads
            slot = tl.load(KV_SLOT + n).to(tl.int64)
            pos = tl.load(POS + n).to(tl.int64)
            kb = K + n * stride_kn + g * stride_kh
            o1, o2 = _rope_half(tl.load(kb + d), tl.load(kb + HALF + d), c1, c2, s1, s2)
            kdst = KP + slot * stride_kps + g * stride_kph + pos * stride_kpl
            tl.store(kdst + d, o1)
            tl.store(kdst + HALF + d, o2)
            vb = V + n * stride_vn + g * stride_vh
            vdst = VP + slot * stride_vps + g * stride_vph + pos * stride_vpl
            tl.store(vdst + d, tl.load(vb + d))
            tl.store(vdst + HALF + d, tl.load(vb + HALF + d))
            if HAS_LR:
                if g == 0:
                    lslot = tl.load(LR_SLOT + n).to(tl.int64)
                    r = tl.arange(0, R_PAD)
                    lr = tl.load(VLR + n * stride_lrn + r, mask=r < rank, other=0.0)
                    tl.store(LRP + lslot * stride_lrs + pos * stride_lrl + r, lr, mask=r < rank)

    @triton.jit
    def _silu_mul_kernel(G, U, OUT, n_cols, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Grid (rows, column blocks): out[row] = silu(g[row]) * u[row], rows of g and u strided."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        if PDL:  # kernels/pdl.py: the previous kernel's results are visible past the wait; the next may launch
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0)
        u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(OUT + row * n_cols + cols, (act * u).to(g.dtype), mask=ok)


# ---- public functions ------------------------------------------------------------------------------------------------
@on_tensor_device
def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """RMSNorm of ``x (+ residual)`` over the last dim; returns ``(normed, h)`` where ``h = x (+ residual)``.

    Args:
        x: ``(..., hidden)``.
        weight: ``(hidden,)``.
        eps: variance epsilon.
        residual: ``(..., hidden)`` added to ``x`` first, or ``None``.
    """
    if not kernels_usable(x) or x.shape[-1] > 65536:
        return rms_norm_reference(x, weight, eps, residual)
    xc = x.contiguous()
    n_cols = xc.shape[-1]
    rows = xc.numel() // n_cols
    out = torch.empty_like(xc)
    h_out = torch.empty_like(xc) if residual is not None else xc
    res = residual.contiguous() if residual is not None else xc
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(rows,)](
        xc, res, weight, out, h_out, n_cols, float(eps), HAS_RES=residual is not None, BLOCK=block,
        num_warps=4 if block <= 2048 else 8, **pdl_launch(xc),
    )  # fmt: skip
    return out, h_out


@on_tensor_device
def rope_store(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    v_lr: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    lr_pool: Tensor | None,
    kv_slot: Tensor,
    lr_slot: Tensor | None,
    pos: Tensor,
    q_lora: tuple[Tensor, Tensor, float, Tensor] | None = None,
) -> Tensor:
    """RoPE on queries and keys, and keys/values/low-rank values written into static pools, in one launch.

    Args:
        q: ``(N, H_q, D)`` queries of N tokens.
        k: ``(N, H_kv, D)`` keys (before RoPE).
        v: ``(N, H_kv, D)`` values (or V_base).
        v_lr: ``(N, r)`` low-rank values, or ``None``.
        cos: ``(N, D)`` and ``sin`` ``(N, D)`` of each token's position.
        k_pool: ``(S, H_kv, C, D)`` key pool; ``v_pool`` the same shape.
        lr_pool: ``(S_lr, C, r)`` low-rank pool or ``None``.
        kv_slot: ``(N,)`` slot of each token; ``lr_slot`` ``(N,)`` its low-rank slot.
        pos: ``(N,)`` position of each token.
        q_lora: the queries' LoRA term, added before RoPE (q_proj's B applied here instead of by a GEMM of its own):
            ``(lr, b, s, role)`` with ``lr`` ``(N, r_q)`` each token's X·A (last dim contiguous), ``b``
            ``(n_roles, H_q·D, r_q)`` every role's B (contiguous), ``s`` the scaling and ``role`` ``(N,)`` each
            token's role. ``q + s · lr · B_roleᵀ`` is computed in float32 and rounded to q's dtype, as the
            multiply-add it replaces rounds.

    Returns:
        ``(N, H_q, D)`` rotated queries (contiguous).
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    usable = kernels_usable(q) and d % 2 == 0 and (d & (d - 1)) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
    if q_lora is not None:
        q_lr, q_b, q_s, q_role = q_lora
        usable = usable and q_lr.stride(-1) == 1 and q_b.is_contiguous() and q_b.dtype == q.dtype
    if not usable or v.stride(-1) != 1 or (v_lr is not None and v_lr.stride(-1) != 1):
        if q_lora is not None:
            term = torch.einsum("nr,nor->no", q_lr.float(), q_b[q_role].float()).view(n, hq, d)
            q = (q.float() + q_s * term).to(q.dtype)
        k_rot = rope_reference(k, cos, sin)
        k_pool[kv_slot, :, pos] = k_rot
        v_pool[kv_slot, :, pos] = v
        if v_lr is not None:
            lr_pool[lr_slot, pos] = v_lr
        return rope_reference(q, cos, sin)
    cos_c, sin_c = cos.to(q.dtype).contiguous(), sin.to(q.dtype).contiguous()
    q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    has_lr = v_lr is not None
    lr_arg = v_lr if has_lr else q
    lrp = lr_pool if has_lr else k_pool
    rank = v_lr.shape[-1] if has_lr else 1
    lr_strides = (lrp.stride(0), lrp.stride(1)) if has_lr else (0, 0)
    has_ql = q_lora is not None
    if has_ql:
        ql_args, q_rank = (q_lr, q_b, q_role), q_lr.shape[-1]
        ql_strides, q_s = (q_lr.stride(0), q_b.stride(0), q_b.stride(1)), float(q_s)
    else:
        ql_args, q_rank, ql_strides, q_s = (q, q, pos), 1, (0, 0, 0), 0.0
    _rope_store_kernel[(n, hq + hkv)](
        q, k, v, lr_arg, cos_c, sin_c, q_out, k_pool, v_pool, lrp, kv_slot, lr_slot if has_lr else kv_slot, pos,
        *ql_args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        lr_arg.stride(0) if has_lr else 0,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        *lr_strides, *ql_strides, hq, hkv, rank, q_rank, q_s,
        HALF=d // 2, HAS_LR=has_lr, R_PAD=max(2, triton.next_power_of_2(rank)), HAS_QLORA=has_ql,
        QR_PAD=max(2, triton.next_power_of_2(q_rank)), num_warps=1, **pdl_launch(q),
    )  # fmt: skip
    return q_out


@on_tensor_device
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` elementwise (same shapes; rows may be strided views, e.g. halves of a fused GEMM)."""
    if not kernels_usable(gate) or gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return silu_mul_reference(gate, up)
    n_cols = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n_cols), up.reshape(-1, n_cols)  # views for the (B, T, I) slices a GEMM gives
    if g2.data_ptr() != gate.data_ptr() or u2.data_ptr() != up.data_ptr():
        g2, u2 = gate.contiguous().view(-1, n_cols), up.contiguous().view(-1, n_cols)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n_cols, block))](
        g2,
        u2,
        out,
        n_cols,
        g2.stride(0),
        u2.stride(0),
        BLOCK=block,
        num_warps=4,
        **pdl_launch(g2),
    )
    return out
