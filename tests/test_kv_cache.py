"""lragent.kv_cache: a growable buffer writes exactly its positions, grows by doubling in place (keeping what it held,
on the device of what is written, never writing into a tensor it was handed), appends by concatenation where autograd
records (gradients reach every write), and counts the bytes of its valid positions; a layer's and a model's caches
truncate every buffer and add up their bytes by component."""

from __future__ import annotations

import pytest
import torch

from lragent.kv_cache import GrowableBuffer, LayerCache, ModelCache


def _kv(n: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(B=2, H_kv=3, n, D=4) keys or values."""
    return torch.randn(2, 3, n, 4, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_writes_append_overwrite_and_refuse_a_gap() -> None:
    """Positions [start, start + n) hold x; an overwrite inside keeps the length, one past the end extends it; a write
    that would leave unwritten positions before it is refused, naming the position and the length."""
    buf = GrowableBuffer(2)
    a, b, c = _kv(5, 1), _kv(3, 2), _kv(4, 3)
    buf.write(0, a)
    buf.write(5, b)
    assert buf.length == 8 and torch.equal(buf.view(), torch.cat([a, b], 2))
    buf.write(1, c[:, :, :2])  # inside: the length stays
    assert buf.length == 8 and torch.equal(buf.view(), torch.cat([a[:, :, :1], c[:, :, :2], a[:, :, 3:], b], 2))
    buf.write(6, c)  # over the tail and past it
    head = torch.cat([a[:, :, :1], c[:, :, :2], a[:, :, 3:], b[:, :, :1]], 2)
    assert buf.length == 10 and torch.equal(buf.view(6), head)
    assert torch.equal(buf.view()[:, :, 6:], c)
    with pytest.raises(IndexError, match=r"^write at 11 leaves a gap: buffer length is 10$"):
        buf.write(11, b)
    with pytest.raises(IndexError, match=r"^write at -1 leaves a gap: buffer length is 10$"):
        buf.write(-1, b)
    with pytest.raises(RuntimeError, match=r"^empty buffer$"):
        GrowableBuffer(1).view()


def test_capacity_starts_at_16_and_doubles_in_place_keeping_what_it_held() -> None:
    """The first write allocates max(n, 16) positions; writes that fit (up to the last position) stay in that storage;
    one past it reallocates to max(end, twice the capacity), copying the valid positions to where they were."""
    buf = GrowableBuffer(2)
    parts = [_kv(5, 1)]
    buf.write(0, parts[0])
    assert buf.data.shape == (2, 3, 16, 4)
    storage = buf.data.data_ptr()
    for i, n in enumerate((1, 4, 6)):  # 5 + 1 + 4 + 6 = 16: exactly full
        parts.append(_kv(n, 10 + i))
        buf.write(buf.length, parts[-1])
    assert buf.length == 16 and buf.data.shape[2] == 16 and buf.data.data_ptr() == storage
    parts.append(_kv(1, 20))
    buf.write(16, parts[-1])
    assert buf.data.shape == (2, 3, 32, 4) and buf.length == 17
    assert torch.equal(buf.view(), torch.cat(parts, 2))
    big = _kv(50, 21)
    buf.write(17, big)  # past twice the capacity: exactly the end
    assert buf.data.shape[2] == 67 and torch.equal(buf.view(), torch.cat([*parts, big], 2))
    wide = GrowableBuffer(1)
    wide.write(0, torch.ones(2, 40, 3))
    assert wide.data.shape == (2, 40, 3)


def test_the_buffer_lives_where_and_as_what_is_written() -> None:
    """dtype and device are those of the written tensor (a meta tensor: no storage on the CPU), grown ones too."""
    buf = GrowableBuffer(2)
    buf.write(0, torch.empty(1, 2, 3, 4, device="meta", dtype=torch.bfloat16))
    buf.write(3, torch.empty(1, 2, 20, 4, device="meta", dtype=torch.bfloat16))
    assert buf.view().device.type == "meta" and buf.view().dtype == torch.bfloat16 and buf.view().shape[2] == 23


def test_truncate_forgets_positions_and_never_grows() -> None:
    """truncate(n): the length is min(length, max(0, n)); what stays is unchanged and the next write goes after it."""
    buf = GrowableBuffer(1)
    x = torch.arange(12.0).view(1, 6, 2)
    buf.write(0, x)
    buf.truncate(10)
    assert buf.length == 6
    buf.truncate(4)
    assert buf.length == 4 and torch.equal(buf.view(), x[:, :4])
    buf.write(4, -x[:, :1])
    assert buf.length == 5 and torch.equal(buf.view(), torch.cat([x[:, :4], -x[:, :1]], 1))
    buf.truncate(0)
    assert buf.length == 0
    buf.write(0, x[:, :2])
    buf.truncate(-3)
    assert buf.length == 0


def test_nbytes_counts_the_valid_positions_only() -> None:
    """Bytes of the valid positions, an int: element size × the other dimensions × length; nothing for an empty or
    truncated-to-nothing buffer, whatever its spare capacity."""
    buf = GrowableBuffer(2)
    assert buf.nbytes() == 0
    buf.write(0, _kv(1, dtype=torch.float32))
    assert buf.nbytes() == 4 * 2 * 3 * 4 and type(buf.nbytes()) is int
    buf.write(1, _kv(4, dtype=torch.float32))
    assert buf.nbytes() == 5 * 96 and type(buf.nbytes()) is int  # capacity 16
    buf.truncate(0)
    assert buf.nbytes() == 0
    lr = GrowableBuffer(1)
    lr.write(0, torch.zeros(3, 7, 5, dtype=torch.bfloat16))
    assert lr.nbytes() == 2 * 3 * 5 * 7


def test_differentiable_writes_concatenate_and_gradients_reach_every_write() -> None:
    """Where autograd records, a write appends (or replaces the tail from ``start``) by concatenation: the first is
    the tensor itself, later ones keep the earlier positions up to ``start``; backward through the buffer reaches each
    written tensor at the positions it still holds. A write ending inside the buffer is refused."""
    a, b, c = (_kv(n, s).requires_grad_() for n, s in ((1, 1), (3, 2), (4, 3)))
    buf = GrowableBuffer(2)
    buf.write(0, a)
    assert buf.data is a and buf.length == 1
    buf.write(1, b)
    assert buf.length == 4 and torch.equal(buf.view(), torch.cat([a, b], 2))
    buf.write(2, c[:, :, :2])  # replaces the last two positions exactly: the end is the length
    assert buf.length == 4 and torch.equal(buf.view(), torch.cat([a, b[:, :, :1], c[:, :, :2]], 2))
    buf.write(3, c)  # from inside, past the end
    want = torch.cat([a, b[:, :, :1], c[:, :, :1], c], 2)
    assert buf.length == 7 and buf.data.shape[2] == 7 and torch.equal(buf.view(), want)
    weights = torch.arange(1.0, 8.0, dtype=torch.float64).view(1, 1, 7, 1)
    ga, gb, gc = torch.autograd.grad((buf.view() * weights).sum(), (a, b, c))
    assert torch.equal(ga, torch.full_like(a, 1.0))
    assert torch.equal(gb, torch.cat([torch.full_like(b[:, :, :1], 2.0), torch.zeros_like(b[:, :, 1:])], 2))
    assert torch.equal(gc[:, :, 0], torch.full_like(gc[:, :, 0], 3.0 + 4.0))  # c[0] at positions 2 and 3
    for pos, col in ((1, 5.0), (2, 6.0), (3, 7.0)):
        assert torch.equal(gc[:, :, pos], torch.full_like(gc[:, :, pos], col))
    with pytest.raises(RuntimeError, match=r"^differentiable writes must append at the end of the buffer$"):
        buf.write(2, _kv(2, 4).requires_grad_())
    assert buf.length == 7


def test_a_differentiable_write_at_one_keeps_position_zero() -> None:
    """After an inference write, a differentiable write from position 1 keeps position 0 (the smallest head)."""
    buf = GrowableBuffer(2)
    first = _kv(3, 1)
    buf.write(0, first)
    x = _kv(2, 2).requires_grad_()
    buf.write(1, x)
    assert buf.length == 3 and torch.equal(buf.view(), torch.cat([first[:, :, :1], x], 2))


def test_an_inference_write_never_writes_into_a_tensor_it_was_handed() -> None:
    """After a differentiable write the buffer is that tensor; a later write under no_grad, even one that fits,
    reallocates (the earlier tensor keeps its values, the buffer holds the new ones)."""
    x = _kv(5, 1).requires_grad_()
    kept = x.detach().clone()
    buf = GrowableBuffer(2)
    buf.write(0, x)
    buf.truncate(3)
    y = _kv(1, 2)
    with torch.no_grad():
        buf.write(3, y)
    assert torch.equal(x.detach(), kept)
    assert not buf.data.requires_grad and buf.data.shape[2] == 16
    assert torch.equal(buf.view(), torch.cat([kept[:, :, :3], y], 2))


def test_layer_caches_plain_decomposed_and_with_another_agents_lr() -> None:
    """plain: K and V along dim 2, no V_lr, V is the full value; decomposed: V is V_base, with a V_lr along dim 1 by
    default or none; with_lr: the same K and V_base buffers with the given V_lr, decomposed."""
    plain = LayerCache.plain()
    assert (plain.k.dim, plain.v.dim, plain.v_lr, plain.v_is_base) == (2, 2, None, False)
    assert plain.v_is_base is False and plain.k is not plain.v
    dec = LayerCache.decomposed()
    assert (dec.k.dim, dec.v.dim, dec.v_lr.dim, dec.v_is_base) == (2, 2, 1, True)
    no_lr = LayerCache.decomposed(with_lr=False)
    assert no_lr.v_lr is None and no_lr.v_is_base is True
    other = GrowableBuffer(1)
    shared = no_lr.with_lr(other)
    assert shared.k is no_lr.k and shared.v is no_lr.v and shared.v_lr is other and shared.v_is_base is True
    assert LayerCache.plain().with_lr(other).v_is_base is True


def _fill(layer: LayerCache, n: int) -> None:
    layer.k.write(0, _kv(n, 1, torch.float32))
    layer.v.write(0, _kv(n, 2, torch.float32))
    if layer.v_lr is not None:
        layer.v_lr.write(0, torch.zeros(2, n, 5, dtype=torch.float16))


def test_layer_truncate_and_component_bytes() -> None:
    """A layer's truncate reaches K, V and V_lr (and skips a missing V_lr); its bytes by component: k and v (plain) or
    v_base and v_lr (decomposed)."""
    plain, dec, no_lr = LayerCache.plain(), LayerCache.decomposed(), LayerCache.decomposed(with_lr=False)
    for layer in (plain, dec, no_lr):
        _fill(layer, 6)
    assert plain.component_bytes() == {"k": 6 * 96, "v": 6 * 96}
    assert dec.component_bytes() == {"k": 6 * 96, "v_base": 6 * 96, "v_lr": 6 * 2 * 2 * 5}
    assert no_lr.component_bytes() == {"k": 6 * 96, "v_base": 6 * 96}
    for layer in (plain, dec, no_lr):
        layer.truncate(2)
    assert (dec.length, dec.k.length, dec.v.length, dec.v_lr.length) == (2, 2, 2, 2)
    assert no_lr.length == no_lr.v.length == plain.v.length == 2
    assert dec.component_bytes() == {"k": 2 * 96, "v_base": 2 * 96, "v_lr": 2 * 2 * 2 * 5}


def test_model_cache_layers_truncate_and_bytes_summed() -> None:
    """n layers of the asked form; ``decomposed`` and ``role_split`` as given; length, truncate and bytes over every
    layer (bytes summed by component)."""
    plain = ModelCache(3)
    assert len(plain) == 3 and plain.decomposed is False and plain.role_split is None
    assert all(plain[i].v_lr is None and plain[i].v_is_base is False for i in range(3))
    dec = ModelCache(2, decomposed=True)
    assert dec.decomposed is True and all(dec[i].v_lr is not None and dec[i].v_is_base for i in range(2))
    assert all(layer.v_lr is None for layer in ModelCache(2, decomposed=True, with_lr=False).layers)
    assert len({id(layer) for layer in dec.layers}) == 2
    for i, n in enumerate((5, 5)):
        _fill(dec[i], n)
    assert dec.length == 5
    assert dec.component_bytes() == {"k": 2 * 5 * 96, "v_base": 2 * 5 * 96, "v_lr": 2 * 5 * 20}
    dec.truncate(3)
    assert [layer.length for layer in dec.layers] == [3, 3] and [layer.v_lr.length for layer in dec.layers] == [3, 3]
    assert dec.component_bytes() == {"k": 2 * 3 * 96, "v_base": 2 * 3 * 96, "v_lr": 2 * 3 * 20}
    assert ModelCache(2).component_bytes() == {"k": 0, "v": 0}
