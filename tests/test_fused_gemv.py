"""RMSNorm and SiLU·mul fused into the GEMV that reads them (kernels/fused_gemv.py): each output is the float64 product
of the unfused path's input and the weight, rounded once, up to what the unfused elementwise kernels' own last-unit
differences can move it; the residual sum comes back exact; more rows than the kernel takes go the unfused way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.fused_gemv import MAX_ROWS, rms_norm_linear, silu_mul_linear
from kernels.fused_ops import rms_norm_reference, silu_mul_reference

EPS = 1e-5


def _close(y: torch.Tensor, x_in: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` is ``x_in @ wᵀ`` (float64, rounded to y's dtype) to one unit in the last place, plus the bound that
    last-unit differences of the input elements can add (2^-mantissa · Σ|w·x|)."""
    exact = x_in.double() @ w.double().T
    mant = torch.finfo(y.dtype).eps  # 2^-mantissa bits
    bound = mant * exact.abs() + mant * (x_in.double().abs() @ w.double().abs().T) + torch.finfo(y.dtype).tiny
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, where the bound is {bound[err > bound].min():.3g}"


def _check_all(device: str, dtype: torch.dtype, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    w = rand(n, k, scale=k**-0.5)
    norm_w = rand(k, scale=0.5) + 1
    for rows in (1, 3):
        x, res = rand(rows, k), rand(rows, k)
        for residual in (None, res):
            y, h = rms_norm_linear(x, norm_w, EPS, w, residual)
            normed, h_ref = rms_norm_reference(x, norm_w, EPS, residual)
            assert torch.equal(h, h_ref)  # x + residual, rounded as the unfused kernel does
            assert y.shape == (rows, n) and y.dtype == dtype
            _close(y, normed, w)
        gu = rand(rows, 2 * k)  # a fused gate/up output: gate and up are strided column slices of it
        gate, up = gu[:, :k], gu[:, k:]
        y = silu_mul_linear(gate, up, w)
        assert y.shape == (rows, n)
        _close(y, silu_mul_reference(gate, up), w)
    # a batch past MAX_ROWS (and a (B, T, K) input) goes the unfused way: the same as norm then linear
    x = rand(2, MAX_ROWS, k)
    y, _ = rms_norm_linear(x, norm_w, EPS, w)
    normed, _ = rms_norm_reference(x, norm_w, EPS)
    _close(y.reshape(-1, n), normed.reshape(-1, k), w)


def test_fused_gemv_under_the_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 (a fresh process: the flag is read at import), with K past one
    K block (512) and N not a multiple of the 8-output block."""
    code = "import torch, tests.test_fused_gemv as t; t._check_all('cpu', torch.float16, k=600, n=37)"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_without_triton_kernels_the_cpu_path_is_norm_then_linear():
    x, norm_w, w = torch.randn(2, 16), torch.rand(16) + 0.5, torch.randn(5, 16)
    y, h = rms_norm_linear(x, norm_w, EPS, w)
    assert torch.equal(y, torch.nn.functional.linear(rms_norm_reference(x, norm_w, EPS)[0], w)) and h is x
    g, u = torch.randn(2, 16), torch.randn(2, 16)
    assert torch.equal(silu_mul_linear(g, u, w), torch.nn.functional.linear(silu_mul_reference(g, u), w))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("block_n=3", "block_n must be a power of two"),
        ("block_k=0", "'block_k=0' must be one of"),
        ("warps=4", "'warps=4' must be one of"),
    ],
)
def test_a_bad_launch_config_is_named(spec, message):
    from eval_suite.bench_fused_gemv import parse_config

    assert parse_config("block_n=16,num_warps=8") == type(parse_config(""))(block_n=16, num_warps=8)
    with pytest.raises(ValueError, match=message):
        parse_config(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(4096, 6160), (14336, 4096), (576, 1539)])
def test_fused_gemv_cuda(dtype, k, n):
    _check_all("cuda", dtype, k=k, n=n)
