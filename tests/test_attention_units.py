"""lragent/attention.py's CPU paths against attention written out by hand (softmax of the masked scores): the mask,
plain and decomposed attention (per sequence and per query roles, GQA, padding, a chunk at the end of the keys), the
B views, the role values, the two-piece layout, and the switches read from the environment."""

from __future__ import annotations

import pytest
import torch

from lragent import attention
from lragent.attention import (
    RoleSplit,
    _cudnn_wide_values_ok,
    _delta_b,
    _role_values,
    attention_mask,
    compute_dtype,
    decomposed_attention,
    flash_takes_wide_values,
    kernel_available,
    lora_b_per_head,
    plain_attention,
    two_piece_attention,
    two_piece_enabled,
)


def reference(q, k, v, key_mask=None):
    """softmax(Q Kᵀ / sqrt(D) + causal bottom-right + padding) V, KV heads repeated for GQA; float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    lq, lk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    allowed = allowed[None, None].expand(q.shape[0], 1, lq, lk)
    if key_mask is not None:
        own = torch.zeros(lq, lk, dtype=torch.bool)
        own[torch.arange(lq), torch.arange(lk - lq, lk)] = True
        allowed = (allowed & key_mask.bool()[:, None, None, :]) | own[None, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------------------------ the mask


def test_attention_mask_none_only_for_one_query_without_padding():
    assert attention_mask(1, 5, None, torch.device("cpu")) is None
    m = attention_mask(1, 5, torch.ones(2, 5), torch.device("cpu"))
    assert m is not None and m.shape == (2, 1, 1, 5) and bool(m.all())


def test_attention_mask_is_causal_bottom_right():
    m = attention_mask(2, 4, None, torch.device("cpu"))
    assert m.shape == (1, 1, 2, 4) and m.dtype == torch.bool
    assert m[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    m = attention_mask(3, 3, None, torch.device("cpu"))
    assert m[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_attention_mask_with_padding_lets_a_padding_query_see_itself():
    key_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    m = attention_mask(3, 4, key_mask, torch.device("cpu"))
    assert m.shape == (2, 1, 3, 4)
    assert m[0, 0].tolist() == [[False, True, False, False], [False, True, True, False], [False, True, True, True]]
    # the padding queries of sequence 1 (keys 2 and 3) see themselves besides the real keys before them
    assert m[1, 0].tolist() == [[True, True, False, False], [True, True, True, False], [True, True, False, True]]
    one = attention_mask(1, 4, torch.tensor([[1, 1, 1, 0]]), torch.device("cpu"))
    assert one[0, 0].tolist() == [[True, True, True, True]]


def test_attention_mask_on_the_requested_device():
    """Every position tensor is made on ``device``: a mask for another device (meta here) mixes in no host tensor."""
    meta = torch.device("meta")
    m = attention_mask(3, 5, None, meta)
    assert m.device == meta and m.shape == (1, 1, 3, 5) and m.dtype == torch.bool
    m = attention_mask(3, 5, torch.ones(2, 5, device=meta), meta)
    assert m.device == meta and m.shape == (2, 1, 3, 5)


# ------------------------------------------------------------------------------------------------ the switches


def test_flash_takes_wide_values_half_precision_widths_of_8_up_to_256():
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.zeros(1, 1, 1, 8, dtype=dtype)
        assert flash_takes_wide_values(q, torch.zeros(1, 1, 1, 256, dtype=dtype)) is True
        assert flash_takes_wide_values(q, torch.zeros(1, 1, 1, 248, dtype=dtype)) is True
        assert flash_takes_wide_values(q, torch.zeros(1, 1, 1, 8, dtype=dtype)) is True
        assert flash_takes_wide_values(q, torch.zeros(1, 1, 1, 264, dtype=dtype)) is False
        assert flash_takes_wide_values(q, torch.zeros(1, 1, 1, 250, dtype=dtype)) is False
        assert flash_takes_wide_values(q, torch.zeros(1, 1, 1, 12, dtype=dtype)) is False
    q32 = torch.zeros(1, 1, 1, 8)
    assert flash_takes_wide_values(q32, torch.zeros(1, 1, 1, 16)) is False


def test_cudnn_wide_values_switch(monkeypatch):
    monkeypatch.delenv("LRAGENT_WIDE_CUDNN", raising=False)
    monkeypatch.setitem(attention._CUDNN_WIDE_VALUES, "ok", True)
    assert _cudnn_wide_values_ok() is True
    monkeypatch.setenv("LRAGENT_WIDE_CUDNN", "1")
    assert _cudnn_wide_values_ok() is True
    monkeypatch.setenv("LRAGENT_WIDE_CUDNN", "0")
    assert _cudnn_wide_values_ok() is False
    monkeypatch.setenv("LRAGENT_WIDE_CUDNN", "1")
    monkeypatch.setitem(attention._CUDNN_WIDE_VALUES, "ok", False)
    assert _cudnn_wide_values_ok() is False


def test_two_piece_switch(monkeypatch):
    monkeypatch.delenv("LRAGENT_TWO_PIECE", raising=False)
    assert two_piece_enabled() is True
    monkeypatch.setenv("LRAGENT_TWO_PIECE", "0")
    assert two_piece_enabled() is False
    monkeypatch.setenv("LRAGENT_TWO_PIECE", "1")
    assert two_piece_enabled() is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answers")
def test_compute_dtype_and_kernel_on_the_cpu():
    assert kernel_available() is False
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert compute_dtype(torch.zeros(1, dtype=dtype)) == dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(torch.zeros(1)) == torch.float32  # only CUDA's autocast is SDPA's


def test_compute_dtype_of_a_cpu_tensor_ignores_cuda_autocast():
    """CUDA autocast casts CUDA tensors only: a host tensor keeps its dtype while it is on (flag, dtype restored)."""
    was_on, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        assert torch.is_autocast_enabled("cuda")
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            assert compute_dtype(torch.zeros(1, dtype=dtype)) == dtype
    finally:
        torch.set_autocast_enabled("cuda", was_on)
        torch.set_autocast_dtype("cuda", was_dtype)


# ------------------------------------------------------------------------------------------------ plain attention


@pytest.mark.parametrize(
    "h_q, h_kv, lq, lk, masked",
    [(2, 2, 5, 5, False), (4, 2, 5, 5, False), (4, 1, 3, 7, False), (2, 2, 1, 6, False), (4, 2, 4, 6, True),
     (2, 2, 6, 6, True), (4, 2, 1, 5, True)],
)  # fmt: skip
def test_plain_attention_equals_the_written_out_softmax(h_q, h_kv, lq, lk, masked):
    q, k, v = randn(2, h_q, lq, 8, seed=1), randn(2, h_kv, lk, 8, seed=2), randn(2, h_kv, lk, 8, seed=3)
    key_mask = torch.tensor([[0] * 2 + [1] * (lk - 2), [1] * (lk - 1) + [0]]) if masked else None
    got = plain_attention(q, k, v, key_mask)
    assert got.shape == (2, h_q, lq, 8) and got.dtype == torch.float64
    assert torch.allclose(got, reference(q, k, v, key_mask), atol=1e-10, rtol=0)


def test_plain_attention_values_wider_than_queries():
    q, k, v = randn(1, 4, 5, 8, seed=1), randn(1, 2, 5, 8, seed=2), randn(1, 2, 5, 11, seed=3)
    assert torch.allclose(plain_attention(q, k, v), reference(q, k, v), atol=1e-10, rtol=0)


def test_plain_attention_in_training_keeps_gradients():
    q, k, v = (randn(1, 2, 6, 8, seed=s).requires_grad_() for s in (1, 2, 3))
    with torch.enable_grad():
        got = plain_attention(q, k, v)
        want = reference(q, k, v)
    gq, gk, gv = torch.autograd.grad(got.sum(), (q, k, v))
    wq, wk, wv = torch.autograd.grad(want.sum(), (q, k, v))
    assert torch.allclose(gq, wq, atol=1e-10) and torch.allclose(gk, wk, atol=1e-10)
    assert torch.allclose(gv, wv, atol=1e-10)


@pytest.mark.parametrize("h_q, h_kv", [(2, 2), (4, 2)])
def test_plain_attention_builds_its_mask_on_the_queries_device(h_q, h_kv):
    """The padding mask is made on q's device (meta here: shapes only), not the default one."""
    meta = torch.device("meta")
    q = torch.empty(2, h_q, 3, 8, device=meta)
    k, v = torch.empty(2, h_kv, 5, 8, device=meta), torch.empty(2, h_kv, 5, 8, device=meta)
    got = plain_attention(q, k, v, torch.ones(2, 5, device=meta))
    assert got.device == meta and got.shape == (2, h_q, 3, 8)


# ------------------------------------------------------------------------------------------- decomposed attention


def test_lora_b_per_head_is_a_view_per_kv_head():
    lora_b = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # 2 roles, H_kv 2 x D 3, r 3
    heads = lora_b_per_head(lora_b, 2)
    assert heads.shape == (2, 2, 3, 3)
    assert heads.data_ptr() == lora_b.data_ptr()
    for role in range(2):
        for h in range(2):
            assert torch.equal(heads[role, h], lora_b[role, h * 3 : (h + 1) * 3].T)
    assert lora_b_per_head(torch.zeros(3, 8, 2), 4).shape == (3, 4, 2, 2)


def decomposed_reference(q, k, v_base, v_lr, lora_b, s, roles, key_mask=None):
    """P V_base + P (V_lr B_role) s per query, with V_lr B computed in full."""
    b, h_kv, lk, d = v_base.shape
    heads = lora_b_per_head(lora_b, h_kv).double()  # (n, H_kv, r, D)
    if roles.dim() == 1:
        roles = roles[:, None].expand(b, q.shape[2])
    out = []
    for i in range(q.shape[2]):  # query i with its own role's values
        values = torch.stack([v_base[bb].double() + s * torch.einsum("lr,hrd->hld", v_lr[bb].double(),
                              heads[roles[bb, i]]) for bb in range(b)])  # fmt: skip
        out.append(reference(q, k, values, key_mask)[:, :, i])
    return torch.stack(out, 2)


@pytest.mark.parametrize("per_query, masked, lq", [(False, False, 6), (True, False, 6), (False, True, 6),
                                                   (True, True, 4), (False, False, 3), (False, True, 1)])  # fmt: skip
def test_decomposed_attention_equals_the_values_built_in_full(per_query, masked, lq):
    b, h_q, h_kv, lk, d, r = 2, 4, 2, 6, 8, 3
    q, k = randn(b, h_q, lq, d, seed=1), randn(b, h_kv, lk, d, seed=2)
    v_base, v_lr, lora_b = randn(b, h_kv, lk, d, seed=3), randn(b, lk, r, seed=4), randn(3, h_kv * d, r, seed=5)
    roles = torch.tensor([[0, 2, 1, 1, 0, 2][:lq], [2, 2, 0, 1, 1, 0][:lq]]) if per_query else torch.tensor([2, 1])
    key_mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]) if masked else None
    got = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.7, roles, key_mask)
    assert got.shape == (b, h_q, lq, d)
    want = decomposed_reference(q, k, v_base, v_lr, lora_b, 0.7, roles, key_mask)
    assert torch.allclose(got, want, atol=1e-10, rtol=0), (got - want).abs().max()
    off = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.7, roles, key_mask, use_kernel=False)
    assert torch.equal(got, off)  # no kernel on the CPU: the same path


def test_decomposed_attention_scaling_and_roles_matter():
    b, h_q, h_kv, n, d, r = 1, 2, 1, 5, 4, 2
    q, k = randn(b, h_q, n, d, seed=1), randn(b, h_kv, n, d, seed=2)
    v_base, v_lr, lora_b = randn(b, h_kv, n, d, seed=3), randn(b, n, r, seed=4), randn(2, h_kv * d, r, seed=5)
    base = plain_attention(q, k, v_base)
    zero = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.0, torch.tensor([1]))
    assert torch.allclose(zero, base, atol=1e-12)
    one = decomposed_attention(q, k, v_base, v_lr, lora_b, 1.0, torch.tensor([1]))
    two = decomposed_attention(q, k, v_base, v_lr, lora_b, 2.0, torch.tensor([1]))
    assert torch.allclose(two - base, 2 * (one - base), atol=1e-10)
    other = decomposed_attention(q, k, v_base, v_lr, lora_b, 1.0, torch.tensor([0]))
    assert not torch.allclose(one, other)


# -------------------------------------------------------------------------------------------- role values, ΔB


def test_role_values_per_sequence():
    b, n, h_kv, d, r = 3, 4, 2, 3, 2
    v_rows, v_lr, lora_b = randn(b, n, h_kv * d, seed=1), randn(b, n, r, seed=2), randn(3, h_kv * d, r, seed=3)
    roles = torch.tensor([2, 0, 2])
    got = _role_values(v_rows, v_lr, lora_b, roles, 0.5)
    want = torch.stack([v_rows[i] + 0.5 * v_lr[i] @ lora_b[roles[i]].T for i in range(b)])
    assert got.shape == (b, n, h_kv * d) and torch.allclose(got, want, atol=1e-12)
    assert torch.equal(v_rows, randn(b, n, h_kv * d, seed=1))  # not written in place


@pytest.mark.parametrize("dtype, out", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                        (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])  # fmt: skip
def test_delta_b_is_the_scaled_difference_per_sequence(dtype, out):
    lora_b = randn(3, 2 * 4, 2, seed=1).to(dtype)
    r = torch.zeros(2, dtype=torch.long)
    layout = RoleSplit.make(torch.tensor([0, 2]), torch.tensor([1, 2]), torch.tensor([1, 2]), 4)
    got = _delta_b(lora_b, layout, 2, 0.5)
    heads = lora_b_per_head(lora_b, 2)
    assert got.dtype == out and got.shape == (2, 2, 2, 4)
    assert torch.allclose(got.double(), ((heads[[1, 2]] - heads[[0, 2]]) * 0.5).double(), atol=1e-2)
    assert float(got[1].abs().max()) == 0.0 and float(got[0].abs().max()) > 0
    del r


# ------------------------------------------------------------------------------------------------- the layout


def test_role_split_layout_fields():
    p, c = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0])
    lay = RoleSplit.make(p, c, torch.tensor([2, -3, 9]), 6)  # clamped to [0, 6]
    assert lay.length == 6 and lay.split.tolist() == [2, 0, 6] and lay.split.dtype == torch.long
    assert lay.producer is p and lay.consumer is c
    rows = lay.rows
    assert rows.start.tolist() == [2, 0, 6] and rows.count.tolist() == [4, 6, 0] and rows.cu.tolist() == [0, 4, 10, 10]
    assert rows.row_seq.tolist() == [0] * 4 + [1] * 6 and rows.row_pos.tolist() == [2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert rows.max_count == 6 and rows.max_end == 6 and rows.n_rows == 10
    assert rows.start.dtype == rows.count.dtype == rows.cu.dtype == torch.int32
    assert rows.row_seq.dtype == rows.row_pos.dtype == torch.long


def test_role_split_layout_with_ends():
    z = torch.zeros(3, dtype=torch.long)
    rows = RoleSplit.make(z, z, torch.tensor([1, 3, 2]), 8, torch.tensor([5, 2, 9])).rows  # end 9 clamps to 8
    assert rows.start.tolist() == [1, 3, 2] and rows.count.tolist() == [4, 0, 6]
    assert rows.row_pos.tolist() == [1, 2, 3, 4, 2, 3, 4, 5, 6, 7] and rows.row_seq.tolist() == [0] * 4 + [2] * 6
    assert rows.max_count == 6 and rows.max_end == 8
    rows = RoleSplit.make(z[:2], z[:2], torch.tensor([4, 1]), 8, torch.tensor([6, 3])).rows
    assert rows.max_end == 6 and rows.max_count == 2  # the largest end of a sequence with rows, not its count
    rows = RoleSplit.make(z[:2], z[:2], torch.tensor([3, 5]), 8, torch.tensor([-1, 5])).rows  # no rows at all
    assert rows.count.tolist() == [0, 0] and rows.max_count == 0 and rows.max_end == 0 and rows.n_rows == 0
    assert rows.row_pos.tolist() == [] and rows.cu.tolist() == [0, 0, 0]
    empty = RoleSplit.make(z[:0], z[:0], torch.tensor([], dtype=torch.long), 8).rows
    assert empty.max_count == 0 and empty.max_end == 0 and empty.cu.tolist() == [0]


def test_role_split_layout_on_the_producers_device():
    """split and every row tensor go to the producer's device (meta here); the host-side maxima stay exact."""
    meta = torch.device("meta")
    p, c = torch.tensor([0, 1], device=meta), torch.tensor([1, 0], device=meta)
    for ends in (None, torch.tensor([3, 6])):
        lay = RoleSplit.make(p, c, torch.tensor([1, 2]), 6, ends)
        rows = lay.rows
        for name, x in (("split", lay.split), ("start", rows.start), ("count", rows.count), ("cu", rows.cu),
                        ("row_seq", rows.row_seq), ("row_pos", rows.row_pos)):  # fmt: skip
            assert x.device == meta, name
        assert lay.split.dtype == rows.row_seq.dtype == rows.row_pos.dtype == torch.long
        assert rows.start.dtype == rows.count.dtype == rows.cu.dtype == torch.int32
        assert rows.row_pos.shape == (2 + 4 if ends is not None else 5 + 4,)
        assert (rows.max_count, rows.max_end) == ((4, 6) if ends is not None else (5, 6))


def test_role_split_reads_the_split_exactly_whatever_the_ends_dtype():
    """ends as floats (a float mask's sums) are read as integers: the split is not rounded to ends' dtype (past
    2**24 a float32 holds even integers only)."""
    big = 2**24
    z = torch.zeros(1, dtype=torch.long)
    for ends in (torch.tensor([big + 2.0]), torch.tensor([big + 2], dtype=torch.int32), torch.tensor([big + 2])):
        lay = RoleSplit.make(z, z, torch.tensor([big + 1]), big + 4, ends)
        assert lay.split.tolist() == [big + 1], ends.dtype
        assert lay.rows.start.tolist() == [big + 1] and lay.rows.count.tolist() == [1], ends.dtype
        assert lay.rows.row_pos.tolist() == [big + 1] and lay.rows.max_end == big + 2, ends.dtype


# ---------------------------------------------------------------------------------------------- two pieces


def test_two_piece_attention_without_consumer_rows_is_the_producers_attention():
    b, h_q, h_kv, t, d, r = 2, 4, 2, 6, 8, 3
    q, k = randn(b, h_q, t, d, seed=1), randn(b, h_kv, t, d, seed=2)
    v_base, v_lr, lora_b = randn(b, h_kv, t, d, seed=3), randn(b, t, r, seed=4), randn(3, h_kv * d, r, seed=5)
    layout = RoleSplit.make(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([6, 6]), t)
    got = two_piece_attention(q, k, v_base, v_lr, lora_b, 0.7, layout)
    want = decomposed_reference(q, k, v_base, v_lr, lora_b, 0.7, torch.tensor([1, 2]))
    assert torch.allclose(got, want, atol=1e-10)
    layout = RoleSplit.make(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([2, 4]), t)
    got = two_piece_attention(q, k, v_base, v_lr, lora_b, 0.7, layout)
    roles = torch.tensor([[1, 1, 0, 0, 0, 0], [2, 2, 2, 2, 0, 0]])
    assert torch.allclose(got, decomposed_reference(q, k, v_base, v_lr, lora_b, 0.7, roles), atol=1e-10)


def test_two_piece_attention_gradients_without_lora_b_grad():
    b, h_q, h_kv, t, d, r = 2, 2, 1, 5, 4, 2
    q, k = randn(b, h_q, t, d, seed=1).requires_grad_(), randn(b, h_kv, t, d, seed=2).requires_grad_()
    v_base, v_lr = randn(b, h_kv, t, d, seed=3).requires_grad_(), randn(b, t, r, seed=4).requires_grad_()
    lora_b = randn(2, h_kv * d, r, seed=5)  # frozen B: no gradient asked for it
    layout = RoleSplit.make(torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([2, 3]), t)
    roles = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    got = two_piece_attention(q, k, v_base, v_lr, lora_b, 0.5, layout)
    want = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.5, roles)
    assert torch.allclose(got, want, atol=1e-10)
    gg = torch.autograd.grad(got.square().sum(), (q, k, v_base, v_lr))
    gw = torch.autograd.grad(want.square().sum(), (q, k, v_base, v_lr))
    for a, w in zip(gg, gw, strict=True):
        assert torch.allclose(a, w, atol=1e-9)


def test_two_piece_attention_lora_b_gradient():
    b, h_q, h_kv, t, d, r = 2, 2, 2, 5, 4, 2
    q, k = randn(b, h_q, t, d, seed=1), randn(b, h_kv, t, d, seed=2)
    v_base, v_lr = randn(b, h_kv, t, d, seed=3), randn(b, t, r, seed=4)
    lora_b = randn(3, h_kv * d, r, seed=5).requires_grad_()
    layout = RoleSplit.make(torch.tensor([2, 0]), torch.tensor([0, 1]), torch.tensor([2, 1]), t)
    roles = torch.tensor([[2, 2, 0, 0, 0], [0, 1, 1, 1, 1]])
    got = two_piece_attention(q, k, v_base, v_lr, lora_b, 0.5, layout)
    want = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.5, roles)
    (g,) = torch.autograd.grad((got * randn(*got.shape, seed=9)).sum(), (lora_b,))
    (w,) = torch.autograd.grad((want * randn(*want.shape, seed=9)).sum(), (lora_b,))
    assert g.dtype == lora_b.dtype and g.shape == lora_b.shape
    assert torch.allclose(g, w, atol=1e-9)


# ------------------------------------------------------------------------------------------- dtypes and edges


def test_two_piece_attention_computes_in_the_query_dtype():
    b, h_q, h_kv, t, d, r = 2, 2, 1, 5, 4, 2
    q, k = randn(b, h_q, t, d, seed=1, dtype=torch.float32), randn(b, h_kv, t, d, seed=2)  # keys etc. in float64
    v_base, v_lr, lora_b = randn(b, h_kv, t, d, seed=3), randn(b, t, r, seed=4), randn(2, h_kv * d, r, seed=5)
    layout = RoleSplit.make(torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([2, 3]), t)
    got = two_piece_attention(q, k, v_base, v_lr, lora_b, 0.5, layout)
    assert got.dtype == torch.float32
    roles = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]])
    want = decomposed_reference(q.double(), k, v_base, v_lr, lora_b, 0.5, roles)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_two_piece_attention_refuses_other_lengths_naming_them():
    b, t = 2, 5
    q, k = randn(b, 2, t, 4, seed=1), randn(b, 1, t, 4, seed=2)
    v_base, v_lr, lora_b = randn(b, 1, t, 4, seed=3), randn(b, t, 2, seed=4), randn(2, 4, 2, seed=5)
    z = torch.zeros(b, dtype=torch.long)
    for q_len, k_len, length in ((t, t, t + 1), (t, t - 1, t), (t - 1, t, t)):
        layout = RoleSplit.make(z, z + 1, torch.tensor([1, 2]), length)
        with pytest.raises(ValueError) as err:
            two_piece_attention(q[:, :, :q_len], k[:, :, :k_len], v_base, v_lr, lora_b, 0.5, layout)
        assert str(err.value) == (
            f"two-piece attention needs as many queries as keys as the layout's length, got {q_len}, {k_len} and "
            f"{length}"
        )


@pytest.mark.parametrize("per_query", [False, True])
def test_decomposed_attention_with_adapters_in_another_dtype(per_query):
    b, h_q, h_kv, n, d, r = 2, 2, 1, 5, 4, 2
    q, k = randn(b, h_q, n, d, seed=1), randn(b, h_kv, n, d, seed=2)
    v_base, v_lr = randn(b, h_kv, n, d, seed=3), randn(b, n, r, seed=4)
    lora_b = randn(3, h_kv * d, r, seed=5, dtype=torch.float32)
    # roles 0 and 1 only, of 3: the one-hot must still be 3 wide
    roles = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 0, 0, 1]]) if per_query else torch.tensor([1, 0])
    got = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.5, roles)
    assert got.dtype == torch.float64
    want = decomposed_reference(q, k, v_base, v_lr, lora_b.double(), 0.5, roles)
    assert torch.allclose(got, want, atol=1e-6)


def test_role_values_with_adapters_in_another_dtype():
    v_rows, v_lr = randn(2, 3, 4, seed=1), randn(2, 3, 2, seed=2)
    lora_b = randn(2, 4, 2, seed=3, dtype=torch.float32)
    got = _role_values(v_rows, v_lr, lora_b, torch.tensor([1, 0]), 2.0)
    assert got.dtype == torch.float64
    want = torch.stack([v_rows[i] + 2.0 * v_lr[i] @ lora_b[role].double().T for i, role in enumerate([1, 0])])
    assert torch.allclose(got, want, atol=1e-6)


def test_role_split_empty_layouts_keep_integer_dtypes():
    z = torch.zeros(0, dtype=torch.long)
    lay = RoleSplit.make(z, z, z, 8)
    assert lay.split.dtype == torch.long and lay.split.tolist() == []
    assert lay.rows.row_pos.dtype == torch.long and lay.rows.row_pos.tolist() == []
    assert lay.rows.row_seq.tolist() == [] and lay.rows.n_rows == 0
    one = torch.zeros(1, dtype=torch.long)
    rows = RoleSplit.make(one, one, one, 8, one).rows  # split 0, end 0: no rows
    assert rows.count.tolist() == [0] and rows.row_pos.tolist() == [] and rows.max_end == 0
    assert rows.row_pos.dtype == torch.long


def test_two_piece_attention_gradient_of_the_queries_alone():
    b, h_q, h_kv, t, d, r = 2, 2, 1, 6, 4, 2
    q = randn(b, h_q, t, d, seed=1).requires_grad_()
    k, v_base, v_lr, lora_b = (
        randn(b, h_kv, t, d, seed=2),
        randn(b, h_kv, t, d, seed=3),
        randn(b, t, r, seed=4),
        randn(2, h_kv * d, r, seed=5),
    )
    layout = RoleSplit.make(torch.tensor([1, 0]), torch.tensor([0, 1]), torch.tensor([2, 4]), t)
    roles = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]])
    weights = randn(b, h_q, t, d, seed=7)
    got = two_piece_attention(q, k, v_base, v_lr, lora_b, 0.5, layout)
    (g,) = torch.autograd.grad((got * weights).sum(), (q,))
    want = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.5, roles)
    (w,) = torch.autograd.grad((want * weights).sum(), (q,))
    assert torch.allclose(g, w, atol=1e-9)
    for only in ("k", "v_base"):
        x = {"k": k.clone(), "v_base": v_base.clone()}
        x[only].requires_grad_()
        got = two_piece_attention(q.detach(), x["k"], x["v_base"], v_lr, lora_b, 0.5, layout)
        (g,) = torch.autograd.grad((got * weights).sum(), (x[only],))
        want = decomposed_attention(q.detach(), x["k"], x["v_base"], v_lr, lora_b, 0.5, roles)
        (w,) = torch.autograd.grad((want * weights).sum(), (x[only],))
        assert torch.allclose(g, w, atol=1e-9), only


def test_two_piece_attention_gradients_in_float32():
    """In float32 the CPU attention's backward reads its own output buffer, which the correction wrote into: the
    backward must put the attention's rows back first (and the corrected ones after)."""
    g = torch.Generator().manual_seed(0)
    b, h_q, h_kv, t, d, r = 2, 4, 2, 24, 8, 3
    x = {
        "q": torch.randn(b, h_q, t, d, generator=g),
        "k": torch.randn(b, h_kv, t, d, generator=g),
        "v_base": torch.randn(b, h_kv, t, d, generator=g),
        "v_lr": torch.randn(b, t, r, generator=g),
        "lora_b": torch.randn(3, h_kv * d, r, generator=g),
    }
    x = {k: v.requires_grad_() for k, v in x.items()}
    split, prod, cons = torch.tensor([5, 17]), torch.tensor([1, 2]), torch.tensor([0, 1])
    layout = RoleSplit.make(prod, cons, split, t)
    roles = torch.where(torch.arange(t)[None, :] < split[:, None], prod[:, None], cons[:, None])
    ours = two_piece_attention(x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], 0.7, layout)
    ref = decomposed_attention(x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], 0.7, roles)
    assert torch.allclose(ours, ref, atol=1e-5)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    before = ours.detach().clone()
    got = torch.autograd.grad(ours, list(x.values()), weights)
    assert torch.equal(ours.detach(), before)  # the output a caller holds is the same after the backward
    want = torch.autograd.grad(ref, list(x.values()), weights)
    for name, a, w in zip(x, got, want, strict=True):
        assert torch.allclose(a, w, atol=1e-4), (name, (a - w).abs().max())


@pytest.mark.parametrize("h_q, h_kv, n", [(4, 2, 2), (4, 2, 4), (2, 2, 4)])
def test_plain_attention_heads_against_lengths(h_q, h_kv, n):
    """GQA decided by the head counts, not by a length that happens to equal one of them."""
    q, k, v = randn(1, h_q, n, 8, seed=1), randn(1, h_kv, n, 8, seed=2), randn(1, h_kv, n, 8, seed=3)
    assert torch.allclose(plain_attention(q, k, v), reference(q, k, v), atol=1e-10, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of half-precision queries")
@pytest.mark.parametrize("width", [8, 16])
def test_plain_attention_in_half_precision_on_the_cpu(monkeypatch, width):
    """No CUDA-only route on the CPU: the padding mask is applied, and cuDNN is never tried (its switch stays on)."""
    monkeypatch.setitem(attention._CUDNN_WIDE_VALUES, "ok", True)
    monkeypatch.delenv("LRAGENT_WIDE_CUDNN", raising=False)
    q = randn(2, 2, 4, 8, seed=1).to(torch.bfloat16)
    k = randn(2, 2, 6, 8, seed=2).to(torch.bfloat16)
    v = randn(2, 2, 6, width, seed=3).to(torch.bfloat16)
    key_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    got = plain_attention(q, k, v, key_mask)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), reference(q, k, v, key_mask), atol=3e-2)
    square = plain_attention(q, k[:, :, :4], v[:, :, :4])  # queries = keys, no mask
    assert torch.allclose(square.double(), reference(q, k[:, :, :4], v[:, :, :4]), atol=3e-2)
    assert _cudnn_wide_values_ok() is True


# ------------------------------------------------------------------ the CUDA routes' arithmetic, run on the CPU
# _sdpa picks SDPA backends for CUDA tensors (cuDNN for wide values, FlashAttention with zero-padded Q/K, expanded KV
# heads, the bottom-right causal bias, no cuDNN in training). Which backend runs needs a GPU; what each route computes
# does not: answering True for the route runs that arithmetic on host tensors, checked against the written-out
# softmax, and a spy on sdpa_kernel (the real one still runs) records which backends each route asked for.


@pytest.fixture
def cuda_route(monkeypatch):
    """The CUDA routes on host tensors; the backend lists requested, in order; cuDNN's switch on and untouched."""
    monkeypatch.setattr(attention, "_cuda_route", lambda t: True)
    monkeypatch.setitem(attention._CUDNN_WIDE_VALUES, "ok", True)
    monkeypatch.delenv("LRAGENT_WIDE_CUDNN", raising=False)
    asked = []
    real = attention.sdpa_kernel

    def spy(backends):
        asked.append(list(backends))
        return real(backends)

    monkeypatch.setattr(attention, "sdpa_kernel", spy)
    return asked


@pytest.fixture
def cuda_autocast():
    """CUDA autocast's flag on in bfloat16 (a thread-local flag: settable without a GPU), restored after."""
    was_on, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    yield
    torch.set_autocast_enabled("cuda", was_on)
    torch.set_autocast_dtype("cuda", was_dtype)


def test_compute_dtype_on_the_cuda_route(cuda_route, cuda_autocast):
    """On CUDA, autocast's dtype while it is on; its own dtype once it is off."""
    for dtype in (torch.float32, torch.float64, torch.float16):
        assert compute_dtype(torch.zeros(1, dtype=dtype)) == torch.bfloat16
    torch.set_autocast_enabled("cuda", False)
    for dtype in (torch.float32, torch.float16):
        assert compute_dtype(torch.zeros(1, dtype=dtype)) == dtype


@pytest.mark.parametrize("h_q, h_kv", [(4, 2), (2, 2)])
def test_wide_values_try_cudnn_once_then_pad_queries_and_keys(cuda_route, caplog, h_q, h_kv):
    """Values wider than Q/K in half precision: cuDNN is asked first; refused (as here), the refusal is logged and
    remembered, and FlashAttention's route (Q and K zero-padded to V's width, the scale still 1/sqrt(D)) gives the
    softmax written out. The second call goes straight to the padded route."""
    caplog.set_level("INFO", logger="lragent.attention")
    q = randn(2, h_q, 5, 8, seed=1).to(torch.bfloat16)
    k, v = randn(2, h_kv, 5, 8, seed=2).to(torch.bfloat16), randn(2, h_kv, 5, 24, seed=3).to(torch.bfloat16)
    got = plain_attention(q, k, v)
    assert got.dtype == torch.bfloat16 and got.shape == (2, h_q, 5, 24)
    assert torch.allclose(got.double(), reference(q, k, v), atol=3e-2)
    assert cuda_route == [[attention.SDPBackend.CUDNN_ATTENTION]]
    assert attention._CUDNN_WIDE_VALUES["ok"] is False
    (record,) = [r for r in caplog.records if r.name == "lragent.attention"]
    message = record.getMessage()
    assert message.startswith("cuDNN attention refused values wider than Q/K (") and message.endswith("); padding Q/K")
    assert "No viable backend" in message  # the refusal's own text
    again = plain_attention(q, k, v)
    assert torch.equal(again, got) and cuda_route == [[attention.SDPBackend.CUDNN_ATTENTION]]
    assert len([r for r in caplog.records if r.name == "lragent.attention"]) == 1


def test_wide_values_without_cudnn_when_switched_off(cuda_route, monkeypatch):
    monkeypatch.setenv("LRAGENT_WIDE_CUDNN", "0")
    q, k = randn(1, 4, 6, 8, seed=1).to(torch.float16), randn(1, 2, 6, 8, seed=2).to(torch.float16)
    v = randn(1, 2, 6, 16, seed=3).to(torch.float16)
    got = plain_attention(q, k, v)
    assert got.dtype == torch.float16 and torch.allclose(got.double(), reference(q, k, v), atol=3e-2)
    assert cuda_route == [] and attention._CUDNN_WIDE_VALUES["ok"] is True


def test_wide_values_in_float32_under_autocast_take_the_padded_half_precision_route(cuda_route, cuda_autocast):
    """Training's shared pass: RoPE leaves Q/K in float32 and autocast computes SDPA in bfloat16, so the route casts
    all three to it (the output is bfloat16)."""
    q, k, v = randn(1, 4, 5, 8, seed=1).float(), randn(1, 2, 5, 8, seed=2).float(), randn(1, 2, 5, 16, seed=3).float()
    got = plain_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), reference(q, k, v), atol=3e-2)
    assert cuda_route == [[attention.SDPBackend.CUDNN_ATTENTION]]


@pytest.mark.parametrize("h_q, h_kv", [(6, 2), (4, 1)])
def test_wide_values_in_float32_with_gqa_expand_the_kv_heads(cuda_route, h_q, h_kv):
    """float32 (no FlashAttention): GQA with wide values takes expanded KV heads; same values, no backend asked."""
    q, k, v = randn(2, h_q, 7, 8, seed=1), randn(2, h_kv, 7, 8, seed=2), randn(2, h_kv, 7, 12, seed=3)
    got = plain_attention(q, k, v)
    assert got.shape == (2, h_q, 7, 12) and torch.allclose(got, reference(q, k, v), atol=1e-10, rtol=0)
    assert cuda_route == []


@pytest.mark.parametrize("h_q, h_kv", [(4, 2), (2, 2)])
def test_training_on_cuda_asks_for_every_backend_but_cudnn(cuda_route, h_q, h_kv):
    q, k, v = randn(1, h_q, 6, 8, seed=1), randn(1, h_kv, 6, 8, seed=2), randn(1, h_kv, 6, 8, seed=3)
    with torch.no_grad():  # inference: torch's own choice
        assert torch.allclose(plain_attention(q, k, v), reference(q, k, v), atol=1e-10, rtol=0)
    assert cuda_route == []
    for trained in ("q", "k", "v"):
        x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        x[trained].requires_grad_()
        with torch.enable_grad():
            got = plain_attention(x["q"], x["k"], x["v"])
            (grad,) = torch.autograd.grad(got.sum(), x[trained])
            want = reference(x["q"], x["k"], x["v"])
            (wgrad,) = torch.autograd.grad(want.sum(), x[trained])
        assert torch.allclose(got, want, atol=1e-10) and torch.allclose(grad, wgrad, atol=1e-10)
    assert cuda_route == [attention._NO_CUDNN] * 3
    with torch.no_grad():  # a tensor that requires gradients, with gradients off: inference
        plain_attention(q.clone().requires_grad_(), k, v)
    assert len(cuda_route) == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q, h_kv, lq, lk", [(4, 2, 3, 7), (2, 2, 1, 5), (4, 1, 6, 9)])
def test_a_chunk_at_the_end_of_the_keys_takes_the_bottom_right_causal_bias(cuda_route, dtype, h_q, h_kv, lq, lk):
    q = randn(2, h_q, lq, 8, seed=1).to(dtype)
    k, v = randn(2, h_kv, lk, 8, seed=2).to(dtype), randn(2, h_kv, lk, 8, seed=3).to(dtype)
    got = plain_attention(q, k, v)
    assert got.dtype == dtype and got.shape == (2, h_q, lq, 8)
    assert torch.allclose(got.double(), reference(q, k, v), atol=3e-2)


def test_a_float32_chunk_under_autocast_is_cast_for_the_bottom_right_bias(cuda_route, cuda_autocast):
    q, k, v = randn(1, 4, 3, 8, seed=1).float(), randn(1, 2, 7, 8, seed=2).float(), randn(1, 2, 7, 8, seed=3).float()
    got = plain_attention(q, k, v)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.double(), reference(q, k, v), atol=3e-2)


@pytest.mark.parametrize("h_q, h_kv, lq, lk", [(6, 2, 4, 7), (4, 1, 7, 7), (4, 2, 1, 5)])
def test_masked_gqa_on_cuda_expands_the_kv_heads(cuda_route, h_q, h_kv, lq, lk):
    """cuDNN's masked GQA kernel failed on an H200: the route expands the KV heads instead. Same values."""
    q, k, v = randn(2, h_q, lq, 8, seed=1), randn(2, h_kv, lk, 8, seed=2), randn(2, h_kv, lk, 8, seed=3)
    key_mask = torch.tensor([[0, 0] + [1] * (lk - 2), [1] * (lk - 1) + [0]])
    got = plain_attention(q, k, v, key_mask)
    assert got.shape == (2, h_q, lq, 8) and torch.allclose(got, reference(q, k, v, key_mask), atol=1e-10, rtol=0)
    assert cuda_route == []


def test_kernel_available_with_cuda_imports_the_kernel(monkeypatch, caplog):
    """With CUDA present (answered True here), the kernel is available when its module imports, and unavailable,
    with one warning naming the import error, when it does not (triton missing)."""
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernel_available() is True
    monkeypatch.setitem(sys.modules, "kernels.flash_lora_attention", None)  # import raises ImportError
    caplog.set_level("WARNING", logger="lragent.attention")
    assert kernel_available() is False
    (record,) = [r for r in caplog.records if r.name == "lragent.attention"]
    message = record.getMessage()
    assert message.startswith("fused kernel unavailable (") and message.endswith("); using the PyTorch path")
    assert "kernels.flash_lora_attention" in message


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Each SDPA call's shapes and keyword arguments, in order (the real SDPA still runs)."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), **kwargs})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("h_q, h_kv", [(4, 2), (2, 2)])
def test_wide_values_calls_cudnn_as_they_are_then_flash_with_padded_queries(cuda_route, sdpa_calls, h_q, h_kv):
    """cuDNN gets Q/K 8 wide and V 24 wide, GQA by the head counts, the scale of 8; the padded call gets all three 24
    wide (FlashAttention takes one width) with the same scale."""
    q = randn(1, h_q, 5, 8, seed=1).to(torch.bfloat16)
    k, v = randn(1, h_kv, 5, 8, seed=2).to(torch.bfloat16), randn(1, h_kv, 5, 24, seed=3).to(torch.bfloat16)
    plain_attention(q, k, v)
    scale, gqa = 8**-0.5, h_q != h_kv
    assert sdpa_calls == [
        {"q": (1, h_q, 5, 8), "k": (1, h_kv, 5, 8), "v": (1, h_kv, 5, 24), "is_causal": True, "enable_gqa": gqa,
         "scale": scale},
        {"q": (1, h_q, 5, 24), "k": (1, h_kv, 5, 24), "v": (1, h_kv, 5, 24), "is_causal": True, "enable_gqa": gqa,
         "scale": scale},
    ]  # fmt: skip


def test_square_half_precision_values_as_wide_as_queries_ask_for_no_backend(cuda_route, sdpa_calls):
    q, k, v = (randn(1, h, 5, 8, seed=s).to(torch.bfloat16) for s, h in ((1, 4), (2, 2), (3, 2)))
    got = plain_attention(q, k, v)
    assert torch.allclose(got.double(), reference(q, k, v), atol=3e-2)
    assert cuda_route == [] and attention._CUDNN_WIDE_VALUES["ok"] is True
    assert sdpa_calls == [{"q": (1, 4, 5, 8), "k": (1, 2, 5, 8), "v": (1, 2, 5, 8), "is_causal": True,
                           "enable_gqa": True}]  # fmt: skip


@pytest.mark.parametrize("h_q, h_kv, lq, lk", [(6, 2, 4, 7), (4, 2, 1, 5)])
def test_masked_gqa_calls_sdpa_with_expanded_heads(cuda_route, sdpa_calls, h_q, h_kv, lq, lk):
    q, k, v = randn(1, h_q, lq, 8, seed=1), randn(1, h_kv, lk, 8, seed=2), randn(1, h_kv, lk, 8, seed=3)
    plain_attention(q, k, v, torch.tensor([[0] + [1] * (lk - 1)]))
    ((call),) = sdpa_calls
    assert call["k"] == call["v"] == (1, h_q, lk, 8) and call["enable_gqa"] is False
    assert call["attn_mask"].shape == (1, 1, lq, lk)


def test_unmasked_gqa_decode_keeps_the_kv_heads(cuda_route, sdpa_calls):
    """One query, no padding: no mask, so GQA stays GQA (no expanded heads)."""
    q, k, v = randn(1, 4, 1, 8, seed=1), randn(1, 2, 5, 8, seed=2), randn(1, 2, 5, 8, seed=3)
    assert torch.allclose(plain_attention(q, k, v), reference(q, k, v), atol=1e-10, rtol=0)
    ((call),) = sdpa_calls
    assert call["k"] == (1, 2, 5, 8) and call["enable_gqa"] is True and call["attn_mask"] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_masked_half_precision_chunk_keeps_its_padding_mask(cuda_route, dtype):
    """The bottom-right causal bias is for unpadded keys only: with a padding mask the mask is built and applied."""
    q = randn(2, 2, 3, 8, seed=1).to(dtype)
    k, v = randn(2, 2, 6, 8, seed=2).to(dtype), randn(2, 2, 6, 8, seed=3).to(dtype)
    key_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    got = plain_attention(q, k, v, key_mask)
    assert torch.allclose(got.double(), reference(q, k, v, key_mask), atol=3e-2)


# ------------------------------------------------------------ decomposed attention's dispatch to the fused kernel


@pytest.fixture
def kernel_calls(monkeypatch):
    """CUDA answered present and the route taken; the Triton kernel (GPU only) stood in for by its own eager
    reference (kernels.flash_lora_attention.flash_lora_attention_reference, its tests' ground truth), each call's
    arguments recorded."""
    import kernels.flash_lora_attention as fla

    monkeypatch.setattr(attention, "_cuda_route", lambda t: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def kernel(q, k, v_base, v_lr, lora_b, scaling, role_ids=None, kv_lens=None, sm_scale=None):
        calls.append({"role_ids": role_ids, "kv_lens": kv_lens, "sm_scale": sm_scale, "lora_b": tuple(lora_b.shape)})
        return fla.flash_lora_attention_reference(q, k, v_base, v_lr, lora_b, scaling, role_ids, kv_lens, sm_scale)

    monkeypatch.setattr(fla, "flash_lora_attention", kernel)
    return calls


@pytest.mark.parametrize("h_q, h_kv, lq", [(4, 2, 6), (2, 2, 3), (4, 1, 1)])
def test_decomposed_attention_hands_half_precision_to_the_kernel_with_its_arguments(kernel_calls, h_q, h_kv, lq):
    b, lk, d, r = 2, 6, 8, 3
    q, k = randn(b, h_q, lq, d, seed=1).bfloat16(), randn(b, h_kv, lk, d, seed=2).bfloat16()
    v_base, v_lr = randn(b, h_kv, lk, d, seed=3).bfloat16(), randn(b, lk, r, seed=4).bfloat16()
    lora_b, roles = randn(3, h_kv * d, r, seed=5).bfloat16(), torch.tensor([2, 1])
    got = decomposed_attention(q, k, v_base, v_lr, lora_b, 0.7, roles)
    assert got.dtype == torch.bfloat16 and got.shape == (b, h_q, lq, d)
    want = decomposed_reference(q, k, v_base, v_lr, lora_b, 0.7, roles)
    assert torch.allclose(got.double(), want, atol=5e-2), (got.double() - want).abs().max()
    ((call),) = kernel_calls
    assert call["role_ids"] is roles and call["kv_lens"] is None and call["sm_scale"] is None
    assert call["lora_b"] == (3, h_kv, r, d)  # the per-head view


def test_decomposed_attention_keeps_the_pytorch_path_where_the_kernel_does_not_apply(kernel_calls, monkeypatch):
    b, h_q, h_kv, lk, d, r = 2, 4, 2, 6, 8, 3
    q, k = randn(b, h_q, lk, d, seed=1), randn(b, h_kv, lk, d, seed=2)
    v_base, v_lr, lora_b = randn(b, h_kv, lk, d, seed=3), randn(b, lk, r, seed=4), randn(3, h_kv * d, r, seed=5)
    roles, mask = torch.tensor([2, 1]), torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    per_query = torch.tensor([[0, 2, 1, 1, 0, 2], [2, 2, 0, 1, 1, 0]])
    half = [t.bfloat16() for t in (q, k, v_base, v_lr, lora_b)]
    decomposed_attention(q, k, v_base, v_lr, lora_b, 0.7, roles)  # float64: not the kernel's dtype
    decomposed_attention(*half, 0.7, roles, use_kernel=False)  # switched off
    decomposed_attention(*half, 0.7, per_query)  # a role per query
    decomposed_attention(*half, 0.7, roles, mask)  # padding
    assert kernel_calls == []
    decomposed_attention(*half, 0.7, roles)  # all four hold: the kernel, by default
    assert len(kernel_calls) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    decomposed_attention(*half, 0.7, roles)
    assert len(kernel_calls) == 1
