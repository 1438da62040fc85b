"""The q/k/v GEMV with RoPE, LoRA B and the cache stores in its launch (kernels/fused_qkv_rope.py): the queries it
returns and the keys, values and V_lr it writes are those of the path it replaces (the norm GEMV, then q's and v's B,
then the RoPE-and-store kernel), element for element under the interpreter (same summation order there) and within one
unit in the last place on a GPU; the decoder takes it for one-row decode steps only and decodes the same tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import run_under_interpreter

from kernels.fused_qkv_rope import SWITCH_ENV, LoraTerm, qkv_rope_switch

EPS = 1e-5


def _case(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, r: int, seed: int = 0) -> dict:
    """A fused q/k/v weight with q's and v's A rows, three roles' B, a norm weight, the row, RoPE at position 37 and
    empty pools (3 slots, capacity 64)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    n_base = (hq + 2 * hkv) * d
    weight = rand(n_base + 2 * r, hidden, scale=hidden**-0.5)
    pos = 37
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.cat([pos * inv, pos * inv])
    return dict(
        h=rand(1, hidden, scale=3.0), norm_w=rand(hidden, scale=0.5) + 1, weight=weight,
        b_q=rand(3, hq * d, r, scale=0.5), b_v=rand(3, hkv * d, r, scale=0.5),
        cos=ang.cos().to(device=device, dtype=dtype), sin=ang.sin().to(device=device, dtype=dtype),
        heads=(hq, hkv, d), r=r, a_q=n_base, a_v=n_base + r, pos=pos,
        k_pool=torch.zeros(3, hkv, 64, d, device=device, dtype=dtype),
        v_pool=torch.zeros(3, hkv, 64, d, device=device, dtype=dtype),
        lr_pool=torch.zeros(2, 64, r, device=device, dtype=dtype),
    )  # fmt: skip


def _index(c: dict, device: str, role: int) -> dict:
    t = dict(dtype=torch.long, device=device)
    return dict(kv_slot=torch.tensor([2], **t), lr_slot=torch.tensor([1], **t), pos=torch.tensor([c["pos"]], **t),
                role=torch.tensor([role], **t))  # fmt: skip


def _pools(c: dict) -> tuple[torch.Tensor, ...]:
    return tuple(c[k].clone() for k in ("k_pool", "v_pool", "lr_pool"))


def _reference(c: dict, idx: dict, decomposed: bool) -> tuple[torch.Tensor, ...]:
    """The path the launch replaces: the norm GEMV, v's B through addmm (full cache), q's B inside the RoPE-and-store
    kernel; returns (queries, k pool, v pool, lr pool)."""
    from kernels.fused_gemv import NORM_CONFIG, rms_norm_linear
    from kernels.fused_ops import rope_store

    hq, hkv, d = c["heads"]
    r = c["r"]
    k_pool, v_pool, lr_pool = _pools(c)
    y = rms_norm_linear(c["h"], c["norm_w"], EPS, c["weight"], config=NORM_CONFIG)[0]
    q, k, v, lr_q, lr_v = y.split([hq * d, hkv * d, hkv * d, r, r], dim=-1)
    if not decomposed:  # addmm(base, lr, B_roleᵀ, alpha=s): float32 sum, one rounding
        v = (v.float() + 0.5 * (lr_v.float() @ c["b_v"][idx["role"]][0].float().T)).to(v.dtype)
    qo = rope_store(
        q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), lr_v if decomposed else None, c["cos"][None],
        c["sin"][None], k_pool, v_pool, lr_pool if decomposed else None, idx["kv_slot"], idx["lr_slot"], idx["pos"],
        q_lora=(lr_q, c["b_q"], 2.0, idx["role"]),
    )  # fmt: skip
    return qo, k_pool, v_pool, lr_pool


def _fused(c: dict, idx: dict, decomposed: bool) -> tuple[torch.Tensor, ...]:
    from kernels.fused_qkv_rope import qkv_rope_store

    k_pool, v_pool, lr_pool = _pools(c)
    lora = {"q": LoraTerm(c["a_q"], c["b_q"], 2.0)}
    if not decomposed:
        lora["v"] = LoraTerm(c["a_v"], c["b_v"], 0.5)
    q = qkv_rope_store(
        c["h"], c["norm_w"], EPS, c["weight"], *c["heads"], c["cos"], c["sin"], k_pool, v_pool,
        lr_pool if decomposed else None, idx["kv_slot"], idx["lr_slot"], idx["pos"], idx["role"], lora,
        c["a_v"] if decomposed else None,
    )  # fmt: skip
    return q, k_pool, v_pool, lr_pool


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the last place of each head vector's largest magnitude: RoPE mixes a vector's
    two halves, so a last-unit difference of the GEMV's output (its summation order) moves an element near zero by
    that vector's unit, not its own; a wrong pairing, rotation or LoRA term moves it by the vector's scale."""
    eps = torch.finfo(a.dtype).eps
    a, b = a.double(), b.double()
    scale = torch.maximum(a.abs(), b.abs()).amax(dim=-1, keepdim=True).clamp_min(1e-6) * eps
    return float(((a - b).abs() / scale).max())


def check(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, r: int, max_ulps: float) -> None:
    for decomposed in (True, False):
        for role in (0, 2):
            c = _case(device, dtype, hq, hkv, d, hidden, r, seed=role)
            idx = _index(c, device, role)
            ref, got = _reference(c, idx, decomposed), _fused(c, idx, decomposed)
            for name, a, b in zip(("q", "k pool", "v pool", "lr pool"), ref, got, strict=True):
                assert a.shape == b.shape, name
                # v's B term (full cache) is summed over r by a matmul in the reference: its order may differ
                exact = max_ulps == 0 and (decomposed or name != "v pool")
                if exact:
                    assert torch.equal(a, b), (name, decomposed, role, float((a.float() - b.float()).abs().max()))
                else:
                    assert _ulps(a, b) <= max(max_ulps, 1.0), (name, decomposed, role, _ulps(a, b))
            # nothing but the row's own slot and position was written
            k_pool = got[1].clone()
            k_pool[idx["kv_slot"], :, idx["pos"]] = 0
            assert not k_pool.any()
            assert got[1][2, :, c["pos"]].abs().sum() > 0  # and that one was


def test_one_launch_matches_the_path_it_replaces_under_the_interpreter():
    """fp16 under TRITON_INTERPRET=1: LLaMA-like GQA (4 query heads a KV head, D 64: 4 programs per head), a head dim
    of 16 (one program per head), rank 16 (32 A rows: the A program takes two blocks), K past one K block (600), both
    cache kinds, two roles: exactly equal."""
    run_under_interpreter(
        "import torch, tests.test_fused_qkv_rope as t; "
        "t.check('cpu', torch.float16, 8, 2, 64, 600, 8, 0); t.check('cpu', torch.float16, 3, 1, 16, 96, 4, 0); "
        "t.check('cpu', torch.float16, 4, 2, 32, 200, 16, 0)"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d", "hidden", "r"), [(32, 8, 128, 4096, 8), (9, 3, 64, 576, 8)])
def test_one_launch_matches_the_path_it_replaces_on_a_gpu(dtype, hq, hkv, d, hidden, r):
    """LLaMA-3.1-8B and SmolLM2-135M shapes on a GPU: within two units in the last place of each head vector (the
    GEMV's sums, X·A's among them, may be ordered differently from the norm GEMV's)."""
    check("cuda", dtype, hq, hkv, d, hidden, r, max_ulps=2.0)


def test_the_switch_is_on_unless_set_to_0(monkeypatch):
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert qkv_rope_switch() == 1
    assert qkv_rope_switch("0") == 0 and qkv_rope_switch(" ") == 1
    for bad in ("2", "on", "-1"):
        with pytest.raises(ValueError, match=rf"{SWITCH_ENV}='{bad}': allowed 0 \(off\) or 1"):
            qkv_rope_switch(bad)


def test_usable_refuses_what_the_kernel_cannot_take():
    """Several rows, a head dim that is not a power of two or too small for two half-blocks, a weight short of the q/k/v
    rows, adapters of two ranks, a float32 call: all left to the unfused path."""
    from kernels.fused_qkv_rope import usable

    w = torch.zeros(6 * 64 + 16, 128, dtype=torch.float16)
    h = torch.zeros(1, 128, dtype=torch.float16)
    b8, b4 = torch.zeros(2, 256, 8, dtype=torch.float16), torch.zeros(2, 64, 4, dtype=torch.float16)
    import os

    os.environ.setdefault("TRITON_INTERPRET", "0")
    ok = dict(n_q_heads=4, n_kv_heads=1, head_dim=64, lora={"q": LoraTerm(384, b8, 2.0)})
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    assert usable(h, w, **ok) == interpret  # only where the kernels run (CUDA, or the interpreter)
    assert not usable(torch.zeros(2, 128, dtype=torch.float16), w, **ok)
    assert not usable(h, w, **{**ok, "head_dim": 48})
    assert not usable(h, w, **{**ok, "head_dim": 8})
    assert not usable(h, w[:300], **ok)
    assert not usable(h, w, **{**ok, "lora": {"q": LoraTerm(384, b8, 2.0), "v": LoraTerm(392, b4, 2.0)}})
    assert not usable(h.float(), w.float(), **ok)


def _engine_one_row(device: str) -> dict:
    """One-row decode (tiny LLaMA, q/v adapters, fp16, three roles) of both shared schemes with the switch on and off:
    the same tokens, logits within 2e-3, and the launch taken once per layer and step only when on."""
    import os

    from conftest import decode_rows, tiny_multi_lora

    import kernels.fused_qkv_rope as fq

    calls = {"n": 0}
    raw = fq.qkv_rope_store

    def spy(*a, **kw):
        calls["n"] += 1
        return raw(*a, **kw)

    saved = os.environ.get(SWITCH_ENV)
    fq.qkv_rope_store = spy
    counted = {}
    try:
        for scheme in ("base_lr_shared", "full_shared"):
            outs = {}
            for flag in ("0", "1"):
                os.environ[SWITCH_ENV] = flag
                before = calls["n"]
                m = tiny_multi_lora("tiny-llama", b_std=0.3)
                m.to(device)
                m.model.half()
                outs[flag] = decode_rows(m, scheme, rows=1)
                counted[(scheme, flag)] = calls["n"] - before
            for a, b in zip(outs["0"], outs["1"], strict=True):
                assert a.generated_ids == b.generated_ids, (scheme, a.generated_ids, b.generated_ids)
                assert float((a.logits - b.logits).abs().max()) <= 2e-3, scheme
            assert counted[(scheme, "0")] == 0 and counted[(scheme, "1")] > 0, counted
    finally:
        fq.qkv_rope_store = raw
        if saved is None:
            os.environ.pop(SWITCH_ENV, None)
        else:
            os.environ[SWITCH_ENV] = saved
    return counted


def test_the_engine_decodes_the_same_with_the_launch_under_the_interpreter():
    out = run_under_interpreter("import tests.test_fused_qkv_rope as t; print('ok', t._engine_one_row('cpu'))")
    assert out.startswith("ok"), out


@pytest.mark.gpu
def test_the_engine_decodes_the_same_with_the_launch_on_a_gpu():
    """The same on a GPU, decode steps captured and replayed as CUDA graphs."""
    _engine_one_row("cuda")
