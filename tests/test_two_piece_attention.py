"""The shared pass's two-piece attention (issue 19): a producer's prefix and a consumer's suffix per sequence attend
as two D-wide causal attentions over dense per-role values, equal (values and gradients) to the per-query
decomposed attention over ``[V_base | V_lr]``; and the shared-sequence forward gives the same logits and gradients
with the path on and off (``LRAGENT_TWO_PIECE=0``)."""

from __future__ import annotations

import pytest
import torch

from lragent import attention, cache_views
from lragent.attention import RoleSplit, decomposed_attention, two_piece_attention

T, UNIT = 40, 8  # a small rounding unit: [lo, hi) ranges inside T


def inputs(dtype: torch.dtype, b: int = 4, t: int = T, h_q: int = 4, h_kv: int = 2, d: int = 8, r: int = 3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(b, h_q, t, d, generator=g, dtype=dtype),
        "k": torch.randn(b, h_kv, t, d, generator=g, dtype=dtype),
        "v_base": torch.randn(b, h_kv, t, d, generator=g, dtype=dtype),
        "v_lr": torch.randn(b, t, r, generator=g, dtype=dtype),
        "lora_b": torch.randn(3, h_kv * d, r, generator=g, dtype=dtype),
    }
    return {k: v.requires_grad_() for k, v in x.items()}


SPLITS = {
    "mixed rows, one at T": [5, 17, 23, 40],
    "0-ish and T-ish": [0, 1, 39, 40],
    "on the unit boundaries": [8, 16, 16, 24],
    "straddling boundaries (lo 8, hi 24)": [9, 15, 17, 23],
    "all 0 (consumer only)": [0, 0, 0, 0],
    "all T (producer only)": [40, 40, 40, 40],
    "one split, lo == hi": [16, 16, 16, 16],
}


def both(x: dict, split: list[int], producer: list[int], consumer: list[int], t: int = T, varlen=None):
    """(two-piece output, per-query output, their layout); ``varlen``: the consumer rows packed through this
    variable-length attention (the CUDA path's packing), ``None``: the dense ``[lo, T)`` call."""
    split_t, prod, cons = torch.tensor(split), torch.tensor(producer), torch.tensor(consumer)
    layout = RoleSplit.make(prod, cons, split_t, t, unit=UNIT)
    roles = torch.where(torch.arange(t)[None, :] < split_t[:, None], prod[:, None], cons[:, None])  # (B, T)
    ours = two_piece_attention(x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], 0.7, layout, varlen=varlen)
    ref = decomposed_attention(x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], 0.7, roles, use_kernel=False)
    return ours, ref, layout


def assert_same_with_grads(x: dict, ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=tol, rtol=0), (ours - ref).abs().max()
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    names = list(x)
    got = torch.autograd.grad(ours, [x[n] for n in names], g)
    want = torch.autograd.grad(ref, [x[n] for n in names], g)
    for n, a, w in zip(names, got, want, strict=True):
        assert torch.allclose(a, w, atol=tol * 10, rtol=0), (n, (a - w).abs().max())


CONSUMER_PATHS = {"dense [lo, T)": None, "packed rows (varlen)": attention.reference_varlen}


@pytest.mark.parametrize("path", list(CONSUMER_PATHS))
@pytest.mark.parametrize("split", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_piece_equals_the_per_query_path(split: list[int], dtype: torch.dtype, path: str) -> None:
    x = inputs(dtype)
    ours, ref, _ = both(x, split, producer=[1, 2, 0, 2], consumer=[0, 0, 1, 1], varlen=CONSUMER_PATHS[path])
    assert_same_with_grads(x, ours, ref, 1e-10 if dtype == torch.float64 else 1e-5)


def test_consumer_rows_are_packed_sequence_by_sequence() -> None:
    r = torch.zeros(3, dtype=torch.long)
    layout = RoleSplit.make(r, r, torch.tensor([7, 10, 4]), 10, unit=UNIT)
    assert layout.consumer_rows.tolist() == [7, 8, 9, 24, 25, 26, 27, 28, 29]  # b * T + t for t >= split[b]
    assert layout.cu_q.tolist() == [0, 3, 3, 9] and layout.cu_k.tolist() == [0, 10, 20, 30]
    assert layout.max_q == 6 and layout.cu_q.dtype == torch.int32


@pytest.mark.parametrize("path", list(CONSUMER_PATHS))
def test_producer_equal_to_consumer_and_a_length_off_the_unit(path: str) -> None:
    x = inputs(torch.float64, t=37)
    ours, ref, layout = both(
        x, [3, 37, 20, 30], producer=[1, 2, 0, 0], consumer=[1, 2, 0, 2], t=37, varlen=CONSUMER_PATHS[path]
    )
    assert (layout.lo, layout.hi) == (0, 37)  # hi rounds up to 40, capped at T
    assert_same_with_grads(x, ours, ref, 1e-10)


def test_row_range_rounds_outward_to_the_unit() -> None:
    r = torch.zeros(4, dtype=torch.long)

    def lo_hi(split: list[int], t: int = T) -> tuple[int, int]:
        layout = RoleSplit.make(r, r, torch.tensor(split), t, unit=UNIT)
        return layout.lo, layout.hi

    assert lo_hi([9, 15, 17, 23]) == (8, 24)
    assert lo_hi([8, 16, 16, 24]) == (8, 24)
    assert lo_hi([0, 0, 0, 0]) == (0, 0)
    assert lo_hi([40, 40, 40, 40]) == (40, 40)
    assert lo_hi([39, 39, 39, 39]) == (32, 40)
    assert lo_hi([50, 60, 39, 45], t=41) == (32, 41)  # splits past T count as T
    assert RoleSplit.make(r, r, torch.tensor([130, 300, 129, 256]), 512).lo == 128  # the default unit
    assert RoleSplit.make(r, r, torch.tensor([130, 300, 129, 256]), 512).hi == 384


# ------------------------------------------------------------------------------------------------ whole model
def tiny_model(layers: int = 2):
    from lit_modules import MultiLoraModule

    tiny = {"vocab_size": 258, "num_hidden_layers": layers}
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=tiny, dropout=0.0)
    m.configure_model()
    m.lora_model.init_adapters("random", seed=4, b_std=0.5)
    return m.lora_model


def run_shared(model, checkpointing: bool, scheme: str = "base_lr_shared"):
    """Logits at some positions and the adapters' gradients of a loss over them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 258, (4, T), generator=g)
    split = torch.tensor([9, 15, 17, 23])  # lo 8, hi 24 at UNIT 8: all three row ranges
    out_index = torch.tensor([0, 8, 12, 30, 41, 55, 64, 79, 100, 135, 150, 159])  # producer and consumer rows
    model.decoder.gradient_checkpointing = checkpointing
    for p in model.lora_parameters():
        p.grad = None
    logits = model.shared_sequence_forward(ids, split, [1, 2, 0, 2], [0, 0, 1, 1], scheme, out_index)
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.lora_parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_sequence_forward_two_piece_on_equals_off(monkeypatch, checkpointing: bool) -> None:
    monkeypatch.setattr(attention, "TWO_PIECE_UNIT", UNIT)
    calls: list[RoleSplit] = []

    def counted(*args, **kwargs):
        calls.append(args[-1])
        return two_piece_attention(*args, **kwargs)

    monkeypatch.setattr(cache_views, "two_piece_attention", counted)
    model = tiny_model()
    monkeypatch.setenv("LRAGENT_TWO_PIECE", "0")
    ref_logits, ref_grads = run_shared(model, checkpointing=False)
    assert calls == []  # switched off: the per-query path
    monkeypatch.setenv("LRAGENT_TWO_PIECE", "1")
    logits, grads = run_shared(model, checkpointing)
    # every layer (and its recomputation under checkpointing) attended in two pieces, one layout for the forward
    assert len(calls) == model.n_layers * (2 if checkpointing else 1)
    assert all(c is calls[0] for c in calls) and (calls[0].lo, calls[0].hi) == (8, 24)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0), (logits - ref_logits).abs().max()
    for a, w in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, w, atol=1e-5, rtol=1e-4), (a - w).abs().max()
    assert any(a.abs().max() > 0 for a in grads)


def test_full_shared_keeps_its_path(monkeypatch) -> None:
    """``full_shared`` stores full values (no decomposed cache): no layout, no two-piece attention."""
    monkeypatch.setattr(cache_views, "two_piece_attention", lambda *a, **k: pytest.fail("two-piece under full_shared"))
    monkeypatch.setattr(RoleSplit, "make", lambda *a, **k: pytest.fail("layout made under full_shared"))
    run_shared(tiny_model(), checkpointing=False, scheme="full_shared")
