"""The closed forms of eval_suite/bench/model_flops.py without an engine (fast; tests/test_model_flops.py checks them
against a trace of the tiny model): a shape read from a transformers config, each projection's shape, the cards'
peaks by name, the causal pairs, and the FLOPs of each plan op kind and of decode, in exact integers."""

from __future__ import annotations

import types

import pytest

from eval_suite.bench.model_flops import (
    PEAK_BF16_FLOPS,
    ModelShape,
    decode_flops,
    head_flops,
    peak_flops,
    prefill_flops,
    recompute_layer_count,
    span_flops,
)
from lragent.sharing import Forward, LRPrefill, Recompute

# every projection a different shape, LoRA on k and o only: a count that mixes up any two shows
SHAPE = ModelShape(
    n_layers=2, hidden=6, n_heads=3, n_kv_heads=1, head_dim=5, intermediate=11, vocab=13, rank=3,
    targets=("k_proj", "o_proj"),
)  # fmt: skip
# per token and layer: P = 6*15 + 2*(6*5) + 15*6 + 2*(6*11) + 11*6 = 90 + 60 + 90 + 132 + 66, R = 3*(6+5) + 3*(15+6)
P, R, W, KV = 438, 96, 15, 60


def _config(**kw) -> types.SimpleNamespace:
    base = dict(num_hidden_layers=2, hidden_size=6, num_attention_heads=3, num_key_value_heads=1,
                intermediate_size=11, vocab_size=13)  # fmt: skip
    return types.SimpleNamespace(**{**base, **kw})


def test_from_config_reads_every_field_and_derives_the_head_width() -> None:
    """``from_config`` takes each width from its config field, ``head_dim`` when the config has one (else hidden /
    heads), and the adapters' rank and targets (as a tuple)."""
    assert ModelShape.from_config(_config(head_dim=5), 3, ["k_proj", "o_proj"]) == SHAPE
    derived = ModelShape.from_config(_config(hidden_size=12), 2, ("q_proj",))
    assert derived.head_dim == 4 and isinstance(derived.head_dim, int) and derived.hidden == 12
    assert derived.targets == ("q_proj",) and derived.rank == 2
    assert ModelShape.from_config(_config(hidden_size=12, head_dim=None), 2, ("q_proj",)).head_dim == 4


def test_linear_shapes_are_each_projections_in_and_out() -> None:
    """Query width H_q·D, key/value width H_kv·D, the MLP's three projections."""
    assert SHAPE.linear_shapes() == {
        "q_proj": (6, 15), "k_proj": (6, 5), "v_proj": (6, 5), "o_proj": (15, 6),
        "gate_proj": (6, 11), "up_proj": (6, 11), "down_proj": (11, 6),
    }  # fmt: skip


def test_peak_flops_by_the_most_specific_name_fragment() -> None:
    """A card's dense bf16 peak by the first fragment of its name in the table (PCIe and NVL before H100, H200 before
    H20); ``None`` for an unknown device or a CPU."""
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 NVL") == 835e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H20") == 148e12
    assert peak_flops("NVIDIA B200") == 2250e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("cpu") is None and peak_flops("") is None
    assert len(PEAK_BF16_FLOPS) == 8


@pytest.mark.parametrize(("start", "end", "pairs"), [(0, 0, 0), (0, 1, 1), (0, 4, 10), (3, 5, 9), (7, 7, 0)])
def test_span_flops_in_exact_integers(start: int, end: int, pairs: int) -> None:
    """``layers · (2·(P − P_kv if skip_kv)·n + 2·R·n + 4·W·pairs)`` over ``n = end − start`` tokens, pairs Σ(p + 1)."""
    n = end - start
    assert span_flops(SHAPE, start, end) == 2 * (2 * P * n + 2 * R * n + 4 * W * pairs)
    assert span_flops(SHAPE, start, end, layers=1) == 2 * P * n + 2 * R * n + 4 * W * pairs
    assert span_flops(SHAPE, start, end, layers=0) == 0
    assert span_flops(SHAPE, start, end, skip_kv=True) == 2 * (2 * (P - KV) * n + 2 * R * n + 4 * W * pairs)
    assert isinstance(span_flops(SHAPE, start, end), float)


@pytest.mark.parametrize(("start", "end"), [(3, 2), (-1, 4), (-2, -2)])
def test_span_flops_refuses_a_bad_span_naming_it(start: int, end: int) -> None:
    """An empty-backwards or negative span is an error naming the positions."""
    with pytest.raises(ValueError, match=rf"^positions \[{start}, {end}\): need 0 <= start <= end$"):
        span_flops(SHAPE, start, end)


def test_head_and_prefill_and_decode_flops() -> None:
    """The LM head ``2·d·V`` per position (one by default); a prefill sums its ops (a Recompute over the given layers
    only) plus one head row, an unknown op named; decode one full forward and head row per token but the last."""
    head = 2 * 6 * 13
    assert head_flops(SHAPE) == head and head_flops(SHAPE, 3) == 3 * head and isinstance(head_flops(SHAPE), float)
    assert prefill_flops(SHAPE, []) == head
    ops = [LRPrefill(0, 2), Recompute(2, 4), Forward(4, 6)]
    expected = span_flops(SHAPE, 0, 2, skip_kv=True) + span_flops(SHAPE, 2, 4, layers=1) + span_flops(SHAPE, 4, 6)
    assert prefill_flops(SHAPE, ops, recompute_layers=1) == expected + head
    assert prefill_flops(SHAPE, [Recompute(2, 4)]) == head  # no recompute layers: nothing but the head
    later = [Forward(0, 2), LRPrefill(2, 4), Recompute(4, 6)]  # every op adds to what came before it
    assert prefill_flops(SHAPE, later, recompute_layers=2) == (
        span_flops(SHAPE, 0, 2) + span_flops(SHAPE, 2, 4, skip_kv=True) + span_flops(SHAPE, 4, 6) + head
    )
    with pytest.raises(TypeError, match=r"^unknown plan op \(0, 1\): allowed Forward, LRPrefill, Recompute$"):
        prefill_flops(SHAPE, [(0, 1)])
    assert decode_flops(SHAPE, 5, 0) == 0 == decode_flops(SHAPE, 5, 1)
    assert decode_flops(SHAPE, 5, 3) == span_flops(SHAPE, 5, 7) + 2 * head
    assert recompute_layer_count([]) == 0 and recompute_layer_count([(1, 4), (6, 7)]) == 4
