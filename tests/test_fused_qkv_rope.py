"""The q/k/v GEMV with RoPE and the cache stores in its launch (kernels/fused_qkv_rope.py): the keys, values and V_lr
it writes are those of the path it replaces (the norm GEMV, then the RoPE-and-store kernel), element for element under
the interpreter (same summation order there) and within two units in the last place on a GPU; its rotated base queries
are the RoPE kernel's without the LoRA term exactly; base plus the float32 term it hands the attention is the replaced
path's query within two units; the attention adds that term as q's own rounding would; the decoder takes the launch for
one-row steps of both cache kinds and decodes the same tokens. A full cache (no V_lr) gets v's LoRA term added in the
launch: the stored values are the replaced path's (the GEMV, the ``addmm`` of the masked B, RoPE-and-store) within two
units in the last place, and the launch writes nothing else."""

from __future__ import annotations

import pytest
import torch
from conftest import run_under_interpreter

from kernels.fused_qkv_rope import MAXNREG_ENV, SWITCH_ENV, qkv_maxnreg, qkv_rope_switch

EPS = 1e-5


def _case(device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, r: int, seed: int = 0) -> dict:
    """A fused q/k/v weight with q's and v's A rows, three roles' B for q and for v, a norm weight, the row, RoPE at
    position 37 and empty pools (3 slots, capacity 64)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    n_base = (hq + 2 * hkv) * d
    pos = 37
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.cat([pos * inv, pos * inv])
    t = dict(dtype=torch.long, device=device)
    return dict(
        h=rand(1, hidden, scale=3.0), norm_w=rand(hidden, scale=0.5) + 1,
        weight=rand(n_base + 2 * r, hidden, scale=hidden**-0.5), b_q=rand(3, hq * d, r, scale=0.5),
        b_v=rand(3, hkv * d, r, scale=0.5),
        cos=ang.cos().to(device=device, dtype=dtype), sin=ang.sin().to(device=device, dtype=dtype),
        heads=(hq, hkv, d), r=r, a_q=n_base, a_v=n_base + r, pos=torch.tensor([pos], **t),
        k_pool=torch.zeros(3, hkv, 64, d, device=device, dtype=dtype),
        v_pool=torch.zeros(3, hkv, 64, d, device=device, dtype=dtype),
        lr_pool=torch.zeros(2, 64, r, device=device, dtype=dtype),
        kv_slot=torch.tensor([2], **t), lr_slot=torch.tensor([1], **t), role=torch.tensor([seed % 3], **t),
    )  # fmt: skip


def _pools(c: dict) -> tuple[torch.Tensor, ...]:
    return tuple(c[k].clone() for k in ("k_pool", "v_pool", "lr_pool"))


def _reference(c: dict, with_lora: bool) -> tuple[torch.Tensor, ...]:
    """The path the launch replaces: the norm GEMV, then the RoPE-and-store kernel (q's B inside it, or none);
    returns (queries, k pool, v pool, lr pool)."""
    from kernels.fused_gemv import NORM_CONFIG, rms_norm_linear
    from kernels.fused_ops import rope_store

    hq, hkv, d = c["heads"]
    r = c["r"]
    k_pool, v_pool, lr_pool = _pools(c)
    y = rms_norm_linear(c["h"], c["norm_w"], EPS, c["weight"], config=NORM_CONFIG)[0]
    q, k, v, lr_q, lr_v = y.split([hq * d, hkv * d, hkv * d, r, r], dim=-1)
    qo = rope_store(
        q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), lr_v, c["cos"][None], c["sin"][None], k_pool, v_pool,
        lr_pool, c["kv_slot"], c["lr_slot"], c["pos"], q_lora=(lr_q, c["b_q"], 2.0, c["role"]) if with_lora else None,
    )  # fmt: skip
    return qo, k_pool, v_pool, lr_pool


def _reference_full(c: dict) -> tuple[torch.Tensor, ...]:
    """A full cache's replaced path: the norm GEMV, v's term added by the ``addmm`` of the role-masked X·A and every
    role's B side by side (:meth:`MultiLoraLinear.add_lora_masked`, v's scaling 0.5), then RoPE-and-store with q's B
    and no V_lr; returns (queries, k pool, v pool)."""
    from kernels.fused_gemv import NORM_CONFIG, rms_norm_linear
    from kernels.fused_ops import rope_store

    hq, hkv, d = c["heads"]
    r = c["r"]
    k_pool, v_pool, _ = _pools(c)
    y = rms_norm_linear(c["h"], c["norm_w"], EPS, c["weight"], config=NORM_CONFIG)[0]
    q, k, v, lr_q, lr_v = y.split([hq * d, hkv * d, hkv * d, r, r], dim=-1)
    role = int(c["role"])
    masked = torch.zeros(1, 3 * r, dtype=y.dtype, device=y.device)
    masked[:, role * r : (role + 1) * r] = lr_v
    v = v.clone().addmm_(masked, torch.cat(list(c["b_v"]), dim=1).t(), alpha=0.5)
    qo = rope_store(
        q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), None, c["cos"][None], c["sin"][None], k_pool, v_pool,
        None, c["kv_slot"], c["lr_slot"], c["pos"], q_lora=(lr_q, c["b_q"], 2.0, c["role"]),
    )  # fmt: skip
    return qo, k_pool, v_pool


def _fused(c: dict, with_lora: bool, maxnreg: int = 0, full: bool = False, pools: tuple | None = None) -> tuple:
    """The one launch; ``full``: a full cache (v's B in the launch, no V_lr pool); ``pools``: these (k, v, lr) pools
    instead of fresh copies (a caller that must launch nothing between its producer and this launch)."""
    from kernels.fused_qkv_rope import qkv_rope_store

    k_pool, v_pool, lr_pool = _pools(c) if pools is None else pools
    q, q_add = qkv_rope_store(
        c["h"], c["norm_w"], EPS, c["weight"], *c["heads"], c["cos"], c["sin"], k_pool, v_pool,
        None if full else lr_pool, c["kv_slot"], c["lr_slot"], c["pos"], c["a_v"],
        (c["a_q"], c["b_q"], 2.0, c["role"]) if with_lora else None, maxnreg=maxnreg,
        v_lora=(c["b_v"], 0.5, c["role"]) if full else None,
    )  # fmt: skip
    return q, q_add, k_pool, v_pool, lr_pool


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the last place of each head vector's largest magnitude: RoPE mixes a vector's
    two halves, so a last-unit difference before it moves an element near zero by that vector's unit, not its own; a
    wrong pairing, rotation or LoRA term moves it by the vector's scale."""
    eps = torch.finfo(a.dtype).eps
    a, b = a.double(), b.double()
    scale = torch.maximum(a.abs(), b.abs()).amax(dim=-1, keepdim=True).clamp_min(1e-6) * eps
    return float(((a - b).abs() / scale).max())


def check(
    device: str, dtype: torch.dtype, hq: int, hkv: int, d: int, hidden: int, r: int, exact: bool, seeds=(0, 2)
) -> None:
    """The launch against the path it replaces for each seed of ``seeds`` (seed ``s`` decodes as role ``s % 3``)."""
    for seed in seeds:
        c = _case(device, dtype, hq, hkv, d, hidden, r, seed=seed)
        # without q's adapter: everything the replaced path writes, and the queries, exactly (interpreter)
        ref, (q, q_add, *pools) = _reference(c, False), _fused(c, False)
        assert q_add is None
        for name, a, b in zip(("q", "k pool", "v pool", "lr pool"), ref, (q, *pools), strict=True):
            assert a.shape == b.shape, name
            if exact:
                assert torch.equal(a, b), (name, seed, float((a.float() - b.float()).abs().max()))
            else:
                assert _ulps(a, b) <= 2, (name, seed, _ulps(a, b))
        # with it: the same stores and base queries; base + term is the replaced path's query within two units
        ref, (q_lora, q_add, *pools2) = _reference(c, True), _fused(c, True)
        assert torch.equal(q_lora, q) and all(torch.equal(x, y) for x, y in zip(pools, pools2, strict=True))
        assert q_add.dtype == torch.float32 and q_add.shape == q.shape
        q_eff = (q.float() + q_add).to(dtype)
        assert _ulps(ref[0], q_eff) <= 2, (seed, _ulps(ref[0], q_eff))
        # the term itself: RoPE of s · X·A_q · B_roleᵀ (float64 from the GEMV's rounded X·A)
        hq_, hkv_, d_ = c["heads"]
        from kernels.fused_gemv import NORM_CONFIG, rms_norm_linear

        y = rms_norm_linear(c["h"], c["norm_w"], EPS, c["weight"], config=NORM_CONFIG)[0]
        lr = y[0, c["a_q"] : c["a_q"] + r].double()
        term = (2.0 * c["b_q"][seed % 3].double() @ lr).view(hq_, d_)
        rot = torch.cat([-term[:, d_ // 2 :], term[:, : d_ // 2]], dim=-1)
        want = term * c["cos"].double() + rot * c["sin"].double()
        assert torch.allclose(q_add[0].double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        # nothing but the row's own slot and position was written, and that one was
        k_pool = pools[0].clone()
        assert k_pool[2, :, 37].abs().sum() > 0
        k_pool[2, :, 37] = 0
        assert not k_pool.any()
        # a full cache: v + s · X·A_v · B_roleᵀ stored (within two units), k and the queries as with a V_lr pool;
        # the term is material (a launch that left it out would be far off). Its v pool is the start of a larger
        # zeroed buffer: nothing but the row's slot and position is written, past the pool's end neither
        ref_q, ref_k, ref_v = _reference_full(c)
        k0, v0, lr0 = _pools(c)
        big = torch.zeros(40, *v0.shape[1:], dtype=v0.dtype, device=v0.device)
        q_f, q_add_f, k_f, v_f, lr_f = _fused(c, True, full=True, pools=(k0, big[: v0.shape[0]], lr0))
        assert torch.equal(q_f, q) and torch.equal(q_add_f, q_add) and torch.equal(k_f, pools[0]), seed
        assert not lr_f.any(), "a full cache's launch wrote into the V_lr pool"
        assert _ulps(ref_k, k_f) <= (0 if exact else 2) and _ulps(ref_v, v_f) <= 2, (seed, _ulps(ref_v, v_f))
        assert _ulps(ref_v, pools[1]) > 10, "the v term is too small to tell"  # bf16: 48 units at 8B shapes
        big[2, :, 37] = 0
        assert not big.any(), "a full cache's launch wrote outside its row's slot and position"


def test_one_launch_matches_the_path_it_replaces_under_the_interpreter():
    """fp16 under TRITON_INTERPRET=1, each role once: LLaMA-like GQA (4 query heads a KV head, D 64: 4 programs per
    head, K past one K block) as role 0, a head dim of 16 (one program per head) with 3 query heads (a term program
    with idle heads) as role 1, rank 16 as role 2."""
    run_under_interpreter(
        "import torch, tests.test_fused_qkv_rope as t; "
        "t.check('cpu', torch.float16, 8, 2, 64, 600, 8, True, seeds=(0,)); "
        "t.check('cpu', torch.float16, 3, 1, 16, 96, 4, True, seeds=(1,)); "
        "t.check('cpu', torch.float16, 4, 2, 32, 200, 16, True, seeds=(2,))"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d", "hidden", "r"), [(32, 8, 128, 4096, 8), (9, 3, 64, 576, 8)])
def test_one_launch_matches_the_path_it_replaces_on_a_gpu(dtype, hq, hkv, d, hidden, r):
    """LLaMA-3.1-8B and SmolLM2-135M shapes on a GPU: within two units in the last place of each head vector (the
    GEMV's sums may be ordered differently from the norm GEMV's)."""
    check("cuda", dtype, hq, hkv, d, hidden, r, exact=False)


def check_attention_adds(device: str) -> None:
    """The decode attention with ``q_add`` equals the attention of ``(q + q_add)`` rounded to q's dtype, on the kernel
    and on the torch path; a q_add of another shape or dtype is refused, naming it."""
    from kernels.flash_lora_decode import flash_lora_decode

    g = torch.Generator().manual_seed(1)
    dt = torch.float16

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    q, k, v, vlr = rand(2, 8, 64), rand(3, 2, 40, 64), rand(3, 2, 40, 64), rand(3, 40, 8)
    b = rand(3, 2, 8, 64) * 0.3
    lens = torch.tensor([40, 17], device=device)
    roles = torch.tensor([2, 0], device=device)
    qa = torch.randn(2, 8, 64, generator=g).to(device) * 0.5
    kw = dict(v_lr_cache=vlr, lora_b=b, scaling=2.0, role_ids=roles)
    got = flash_lora_decode(q, k, v, lens, q_add=qa, **kw)
    want = flash_lora_decode((q.float() + qa).to(dt), k, v, lens, **kw)
    assert torch.equal(got, want)
    got32 = flash_lora_decode(q.float(), k.float(), v.float(), lens, q_add=qa, v_lr_cache=vlr.float(),
                              lora_b=b.float(), scaling=2.0, role_ids=roles)  # fmt: skip
    want32 = flash_lora_decode(q.float() + qa, k.float(), v.float(), lens, v_lr_cache=vlr.float(), lora_b=b.float(),
                               scaling=2.0, role_ids=roles)  # fmt: skip
    assert torch.equal(got32, want32)
    with pytest.raises(ValueError, match="q_add must be a contiguous float32 tensor of q's shape"):
        flash_lora_decode(q, k, v, lens, q_add=qa.half(), **kw)
    with pytest.raises(ValueError, match="q_add must be"):
        flash_lora_decode(q, k, v, lens, q_add=qa[:1], **kw)


def test_the_attention_adds_q_add_under_the_interpreter():
    run_under_interpreter("import tests.test_fused_qkv_rope as t; t.check_attention_adds('cpu')")


@pytest.mark.gpu
def test_the_attention_adds_q_add_on_a_gpu():
    check_attention_adds("cuda")


def test_the_switch_is_on_unless_set_to_0(monkeypatch):
    """On by default (the whole GPU suite passed with it on); anything but 0 or 1 refused, named."""
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert qkv_rope_switch() == 1
    assert qkv_rope_switch("0") == 0 and qkv_rope_switch(" ") == 1
    for bad in ("2", "on", "-1"):
        with pytest.raises(ValueError, match=rf"{SWITCH_ENV}='{bad}': allowed 0 \(off\) or 1"):
            qkv_rope_switch(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_register_cap_changes_nothing_the_launch_writes(dtype):
    """LLaMA-3.1-8B shapes with ``maxnreg`` 80 (three programs an SM instead of two) and 64 (spills): every output
    the same as the compiler's register count gives, bit for bit (a cap moves values between registers and the
    stack, not the arithmetic)."""
    for seed in (0, 1):
        c = _case("cuda", dtype, 32, 8, 128, 4096, 8, seed=seed)
        want = _fused(c, True)
        for cap in (80, 64):
            got = _fused(c, True, maxnreg=cap)
            for name, a, b in zip(("q", "q_add", "k pool", "v pool", "lr pool"), want, got, strict=True):
                assert torch.equal(a, b), (name, cap, seed)


def _compiled(fn) -> list:
    """Every compiled kernel of the Triton function ``fn`` in this process (its per-device caches), handles loaded."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        for kernel in entry[0].values():
            if hasattr(kernel, "_init_handles"):
                kernel._init_handles()
            out.append(kernel)
    return out


@pytest.mark.gpu
def test_the_register_cap_reaches_the_compiler():
    """The launch compiles with the cap it is given: at 80 the kernel takes at most 80 registers a thread with no
    spill (three 8-warp programs an SM; the compiler's own count was 93-99 on sm_90)."""
    import kernels.fused_qkv_rope as fq

    c = _case("cuda", torch.bfloat16, 32, 8, 128, 4096, 8)
    _fused(c, True, maxnreg=80)
    capped = [k for k in _compiled(fq._qkv_rope_store_kernel) if getattr(k.metadata, "maxnreg", None) == 80]
    assert capped, "no compiled kernel carries maxnreg=80"
    assert all(k.n_regs <= 80 and k.n_spills == 0 for k in capped), [(k.n_regs, k.n_spills) for k in capped]


def test_the_register_cap_switch_names_a_bad_value():
    """``LRAGENT_QKV_MAXNREG``: unset or empty the default cap (80); 0 the compiler's choice; 32-255 a cap; anything
    else refused."""
    assert qkv_maxnreg("") == qkv_maxnreg(" ") == 80 and qkv_maxnreg("0") == 0 and qkv_maxnreg("255") == 255
    for bad in ("16", "256", "-1", "80.5", "many"):
        with pytest.raises(
            ValueError, match=rf"{MAXNREG_ENV}='{bad}': allowed 0 \(the compiler's choice\) or registers 32-255"
        ):
            qkv_maxnreg(bad)


def test_usable_refuses_what_the_kernel_cannot_take(monkeypatch):
    """Several rows, a head dim that is not a power of two or too small for two half-blocks, a weight short of the
    q/k/v and A rows, a rank past 16, a float32 call: all left to the unfused path."""
    from kernels.fused_qkv_rope import usable

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the kernels run (kernels_usable reads it per call)
    w = torch.zeros(6 * 64 + 16, 128, dtype=torch.float16)
    h = torch.zeros(1, 128, dtype=torch.float16)
    ok = dict(n_q_heads=4, n_kv_heads=1, head_dim=64, rank=8)
    assert usable(h, w, **ok)
    assert not usable(torch.zeros(2, 128, dtype=torch.float16), w, **ok)
    assert not usable(h, w, **{**ok, "head_dim": 48}) and not usable(h, w, **{**ok, "head_dim": 8})
    assert not usable(h, w[: 6 * 64 + 7], **ok)
    assert not usable(h, torch.zeros(6 * 64 + 40, 128, dtype=torch.float16), **{**ok, "rank": 17})
    assert not usable(h.float(), w.float(), **ok)


def test_a_call_naming_both_caches_or_neither_or_a_bad_v_b_is_refused(monkeypatch):
    """Exactly one of the V_lr pool (a decomposed cache) and v's B (a full cache); v's B of v's rows and the rank, in
    the weight's dtype, contiguous: anything else named before the launch."""
    from kernels.fused_qkv_rope import qkv_rope_store

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the kernels run (kernels_usable reads it per call)
    c = _case("cpu", torch.float16, 4, 2, 32, 64, 4)
    k_pool, v_pool, lr_pool = _pools(c)

    def call(lr, v_lora):
        return qkv_rope_store(
            c["h"], c["norm_w"], EPS, c["weight"], *c["heads"], c["cos"], c["sin"], k_pool, v_pool, lr, c["kv_slot"],
            c["lr_slot"], c["pos"], c["a_v"], None, v_lora=v_lora,
        )  # fmt: skip

    with pytest.raises(ValueError, match="give one of lr_pool .* and v_lora .*, got both"):
        call(lr_pool, (c["b_v"], 0.5, c["role"]))
    with pytest.raises(ValueError, match="got neither"):
        call(None, None)
    for bad in (c["b_v"][:, :-1], c["b_v"].float(), c["b_v"].transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match=r"v's B must be contiguous \(n_roles, 64, 4\) in torch.float16, got"):
            call(None, (bad, 0.5, c["role"]))


def _engine_one_row(device: str, schemes: tuple[str, ...] = ("base_lr_shared", "full_shared")) -> dict:
    """One-row decode (tiny LLaMA, q/v adapters, fp16) of both shared schemes with the switch on and off: the same
    tokens, logits within 2e-3; the launch taken only with the switch on, for both (a full cache's with v's LoRA
    term added in it)."""
    import os

    from conftest import TWO_LAYERS, decode_rows, tiny_multi_lora

    import kernels.fused_qkv_rope as fq

    calls = {"n": 0}
    raw = fq.qkv_rope_store

    def spy(*a, **kw):
        calls["n"] += 1
        calls.setdefault("kw", []).append(kw)
        return raw(*a, **kw)

    saved = {k: os.environ.get(k) for k in (SWITCH_ENV, MAXNREG_ENV)}
    fq.qkv_rope_store = spy
    counted, caps = {}, set()
    try:
        for scheme in schemes:
            outs = {}
            # "0": the compiler's register count; "72": a cap; "": the default cap (80)
            for flag, cap in (("0", "0"), ("1", "0"), ("1", "72"), ("1", "")):
                os.environ[SWITCH_ENV], os.environ[MAXNREG_ENV] = flag, cap
                before = calls["n"]
                m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides=TWO_LAYERS)
                m.to(device)
                m.model.half()
                outs[flag + cap] = decode_rows(m, scheme, rows=1, max_new_tokens=2)  # a step past the prefill's
                counted[(scheme, flag + cap)] = calls["n"] - before
                caps |= {(cap, kw.get("maxnreg")) for kw in calls.get("kw", [])}
                calls["kw"] = []
            for a, b, c, d in zip(outs["00"], outs["10"], outs["172"], outs["1"], strict=True):
                assert a.generated_ids == b.generated_ids, (scheme, a.generated_ids, b.generated_ids)
                assert float((a.logits - b.logits).abs().max()) <= 2e-3, scheme
                assert torch.equal(b.logits, c.logits) and torch.equal(b.logits, d.logits), scheme  # caps: no change
        for scheme in schemes:
            assert counted[(scheme, "10")] > 0 and counted[(scheme, "172")] > 0 and counted[(scheme, "1")] > 0, counted
            assert counted[(scheme, "00")] == 0, counted
        assert caps == {("0", 0), ("72", 72), ("", 80)}, caps  # the view hands the switch's cap to the launch
    finally:
        fq.qkv_rope_store = raw
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {f"{s} {k}": v for (s, k), v in counted.items()}


@pytest.mark.parametrize("scheme", ["base_lr_shared", "full_shared"])
def test_the_engine_decodes_the_same_with_the_launch_under_the_interpreter(scheme):
    """One scheme per test (each its own interpreter process): the two together outlast a minute."""
    out = run_under_interpreter(
        f"import tests.test_fused_qkv_rope as t; print('ok', t._engine_one_row('cpu', ({scheme!r},)))"
    )
    assert out.startswith("ok"), out


@pytest.mark.gpu
def test_the_engine_decodes_the_same_with_the_launch_on_a_gpu():
    """The same on a GPU, decode steps captured and replayed as CUDA graphs."""
    _engine_one_row("cuda")
