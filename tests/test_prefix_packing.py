"""Prefix packing and token-budget batches: packing is exact, scores every example once, and saves tokens."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import (
    IGNORE_INDEX,
    LengthBucketBatchSampler,
    RoleExampleDataModule,
    RoleRecord,
    byte_tokenizer,
    collate_examples,
    pack_prefix_chains,
    tokenize_example,
)
from lit_modules import MultiLoraModule

REPO = Path(__file__).resolve().parents[1]
ROLES = ["plan", "action", "reflect"]
TINY = {"vocab_size": 258, "num_hidden_layers": 2}


def write_trajectories(tmp_path: Path, n: int = 4, steps: int = 3) -> dict[str, str]:
    """Role files cut from whole trajectories, as the bundled data: step k's input holds steps 0..k-1."""
    files = {}
    for r, role in enumerate(ROLES):
        rows = []
        for i in range(n):
            history = f"Question {i}: what is {i} + {r}?\n"
            for k in range(steps):
                prompt = history + f"{role.capitalize()}: \n### Response:\n"
                output = f"{role} step {k} of {i}"
                rows.append({"input": prompt, "output": output})
                history = prompt + output + f"\nObs: ok {k}\n"
        path = tmp_path / f"{role}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in rows))
        files[role] = str(path)
    return files


def datamodule(files: dict[str, str], pack: bool, **kwargs) -> RoleExampleDataModule:
    args = dict(tokenizer=byte_tokenizer(), max_length=512, val_fraction=0.0, pack_prefixes=pack)
    dm = RoleExampleDataModule(files, roles=ROLES, **{**args, **kwargs})
    dm.setup()
    return dm


def unpack(sequences) -> Counter:
    """The examples a list of (packed) sequences scores: (role, ids, context_len) with multiplicity."""
    out: Counter = Counter()
    for s in sequences:
        out[(s.role_id, tuple(s.input_ids), s.context_len)] += 1
        for ctx, target in s.segments:
            out[(s.role_id, tuple(s.input_ids[:ctx]) + tuple(target), ctx)] += 1
    return out


def test_packed_batch_gives_the_same_loss_and_gradients(tmp_path: Path) -> None:
    files = write_trajectories(tmp_path)
    plain, packed = datamodule(files, False), datamodule(files, True)
    assert len(packed.train_set) == 3 * 4 < len(plain.train_set) == 3 * 12  # one sequence per trajectory and role
    assert sum(packed.train_set.lengths) < 0.5 * sum(plain.train_set.lengths)
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, dropout=0.0)
    m.configure_model()
    m.lora_model.init_adapters("random", seed=1, b_std=0.5)
    results = []
    for dm in (plain, packed):
        batch = collate_examples(dm.train_set.examples, pad_id=257)
        m.zero_grad()
        loss = m.compute_loss(batch)["loss"]
        loss.backward()
        grads = [p.grad.clone() for p in m.lora_model.lora_parameters()]
        results.append((loss.detach(), batch["loss_index"].numel(), grads))
    (loss_a, n_a, grads_a), (loss_b, n_b, grads_b) = results
    assert n_a == n_b  # every output token (and EOS) is scored once either way
    assert torch.allclose(loss_a, loss_b, atol=1e-5, rtol=0)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(ga, gb, atol=1e-5, rtol=1e-4)


def test_packing_the_bundled_trajectories_scores_every_example_once() -> None:
    tok = byte_tokenizer()  # bytes: the prefix structure is the text's own
    examples = []
    for rid, role in enumerate(ROLES):
        from datamodules import read_records

        records = read_records(REPO / f"data/trajectories/hotpotqa/{role}.jsonl.gz")
        examples += [tokenize_example(tok, r, rid, max_length=20_000) for r in records]
    packed = pack_prefix_chains(examples)
    assert sum(s.n_examples for s in packed) == len(examples) == 1354 + 698 + 450
    assert unpack(packed) == unpack(examples)  # exactly the original examples, each once
    ratio = sum(len(s.input_ids) for s in packed) / sum(len(e.input_ids) for e in examples)
    assert ratio < 0.35, ratio  # measured: 0.30 of the bytes
    for s in packed:  # a segment's labels sit inside the host's context, never on its own output
        assert all(ctx + len(target) <= s.context_len for ctx, target in s.segments)


def test_colliding_examples_stay_separate() -> None:
    tok = byte_tokenizer()
    host = RoleRecord("Q\n### Response:\nx\nMore\n### Response:\n", "y", "f:1")
    inner = RoleRecord("Q\n### Response:\n", "x", "f:2")
    examples = [tokenize_example(tok, r, 0, 256) for r in (host, inner, inner)]  # the inner one twice
    packed = pack_prefix_chains(examples)
    assert sorted(s.n_examples for s in packed) == [1, 2]  # one rides in the host, its duplicate cannot
    assert unpack(packed) == unpack(examples)
    other_role = [examples[0], tokenize_example(tok, inner, 1, 256)]
    assert [s.n_examples for s in pack_prefix_chains(other_role)] == [1, 1]  # never across roles


def test_loss_index_lists_every_supervised_prediction(tmp_path: Path) -> None:
    dm = datamodule(write_trajectories(tmp_path), True)
    batch = collate_examples(dm.train_set.examples[:5], pad_id=257)
    labels, index, targets = batch["labels"], batch["loss_index"], batch["loss_targets"]
    t = labels.shape[1]
    expected = [(b, p) for b in range(labels.shape[0]) for p in range(t - 1) if labels[b, p + 1] != IGNORE_INDEX]
    assert [(int(i) // t, int(i) % t) for i in index] == expected  # row-major
    assert targets.tolist() == [int(labels[b, p + 1]) for b, p in expected]
    # A packed example's EOS is a target where the next input token is not EOS (causal: nothing reads ahead).
    eos_inside = [(b, p) for (b, p), y in zip(expected, targets.tolist(), strict=True) if y == 256]
    assert any(batch["input_ids"][b, p + 1] != 256 for b, p in eos_inside)
    assert batch["n_examples"] == sum(e.n_examples for e in dm.train_set.examples[:5])
    assert batch["n_tokens"] == int(batch["attention_mask"].sum())


def test_token_budget_batches() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 500, (1000,), generator=g).tolist()
    s = LengthBucketBatchSampler(lengths, batch_size=8, seed=3, max_tokens=2000)
    epochs = []
    for epoch in range(3):
        s.set_epoch(epoch)
        epochs.append(list(s))
        assert len(epochs[-1]) == len(s)  # the count Lightning plans with, every epoch
        assert sorted(i for b in epochs[-1] for i in b) == list(range(1000))
        for b in epochs[-1]:
            assert len(b) * max(lengths[i] for i in b) <= 2000
    assert epochs[0] != epochs[1] and sorted(map(tuple, epochs[0])) == sorted(map(tuple, epochs[1]))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in epochs[0])
    assert s.padding_fraction() == pytest.approx(1 - sum(lengths) / padded)
    fixed = LengthBucketBatchSampler(lengths, batch_size=8, seed=3)
    assert s.padding_fraction() < fixed.padding_fraction() < 0.02  # measured: 0.011 (sorted once) vs 0.019 (pools)
    assert list(LengthBucketBatchSampler([3000, 10], batch_size=1, shuffle=False, max_tokens=1000)) == [[0], [1]]
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        LengthBucketBatchSampler(lengths, 8, max_tokens=0)


def test_max_tokens_below_max_length_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_tokens must be >= max_length \(512\)"):
        datamodule(write_trajectories(tmp_path), True, max_tokens=100)


def test_data_stats_reports_lengths_and_batches(tmp_path: Path) -> None:
    from datamodules import read_records
    from eval_suite.diagnostics.data_stats import data_stats

    assert data_stats(str(tmp_path), ["scienceqa"], tokenizer="byte", max_length=8000, max_tokens=20000) == 0
    stats = json.loads((tmp_path / "data_stats.json").read_text())["benchmarks"]["scienceqa"]
    for role, n in (("plan", 944), ("action", 518), ("reflect", 520)):
        records = read_records(REPO / f"data/trajectories/scienceqa/{role}.jsonl.gz")
        lengths = sorted(len(r.input.encode()) + len(r.output.encode()) + 1 for r in records)  # bytes + EOS
        s = stats["roles"][role]
        assert s["n"] == n and s["max"] == lengths[-1] and s["p50"] == float(np.median(lengths))
        assert s["fit_share"] == sum(x <= 8000 for x in lengths) / n
    conf, base = stats["batching"]["configured"], stats["batching"]["baseline"]
    assert conf["examples"] == base["examples"] == base["sequences"] > conf["sequences"]
    assert conf["tokens"] < 0.5 * base["tokens"] and 0 <= conf["padding"] < 0.05
    assert conf["padded_tokens"] / conf["batches"] <= 20000
    assert base["optimizer_steps"] == base["batches"] / 8 and base["examples_per_step"] == pytest.approx(32, rel=0.01)
    assert "| plan | 944 |" in (tmp_path / "data_stats.md").read_text()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--benchmarks", '["scienceqa", "gsm8k"]'], "benchmark 'gsm8k' not bundled: allowed "),
        (["--max_length", "1"], "need max_length >= 2 and max_tokens >= max_length, got 1, 16384"),
        (["--max_length", "64", "--max_tokens", "32"], "need max_length >= 2 and max_tokens >= max_length, got 64, 32"),
    ],
)
def test_data_stats_refuses_bad_options_naming_them(capsys, tmp_path: Path, argv, expected) -> None:
    from lragent.cli_main import main

    assert main(["data-stats", "--out", str(tmp_path / "stats"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "stats").exists()


def test_length_stats_count_an_example_of_exactly_max_length_as_fitting() -> None:
    from eval_suite.diagnostics.data_stats import length_stats

    s = length_stats([10, 20, 30, 40], [1, 2, 3, 4], max_length=30)
    assert s["fit_share"] == 0.75 and s["max"] == 40 and s["n"] == 4
    assert s["output_share"] == 10 / 100 and s["p50"] == 25.0


def _role_examples(pairs: list[tuple[str, str]], role_id: int = 0) -> list:
    tok = byte_tokenizer()  # bytes: id = byte value, EOS = 256
    return [tokenize_example(tok, RoleRecord(i, o, f"f:{n}"), role_id, 256) for n, (i, o) in enumerate(pairs, 1)]


def test_an_example_rides_in_a_host_whose_context_strictly_extends_it_not_in_one_that_merely_equals_it() -> None:
    """``a``+``b`` is the whole context of ``ab -> c`` (its EOS label would sit on that host's first output label)
    and a strict prefix of ``abd -> e``'s context: it rides in the latter; the unrelated ones stay as they are."""
    examples = _role_examples([("a", "b"), ("ab", "c"), ("abd", "e"), ("A", "x"), ("B", "y")])
    short, equal, longer, other_a, other_b = examples
    packed = pack_prefix_chains(examples)
    assert packed == [equal, replace(longer, segments=((1, (ord("b"), 256)),)), other_a, other_b]
    assert unpack(packed) == unpack(examples)


def test_an_example_whose_last_output_token_differs_from_the_hosts_context_is_not_packed() -> None:
    """Packing needs every token but the EOS to match: ``q`` -> ``xy`` is not a prefix of ``qxzzz``."""
    examples = _role_examples([("q", "xy"), ("qxzzz", "w")])
    assert pack_prefix_chains(examples) == examples
    assert [s.segments for s in pack_prefix_chains(examples)] == [(), ()]


def test_a_packed_host_is_the_same_whatever_the_order_of_the_examples() -> None:
    """The segments are listed by position in the host (``a -> b`` at 1, ``abc -> d`` at 3), in any input order."""
    host, first, second = _role_examples([("abcdefgh", "z"), ("a", "b"), ("abc", "d")])
    expected = replace(host, segments=((1, (ord("b"), 256)), (3, (ord("d"), 256))))
    assert pack_prefix_chains([host, first, second]) == [expected]
    assert pack_prefix_chains([second, first, host]) == [expected]
    assert pack_prefix_chains([first, host, second]) == [expected]


def test_an_example_left_out_by_a_collision_does_not_keep_later_ones_out_of_the_host() -> None:
    """The duplicate of ``a -> b`` collides with it and stays alone; ``abc -> d``, further on, still rides along."""
    host, first, duplicate, later = _role_examples([("abcdefgh", "z"), ("a", "b"), ("a", "b"), ("abc", "d")])
    packed = pack_prefix_chains([host, first, duplicate, later])
    assert packed == [replace(host, segments=((1, (ord("b"), 256)), (3, (ord("d"), 256)))), duplicate]
    assert sum(s.n_examples for s in packed) == 4
