"""The fused norm / RoPE-and-store / SiLU kernels against their PyTorch expressions.

On CPU the Triton kernels run under the interpreter (fp16; slow, so shapes are small); on CUDA (marked ``gpu``) in
fp16 and bf16 at model shapes. Each output is checked against the exact (float64) value of
the expression on the same rounded inputs: the error must be at most two units in the last place of the magnitude
the expression rounds at (for RoPE, ``|x cos| + |rot(x) sin|``: its two terms may cancel), which the eager PyTorch
expression itself meets; a wrong position, half, sign, weight or slot is off by far more.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import fused_ops as F


def _ulp_close(a: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """``|a - truth| <= 2 eps(dtype) * scale`` everywhere (``scale`` clamped at 2^-6: no denormal-level tolerance)."""
    eps = torch.finfo(dtype).eps
    diff = (a.double() - truth).abs()
    tol = 2 * eps * scale.clamp_min(2.0**-6)
    assert bool((diff <= tol).all()), (float(diff.max()), float((diff / tol).max()))


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact RoPE and the magnitude it rounds at."""
    x, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
    rot = torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)
    return x * c + rot * s, (x * c).abs() + (rot * s).abs()


def _check_all(device: str, dtype: torch.dtype, hidden: int, n: int, hq: int, hkv: int, d: int, r: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # rms norm, with and without the residual
    x, res, w = rnd(n, hidden), rnd(n, hidden), rnd(hidden)
    for residual in (None, res):
        got, h = F.rms_norm(x, w, 1e-5, residual)
        want, wh = F.rms_norm_reference(x, w, 1e-5, residual)
        assert torch.equal(h, wh)
        h64 = wh.double()
        truth = w.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)
        _ulp_close(want, truth, truth.abs(), dtype)  # the eager expression meets the bound
        _ulp_close(got, truth, truth.abs(), dtype)
    # silu * up
    gu = rnd(1, n, 2 * hidden)  # the two halves of one fused GEMM: strided rows
    for gate, up in ((rnd(n, hidden), rnd(n, hidden)), gu.split(hidden, dim=-1)):
        truth = torch.nn.functional.silu(gate.double()) * up.double()
        _ulp_close(F.silu_mul_reference(gate, up), truth, truth.abs(), dtype)
        _ulp_close(F.silu_mul(gate, up), truth, truth.abs(), dtype)
    # rope + store into pools at scattered slots and positions
    q, k, v, lr = rnd(n, hq, d), rnd(n, hkv, d), rnd(n, hkv, d), rnd(n, r)
    pos = torch.randperm(40, generator=g)[:n].to(device)
    ang = pos[:, None].float() * torch.linspace(0.01, 1.0, d // 2, device=device)[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slot = torch.randint(0, 3, (n,), generator=g).to(device)
    lslot = torch.randint(0, 2, (n,), generator=g).to(device)
    pools = [torch.zeros(3, hkv, 40, d, dtype=dtype, device=device) for _ in range(2)]
    lr_pool = torch.zeros(2, 40, r, dtype=dtype, device=device)
    q_out = F.rope_store(q, k, v, lr, cos, sin, pools[0], pools[1], lr_pool, slot, lslot, pos)
    for x, got in ((q, q_out), (k, pools[0][slot, :, pos])):
        truth, scale = _rope64(x, cos, sin)
        _ulp_close(F.rope_reference(x, cos, sin), truth, scale, dtype)
        _ulp_close(got, truth, scale, dtype)
    assert torch.equal(pools[1][slot, :, pos], v)
    assert torch.equal(lr_pool[lslot, pos], lr)
    # nothing else was written
    mask = torch.zeros(3, 40, dtype=torch.bool, device=device)
    mask[slot, pos] = True
    assert not pools[0].permute(0, 2, 1, 3)[~mask].any()
    # the queries' LoRA term in the same launch: q + s·lr·B_roleᵀ, rounded to the dtype, then RoPE
    q_lr, q_b = rnd(n, r), rnd(3, hq * d, r)
    role = torch.randint(0, 3, (n,), generator=g).to(device)
    again = [torch.zeros_like(p) for p in pools]
    got = F.rope_store(q, k, v, lr, cos, sin, *again, torch.zeros_like(lr_pool), slot, lslot, pos,
                       q_lora=(q_lr, q_b, 0.5, role))  # fmt: skip
    qa = q.double() + 0.5 * torch.einsum("nr,nor->no", q_lr.double(), q_b[role].double()).view(n, hq, d)
    truth, scale = _rope64(qa.to(dtype), cos, sin)
    _ulp_close(got, truth, 2 * scale, dtype)  # two roundings (the multiply-add, RoPE) before the compare
    assert float((truth - _rope64(q, cos, sin)[0]).abs().max()) > 0.5  # the term is not negligible
    # keys and values are stored as without the term: the values are copies; the keys the same RoPE, within its
    # rounding bound (this kernel variant may contract the multiply-adds differently: seen 1-ulp differences on an
    # H200 at head dim 128), and nothing else is written
    truth_k, scale_k = _rope64(k, cos, sin)
    _ulp_close(again[0][slot, :, pos], truth_k, scale_k, dtype)
    assert torch.equal(again[1], pools[1])
    assert not again[0].permute(0, 2, 1, 3)[~mask].any()


def test_fused_ops_under_the_interpreter():
    """Runs the Triton kernels under TRITON_INTERPRET=1 (a fresh process: the flag is read at import)."""
    code = (
        "import torch, tests.test_fused_ops as t; "
        "t._check_all('cpu', torch.float16, hidden=48, n=5, hq=4, hkv=2, d=16, r=3)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_fallbacks_are_the_reference_on_cpu():
    x, w = torch.randn(3, 8), torch.randn(8)
    assert torch.equal(F.rms_norm(x, w, 1e-6)[0], F.rms_norm_reference(x, w, 1e-6)[0])
    assert torch.equal(F.silu_mul(x, w.expand(3, 8)), F.silu_mul_reference(x, w.expand(3, 8)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(576, 9, 3, 64, 8), (4096, 32, 8, 128, 8), (3584, 28, 4, 128, 16)])
def test_fused_ops_cuda(dtype, shape):
    hidden, hq, hkv, d, r = shape
    _check_all("cuda", dtype, hidden=hidden, n=37, hq=hq, hkv=hkv, d=d, r=r)
