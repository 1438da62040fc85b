"""How role examples are batched (:class:`datamodules.role_examples.LengthBucketBatchSampler`), by hand: the greedy
token-budget batches, the fixed composition that keeps groups together, the padding share, the per-rank split with
its filler, and the collated batch of a few examples, each to the exact value."""

from __future__ import annotations

import pytest
import torch

from datamodules.records import TokenizedExample
from datamodules.role_examples import (
    FILLER_SOURCE,
    IGNORE_INDEX,
    LengthBucketBatchSampler,
    RoleExampleDataset,
    collate_examples,
    split_indices,
)

LENGTHS = [5, 9, 3, 9, 4]


def test_token_budget_batches_are_greedy_longest_first_within_the_budget() -> None:
    # longest first, ties by index: 1, 3 (9 tokens), 0 (5), 4 (4), 2 (3); rows x longest <= 18
    s = LengthBucketBatchSampler(LENGTHS, batch_size=1, shuffle=False, max_tokens=18)
    assert list(s) == [[1, 3], [0, 4, 2]] and len(s) == 2
    assert s.padding_fraction() == pytest.approx(1 - 30 / 33)  # padded 2 x 9 + 3 x 5, real 18 + 12
    tight = LengthBucketBatchSampler(LENGTHS, batch_size=1, shuffle=False, max_tokens=17)
    assert list(tight) == [[1], [3], [0, 4, 2]] and len(tight) == 3
    assert list(LengthBucketBatchSampler([30, 2, 2], 1, shuffle=False, max_tokens=4)) == [[0], [1, 2]]  # too long


def test_token_budget_batches_keep_their_composition_and_only_change_order() -> None:
    lengths = [7, 3, 9, 2, 8, 4, 6, 5, 1, 10]
    s = LengthBucketBatchSampler(lengths, batch_size=1, seed=4, max_tokens=20)
    fixed = sorted(sorted(b) for b in LengthBucketBatchSampler(lengths, 1, shuffle=False, max_tokens=20))
    orders = []
    for epoch in range(4):
        s.set_epoch(epoch)
        batches = list(s)
        assert sorted(sorted(b) for b in batches) == fixed and len(s) == len(fixed)
        orders.append(batches)
    assert len({str(o) for o in orders}) > 1  # a new order in some epoch
    s.set_epoch(1)
    assert list(s) == orders[1]  # the order of an epoch is seeded


def test_groups_are_batched_whole_by_token_budget() -> None:
    groups = [[0, 2], [1], [3, 4]]  # longest 5, 9, 9: groups 1, 2 (ties by their first index), then 0
    s = LengthBucketBatchSampler(LENGTHS, batch_size=1, shuffle=False, max_tokens=27, groups=groups)
    assert list(s) == [[1, 3, 4], [0, 2]] and len(s) == 2
    s = LengthBucketBatchSampler(LENGTHS, batch_size=1, shuffle=False, max_tokens=26, groups=groups)
    assert list(s) == [[1], [3, 4], [0, 2]]


def test_groups_are_batched_whole_within_batch_size_in_a_fixed_composition() -> None:
    lengths = [10, 1, 7, 2, 6, 3, 9, 4, 8, 5, 11, 12]
    groups = [[0, 1], [2], [3, 4, 5], [6], [7, 8], [9], [10, 11]]
    s = LengthBucketBatchSampler(lengths, batch_size=3, seed=5, pool_batches=2, groups=groups)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(12))
    assert all(len(b) <= 3 for b in batches) and len(s) == len(batches)
    for g in groups:  # a group is never split
        assert sum(1 for b in batches if set(g) & set(b)) == 1
    composition = sorted(sorted(b) for b in batches)
    s.set_epoch(3)
    assert sorted(sorted(b) for b in s) == composition
    # the groups are drawn in one seeded order, cut into pools of batch_size x pool_batches examples, each pool sorted
    # by its groups' longest example, longest first, then cut into batches
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(5)).tolist()
    order = [groups[i] for i in perm]
    expected, start = [], 0
    while start < len(order):
        chunk, n = [], 0
        while start < len(order) and n < 6:
            chunk.append(order[start])
            n += len(order[start])
            start += 1
        expected.append([])
        for g in sorted(chunk, key=lambda g: -max(lengths[i] for i in g)):
            if len(expected[-1]) + len(g) > 3:
                expected.append([])
            expected[-1] += g
    assert composition == sorted(sorted(b) for b in expected)
    unshuffled = LengthBucketBatchSampler(lengths, batch_size=3, seed=5, pool_batches=2, groups=groups, shuffle=False)
    assert list(unshuffled) == expected


def test_group_settings_are_refused_naming_the_problem() -> None:
    with pytest.raises(ValueError) as e:
        LengthBucketBatchSampler([1, 2, 3], 2, groups=[[0, 1], [1, 2]])
    assert str(e.value) == "groups must hold every example index 0..2 exactly once"
    with pytest.raises(ValueError) as e:
        LengthBucketBatchSampler([1, 2, 3], 2, groups=[[0, 1, 2], []])
    assert str(e.value) == "groups must hold every example index 0..2 exactly once"
    with pytest.raises(ValueError) as e:
        LengthBucketBatchSampler([1, 2, 3], 2, groups=[[0, 1, 2]])
    assert str(e.value) == "batch_size 2 is smaller than a group of 3 examples"
    assert list(LengthBucketBatchSampler([1, 2, 3], 2, shuffle=False, max_tokens=9, groups=[[0, 1, 2]])) == [[0, 1, 2]]
    with pytest.raises(ValueError) as e:
        LengthBucketBatchSampler([1, 2, 3], 2, max_tokens=-1)
    assert str(e.value) == "max_tokens must be > 0 or null, got -1"


def test_unshuffled_batches_are_longest_first_and_drop_last_drops_the_short_one() -> None:
    s = LengthBucketBatchSampler(LENGTHS, batch_size=2, shuffle=False)
    assert list(s) == [[1, 3], [0, 4], [2]] and len(s) == 3
    assert s.padding_fraction() == pytest.approx(1 - 30 / (18 + 10 + 3))
    d = LengthBucketBatchSampler(LENGTHS, batch_size=2, shuffle=False, drop_last=True)
    assert list(d) == [[1, 3], [0, 4]] and len(d) == 2
    assert LengthBucketBatchSampler([], 2, shuffle=False).padding_fraction() == 0.0


def test_shuffled_batches_are_sorted_within_pools_and_counted_per_pool() -> None:
    lengths = list(range(1, 12))  # 11 examples, pools of 2 x 2 = 4: 4 + 4 + 3 -> 2 + 2 + 2 batches
    s = LengthBucketBatchSampler(lengths, batch_size=2, seed=1, pool_batches=2)
    batches = list(s)
    assert len(batches) == len(s) == 6 and sorted(i for b in batches for i in b) == list(range(11))
    assert all(lengths[b[0]] >= lengths[b[-1]] for b in batches)
    d = LengthBucketBatchSampler(lengths, batch_size=2, seed=1, pool_batches=2, drop_last=True)
    assert len(list(d)) == len(d) == 5 and all(len(b) == 2 for b in d)
    assert s.sampler is s


def test_ranks_take_every_nth_batch_and_fill_gives_a_filler_to_the_ranks_short_of_one() -> None:
    plain = list(LengthBucketBatchSampler(LENGTHS, batch_size=2, shuffle=False))  # [[1, 3], [0, 4], [2]]
    ranks = [LengthBucketBatchSampler(LENGTHS, 2, shuffle=False, num_replicas=2, rank=r) for r in (0, 1)]
    assert [list(r) for r in ranks] == [[plain[0]], [plain[1]]] and [len(r) for r in ranks] == [1, 1]
    filled = [LengthBucketBatchSampler(LENGTHS, 2, shuffle=False, num_replicas=2, rank=r, fill=True) for r in (0, 1)]
    # the shortest example (index 2, 3 tokens) as filler, at index len + 2
    assert [list(r) for r in filled] == [[plain[0], plain[2]], [plain[1], [5 + 2]]] and [len(r) for r in filled] == [
        2,
        2,
    ]
    tie = LengthBucketBatchSampler([4, 3, 3], 3, shuffle=False, num_replicas=2, rank=1, fill=True)
    assert list(tie) == [[3 + 1]]  # the first of the shortest


def test_a_filler_is_the_example_with_nothing_supervised() -> None:
    e = TokenizedExample(input_ids=[5, 6, 7, 8], context_len=2, prefix_len=1, role_id=1, source="f:1")
    ds = RoleExampleDataset([e])
    assert ds[0] is e and len(ds) == 1 and ds.lengths == [4]
    filler = ds[1]
    assert (filler.input_ids, filler.context_len, filler.source, filler.role_id) == ([5, 6, 7, 8], 4, FILLER_SOURCE, 1)
    batch = collate_examples([e, filler], pad_id=0)
    assert batch["n_examples"] == 1 and batch["loss_index"].tolist() == [1, 2] and batch["n_tokens"] == 8


def test_collate_pads_right_and_lists_the_supervised_positions() -> None:
    a = TokenizedExample(input_ids=[11, 12, 13], context_len=1, prefix_len=0, role_id=2, source="a:1")
    b = TokenizedExample(input_ids=[21, 22, 23, 24, 25], context_len=3, prefix_len=2, role_id=0, source="b:1")
    batch = collate_examples([a, b], pad_id=99)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 99, 99], [21, 22, 23, 24, 25]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[x, 12, 13, x, x], [x, x, x, 24, 25]]
    assert batch["loss_index"].tolist() == [0, 1, 7, 8] and batch["loss_targets"].tolist() == [12, 13, 24, 25]
    assert batch["role_ids"].tolist() == [2, 0] and batch["context_len"].tolist() == [1, 3]
    assert batch["prefix_len"].tolist() == [0, 2] and batch["lengths"].tolist() == [3, 5]
    assert batch["n_tokens"] == 8 and batch["n_examples"] == 2
    longs = ("input_ids", "attention_mask", "labels", "loss_index", "loss_targets", "role_ids", "context_len")
    assert all(batch[k].dtype == torch.long for k in (*longs, "prefix_len", "lengths"))


def test_collate_puts_packed_outputs_at_their_positions() -> None:
    # a context whose first 4 tokens are a shorter example (3 context tokens, then output 14 + EOS 0)
    e = TokenizedExample(input_ids=[11, 12, 13, 14, 0, 16, 17, 18], context_len=6, prefix_len=0, role_id=1,
                         source="p:2", segments=((3, (14, 0)),))  # fmt: skip
    batch = collate_examples([e], pad_id=99)
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[x, x, x, 14, 0, x, 17, 18]]
    assert batch["loss_index"].tolist() == [2, 3, 5, 6] and batch["loss_targets"].tolist() == [14, 0, 17, 18]
    assert batch["n_examples"] == 2


def test_split_indices_hold_out_the_rounded_share_seeded_by_role() -> None:
    tr, va = split_indices(10, 0.25, 0, "plan")  # round(2.5) = 2
    assert len(va) == 2 and sorted(tr + va) == list(range(10)) and tr == sorted(tr) and va == sorted(va)
    assert len(split_indices(10, 0.01, 0, "plan")[1]) == 1  # at least one
    assert len(split_indices(10, 0.36, 0, "plan")[1]) == 4
    assert split_indices(10, 0.3, 7, "plan") == split_indices(10, 0.3, 7, "plan")
    assert split_indices(50, 0.3, 7, "plan") != split_indices(50, 0.3, 8, "plan")
    assert split_indices(1, 0.5, 0, "plan") == ([0], [])  # the only example stays for training


def _module(tmp_path, **kwargs):
    import json

    from datamodules import RoleExampleDataModule, byte_tokenizer

    files = {}
    for role, n in (("plan", 6), ("action", 4)):
        rows = [{"input": f"{role} q{i}: " + "x " * i + "\n", "output": f"{role} a{i}"} for i in range(n)]
        (tmp_path / f"{role}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[role] = str(tmp_path / f"{role}.jsonl")
    return RoleExampleDataModule(files, tokenizer=byte_tokenizer(), max_length=64, **kwargs)


def test_loaders_batch_the_split_as_configured(tmp_path) -> None:
    dm = _module(tmp_path, batch_size=3, val_fraction=0.25, seed=2, pool_batches=7, max_tokens=None, pin_memory=False)
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert (len(dm.train_set), len(dm.val_set)) == (4 + 3, 2 + 1)  # round(0.25 x 6) = 2, round(0.25 x 4) = 1
    for loader, shuffle in ((train, True), (val, False)):
        s = loader.batch_sampler
        assert isinstance(s, LengthBucketBatchSampler) and (s.batch_size, s.shuffle, s.seed) == (3, shuffle, 2)
        assert (s.pool_batches, s.num_replicas, s.rank, s.max_tokens, s.fill) == (7, 1, 0, None, not shuffle)
        assert loader.num_workers == 0 and not loader.persistent_workers and not loader.pin_memory
        assert loader.collate_fn.pad_id == dm.pad_id == dm.tokenizer.pad_token_id
        assert loader.collate_fn.prefix_sources is False
    assert s.lengths == dm.val_set.lengths
    assert sorted(i for b in train for i in b["role_ids"].tolist()) == [0] * 4 + [1] * 3
    assert dm.state_dict() == {"roles": ["plan", "action"], "seed": 2, "val_fraction": 0.25}
    first = dm.train_set
    dm.setup()
    assert dm.train_set is first  # read once


def test_several_processes_shard_the_batches_by_rank_and_refuse_lightnings_sampler(tmp_path) -> None:
    from types import SimpleNamespace

    dm = _module(tmp_path, batch_size=2, pin_memory=True, max_tokens=128)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1, _accelerator_connector=SimpleNamespace(
        use_distributed_sampler=False))  # fmt: skip
    loader = dm.val_dataloader()
    assert (loader.batch_sampler.num_replicas, loader.batch_sampler.rank, loader.batch_sampler.max_tokens) == (
        2,
        1,
        128,
    )
    assert loader.pin_memory
    dm.trainer._accelerator_connector.use_distributed_sampler = True
    with pytest.raises(ValueError) as e:
        dm.train_dataloader()
    assert str(e.value).startswith("trainer.use_distributed_sampler must be false with several processes: ")


def test_resuming_checks_only_the_roles(tmp_path) -> None:
    dm = _module(tmp_path)
    dm.load_state_dict({})
    dm.load_state_dict({"roles": ["plan", "action"], "seed": 9})
    with pytest.raises(ValueError) as e:
        dm.load_state_dict({"roles": ["action", "plan"]})
    assert str(e.value) == "the checkpoint was trained with roles ['action', 'plan'], this run has ['plan', 'action']"


def test_the_pad_id_is_the_eos_where_the_tokenizer_has_no_pad_token(tmp_path) -> None:
    dm = _module(tmp_path)
    dm.tokenizer.pad_token = None
    assert dm.pad_id == dm.tokenizer.eos_token_id is not None


def test_sampler_defaults_and_the_order_of_each_epoch() -> None:
    lengths = [(7 * i) % 50 + 1 for i in range(200)]
    default = LengthBucketBatchSampler(lengths, 3, val_max_per_role=4)
    assert list(default) == list(LengthBucketBatchSampler(lengths, 3, seed=0, pool_batches=50))
    assert list(default) != list(LengthBucketBatchSampler(lengths, 3, seed=0, pool_batches=51))
    assert list(default) != list(LengthBucketBatchSampler(lengths, 3, seed=1))
    assert default.val_max_per_role == 4
    later = LengthBucketBatchSampler(lengths, 3, seed=5)
    later.set_epoch(1)
    assert list(later) == list(LengthBucketBatchSampler(lengths, 3, seed=6))  # the order of seed + epoch
    assert list(LengthBucketBatchSampler([1], 1, max_tokens=1)) == [[0]]
    with pytest.raises(ValueError) as e:
        LengthBucketBatchSampler([1], 1, max_tokens=0)
    assert str(e.value) == "max_tokens must be > 0 or null, got 0"


def test_a_filler_of_a_packed_example_drops_its_packed_outputs() -> None:
    e = TokenizedExample(input_ids=[1, 2, 3, 4], context_len=3, prefix_len=0, role_id=0, source="p:1",
                         segments=((1, (2,)),))  # fmt: skip
    filler = RoleExampleDataset([e])[1]
    assert filler.segments == () and filler.n_examples == 1 and filler.context_len == 4
    assert collate_examples([filler], pad_id=0)["loss_index"].tolist() == []


def test_json_array_records_keep_their_lines(tmp_path) -> None:
    from datamodules.role_examples import _records_from_json_array

    path = tmp_path / "a.json"
    text = '\n[\n  {"input": "see [1]", "output": "a"},\n\n  {"input": "q", "output": "b"}\n]\n'
    recs = _records_from_json_array(text, path)
    assert [(r.input, r.output, r.source) for r in recs] == [("see [1]", "a", f"{path}:3"), ("q", "b", f"{path}:5")]
    compact = _records_from_json_array('[{"input": "q", "output": "a"},{"input": "r", "output": "b"}]', path)
    assert [(r.input, r.source) for r in compact] == [("q", f"{path}:1"), ("r", f"{path}:1")]
    for bad, message in (
        ('[{"input": "q", "output": "a"}', f"{path}:1: not valid JSON (expected ',' or ']' in the array)"),
        ("[", f"{path}:1: not valid JSON (Expecting value)"),
        ("[X]", f"{path}:1: not valid JSON (Expecting value)"),
        ('[{"input": "q", "output": "a"},', f"{path}:1: not valid JSON (Expecting value)"),
    ):
        with pytest.raises(ValueError) as e:
            _records_from_json_array(bad, path)
        assert str(e.value) == message


def test_hub_records_are_named_by_dataset_split_and_row(monkeypatch) -> None:
    import datasets

    from datamodules.role_examples import read_hub_records, read_records

    asked = []

    def load_dataset(name, split):
        asked.append((name, split))
        if name == "gone":
            raise FileNotFoundError()
        return [{"input": "q0", "output": "a0"}, {"input": "q1", "output": "a1", "extra": 1}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    recs = read_records("org/set:dev")
    assert [(r.input, r.output, r.source) for r in recs] == [
        ("q0", "a0", "org/set:dev row 0"),
        ("q1", "a1", "org/set:dev row 1"),
    ]
    assert [r.source for r in read_hub_records("org/set")] == ["org/set:train row 0", "org/set:train row 1"]
    assert asked == [("org/set", "dev"), ("org/set", "train")]
    with pytest.raises(ValueError) as e:
        read_hub_records("gone")
    assert str(e.value) == "data not found: 'gone' is no local file and no loadable dataset ()"


def test_tokenizer_names_are_resolved_and_objects_kept(monkeypatch) -> None:
    import lragent.models
    from datamodules.role_examples import resolve_tokenizer

    loaded = []
    monkeypatch.setattr(lragent.models, "load_tokenizer", lambda name: loaded.append(name) or f"tok:{name}")
    assert resolve_tokenizer("byte").eos_token_id is not None and loaded == []
    assert resolve_tokenizer("default") == "tok:default" and loaded == ["default"]
    obj = object()
    assert resolve_tokenizer(obj) is obj
