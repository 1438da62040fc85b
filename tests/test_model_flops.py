"""The model FLOPs `bench trace` divides by its prefill and decode seconds (eval_suite/bench/model_flops.py).

Pinned: the closed form against a per-token, per-pair count written out here (an asymmetric shape: 4 query heads, 2
KV heads, MLP wider than the hidden size, LoRA on q and v only); the LR prefill is exactly the forward less the K
and V_base projections; DroidSpeak's recompute counts only its layers; decode counts one forward per generated
token but the last; and on a real trace every step's plan covers exactly the positions the engine reports prefilled.
"""

from __future__ import annotations

import pytest

from eval_suite.bench.model_flops import (
    ModelShape,
    decode_flops,
    head_flops,
    prefill_flops,
    recompute_layer_count,
    span_flops,
)
from lragent.sharing import Forward, LRPrefill, Recompute

SHAPE = ModelShape(
    n_layers=3, hidden=16, n_heads=4, n_kv_heads=2, head_dim=4, intermediate=40, vocab=50, rank=2,
    targets=("q_proj", "v_proj"),
)  # fmt: skip


def _by_hand(start: int, end: int, layers: int = 3, skip_kv: bool = False) -> int:
    """One token and one query-key pair at a time."""
    d, q, kv, ff, r = 16, 16, 8, 40, 2
    frozen = d * q + (0 if skip_kv else 2 * d * kv) + q * d + 3 * d * ff
    lora = r * (d + q) + r * (d + kv)
    total = 0
    for p in range(start, end):
        total += 2 * frozen + 2 * lora  # multiply-adds are 2 FLOPs
        total += (p + 1) * 4 * q  # QK^T and PV against every position up to p
    return layers * total


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 7), (5, 12), (9, 9)])
def test_span_flops_equals_the_count_token_by_token(start: int, end: int) -> None:
    assert span_flops(SHAPE, start, end) == _by_hand(start, end)
    assert span_flops(SHAPE, start, end, layers=1) == _by_hand(start, end, layers=1)


def test_lr_prefill_is_the_forward_less_k_and_v_base() -> None:
    assert span_flops(SHAPE, 2, 9, skip_kv=True) == _by_hand(2, 9, skip_kv=True)
    saved = span_flops(SHAPE, 2, 9) - span_flops(SHAPE, 2, 9, skip_kv=True)
    assert saved == 3 * 7 * 2 * (2 * 16 * 8)  # layers x tokens x 2 FLOPs x (K + V_base multiply-adds)


def test_prefill_counts_each_op_kind_and_one_lm_head_row() -> None:
    head = head_flops(SHAPE, 1)
    assert head == 2 * 16 * 50
    assert prefill_flops(SHAPE, [Forward(4, 10)]) == _by_hand(4, 10) + head
    assert (
        prefill_flops(SHAPE, [LRPrefill(0, 4), Forward(4, 10)]) == _by_hand(0, 4, skip_kv=True) + _by_hand(4, 10) + head
    )
    groups = [(0, 1), (2, 3)]  # two recompute groups of one layer each, of three layers
    assert recompute_layer_count(groups) == 2
    assert prefill_flops(SHAPE, [Recompute(0, 4), Forward(4, 10)], recompute_layers=2) == (
        _by_hand(0, 4, layers=2) + _by_hand(4, 10) + head
    )
    with pytest.raises(TypeError, match="unknown plan op"):
        prefill_flops(SHAPE, ["Forward(0, 1)"])
    with pytest.raises(ValueError, match=r"positions \[5, 2\)"):
        span_flops(SHAPE, 5, 2)


def test_decode_counts_one_forward_per_generated_token_but_the_last() -> None:
    assert decode_flops(SHAPE, 10, 0) == 0 and decode_flops(SHAPE, 10, 1) == 0
    # 4 tokens generated after 10 positions: forwards at positions 10, 11, 12 (the 4th enters with the next step)
    assert decode_flops(SHAPE, 10, 4) == _by_hand(10, 13) + 3 * head_flops(SHAPE, 1)


@pytest.mark.parametrize("scheme", ["non_shared", "full_shared", "base_shared", "droidspeak"])
def test_trace_steps_count_exactly_the_positions_the_engine_prefilled(scheme: str) -> None:
    """On the tiny random-weight model: the plan captured before each step covers the positions the engine reports
    as prefilled, so the FLOPs are of the work the scheme did; full_shared prefills only new tokens (its FLOPs are
    the new tokens' forward), non_shared re-prefills what a role has not seen (more)."""
    import torch

    from eval_suite.bench.trace import run_trace
    from lragent.engine import Engine
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    torch.manual_seed(0)
    hf, _ = load_model("tiny-llama", dtype=torch.float32, device="cpu")
    lm = MultiLoraModel(hf, MultiLoraConfig(rank=2, alpha=4, dropout=0.0)).eval()
    lm.init_adapters("random", seed=0, b_std=0.02)
    shape = ModelShape.from_config(hf.config, 2, targets=tuple(lm.lora_config.targets))
    eng = Engine(lm, scheme, rows=1, capacity=2048, eos_token_ids=[])
    res = run_trace(eng, lm, l_ctx=3, seed=1, shape=shape)
    head = head_flops(shape, 1)
    assert [s["planned_tokens"] for s in res["steps"]] == [s["prefill_tokens"] for s in res["steps"]]
    assert all(s["prefill_flops"] > head for s in res["steps"])
    if scheme == "full_shared":
        length = 0
        expect = 0.0
        for step in res["steps"]:
            new = step["prefill_tokens"]
            end = step["total_len"] - step["decode_tokens"]
            expect += span_flops(shape, end - new, end) + head
            length = step["total_len"]
        assert length == res["final_len"]
        assert res["prefill_flops"] == pytest.approx(expect, rel=1e-12)
    if scheme == "non_shared":
        assert sum(s["recomputed_tokens"] for s in res["steps"]) == 0
        assert res["prefill_tokens"] > sum(s["decode_tokens"] for s in res["steps"])
    assert res["decode_flops"] == pytest.approx(
        sum(decode_flops(shape, s["total_len"] - s["decode_tokens"], s["decode_tokens"]) for s in res["steps"]),
        rel=1e-12,
    )
