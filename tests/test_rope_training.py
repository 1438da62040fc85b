"""lragent.rope.rope_store_unfused in training: q and k through one RoPE call on their concatenation give the same
queries, stored keys and gradients bit for bit as two calls, with fewer dispatched ops (the step is host-bound)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lragent.rope import apply_rope, rope_store_unfused

VIEWS = {"view", "_unsafe_view", "as_strided", "transpose", "t", "slice", "select", "unsqueeze", "split", "detach",
         "chunk", "expand", "alias", "unbind"}  # fmt: skip


class _Store:
    def __init__(self) -> None:
        self.k = self.v = None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        self.k, self.v = k, v


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def _inputs(dtype: torch.dtype, cos_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 6, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 7, 2, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 7, 2, 16, generator=g).to(dtype)
    angle = torch.randn(2, 7, 8, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(cos_dtype), torch.cat([angle.sin()] * 2, -1).to(cos_dtype)
    return q, k, v, cos, sin


def _separate(q, k, v, cos, sin):
    return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


@pytest.mark.parametrize(("dtype", "cos_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_one_rope_over_q_and_k_equals_two_bit_for_bit(dtype, cos_dtype) -> None:
    """Queries, stored keys and values, and the gradients of q and k: torch.equal with two apply_rope calls."""
    q, k, v, cos, sin = _inputs(dtype, cos_dtype)
    store = _Store()
    q_out = rope_store_unfused(store, 0, q, k, v, None, cos, sin)
    ref_q, ref_k, ref_v = _separate(q, k, v, cos, sin)
    assert q_out.shape == ref_q.shape and store.k.shape == ref_k.shape
    assert torch.equal(q_out, ref_q) and torch.equal(store.k, ref_k) and torch.equal(store.v, ref_v)
    gq = torch.randn(ref_q.shape, generator=torch.Generator().manual_seed(1)).to(ref_q.dtype)
    gk = torch.randn(ref_k.shape, generator=torch.Generator().manual_seed(2)).to(ref_k.dtype)
    grads = torch.autograd.grad((q_out, store.k), (q, k), (gq, gk))
    ref_grads = torch.autograd.grad((ref_q, ref_k), (q, k), (gq, gk))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def _op_counts(joint: bool) -> tuple[int, int]:
    """Non-view ops dispatched forward and backward, one joint call or two apply_rope calls."""
    q, k, v, cos, sin = _inputs(torch.bfloat16, torch.float32)
    with _Ops() as fwd:
        if joint:
            store = _Store()
            outs = (rope_store_unfused(store, 0, q, k, v, None, cos, sin), store.k)
        else:
            outs = _separate(q, k, v, cos, sin)[:2]
    with _Ops() as bwd:
        torch.autograd.grad(outs, (q, k), [torch.ones_like(o) for o in outs])
    return sum(fwd.count.values()), sum(bwd.count.values())


def test_the_joint_rope_dispatches_fewer_ops_forward_and_backward() -> None:
    """Where autograd records: fewer non-view ops than two calls, forward and backward; without autograd (inference)
    the two calls as before, op for op."""
    joint, two = _op_counts(True), _op_counts(False)
    assert joint[0] < two[0] and joint[1] < two[1], (joint, two)
    q, k, v, cos, sin = _inputs(torch.bfloat16, torch.float32)
    with torch.no_grad(), _Ops() as inference:
        rope_store_unfused(_Store(), 0, q, k, v, None, cos, sin)
    with torch.no_grad(), _Ops() as two_calls:
        _separate(q, k, v, cos, sin)
    assert inference.count == two_calls.count, (inference.count, two_calls.count)


class _Record:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        self.calls.append((layer, k, v, v_lr))


def test_apply_rope_rotates_each_half_pair_by_its_angle() -> None:
    """RoPE (the half-split convention of LLaMA/Qwen2): entries i and i + D/2 of each head are one complex number
    x_i + j x_{i+D/2}, turned by the angle of its position and frequency; cos/sin (B, T, D) apply to every head."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)  # (B, H, T, D)
    angle = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)  # (B, T, D/2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    turned = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)[:, None]
    assert torch.allclose(apply_rope(x, cos, sin), torch.cat([turned.real, turned.imag], -1), atol=1e-12, rtol=0)
    # a quarter turn of (1, 0) is (0, 1), of (0, 1) is (-1, 0); a zero angle leaves x as it is
    e = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (1, 1, 2, 2): two positions, D = 2
    quarter = (torch.zeros(1, 2, 2), torch.ones(1, 2, 2))
    assert torch.equal(apply_rope(e, *quarter), torch.tensor([[[[0.0, 1.0], [-1.0, 0.0]]]]))
    assert torch.equal(apply_rope(x, torch.ones(2, 5, 8, dtype=torch.float64), torch.zeros(2, 5, 8, dtype=x.dtype)), x)


@pytest.mark.parametrize("grad", [True, False])
def test_rope_store_unfused_stores_the_layer_the_roped_keys_the_values_and_v_lr(grad) -> None:
    """With autograd (one joint RoPE) and without (two calls): one store, of the given layer, the keys after RoPE and
    the values as (B, H_kv, T, D), and the low-rank values handed in, the same tensor."""
    q, k, v, cos, sin = _inputs(torch.float32, torch.float32)
    v_lr = torch.randn(2, 7, 4)
    view = _Record()
    with torch.set_grad_enabled(grad):
        q_out = rope_store_unfused(view, 5, q, k, v, v_lr, cos, sin)
    ref_q, ref_k, ref_v = _separate(q, k, v, cos, sin)
    [(layer, k_stored, v_stored, v_lr_stored)] = view.calls
    assert layer == 5 and v_lr_stored is v_lr
    assert k_stored.shape == (2, 2, 7, 16) and v_stored.shape == (2, 2, 7, 16) and q_out.shape == (2, 6, 7, 16)
    assert torch.equal(k_stored, ref_k) and torch.equal(v_stored, ref_v) and torch.equal(q_out, ref_q)
