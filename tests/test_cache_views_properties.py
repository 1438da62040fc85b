"""Cache views write exactly their own positions and slots, and attend exactly to what DESIGN.md §2 lets them see.

Each view is checked against a naive masked-softmax attention written out here (float64, the decomposed value
expanded literally, ``V = V_base + s · V_lr B_roleᵀ``), on pools whose other slots hold noise: a prefill view of
one trajectory at an offset (bottom-right causal), a decode view of rows with unequal lengths, distinct K/V and
V_lr slots and different roles, the growable view (with a padding mask, and its two-piece shared pass), and the
replay view of a checkpointed layer. Stores must touch only the view's slots and positions. End to end, three agents
with unequal prompts taking turns out of order give, through the engine's views, DESIGN.md §2's equalities: with
B = 0 every scheme equals the base model, and with one agent every scheme equals ``non_shared``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_multi_lora
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.flash_lora_decode as fld
import kernels.fused_ops as fused_ops
import lragent.cache_views as cv
from lragent.attention import RoleSplit
from lragent.cache_views import DecodeView, GrowableView, PrefillView, ReplayView, decode_attention_reference
from lragent.engine import Engine, GenerationRequest
from lragent.kv_cache import ModelCache
from lragent.schemes import SCHEMES
from lragent.static_cache import PoolLayout, StaticCachePool

H_Q, H_KV, D, R, N_ROLES, CAP = 4, 2, 4, 3, 3, 12


def naive_attention(q, k, v, visible):
    """Masked softmax attention: q (B, H_q, T, D), k (B, H_kv, L, D), v (B, H_kv, L, Dv), visible (B, T, L)."""
    b, h_q, t, d = q.shape
    group = h_q // k.shape[1]
    out = torch.zeros(b, h_q, t, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(h_q):
            for ti in range(t):
                scores = k[bi, h // group].double() @ q[bi, h, ti].double() / math.sqrt(d)
                scores = scores.masked_fill(~visible[bi, ti], float("-inf"))
                out[bi, h, ti] = torch.softmax(scores, 0) @ v[bi, h // group].double()
    return out


def expand_v(v_base, v_lr, lora_b, scaling, roles):
    """Literal ``V_base + s · V_lr B_roleᵀ`` per row: ``v_base (B, H_kv, L, D)``, ``v_lr (B, L, r)``."""
    b, h_kv, length, d = v_base.shape
    out = v_base.double().clone()
    for bi in range(b):
        up = v_lr[bi].double() @ lora_b[int(roles[bi])].double().T  # (L, H_kv·D)
        out[bi] += scaling * up.view(length, h_kv, d).transpose(0, 1)
    return out


def make_pool(decomposed: bool, dtype=torch.float64, seed: int = 0) -> StaticCachePool:
    """A pool with 3 K/V slots, 4 V_lr slots and hidden states at layer 1, filled with noise."""
    layout = PoolLayout(
        n_layers=2,
        n_kv_heads=H_KV,
        head_dim=D,
        kv_slots=3,
        lr_slots=4 if decomposed else 0,
        rank=R if decomposed else 0,
        hidden_layers=(1,),
        hidden_slots=2,
        hidden_size=5,
    )
    pool = StaticCachePool(layout, CAP, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in [*pool.k, *pool.v, *(pool.v_lr or []), *pool.hidden.values()]:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype))
    return pool


def snapshot(pool):
    return [t.clone() for t in [*pool.k, *pool.v, *(pool.v_lr or []), *pool.hidden.values()]]


def changed(pool, before) -> list[tuple[int, ...]]:
    """(tensor index, nonzero index...) of every element that differs from the snapshot."""
    now = [*pool.k, *pool.v, *(pool.v_lr or []), *pool.hidden.values()]
    out = []
    for i, (a, b) in enumerate(zip(now, before, strict=True)):
        out += [(i, *map(int, idx)) for idx in (a != b).nonzero()]
    return out


def rand(*shape, seed=1, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ---- PrefillView --------------------------------------------------------------------------------------------------
def test_prefill_store_writes_only_its_slots_and_positions():
    pool = make_pool(True)
    view = PrefillView(pool, kv_slot=2, lr_slot=1, hidden_slot=1, start=3, length=4)
    assert (view.start, view.end, view.kv_slot, view.lr_slot, view.hidden_slot) == (3, 7, 2, 1, 1)
    before = snapshot(pool)
    k, v, v_lr = rand(1, H_KV, 4, D, seed=2), rand(1, H_KV, 4, D, seed=3), rand(1, 4, R, seed=4)
    view.store(1, k, v, v_lr)
    assert torch.equal(pool.k[1][2, :, 3:7], k[0]) and torch.equal(pool.v[1][2, :, 3:7], v[0])
    assert torch.equal(pool.v_lr[1][1, 3:7], v_lr[0])
    # tensors: k0 k1 v0 v1 lr0 lr1 hidden1
    touched = {(i, s) for i, s, *_ in changed(pool, before)}
    assert touched == {(1, 2), (3, 2), (5, 1)}
    pos = {c[-2] if i < 4 else c[-1] for i, *c in changed(pool, before) if i != 5}
    assert {p for i, *c in changed(pool, before) for p in [c[2] if i < 4 else c[1]]} == {3, 4, 5, 6}, pos
    before = snapshot(pool)
    view.store(0, k, v, None)  # a plain store leaves V_lr alone
    assert {(i, s) for i, s, *_ in changed(pool, before)} == {(0, 2), (2, 2)}
    before = snapshot(pool)
    view.store_lr(0, v_lr * 2)
    assert torch.equal(pool.v_lr[0][1, 3:7], 2 * v_lr[0])
    assert {(i, s, p) for i, s, p, *_ in changed(pool, before)} == {(4, 1, p) for p in range(3, 7)}


def test_prefill_capture_keeps_hidden_states_only_where_asked():
    pool = make_pool(False)
    h = rand(1, 4, 5, seed=5)
    before = snapshot(pool)
    PrefillView(pool, 0, 0, 1, 2, 4).capture(0, h)  # layer 0 keeps nothing
    PrefillView(pool, 0, 0, None, 2, 4).capture(1, h)  # no hidden slot: nothing
    assert changed(pool, before) == []
    PrefillView(pool, 0, 0, 1, 2, 4).capture(1, h)
    assert torch.equal(pool.hidden[1][1, 2:6], h[0])
    assert {(s, p) for _, s, p, _ in changed(pool, before)} == {(1, p) for p in range(2, 6)}


def test_prefill_capacity_is_a_one_line_error():
    pool = make_pool(False)
    assert PrefillView(pool, 0, 0, None, 8, 4).end == CAP
    with pytest.raises(ValueError, match="^positions up to 13 exceed the cache capacity 12$"):
        PrefillView(pool, 0, 0, None, 9, 4)


@pytest.mark.parametrize("decomposed", [False, True])
@settings(max_examples=8)
@given(start=st.integers(0, 6), length=st.integers(1, 5), role=st.integers(0, N_ROLES - 1))
def test_prefill_attends_causally_over_its_slot_from_position_zero(decomposed, start, length, role):
    pool = make_pool(decomposed, seed=start)
    view = PrefillView(pool, kv_slot=1, lr_slot=3, hidden_slot=None, start=start, length=length)
    q = rand(1, H_Q, length, D, seed=7 + length)
    lora_b, scaling = rand(N_ROLES, H_KV * D, R, seed=8), 0.7
    end = start + length
    k, v = pool.k[1][1:2, :, :end], pool.v[1][1:2, :, :end]
    if decomposed:
        v = expand_v(v, pool.v_lr[1][3:4, :end], lora_b, scaling, [role])
    visible = torch.arange(end)[None, :] <= (start + torch.arange(length))[:, None]
    want = naive_attention(q, k, v, visible[None])
    got = view.attend(1, q, lora_b if decomposed else None, scaling, torch.tensor([role]))
    assert torch.allclose(got, want, atol=1e-10)


def test_prefill_sub_view_keeps_slots_and_flags():
    pool = make_pool(True)
    view = PrefillView(pool, 2, 3, 1, 2, 6, use_kernel=False, fused=True)
    sub = view.sub(1, 3)
    assert (sub.start, sub.end, sub.kv_slot, sub.lr_slot, sub.hidden_slot) == (3, 6, 2, 3, 1)
    assert (sub.use_kernel, sub.fused, sub.pool) == (False, True, pool)
    assert view.sub(0, 2).fused is True and PrefillView(pool, 2, 3, 1, 2, 6).sub(4, 2).fused is False
    assert PrefillView(pool, 2, 3, 1, 2, 6, use_kernel=True).sub(4, 2).use_kernel is True


def test_fused_only_when_asked_or_on_a_cuda_half_pool():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        pool = make_pool(True, dtype=dtype)
        assert PrefillView(pool, 0, 0, None, 0, 2).fused is False
        assert PrefillView(pool, 0, 0, None, 0, 2, use_kernel=False, fused=True).fused is True
        assert PrefillView(pool, 0, 0, None, 0, 2, fused=False).fused is False
        pos = torch.tensor([0, 1])
        dv = DecodeView(pool, pos, pos, pos, pos)
        assert dv.kernel is None and dv.fused is False and dv.folds_q_lora is False
        assert DecodeView(pool, pos, pos, pos, pos, fused=True).folds_q_lora is True
    assert PrefillView(make_pool(False), 0, 0, None, 0, 2).decomposed is False
    assert PrefillView(make_pool(True), 0, 0, None, 0, 2).decomposed is True


def _rope_inputs(b, t, decomposed, seed=11):
    q = rand(b, t, H_Q, D, seed=seed, dtype=torch.float32)
    k = rand(b, t, H_KV, D, seed=seed + 1, dtype=torch.float32)
    v = rand(b, t, H_KV, D, seed=seed + 2, dtype=torch.float32)
    v_lr = rand(b, t, R, seed=seed + 3, dtype=torch.float32) if decomposed else None
    ang = rand(b, t, D, seed=seed + 4, dtype=torch.float32)
    return q, k, v, v_lr, ang.cos(), ang.sin()


@pytest.mark.parametrize("decomposed", [False, True])
def test_prefill_fused_rope_store_equals_the_pytorch_path(decomposed):
    outs = []
    for fused in (False, True):
        pool = make_pool(decomposed, dtype=torch.float32)
        view = PrefillView(pool, kv_slot=2, lr_slot=1, hidden_slot=None, start=5, length=3, fused=fused)
        q_out = view.rope_store(1, *_rope_inputs(1, 3, decomposed))
        outs.append((q_out, snapshot(pool)))
    (qa, pa), (qb, pb) = outs
    assert qa.shape == qb.shape == (1, H_Q, 3, D)
    assert torch.allclose(qa, qb, atol=1e-5)
    for a, b in zip(pa, pb, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.equal(pa[1], make_pool(decomposed, dtype=torch.float32).k[1])


def test_prefill_fused_by_default_exactly_on_a_cuda_half_pool():
    """The rule on a CUDA pool (a stand-in: only ``device`` and ``dtype`` are read): fused for float16/bfloat16."""
    for dtype, want in [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False)]:
        pool = SimpleNamespace(
            capacity=CAP, layout=SimpleNamespace(decomposed=True), device=torch.device("cuda"), dtype=dtype
        )
        view = PrefillView(pool, 0, 0, None, 0, 2)
        assert view.use_kernel is True and view.fused is want, dtype
        assert PrefillView(pool, 0, 0, None, 0, 2, use_kernel=False).fused is False
    assert PrefillView(make_pool(True), 0, 0, None, 0, 2).use_kernel is True


def test_prefill_rope_store_dispatches_on_fused_and_indexes_on_the_queries_device(monkeypatch):
    calls = []
    monkeypatch.setattr(cv, "rope_store_unfused", lambda view, *a: calls.append(("unfused", view)) or "unfused")

    def fake(q, k, v, v_lr, cos, sin, k_pool, v_pool, lr_pool, kv_slot, lr_slot, pos):
        calls.append(("fused", pos, kv_slot, lr_slot))
        return q

    monkeypatch.setattr(fused_ops, "rope_store", fake)
    pool = make_pool(True, dtype=torch.float32)
    plain = PrefillView(pool, kv_slot=2, lr_slot=1, hidden_slot=None, start=5, length=3, fused=False)
    assert plain.rope_store(1, *_rope_inputs(1, 3, True)) == "unfused" and calls == [("unfused", plain)]
    calls.clear()
    view = PrefillView(pool, kv_slot=2, lr_slot=1, hidden_slot=None, start=5, length=3, fused=True)
    view.rope_store(1, *_rope_inputs(1, 3, True))
    ((_, pos, kv_slot, lr_slot),) = calls
    assert pos.tolist() == [5, 6, 7] and kv_slot.tolist() == [2, 2, 2] and lr_slot.tolist() == [1, 1, 1]
    assert kv_slot.dtype == lr_slot.dtype == torch.long
    calls.clear()  # index tensors follow the queries' device (meta here, CUDA in use)
    q, k, v, v_lr, cos, sin = (x.to("meta") for x in _rope_inputs(1, 3, True))
    view.rope_store(1, q, k, v, v_lr, cos, sin)
    assert all(t.device.type == "meta" for t in calls[0][1:])


@pytest.mark.parametrize("use_kernel", [False, True])
def test_prefill_and_growable_views_pass_use_kernel_on(monkeypatch, use_kernel):
    seen = []

    def fake(q, k, v, v_lr, lora_b, scaling, role_ids, key_mask=None, use_kernel="unset"):
        seen.append(use_kernel)
        return q

    monkeypatch.setattr(cv, "decomposed_attention", fake)
    q, lora_b, roles = rand(1, H_Q, 2, D), rand(N_ROLES, H_KV * D, R), torch.tensor([0])
    pool = make_pool(True)
    PrefillView(pool, 0, 0, None, 0, 2, use_kernel=use_kernel).attend(0, q, lora_b, 0.5, roles)
    caches = ModelCache(1, decomposed=True)
    GrowableView(caches, 0).store(0, rand(1, H_KV, 2, D), rand(1, H_KV, 2, D), rand(1, 2, R))
    GrowableView(caches, 0, use_kernel=use_kernel).attend(0, q, lora_b, 0.5, roles)
    assert seen == [use_kernel, use_kernel]
    seen.clear()
    PrefillView(pool, 0, 0, None, 0, 2).attend(0, q, lora_b, 0.5, roles)
    view = GrowableView(caches, 0)
    view.attend(0, q, lora_b, 0.5, roles)
    assert seen == [True, True] and view.use_kernel is True


# ---- DecodeView ---------------------------------------------------------------------------------------------------
KV_SLOT, LR_SLOT, POS, ROLES = [2, 0, 3], [1, 3, 4], [5, 0, 2], [2, 0, 1]


def _decode_view(pool, max_len=None, fused=None):
    t = torch.tensor
    return DecodeView(pool, t(KV_SLOT), t(LR_SLOT), t([1, 0, 2]), t(POS), max_len=max_len, fused=fused)


def test_decode_lengths_and_bounds():
    pool = make_pool(True)
    view = _decode_view(pool)
    assert view.kv_lens.tolist() == [6, 1, 3] and view.max_len == CAP
    assert _decode_view(pool, max_len=7).max_len == 7
    assert _decode_view(pool, max_len=99).max_len == CAP
    assert view.decomposed is True and _decode_view(make_pool(False)).decomposed is False


def test_decode_store_writes_each_row_at_its_own_slot_and_position():
    pool = make_pool(True)
    view = _decode_view(pool)
    before = snapshot(pool)
    k, v, v_lr = rand(3, H_KV, 1, D, seed=2), rand(3, H_KV, 1, D, seed=3), rand(3, 1, R, seed=4)
    view.store(1, k, v, v_lr)
    for b in range(3):
        assert torch.equal(pool.k[1][KV_SLOT[b], :, POS[b]], k[b, :, 0])
        assert torch.equal(pool.v[1][KV_SLOT[b], :, POS[b]], v[b, :, 0])
        assert torch.equal(pool.v_lr[1][LR_SLOT[b], POS[b]], v_lr[b, 0])
    kv = {(i, s, p) for i, s, _, p, _ in (c for c in changed(pool, before) if c[0] < 4)}
    assert kv == {(i, s, p) for i in (1, 3) for s, p in zip(KV_SLOT, POS, strict=True)}
    lr = {(i, s, p) for i, s, p, _ in (c for c in changed(pool, before) if c[0] >= 4)}
    assert lr == {(5, s, p) for s, p in zip(LR_SLOT, POS, strict=True)}
    before = snapshot(pool)
    view.store(0, k, v, None)
    assert {c[0] for c in changed(pool, before)} == {0, 2}
    before = snapshot(pool)
    view.store_lr(0, 3 * v_lr)
    assert {(i, s, p) for i, s, p, _ in changed(pool, before)} == {(4, s, p) for s, p in zip(LR_SLOT, POS, strict=True)}


def test_decode_capture_writes_hidden_states_of_kept_layers_only():
    pool = make_pool(False)
    view = _decode_view(pool)
    h = rand(3, 1, 5, seed=9)
    before = snapshot(pool)
    view.capture(0, h)
    assert changed(pool, before) == []
    view.capture(1, h)
    for b, slot in enumerate([1, 0, 2]):
        assert torch.equal(pool.hidden[1][slot, POS[b]], h[b, 0])
    assert len({(s, p) for _, s, p, _ in changed(pool, before)}) == 3


@pytest.mark.parametrize("decomposed", [False, True])
@pytest.mark.parametrize("max_len", [None, 6, 9])
def test_decode_rows_attend_over_their_own_first_pos_plus_one_positions(decomposed, max_len):
    pool = make_pool(decomposed, seed=3)
    view = _decode_view(pool, max_len=max_len)
    q = rand(3, H_Q, 1, D, seed=12)
    lora_b, scaling = rand(N_ROLES, H_KV * D, R, seed=13), 1.3
    k = torch.stack([pool.k[0][s] for s in KV_SLOT])
    v = torch.stack([pool.v[0][s] for s in KV_SLOT])
    if decomposed:
        v = expand_v(v, torch.stack([pool.v_lr[0][s] for s in LR_SLOT]), lora_b, scaling, ROLES)
    visible = (torch.arange(CAP)[None, :] <= torch.tensor(POS)[:, None])[:, None]
    want = naive_attention(q, k, v, visible)
    got = view.attend(0, q, lora_b if decomposed else None, scaling, torch.tensor(ROLES))
    assert got.shape == (3, H_Q, 1, D)
    assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize("decomposed", [False, True])
def test_decode_token_groups_run_the_fed_rows_as_groups_and_keep_every_real_rows_attention(decomposed):
    """``token_groups=(1, 2)``: row 0 one call of the kernel on its own; rows 1-4 a second call in groups of 2 (rows
    1-2 two tokens of slot 2 at positions 3 and 4, rows 3-4 a token of slot 1 and a padding row in the scratch slot).
    Every row that is not padding attends as without groups: over its own slot up to its own position."""
    from kernels.flash_lora_decode import flash_lora_decode

    pool = make_pool(decomposed, seed=4)
    t = torch.tensor
    kv_slot, lr_slot, pos, roles = t([0, 2, 2, 1, 0]), t([3, 1, 1, 2, 0]), t([6, 3, 4, 8, 0]), t([1, 2, 2, 0, 1])
    calls = []

    def kernel(q, *args, **kw):
        calls.append((q.shape[0], kw.get("group_rows", 1), kw["kv_slot"].tolist()))
        return flash_lora_decode(q, *args, **kw)  # on the CPU: its torch path, groups and all

    views = []
    for groups in (None, (1, 2)):
        view = DecodeView(pool, kv_slot, lr_slot, t([0, 1, 1, 0, 1]), pos, token_groups=groups)
        view.kernel, view.kv_lens32, view.kv_slot32, view.lr_slot32 = kernel, view.kv_lens, kv_slot, lr_slot
        views.append(view)
    q = rand(5, H_Q, 1, D, seed=14)
    lora_b = rand(N_ROLES, H_KV * D, R, seed=15) if decomposed else None
    plain, grouped = (view.attend(1, q, lora_b, 0.7, roles) for view in views)
    assert calls == [(5, 1, [0, 2, 2, 1, 0]), (1, 1, [0]), (4, 2, [2, 2, 1, 0])]
    assert grouped.shape == (5, H_Q, 1, D)
    torch.testing.assert_close(grouped[:4], plain[:4], rtol=0, atol=1e-12)
    assert (grouped[4] - plain[4]).abs().max() > 1e-3  # the padding row read its group's slot (output unused)
    # a float32 term added to the queries (q_proj's rotated LoRA term) reaches both calls: the same as added first;
    # the torch path (no kernel) adds it itself
    q_add = rand(5, H_Q, D, seed=16, dtype=torch.float32)
    added = views[0].attend(1, (q[:, :, 0].float() + q_add).to(q.dtype)[:, :, None], lora_b, 0.7, roles)
    torch.testing.assert_close(views[1].attend(1, q, lora_b, 0.7, roles, q_add=q_add)[:4], added[:4], rtol=0, atol=1e-6)
    torch.testing.assert_close(views[0].attend(1, q, lora_b, 0.7, roles, q_add=q_add), added, rtol=0, atol=1e-6)
    eager = DecodeView(pool, kv_slot, lr_slot, t([0, 1, 1, 0, 1]), pos)
    torch.testing.assert_close(eager.attend(1, q, lora_b, 0.7, roles, q_add=q_add), added, rtol=0, atol=1e-6)
    assert (added - plain).abs().max() > 1e-3
    if not decomposed:  # a plain cache needs no roles: none given is the same
        torch.testing.assert_close(views[1].attend(1, q, None, 0.7, None)[:4], grouped[:4], rtol=0, atol=0)
    assert DecodeView(pool, kv_slot, lr_slot, kv_slot, pos, token_groups=(1, 1)).token_groups is None


def test_decode_view_takes_the_fused_launch_switches_only_when_fused(monkeypatch):
    """A fused view reads the fused GEMV rows (``LRAGENT_FUSED_GEMV``, default 1), then, where those are on, the
    one-launch q/k/v switch (``LRAGENT_QKV_ROPE``, default 1) and, where that is on, its register cap
    (``LRAGENT_QKV_MAXNREG``, default 80); an unfused view runs none of them (all 0)."""
    for name in ("LRAGENT_FUSED_GEMV", "LRAGENT_QKV_ROPE", "LRAGENT_QKV_MAXNREG"):
        monkeypatch.delenv(name, raising=False)
    pool, pos = make_pool(True), torch.tensor([0, 1])

    def switches(**kw):
        view = DecodeView(pool, pos, pos, pos, pos, **kw)
        return view.norm_gemv_rows, view.qkv_rope, view.qkv_maxnreg

    assert switches(fused=True) == (1, 1, 80) and switches(fused=False) == (0, 0, 0) and switches() == (0, 0, 0)
    monkeypatch.setenv("LRAGENT_QKV_MAXNREG", "96")
    assert switches(fused=True) == (1, 1, 96)
    monkeypatch.setenv("LRAGENT_QKV_ROPE", "0")
    assert switches(fused=True) == (1, 0, 0)
    monkeypatch.setenv("LRAGENT_QKV_ROPE", "1")
    monkeypatch.setenv("LRAGENT_FUSED_GEMV", "0")
    assert switches(fused=True) == (0, 0, 0)


@pytest.mark.parametrize("decomposed", [False, True])
def test_decode_qkv_rope_store_hands_the_launch_its_layers_pools_and_the_rows_slots(monkeypatch, decomposed):
    """The one-launch q/k/v step (:func:`kernels.fused_qkv_rope.qkv_rope_store`, a GPU kernel) gets the layer's K and
    V pools, its V_lr pool and no v_lora for a decomposed cache (v_lora and no V_lr pool for a full one), the rows'
    slots and positions, cos/sin in h's dtype and the view's register cap; its queries come back with a T axis."""
    import kernels.fused_qkv_rope as fqr

    seen = {}

    def launch(h, norm_w, eps, weight, hq, hkv, d, cos, sin, k_pool, v_pool, lr_pool, kv_slot, lr_slot, pos,
               v_a_row, q_lora, maxnreg=0, v_lora=None):  # fmt: skip
        seen.update(locals())
        return torch.ones(1, hq, d, dtype=h.dtype), "q_add"

    monkeypatch.setattr(fqr, "qkv_rope_store", launch)
    monkeypatch.setenv("LRAGENT_QKV_MAXNREG", "112")
    pool = make_pool(decomposed, dtype=torch.float16)
    t = torch.tensor
    view = DecodeView(pool, t([2]), t([3]), t([1]), t([5]), fused=True)
    h, w, nw = rand(1, 1, 5, dtype=torch.float16), rand(8, 5), rand(5)
    rotary = (rand(1, 1, D, seed=3), rand(1, 1, D, seed=4))  # float64: the view casts them to h's dtype
    q, q_add = view.qkv_rope_store(1, h, nw, 1e-5, w, (H_Q, H_KV, D), rotary, 7, "q_lora", v_lora="v_lora")
    assert q.shape == (1, H_Q, 1, D) and q_add == "q_add"
    assert seen["k_pool"] is pool.k[1] and seen["v_pool"] is pool.v[1]
    assert (seen["hq"], seen["hkv"], seen["d"]) == (H_Q, H_KV, D)
    assert seen["lr_pool"] is (pool.v_lr[1] if decomposed else None)
    assert seen["v_lora"] == (None if decomposed else "v_lora") and seen["q_lora"] == "q_lora"
    assert (seen["kv_slot"].tolist(), seen["lr_slot"].tolist(), seen["pos"].tolist()) == ([2], [3], [5])
    assert seen["cos"].dtype == seen["sin"].dtype == torch.float16 and torch.equal(seen["cos"], rotary[0].half())
    assert torch.equal(seen["sin"], rotary[1].half())
    assert seen["h"] is h and seen["norm_w"] is nw and seen["weight"] is w
    assert (seen["eps"], seen["v_a_row"]) == (1e-5, 7)
    assert seen["maxnreg"] == 112


def test_decode_attention_reference_masks_each_row_and_applies_its_role():
    """One query per row, GQA, lengths 1..L, each row's own B."""
    b, length = 4, 7
    q, k, v = rand(b, H_Q, D, seed=20), rand(b, H_KV, length, D, seed=21), rand(b, H_KV, length, D, seed=22)
    v_lr, lora_b = rand(b, length, R, seed=23), rand(N_ROLES, H_KV * D, R, seed=24)
    lens, roles = torch.tensor([1, 7, 3, 5]), torch.tensor([1, 2, 0, 1])
    visible = (torch.arange(length)[None, :] < lens[:, None])[:, None]
    plain = decode_attention_reference(q, k, v, lens)
    assert torch.allclose(plain, naive_attention(q[:, :, None], k, v, visible)[:, :, 0], atol=1e-10)
    full = expand_v(v, v_lr, lora_b, 0.5, roles)
    dec = decode_attention_reference(q, k, v, lens, v_lr, lora_b, 0.5, roles)
    assert torch.allclose(dec, naive_attention(q[:, :, None], k, full, visible)[:, :, 0], atol=1e-10)
    # scaling defaults to 1
    dec1 = decode_attention_reference(q, k, v, lens, v_lr, lora_b, role_ids=roles)
    assert torch.allclose(
        dec1, naive_attention(q[:, :, None], k, expand_v(v, v_lr, lora_b, 1.0, roles), visible)[:, :, 0]
    )
    # one KV head per query head (no grouping)
    q1 = rand(b, H_KV, D, seed=25)
    got = decode_attention_reference(q1, k, v, lens)
    assert torch.allclose(got, naive_attention(q1[:, :, None], k, v, visible)[:, :, 0], atol=1e-10)


def test_decode_attention_reference_runs_on_the_queries_device_and_casts_adapters():
    """Any device (meta here: shapes only), and B in another dtype than the cache (float32 adapters, float64 cache)."""
    b, length = 3, 6
    q, k, v = rand(b, H_Q, D, seed=26), rand(b, H_KV, length, D, seed=27), rand(b, H_KV, length, D, seed=28)
    v_lr, lora_b = rand(b, length, R, seed=29), rand(N_ROLES, H_KV * D, R, seed=30, dtype=torch.float32)
    lens, roles = torch.tensor([2, 6, 4]), torch.tensor([2, 0, 1])
    meta = [x.to("meta") for x in (q, k, v, lens, v_lr, lora_b, roles)]
    assert decode_attention_reference(*meta[:4]).shape == (b, H_Q, D)
    assert decode_attention_reference(*meta[:4], meta[4], meta[5], 0.5, meta[6]).shape == (b, H_Q, D)
    visible = (torch.arange(length)[None, :] < lens[:, None])[:, None]
    got = decode_attention_reference(q, k, v, lens, v_lr, lora_b, 0.5, roles)
    assert got.dtype == torch.float64
    want = naive_attention(q[:, :, None], k, expand_v(v, v_lr, lora_b, 0.5, roles), visible)[:, :, 0]
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("decomposed", [False, True])
def test_decode_reads_no_position_past_max_len(decomposed):
    """Eager decoding reads only ``max_len`` positions: NaN past them (in every slot) cannot reach the output."""
    pool = make_pool(decomposed, seed=4)
    n = max(POS) + 1
    for t in [*pool.k, *pool.v]:
        t[:, :, n:] = float("nan")
    for t in pool.v_lr or []:
        t[:, n:] = float("nan")
    q = rand(3, H_Q, 1, D, seed=14)
    lora_b, scaling = rand(N_ROLES, H_KV * D, R, seed=15), 0.8
    got = _decode_view(pool, max_len=n).attend(1, q, lora_b if decomposed else None, scaling, torch.tensor(ROLES))
    k = torch.stack([pool.k[1][s, :, :n] for s in KV_SLOT])
    v = torch.stack([pool.v[1][s, :, :n] for s in KV_SLOT])
    if decomposed:
        v = expand_v(v, torch.stack([pool.v_lr[1][s, :n] for s in LR_SLOT]), lora_b, scaling, ROLES)
    visible = (torch.arange(n)[None, :] <= torch.tensor(POS)[:, None])[:, None]
    assert torch.allclose(got, naive_attention(q, k, v, visible), atol=1e-10)


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA: lets the fused decode dispatch run here, with a stand-in kernel."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("decomposed", [False, True])
def test_decode_kernel_dispatch_passes_the_pool_lengths_and_slots(monkeypatch, decomposed):
    """On a (stand-in) CUDA half pool the view calls the fused decode kernel, once per layer, with the whole pools,
    int32 lengths and slots, B per KV head, the scaling and the roles; the kernel here is its PyTorch reference,
    so the result must be the naive attention. A float32 pool, or ``use_kernel=False``, never calls it."""
    calls = []

    def kernel(q, k_cache, v_cache, kv_lens, *args, **kw):
        calls.append((kv_lens, kw.get("kv_slot"), kw.get("lr_slot")))
        return fld.flash_lora_decode_reference(q, k_cache, v_cache, kv_lens, *args, **kw)

    monkeypatch.setattr(cv, "_fused_decode", lambda: kernel)
    t = torch.tensor
    lr_slots = LR_SLOT if decomposed else KV_SLOT  # a plain pool has no V_lr slots
    pos = t(POS).as_subclass(_CudaLike)
    assert pos.is_cuda and (pos + 1).is_cuda
    for dtype, use_kernel in [(torch.float32, True), (torch.float16, False)]:
        pool = make_pool(decomposed, dtype=dtype)
        view = DecodeView(pool, t(KV_SLOT), t(lr_slots), t([1, 0, 2]), pos, use_kernel=use_kernel)
        assert view.kernel is None and view.fused is False and not hasattr(view, "kv_lens32")
    pool = make_pool(decomposed, dtype=torch.float16, seed=5)
    view = DecodeView(pool, t(KV_SLOT), t(lr_slots), t([1, 0, 2]), pos)
    assert view.kernel is kernel and view.fused is True
    q = rand(3, H_Q, 1, D, seed=16, dtype=torch.float16)
    lora_b, scaling = rand(N_ROLES, H_KV * D, R, seed=17, dtype=torch.float16), 1.3
    got = view.attend(1, q, lora_b if decomposed else None, scaling, t(ROLES))
    ((kv_lens, kv_slot, lr_slot),) = calls
    assert kv_lens.dtype == kv_slot.dtype == lr_slot.dtype == torch.int32
    assert kv_lens.tolist() == [p + 1 for p in POS] and kv_slot.tolist() == KV_SLOT and lr_slot.tolist() == lr_slots
    k = torch.stack([pool.k[1][s] for s in KV_SLOT])
    v = torch.stack([pool.v[1][s] for s in KV_SLOT])
    if decomposed:
        v = expand_v(v, torch.stack([pool.v_lr[1][s] for s in LR_SLOT]), lora_b, scaling, ROLES)
    visible = (torch.arange(CAP)[None, :] <= torch.tensor(POS)[:, None])[:, None]
    assert got.shape == (3, H_Q, 1, D) and got.dtype == torch.float16
    assert torch.allclose(got.double(), naive_attention(q, k, v, visible), atol=1e-2)


def test_decode_unfused_rope_store_refuses_q_lora():
    pool = make_pool(True, dtype=torch.float32)
    q, k, v, v_lr, cos, sin = _rope_inputs(3, 1, True)
    with pytest.raises(ValueError, match="^q_lora needs a fused view$"):
        _decode_view(pool).rope_store(0, q, k, v, v_lr, cos, sin, q_lora=(v_lr, None, 1.0, None))


@pytest.mark.parametrize("decomposed", [False, True])
def test_decode_fused_rope_store_equals_the_pytorch_path(decomposed):
    q, k, v, v_lr, cos, sin = _rope_inputs(3, 1, decomposed, seed=30)
    lr_q = rand(3, 1, R, seed=40, dtype=torch.float32)
    b_q = rand(N_ROLES, H_Q * D, R, seed=41, dtype=torch.float32)
    roles, s = torch.tensor(ROLES), 0.6
    outs = []
    for fused in (False, True):
        pool = make_pool(decomposed, dtype=torch.float32)
        view = _decode_view(pool, fused=fused)
        q_out = view.rope_store(1, q, k, v, v_lr, cos, sin)
        if fused:
            q_lora = view.rope_store(1, q, k, v, v_lr, cos, sin, q_lora=(lr_q, b_q, s, roles))
        else:  # the LoRA term added to the queries by hand
            up = torch.stack([lr_q[b, 0] @ b_q[int(roles[b])].T for b in range(3)]).view(3, 1, H_Q, D)
            q_lora = view.rope_store(1, q + s * up, k, v, v_lr, cos, sin)
        outs.append((q_out, q_lora, snapshot(pool)))
    (qa, la, pa), (qb, lb, pb) = outs
    assert qa.shape == qb.shape == (3, H_Q, 1, D)
    assert torch.allclose(qa, qb, atol=1e-5) and torch.allclose(la, lb, atol=1e-5)
    assert not torch.allclose(la, qa, atol=1e-3)
    for a, b in zip(pa, pb, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


# ---- GrowableView -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decomposed", [False, True])
def test_growable_view_appends_and_attends_with_a_padding_mask(decomposed):
    caches = ModelCache(2, decomposed=decomposed)
    b, roles, lora_b, s = 2, torch.tensor([2, 0]), rand(N_ROLES, H_KV * D, R, seed=50), 0.9
    ks, vs, lrs = [], [], []
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    for start, t in [(0, 4), (4, 3)]:
        view = GrowableView(caches, start, key_mask=mask if start else None)
        assert view.decomposed is decomposed
        k, v, lr = rand(b, H_KV, t, D, seed=51 + t), rand(b, H_KV, t, D, seed=61 + t), rand(b, t, R, seed=71 + t)
        view.store(1, k, v, lr if decomposed else None)
        ks.append(k), vs.append(v), lrs.append(lr)
        q = rand(b, H_Q, t, D, seed=81 + t)
        got = view.attend(1, q, lora_b if decomposed else None, s, roles)
        end = start + t
        kk, vv = torch.cat(ks, 2), torch.cat(vs, 2)
        if decomposed:
            vv = expand_v(vv, torch.cat(lrs, 1), lora_b, s, roles)
        visible = torch.arange(end)[None, :] <= (start + torch.arange(t))[:, None]
        visible = visible[None].expand(b, -1, -1) & (mask[:, None, :end].bool() if start else True)
        visible = visible | (torch.arange(end)[None, :] == (start + torch.arange(t))[:, None])  # padding sees itself
        assert torch.allclose(got, naive_attention(q, kk, vv, visible), atol=1e-10), start
    assert caches[1].length == 7 and caches[0].length == 0
    if decomposed:
        GrowableView(caches, 2).store_lr(1, torch.zeros(b, 3, R, dtype=torch.float64))
        assert caches[1].v_lr.view(7)[:, 2:5].abs().sum() == 0 and caches[1].v_lr.view(7)[:, :2].abs().sum() > 0


def test_growable_view_captures_only_its_layers_detached():
    buf = ModelCache(1)[0].k.__class__(1)
    view = GrowableView(ModelCache(3), 0, capture={2: buf})
    h = rand(1, 4, 5, seed=90).requires_grad_()
    view.capture(0, h)
    assert buf.length == 0
    view.capture(2, h * 2)
    assert buf.length == 4 and torch.equal(buf.view(), 2 * h.detach()) and not buf.view().requires_grad
    assert GrowableView(ModelCache(1), 0).capture_buffers == {}


@pytest.mark.parametrize(("decomposed", "split", "start", "masked", "two_piece"), [
    (True, True, 0, False, True),
    (False, True, 0, False, False),
    (True, False, 0, False, False),
    (True, True, 2, False, False),
    (True, True, 0, True, False),
])  # fmt: skip
def test_growable_shared_pass_uses_two_pieces_only_from_zero_unmasked_decomposed(
    monkeypatch, decomposed, split, start, masked, two_piece
):
    calls = []

    def fake(q, k, v, v_lr, lora_b, scaling, layout):
        calls.append((k.shape[2], v_lr.shape[1], scaling, layout))
        return q

    monkeypatch.setattr(cv, "two_piece_attention", fake)
    t = 3
    layout = RoleSplit.make(torch.tensor([0]), torch.tensor([1]), torch.tensor([1]), start + t) if split else None
    caches = ModelCache(1, decomposed=decomposed, role_split=layout)
    fill = GrowableView(caches, 0)
    fill.store(
        0, rand(1, H_KV, start + t, D), rand(1, H_KV, start + t, D), rand(1, start + t, R) if decomposed else None
    )
    mask = torch.ones(1, start + t) if masked else None
    q = rand(1, H_Q, t, D, seed=3)
    GrowableView(caches, start, key_mask=mask).attend(0, q, rand(2, H_KV * D, R), 0.25, torch.tensor([1]))
    assert len(calls) == int(two_piece)
    if two_piece:
        assert calls == [(t, t, 0.25, layout)]


@pytest.mark.parametrize(("decomposed", "split"), [(False, False), (True, False), (True, True)])
def test_growable_view_attends_only_up_to_its_end_in_a_longer_cache(decomposed, split):
    """A view at ``start`` over ``T`` queries sees ``[0, start + T)`` even where the cache already holds more (a
    checkpointed layer recomputed after later forwards appended): the same as over a cache of exactly that length.
    Also over a plain list of layer caches."""
    t, full, b = 4, 7, 1
    layout = RoleSplit.make(torch.tensor([0]), torch.tensor([2]), torch.tensor([2]), t) if split else None
    k, v, lr = rand(b, H_KV, full, D, seed=91), rand(b, H_KV, full, D, seed=92), rand(b, full, R, seed=93)
    q, lora_b, roles = rand(b, H_Q, t, D, seed=94), rand(N_ROLES, H_KV * D, R, seed=95), torch.tensor([1])
    outs = []
    for n in (full, t):
        caches = ModelCache(2, decomposed=decomposed, role_split=layout)
        GrowableView(caches, 0).store(1, k[:, :, :n], v[:, :, :n], lr[:, :n] if decomposed else None)
        outs.append(GrowableView(caches, 0).attend(1, q, lora_b if decomposed else None, 0.6, roles))
        if not split:
            layers = [caches[0], caches[1]]
            outs.append(GrowableView(layers, 0).attend(1, q, lora_b if decomposed else None, 0.6, roles))
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=1e-12)
    if not split:  # and what it sees: causal over the first T positions
        vv = expand_v(v[:, :, :t], lr[:, :t], lora_b, 0.6, roles) if decomposed else v[:, :, :t]
        visible = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        assert torch.allclose(outs[0], naive_attention(q, k[:, :, :t], vv, visible[None]), atol=1e-10)
        # and from a non-zero start (T = 3 queries at 2 over 5 of the 7 positions)
        q3, got = q[:, :, :3], []
        for n in (full, 5):
            caches = ModelCache(2, decomposed=decomposed)
            GrowableView(caches, 0).store(1, k[:, :, :n], v[:, :, :n], lr[:, :n] if decomposed else None)
            got.append(GrowableView(caches, 2).attend(1, q3, lora_b if decomposed else None, 0.6, roles))
        assert torch.allclose(got[0], got[1], atol=1e-12)


# ---- ReplayView ---------------------------------------------------------------------------------------------------
class Recorder:
    decomposed = True

    def __init__(self):
        self.calls = []

    def store(self, *a):
        self.calls.append(("store", *a))

    def store_lr(self, *a):
        self.calls.append(("store_lr", *a))

    def capture(self, *a):
        self.calls.append(("capture", *a))

    def attend(self, *a):
        self.calls.append(("attend", *a))
        return "out"


def test_replay_view_writes_once_and_attends_through():
    inner = Recorder()
    view = ReplayView(inner)
    assert view.decomposed is True and view.replay is False
    view.store(1, "k", "v", "lr")
    view.store_lr(1, "lr")
    view.capture(1, "h")
    assert view.attend(1, "q", "b", 0.5, "roles") == "out"
    assert inner.calls == [
        ("store", 1, "k", "v", "lr"),
        ("store_lr", 1, "lr"),
        ("capture", 1, "h"),
        ("attend", 1, "q", "b", 0.5, "roles"),
    ]
    inner.calls.clear()
    view.replay = True
    view.store(1, "k", "v", "lr")
    view.store_lr(1, "lr")
    view.capture(1, "h")
    assert view.attend(2, "q", "b", 0.5, "roles") == "out"
    assert inner.calls == [("attend", 2, "q", "b", 0.5, "roles")]


def test_replay_rope_store_stores_through_the_wrapped_view():
    caches = ModelCache(1, decomposed=True)
    view = ReplayView(GrowableView(caches, 0))
    q, k, v, v_lr, cos, sin = (x.double() if x is not None else x for x in _rope_inputs(1, 3, True))
    q_out = view.rope_store(0, q, k, v, v_lr, cos, sin)
    assert q_out.shape == (1, H_Q, 3, D) and caches[0].length == 3
    assert torch.equal(caches[0].v.view(), v.transpose(1, 2)) and torch.equal(caches[0].v_lr.view(), v_lr)


# ---- DESIGN.md §2 through the engine's views ----------------------------------------------------------------------
_MODELS: dict = {}


def _model(zero_b: bool):
    if zero_b not in _MODELS:
        m = tiny_multi_lora("tiny-llama", b_std=0.3)
        if zero_b:
            m.init_adapters("zero", seed=3)
        _MODELS[zero_b] = m
    return _MODELS[zero_b]


# three agents, unequal prompts, out of order (2, 0, 0, 1): (role, appended ids, new tokens)
SCHEDULE = [(2, list(range(40, 52)), 2), (0, [7, 8, 9], 1), (0, [11], 3), (1, list(range(90, 95)), 2)]


def _run(model, scheme, schedule):
    eng = Engine(model, scheme, rows=1, capacity=40, eos_token_ids=[], droidspeak_layers=[1])
    out = []
    for role, ids, n in schedule:
        eng.append(0, ids)
        out.append(eng.generate(0, GenerationRequest(role=role, max_new_tokens=n, return_logits=True)))
    return out, list(eng.ids(0))


def test_zero_b_adapters_make_every_scheme_the_base_model():
    model = _model(True)
    runs = {s: _run(model, s, SCHEDULE) for s in SCHEMES}
    ids = runs["non_shared"][1]
    for s, (_, got_ids) in runs.items():
        assert got_ids == ids, s
    with torch.no_grad():
        out = model(torch.tensor([ids]), role_ids=[0])  # B = 0: the base model, whatever the role
        full = getattr(out, "logits", out)[0]
    for s, (res, _) in runs.items():
        for r in res:
            want = full[r.logit_positions]
            assert (r.logits - want).abs().max() <= 1e-4, s


def test_one_agent_makes_every_scheme_non_shared():
    model = _model(False)
    one = [(1, ids, n) for _, ids, n in SCHEDULE]
    want, want_ids = _run(model, "non_shared", one)
    for s in SCHEMES:
        got, got_ids = _run(model, s, one)
        assert got_ids == want_ids, s
        for a, b in zip(want, got, strict=True):
            assert a.logit_positions == b.logit_positions and a.generated_ids == b.generated_ids, s
            assert (a.logits - b.logits).abs().max() <= 1e-4, s
    # and the roles matter: three agents in turn do not give one agent's trajectory
    assert _run(model, "non_shared", SCHEDULE)[1] != want_ids
