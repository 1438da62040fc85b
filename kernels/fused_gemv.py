"""RMSNorm or SiLU·mul fused into the matrix-vector product that reads its output (decode at a few rows).

Why: at batch 1 a decode step of an 8B model is a chain of GEMVs with small elementwise kernels between them. On an H100
(``results/engine_h100/decode_profile_2026-11-27``) the two RMSNorms and the SiLU·mul of each layer take 2 + 2 + 1.5 µs,
and each is a graph node whose gap to the next adds about 1 µs: 0.26 ms of a 6.86 ms step, against the 0.8 ms a batch-1
step had to lose to reach its target. Computing the norm (or the activation) inside the GEMV that consumes it removes
the kernel, its output's round trip through memory and its node. Whether a Triton GEMV keeps cuBLAS's bandwidth is what
``python -m eval_suite.bench.fused_gemv`` measures: on an H100, 1.01-1.06x the unfused pair at one row (the 8B batch-1
step 5% faster), and slower than unfused at 4 to 32 rows even through one tensor-core dot per tile, so the decoder takes
them at the rows ``LRAGENT_FUSED_GEMV`` names (default 1: batch-1 decode; kernels/NOTES.md).

What each computes, with the intermediate roundings of the unfused kernels (:mod:`kernels.fused_ops`), so the GEMV's
input is bit for bit what the unfused path feeds cuBLAS; only the GEMV's summation order differs:

- :func:`rms_norm_linear`: ``h = x (+ residual)``; ``y = (w_norm * (h * rsqrt(mean(h²) + eps))) @ Wᵀ`` and ``h``;
- :func:`silu_mul_linear`: ``y = (silu(gate) * up) @ Wᵀ``, optionally ``+ residual`` before the one rounding (as
  ``addmm`` does for the decoder's down projection).

Each program computes ``BLOCK_N`` outputs of every input row (at most :data:`MAX_ROWS` rows: decode, not prefill),
streaming its ``BLOCK_N × K`` slice of ``W`` once for all rows, with fp32 accumulation. The norm's statistic is
recomputed by every program from the input row (K elements, from L2), which costs far less than a launch.

Limits: CUDA fp16/bf16 (or ``TRITON_INTERPRET=1`` on the CPU); ``W`` row-major ``(N, K)``; anything else, and more
than :data:`MAX_ROWS` rows, takes the unfused path.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device
from kernels.flash_lora_attention import _num_sms
from kernels.fused_ops import kernels_usable, rms_norm, silu_mul
from kernels.pdl import pdl_launch
from kernels.split_workspace import split_workspace

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_ROWS = 32
"""Input rows a fused call takes (a decode step at small batch: one or two tensor-core row blocks); more go through the
unfused kernels and cuBLAS."""

ROWS_ENV = "LRAGENT_FUSED_GEMV"
"""The decoder's switch: the most rows of a decode step whose norms and SiLU·mul run inside the GEMVs (0: off)."""


DEFAULT_ROWS = 1
"""Without ``LRAGENT_FUSED_GEMV``: batch-1 steps fuse. On an H100 (8B shapes, results/engine_h100/decode_2026-11-27b)
that took the batch-1 step from 6.77 to 6.42 ms; several rows through the tensor-core dot were slower than the unfused
kernels at every size timed (4, 16, 32 rows: 0.18-0.89x; the 8B batch-32 step 9.7 -> 20.4 ms), so wider steps fuse
only where a user asks (``LRAGENT_FUSED_GEMV=N``)."""


def fused_gemv_rows(value: str | None = None) -> int:
    """The rows up to which decode views fuse (``LRAGENT_FUSED_GEMV``, or ``value``): 0 (off) to :data:`MAX_ROWS`;
    unset or empty: :data:`DEFAULT_ROWS`.

    Raises:
        ValueError: anything but an integer in 0..MAX_ROWS, named with what is allowed.
    """
    import os

    raw = (os.environ.get(ROWS_ENV, "") if value is None else value).strip() or str(DEFAULT_ROWS)
    if not raw.isdigit() or int(raw) > MAX_ROWS:
        raise ValueError(f"{ROWS_ENV}={raw!r}: allowed 0 (off) to {MAX_ROWS}, the most rows of a fused decode step")
    return int(raw)


@dataclass(frozen=True)
class GemvConfig:
    """A launch of the fused GEMVs: outputs and inputs per block step, warps, software-pipeline stages."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    deferred: int = 0
    """1: a one-row call keeps a (block_n, block_k) fp32 accumulator and sums it over K once, after the loop, instead
    of reducing every tile across threads (the shuffles then leave the loop; 32 more registers a thread at 16 × 512
    over 8 warps). On an H100 the fastest one-row launch of each 8B GEMV has it (``DEFAULT_CONFIG``,
    ``NORM_CONFIG``)."""
    split_k: int = 1
    """Programs along K for each block of outputs (grid dim 1): each sums its share of the K blocks into an fp32
    partial, and the last of them to finish adds the partials in split order and stores the outputs
    (:mod:`kernels.split_workspace`; one launch). For GEMVs with few output blocks (N = 4096 at 64 outputs a program
    is 64 programs on 132 SMs) and several rows; not yet timed on a GPU."""


DEFAULT_CONFIG = GemvConfig(deferred=1)
"""The SiLU·mul and plain GEMVs' launch: on an H100 at one row the fastest of nine for the 8B down projection (43.6 µs
against 45.5 for the unfused pair and 43.7 for cuBLAS alone) and the o projection (13.8 µs against cuBLAS's 16.1;
``results/engine_h100/decode_2026-11-27b/fused_gemv.md``, each weight read from DRAM)."""

NORM_CONFIG = GemvConfig(block_n=16, block_k=512, num_warps=8, deferred=1)
"""The RMSNorm GEMVs' launch: on an H100 at one row the fastest of nine for both 8B norm GEMVs (q/k/v with the A rows
21.2 µs, where the unfused pair took 23.2; gate/up 80.6 against 88.2, at the 81.6 µs floor of the measured copy
bandwidth): eight warps share the per-program norm statistic over twice the outputs."""

ROWS_CONFIG = GemvConfig(block_n=64, block_k=256, num_warps=8)
"""The launch of a call with several rows. Every program reads all its rows' inputs from L2 (the norm GEMV twice:
statistic, then product), so those reads grow with rows × programs: at 32 rows the 8B gate/up GEMV with 16 outputs per
program would read 917 MB from L2 for its 235 MB weight, with 64 outputs 229 MB. Timed on an H100 it was not the best
of nine at 4-32 rows (the best had 32 or 128 outputs per program, by GEMV), and no launch beat the unfused kernels
there (the module doc)."""


@dataclass(frozen=True)
class DeviceLaunches:
    """One GPU model's one-row launches, measured on it where the H100's (:data:`NORM_CONFIG`,
    :data:`DEFAULT_CONFIG`) were not the fastest."""

    norm_wide: GemvConfig
    """A norm GEMV of at least :data:`WIDE_PROGRAMS_PER_SM` programs an SM under :data:`NORM_CONFIG` (the 8B
    gate/up: 1,792 programs on 132 SMs)."""
    wide_unfused: bool
    """Whether the decoder leaves such a wide norm GEMV unfused on this GPU (the RMSNorm kernel, then cuBLAS), where
    that was faster than the fused launch: :func:`wide_norm_fused`, ``LRAGENT_GEMV_WIDE``."""
    norm: GemvConfig
    """The other norm GEMVs (the 8B q/k/v: 385 programs, under half a wave)."""
    plain: GemvConfig
    """The plain and SiLU·mul GEMVs (o, down)."""


WIDE_PROGRAMS_PER_SM = 8
"""Where a norm GEMV counts as wide (:attr:`DeviceLaunches.norm_wide`). With many programs an SM, smaller tiles at
four warps keep more of them resident; with few, each program must keep more bytes in flight (wide K blocks, eight
warps): on an H200 the gate/up launch below is 6% faster than :data:`NORM_CONFIG` and the q/k/v one 23% slower."""

DEVICE_LAUNCHES: dict[str, DeviceLaunches] = {
    "H200": DeviceLaunches(
        norm_wide=GemvConfig(block_n=16, block_k=256, num_warps=4, deferred=1),
        wide_unfused=True,
        norm=NORM_CONFIG,
        plain=GemvConfig(block_n=4, block_k=512, num_warps=4, deferred=1),
    ),
}
"""Measured one-row launches by GPU model (a whole word of the CUDA device's name), each the fastest found in two
sweeps (24 and 22 launches) of ``python -m eval_suite.bench.fused_gemv --rows [1]`` at the 8B shapes, weights read from
DRAM
(``results/engine_h200/gemv_launches_2026-11-29``): on an H200 gate/up 57.96 µs against 61.70 for
:data:`NORM_CONFIG` (cuBLAS 56.13, unfused 58.05), down 31.56 against 32.14, o 10.03 against 10.05; q/k/v keeps
:data:`NORM_CONFIG` (15.81, the fastest). A GPU not named here takes the H100's launches. ``LRAGENT_GEMV_TABLE=0``
ignores the table (to time the two side by side).

The H200's gate/up is left to the RMSNorm kernel and cuBLAS (``wide_unfused``): its fused launch's speed moved from
card to card where cuBLAS's did not (2026-11-29, ``results/engine_h200/readme_2026-11-29``): on one card 63.82 µs
against 56.93 for the unfused pair (cuBLAS 55.59), and on another the 8B batch-1 step was 0.05-0.13 ms faster with it
unfused in all 8 paired turns of two runs (``bench decode --plans '["", "gemv_wide=0"]'``); on the card of the sweeps
above the two were level (57.96 against 58.05). ``LRAGENT_GEMV_WIDE=1`` takes the fused launch ``norm_wide``."""

TABLE_ENV = "LRAGENT_GEMV_TABLE"


def gemv_table_setting(value: str | None = None) -> bool:
    """``LRAGENT_GEMV_TABLE`` (or ``value``): unset, empty or ``1``: the measured launches of
    :data:`DEVICE_LAUNCHES` where the GPU is named there; ``0``: the H100's everywhere.

    Raises:
        ValueError: any other value, named with what is allowed.
    """
    import os

    raw = (os.environ.get(TABLE_ENV, "") if value is None else value).strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{TABLE_ENV}={raw!r}: expected 1 (the GPU's measured GEMV launches, the default) or 0")
    return raw != "0"


def gemv_table_switch(value: str | None = None) -> int:
    """:func:`gemv_table_setting` as ``bench decode --plans`` records it: 1 on, 0 off."""
    return int(gemv_table_setting(value))


@functools.cache
def device_launches(device_name: str) -> DeviceLaunches | None:
    """The measured launches of the GPU model ``device_name`` names (``"NVIDIA H200"``, ``"NVIDIA H200 NVL"``), or
    None. The key must be a whole word of the name: a GH200 (another memory system) is not an H200. Cached per name:
    every one-row GEMV call without a config asks."""
    words = set(re.split(r"[\s_-]+", device_name))
    return next((launches for key, launches in DEVICE_LAUNCHES.items() if key in words), None)


WIDE_ENV = "LRAGENT_GEMV_WIDE"


def gemv_wide_setting(value: str | None = None) -> int:
    """``LRAGENT_GEMV_WIDE`` (or ``value``): unset or empty, -1 (a wide one-row norm GEMV fused or not as the GPU's
    :data:`DEVICE_LAUNCHES` entry says: :attr:`DeviceLaunches.wide_unfused`); ``1`` fused; ``0`` unfused (the RMSNorm
    kernel, then cuBLAS). For ``bench decode --plans`` (``gemv_wide=0|1``) to time them side by side.

    Raises:
        ValueError: any other value, named with what is allowed.
    """
    import os

    raw = (os.environ.get(WIDE_ENV, "") if value is None else value).strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{WIDE_ENV}={raw!r}: expected 1 (fused), 0 (the norm kernel, then cuBLAS) or unset (table)")
    return int(raw) if raw else -1


def wide_norm_fused(rows: int, n_out: int, device_name: str = "", sms: int = 0) -> bool:
    """Whether a norm GEMV of ``rows`` input rows into ``n_out`` outputs on the GPU model ``device_name`` (of ``sms``
    SMs) runs fused (:func:`rms_norm_linear`) rather than as the RMSNorm kernel and cuBLAS. Only a wide one-row GEMV
    (:attr:`DeviceLaunches.norm_wide`'s rule) on a GPU whose :data:`DEVICE_LAUNCHES` entry says
    :attr:`~DeviceLaunches.wide_unfused` (the table on) is left unfused; ``LRAGENT_GEMV_WIDE`` overrides the entry."""
    forced = gemv_wide_setting()  # a bad value is named wherever the call comes from
    if rows > 1 or not device_name or not _wide(n_out, sms):
        return True
    if forced >= 0:
        return bool(forced)
    launches = _table_entry(device_name)
    return launches is None or not launches.wide_unfused


def fuses_norm_gemv(x: Tensor, n_out: int) -> bool:
    """:func:`wide_norm_fused` for the rows of ``x`` (..., K) on its device: the decoder's question before a norm
    GEMV."""
    return wide_norm_fused(x.numel() // x.shape[-1], n_out, *_device_facts(x))


def default_config(rows: int, norm: bool, n_out: int = 0, device_name: str = "", sms: int = 0) -> GemvConfig:
    """The launch a call takes without one: several rows, :data:`ROWS_CONFIG`; one row, the launch measured on
    the GPU model ``device_name`` (:data:`DEVICE_LAUNCHES`; a norm GEMV of ``n_out`` outputs is wide when
    :data:`NORM_CONFIG` would give it at least :data:`WIDE_PROGRAMS_PER_SM` programs on each of ``sms`` SMs), or else
    :data:`NORM_CONFIG` (a norm GEMV) or :data:`DEFAULT_CONFIG`."""
    if rows > 1:
        return ROWS_CONFIG
    launches = _table_entry(device_name)
    if launches is None:
        return NORM_CONFIG if norm else DEFAULT_CONFIG
    if not norm:
        return launches.plain
    return launches.norm_wide if _wide(n_out, sms) else launches.norm


def _table_entry(device_name: str) -> DeviceLaunches | None:
    """The :data:`DEVICE_LAUNCHES` entry of ``device_name`` with the table on (``LRAGENT_GEMV_TABLE``), else None
    (no device: the interpreter)."""
    return device_launches(device_name) if device_name and gemv_table_setting() else None


def _wide(n_out: int, sms: int) -> bool:
    """A norm GEMV of ``n_out`` outputs is wide when :data:`NORM_CONFIG` gives it at least
    :data:`WIDE_PROGRAMS_PER_SM` programs on each of ``sms`` SMs."""
    return sms > 0 and -(-n_out // NORM_CONFIG.block_n) >= WIDE_PROGRAMS_PER_SM * sms


def _device_facts(t: Tensor) -> tuple[str, int]:
    """``(name, SM count)`` of ``t``'s CUDA device (``("", 0)`` off CUDA: the interpreter, which no table names)."""
    if not t.is_cuda:
        return "", 0
    return torch.cuda.get_device_name(t.device), _num_sms(t.device)


if triton is not None:

    @triton.jit
    def _rows_times_w(W, offs_n, n_ok, cols, k_ok, n_in, xin, acc, ROWS: tl.constexpr):
        """``acc[r] += Σ_k W[n, k]·xin[r, k]`` over one (BLOCK_N, BLOCK_K) tile of W, loaded once for all ``ROWS``
        rows, with fp32 accumulation (the GEMVs' inner step). One row: a broadcast product summed over K on the CUDA
        cores. More (a 16- or 32-row block, the idle rows zero): one tensor-core ``tl.dot``, where taking the rows one
        by one made four rows 3.6-4.3x slower than unfused on an H100. ``xin`` holds values already rounded to W's
        dtype, so casting it back is exact."""
        w = tl.load(W + offs_n[:, None] * n_in + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if ROWS == 1:
            acc += tl.sum(w.to(tl.float32) * xin, axis=1)[None, :]
        else:
            acc += tl.dot(xin.to(w.dtype), tl.trans(w))
        return acc

    @triton.jit
    def _row_times_w_deferred(W, offs_n, n_ok, cols, k_ok, n_in, xin, acc2):
        """One row, the reduction deferred: ``acc2[n, k] += W[n, k]·xin[0, k]`` over one (BLOCK_N, BLOCK_K) tile, in
        fp32; the caller sums ``acc2`` over K once after its loop."""
        w = tl.load(W + offs_n[:, None] * n_in + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return acc2 + w.to(tl.float32) * xin

    @triton.jit
    def _tile_step(W, offs_n, n_ok, cols, k_ok, n_in, xin, acc, acc2, ROWS: tl.constexpr, DEFERRED: tl.constexpr):
        """The GEMVs' inner step over one W tile: into ``acc2`` (the deferred sum) or ``acc``; both returned."""
        if DEFERRED:
            acc2 = _row_times_w_deferred(W, offs_n, n_ok, cols, k_ok, n_in, xin, acc2)
        else:
            acc = _rows_times_w(W, offs_n, n_ok, cols, k_ok, n_in, xin, acc, ROWS)
        return acc, acc2

    @triton.jit
    def _summed(acc, acc2, DEFERRED: tl.constexpr):
        """The ``(ROWS, BLOCK_N)`` products after the loop: the deferred sum taken over K now, or ``acc`` itself."""
        if DEFERRED:
            acc = tl.sum(acc2, axis=1)[None, :]
        return acc

    @triton.jit
    def _k_range(n_in, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """This program's inputs ``[lo, hi)``: the K blocks shared as evenly as whole blocks allow among the
        ``SPLIT_K`` programs of grid dim 1 (one program: all of K)."""
        per = tl.cdiv(tl.cdiv(n_in, BLOCK_K), SPLIT_K) * BLOCK_K
        lo = tl.program_id(1) * per
        return lo, tl.minimum(n_in, lo + per)

    @triton.jit
    def _store_rounded(total, Y, RES, out, m2, HAS_RES: tl.constexpr):
        """``total`` (fp32, + the residual at ``out`` with ``HAS_RES``) rounded once into ``Y``."""
        if HAS_RES:
            total += tl.load(RES + out, mask=m2, other=0.0).to(tl.float32)
        tl.store(Y + out, total.to(Y.dtype.element_ty), mask=m2)

    @triton.jit
    def _finish(acc, Y, RES, WS, CNT, out, m2, n_out, HAS_RES: tl.constexpr, ROWS: tl.constexpr,
                SPLIT_K: tl.constexpr):  # fmt: skip
        """Stores a program's ``(ROWS, BLOCK_N)`` fp32 products. Split along K: its partial goes to the workspace
        and the last program of the output block (a ticket on its counter) adds every partial in split order (the
        same bits whichever finishes last), stores, and zeroes the counter for the next launch or graph replay."""
        if SPLIT_K == 1:
            _store_rounded(acc, Y, RES, out, m2, HAS_RES)
        else:
            tl.store(WS + tl.program_id(1) * ROWS * n_out + out, acc, mask=m2)
            tl.debug_barrier()  # every thread's partial stores precede the release below
            done = tl.atomic_add(CNT + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                tl.store(CNT + tl.program_id(0), 0)
                total = tl.load(WS + out, mask=m2, other=0.0)
                for s in tl.static_range(1, SPLIT_K):
                    total += tl.load(WS + s * ROWS * n_out + out, mask=m2, other=0.0)
                _store_rounded(total, Y, RES, out, m2, HAS_RES)

    @triton.jit
    def _rms_inverse(X, RES, H_OUT, rows, r_ok, n_in, eps, pid, HAS_RES: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
        """``1 / sqrt(mean(h²) + eps)`` of each of the ``ROWS`` rows ``h = X (+ RES)``, ``(ROWS,)``, as
        ``_rms_norm_kernel`` computes it (the sum of squares of h rounded to the input's dtype); program 0 writes the
        residual sum to ``H_OUT``."""
        ks = tl.arange(0, BLOCK_K)
        sq = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k_ok = k0 + ks < n_in
            at = rows[:, None] * n_in + (k0 + ks)[None, :]
            m2 = r_ok[:, None] & k_ok[None, :]
            h = tl.load(X + at, mask=m2, other=0.0)
            if HAS_RES:
                h = (h + tl.load(RES + at, mask=m2, other=0.0)).to(X.dtype.element_ty)
                if pid == 0:
                    tl.store(H_OUT + at, h, mask=m2)
            hf = h.to(tl.float32)
            sq += hf * hf
        return 1.0 / tl.sqrt(tl.sum(sq, axis=1) / n_in + eps)

    @triton.jit
    def _normed_input(X, RES, NW, rows, r_ok, n_in, inv, k0, ks, k_ok, HAS_RES: tl.constexpr):
        """The ``(ROWS, BLOCK_K)`` input tile at ``k0`` of the GEMV after the norm: ``w_norm * (h * inv)`` with the
        unfused norm's roundings, as float32 (exact: the values are already rounded to the input's dtype)."""
        at = rows[:, None] * n_in + (k0 + ks)[None, :]
        m2 = r_ok[:, None] & k_ok[None, :]
        h = tl.load(X + at, mask=m2, other=0.0)
        if HAS_RES:
            h = (h + tl.load(RES + at, mask=m2, other=0.0)).to(X.dtype.element_ty)
        normed = (h.to(tl.float32) * inv[:, None]).to(X.dtype.element_ty)
        nw = tl.load(NW + k0 + ks, mask=k_ok, other=0.0)
        return (nw[None, :] * normed).to(X.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _rms_norm_gemv_kernel(
        X, RES, NW, W, Y, H_OUT, WS, CNT, n_rows, n_out, n_in, eps,
        HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
        DEFERRED: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (ceil(N / BLOCK_N), SPLIT_K): outputs [pid·BLOCK_N, +BLOCK_N) of each of the ``n_rows`` (<= ROWS)
        rows, over the program's share of K (every program takes the norm's statistic over all of K)."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        ks = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, ROWS)
        r_ok = rows < n_rows
        if PDL:  # kernels/pdl.py: the previous kernel's output (x, the residual) is visible past this point
            tl.extra.cuda.gdc_wait()
        # the residual sum h is written once, by the first program of the first split
        inv = _rms_inverse(X, RES, H_OUT, rows, r_ok, n_in, eps, pid + tl.program_id(1), HAS_RES, ROWS, BLOCK_K)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K] if DEFERRED else [1, 1], dtype=tl.float32)
        lo, hi = _k_range(n_in, BLOCK_K, SPLIT_K)
        for k0 in range(lo, hi, BLOCK_K):
            k_ok = k0 + ks < hi
            xin = _normed_input(X, RES, NW, rows, r_ok, n_in, inv, k0, ks, k_ok, HAS_RES)
            acc, acc2 = _tile_step(W, offs_n, n_ok, k0 + ks, k_ok, n_in, xin, acc, acc2, ROWS, DEFERRED)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        acc = _summed(acc, acc2, DEFERRED)
        out = rows[:, None] * n_out + offs_n[None, :]
        _finish(acc, Y, Y, WS, CNT, out, r_ok[:, None] & n_ok[None, :], n_out, False, ROWS, SPLIT_K)

    @triton.jit
    def _gemv_kernel(
        G, U, W, RES, Y, WS, CNT, n_rows, n_out, n_in, stride_g, stride_u,
        SILU: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
        DEFERRED: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Grid (ceil(N / BLOCK_N), SPLIT_K): y = x @ Wᵀ (+ res, added before the one rounding, as addmm) for outputs
        [pid·BLOCK_N, +BLOCK_N) of each row, over the program's share of K, where x = silu(g) * u with ``SILU``,
        else g."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_out
        ks = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, ROWS)
        r_ok = rows < n_rows
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K] if DEFERRED else [1, 1], dtype=tl.float32)
        if PDL:  # kernels/pdl.py: the previous kernel's output (input rows, residual) is visible past this point
            tl.extra.cuda.gdc_wait()
        lo, hi = _k_range(n_in, BLOCK_K, SPLIT_K)
        for k0 in range(lo, hi, BLOCK_K):
            k_ok = k0 + ks < hi
            m2 = r_ok[:, None] & k_ok[None, :]
            g = tl.load(G + rows[:, None] * stride_g + (k0 + ks)[None, :], mask=m2, other=0.0)
            if SILU:
                u = tl.load(U + rows[:, None] * stride_u + (k0 + ks)[None, :], mask=m2, other=0.0)
                gf = g.to(tl.float32)
                act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # as _silu_mul_kernel rounds
                xin = (act * u).to(g.dtype).to(tl.float32)
            else:
                xin = g.to(tl.float32)
            acc, acc2 = _tile_step(W, offs_n, n_ok, k0 + ks, k_ok, n_in, xin, acc, acc2, ROWS, DEFERRED)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        acc = _summed(acc, acc2, DEFERRED)
        out = rows[:, None] * n_out + offs_n[None, :]
        _finish(acc, Y, RES, WS, CNT, out, r_ok[:, None] & n_ok[None, :], n_out, HAS_RES, ROWS, SPLIT_K)


DOT_ROWS = 16
"""The row block of a call with several rows: the smallest M of a tensor-core ``tl.dot`` (idle rows masked to zero)."""

TILE_ELEMENTS = DOT_ROWS * 512
"""The most input elements (row block × K block) a program holds at once: a 16-row block at the configs' K block of
512. A 32-row block halves its K block, so its registers per thread stay those of 16 rows (no spills)."""


def _row_block(rows: int) -> int:
    """The kernels' row block: 1 for one row (CUDA-core products), else the rows rounded up to a multiple of
    :data:`DOT_ROWS` (16 or 32: one tensor-core dot per W tile either way)."""
    return 1 if rows == 1 else -(-rows // DOT_ROWS) * DOT_ROWS


def _block_k(config: GemvConfig, rows: int) -> int:
    """Inputs per block step: the config's, halved as often as the row block needs to keep within
    :data:`TILE_ELEMENTS` (never below 16, a tensor-core dot's smallest K)."""
    block_k, row_block = config.block_k, _row_block(rows)
    while row_block * block_k > TILE_ELEMENTS and block_k > 16:
        block_k //= 2
    return block_k


def _block_n(config: GemvConfig, rows: int) -> int:
    """Outputs per program: the config's, at least 16 where a tensor-core dot takes the rows (its N must be)."""
    return config.block_n if rows == 1 else max(config.block_n, 16)


def _launch_args(config: GemvConfig, rows: int, pdl: dict[str, bool]) -> dict:
    """The launch arguments both GEMV kernels take for ``rows`` input rows under ``config``: outputs and inputs per
    block step, the row block, the deferred sum (one row only), warps, stages, and ``pdl``
    (:func:`kernels.pdl.pdl_launch`)."""
    return dict(
        BLOCK_N=_block_n(config, rows), BLOCK_K=_block_k(config, rows), ROWS=_row_block(rows),
        DEFERRED=bool(config.deferred) and rows == 1, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl,
    )  # fmt: skip


def _split_buffers(config: GemvConfig, launch: dict, n_in: int, n_out: int, y: Tensor) -> tuple[int, Tensor, Tensor]:
    """``(SPLIT_K, workspace, counters)`` of a launch: the config's split, at most one split per K block; above one,
    the cached fp32 partials ``(SPLIT_K, ROWS, N)`` and one counter per output block
    (:func:`kernels.split_workspace.split_workspace`), else ``y`` in their place (never read)."""
    split = max(1, min(config.split_k, triton.cdiv(n_in, launch["BLOCK_K"])))
    if split == 1:
        return 1, y, y
    rows, tiles = launch["ROWS"], triton.cdiv(n_out, launch["BLOCK_N"])
    ws, cnt = split_workspace(("fused_gemv", split, rows, n_out, launch["BLOCK_N"]), split * rows * n_out, tiles,
                              y.device)  # fmt: skip
    return split, ws, cnt


def _fusable(x: Tensor, weight: Tensor) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        kernels_usable(x)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] == x.shape[-1]
        and 1 <= rows <= MAX_ROWS
    )


@on_tensor_device
def rms_norm_linear(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    residual: Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """``linear(rms_norm(x (+ residual)), weight)`` in one launch at up to :data:`MAX_ROWS` rows.

    Args:
        x: ``(..., K)``.
        norm_weight: ``(K,)`` the RMSNorm's weight.
        eps: its variance epsilon.
        weight: ``(N, K)`` the linear layer's weight (no bias).
        residual: ``(..., K)`` added to ``x`` first, or None.
        config: the launch (``python -m eval_suite.bench.fused_gemv`` sweeps them); default :func:`default_config`.

    Returns:
        ``(y, h)``: ``y`` ``(..., N)`` and ``h = x (+ residual)`` ``(..., K)`` (``x`` itself without a residual).
    """
    if not _fusable(x, weight):
        normed, h = rms_norm(x, norm_weight, eps, residual)
        return torch.nn.functional.linear(normed, weight), h
    xc = x.contiguous()
    n_in, n_out = xc.shape[-1], weight.shape[0]
    rows = xc.numel() // n_in
    config = config or default_config(rows, True, n_out, *_device_facts(xc))
    y = torch.empty(*xc.shape[:-1], n_out, dtype=xc.dtype, device=xc.device)
    h_out = torch.empty_like(xc) if residual is not None else xc
    res = residual.contiguous() if residual is not None else xc
    launch = _launch_args(config, rows, pdl_launch(xc))
    split, ws, cnt = _split_buffers(config, launch, n_in, n_out, y)
    _rms_norm_gemv_kernel[(triton.cdiv(n_out, launch["BLOCK_N"]), split)](
        xc, res, norm_weight, weight, y, h_out, ws, cnt, rows, n_out, n_in, float(eps), HAS_RES=residual is not None,
        SPLIT_K=split, **launch,
    )  # fmt: skip
    return y, h_out


@on_tensor_device
def silu_mul_linear(
    gate: Tensor, up: Tensor, weight: Tensor, residual: Tensor | None = None, config: GemvConfig | None = None
) -> Tensor:
    """``linear(silu(gate) * up, weight)`` (``+ residual``, rounded once as ``addmm``) in one launch at up to
    :data:`MAX_ROWS` rows.

    Args:
        gate: ``(..., K)`` (rows may be strided: a slice of the fused gate/up output).
        up: ``(..., K)``, as ``gate``.
        weight: ``(N, K)`` the down projection's weight (no bias).
        residual: ``(..., N)`` added to the product before its rounding (the decoder's residual stream), or None.
        config: the launch; default :func:`default_config`.

    Returns:
        ``(..., N)``.
    """
    if not _fusable(gate, weight) or gate.shape != up.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        act = silu_mul(gate, up)
        if residual is None:
            return torch.nn.functional.linear(act, weight)
        flat = torch.addmm(residual.reshape(-1, weight.shape[0]), act.reshape(-1, act.shape[-1]), weight.t())
        return flat.view(*act.shape[:-1], weight.shape[0])
    return _launch_gemv(gate, up, weight, residual, config)


@on_tensor_device
def gemv(x: Tensor, weight: Tensor, config: GemvConfig | None = None) -> Tensor:
    """``linear(x, weight)`` by the same Triton GEMV at up to :data:`MAX_ROWS` rows (cuBLAS otherwise): the plain
    kernel the fused ones are built on, timed against cuBLAS where no norm precedes (the o projection).

    Args:
        x: ``(..., K)``.
        weight: ``(N, K)``.
        config: the launch; default :func:`default_config`.

    Returns:
        ``(..., N)``.
    """
    if not _fusable(x, weight):
        return torch.nn.functional.linear(x, weight)
    return _launch_gemv(x.contiguous(), None, weight, None, config)


def _launch_gemv(
    g: Tensor, up: Tensor | None, weight: Tensor, residual: Tensor | None, config: GemvConfig | None
) -> Tensor:
    """``_gemv_kernel`` over the rows of ``g`` (last dim contiguous, rows may be strided): the input is
    ``silu(g) * up``, or ``g`` itself without ``up``; ``residual`` added before the rounding."""
    n_in, n_out = g.shape[-1], weight.shape[0]
    g2 = g.reshape(-1, n_in)
    u2 = g2 if up is None else up.reshape(-1, n_in)
    rows = g2.shape[0]
    config = config or default_config(rows, False, n_out, *_device_facts(g2))
    y = torch.empty(*g.shape[:-1], n_out, dtype=g.dtype, device=g.device)
    res = residual.contiguous() if residual is not None else y
    launch = _launch_args(config, rows, pdl_launch(g2))
    split, ws, cnt = _split_buffers(config, launch, n_in, n_out, y)
    _gemv_kernel[(triton.cdiv(n_out, launch["BLOCK_N"]), split)](
        g2, u2, weight, res, y, ws, cnt, rows, n_out, n_in, g2.stride(0), u2.stride(0), SILU=up is not None,
        HAS_RES=residual is not None, SPLIT_K=split, **launch,
    )  # fmt: skip
    return y
