"""The decoder forward (lragent/decoder.py) on the CPU, fast: it computes what the merged-weights transformers model
computes for every role, over growable caches and static-pool views; an LR prefill, a forward over partly cached
positions (``kv_from``) and a K/V-only last layer write what the full forward writes; the fused path (fused GEMMs,
role mask, the GEMV kernels' CPU references) gives the plain path's values and takes the kernels it is meant to take;
activation checkpointing changes no value or gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_multi_lora
from torch import nn

import kernels.fused_gemv as fused_gemv
import kernels.fused_ops as fused_ops
import kernels.fused_qkv_rope as fused_qkv_rope
from lragent import decoder as decoder_mod
from lragent.cache_views import DecodeView, GrowableView, PrefillView
from lragent.fused_weights import fuse_base_weights
from lragent.kv_cache import ModelCache
from lragent.multi_lora import ALL_TARGETS, MultiLoraLinear, role_mask
from lragent.static_cache import PoolLayout, StaticCachePool

ALL = tuple(ALL_TARGETS)
TWO = {"num_hidden_layers": 2}


def _model(arch: str = "tiny-llama", targets=("q_proj", "v_proj"), **kw):
    return tiny_multi_lora(arch, b_std=0.3, targets=targets, overrides=kw.pop("overrides", TWO), **kw)


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (b, t), generator=torch.Generator().manual_seed(seed))


def _merged_logits(model, ids: torch.Tensor, roles: list[int]) -> torch.Tensor:
    return torch.cat([model.merged_model(r)(ids[i : i + 1]).logits for i, r in enumerate(roles)])


def _pool(model, decomposed: bool, slots: int = 3, capacity: int = 32) -> StaticCachePool:
    dec = model.decoder
    layout = PoolLayout(
        n_layers=dec.n_layers,
        n_kv_heads=dec.n_kv_heads,
        head_dim=dec.head_dim,
        kv_slots=slots,
        lr_slots=slots if decomposed else 0,
        rank=4 if decomposed else 0,
    )
    return StaticCachePool(layout, capacity, torch.float32, "cpu")


def _prefill(model, pool, ids, role: int, slot: int, start: int = 0, fused: bool = False, **kw) -> torch.Tensor:
    """Runs ``ids`` ``(1, T)`` at ``start`` of ``slot`` through a :class:`PrefillView`; the hidden states out."""
    dec = model.decoder
    t = ids.shape[1]
    view = PrefillView(pool, slot, slot, None, start, t, use_kernel=False, fused=fused)
    h = dec.embed(ids)
    return dec.run_view(h, dec.rotary(h, torch.arange(start, start + t)[None]), torch.tensor([role]), view, **kw)


def _prefill_rows(model, pool, ids, roles: list[int], n: int, fused: bool = False, want=None) -> None:
    """Prefills row i's first ``n`` ids (``ids`` ``(B, T)``) into slot i with role ``roles[i]``; given ``want`` (the
    merged model's logits ``(B, T, V)``), each row's prefill logits must equal its first ``n``."""
    for i, role in enumerate(roles):
        h = _prefill(model, pool, ids[i : i + 1, :n], role, slot=i, fused=fused)
        if want is not None:
            assert torch.allclose(model.decoder.logits(h, fused)[0], want[i, :n], atol=1e-4)


def _decode(model, pool, tokens: list[int], slots: list[int], pos: list[int], roles, fused: bool) -> torch.Tensor:
    """One decode step of one token per row (row i in slot ``slots[i]`` at ``pos[i]``); the logits ``(B, 1, V)``."""
    dec = model.decoder
    s, p = torch.tensor(slots), torch.tensor(pos)
    view = DecodeView(pool, s, s, s, p, max_len=max(pos) + 1, use_kernel=False, fused=fused)
    h = dec.embed(torch.tensor(tokens)[:, None])
    rid = None if roles is None else torch.tensor(roles)
    return dec.logits(dec.run_view(h, dec.rotary(h, p[:, None]), rid, view), fused)


def _fuse(model, lora: bool = True) -> None:
    fuse_base_weights(model.model, lora=lora)
    model.decoder.fuse_lora = lora


# ---- the plain forward against transformers ---------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize(
    ("arch", "targets"), [("tiny-llama", ALL), ("tiny-qwen2", ("q_proj", "v_proj")), ("tiny-mistral", ALL)]
)
def test_the_forward_equals_the_merged_model_of_each_row_role(arch, targets):
    """A batch of three rows of different roles gives each row its role's merged-weights model's logits (adapters on
    every projection, or on q and v only, where the MLP is the model's own module; Qwen2's q/k/v biases)."""
    model = _model(arch, targets)
    ids, roles = _ids(3, 6), [2, 0, 1]
    want = _merged_logits(model, ids, roles)
    got = model.decoder.forward(ids, torch.tensor(roles))
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    last = model.decoder.forward(ids, torch.tensor(roles), last_only=True)
    assert last.shape == (3, 1, 256) and torch.allclose(last, want[:, -1:], atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("decomposed", [False, True])
def test_a_forward_in_two_parts_over_growable_caches_equals_one_forward(decomposed):
    """Four tokens, then three more on the same caches (start and positions from the cache's length) give the
    whole forward's logits for the last three, plain or decomposed (V_base + V_lr) caches alike."""
    model = _model()
    ids, roles = _ids(2, 7, seed=1), torch.tensor([1, 2])
    want = _merged_logits(model, ids, [1, 2])
    caches = ModelCache(model.n_layers, decomposed=decomposed)
    model.decoder.forward(ids[:, :4], roles, caches)
    assert caches[0].length == 4
    got = model.decoder.forward(ids[:, 4:], roles, caches)
    assert caches[0].length == 7 and torch.allclose(got, want[:, 4:], atol=1e-5)


@torch.no_grad()
def test_a_one_role_model_needs_no_role_ids():
    """With one role, role_ids None is that role: the merged model's logits, plain and decomposed caches."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3, roles=("plan",), overrides=TWO)
    ids = _ids(2, 5, seed=2)
    want = _merged_logits(model, ids, [0, 0])
    assert torch.allclose(model.decoder.forward(ids, None), want, atol=1e-5)
    assert torch.allclose(model.decoder.forward(ids, None, ModelCache(2, decomposed=True)), want, atol=1e-5)


@torch.no_grad()
def test_explicit_positions_are_the_rope_positions():
    """``positions`` replaces ``start + arange(T)``: positions with a gap give the merged model's logits at those
    position ids (not those of consecutive positions)."""
    model = _model()
    ids, roles = _ids(1, 5, seed=3), torch.tensor([0])
    pos = torch.tensor([[0, 1, 2, 6, 7]])
    want = model.merged_model(0)(ids, position_ids=pos).logits
    got = model.decoder.forward(ids, roles, positions=pos)
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(
        got, model.decoder.forward(ids, roles), atol=1e-3
    )


def test_the_decoder_reads_the_sizes_of_its_config():
    """Heads, KV heads, head dim (the config's, else hidden / heads), width, vocabulary, layers; SiLU noted."""
    dec = _model().decoder
    assert (dec.n_layers, dec.n_heads, dec.n_kv_heads, dec.head_dim, dec.hidden_size, dec.vocab_size) == (
        2, 4, 2, 16, 64, 256,
    )  # fmt: skip
    assert dec._silu is True and dec.fuse_lora is False and dec.gradient_checkpointing is False
    wide = _model(overrides={**TWO, "head_dim": 32}).decoder
    assert wide.head_dim == 32
    none = _model(overrides={**TWO, "head_dim": None}).decoder
    assert none.head_dim == 16
    gelu = _model(overrides={**TWO, "hidden_act": "gelu"}).decoder
    assert gelu._silu is False


# ---- static-pool views -------------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("decomposed", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_prefill_then_decode_over_a_pool_equals_the_merged_model(decomposed, fused):
    """A prefill of six tokens into a slot and a decode step of one more, for two rows of different roles, give the
    merged model's logits, on the plain and the fused path (fused GEMMs with the adapters' A, the role mask)."""
    model = _model(targets=ALL)
    if fused:
        _fuse(model)
    ids, roles = _ids(2, 7, seed=4), [1, 2]
    want = _merged_logits(model, ids, roles)
    pool = _pool(model, decomposed)
    _prefill_rows(model, pool, ids, roles, 6, fused, want)
    got = _decode(model, pool, ids[:, 6].tolist(), [0, 1], [6, 6], roles, fused)
    assert torch.allclose(got[:, 0], want[:, 6], atol=1e-4)
    one = _decode(model, pool, ids[1:, 6].tolist(), [1], [6], roles[1:], fused)  # one row: the norm GEMVs
    assert torch.allclose(one[:, 0], want[1:, 6], atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_an_lr_prefill_writes_the_v_lr_a_full_forward_writes_and_leaves_k_and_v(fused):
    """``write_kv=False``: role 2's LR prefill over positions role 0 wrote leaves K and V_base as they were, writes
    at layer 0 the V_lr role 2's own forward writes (K and V_base there are role-free; V_lr wiped first) and at the
    last layer the V_lr of the hidden states entering it, which it returns: those role 2's forward has after layer
    0."""
    model = _model()
    if fused:
        _fuse(model)
    ids = _ids(1, 6, seed=5)
    pool = _pool(model, True)
    _prefill(model, pool, ids, 0, slot=0, fused=fused)
    k0, v0 = [k[0].clone() for k in pool.k], [v[0].clone() for v in pool.v]
    for lr in pool.v_lr:
        lr.zero_()
    out = _prefill(model, pool, ids, 2, slot=0, fused=fused, write_kv=False)
    first = _prefill(model, pool, ids, 2, slot=1, fused=fused, layers=[0])
    for layer in range(2):
        assert torch.equal(pool.k[layer][0], k0[layer]) and torch.equal(pool.v[layer][0], v0[layer])
    assert torch.allclose(pool.v_lr[0][0, :6], pool.v_lr[0][1, :6], atol=1e-6)
    assert torch.allclose(out, first, atol=1e-6)
    last = model.model.model.layers[1]
    want = last.self_attn.v_proj.lora_input(last.input_layernorm(out), torch.tensor([2]))
    assert torch.allclose(pool.v_lr[1][0, :6], want[0], atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_a_forward_over_partly_cached_positions_equals_the_full_forward(fused):
    """``kv_from=3``: the first three positions' K and V_base are cached (V_lr wiped), the rest are written in full;
    the hidden states and every cache entry (V_lr of all six rewritten) equal the full forward over all six."""
    model = _model()
    if fused:
        _fuse(model)
    ids = _ids(1, 6, seed=6)
    pool = _pool(model, True)
    _prefill(model, pool, ids[:, :3], 1, slot=0, fused=fused)
    for lr in pool.v_lr:
        lr.zero_()
    got = _prefill(model, pool, ids, 1, slot=0, fused=fused, kv_from=3)
    want = _prefill(model, pool, ids, 1, slot=1, fused=fused)
    assert torch.allclose(got, want, atol=1e-5)
    for layer in range(2):
        assert torch.allclose(pool.k[layer][0, :, :6], pool.k[layer][1, :, :6], atol=1e-5)
        assert torch.allclose(pool.v[layer][0, :, :6], pool.v[layer][1, :, :6], atol=1e-5)
        assert torch.allclose(pool.v_lr[layer][0, :6], pool.v_lr[layer][1, :6], atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("decomposed", [False, True])
def test_a_k_v_only_last_layer_writes_the_full_layers_cache_and_returns_its_input(decomposed):
    """``kv_only_last``: the last layer writes the K and V (V_base and V_lr) the full forward writes and its input
    comes back unchanged (no queries, attention or MLP)."""
    model = _model()
    ids = _ids(1, 5, seed=7)
    pool = _pool(model, decomposed)
    got = _prefill(model, pool, ids, 1, slot=0, kv_only_last=True)
    _prefill(model, pool, ids, 1, slot=1)
    first = _prefill(model, pool, ids, 1, slot=2, layers=[0])
    assert torch.allclose(got, first, atol=1e-6)
    bufs = [pool.k, pool.v] + ([pool.v_lr] if decomposed else [])
    for buf in bufs:
        assert torch.allclose(buf[1][0], buf[1][1], atol=1e-6)
    caches = ModelCache(2, decomposed=decomposed)
    h = model.decoder.embed(ids)
    out = model.decoder.run_layers(h, torch.arange(5)[None], torch.tensor([1]), caches, 0, kv_only_last=True)
    assert caches[1].length == 5 and torch.allclose(out, first, atol=1e-6)


# ---- the fused path's choices ------------------------------------------------------------------------------------
def _spy(monkeypatch, module, name: str, calls: dict) -> None:
    real = getattr(module, name)
    calls[name] = 0

    def wrapped(*a, **k):
        calls[name] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapped)


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 2])
def test_a_fused_decode_step_takes_the_gemv_kernels_at_one_row_and_the_norm_kernels_at_two(monkeypatch, rows):
    """``LRAGENT_FUSED_GEMV=1``: a one-row step runs each norm inside the next GEMV, SiLU·mul inside the down GEMV and
    o_proj (plain) on the GEMV; a two-row step runs the norm and SiLU·mul kernels; both give the plain path's logits."""
    monkeypatch.setenv("LRAGENT_FUSED_GEMV", "1")
    calls: dict = {}
    for name in ("rms_norm_linear", "silu_mul_linear", "gemv"):
        _spy(monkeypatch, fused_gemv, name, calls)
    for name in ("rms_norm", "silu_mul"):
        _spy(monkeypatch, fused_ops, name, calls)
    model = _model()
    ids, roles = _ids(2, 5, seed=8), [1, 2]
    pool = _pool(model, True)
    for i in range(rows):
        _prefill(model, pool, ids[i : i + 1, :4], roles[i], slot=i)
    plain = _decode(model, pool, ids[:rows, 4].tolist(), list(range(rows)), [4] * rows, roles[:rows], False)
    _fuse(model)
    for k in calls:
        calls[k] = 0
    got = _decode(model, pool, ids[:rows, 4].tolist(), list(range(rows)), [4] * rows, roles[:rows], True)
    assert torch.allclose(got, plain, atol=1e-4)
    if rows == 1:  # per layer: the input norm in q/k/v, the post-attention norm in gate/up; the final norm alone
        assert calls == {"rms_norm_linear": 4, "silu_mul_linear": 2, "gemv": 2, "rms_norm": 1, "silu_mul": 0}
    else:
        assert calls == {"rms_norm_linear": 0, "silu_mul_linear": 0, "gemv": 0, "rms_norm": 5, "silu_mul": 2}


@torch.no_grad()
def test_a_wide_gate_up_gemv_the_gpu_leaves_unfused_runs_the_norm_kernel_then_silu_in_the_down_gemv(monkeypatch):
    """Where the GPU's table leaves the gate/up norm GEMV to cuBLAS, the post-attention norm runs as the norm kernel
    and the gate/up GEMM reads its output; the down GEMV still takes SiLU·mul; the logits are the same."""
    calls: dict = {}
    for name in ("rms_norm_linear", "silu_mul_linear"):
        _spy(monkeypatch, fused_gemv, name, calls)
    _spy(monkeypatch, fused_ops, "rms_norm", calls)
    widths = []
    monkeypatch.setattr(fused_gemv, "fuses_norm_gemv", lambda x, n: widths.append((x.shape, n)) or False)
    model = _model()
    ids = _ids(1, 5, seed=9)
    pool = _pool(model, True)
    _prefill(model, pool, ids[:, :4], 1, slot=0)
    plain = _decode(model, pool, ids[:, 4].tolist(), [0], [4], [1], False)
    _fuse(model)
    for k in calls:
        calls[k] = 0
    got = _decode(model, pool, ids[:, 4].tolist(), [0], [4], [1], True)
    assert torch.allclose(got, plain, atol=1e-4)
    assert widths == [((1, 1, 64), 256)] * 2  # gate + up: 2 x 128 outputs
    assert calls == {"rms_norm_linear": 2, "silu_mul_linear": 2, "rms_norm": 3}


@torch.no_grad()
def test_a_model_whose_activation_is_not_silu_uses_its_own_activation_on_the_fused_path(monkeypatch):
    """GELU: the fused path applies the model's activation (no SiLU kernel, in or out of the GEMV) and gives the
    merged model's logits."""
    calls: dict = {}
    _spy(monkeypatch, fused_gemv, "silu_mul_linear", calls)
    _spy(monkeypatch, fused_ops, "silu_mul", calls)
    model = _model(overrides={**TWO, "hidden_act": "gelu"})
    ids = _ids(1, 5, seed=10)
    want = _merged_logits(model, ids, [2])
    _fuse(model)
    pool = _pool(model, True)
    _prefill(model, pool, ids[:, :4], 2, slot=0, fused=True)
    got = _decode(model, pool, ids[:, 4].tolist(), [0], [4], [2], True)
    assert torch.allclose(got[0, 0], want[0, 4], atol=1e-4)
    assert calls == {"silu_mul_linear": 0, "silu_mul": 0}


def test_the_fused_step_and_gemv_conditions():
    """A step is fused at no more rows than the view's ``norm_gemv_rows`` (none without it); the norm GEMV needs a
    bias-free group of the input's dtype whose adapters' X·A all come from it, without dropout in training; the plain
    GEMV a bias-free ``nn.Linear`` of the input's dtype."""
    x1, x3 = torch.zeros(1, 1, 64), torch.zeros(3, 1, 64)
    v2 = SimpleNamespace(norm_gemv_rows=2)
    assert decoder_mod._fused_step(v2, x1) and decoder_mod._fused_step(v2, torch.zeros(2, 1, 64))
    assert not decoder_mod._fused_step(v2, x3) and not decoder_mod._fused_step(SimpleNamespace(), x1)
    model = _model()
    _fuse(model)
    attn, mlp = model.model.model.layers[0].self_attn, model.model.model.layers[0].mlp
    qkv, gu = attn.__dict__["_lragent_qkv"], mlp.__dict__["_lragent_gu"]
    assert decoder_mod._norm_gemv_ok(v2, qkv, x1) and decoder_mod._norm_gemv_ok(v2, gu, x1)
    assert not decoder_mod._norm_gemv_ok(v2, None, x1) and not decoder_mod._norm_gemv_ok(v2, qkv, x3)
    assert not decoder_mod._norm_gemv_ok(v2, qkv, x1.double())
    assert not decoder_mod._norm_gemv_ok(v2, SimpleNamespace(bias=torch.zeros(3), weight=qkv.weight), x1)
    partial = SimpleNamespace(bias=None, weight=qkv.weight, modules=qkv.modules, lora=qkv.lora[:1])
    assert not decoder_mod._norm_gemv_ok(v2, partial, x1)  # v_proj's X·A not in the GEMM
    attn.q_proj.train()
    assert decoder_mod._norm_gemv_ok(v2, qkv, x1)  # dropout 0: an Identity
    attn.q_proj.dropout = nn.Dropout(0.1)
    assert not decoder_mod._norm_gemv_ok(v2, qkv, x1)
    attn.q_proj.eval()
    assert decoder_mod._norm_gemv_ok(v2, qkv, x1)
    o = attn.o_proj
    assert type(o) is nn.Linear and decoder_mod._plain_gemv_ok(v2, o, x1)
    assert not decoder_mod._plain_gemv_ok(v2, o, x3) and not decoder_mod._plain_gemv_ok(v2, o, x1.double())
    assert not decoder_mod._plain_gemv_ok(v2, nn.Linear(64, 64), x1)  # a bias
    assert not decoder_mod._plain_gemv_ok(v2, attn.q_proj, x1)  # an adapter


# ---- the role mask ------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_the_role_mask_is_made_once_per_view_and_role_ids_and_only_where_the_fused_lora_path_runs():
    """role_mask_for: None without fuse_lora, on an unfused view, with autograd on or a role per token; else the
    one-hot mask of the rows' roles in the input's dtype, kept on the view for the same role_ids and dtype."""
    dec = _model().decoder
    view, h, roles = SimpleNamespace(fused=True), torch.zeros(2, 1, 64), torch.tensor([2, 0])
    assert dec.role_mask_for(view, roles, h) is None
    dec.fuse_lora = True
    assert dec.role_mask_for(SimpleNamespace(fused=False), roles, h) is None
    assert dec.role_mask_for(SimpleNamespace(), roles, h) is None
    assert dec.role_mask_for(view, torch.tensor([[2], [0]]), h) is None
    with torch.enable_grad():
        assert dec.role_mask_for(view, roles, h) is None
    mask = dec.role_mask_for(view, roles, h)()
    assert torch.equal(mask, role_mask(roles, 3, torch.float32)) and dec._n_roles == 3
    assert dec.role_mask_for(view, roles, h)() is mask
    half = dec.role_mask_for(view, roles, h.half())()
    assert half.dtype == torch.float16 and torch.equal(half.float(), mask)
    other = torch.tensor([2, 0])
    assert dec.role_mask_for(view, other, h)() is not view._lragent_role_mask[1] or view._lragent_role_mask[0] is other
    assert view._lragent_role_mask[0] is other


def test_a_model_without_adapters_has_one_role_in_the_mask():
    """No MultiLoraLinear in the model: one role; rows without role ids all get it."""
    model = _model()
    dec = decoder_mod.DecoderEngine(model.merged_model(0))
    dec.fuse_lora = True
    with torch.no_grad():
        mask = dec.role_mask_for(SimpleNamespace(fused=True), None, torch.zeros(3, 1, 64))()
    assert dec._n_roles == 1 and torch.equal(mask, torch.ones(3, 1))


# ---- the fused group forward ---------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("masked", [False, True])
def test_a_fused_group_gives_each_modules_output_and_x_a(masked):
    """One GEMM for q/k/v with the adapters' A columns: each module's output (base + its role's LoRA) and each adapted
    module's X·A, with B gathered per row or applied through the role mask; ``no_b`` leaves that module's base."""
    model = _model(targets=ALL)
    _fuse(model)
    attn = model.model.model.layers[0].self_attn
    qkv = attn.__dict__["_lragent_qkv"]
    x, roles = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([2, 1])
    mask = (lambda: role_mask(roles, 3, torch.float32)) if masked else None
    outs, lrs = decoder_mod._group_forward(qkv, x, roles, mask)
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    for out, lr, m in zip(outs, [lrs[0], lrs[1], lrs[2]], mods, strict=True):
        assert torch.allclose(out, m(x, roles), atol=1e-5)
        assert torch.allclose(lr, m.lora_input(x, roles), atol=1e-5)
    outs2, _ = decoder_mod._group_forward(qkv, x, roles, mask, no_b=(0, 2))
    assert torch.allclose(outs2[0], attn.q_proj.base(x), atol=1e-5)
    assert torch.allclose(outs2[2], attn.v_proj.base(x), atol=1e-5)
    assert torch.allclose(outs2[1], outs[1], atol=1e-6)
    outs3, lrs3 = decoder_mod._group_forward(qkv, x, roles, mask, no_b=(0, 1, 2))
    assert all(torch.allclose(o, m.base(x), atol=1e-5) for o, m in zip(outs3, mods, strict=True)) and len(lrs3) == 3


@torch.no_grad()
@pytest.mark.parametrize("masked", [False, True])
def test_a_group_without_the_adapters_a_computes_x_a_from_the_modules(masked):
    """Fused without ``lora`` (or with an adapter in training with dropout): X·A comes from the module itself and
    the outputs are the modules' own."""
    model = _model()
    _fuse(model, lora=False)
    attn = model.model.model.layers[1].self_attn
    qkv = attn.__dict__["_lragent_qkv"]
    assert qkv.lora == ()
    x, roles = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 2])
    mask = (lambda: role_mask(roles, 3, torch.float32)) if masked else None
    outs, lrs = decoder_mod._group_forward(qkv, x, roles, mask)
    assert sorted(lrs) == [0, 2]
    for i, m in enumerate([attn.q_proj, attn.k_proj, attn.v_proj]):
        assert torch.allclose(outs[i], m(x, roles) if isinstance(m, MultiLoraLinear) else m(x), atol=1e-5)
    model2 = _model()
    _fuse(model2)
    attn2 = model2.model.model.layers[0].self_attn
    group = attn2.__dict__["_lragent_qkv"]
    attn2.v_proj.train()  # training, but no dropout (an Identity): X·A still from the GEMM's own columns
    outs, lrs = decoder_mod._group_forward(group, x, roles, mask)
    assert lrs[2].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()  # k: a slice of the GEMM
    attn2.v_proj.dropout = nn.Dropout(0.5)
    attn2.v_proj.train()
    torch.manual_seed(0)
    outs, lrs = decoder_mod._group_forward(group, x, roles, mask)
    torch.manual_seed(0)
    want = attn2.v_proj.lora_input(x, roles)
    assert torch.allclose(lrs[2], want, atol=1e-6) and not torch.allclose(lrs[2], lrs[2] * 0)
    assert torch.allclose(lrs[0], attn2.q_proj.lora_input(x, roles), atol=1e-5)


@torch.no_grad()
def test_a_group_norm_gemv_equals_the_norm_then_the_gemm():
    """``normed=(h, norm)``: the GEMM takes the RMSNorm of h (x unused) and gives what the norm then the GEMM give."""
    model = _model()
    _fuse(model)
    layer = model.model.model.layers[0]
    qkv = layer.self_attn.__dict__["_lragent_qkv"]
    h, roles = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3)), torch.tensor([1])
    x = model.decoder._norm(layer.input_layernorm, h, False)
    mask = lambda: role_mask(roles, 3, torch.float32)  # noqa: E731
    want, wl = decoder_mod._group_forward(qkv, x, roles, mask)
    got, gl = decoder_mod._group_forward(qkv, None, roles, mask, normed=(h, layer.input_layernorm))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))
    assert sorted(gl) == sorted(wl) == [0, 2]


# ---- rope table, norms ---------------------------------------------------------------------------------------------
def test_the_rope_table_is_the_rotary_embedding_of_each_position_kept_for_the_last_shape():
    """cos/sin ``(capacity, D)`` equal the rotary embedding of positions 0..capacity-1; the same call returns the
    kept table; another capacity or dtype replaces it (one table kept)."""
    dec = _model().decoder
    cos, sin = dec.rope_table(8, torch.float32, torch.device("cpu"))
    want_cos, want_sin = dec.rotary(torch.zeros(1), torch.arange(8)[None])
    assert cos.shape == (8, 16) and torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert cos.is_contiguous() and sin.is_contiguous()
    assert dec.rope_table(8, torch.float32, torch.device("cpu"))[0] is cos
    c16, _ = dec.rope_table(8, torch.float16, torch.device("cpu"))
    assert c16.dtype == torch.float16 and len(dec._rope_tables) == 1
    c4, _ = dec.rope_table(4, torch.float32, torch.device("cpu"))
    assert torch.equal(c4, cos[:4]) and c4 is not cos and list(dec._rope_tables) == [(4, torch.float32, "cpu")]


@torch.no_grad()
def test_the_fused_norm_equals_the_plain_norm():
    """The final norm on the fused path (the norm kernel's reference) equals the module's; logits alike."""
    dec = _model().decoder
    h = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(dec.logits(h, True), dec.logits(h), atol=1e-5)
    assert torch.allclose(dec._norm(dec.inner.norm, h, True), dec.inner.norm(h), atol=1e-6)


# ---- the one-launch q/k/v step (its conditions; the launch itself is tested under the interpreter) ------------------
class _QkvView:
    """Records the one-launch call a view would make."""

    def __init__(self, decomposed: bool, rank: int = 4) -> None:
        self.qkv_rope, self.decomposed, self.calls = 1, decomposed, []
        self.pool = SimpleNamespace(v_lr=[torch.zeros(1, 1, rank)] * 2)

    def qkv_rope_store(self, *args):
        self.calls.append(args)
        return "launched"


def _qkv_case(targets=("q_proj", "v_proj"), lora: bool = True):
    model = _model(targets=targets)
    _fuse(model, lora=lora)
    layer = model.model.model.layers[1]
    return model, layer, layer.self_attn.__dict__["_lragent_qkv"]


@pytest.mark.parametrize("decomposed", [False, True])
def test_the_one_launch_step_passes_the_layers_weights_heads_and_adapters(monkeypatch, decomposed):
    """A one-row step of a layer with q and v adapters: the launch gets the layer's index, h, the input norm, the
    fused weight, (H_q, H_kv, D), the rotary table, v's A row and q's (A row, B, scaling, roles); v's (B, scaling,
    roles) only for a full cache (a decomposed one keeps V_lr)."""
    monkeypatch.setattr(fused_qkv_rope, "usable", lambda *a: True)
    model, layer, qkv = _qkv_case()
    view, h, rot = _QkvView(decomposed), torch.zeros(1, 1, 64), ("cos", "sin")
    assert model.decoder._qkv_rope(1, h, layer, qkv, view, None, rot) == "launched"
    (args,) = view.calls
    norm, attn = layer.input_layernorm, layer.self_attn
    assert args[0] == 1 and args[1] is h and args[2] is norm.weight and args[3] == norm.variance_epsilon
    assert args[4] is qkv.weight and args[5] == (4, 2, 16) and args[6] == rot and args[7] == qkv.a_offset(1) == 132
    a_row, b, scaling, roles = args[8]
    assert a_row == qkv.a_offset(0) == 128 and torch.equal(b, attn.q_proj.stacked_b())
    assert scaling == attn.q_proj.scaling and torch.equal(roles, torch.zeros(1, dtype=torch.long))
    assert roles.dtype == torch.long and all(type(n) is int for n in args[5])
    if decomposed:
        assert args[9] is None
    else:
        vb, vs, vr = args[9]
        assert torch.equal(vb, attn.v_proj.stacked_b()) and vs == attn.v_proj.scaling and torch.equal(vr, roles)
    view2 = _QkvView(decomposed)
    model.decoder._qkv_rope(1, h, layer, qkv, view2, torch.tensor([2]), rot)
    assert torch.equal(view2.calls[0][8][3], torch.tensor([2]))


def test_the_one_launch_step_without_a_q_adapter_passes_none_for_q(monkeypatch):
    """v adapted only: no q LoRA term (None); v's A row follows the base rows."""
    monkeypatch.setattr(fused_qkv_rope, "usable", lambda *a: True)
    model, layer, qkv = _qkv_case(targets=("v_proj",))
    view = _QkvView(True)
    model.decoder._qkv_rope(0, torch.zeros(1, 1, 64), layer, qkv, view, None, ("c", "s"))
    assert view.calls[0][8] is None and view.calls[0][7] == qkv.a_offset(0) == 128


def test_the_one_launch_step_declines_what_it_cannot_take(monkeypatch):
    """None (nothing launched) with the switch off, several rows, k adapted, v not adapted or not in the GEMM, a
    V_lr of another rank, a full cache whose B is of another dtype, q of another rank, or ``usable`` saying no."""
    seen = []
    monkeypatch.setattr(fused_qkv_rope, "usable", lambda *a: seen.append(a) or True)
    model, layer, qkv = _qkv_case()
    h, dec = torch.zeros(1, 1, 64), model.decoder

    def declines(view, group=qkv, hh=h, lay=layer) -> bool:
        return dec._qkv_rope(0, hh, lay, group, view, None, ("c", "s")) is None and view.calls == []

    off = _QkvView(True)
    off.qkv_rope = 0
    assert declines(off)
    assert declines(_QkvView(True), hh=torch.zeros(2, 1, 64))
    bare = SimpleNamespace(decomposed=True, pool=_QkvView(True).pool, calls=[])
    assert declines(bare)  # a view that does not ask for the launch
    assert declines(_QkvView(True), hh=torch.zeros(1, 2, 64))
    assert declines(_QkvView(True, rank=8))
    assert not declines(_QkvView(True)) and seen[-1][1:] == (qkv.weight, 4, 2, 16, 4)
    assert all(type(n) is int for n in seen[-1][2:])

    def like(**kw):
        g = SimpleNamespace(**{**vars(qkv), **kw})
        g.a_offset, g.refresh = (lambda j: sum(g.sizes[: len(g.modules) + j])), qkv.refresh
        return g

    assert not declines(_QkvView(True), group=like())
    assert declines(_QkvView(True), group=like(modules=qkv.modules[::-1]))
    for sizes in ([56, 32, 32, 4, 4], [64, 24, 32, 4, 4], [64, 40, 32, 4, 4], [64, 32, 16, 4, 4], [64, 32, 48, 4, 4]):
        assert declines(_QkvView(True), group=like(sizes=sizes))
    k_model, k_layer, k_qkv = _qkv_case(targets=("k_proj", "v_proj"))
    assert k_model.decoder._qkv_rope(0, h, k_layer, k_qkv, _QkvView(True), None, ("c", "s")) is None
    q_model, q_layer, q_qkv = _qkv_case(targets=("q_proj",))
    assert q_model.decoder._qkv_rope(0, h, q_layer, q_qkv, _QkvView(True), None, ("c", "s")) is None
    n_model, n_layer, n_qkv = _qkv_case(lora=False)
    assert n_model.decoder._qkv_rope(0, h, n_layer, n_qkv, _QkvView(True), None, ("c", "s")) is None
    layer.self_attn.v_proj.lora_B[0].data = layer.self_attn.v_proj.lora_B[0].data.half()
    assert declines(_QkvView(False)) and not declines(_QkvView(True))
    layer.self_attn.v_proj.lora_B[0].data = layer.self_attn.v_proj.lora_B[0].data.float()
    assert not declines(_QkvView(False))
    monkeypatch.setattr(fused_qkv_rope, "usable", lambda *a: False)
    assert declines(_QkvView(True))


def test_the_one_launch_step_declines_a_q_adapter_of_another_rank(monkeypatch):
    """q's rank must be the V_lr rank (one launch, one rank)."""
    monkeypatch.setattr(fused_qkv_rope, "usable", lambda *a: True)
    model, layer, qkv = _qkv_case()
    layer.self_attn.q_proj.rank = 8
    assert model.decoder._qkv_rope(0, torch.zeros(1, 1, 64), layer, qkv, _QkvView(True), None, ("c", "s")) is None


# ---- activation checkpointing ----------------------------------------------------------------------------------------
def _loss_and_grads(model, ckpt: bool, ids, roles):
    model.zero_grad()
    model.decoder.gradient_checkpointing = ckpt
    torch.manual_seed(0)
    logits = model.decoder.forward(ids, roles)
    loss = logits.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_changes_no_loss_or_gradient_and_replays_dropout(monkeypatch):
    """Adapters with dropout in training: the loss and every gradient are those without checkpointing (the dropout
    masks replayed); each layer runs under the checkpoint."""
    import torch.utils.checkpoint as ckpt_mod

    model = tiny_multi_lora("tiny-llama", b_std=0.3, overrides=TWO)
    for m in model.modules():
        if isinstance(m, MultiLoraLinear):
            m.dropout = nn.Dropout(0.3)
    model.train()
    ids, roles = _ids(2, 5, seed=11), torch.tensor([0, 2])
    want_loss, want = _loss_and_grads(model, False, ids, roles)
    calls = []
    real = ckpt_mod.checkpoint
    monkeypatch.setattr(ckpt_mod, "checkpoint", lambda *a, **k: calls.append(k) or real(*a, **k))
    got_loss, got = _loss_and_grads(model, True, ids, roles)
    assert len(calls) == 2 and calls[0] == {"use_reentrant": False, "preserve_rng_state": True}
    assert torch.allclose(got_loss, want_loss, atol=1e-6) and sorted(got) == sorted(want) and len(got) > 0
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)
    with torch.no_grad():
        model.decoder.forward(ids, roles)
    assert len(calls) == 2  # no autograd: no checkpoint
    model.decoder.gradient_checkpointing = False


# ---- which path a step takes (the same values on the CPU; the GPU kernels differ) ------------------------------------
class _Paths:
    """Counts the decoder's choices in one pass: fused group GEMMs, B gathered per row or through the role mask, mask
    launches, the one-launch q/k/v attempts (with their view, roles and rotary), q's LoRA folded into RoPE."""

    def __init__(self, monkeypatch, dec) -> None:
        self.n = {"group": 0, "gather": 0, "masked": 0, "role_masked": 0, "qkv_rope": 0, "fold_q": 0, "addmm": 0}
        self.qkv_args: list = []

        def count(key, real):
            def wrapped(*a, **k):
                self.n[key] += 1
                return real(*a, **k)

            return wrapped

        monkeypatch.setattr(decoder_mod, "_group_forward", count("group", decoder_mod._group_forward))
        monkeypatch.setattr(decoder_mod, "role_masked", count("role_masked", decoder_mod.role_masked))
        monkeypatch.setattr(MultiLoraLinear, "_add_lora", count("gather", MultiLoraLinear._add_lora))
        monkeypatch.setattr(MultiLoraLinear, "add_lora_masked", count("masked", MultiLoraLinear.add_lora_masked))
        monkeypatch.setattr(torch, "addmm", count("addmm", torch.addmm))
        real_qkv = dec._qkv_rope

        def qkv(*a):
            self.n["qkv_rope"] += 1
            self.qkv_args.append(a)
            return real_qkv(*a)

        monkeypatch.setattr(dec, "_qkv_rope", qkv)
        for cls in (DecodeView, PrefillView):
            real_rs = cls.rope_store

            def rope_store(view, *a, _real=real_rs, **k):
                self.n["fold_q"] += k.get("q_lora") is not None
                return _real(view, *a, **k)

            monkeypatch.setattr(cls, "rope_store", rope_store)

    def reset(self) -> None:
        self.n = dict.fromkeys(self.n, 0)
        self.qkv_args.clear()


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 2])
def test_a_fused_lora_decode_step_fuses_the_gemms_masks_every_b_and_folds_q(monkeypatch, rows):
    """Adapters on q/k/v/o/gate/up/down, fused with their A: per layer one q/k/v and one gate/up group GEMM, every B
    through the role mask (none gathered), one mask launch per group (the A columns) plus one per o/down, q's LoRA
    folded into the RoPE launch; the one-launch q/k/v step is tried at one row only (the CPU declines it)."""
    model = _model(targets=ALL)
    ids, roles = _ids(2, 5, seed=12), [2, 1]
    pool = _pool(model, True)
    for i in range(rows):
        _prefill(model, pool, ids[i : i + 1, :4], roles[i], slot=i)
    plain = _decode(model, pool, ids[:rows, 4].tolist(), list(range(rows)), [4] * rows, roles[:rows], False)
    _fuse(model)
    paths = _Paths(monkeypatch, model.decoder)
    got = _decode(model, pool, ids[:rows, 4].tolist(), list(range(rows)), [4] * rows, roles[:rows], True)
    assert torch.allclose(got, plain, atol=1e-4)
    # per layer: B through the mask for k, o, gate, up, down (q's folded into RoPE, v's applied by the attention
    # over V_lr); mask launches: one per group (its A columns), one each for o and down
    assert paths.n == {"group": 4, "gather": 0, "masked": 10, "role_masked": 8, "qkv_rope": 2 if rows == 1 else 0,
                       "fold_q": 2, "addmm": 0}  # fmt: skip
    for index, (layer_i, h, layer, group, view, role_ids, rotary) in enumerate(paths.qkv_args):
        assert layer_i == index and isinstance(view, DecodeView) and torch.equal(role_ids, torch.tensor(roles[:1]))
        assert layer is model.model.model.layers[index] and group is layer.self_attn.__dict__["_lragent_qkv"]
        assert len(rotary) == 2 and rotary[0].shape == (1, 1, 16) and h.shape == (1, 1, 64)


@torch.no_grad()
def test_fused_ops_without_fused_lora_gather_each_rows_b_and_give_the_merged_logits(monkeypatch):
    """``fuse_lora`` off (base GEMMs fused, adapters' A not): no role mask, every B gathered per row, the merged
    model's logits for a prefill and a two-row decode step."""
    model = _model(targets=ALL)
    ids, roles = _ids(2, 6, seed=13), [0, 2]
    want = _merged_logits(model, ids, roles)
    _fuse(model, lora=False)
    pool = _pool(model, True)
    _prefill_rows(model, pool, ids, roles, 5, True, want)
    paths = _Paths(monkeypatch, model.decoder)
    got = _decode(model, pool, ids[:, 5].tolist(), [0, 1], [5, 5], roles, True)
    assert torch.allclose(got[:, 0], want[:, 5], atol=1e-4)
    assert paths.n["masked"] == 0 and paths.n["role_masked"] == 0 and paths.n["gather"] == 2 * 6  # all but v's
    assert paths.n["fold_q"] == 0 and paths.n["group"] == 4


@torch.no_grad()
def test_the_plain_path_uses_no_fused_group_mask_or_addmm_even_when_the_model_carries_them(monkeypatch):
    """Fused weights attached, but an unfused view (and growable caches): the modules one by one, B gathered, no
    norm or SiLU kernel, no GEMM epilogue add; the merged model's logits."""
    model = _model(targets=ALL)
    ids, roles = _ids(2, 5, seed=14), [1, 0]
    want = _merged_logits(model, ids, roles)
    _fuse(model)
    calls: dict = {}
    _spy(monkeypatch, fused_ops, "rms_norm", calls)
    _spy(monkeypatch, fused_ops, "silu_mul", calls)
    paths = _Paths(monkeypatch, model.decoder)
    assert torch.allclose(model.decoder.forward(ids, torch.tensor(roles)), want, atol=1e-5)
    pool = _pool(model, False)
    h = _prefill(model, pool, ids[:1], roles[0], slot=0)
    assert torch.allclose(model.decoder.logits(h)[0], want[0], atol=1e-5)
    assert paths.n["group"] == paths.n["masked"] == paths.n["addmm"] == paths.n["qkv_rope"] == 0
    assert paths.n["gather"] > 0 and calls == {"rms_norm": 0, "silu_mul": 0}


@torch.no_grad()
def test_a_fused_step_adds_the_residual_in_the_down_gemm_where_down_is_a_plain_linear(monkeypatch):
    """q/v adapters (plain gate/up/down): a two-row fused step adds the residual inside the down GEMM (addmm) in
    every layer, one unfused q/k/v... group GEMM per group, and gives the plain path's logits."""
    model = _model()
    ids, roles = _ids(2, 5, seed=15), [0, 1]
    pool = _pool(model, True)
    _prefill_rows(model, pool, ids, roles, 4)
    plain = _decode(model, pool, ids[:, 4].tolist(), [0, 1], [4, 4], roles, False)
    _fuse(model)
    paths = _Paths(monkeypatch, model.decoder)
    got = _decode(model, pool, ids[:, 4].tolist(), [0, 1], [4, 4], roles, True)
    assert torch.allclose(got, plain, atol=1e-4) and paths.n["addmm"] == 2 and paths.n["group"] == 4


@torch.no_grad()
def test_an_adapter_on_gate_but_not_down_runs_the_mlp_piece_by_piece_on_the_plain_path():
    """gate_proj adapted, down_proj plain: the plain path computes act(gate)·up then the plain down projection (no
    residual to add there); the merged model's logits."""
    model = _model(targets=("q_proj", "v_proj", "gate_proj"))
    ids, roles = _ids(2, 5, seed=16), [2, 1]
    assert torch.allclose(model.decoder.forward(ids, torch.tensor(roles)), _merged_logits(model, ids, roles), atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True])
def test_per_role_a_matrices_reach_every_path(fused):
    """Adapters without a shared A (each role its own A, never in the fused GEMMs): prefill and decode give the
    merged model's logits on both paths; an LR prefill and a partly cached forward use the row's role's A."""
    model = _model(targets=ALL, shared_a=False)
    if fused:
        _fuse(model)
    ids, roles = _ids(2, 6, seed=17), [1, 2]
    want = _merged_logits(model, ids, roles)
    pool = _pool(model, True)
    _prefill_rows(model, pool, ids, roles, 5, fused, want)
    got = _decode(model, pool, ids[:, 5].tolist(), [0, 1], [5, 5], roles, fused)
    assert torch.allclose(got[:, 0], want[:, 5], atol=1e-4)
    one = _decode(model, pool, ids[1:, 5].tolist(), [1], [5], roles[1:], fused)
    assert torch.allclose(one[:, 0], want[1:, 5], atol=1e-4)
    pool2 = _pool(model, True)
    _prefill(model, pool2, ids[:1, :2], 2, slot=0, fused=fused)
    got = _prefill(model, pool2, ids[:1], 2, slot=0, fused=fused, kv_from=2)
    full = _prefill(model, pool2, ids[:1], 2, slot=1, fused=fused)
    assert torch.allclose(got, full, atol=1e-5)
    assert torch.allclose(pool2.v_lr[1][0, :6], pool2.v_lr[1][1, :6], atol=1e-5)
    out = _prefill(model, pool2, ids[:1], 1, slot=1, fused=fused, write_kv=False)
    last = model.model.model.layers[1]
    want_lr = last.self_attn.v_proj.lora_input(last.input_layernorm(out), torch.tensor([1]))
    assert torch.allclose(pool2.v_lr[1][1, :6], want_lr[0], atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("kv_from", [1, 5])
def test_a_partly_cached_forward_keeps_the_cached_k_and_writes_the_roles_k_after_it(kv_from):
    """k_proj adapted too (K depends on the role), the first ``kv_from`` positions cached by role 0: role 1's pass
    leaves their K and V_base as cached, writes role 1's V_lr over all six and role 1's K after them (layer 0: the
    values of role 1's full forward)."""
    model = _model(targets=ALL, shared_a=False)
    ids = _ids(1, 6, seed=18)
    pool = _pool(model, True)
    _prefill(model, pool, ids[:, :kv_from], 0, slot=0)
    cached = [(k[0, :, :kv_from].clone(), v[0, :, :kv_from].clone()) for k, v in zip(pool.k, pool.v, strict=True)]
    _prefill(model, pool, ids, 1, slot=0, kv_from=kv_from)
    _prefill(model, pool, ids, 1, slot=1)
    for layer, (k, v) in enumerate(cached):
        assert torch.equal(pool.k[layer][0, :, :kv_from], k) and torch.equal(pool.v[layer][0, :, :kv_from], v)
    assert not torch.allclose(pool.k[0][1, :, :kv_from], cached[0][0], atol=1e-4)  # role 1's K differs
    assert torch.allclose(pool.k[0][0, :, kv_from:6], pool.k[0][1, :, kv_from:6], atol=1e-5)
    assert torch.allclose(pool.v_lr[0][0, :6], pool.v_lr[0][1, :6], atol=1e-5)


@torch.no_grad()
def test_a_one_role_fused_step_without_role_ids_folds_q_for_role_zero():
    """One role, no role ids: the fused decode step (q's LoRA folded with role 0) gives the merged model's logits."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3, roles=("plan",), overrides=TWO)
    ids = _ids(2, 5, seed=19)
    want = _merged_logits(model, ids, [0, 0])
    _fuse(model)
    pool = _pool(model, True)
    _prefill_rows(model, pool, ids, [0, 0], 4, True)
    got = _decode(model, pool, ids[:, 4].tolist(), [0, 1], [4, 4], None, True)
    assert torch.allclose(got[:, 0], want[:, 4], atol=1e-4)
    half = model.decoder.role_mask_for(SimpleNamespace(fused=True), None, torch.zeros(2, 1, 64).half())()
    assert half.dtype == torch.float16 and torch.equal(half, torch.ones(2, 1, dtype=torch.float16))


@torch.no_grad()
def test_a_one_adapter_model_fuses_and_masks_a_single_a():
    """A single adapted projection (v_proj, one layer): the role count comes from it, the group's one A column block
    is masked, and the fused step gives the merged model's logits."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3, targets=("v_proj",), overrides={"num_hidden_layers": 1})
    ids, roles = _ids(2, 5, seed=20), [2, 0]
    want = _merged_logits(model, ids, roles)
    _fuse(model)
    pool = _pool(model, False)  # a full cache: v's B applied through the mask
    _prefill_rows(model, pool, ids, roles, 4, True)
    got = _decode(model, pool, ids[:, 4].tolist(), [0, 1], [4, 4], roles, True)
    assert torch.allclose(got[:, 0], want[:, 4], atol=1e-4) and model.decoder._n_roles == 3


@torch.no_grad()
def test_changed_adapters_reach_the_fused_gemm_before_the_step():
    """An adapter's A changed in place after fusing: the fused step refreshes its rows and gives the new merged
    model's logits."""
    model = _model()
    _fuse(model)
    for m in model.modules():
        if isinstance(m, MultiLoraLinear):
            m.lora_A[0].mul_(3.0)
    ids, roles = _ids(1, 5, seed=21), [1]
    want = _merged_logits(model, ids, roles)
    pool = _pool(model, True)
    h = _prefill(model, pool, ids, roles[0], slot=0, fused=True)
    assert torch.allclose(model.decoder.logits(h, True)[0], want[0], atol=1e-4)


@torch.no_grad()
def test_layer_forward_defaults_to_a_full_layer_that_writes_its_cache():
    """``layer_forward(i, h, rotary, roles, view)``: K and V written, the whole layer run (what run_view runs)."""
    model = _model()
    ids, roles = _ids(1, 5, seed=22), torch.tensor([1])
    pool = _pool(model, True)
    dec = model.decoder
    h = dec.embed(ids)
    rot = dec.rotary(h, torch.arange(5)[None])
    view = PrefillView(pool, 0, 0, None, 0, 5, use_kernel=False, fused=False)
    got = dec.layer_forward(0, h, rot, roles, view)
    want = _prefill(model, pool, ids, 1, slot=1, layers=[0])
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(pool.k[0][0], pool.k[0][1])
    assert torch.equal(pool.v_lr[0][0], pool.v_lr[0][1])


@torch.no_grad()
def test_the_hidden_states_entering_each_kept_layer_are_captured():
    """A pool keeping layer 1's entering hidden states (DroidSpeak): a prefill writes them into its hidden slot."""
    model = _model()
    dec = model.decoder
    layout = PoolLayout(n_layers=2, n_kv_heads=2, head_dim=16, kv_slots=2, lr_slots=2, rank=4, hidden_layers=(1,),
                        hidden_slots=2, hidden_size=64)  # fmt: skip
    pool = StaticCachePool(layout, 16, torch.float32, "cpu")
    ids = _ids(1, 5, seed=23)
    h = dec.embed(ids)
    view = PrefillView(pool, 0, 0, 1, 2, 5, use_kernel=False, fused=False)
    dec.run_view(h, dec.rotary(h, torch.arange(2, 7)[None]), torch.tensor([2]), view)
    first = dec.run_view(h, dec.rotary(h, torch.arange(2, 7)[None]), torch.tensor([2]),
                         PrefillView(pool, 1, 1, None, 2, 5, use_kernel=False), layers=[0])  # fmt: skip
    assert torch.allclose(pool.hidden[1][1, 2:7], first[0], atol=1e-6) and not pool.hidden[1][0].any()


@torch.no_grad()
def test_padded_rows_with_a_key_mask_give_each_rows_own_logits():
    """Left padding masked out (``key_mask``, positions from 0 at the first real token): the real positions get the
    merged model's logits of the row alone, through forward and run_layers."""
    model = _model()
    ids = _ids(2, 5, seed=24)
    ids[0, :2] = 0
    key_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    got = model.decoder.forward(ids, torch.tensor([1, 2]), positions=positions, key_mask=key_mask)
    assert torch.allclose(got[0, 2:], model.merged_model(1)(ids[:1, 2:]).logits[0], atol=1e-5)
    assert torch.allclose(got[1], model.merged_model(2)(ids[1:]).logits[0], atol=1e-5)
    h = model.decoder.run_layers(model.decoder.embed(ids), positions, torch.tensor([1, 2]), ModelCache(2), 0,
                                 key_mask=key_mask)  # fmt: skip
    assert torch.allclose(model.decoder.logits(h), got, atol=1e-6)


@torch.no_grad()
def test_run_layers_runs_only_the_layers_asked():
    model = _model()
    ids, roles = _ids(1, 4, seed=25), torch.tensor([0])
    caches = ModelCache(2)
    h = model.decoder.embed(ids)
    out = model.decoder.run_layers(h, torch.arange(4)[None], roles, caches, 0, layers=[0])
    assert caches[0].length == 4 and caches[1].length == 0
    pool = _pool(model, False)
    assert torch.allclose(out, _prefill(model, pool, ids, 0, slot=0, layers=[0]), atol=1e-6)


def test_activation_checkpointing_writes_each_position_once_and_trains_an_lr_prefill_alike(monkeypatch):
    """Checkpointed layers recompute in backward without writing the caches again: two forwards appended to the
    same caches, then one backward, give the caches and gradients of the unchecked run; an LR prefill
    (``write_kv=False``) through checkpointed layers gives the same output and gradients."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3, overrides=TWO).train()
    ids, roles = _ids(2, 7, seed=26), torch.tensor([0, 2])
    writes = []
    real_store = GrowableView.store
    monkeypatch.setattr(GrowableView, "store", lambda self, *a: writes.append(self.start) or real_store(self, *a))

    def run(ckpt: bool):
        model.zero_grad()
        model.decoder.gradient_checkpointing = ckpt
        caches = ModelCache(2, decomposed=True)
        a = model.decoder.forward(ids[:, :4], roles, caches)
        b = model.decoder.forward(ids[:, 4:], roles, caches)
        other = ModelCache(2, decomposed=True)
        with torch.no_grad():
            model.decoder.forward(ids, roles, other)
        h = model.decoder.embed(ids)
        lr = model.decoder.run_layers(h, torch.arange(7)[None].expand(2, 7), torch.tensor([1, 1]), other, 0,
                                      write_kv=False)  # fmt: skip
        (a.pow(2).mean() + b.pow(2).mean() + lr.pow(2).mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return caches, grads, lr.detach()

    plain_caches, plain_grads, plain_lr = run(False)
    n_plain = len(writes)
    writes.clear()
    ckpt_caches, ckpt_grads, ckpt_lr = run(True)
    assert len(writes) == n_plain == 6  # three forwards x two layers, none again in backward
    assert torch.allclose(ckpt_lr, plain_lr, atol=1e-6) and sorted(ckpt_grads) == sorted(plain_grads)
    assert all(torch.allclose(ckpt_grads[n], plain_grads[n], atol=1e-5) for n in plain_grads)
    for layer in range(2):
        assert torch.equal(ckpt_caches[layer].k.view(7), plain_caches[layer].k.view(7))
        assert torch.allclose(ckpt_caches[layer].v_lr.view(7), plain_caches[layer].v_lr.view(7), atol=1e-6)
    model.decoder.gradient_checkpointing = False


@torch.no_grad()
def test_a_one_launch_step_hands_its_queries_and_q_lora_term_to_the_attention(monkeypatch):
    """Where the one-launch q/k/v step runs (a GPU or the interpreter; faked here), its rotated queries and q's LoRA
    term go to the attention (``q_add``) and no other q/k/v projection runs."""
    model = _model()
    _fuse(model)
    pool = _pool(model, True)
    q_fake, add_fake = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 16)
    monkeypatch.setattr(model.decoder, "_qkv_rope", lambda *a: (q_fake, add_fake))
    seen = []

    def attend(view, layer, q, lora_b, scaling, role_ids, **extra):
        seen.append((layer, q, extra))
        return torch.zeros(1, 4, 1, 16)

    monkeypatch.setattr(DecodeView, "attend", attend)
    paths = _Paths(monkeypatch, model.decoder)
    _decode(model, pool, [7], [0], [3], [1], True)
    assert [(layer, q is q_fake, list(extra)) for layer, q, extra in seen] == [
        (0, True, ["q_add"]),
        (1, True, ["q_add"]),
    ]
    assert all(extra["q_add"] is add_fake for _, _, extra in seen) and paths.n["fold_q"] == 0


@torch.no_grad()
def test_a_fused_qwen2_step_keeps_the_q_k_v_biases():
    """Qwen2's q/k/v biases ride in the fused GEMM: the fused prefill and decode give the merged model's logits."""
    model = _model("tiny-qwen2")
    for layer in model.model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            base = proj.base if isinstance(proj, MultiLoraLinear) else proj
            base.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))  # (initialised to zeros)
    ids, roles = _ids(2, 5, seed=27), [0, 2]
    want = _merged_logits(model, ids, roles)
    _fuse(model)
    pool = _pool(model, True)
    _prefill_rows(model, pool, ids, roles, 4, True, want)
    got = _decode(model, pool, ids[:, 4].tolist(), [0, 1], [4, 4], roles, True)
    assert torch.allclose(got[:, 0], want[:, 4], atol=1e-4)


@torch.no_grad()
def test_a_per_role_down_adapter_after_the_fused_norm_gemv_uses_the_rows_roles(monkeypatch):
    """Only down_proj adapted (per-role A): a one-row fused step runs the gate/up norm GEMV, then down's LoRA
    through the role mask with the row's role; the merged model's logits."""
    model = _model(targets=("q_proj", "v_proj", "down_proj"), shared_a=False)
    ids, roles = _ids(1, 5, seed=28), [2]
    want = _merged_logits(model, ids, roles)
    _fuse(model)
    pool = _pool(model, True)
    _prefill(model, pool, ids[:, :4], 2, slot=0, fused=True)
    paths = _Paths(monkeypatch, model.decoder)
    got = _decode(model, pool, ids[:, 4].tolist(), [0], [4], roles, True)
    assert torch.allclose(got[0, 0], want[0, 4], atol=1e-4) and paths.n["gather"] == 0 and paths.n["masked"] > 0


@torch.no_grad()
def test_a_single_layer_run_is_the_last_layer_of_an_lr_prefill_or_a_k_v_only_pass():
    """``layers=[1]`` alone: with ``write_kv=False`` that layer only writes V_lr and returns its input; with
    ``kv_only_last`` it only writes K/V and returns its input."""
    model = _model()
    ids = _ids(1, 4, seed=29)
    pool = _pool(model, True)
    h = _prefill(model, pool, ids, 0, slot=0, layers=[0])
    dec = model.decoder
    rot = dec.rotary(h, torch.arange(4)[None])
    view = PrefillView(pool, 0, 0, None, 0, 4, use_kernel=False, fused=False)
    assert torch.equal(dec.run_view(h, rot, torch.tensor([1]), view, layers=[1], write_kv=False), h)
    assert torch.equal(dec.run_view(h, rot, torch.tensor([1]), view, layers=[1], kv_only_last=True), h)
    assert pool.k[1][0, :, :4].any()


def test_a_config_without_an_activation_name_is_taken_as_silu():
    """``hidden_act`` missing from the config: SiLU (the LLaMA family's); head dim from hidden / heads."""
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, vocab_size=256)
    dec = decoder_mod.DecoderEngine(SimpleNamespace(config=cfg, model=SimpleNamespace(layers=[0, 1, 2])))
    assert dec._silu is True and dec.head_dim == 16 and dec.n_layers == 3


@torch.no_grad()
def test_the_mlp_alone_defaults_to_the_plain_modules(monkeypatch):
    """``_mlp(layer, x, roles)``: the model's own MLP (no fused kernel), also with fused weights attached; with
    ``fused=True`` and a residual, SiLU·mul stays out of the down GEMV unless asked."""
    model = _model()
    _fuse(model)
    calls: dict = {}
    _spy(monkeypatch, fused_ops, "silu_mul", calls)
    _spy(monkeypatch, fused_gemv, "silu_mul_linear", calls)
    layer = model.model.model.layers[0]
    x, roles = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(5)), torch.tensor([1])
    assert torch.allclose(model.decoder._mlp(layer, x, roles), layer.mlp(x), atol=1e-6)
    assert calls == {"silu_mul": 0, "silu_mul_linear": 0}
    r = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(6))
    got = model.decoder._mlp(layer, x, roles, fused=True, residual=r)
    assert torch.allclose(got, r + layer.mlp(x), atol=1e-5) and calls == {"silu_mul": 1, "silu_mul_linear": 0}


@torch.no_grad()
def test_a_fused_step_without_fused_groups_masks_each_mlp_projections_b(monkeypatch):
    """The fused LoRA path on a model whose projections were not fused: gate, up and down each apply their B
    through the role mask (none gathered); the merged model's logits."""
    model = _model(targets=ALL)
    model.decoder.fuse_lora = True
    ids, roles = _ids(2, 5, seed=30), [1, 2]
    want = _merged_logits(model, ids, roles)
    pool = _pool(model, True)
    _prefill_rows(model, pool, ids, roles, 4, True)
    gathered = []
    real = MultiLoraLinear._add_lora
    monkeypatch.setattr(MultiLoraLinear, "_add_lora", lambda m, *a: gathered.append(m) or real(m, *a))
    got = _decode(model, pool, ids[:, 4].tolist(), [0, 1], [4, 4], roles, True)
    assert torch.allclose(got[:, 0], want[:, 4], atol=1e-4)
    mlps = {
        id(getattr(layer.mlp, n)) for layer in model.model.model.layers for n in ("gate_proj", "up_proj", "down_proj")
    }
    assert not any(id(m) in mlps for m in gathered)


@torch.no_grad()
def test_layer_forward_with_write_kv_off_runs_the_whole_layer_unless_told_lr_only():
    """``write_kv=False`` alone: V_lr written and the whole layer run over the cached K/V (not its input back)."""
    model = _model()
    ids = _ids(1, 4, seed=31)
    pool = _pool(model, True)
    _prefill(model, pool, ids, 0, slot=0)
    dec = model.decoder
    h = dec.embed(ids)
    rot = dec.rotary(h, torch.arange(4)[None])
    view = PrefillView(pool, 0, 0, None, 0, 4, use_kernel=False, fused=False)
    got = dec.layer_forward(0, h, rot, torch.tensor([2]), view, write_kv=False)
    want = dec.run_view(h, rot, torch.tensor([2]), view, layers=[0, 1], write_kv=False)
    assert not torch.equal(got, h) and torch.allclose(got, want, atol=1e-6)


@torch.no_grad()
def test_forward_appends_at_the_caches_length():
    """The default start is the cache's length (``ModelCache.length``: its first layer's): where a later layer holds
    fewer positions (run_layers over the first layer only) the write there would leave a gap and is refused, not
    made at that layer's own length."""
    model = _model()
    caches = ModelCache(2)
    ids = _ids(1, 6, seed=32)
    model.decoder.run_layers(model.decoder.embed(ids[:, :4]), torch.arange(4)[None], torch.tensor([0]), caches, 0,
                             layers=[0])  # fmt: skip
    assert (caches.length, caches[1].length) == (4, 0)
    with pytest.raises(IndexError, match="^write at 4 leaves a gap: buffer length is 0$"):
        model.decoder.forward(ids[:, 4:], torch.tensor([0]), caches)
