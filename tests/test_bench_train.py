"""bench train (training-step speed vs a PEFT loop), its FLOP count, gradient checkpointing, the cheaper λ term."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from datamodules import BYTE_VOCAB_SIZE, RoleExampleDataModule, byte_tokenizer, collate_examples
from eval_suite.bench.train import ModelShape, pass_flops, step_flops
from lit_modules import MultiLoraModule
from lit_modules.multi_lora_module import split_for_sharing, token_loss
from lragent.cli_main import main

ROLES = ["plan", "action", "reflect"]
TINY = {"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": 2}


def tiny_module(**kwargs) -> MultiLoraModule:
    args = dict(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, dropout=0.0)
    m = MultiLoraModule(**{**args, **kwargs})
    m.configure_model()
    return m


def write_data(tmp_path: Path, n: int = 8) -> Path:
    """Agent-like role files: a prompt with an earlier response, a last prompt piece, a short output."""
    for r, role in enumerate(ROLES):
        rows = [
            {
                "input": f"Question {i}: what is {i} + {r}?\nThought: \n### Response:\nI add them.\n"
                f"{role.capitalize()}: \n### Response:\n",
                "output": f"{role} {i + r}",
            }
            for i in range(n)
        ]
        (tmp_path / f"{role}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    return tmp_path


def mixed_batch(tmp_path: Path) -> dict:
    dm = RoleExampleDataModule(
        {r: str(write_data(tmp_path) / f"{r}.jsonl") for r in ROLES},
        roles=ROLES, tokenizer=byte_tokenizer(), max_length=96, batch_size=4, val_fraction=0.0,
    )  # fmt: skip
    dm.setup()
    return collate_examples([dm.train_set[i] for i in (0, 9, 17, 20)], pad_id=257)  # every role, unequal lengths


# ------------------------------------------------------------------------------------------------------ FLOPs
def test_flop_count_matches_a_hand_count_on_a_tiny_config() -> None:
    shape = ModelShape(
        n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128, vocab=258, rank=8,
        targets=("q_proj", "v_proj"),
    )  # fmt: skip
    # By hand, per token per layer: frozen multiply-adds q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate, up, down
    # 3 · 64·128 = 4096 + 2048 + 2048 + 4096 + 24576 = 36864; LoRA q 8·(64+64) + v 8·(64+32) = 1024 + 768 = 1792.
    # Two sequences of 5 and 3 tokens: 8 tokens, 15 + 6 = 21 causal query-key pairs; 4 scored positions.
    frozen = 4 * 36864 * 8  # forward 2·P·T + input gradient 2·P·T (no weight gradient: frozen)
    lora = 6 * 1792 * 8  # forward 2·R·T + input, A and B gradients 4·R·T
    attention = 12 * (4 * 16) * 21  # QKᵀ and PV: 4·H_q·D per pair forward, twice that backward
    head = 4 * 64 * 258 * 4  # 2·d·V forward + 2·d·V input gradient per scored position
    assert pass_flops(shape, [5, 3], n_scored=4) == 2 * (frozen + lora + attention) + head == 2827776
    assert step_flops(shape, [5, 3], 4, lambda_shared=0.0) == 2827776
    assert step_flops(shape, [5, 3], 4, lambda_shared=0.5) == 2 * 2827776  # plain pass + shared-term pass
    assert step_flops(shape, [5, 3], 4, lambda_shared=1.0) == 2827776  # the plain term is not computed
    assert step_flops(shape, [5, 3], 4, 0.5, lambda_mode="sample") == 2827776  # one term per step


def test_flop_shape_is_the_real_models() -> None:
    """The shape read from a config counts the weights the model really has (frozen and LoRA)."""
    m = tiny_module()
    shape = ModelShape.from_config(m.lora_model.model.config, rank=8, targets=("q_proj", "v_proj"))
    layer = m.lora_model.model.model.layers[0]
    frozen = sum(
        mod.weight.numel() if isinstance(mod, torch.nn.Linear) else mod.base.weight.numel()
        for mod in [*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))]
        + [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    )
    assert sum(i * o for i, o in shape.linear_shapes().values()) == frozen
    lora = sum(
        mod.lora_A[0].numel() + mod.lora_B[0].numel() for mod in (layer.self_attn.q_proj, layer.self_attn.v_proj)
    )
    assert sum(8 * (shape.linear_shapes()[t][0] + shape.linear_shapes()[t][1]) for t in shape.targets) == lora
    assert shape.vocab * shape.hidden == m.lora_model.model.lm_head.weight.numel()


# ----------------------------------------------------------------------------------------- gradient checkpointing
def _loss_and_grads(m: MultiLoraModule, batch: dict, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in m.lora_model.lora_parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = m.compute_loss(batch, seed=seed)["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.lora_model.lora_parameters()]


@pytest.mark.parametrize("scheme", ["base_lr_shared", "full_shared"])
def test_checkpointing_gives_the_same_loss_and_gradients(tmp_path: Path, scheme: str) -> None:
    """With dropout on (its masks must replay in the recomputation) and λ > 0 (the producer's cache is read by the
    consumer and recomputed in backward), checkpointing changes memory, not the loss or the gradients."""
    m = tiny_module(lambda_shared=0.5, dropout=0.2, producer="next", shared_scheme=scheme)
    m.lora_model.init_adapters("random", seed=1, b_std=0.5)
    m.train()
    batch = mixed_batch(tmp_path)
    loss0, grads0 = _loss_and_grads(m, batch, seed=7)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    m.lora_model.decoder.gradient_checkpointing = True
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss1, grads1 = _loss_and_grads(m, batch, seed=7)
    assert torch.allclose(loss0, loss1, atol=1e-6, rtol=0)
    for g0, g1 in zip(grads0, grads1, strict=True):
        assert torch.allclose(g0, g1, atol=1e-6, rtol=1e-5)
    m.lora_model.decoder.gradient_checkpointing = False
    saved_plain: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_plain.append(t.numel()) or t, lambda t: t):
        _loss_and_grads(m, batch, seed=7)
    assert sum(saved) < 0.5 * sum(saved_plain)  # the layers' activations are not kept


def test_module_sets_checkpointing_and_bfloat16_base_with_float32_adapters(tmp_path: Path) -> None:
    m = tiny_module(model_dtype="bfloat16", gradient_checkpointing=True, lambda_shared=0.5)
    assert m.lora_model.decoder.gradient_checkpointing
    assert m.lora_model.model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in m.lora_model.lora_parameters())
    m.lora_model.init_adapters("random", seed=1, b_std=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m.compute_loss(mixed_batch(tmp_path))["loss"]
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.lora_model.lora_parameters())
    with pytest.raises(ValueError, match="float8"):
        MultiLoraModule(model_name="tiny-llama", model_dtype="float8")


# ------------------------------------------------------------------------------------------------- the λ term
@pytest.mark.parametrize(
    ("scheme", "shared_a"), [("base_lr_shared", True), ("full_shared", True), ("full_shared", False)]
)
@pytest.mark.parametrize("split", ["piece", "last_token"])
def test_one_pass_shared_term_equals_the_two_pass_form(tmp_path: Path, scheme: str, shared_a: bool, split: str) -> None:
    """The λ term runs producer and consumer in one pass (a role per token) and scores the supervised positions
    only; its loss is token_loss over the two-pass form's target logits (context re-laid out and encoded by the
    producer into the cache, then the target by the consumer: the form pinned against a session)."""
    m = tiny_module(lambda_shared=1.0, producer="random", shared_scheme=scheme, shared_a=shared_a, shared_split=split)
    m.lora_model.init_adapters("random", seed=3, b_std=0.5)
    batch = mixed_batch(tmp_path)
    producers = m.draw_producers(batch["role_ids"], seed=0)
    parts = split_for_sharing(batch, m.shared_split(batch), m.pad_id)
    assert int(parts["context_mask"].sum(1).min()) > 0  # every row shares some context
    two_pass = m.lora_model.shared_context_forward(
        parts["context_ids"], parts["context_mask"], parts["target_ids"], parts["target_mask"], producers,
        batch["role_ids"], scheme=scheme,
    )  # fmt: skip
    reference, n = token_loss(two_pass, parts["target_labels"])
    out = m.compute_loss(batch, seed=0)
    assert "plain" not in out and n == batch["loss_index"].numel() > 0
    assert torch.allclose(out["shared"], reference, atol=1e-5, rtol=0)
    # and position by position over every consumer token
    one_pass = m.shared_logits(batch, producers, scheme)  # (B, T, V)
    for b in range(batch["input_ids"].shape[0]):
        s, n_b = int(m.shared_split(batch)[b]), int(batch["lengths"][b])
        assert torch.allclose(one_pass[b, s:n_b], two_pass[b, : n_b - s], atol=1e-5, rtol=0)


def test_per_token_roles_equal_per_sequence_roles() -> None:
    """A role per token, constant along a row, is the role per sequence (LoRA layers and decomposed attention)."""
    from lragent.attention import decomposed_attention
    from lragent.multi_lora import MultiLoraLinear

    torch.manual_seed(0)
    for shared_a in (True, False):
        layer = MultiLoraLinear(torch.nn.Linear(16, 12), n_roles=3, rank=4, alpha=8.0, shared_a=shared_a)
        for b in layer.lora_B:
            torch.nn.init.normal_(b)
        x, roles = torch.randn(2, 5, 16), torch.tensor([2, 0])
        assert torch.allclose(layer(x, roles), layer(x, roles[:, None].expand(2, 5)), atol=1e-6)
        mixed = torch.tensor([[0, 0, 1, 1, 2], [2, 1, 1, 0, 0]])
        per_row = torch.stack([layer(x[i : i + 1], mixed[i, t : t + 1])[0, t] for i in range(2) for t in range(5)])
        assert torch.allclose(layer(x, mixed).flatten(0, 1), per_row, atol=1e-6)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    v_lr, lora_b = torch.randn(2, 5, 3), torch.randn(3, 16, 3)
    mixed = torch.tensor([[0, 0, 1, 1, 2], [2, 1, 1, 0, 0]])
    out = decomposed_attention(q, k, v, v_lr, lora_b, 0.5, mixed, use_kernel=False)
    for role in range(3):
        ref = decomposed_attention(q, k, v, v_lr, lora_b, 0.5, torch.full((2,), role), use_kernel=False)
        sel = mixed == role  # (B, Lq)
        assert torch.allclose(out.transpose(1, 2)[sel], ref.transpose(1, 2)[sel], atol=1e-5)


def test_two_pass_producer_skips_its_last_layer_after_the_cache(tmp_path: Path, monkeypatch) -> None:
    """In the two-pass form the producer's last layer writes K/V and returns: its MLP never runs (the consumer's
    does)."""
    m = tiny_module()
    mlp_calls: list[int] = []
    last = m.lora_model.model.model.layers[-1].mlp
    monkeypatch.setattr(last, "forward", lambda x: mlp_calls.append(x.shape[1]) or torch.zeros_like(x))
    batch = mixed_batch(tmp_path)
    parts = split_for_sharing(batch, batch["prefix_len"], m.pad_id)
    m.lora_model.shared_context_forward(
        parts["context_ids"], parts["context_mask"], parts["target_ids"], parts["target_mask"],
        torch.tensor([1, 2, 0, 1]), batch["role_ids"],
    )  # fmt: skip
    assert mlp_calls == [parts["target_ids"].shape[1]]  # once, over the consumer's target positions


# ------------------------------------------------------------------------------------------------------ the CLI
def test_bench_train_runs_on_a_tiny_model(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    data = write_data(tmp_path / "data")
    out = tmp_path / "out"
    argv = [
        "bench", "train", "--model", "tiny-llama", "--model_overrides", json.dumps(TINY), "--data", str(data),
        "--seq_len", "96", "--batch_size", "4", "--steps", "1", "--warmup_steps", "0", "--lambdas", "[0, 0.5]",
        "--lambda_modes", "[weight, sample]", "--checkpointing", "[true]", "--pack_prefixes", "false",
        "--precision", "32-true", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "bench_train.json").read_text())
    sampled = [r for r in result["rows"] if r["lambda_mode"] == "sample"]
    assert [(r["impl"], r["lambda"]) for r in sampled] == [("lragent", 0.5)]  # λ 0 has nothing to sample
    rows = {(r["impl"], r["lambda"]): r for r in result["rows"] if r["lambda_mode"] == "weight"}
    assert set(rows) == {("lragent", 0.0), ("lragent", 0.5), ("peft", 0.0)}
    assert sampled[0]["model_flops"] == rows["lragent", 0.0]["model_flops"]  # one pass per step
    assert rows["lragent", 0.0]["tokens"] == rows["peft", 0.0]["tokens"] > 0  # the same batches
    assert rows["lragent", 0.5]["model_flops"] == 2 * rows["lragent", 0.0]["model_flops"]
    assert rows["lragent", 0.5]["vs_lambda0"] > 0 and rows["lragent", 0.0]["vs_peft"] > 0
    assert result["provenance"]["command"] and result["shape"]["n_layers"] == 2
    md = (out / "bench_train.md").read_text()
    assert "| lragent | 0.5 | on |" in md and "| lragent | 0.5 (sample) | on |" in md


def test_bench_train_counts_absorbed_rows_with_cross_role_batches(tmp_path: Path) -> None:
    """With cross-role batches and the prefix producer, the weighted λ step scores some plain terms in the shared
    pass (counted per row), λ = 0 none, and the report says so."""
    from tests.test_cross_role_batches import write_chained

    (tmp_path / "data").mkdir()
    write_chained(tmp_path / "data")
    out = tmp_path / "out"
    argv = [
        "bench", "train", "--model", "tiny-llama", "--model_overrides", json.dumps(TINY), "--data",
        str(tmp_path / "data"), "--seq_len", "512", "--batch_size", "4", "--steps", "2", "--warmup_steps", "0",
        "--lambdas", "[0, 0.5]", "--checkpointing", "[false]", "--pack_prefixes", "false", "--peft_baseline", "false",
        "--precision", "32-true", "--cross_role_batches", "true", "--producer", "prefix", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "bench_train.json").read_text())
    rows = {r["lambda"]: r for r in result["rows"]}
    assert rows[0.5]["absorbed_rows"] >= 2 and rows[0.0]["absorbed_rows"] == 0
    assert sum(rows[0.5]["step_absorbed"]) == rows[0.5]["absorbed_rows"] and not any(rows[0.0]["step_absorbed"])
    assert result["cross_role_links"] > 0 and result["producer"] == "prefix"
    md = (out / "bench_train.md").read_text()
    assert f"absorbed rows (plain terms scored in the shared pass) per λ > 0 row: {rows[0.5]['absorbed_rows']} in" in md


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lambdas", "[1.5]"], "lambdas must be values in [0, 1], got [1.5]"),
        (["--lambda_modes", "[mixed]"], "lambda_modes must be among weight, sample, got ['mixed']"),
        (["--precision", "fp8"], "precision 'fp8' not supported: allowed bf16-mixed, 32-true, 32"),
        (["--data", "nowhere"], "data 'nowhere' is neither a directory nor a benchmark"),
        (["--rounds", "0"], "rounds must be at least 1, got 0"),
        (["--warm_rounds", "-1"], "warm_rounds must be 0 or more, got -1"),
        (["--seq_len", "512", "--max_tokens", "256"], "max_tokens must be at least seq_len (512)"),
        (["--producer", "first"], "producer 'first' not supported: allowed random, next, prefix"),
    ],
)
def test_bench_train_bad_values_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "train", "--model", "tiny-llama", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_rounds_pool_their_steps_and_keep_each_rounds_own_ratio() -> None:
    """Two rounds of (λ 0, λ 0.5): the pooled row sums steps and seconds; the per-round ratio pairs each round's λ 0.5
    with that round's λ 0 (not the pooled λ 0)."""
    from eval_suite.bench.train import _compare, _measure, _pool_rounds

    shape = ModelShape(1, 8, 2, 1, 4, 16, 10, 2, ("q_proj",))
    dev = torch.device("cpu")

    def steps(seconds: float):
        return lambda: [{"lengths": [3], "padded": 4, "n_scored": 1, "n_examples": 1, "seconds": seconds}] * 3

    measured = []
    for zero, half in ((0.100, 0.200), (0.110, 0.209)):
        rnd = [
            {"impl": "lragent", "lambda": lam, "lambda_mode": "weight", "checkpointing": False, "packed": False,
             **_measure(steps(sec), 1, shape, lam, None, dev)}
            for lam, sec in ((0.0, zero), (0.5, half))
        ]  # fmt: skip
        _compare(rnd)
        measured.append(rnd)
    pooled = _pool_rounds(measured, None)
    _compare(pooled)
    zero, half = pooled
    assert zero["steps"] == half["steps"] == 4 and zero["rounds"] == 2
    assert half["round_ms_per_step"] == pytest.approx([200.0, 209.0])
    assert half["round_vs_lambda0"] == pytest.approx([2.0, 1.9])
    assert half["vs_lambda0"] == pytest.approx(409 / 210)
    assert half["tokens"] == 2 * measured[0][1]["tokens"]


def test_paired_interval_follows_the_batches_not_their_spread() -> None:
    """Batches of very different sizes that each cost exactly 2x under the setting: the paired interval is 2.0 at
    both ends (resampling batches cannot move a ratio every batch shares); an unpaired resampling would spread it.
    When the ratio differs per batch the interval spans the batches' ratios and holds the pooled one."""
    from eval_suite.bench.train import paired_ratio_interval

    zero = [0.5, 1.0, 1.6, 0.9, 1.4, 0.6]
    assert paired_ratio_interval(zero, [2 * z for z in zero]) == pytest.approx([2.0, 2.0])
    # two rounds of the same batches: a batch's time is its mean over the rounds (round-major lists)
    two_rounds = zero + [z * 1.1 for z in zero]
    assert paired_ratio_interval(two_rounds, [2 * z for z in two_rounds], rounds=2) == pytest.approx([2.0, 2.0])
    mixed = [z * r for z, r in zip(zero, [1.5, 2.0, 2.1, 1.8, 2.0, 1.6], strict=True)]
    low, high = paired_ratio_interval(zero, mixed)
    pooled = sum(mixed) / sum(zero)
    assert 1.5 <= low < pooled < high <= 2.1 and high - low > 0.05
    assert paired_ratio_interval(zero, mixed) == [low, high]  # seeded: reproducible
    assert paired_ratio_interval([1.0], [2.0]) is None and paired_ratio_interval(zero, mixed[:5]) is None


def test_speed_against_the_peft_loop_gets_a_paired_interval_over_its_batches() -> None:
    """lragent timed in 2 rounds, the loop in one, over the same 3 batches; the loop takes 1.2x each batch's mean
    lragent time: tokens/s over the loop's is 1.2 with the interval 1.2 at both ends."""
    from eval_suite.bench.train import _compare

    lragent_rounds = [0.5, 1.0, 0.8, 0.7, 1.2, 0.6]  # round-major: batches 0, 1, 2 then again
    means = [(a + b) / 2 for a, b in zip(lragent_rounds[:3], lragent_rounds[3:], strict=True)]
    setting = {"checkpointing": True, "packed": False, "oom": False, "lambda": 0.0, "lambda_mode": "weight"}
    ours = {**setting, "impl": "lragent", "rounds": 2, "step_seconds": lragent_rounds, "ms_per_step": 1e3 * sum(
        lragent_rounds) / 6, "tokens_per_s": 6 * 100 / sum(lragent_rounds)}  # fmt: skip
    loop = {**setting, "impl": "peft", "step_seconds": [1.2 * m for m in means], "ms_per_step": 1.0,
            "tokens_per_s": 3 * 100 / sum(1.2 * m for m in means)}  # fmt: skip
    rows = [ours, loop]
    _compare(rows)
    assert ours["vs_peft"] == pytest.approx(1.2)
    assert ours["vs_peft_interval"] == pytest.approx([1.2, 1.2])
    assert loop["vs_peft_interval"] is None and ours["vs_lambda0_interval"] is None  # nothing to pair with itself


def test_bench_train_warm_rounds_are_not_pooled_and_max_tokens_caps_the_batches(tmp_path: Path) -> None:
    """One warm round and two timed ones: the rows pool only the timed rounds (steps = 2 rounds x steps), keep the
    warm round's step time apart, pair the ratio's interval over the batches; token-budget batches stay within
    ``max_tokens`` padded tokens."""
    out = tmp_path / "out"
    argv = [
        "bench", "train", "--model", "tiny-llama", "--model_overrides", json.dumps(TINY), "--data", "hotpotqa",
        "--seq_len", "512", "--max_tokens", "4096", "--steps", "3", "--warmup_steps", "0", "--rounds", "2",
        "--warm_rounds", "1", "--lambdas", "[0, 0.5]", "--checkpointing", "[false]", "--pack_prefixes", "false",
        "--peft_baseline", "false", "--precision", "32-true", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((out / "bench_train.json").read_text())
    assert result["warm_rounds"] == 1 and result["max_tokens"] == 4096
    zero, half = result["rows"]
    for row in (zero, half):
        assert row["steps"] == 6 and row["rounds"] == 2 and len(row["warm_ms_per_step"]) == 1
        assert row["step_lengths"][:3] == row["step_lengths"][3:]  # each round runs the same batches
        assert all(len(lengths) * max(lengths) <= 4096 for lengths in row["step_lengths"])
    assert any(len(lengths) > 4 for lengths in zero["step_lengths"])  # the budget, not batch_size, set the rows
    low, high = half["vs_lambda0_interval"]
    assert low <= half["vs_lambda0"] <= high and zero["vs_lambda0_interval"] is None
    md = (out / "bench_train.md").read_text()
    assert "after 1 untimed round(s) over the same batches" in md and "batch 4096 padded tokens" in md
    assert f"95% interval {low:.3f}–{high:.3f} over 3 batches" in md


def test_an_out_of_memory_setting_is_a_row_not_the_end() -> None:
    from eval_suite.bench.train import _compare, _measure, render_markdown

    shape = ModelShape(1, 8, 2, 1, 4, 16, 10, 2, ("q_proj",))

    def oom() -> list:
        raise torch.OutOfMemoryError("CUDA out of memory")

    def fine() -> list:
        return [{"lengths": [3], "padded": 4, "n_scored": 1, "n_examples": 1, "seconds": 0.5}] * 2

    dev = torch.device("cpu")
    setting = {"impl": "lragent", "checkpointing": False, "packed": False}
    rows = [
        {**setting, "lambda": 0.0, **_measure(fine, 1, shape, 0.0, None, dev)},
        {**setting, "lambda": 0.5, **_measure(oom, 1, shape, 0.5, None, dev)},
    ]
    _compare(rows)
    assert rows[1]["oom"] and rows[1]["vs_lambda0"] is None and rows[0]["ms_per_step"] == 500.0
    prov = {"device": {"name": "cpu"}, "command": "x"}
    result = {
        "provenance": prov, "rows": rows, "shape": {"n_layers": 1, "hidden": 8, "vocab": 10}, "peak_flops": None,
        "model": "m", "model_overrides": None, "precision": "32-true", "data": "d", "tokenizer": "byte", "seq_len": 4,
        "batch_size": 1, "rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q_proj"], "steps": 1,
        "warmup_steps": 1,
    }  # fmt: skip
    assert "| lragent | 0.5 | off | no | out of memory |" in render_markdown(result)


def test_fit_speed_reports_the_device_it_trained_on(tmp_path: Path, monkeypatch) -> None:
    """Lightning moves the module back to the CPU before ``on_fit_end``: peak memory, MFU and the provenance must
    still describe the GPU the steps ran on (an H200 fit once reported device cpu, no peak memory and no MFU)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    import eval_suite.bench.train as bt

    seen: dict[str, str] = {}
    monkeypatch.setattr(bt, "_sync", lambda device: None)
    gpu_ms = iter(range(0, 1000, 7))
    monkeypatch.setattr(bt, "_cuda_mark", lambda device: _FakeEvent(float(next(gpu_ms))))
    monkeypatch.setattr(_FakeEvent, "synced", True)
    monkeypatch.setattr(bt, "_batch_stats", lambda batch: {"lengths": [64], "n_scored": 16, "padded": 64,
                                                            "n_examples": 1})  # fmt: skip
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2**31)
    monkeypatch.setattr(bt, "provenance", lambda device=None, **kw: seen.setdefault("device", device))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=258)  # fmt: skip
    module = SimpleNamespace(
        device=torch.device("cuda", 0),
        lora_config=SimpleNamespace(rank=4, targets=("q_proj", "v_proj")),
        lora_model=SimpleNamespace(model=SimpleNamespace(config=config)),
        train_config=SimpleNamespace(lambda_shared=0.0, lambda_mode="weight"),
    )
    cb = bt.FitSpeed(str(tmp_path / "speed.json"), warmup=0)
    cb.on_fit_start(None, module)
    for i in range(2):
        cb.on_train_batch_start(None, module, None, i)
        cb.on_train_batch_end(None, module, None, None, i)
    module.device = torch.device("cpu")  # Lightning's teardown
    cb.on_fit_end(SimpleNamespace(global_step=2), module)
    out = json.loads((tmp_path / "speed.json").read_text())
    assert out["peak_memory_gib"] == 1.0 and out["peak_reserved_gib"] == 2.0
    assert out["mfu"] is not None and out["mfu"] > 0
    assert seen["device"] == "cuda"


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: recorded at GPU time ``t`` ms; readable only once the device was synced."""

    synced = False

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, end: _FakeEvent) -> float:
        if not _FakeEvent.synced:
            raise RuntimeError("event read before the device was synchronised")
        return end.t - self.t


@pytest.mark.parametrize("sync_steps", [False, True])
def test_fit_speed_times_gpu_micro_batches_without_stalling_the_host(tmp_path: Path, monkeypatch, sync_steps) -> None:
    """On a GPU, FitSpeed marks each micro-batch with CUDA events and reads them once when training ends: no device
    sync per micro-batch (one would stop the host from running ahead, and under DDP make every rank wait for the
    slowest at every micro-batch); the seconds are the events' GPU times. ``sync_steps=True`` is the old timer: a
    sync at each micro-batch's start and end, the host clock."""
    from types import SimpleNamespace

    import eval_suite.bench.train as bt

    syncs: list[int] = []
    clock = iter([5.0, 10.0, 20.0, 35.0])  # GPU ms at each mark: micro-batches of 5 and 15 ms

    def sync(device):
        syncs.append(len(cb.records))
        _FakeEvent.synced = True

    monkeypatch.setattr(bt, "_sync", sync)
    monkeypatch.setattr(_FakeEvent, "synced", False)
    monkeypatch.setattr(bt, "_cuda_mark", lambda device: _FakeEvent(next(clock)))
    host = iter([1.0, 3.0, 4.0, 8.0])  # host seconds at each mark (sync_steps): 2 and 4 s
    monkeypatch.setattr(bt.time, "perf_counter", lambda: next(host, 100.0))
    module = SimpleNamespace(device=torch.device("cuda", 0))
    batch = {"input_ids": torch.zeros(1, 4), "lengths": torch.tensor([4]), "loss_index": torch.zeros(2),
             "n_examples": 1, "host": {"lengths": [4]}}  # fmt: skip
    cb = bt.FitSpeed(str(tmp_path / "speed.json"), warmup=0, sync_steps=sync_steps)
    for i in range(2):
        cb.on_train_batch_start(None, module, batch, i)
        cb.on_train_batch_end(None, module, None, batch, i)
    if sync_steps:
        assert syncs == [0, 0, 1, 1]  # at every micro-batch's start and end
    else:
        assert syncs == []  # nothing waited for the GPU during training
    cb.on_train_end(SimpleNamespace(world_size=1), module)
    seconds = [r["seconds"] for r in cb.records]
    assert seconds == ([2.0, 4.0] if sync_steps else [0.005, 0.015])
    assert len(syncs) == (4 if sync_steps else 1)  # the events: read after one sync
    assert bt._timer_name(module.device, sync_steps) == ("host clock, device synced at each micro-batch" if sync_steps
                                                         else "cuda events")  # fmt: skip


def test_batch_stats_read_the_host_copy_of_the_lengths() -> None:
    """The lengths come from the host copy (``batch["host"]``) when the batch has one: ``.tolist()`` of the device
    tensor would make the host wait for the GPU at every micro-batch."""
    import eval_suite.bench.train as bt

    class DeviceLengths:
        def tolist(self):
            raise AssertionError("read the device tensor")

    batch = {"input_ids": torch.zeros(2, 5), "lengths": DeviceLengths(), "loss_index": torch.zeros(3),
             "n_examples": 2, "host": {"lengths": [5, 3]}}  # fmt: skip
    assert bt._batch_stats(batch) == {"lengths": [5, 3], "padded": 10, "n_scored": 3, "n_examples": 2}
    batch = {**batch, "lengths": torch.tensor([5, 3])}
    del batch["host"]
    assert bt._batch_stats(batch)["lengths"] == [5, 3]


def test_fit_speed_splits_each_micro_batch_at_lightnings_hooks(tmp_path: Path, monkeypatch) -> None:
    """``phases_ms``: forward (start to on_before_backward), backward, to_optimizer, then ``optimizer`` to the end of
    a micro-batch that steps, ``end`` for one that does not; host times from the host clock, GPU times from the
    events at the same hooks, means over the micro-batches that had the phase."""
    from types import SimpleNamespace

    import eval_suite.bench.train as bt

    host = iter([0.0, 1.0, 3.0, 3.5, 7.5, 10.0, 12.0, 16.0, 17.0])  # seconds at each hook
    gpu = iter([0.0, 2.0, 5.0, 6.0, 14.0, 20.0, 21.0, 22.0, 23.0])  # GPU ms at the same hooks
    monkeypatch.setattr(bt.time, "perf_counter", lambda: next(host))
    monkeypatch.setattr(bt, "_cuda_mark", lambda device: _FakeEvent(next(gpu)))
    monkeypatch.setattr(bt, "_sync", lambda device: None)
    monkeypatch.setattr(_FakeEvent, "synced", True)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    batch = {"input_ids": torch.zeros(1, 4), "loss_index": torch.zeros(2), "n_examples": 1, "host": {"lengths": [4]}}
    cb = bt.FitSpeed(str(tmp_path / "speed.json"), warmup=0)
    cb.on_train_batch_start(None, module, batch, 0)  # a micro-batch that steps: 5 marks
    cb.on_before_backward(None, module, None)
    cb.on_after_backward(None, module)
    cb.on_before_optimizer_step(None, module, None)
    cb.on_train_batch_end(None, module, None, batch, 0)
    cb.on_train_batch_start(None, module, batch, 1)  # one that accumulates: 4 marks
    cb.on_before_backward(None, module, None)
    cb.on_after_backward(None, module)
    cb.on_train_batch_end(None, module, None, batch, 1)
    cb.on_train_end(SimpleNamespace(world_size=1), module)
    summary = bt._phase_summary(cb.records)["phases_ms"]
    assert summary["host"] == {"forward": 1500.0, "backward": 3000.0, "to_optimizer": 500.0, "optimizer": 4000.0,
                               "end": 1000.0}  # fmt: skip
    assert summary["gpu"] == {"forward": 1.5, "backward": 2.0, "to_optimizer": 1.0, "optimizer": 8.0, "end": 1.0}
    assert summary["count"] == {"forward": 2, "backward": 2, "to_optimizer": 1, "optimizer": 1, "end": 1}
    assert [r["seconds"] for r in cb.records] == [0.014, 0.003]  # first to last event of each micro-batch


def test_fit_speed_leaves_no_sync_debug_mode_behind_when_a_fit_stops(monkeypatch, tmp_path: Path) -> None:
    """A fit that raises inside a micro-batch counted with ``sync_debug`` gets torch's sync debug mode and the warning
    filters back as they were (``on_exception``)."""
    import warnings
    from types import SimpleNamespace

    import eval_suite.bench.train as bt

    modes: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(bt, "_cuda_mark", lambda device: _FakeEvent(0.0))
    filters = list(warnings.filters)
    cb = bt.FitSpeed(str(tmp_path / "speed.json"), warmup=0, sync_debug=True)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    batch = {"input_ids": torch.zeros(1, 4), "loss_index": torch.zeros(2), "n_examples": 1, "host": {"lengths": [4]}}
    cb.on_train_batch_start(None, module, batch, 0)
    assert modes == ["warn"] and warnings.filters != filters
    cb.on_exception(None, module, RuntimeError("out of memory"))
    assert modes == ["warn", 0] and warnings.filters == filters


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpointing", "[]"], "checkpointing: give at least one setting (true / false)"),
        (["--steps", "0"], "steps >= 1, warmup_steps >= 0, batch_size >= 1, seq_len >= 2 needed, got 0, "),
        (["--seq_len", "1"], "steps >= 1, warmup_steps >= 0, batch_size >= 1, seq_len >= 2 needed, got "),
    ],
)
def test_bench_train_settings_are_refused_naming_them(args: list[str], message: str, capsys) -> None:
    assert main(["bench", "train", "--model", "tiny-llama", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {message}") and "\n" not in err, err


def test_a_data_directory_without_a_roles_file_is_named(tmp_path, capsys) -> None:
    (tmp_path / "plan.jsonl").write_text('{"input": "q", "output": "a"}\n')
    assert main(["bench", "train", "--model", "tiny-llama", "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: data {tmp_path} has no file for role 'action' (action.jsonl.gz, .jsonl or .json)")
