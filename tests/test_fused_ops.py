"""The fused norm / RoPE-and-store / SiLU kernels against their PyTorch expressions.

On CPU the Triton kernels run under the interpreter (fp16; slow, so shapes are small); on CUDA (marked ``gpu``) in
fp16 and bf16 at model shapes. The kernels reproduce the expressions' roundings, so the comparison is tight: at
most one unit in the last place anywhere, and the bulk of the elements bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import fused_ops as F


def _ulp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Within two units in the last place of the reference everywhere, and ‖a − b‖ / ‖b‖ at rounding level."""
    eps = torch.finfo(dtype).eps
    diff = (a.float() - b.float()).abs()
    tol = 2 * eps * b.float().abs().clamp_min(2.0**-6)
    assert bool((diff <= tol).all()), (float(diff.max()), float((diff / tol).max()))
    assert float(diff.norm() / b.float().norm().clamp_min(1e-12)) < 2 * eps


def _check_all(device: str, dtype: torch.dtype, hidden: int, n: int, hq: int, hkv: int, d: int, r: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # rms norm, with and without the residual
    x, res, w = rnd(n, hidden), rnd(n, hidden), rnd(hidden)
    for residual in (None, res):
        got, h = F.rms_norm(x, w, 1e-5, residual)
        want, wh = F.rms_norm_reference(x, w, 1e-5, residual)
        _ulp_close(got, want, dtype)
        assert torch.equal(h, wh)
    # silu * up
    gate, up = rnd(n, hidden), rnd(n, hidden)
    _ulp_close(F.silu_mul(gate, up), F.silu_mul_reference(gate, up), dtype)
    gu = rnd(1, n, 2 * hidden)  # the two halves of one fused GEMM: strided rows
    gate, up = gu.split(hidden, dim=-1)
    _ulp_close(F.silu_mul(gate, up), F.silu_mul_reference(gate, up), dtype)
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
    _ulp_close(q_out, F.rope_reference(q, cos, sin), dtype)
    _ulp_close(pools[0][slot, :, pos], F.rope_reference(k, cos, sin), dtype)
    assert torch.equal(pools[1][slot, :, pos], v)
    assert torch.equal(lr_pool[lslot, pos], lr)
    # nothing else was written
    mask = torch.zeros(3, 40, dtype=torch.bool, device=device)
    mask[slot, pos] = True
    assert not pools[0].permute(0, 2, 1, 3)[~mask].any()


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
