"""Fused projection weights (lragent/fused_weights.py) on small layers: the layout of a group, its modules' weights
as views of it, the shared-A rows appended as copies kept up to date, the cases left unfused, and when a kept
group is reused or rebuilt. The engines' results with fused weights are in tests/test_decode_fusion.py."""

from __future__ import annotations

import torch
from torch import nn

from lragent.fused_weights import FusedGroup, fused_weights
from lragent.multi_lora import MultiLoraLinear

D_IN = 6


def _linears(outs=(4, 2, 3), bias=True, dtype=torch.float32, seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(D_IN, n, bias=bias, dtype=dtype) for n in outs]


def _adapted(lin: nn.Linear, shared_a: bool = True, rank: int = 2) -> MultiLoraLinear:
    m = MultiLoraLinear(lin, n_roles=3, rank=rank, alpha=4.0, shared_a=shared_a)
    with torch.no_grad():
        for b in m.lora_B:
            b.normal_()
    return m


def _row_offset(view: torch.Tensor, whole: torch.Tensor) -> int:
    """The first row of ``whole`` that ``view`` starts at (it shares ``whole``'s storage)."""
    assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    return (view.data_ptr() - whole.data_ptr()) // (whole.stride(0) * whole.element_size())


def test_a_group_is_the_weights_stacked_and_each_module_a_view_of_it() -> None:
    owner, lins = nn.Module(), _linears()
    before_w = [lin.weight.detach().clone() for lin in lins]
    before_b = [lin.bias.detach().clone() for lin in lins]
    x = torch.randn(5, D_IN)
    outs = [lin(x) for lin in lins]
    g = fused_weights(owner, "_g", lins)
    assert isinstance(g, FusedGroup) and owner.__dict__["_g"] is g
    assert torch.equal(g.weight, torch.cat(before_w)) and torch.equal(g.bias, torch.cat(before_b))
    assert g.sizes == [4, 2, 3] and g.lora == () and g.modules == lins and g.n_base == 3
    assert g[0] is g.weight and g[1] is g.bias and g[2] is g.sizes  # the (weight, bias, sizes) it replaced
    assert g.a_offset(0) == 9  # no A rows: the offset after every base row
    for lin, start, n in zip(lins, (0, 4, 6), (4, 2, 3), strict=True):
        assert _row_offset(lin.weight, g.weight) == start and lin.weight.shape == (n, D_IN)
        assert _row_offset(lin.bias, g.bias) == start and lin.bias.shape == (n,)
        assert not lin.weight.requires_grad and not lin.bias.requires_grad
    for lin, out in zip(lins, outs, strict=True):
        torch.testing.assert_close(lin(x), out, rtol=0, atol=0)
    y = nn.functional.linear(x, g.weight, g.bias)
    torch.testing.assert_close(y, torch.cat(outs, -1))  # one GEMM gives every module's output (up to rounding)


def test_without_biases_the_group_has_none() -> None:
    lins = _linears(bias=False)
    g = fused_weights(nn.Module(), "_g", lins)
    assert g.bias is None and g[1] is None and g.sizes == [4, 2, 3]
    assert all(lin.bias is None for lin in lins)


def test_mixed_biases_or_a_module_that_is_no_linear_are_left_alone() -> None:
    owner = nn.Module()
    lins = _linears(outs=(4, 2))
    lins.append(nn.Linear(D_IN, 3, bias=False))
    weights = [lin.weight for lin in lins]
    assert fused_weights(owner, "_g", lins) is None and owner.__dict__["_g"] is None
    assert all(lin.weight is w and w.requires_grad for lin, w in zip(lins, weights, strict=True))  # not rebound
    conv = [nn.Linear(D_IN, 4), nn.Conv1d(D_IN, 4, 1)]
    assert fused_weights(owner, "_h", conv) is None and conv[0].weight.requires_grad


def test_shared_a_rows_follow_the_base_rows_as_copies_with_zero_bias() -> None:
    q, k, v = _linears()
    mods = [_adapted(q), k, _adapted(v)]  # k not adapted
    a_q, a_v = mods[0].lora_A[0], mods[2].lora_A[0]
    x = torch.randn(5, D_IN)
    g = fused_weights(nn.Module(), "_g", mods, lora=True)
    assert g.sizes == [4, 2, 3, 2, 2] and g.lora == (0, 2) and g.n_base == 3 and g.modules == mods
    assert g.a_offset(0) == 9 and g.a_offset(1) == 11
    assert torch.equal(g.weight[9:11], a_q) and torch.equal(g.weight[11:13], a_v)
    assert torch.equal(g.bias[9:], torch.zeros(4)) and g.bias.dtype == q.bias.dtype
    assert a_q.data_ptr() != g.weight[9:].data_ptr() and a_q.requires_grad  # the adapter keeps its own storage
    assert mods[0].base.weight.data_ptr() == g.weight.data_ptr()  # a MultiLoraLinear's base weight is the view
    y = nn.functional.linear(x, g.weight, g.bias)
    torch.testing.assert_close(y[:, 9:11], x @ a_q.T)
    torch.testing.assert_close(y[:, :4], q(x))


def test_no_a_rows_without_lora_or_without_a_shared_a() -> None:
    q, k, v = _linears()
    g = fused_weights(nn.Module(), "_g", [_adapted(q), k, _adapted(v)])  # lora off by default
    assert g.sizes == [4, 2, 3] and g.lora == ()
    q, k, v = _linears()
    g = fused_weights(nn.Module(), "_g", [_adapted(q), k, _adapted(v)], lora=False)
    assert g.sizes == [4, 2, 3] and g.lora == () and g.weight.shape == (9, D_IN) and g.bias.shape == (9,)
    q, k, v = _linears()
    g = fused_weights(nn.Module(), "_g", [_adapted(q, shared_a=False), k, _adapted(v)], lora=True)
    assert g.sizes == [4, 2, 3, 2] and g.lora == (2,)  # one A per role: the decoder computes X·A itself


def test_a_rows_and_their_bias_take_the_base_dtype() -> None:
    """A bf16 base with float32 adapters (how they are trained): the group stays bf16, A rows rounded to it."""
    q, k = _linears(outs=(4, 2), dtype=torch.bfloat16)
    m = _adapted(q)
    m.lora_A[0] = nn.Parameter(m.lora_A[0].detach().float() / 3)  # float32 values bf16 cannot hold exactly
    g = fused_weights(nn.Module(), "_g", [m, k], lora=True)
    assert g.weight.dtype == torch.bfloat16 and g.bias.dtype == torch.bfloat16
    assert torch.equal(g.weight[6:], m.lora_A[0].bfloat16()) and torch.equal(g.bias[6:], torch.zeros(2).bfloat16())
    assert q.weight.dtype == torch.bfloat16 and k.bias.dtype == torch.bfloat16  # the modules' views too
    q, k = _linears(outs=(4, 2), dtype=torch.float64)
    m = _adapted(q)
    m.lora_A[0] = nn.Parameter(m.lora_A[0].detach().float())  # float32 beside a float64 base: widened exactly
    g = fused_weights(nn.Module(), "_g", [m, k], lora=True)
    assert g.weight.dtype == torch.float64 and torch.equal(g.weight[6:], m.lora_A[0].double())


def test_a_group_of_one_adapted_module() -> None:
    (q,) = _linears(outs=(4,))
    m = _adapted(q)
    g = fused_weights(nn.Module(), "_g", [m], lora=True)
    assert g.sizes == [4, 2] and g.lora == (0,) and g.a_offset(0) == 4
    assert torch.equal(g.weight[4:], m.lora_A[0]) and torch.equal(g.bias[4:], torch.zeros(2))


def test_a_group_is_built_on_its_modules_device() -> None:
    """On the meta device (no data, a real torch device like cuda): the group, its bias and A rows are there."""
    q, k = nn.Linear(D_IN, 4, device="meta"), nn.Linear(D_IN, 2, device="meta")
    g = fused_weights(nn.Module(), "_g", [_adapted(q), k], lora=True)
    assert g.weight.device.type == "meta" and g.bias.device.type == "meta"
    assert g.weight.shape == (8, D_IN) and g.bias.shape == (8,) and g.sizes == [4, 2, 2]


def test_a_kept_group_is_reused_and_its_a_rows_refreshed() -> None:
    owner = nn.Module()
    q, k, v = _linears()
    mods = [_adapted(q), k, _adapted(v)]
    g = fused_weights(owner, "_g", mods, lora=True)
    with torch.no_grad():
        mods[2].lora_A[0].mul_(-2.0)
    assert fused_weights(owner, "_g", mods, lora=True) is g  # same weights, same A layout: the same group
    assert torch.equal(g.weight[11:13], mods[2].lora_A[0])  # the changed A reached its rows
    lins = _linears(bias=False)
    owner2 = nn.Module()
    g2 = fused_weights(owner2, "_g", lins)
    assert fused_weights(owner2, "_g", lins) is g2


def test_a_stale_group_is_rebuilt() -> None:
    owner = nn.Module()
    q, k, v = _linears()
    mods = [_adapted(q), k, _adapted(v)]
    g = fused_weights(owner, "_g", mods, lora=True)
    g_off = fused_weights(owner, "_g", mods, lora=False)  # other A rows asked for
    assert g_off is not g and g_off.lora == () and g_off.sizes == [4, 2, 3] and owner.__dict__["_g"] is g_off
    g_on = fused_weights(owner, "_g", mods, lora=True)
    assert g_on is not g_off and g_on.lora == (0, 2)
    for m in mods:
        m.to(torch.float64)  # a new dtype (and storage): the group no longer holds the weights
    g64 = fused_weights(owner, "_g", mods, lora=True)
    assert g64 is not g_on and g64.weight.dtype == torch.float64 and g64.sizes == [4, 2, 3, 2, 2]
    assert mods[0].base.weight.data_ptr() == g64.weight.data_ptr()
    q2, k2 = _linears(outs=(4, 2), seed=1)
    owner2 = nn.Module()
    g2 = fused_weights(owner2, "_g", [q2, k2])
    q2.weight = nn.Parameter(q2.weight.detach().clone())
    g3 = fused_weights(owner2, "_g", [q2, k2])  # the first weight rebound elsewhere: rebuilt around it
    assert g3 is not g2 and q2.weight.data_ptr() == g3.weight.data_ptr()
