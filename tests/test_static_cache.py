"""Properties of :mod:`lragent.static_cache`: the KV-cache pool's layout, byte accounting and growth.

Pinned here: :class:`PoolLayout`'s validation (exact boundaries and messages) and defaults; bytes per position and
allocated bytes against a hand count for asymmetric shapes, decomposed (K, V_base, V_lr) and plain (K, V, even with a
rank set), with and without DroidSpeak hidden states, and that a real pool allocates exactly what the layout says;
every buffer's shape (scratch slot included, as the last slot), dtype, device and independence; ``grow`` keeping the
valid prefix of every buffer exactly (zeros after it), ignoring a non-larger capacity, and bumping ``version`` once
per real growth.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.static_cache import PoolLayout, StaticCachePool

# asymmetric on purpose: layers, heads, head dim, slots, rank, hidden size all differ
DECOMPOSED = PoolLayout(
    n_layers=3,
    n_kv_heads=2,
    head_dim=5,
    kv_slots=4,
    lr_slots=2,
    rank=7,
    hidden_layers=(0, 2),
    hidden_slots=3,
    hidden_size=11,
)
PLAIN = PoolLayout(n_layers=3, n_kv_heads=2, head_dim=5, kv_slots=4, rank=7)  # a rank but no low-rank slots


# ----------------------------------------------------------------------------- layout
def test_layout_needs_at_least_one_kv_slot() -> None:
    PoolLayout(n_layers=1, n_kv_heads=1, head_dim=1, kv_slots=1)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"^{re.escape(f'kv_slots must be >= 1, got {bad}')}$"):
            PoolLayout(n_layers=1, n_kv_heads=1, head_dim=1, kv_slots=bad)


def test_low_rank_slots_need_a_rank_and_a_plain_layout_does_not() -> None:
    PoolLayout(n_layers=1, n_kv_heads=1, head_dim=1, kv_slots=1, lr_slots=0, rank=0)
    PoolLayout(n_layers=1, n_kv_heads=1, head_dim=1, kv_slots=1, lr_slots=3, rank=1)
    msg = "a pool with low-rank slots needs rank >= 1, got 0"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        PoolLayout(n_layers=1, n_kv_heads=1, head_dim=1, kv_slots=1, lr_slots=3, rank=0)


def test_layout_defaults_are_a_plain_pool_without_hidden_states() -> None:
    lay = PoolLayout(2, 3, 4, 5)
    assert lay == PoolLayout(2, 3, 4, 5, lr_slots=0, rank=0, hidden_layers=(), hidden_slots=0, hidden_size=0)
    assert not lay.decomposed and DECOMPOSED.decomposed and not PLAIN.decomposed


def test_bytes_per_position_against_a_hand_count() -> None:
    # K and V: 3 layers * 2 heads * 5 dims * 2 bytes = 60; V_lr: 3 layers * rank 7 * 2 = 42; hidden: 2 * 11 * 2 = 44
    assert DECOMPOSED.bytes_per_position(2) == {"k": 60, "v_base": 60, "v_lr": 42, "hidden": 44}
    assert PLAIN.bytes_per_position(4) == {"k": 120, "v": 120}
    with_hidden = PoolLayout(3, 2, 5, 4, hidden_layers=(1,), hidden_slots=1, hidden_size=11)
    assert with_hidden.bytes_per_position(1) == {"k": 30, "v": 30, "hidden": 11}


def test_allocated_bytes_against_a_hand_count() -> None:
    # per position: K+V 2 * 3 layers * (4 + 1) slots * 2 heads * 5 = 300, V_lr 3 * (2 + 1) * 7 = 63,
    # hidden 2 layers * (3 + 1) * 11 = 88; capacity 9, 4 bytes
    assert DECOMPOSED.allocated_bytes(9, 4) == 9 * (300 + 63 + 88) * 4
    assert PLAIN.allocated_bytes(9, 2) == 9 * 300 * 2  # the rank of a plain layout allocates nothing
    assert PLAIN.allocated_bytes(1, 1) == 300


@given(
    n_layers=st.integers(1, 3),
    n_kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    kv_slots=st.integers(1, 3),
    lr_slots=st.integers(0, 2),
    rank=st.integers(1, 3),
    hidden_layers=st.sets(st.integers(0, 2), max_size=2).map(lambda s: tuple(sorted(s))),
    hidden_slots=st.integers(0, 2),
    hidden_size=st.integers(1, 5),
    capacity=st.integers(1, 5),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
)
@settings(max_examples=25)
def test_a_pool_allocates_what_its_layout_says(capacity: int, dtype: torch.dtype, **sizes: int) -> None:
    lay = PoolLayout(**sizes)
    pool = StaticCachePool(lay, capacity, dtype, "cpu")
    es = torch.empty(0, dtype=dtype).element_size()
    assert pool.allocated_bytes() == lay.allocated_bytes(capacity, es)
    per = lay.bytes_per_position(es)
    slots = {"k": lay.kv_slots, "v": lay.kv_slots, "v_base": lay.kv_slots, "v_lr": lay.lr_slots}
    assert pool.allocated_bytes() == sum(capacity * (slots.get(k, lay.hidden_slots) + 1) * b for k, b in per.items())


# ----------------------------------------------------------------------------- pool buffers
def test_buffers_have_the_layout_shapes_with_the_scratch_slot_last() -> None:
    pool = StaticCachePool(DECOMPOSED, 6, torch.float64, "cpu")
    assert (pool.capacity, pool.version) == (6, 0)
    assert (pool.scratch_kv, pool.scratch_lr, pool.scratch_hidden) == (4, 2, 3)
    assert len(pool.k) == len(pool.v) == len(pool.v_lr) == 3
    for t in pool.k + pool.v:
        assert t.shape == (4 + 1, 2, 6, 5) and t.dtype == torch.float64 and not t.any()
    for t in pool.v_lr:
        assert t.shape == (2 + 1, 6, 7) and t.dtype == torch.float64 and not t.any()
    assert sorted(pool.hidden) == [0, 2]
    for t in pool.hidden.values():
        assert t.shape == (3 + 1, 6, 11) and t.dtype == torch.float64 and not t.any()
    assert pool.allocated_bytes() == 6 * (300 + 63 + 88) * 8


def test_a_plain_pool_has_no_low_rank_buffers_and_no_hidden_states() -> None:
    pool = StaticCachePool(PLAIN, 2, torch.float16, "cpu")
    assert pool.v_lr is None and pool.hidden == {}
    assert [t.shape for t in pool.v] == [(5, 2, 2, 5)] * 3
    assert pool.allocated_bytes() == 2 * 300 * 2


def test_every_buffer_is_its_own_storage() -> None:
    pool = StaticCachePool(DECOMPOSED, 3, torch.float32, "cpu")
    tensors = [*pool.k, *pool.v, *pool.v_lr, *pool.hidden.values()]
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [t.unique().tolist() for t in tensors] == [[i + 1.0] for i in range(len(tensors))]


def test_buffers_live_on_the_requested_device() -> None:
    pool = StaticCachePool(DECOMPOSED, 4, torch.bfloat16, "meta")
    assert pool.device == torch.device("meta")
    for t in [*pool.k, *pool.v, *pool.v_lr, *pool.hidden.values()]:
        assert t.device.type == "meta" and t.dtype == torch.bfloat16
    pool.grow(7)
    assert all(t.device.type == "meta" and t.shape[-2] == 7 for t in pool.k + pool.v)


def test_capacity_must_be_at_least_one_position() -> None:
    assert StaticCachePool(PLAIN, 1, torch.float32, "cpu").capacity == 1
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"^{re.escape(f'cache capacity must be >= 1 position, got {bad}')}$"):
            StaticCachePool(PLAIN, bad, torch.float32, "cpu")


# ----------------------------------------------------------------------------- growth
def filled(layout: PoolLayout, capacity: int) -> StaticCachePool:
    pool = StaticCachePool(layout, capacity, torch.float32, "cpu")
    g = torch.Generator().manual_seed(capacity)
    for t in [*pool.k, *pool.v, *(pool.v_lr or []), *pool.hidden.values()]:
        t.copy_(torch.rand(t.shape, generator=g) + 1)  # no zero anywhere
    return pool


def snapshot(pool: StaticCachePool) -> dict[str, list[torch.Tensor]]:
    return {
        "k": [t.clone() for t in pool.k],
        "v": [t.clone() for t in pool.v],
        "v_lr": [t.clone() for t in pool.v_lr or []],
        "hidden": [pool.hidden[layer].clone() for layer in sorted(pool.hidden)],
    }


@pytest.mark.parametrize("layout", [DECOMPOSED, PLAIN], ids=["decomposed", "plain"])
@pytest.mark.parametrize("valid", [None, 0, 2, 5, 100])
def test_grow_keeps_the_valid_prefix_exactly_and_zeros_the_rest(layout: PoolLayout, valid: int | None) -> None:
    pool = filled(layout, 5)
    old = snapshot(pool)
    pool.grow(8, valid=valid)
    keep = 5 if valid is None else min(valid, 5)
    assert pool.capacity == 8 and pool.version == 1
    new = snapshot(pool)
    for name in ("k", "v"):
        for a, b in zip(new[name], old[name], strict=True):
            assert a.shape == (5, 2, 8, 5)
            assert torch.equal(a[:, :, :keep], b[:, :, :keep]) and not a[:, :, keep:].any()
    for name, shape in (("v_lr", (3, 8, 7)), ("hidden", (4, 8, 11))):
        assert len(new[name]) == len(old[name]) == (0 if layout is PLAIN else 3 - (name == "hidden"))
        for a, b in zip(new[name], old[name], strict=True):
            assert a.shape == shape
            assert torch.equal(a[:, :keep], b[:, :keep]) and not a[:, keep:].any()
    assert pool.allocated_bytes() == layout.allocated_bytes(8, 4)


@pytest.mark.parametrize("capacity", [5, 4, 1])
def test_grow_to_a_capacity_not_above_the_current_one_changes_nothing(capacity: int) -> None:
    pool = filled(DECOMPOSED, 5)
    before = [*pool.k, *pool.v, *pool.v_lr, *pool.hidden.values()]
    pool.grow(capacity, valid=2)
    assert (pool.capacity, pool.version) == (5, 0)
    after = [*pool.k, *pool.v, *pool.v_lr, *pool.hidden.values()]
    assert all(a is b for a, b in zip(after, before, strict=True))


def test_each_real_growth_bumps_the_version_once() -> None:
    pool = filled(PLAIN, 2)
    versions = []
    for capacity in (3, 3, 7, 6, 12):
        pool.grow(capacity)
        versions.append((pool.capacity, pool.version))
    assert versions == [(3, 1), (3, 1), (7, 2), (7, 2), (12, 3)]
    assert not pool.k[0][:, :, 2:].any() and pool.k[0][:, :, :2].all()
