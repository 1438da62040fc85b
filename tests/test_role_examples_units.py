"""Role examples piece by piece (datamodules/role_examples.py): record and file errors to the word, the encodings and
formats a file is read in, how an example is framed by fast (offsets) and slow tokenizers with leading and trailing
special tokens, the data module's settings at their edges, and how its setup and loaders pass the options on."""

from __future__ import annotations

import gzip
import json
import locale
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from datamodules import RoleExampleDataModule, RoleRecord, byte_tokenizer, tokenize_example
from datamodules.cross_role_prefixes import prefix_sources
from datamodules.prefix_packing import pack_prefix_chains
from datamodules.records import TokenizedExample
from datamodules.role_examples import (
    LengthBucketBatchSampler,
    _check_record,
    _Collator,
    is_local_spec,
    read_local_records,
    read_records,
    split_indices,
)

BOS, SEP, EOS = 1, 2, 3


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------------------------------------- reading


def test_a_record_of_the_wrong_type_is_refused_naming_the_type_found() -> None:
    with pytest.raises(ValueError) as e:
        _check_record(["q", "a"], "f:1")
    assert str(e.value) == "f:1: a record must be a JSON object with 'input' and 'output', got list"
    with pytest.raises(ValueError) as e:
        _check_record({"input": 3, "output": "a"}, "f:2")
    assert str(e.value) == "f:2: 'input' must be a string, got int"


def test_a_plain_file_that_is_not_utf8_is_refused_as_utf8_text(tmp_path: Path) -> None:
    path = tmp_path / "plan.jsonl"
    path.write_bytes(b'{"input": "\xff", "output": "a"}\n')
    with pytest.raises(ValueError) as e:
        read_local_records(path)
    assert str(e.value).startswith(f"{path}: cannot be read as UTF-8 text: 'utf-8' codec can't decode byte 0xff")


def test_files_are_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """Under the C locale (ASCII) a UTF-8 file, plain or gzip-compressed, still reads as UTF-8."""
    row = {"input": "café?\n", "output": "été"}
    plain = tmp_path / "plan.jsonl"
    packed = tmp_path / "plan.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    plain.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    before = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        read = [read_local_records(p) for p in (plain, packed)]
    finally:
        locale.setlocale(locale.LC_CTYPE, before)
    assert [[(r.input, r.output) for r in recs] for recs in read] == [[("café?\n", "été")]] * 2


def test_a_json_array_after_blank_lines_is_read_as_an_array(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('\n\n  [\n {"input": "q", "output": "a"},\n {"input": "r", "output": "b"}\n]\n')
    assert [(r.input, r.source) for r in read_local_records(path)] == [("q", f"{path}:4"), ("r", f"{path}:5")]


def test_a_spec_is_local_by_its_suffix_or_because_it_exists(tmp_path: Path) -> None:
    """An existing file of any name is read locally (JSON lines here); a known suffix is local even when missing."""
    other = tmp_path / "plan.txt"
    _jsonl(other, [{"input": "q", "output": "a"}])
    assert is_local_spec(str(other)) and is_local_spec(str(tmp_path / "gone.jsonl.gz"))
    assert not is_local_spec(str(tmp_path / "gone.txt")) and not is_local_spec("org/set:train")
    assert [(r.input, r.output, r.source) for r in read_records(other)] == [("q", "a", f"{other}:1")]


# -------------------------------------------------------------------------------------------------------- tokenising


class _PairTokenizer:
    """A slow tokenizer stand-in: every two characters are one token (``1000 * ord(a) + ord(b)``), and with
    ``add_special_tokens`` a BOS (1) in front and a separator (2) behind; EOS is 3. No ``is_fast`` attribute."""

    eos_token_id = EOS

    def __init__(self, width: int = 2) -> None:
        self.width = width

    def _encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        starts = range(0, len(text), self.width)
        ids = [
            sum(1000 ** (self.width - 1 - k) * ord(c) for k, c in enumerate(text[i : i + self.width])) for i in starts
        ]
        offsets = [(i, min(i + self.width, len(text))) for i in starts]
        if add_special_tokens:
            return [BOS, *ids, SEP], [(0, 0), *offsets, (0, 0)]
        return ids, offsets

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self._encode(text, add_special_tokens)[0]}


class _FastPairTokenizer(_PairTokenizer):
    """The same tokens with ``is_fast`` and character offsets (special tokens at ``(0, 0)``)."""

    is_fast = True

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        ids, offsets = self._encode(text, add_special_tokens)
        return {"input_ids": ids, **({"offset_mapping": offsets} if return_offsets_mapping else {})}


# the piece (after the previous output "abc") starts at character 19, inside the token of characters 18-19
TEXT = "Q\n### Response:\nabc\nA\n### Response:\n"


def test_a_fast_tokenizer_counts_the_tokens_that_end_before_the_piece() -> None:
    """Offsets: the BOS and the 9 pairs ending at or before character 19 come before the piece; the trailing
    separator is dropped from the context; the output is its tokens and the EOS."""
    ex = tokenize_example(_FastPairTokenizer(), RoleRecord(TEXT, "ok", "plan.jsonl:7"), role_id=2, max_length=64)
    ctx = _PairTokenizer()(TEXT, add_special_tokens=True)["input_ids"][:-1]
    assert ex.input_ids == [*ctx, 1000 * ord("o") + ord("k"), EOS]
    assert (ex.context_len, ex.prefix_len, ex.role_id, ex.source) == (19, 10, 2, "plan.jsonl:7")


def test_a_slow_tokenizer_counts_the_tokens_of_the_text_before_the_piece() -> None:
    """No offsets: the text before the piece is tokenised alone (19 characters: 10 tokens after the BOS), less the
    trailing separator."""
    ex = tokenize_example(_PairTokenizer(), RoleRecord(TEXT, "ok", "plan.jsonl:7"), role_id=1, max_length=64)
    ctx = _PairTokenizer()(TEXT, add_special_tokens=True)["input_ids"][:-1]
    assert ex.input_ids == [*ctx, 1000 * ord("o") + ord("k"), EOS]
    assert (ex.context_len, ex.prefix_len, ex.source) == (19, 11, "plan.jsonl:7")


@pytest.mark.parametrize("tok", [_PairTokenizer(), _FastPairTokenizer()], ids=["slow", "fast"])
def test_an_input_without_a_previous_output_has_no_prefix_and_an_open_piece_keeps_one_token(tok) -> None:
    """No response marker: prefix 0 (not the BOS). A previous output with no piece after it: everything precedes
    the piece, and the prefix stops one token short of the context."""
    ex = tokenize_example(tok, RoleRecord("Question: why?\n", "ok", "f:1"), role_id=0, max_length=64)
    assert (ex.context_len, ex.prefix_len) == (1 + 8, 0)
    ex = tokenize_example(tok, RoleRecord("Q\n### Response:\nprev", "ok", "f:2"), role_id=0, max_length=64)
    assert (ex.context_len, ex.prefix_len) == (1 + 10, 10)


def test_the_smallest_max_length_keeps_the_bos_and_one_context_token() -> None:
    """Room for exactly the BOS and one context token is enough; one less is refused naming the record."""
    tok = _FastPairTokenizer()
    ex = tokenize_example(tok, RoleRecord(TEXT, "ok", "f:3"), role_id=0, max_length=4)
    assert ex.input_ids == [BOS, *tok(TEXT[-2:])["input_ids"], 1000 * ord("o") + ord("k"), EOS]
    assert (ex.context_len, ex.prefix_len) == (2, 0)
    with pytest.raises(ValueError) as e:
        tokenize_example(tok, RoleRecord(TEXT, "ok", "f:3"), role_id=0, max_length=3)
    assert str(e.value) == (
        "f:3: the output needs 2 tokens (with EOS), which leaves no room for context in max_length=3; raise max_length"
    )


def test_a_cut_that_leaves_only_the_bos_before_the_piece_leaves_no_prefix() -> None:
    """The prefix of 10 (BOS + 9) loses the cut tokens: a cut of 8 keeps 2, a cut of 9 leaves the BOS alone: 0."""
    tok = _FastPairTokenizer()
    kept = tokenize_example(tok, RoleRecord(TEXT, "ok", "f:4"), role_id=0, max_length=2 + 19 - 8)
    assert (kept.context_len, kept.prefix_len) == (11, 2)
    cut = tokenize_example(tok, RoleRecord(TEXT, "ok", "f:4"), role_id=0, max_length=2 + 19 - 9)
    assert (cut.context_len, cut.prefix_len) == (10, 0)
    assert cut.input_ids[:2] == [BOS, kept.input_ids[2]]


def test_a_context_that_just_fits_keeps_its_prefix() -> None:
    """One token holds the whole input (the piece starts inside it): the prefix is the BOS alone, kept when the
    context fills the budget exactly."""
    tok = _FastPairTokenizer(width=64)
    ex = tokenize_example(tok, RoleRecord(TEXT, "ok", "f:5"), role_id=0, max_length=2 + 1 + 1)
    assert (ex.context_len, ex.prefix_len, len(ex.input_ids)) == (2, 1, 4)


# ------------------------------------------------------------------------------------------------------ data module


def _files(tmp_path: Path, n: int = 6) -> dict[str, str]:
    return {
        role: _jsonl(
            tmp_path / f"{role}.jsonl",
            [{"input": f"{role} q{i}: " + "x " * i + "\n", "output": f"a{i}"} for i in range(n)],
        )  # fmt: skip
        for role in ("plan", "action")
    }


def test_the_data_module_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults, read back from the module (not from ``hparams``: save_hyperparameters reads the constructor's
    frame, which mutmut's trampoline hides), and the default tokenizer is the embedded model's, loaded on first use."""
    import lragent.models

    dm = RoleExampleDataModule(_files(tmp_path))
    assert (dm.roles, dm.max_length, dm.batch_size, dm.val_fraction, dm.seed, dm.val_max_per_role) == (
        ["plan", "action"], 1024, 4, 0.05, 0, None
    )  # fmt: skip
    assert (dm.pool_batches, dm.num_workers, dm.pack_prefixes, dm.max_tokens, dm.answer_thoughts) == (
        50, 0, False, None, False
    )  # fmt: skip
    assert (dm.cross_role_batches, dm.cross_role_min_share, dm.option_variants) == (False, 0.6, None)
    assert dm.pin_memory is torch.cuda.is_available()
    assert dm.train_set is None and dm.val_set is None and dm.train_groups is None
    assert dm.variant_stats == {} and dm.answer_thought_stats == {}
    loaded = []
    monkeypatch.setattr(lragent.models, "load_tokenizer", lambda name: loaded.append(name) or byte_tokenizer())
    assert loaded == [] and dm.tokenizer.eos_token_id is not None and loaded == ["default"]


@pytest.mark.parametrize(
    "edge",
    [
        {"max_length": 2}, {"batch_size": 1}, {"val_fraction": 0.0}, {"val_max_per_role": 1},
        {"max_length": 64, "max_tokens": 64}, {"option_variants": [2, 10]}, {"cross_role_min_share": 0.0},
        {"cross_role_min_share": 1.0}, {"pack_prefixes": True}, {"cross_role_batches": True},
    ],
)  # fmt: skip
def test_settings_at_their_edges_are_accepted(tmp_path: Path, edge: dict) -> None:
    dm = RoleExampleDataModule(_files(tmp_path), tokenizer="byte", **edge)
    assert all(getattr(dm, k) == v for k, v in edge.items())
    assert all(type(getattr(dm, k)) is type(v) for k, v in edge.items())  # the flags stay bools, the share a float


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_length": 64, "max_tokens": 63}, "max_tokens must be >= max_length (64) or null, got 63"),
        *[
            ({"option_variants": bad}, f"option_variants must be a non-empty list of option counts in 2..10, got {bad}")
            for bad in ([], [1], [11], [3, True], [3, "4"])
        ],
        ({"cross_role_min_share": 1.5}, "cross_role_min_share must be in [0, 1], got 1.5"),
        (
            {"cross_role_batches": True, "pack_prefixes": True},
            "cross_role_batches and pack_prefixes cannot be combined: cross-role batches serve the cache-sharing "
            "loss, which needs one example per sequence (set data.pack_prefixes false)",
        ),
    ],
)
def test_bad_settings_are_refused_in_full(tmp_path: Path, change: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        RoleExampleDataModule(_files(tmp_path), tokenizer="byte", **change)
    assert str(e.value) == message


def test_role_errors_list_every_role_and_file(tmp_path: Path) -> None:
    files = _files(tmp_path)
    with pytest.raises(ValueError) as e:
        RoleExampleDataModule({**files, "critic": files["plan"]}, roles=["plan", "action"])
    assert str(e.value) == "unknown role 'critic' in data_files: roles are plan, action"
    with pytest.raises(ValueError) as e:
        RoleExampleDataModule(files, roles=["plan", "action", "reflect"])
    assert str(e.value) == "no data file for role 'reflect': data_files has plan, action"


def test_setup_splits_each_role_by_its_own_name(tmp_path: Path) -> None:
    dm = RoleExampleDataModule(_files(tmp_path, n=20), tokenizer="byte", max_length=64, val_fraction=0.25, seed=4)
    dm.setup()
    tok = dm.tokenizer
    for role_id, role in enumerate(dm.roles):
        _, val = split_indices(20, 0.25, 4, role)
        texts = [tok.decode(e.input_ids[: e.context_len]) for e in dm.val_set.examples if e.role_id == role_id]
        assert texts == [f"{role} q{i}: " + "x " * i + "\n" for i in val]
    assert split_indices(20, 0.25, 4, "plan") != split_indices(20, 0.25, 4, "action")


def test_setup_passes_the_training_records_through_the_variants_then_the_answer_thoughts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Option variants (with the configured counts and seed) and then answer thoughts rewrite the training records
    only; their statistics are kept."""
    import datamodules.answer_thoughts
    import datamodules.option_variants

    calls = []

    def variants(records, counts, seed):
        calls.append(("variants", {r: len(v) for r, v in records.items()}, counts, seed))
        return {r: [*v, RoleRecord(f"{r} variant\n", "v", "variant")] for r, v in records.items()}, {"added": 2}

    def thoughts(records):
        calls.append(("thoughts", {r: len(v) for r, v in records.items()}))
        return {r: [*v, RoleRecord(f"{r} thought\n", "t", "thought")] for r, v in records.items()}, {"thoughts": 2}

    monkeypatch.setattr(datamodules.option_variants, "option_count_variants", variants)
    monkeypatch.setattr(datamodules.answer_thoughts, "add_answer_thoughts", thoughts)
    dm = RoleExampleDataModule(_files(tmp_path), tokenizer="byte", max_length=64, val_fraction=0.5, seed=3,
                               option_variants=[3, 2], answer_thoughts=True)  # fmt: skip
    dm.setup()
    assert calls == [("variants", {"plan": 3, "action": 3}, [3, 2], 3), ("thoughts", {"plan": 4, "action": 4})]
    assert (dm.variant_stats, dm.answer_thought_stats) == ({"added": 2}, {"thoughts": 2})
    assert [e.source for e in dm.train_set.examples if e.role_id == 1][-2:] == ["variant", "thought"]
    assert len(dm.train_set) == 10 and len(dm.val_set) == 6


def test_setup_packs_the_training_prefixes_only(tmp_path: Path) -> None:
    rows = [
        {"input": "Task\n", "output": "a"},
        {"input": "Task\na\nmore\n", "output": "b"},  # its context starts with the first example
        {"input": "Other\n", "output": "c"},
    ]
    files = {"plan": _jsonl(tmp_path / "plan.jsonl", rows)}
    args = dict(tokenizer="byte", max_length=64, val_fraction=0.0)
    plain, packed = RoleExampleDataModule(files, **args), RoleExampleDataModule(files, pack_prefixes=True, **args)
    plain.setup()
    packed.setup()
    assert packed.train_set.examples == pack_prefix_chains(plain.train_set.examples)
    assert len(packed.train_set) == 2 and len(plain.train_set) == 3


def test_cross_role_groups_use_the_batch_size_or_four_and_the_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chains are formed over the training examples, up to a batch (4 under a token budget), with the
    configured share; the training sampler keeps them together, the validation sampler has none, and only the
    training batches list their prefix sources."""
    import datamodules.cross_role_prefixes

    asked = []

    def groups(examples, max_group, share):
        asked.append((list(examples), max_group, share))
        return [[1, 0], *([i] for i in range(2, len(examples)))]

    monkeypatch.setattr(datamodules.cross_role_prefixes, "cross_role_groups", groups)

    def extra_sampler(extra: dict) -> dict:
        return {"max_tokens": extra.get("max_tokens")}

    args = dict(tokenizer="byte", max_length=64, val_fraction=0.25, cross_role_batches=True, cross_role_min_share=0.3)
    for extra, size in (({"batch_size": 3}, 3), ({"batch_size": 3, "max_tokens": 640}, 4)):
        dm = RoleExampleDataModule(_files(tmp_path), **args, **extra)
        train, val = dm.train_dataloader(), dm.val_dataloader()
        assert asked[-1] == (dm.train_set.examples, size, 0.3)
        assert dm.train_groups == groups(dm.train_set.examples, 0, 0)
        grouped = LengthBucketBatchSampler(dm.train_set.lengths, 3, groups=dm.train_groups, **extra_sampler(extra))
        assert list(train.batch_sampler) == list(grouped)
        assert list(val.batch_sampler) == list(LengthBucketBatchSampler(dm.val_set.lengths, 3, shuffle=False,
                                                                        fill=True, **extra_sampler(extra)))  # fmt: skip
        assert train.collate_fn.prefix_sources is True and val.collate_fn.prefix_sources is False
        assert any(1 in b and 0 in b for b in train.batch_sampler)


def test_the_collator_lists_prefix_sources_only_when_asked() -> None:
    rows = [TokenizedExample([5, 6, 7, 0], 2, 0, 0, "p"), TokenizedExample([5, 6, 7, 8, 9, 0], 4, 0, 1, "a")]
    assert prefix_sources(rows) == [[], [(0, 3)]]
    assert _Collator(0, prefix_sources=True)(rows)["prefix_sources"] == [[], [(0, 3)]]
    assert "prefix_sources" not in _Collator(0)(rows)


def test_worker_processes_persist_between_epochs(tmp_path: Path) -> None:
    dm = RoleExampleDataModule(_files(tmp_path), tokenizer="byte", max_length=64, val_fraction=0.25, num_workers=1)
    loader = dm.val_dataloader()  # built, not iterated: no worker starts
    assert loader.num_workers == 1 and loader.persistent_workers is True


def test_lightnings_sampler_is_refused_only_with_several_processes(tmp_path: Path) -> None:
    """One process may keep Lightning's default; several must turn it off (said in full); a trainer without an
    accelerator connector has no sampler to refuse."""
    dm = RoleExampleDataModule(_files(tmp_path), tokenizer="byte", max_length=64, val_fraction=0.25)
    dm.trainer = SimpleNamespace(world_size=1, global_rank=0,
                                 _accelerator_connector=SimpleNamespace(use_distributed_sampler=True))  # fmt: skip
    assert dm.val_dataloader().batch_sampler.num_replicas == 1
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1)
    assert dm.val_dataloader().batch_sampler.rank == 1
    dm.trainer._accelerator_connector = SimpleNamespace(use_distributed_sampler=True)
    with pytest.raises(ValueError) as e:
        dm.train_dataloader()
    assert str(e.value) == (
        "trainer.use_distributed_sampler must be false with several processes: the data module shards its "
        "length-bucketed batches by rank itself (add --config configs/ddp.yaml, or "
        "--trainer.use_distributed_sampler false)"
    )


def test_a_pool_of_one_batch_closes_as_soon_as_it_holds_a_batch() -> None:
    """``pool_batches=1`` is allowed; grouped single examples are drawn in the seeded order and every pool closes
    at exactly ``batch_size`` examples: consecutive pairs of that order, each longest first."""
    lengths = [4, 1, 6, 3, 5, 2]
    s = LengthBucketBatchSampler(lengths, 2, shuffle=False, seed=0, pool_batches=1, groups=[[i] for i in range(6)])
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0)).tolist()
    pairs = [sorted(order[k : k + 2], key=lambda i: -lengths[i]) for k in (0, 2, 4)]
    assert list(s) == pairs and len(s) == 3
