"""CPU tests of Flash-LoRA-Attention: the torch reference against a naive float64 formula, the input checks,
and the Triton kernel logic under ``TRITON_INTERPRET=1`` (fp16 only: the interpreter's bf16 ``tl.dot`` is
wrong in Triton 3.9).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.flash_lora_attention import flash_lora_attention, flash_lora_attention_reference

REPO = Path(__file__).resolve().parents[1]


def make_inputs(
    bsz: int,
    hq: int,
    hkv: int,
    lc: int,
    seq: int,
    d: int,
    rank: int,
    dtype: torch.dtype,
    n_roles: int = 3,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """Random inputs laid out like the runtime passes them: strided views of larger buffers."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    q = rnd(bsz, lc, hq, d).transpose(1, 2)  # (B, Hq, Lc, D), non-contiguous in heads
    k = rnd(bsz, hkv, seq + 5, d)[:, :, :seq]  # narrowed cache views (B, Hkv, L, D)
    v_base = rnd(bsz, hkv, seq + 3, d)[:, :, :seq]
    v_lr = rnd(bsz, seq + 2, rank)[:, :seq]  # (B, L, r)
    b_peft = rnd(n_roles, hkv * d, rank, scale=0.5)  # PEFT layout (n_roles, Hkv*D, r)
    lora_b = b_peft.view(n_roles, hkv, d, rank).transpose(-1, -2)  # (n_roles, Hkv, r, D), strided view
    return {"q": q, "k": k, "v_base": v_base, "v_lr": v_lr, "lora_b": lora_b}


def naive_float64(q, k, v_base, v_lr, lora_b, scaling, role_ids, kv_lens, sm_scale=None) -> torch.Tensor:
    """Materialise V = V_base + V_lr B_g s per sequence and run masked softmax attention, in float64."""
    bsz, hq, lc, d = q.shape
    hkv = k.shape[1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(bsz, hq, lc, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(kv_lens[b])
        role = int(role_ids[b])
        for h in range(hq):
            g = h // (hq // hkv)
            kk = k[b, g, :n].double()
            vv = v_base[b, g, :n].double() + v_lr[b, :n].double() @ lora_b[role, g].double() * scaling
            s = q[b, h].double() @ kk.T * sm_scale  # (Lc, n)
            for i in range(lc):
                last = n - lc + i  # query i sits at position n - lc + i
                s[i, last + 1 :] = float("-inf")
            out[b, h] = torch.softmax(s, dim=-1) @ vv
    return out


CASES = [
    # bsz, hq, hkv, lc, seq, d, rank, kv_lens, role_ids
    (1, 4, 4, 1, 1, 16, 1, [1], [0]),
    (1, 4, 1, 1, 17, 32, 8, [17], [2]),
    (2, 6, 2, 5, 40, 16, 3, [40, 9], [1, 0]),
    (3, 8, 2, 17, 100, 64, 16, [100, 17, 63], [2, 0, 1]),
    (2, 9, 3, 33, 33, 32, 64, [33, 33], [0, 2]),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive_float64(case):
    bsz, hq, hkv, lc, seq, d, rank, kv_lens, role_ids = case
    x = make_inputs(bsz, hq, hkv, lc, seq, d, rank, torch.float32, seed=len(kv_lens) + seq)
    kv = torch.tensor(kv_lens)
    roles = torch.tensor(role_ids)
    out = flash_lora_attention_reference(**x, scaling=2.0, role_ids=roles, kv_lens=kv)
    expected = naive_float64(**x, scaling=2.0, role_ids=roles, kv_lens=kv)
    assert out.shape == (bsz, hq, lc, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_reference_lora_term_matters_and_roles_differ():
    """With B != 0 the LoRA term changes the output, and each role gives a different result."""
    x = make_inputs(2, 4, 2, 3, 20, 16, 4, torch.float32)
    base = flash_lora_attention_reference(**x, scaling=0.0)
    r0 = flash_lora_attention_reference(**x, scaling=2.0, role_ids=torch.tensor([0, 0]))
    r1 = flash_lora_attention_reference(**x, scaling=2.0, role_ids=torch.tensor([1, 1]))
    assert (r0 - base).abs().max() > 1e-2
    assert (r0 - r1).abs().max() > 1e-2
    mixed = flash_lora_attention_reference(**x, scaling=2.0, role_ids=torch.tensor([0, 1]))
    torch.testing.assert_close(mixed[0], r0[0])
    torch.testing.assert_close(mixed[1], r1[1])


def test_reference_full_prefill_equals_sdpa_on_expanded_values():
    """Lc == L with full lengths is ordinary causal attention over V_base + V_lr B s (torch SDPA, GQA expanded)."""
    x = make_inputs(2, 8, 2, 24, 24, 32, 8, torch.float64)
    roles = torch.tensor([1, 2])
    out = flash_lora_attention_reference(**x, scaling=0.5, role_ids=roles)
    v = x["v_base"] + torch.matmul(x["v_lr"].unsqueeze(1), x["lora_b"][roles]) * 0.5  # (B, Hkv, L, D)
    k = x["k"].repeat_interleave(4, dim=1)
    expected = F.scaled_dot_product_attention(x["q"], k, v.repeat_interleave(4, dim=1), is_causal=True)
    torch.testing.assert_close(out, expected)


def test_reference_low_precision_mode_returns_q_dtype():
    x = make_inputs(1, 4, 2, 2, 10, 16, 2, torch.bfloat16)
    lo = flash_lora_attention_reference(**x, scaling=1.0, upcast=False)
    hi = flash_lora_attention_reference(**x, scaling=1.0)
    assert lo.dtype == hi.dtype == torch.bfloat16
    assert 0 < (lo.float() - hi.float()).abs().max() < 0.1


# ------------------------------------------------------------------------------------------------
# Bad input: one-line ValueError naming the argument
# ------------------------------------------------------------------------------------------------


def _bad(fn, match: str, **overrides):
    x = make_inputs(2, 8, 2, 3, 12, 16, 4, torch.float16)
    kwargs = {**x, "scaling": 1.0, **overrides}
    with pytest.raises(ValueError, match=match) as info:
        fn(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fn", [flash_lora_attention, flash_lora_attention_reference])
def test_bad_inputs_raise_value_error(fn):
    x = make_inputs(2, 8, 2, 3, 12, 16, 4, torch.float16)
    _bad(fn, "q dtype", q=x["q"].to(torch.int32))
    _bad(fn, "k dtype", k=x["k"].float())
    _bad(fn, "q heads", q=torch.randn(2, 7, 3, 16, dtype=torch.float16))
    _bad(fn, "v_base shape", v_base=x["v_base"][:, :, :11])
    _bad(fn, "rank", v_lr=x["v_lr"][..., :0], lora_b=x["lora_b"][:, :, :0])
    _bad(fn, "v_lr rank", v_lr=torch.randn(2, 12, 65, dtype=torch.float16))
    _bad(fn, "lora_b shape", lora_b=x["lora_b"][:, :1])
    _bad(fn, "q length", q=torch.randn(2, 8, 13, 16, dtype=torch.float16))
    _bad(fn, "role_ids", role_ids=torch.tensor([0, 3]))
    _bad(fn, "role_ids", role_ids=torch.tensor([0.0, 1.0]))
    _bad(fn, "kv_lens", kv_lens=torch.tensor([12, 2]))  # shorter than Lc = 3
    _bad(fn, "kv_lens", kv_lens=torch.tensor([12]))
    _bad(fn, "v_lr must have 3 dims", v_lr=x["v_lr"][0])


def test_kernel_rejects_cpu_and_unsupported_layouts():
    x = make_inputs(2, 8, 2, 3, 12, 16, 4, torch.float16)  # the shapes _bad uses
    if os.environ.get("TRITON_INTERPRET") != "1":
        _bad(flash_lora_attention, "q must be a CUDA tensor")
    _bad(flash_lora_attention, "q dtype", q=x["q"].float(), k=x["k"].float(), v_base=x["v_base"].float())
    _bad(flash_lora_attention, "head dim", **make_inputs(2, 8, 2, 3, 12, 24, 4, torch.float16))
    _bad(flash_lora_attention, "k must be contiguous in its last dim", k=x["k"].transpose(-1, -2).contiguous().mT)


# ------------------------------------------------------------------------------------------------
# Triton kernel logic on CPU via the interpreter (subprocess: TRITON_INTERPRET must be set before import)
# ------------------------------------------------------------------------------------------------

_INTERPRET_SCRIPT = """
import json, torch
from tests.test_kernel_reference import make_inputs
from kernels.flash_lora_attention import flash_lora_attention, flash_lora_attention_reference as ref
res = []
for (bsz, hq, hkv, lc, seq, d, rank, kv, roles) in CASES:
    x = make_inputs(bsz, hq, hkv, lc, seq, d, rank, torch.float16, seed=seq)
    kw = dict(scaling=2.0, role_ids=torch.tensor(roles), kv_lens=torch.tensor(kv, dtype=torch.int32))
    out = flash_lora_attention(**x, **kw)
    exact = ref(**x, **kw).float()
    eager = ref(**x, **kw, upcast=False).float()
    res.append([(out.float() - exact).abs().max().item(), (eager - exact).abs().max().item()])
print(json.dumps(res))
"""

INTERPRET_CASES = [
    # bsz, hq, hkv, lc, seq, d, rank, kv_lens, role_ids ; G * Lc <= 64 -> split-K path, else prefill path
    (1, 2, 2, 1, 1, 16, 1, [1], [0]),
    (2, 4, 1, 1, 1000, 32, 8, [1000, 17], [2, 1]),
    (2, 8, 1, 3, 600, 16, 64, [600, 257], [0, 2]),
    (2, 6, 2, 40, 130, 16, 16, [130, 41], [1, 0]),
    (2, 8, 2, 17, 300, 64, 5, [300, 17], [2, 2]),
    (1, 3, 1, 70, 70, 16, 8, [70], [1]),
]


def test_triton_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = f"CASES = {INTERPRET_CASES!r}\n" + _INTERPRET_SCRIPT
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == len(INTERPRET_CASES)
    for case, (err, eager_err) in zip(INTERPRET_CASES, errors, strict=True):
        assert err <= 2 * eager_err + 1e-3, (case, err, eager_err)
