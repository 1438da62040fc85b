"""Role example data: loss mask, truncation, split, error reporting, formats, length batching."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import processors

from datamodules import (
    IGNORE_INDEX,
    LengthBucketBatchSampler,
    RoleExampleDataModule,
    RoleRecord,
    byte_tokenizer,
    collate_examples,
    last_piece_start,
    read_records,
    split_indices,
    tokenize_example,
)

ROLES = ["plan", "action", "reflect"]
REPO = Path(__file__).resolve().parents[1]


def _records(role: str, n: int) -> list[dict]:
    return [
        {"input": f"{role} question {i}: " + "context " * (i % 7) + "\n### Response:\n", "output": f"{role} answer {i}"}
        for i in range(n)
    ]


def _write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _bos_byte_tokenizer():
    """The byte tokenizer with a BOS (the pad token, id 257, stands in for it) prepended to every input."""
    tok = byte_tokenizer()
    tok.bos_token = "<pad>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<pad> $A", special_tokens=[("<pad>", 257)]
    )
    return tok


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


# ----------------------------------------------------------------------------------------------------- loss mask


def test_loss_mask_is_exactly_output_and_eos(tok) -> None:
    recs = [RoleRecord("Question: why?\n### Response:\n", "Because.", "x:1"), RoleRecord("ab\n", "c d e f", "x:2")]
    exs = [tokenize_example(tok, r, role_id=i, max_length=64) for i, r in enumerate(recs)]
    batch = collate_examples(exs, pad_id=tok.pad_token_id)
    for i, r in enumerate(recs):
        out = list(r.output.encode()) + [tok.eos_token_id]
        ctx = list(r.input.encode())
        mask = batch["labels"][i] != IGNORE_INDEX
        assert batch["labels"][i][mask].tolist() == out
        # The supervised tokens are exactly positions context_len .. length-1.
        c, n = int(batch["context_len"][i]), int(batch["lengths"][i])
        assert c == len(ctx) and n == len(ctx) + len(out)
        assert mask.nonzero().flatten().tolist() == list(range(c, n))
        assert batch["input_ids"][i, :c].tolist() == ctx
        assert batch["attention_mask"][i].sum() == n
        assert (batch["input_ids"][i, n:] == tok.pad_token_id).all()
    assert batch["role_ids"].tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------------- truncation


@settings(max_examples=60, deadline=None)
@given(
    ctx=st.text(st.characters(codec="ascii", exclude_characters="<"), min_size=1, max_size=80),
    out=st.text(st.characters(codec="ascii", exclude_characters="<"), min_size=1, max_size=30).filter(str.strip),
    max_length=st.integers(min_value=2, max_value=120),
)
def test_truncation_keeps_output_and_most_recent_context(ctx: str, out: str, max_length: int) -> None:
    tok = byte_tokenizer()
    rec = RoleRecord(ctx, out, "f.jsonl:3")
    out_ids = list(out.encode()) + [tok.eos_token_id]
    if len(out_ids) + 1 > max_length:
        with pytest.raises(ValueError, match=r"f\.jsonl:3"):
            tokenize_example(tok, rec, 0, max_length)
        return
    ex = tokenize_example(tok, rec, 0, max_length)
    ctx_ids = list(ctx.encode())
    kept = min(len(ctx_ids), max_length - len(out_ids))
    assert len(ex.input_ids) == kept + len(out_ids) <= max_length
    assert ex.context_len == kept
    assert ex.input_ids[: ex.context_len] == ctx_ids[len(ctx_ids) - kept :]  # the most recent context
    assert ex.input_ids[ex.context_len :] == out_ids  # the whole output + EOS


def test_truncation_keeps_a_leading_bos() -> None:
    tok = _bos_byte_tokenizer()
    rec = RoleRecord("0123456789" * 5, "out", "f:1")
    ex = tokenize_example(tok, rec, 0, max_length=20)
    assert len(ex.input_ids) == 20
    assert ex.input_ids[0] == 257  # BOS survives the left cut
    assert ex.context_len == 16  # BOS + the last 15 input bytes
    assert ex.input_ids[1:16] == list(("0123456789" * 5).encode()[-15:])
    assert ex.input_ids[ex.context_len :] == list(b"out") + [tok.eos_token_id]


def test_real_data_truncated_examples_fit(tok) -> None:
    files = {r: str(REPO / f"data/trajectories/scienceqa/{r}.jsonl.gz") for r in ROLES}
    dm = RoleExampleDataModule(files, tokenizer=tok, max_length=400, batch_size=16, val_fraction=0.1)
    dm.setup()
    for ex in dm.train_set.examples + dm.val_set.examples:
        assert len(ex.input_ids) <= 400 and 1 <= ex.context_len < len(ex.input_ids)
        assert ex.input_ids[-1] == tok.eos_token_id
    assert len(dm.train_set) + len(dm.val_set) == 944 + 518 + 520


# --------------------------------------------------------------------------------------------- last prompt piece


@pytest.mark.parametrize(
    ("text", "piece"),
    [
        ("Q?\nThought: \n### Response:\nI add.\nAction: \n### Response:\n", "\nAction: \n### Response:\n"),
        (
            "Q?\n### Response:\nSearch[x]\nObversation: none\nThought: \n### Response:\n",
            "\nObversation: none\nThought: \n### Response:\n",
        ),
        ("Q?\nThought: \n### Response:\nMy answer is correct.\n", "\n"),  # second-stage reflect
        ("Question: Q?\nThought: \n### Response:\n", "Question: Q?\nThought: \n### Response:\n"),  # first step
    ],
)
def test_last_piece_is_what_the_consumer_prefills_itself(tok, text: str, piece: str) -> None:
    start = last_piece_start(text)
    assert text[start:] == piece
    ex = tokenize_example(tok, RoleRecord(text, "out", "f:1"), 0, max_length=256)
    assert ex.prefix_len == (0 if start == 0 else len(text[:start].encode()))
    assert tok.decode(ex.input_ids[ex.prefix_len : ex.context_len]) == piece


def test_prefix_len_follows_the_left_cut(tok) -> None:
    text = "0123456789" * 3 + "\n### Response:\nprev\nNext: \n### Response:\n"
    piece_len = len("\nNext: \n### Response:\n")
    full = tokenize_example(tok, RoleRecord(text, "ab", "f:1"), 0, max_length=256)
    assert full.context_len - full.prefix_len == piece_len
    cut = tokenize_example(tok, RoleRecord(text, "ab", "f:1"), 0, max_length=full.context_len - 5 + 3)
    assert cut.context_len == full.context_len - 5 and cut.prefix_len == full.prefix_len - 5
    tiny = tokenize_example(tok, RoleRecord(text, "ab", "f:1"), 0, max_length=piece_len + 3 - 2)
    assert tiny.prefix_len == 0 and tiny.context_len == piece_len - 2  # the shared part is gone entirely


# --------------------------------------------------------------------------------------------------------- split


def _dm(tmp_path: Path, tok, seed: int = 0, val_fraction: float = 0.2, sizes=(30, 20, 11)) -> RoleExampleDataModule:
    files = {r: str(_write_jsonl(tmp_path / f"{r}.jsonl", _records(r, n))) for r, n in zip(ROLES, sizes, strict=True)}
    dm = RoleExampleDataModule(files, roles=ROLES, tokenizer=tok, max_length=256, val_fraction=val_fraction, seed=seed)
    dm.setup()
    return dm


def _texts(dataset, tok) -> list[tuple[int, str]]:
    return [(e.role_id, tok.decode(e.input_ids[: e.context_len])) for e in dataset.examples]


def test_split_is_seeded_disjoint_and_per_role(tmp_path: Path, tok) -> None:
    sizes = (30, 20, 11)
    a, b, c = (_dm(tmp_path, tok, seed=s, sizes=sizes) for s in (0, 0, 1))
    val_a, train_a = _texts(a.val_set, tok), _texts(a.train_set, tok)
    assert val_a == _texts(b.val_set, tok) and train_a == _texts(b.train_set, tok)  # same seed, same split
    assert val_a != _texts(c.val_set, tok)  # another seed, another split
    assert not set(val_a) & set(train_a)  # disjoint
    for role_id, (role, n) in enumerate(zip(ROLES, sizes, strict=True)):
        role_val = [t for r, t in val_a if r == role_id]
        role_train = [t for r, t in train_a if r == role_id]
        assert len(role_val) == round(0.2 * n) and len(role_val) + len(role_train) == n  # per role, nothing lost
        assert all(t.startswith(role) for t in role_val + role_train)  # role ids follow the role list
    # The split of one role does not depend on the other roles' data.
    d = _dm(tmp_path, tok, seed=0, sizes=(30, 5, 11))
    assert [t for r, t in _texts(d.val_set, tok) if r == 0] == [t for r, t in val_a if r == 0]


def test_val_max_per_role_caps_each_role(tmp_path: Path, tok) -> None:
    full = _dm(tmp_path, tok)
    files = {r: str(tmp_path / f"{r}.jsonl") for r in ROLES}
    capped = RoleExampleDataModule(files, tokenizer=tok, max_length=256, val_fraction=0.2, val_max_per_role=2)
    capped.setup()
    val = _texts(capped.val_set, tok)
    assert [r for r, _ in val] == [0, 0, 1, 1, 2, 2] and set(val) <= set(_texts(full.val_set, tok))
    assert _texts(capped.train_set, tok) == _texts(full.train_set, tok)  # the rest stays held out


def test_split_indices_edges() -> None:
    assert split_indices(10, 0.0, 0, "plan") == (list(range(10)), [])
    tr, va = split_indices(2, 0.9, 0, "plan")
    assert len(tr) == 1 and len(va) == 1  # at least one example stays for training
    assert split_indices(100, 0.1, 3, "plan") != split_indices(100, 0.1, 3, "action")


# ---------------------------------------------------------------------------------------------------- bad records


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"input": "q"}', "no 'output' field"),
        ('{"output": "a"}', "no 'input' field"),
        ('{"input": "q", "output": ""}', "'output' is empty"),
        ('{"input": "q", "output": "  \\n"}', "'output' is empty"),
        ('{"input": "q", "output": 3}', "'output' must be a string"),
        ('{"input": ["q"], "output": "a"}', "'input' must be a string"),
        ('["q", "a"]', "must be a JSON object"),
        ('{"input": "q", "output": "a"', "not valid JSON"),
        ("not json at all", "not valid JSON"),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_bad_record_reports_file_and_line(tmp_path: Path, line: str, message: str, gz: bool) -> None:
    good = json.dumps({"input": "q\n", "output": "a"})
    path = tmp_path / ("bad.jsonl.gz" if gz else "bad.jsonl")
    text = f"{good}\n\n{good}\n{line}\n{good}\n"  # the bad record is on line 4 (line 2 is blank)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_records(path)
    assert str(err.value).startswith(f"{path}:4: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_record_in_json_array_reports_its_line(tmp_path: Path) -> None:
    path = tmp_path / "arr.json"
    path.write_text('[\n  {"input": "q", "output": "a"},\n  {"input": "q",\n   "output": ""},\n  {"input": "q"}\n]\n')
    with pytest.raises(ValueError) as err:
        read_records(path)
    assert str(err.value) == f"{path}:3: 'output' is empty"
    path.write_text('[\n  {"input": "q", "output": "a"},\n  {"input": "q", "output": "a",}\n]')
    with pytest.raises(ValueError, match=rf"^{path}:3: not valid JSON"):
        read_records(path)


def test_broken_record_stops_the_data_module(tmp_path: Path, tok) -> None:
    files = {r: str(_write_jsonl(tmp_path / f"{r}.jsonl", _records(r, 5))) for r in ROLES}
    _write_jsonl(tmp_path / "action.jsonl", _records("action", 5) + [{"input": "q", "output": 7}])
    dm = RoleExampleDataModule(files, tokenizer=tok, max_length=128)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'action.jsonl'}:6: 'output' must be a string"):
        dm.setup()


def test_missing_path_and_unknown_role_are_one_line_errors(tmp_path: Path, tok) -> None:
    files = {r: str(_write_jsonl(tmp_path / f"{r}.jsonl", _records(r, 5))) for r in ROLES}
    missing = str(tmp_path / "nope" / "plan.jsonl.gz")
    with pytest.raises(ValueError, match=f"^data file not found: {missing}$"):
        RoleExampleDataModule({**files, "plan": missing}, tokenizer=tok)
    with pytest.raises(ValueError, match="^unknown role 'critic' in data_files"):
        RoleExampleDataModule({**files, "critic": files["plan"]}, roles=ROLES, tokenizer=tok)
    with pytest.raises(ValueError, match="^no data file for role 'reflect'"):
        RoleExampleDataModule({"plan": files["plan"], "action": files["action"]}, roles=ROLES, tokenizer=tok)
    with pytest.raises(ValueError, match="^val_fraction must be in"):
        RoleExampleDataModule(files, tokenizer=tok, val_fraction=1.0)


# ------------------------------------------------------------------------------------------------------- formats


def test_json_jsonl_and_gz_load_the_same_records(tmp_path: Path) -> None:
    rows = _records("plan", 7) + [{"input": "unicode é ✓\n", "output": "ok", "extra": 1}]
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    loaded = [
        read_records(p)
        for p in (arr, _write_jsonl(tmp_path / "a.jsonl", rows), _write_jsonl(tmp_path / "a.jsonl.gz", rows, gz=True))
    ]
    for recs in loaded:
        assert [(r.input, r.output) for r in recs] == [(r["input"], r["output"]) for r in rows]
    assert loaded[0][1].source == f"{arr}:6"  # JSON array records keep the line they start on
    assert loaded[2][1].source == f"{tmp_path / 'a.jsonl.gz'}:2"


def test_bundled_trajectories_load() -> None:
    counts = {"plan": 1354, "action": 698, "reflect": 450}
    for role, n in counts.items():
        recs = read_records(REPO / f"data/trajectories/hotpotqa/{role}.jsonl.gz")
        assert len(recs) == n
        if role != "reflect":  # some second-stage reflect prompts end with the first stage's verdict instead
            assert all(r.input.endswith("\n### Response:\n") for r in recs)


# ---------------------------------------------------------------------------------------------- length batching


def test_length_buckets_cover_every_example_once_and_reduce_padding() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 500, (1000,), generator=g).tolist()
    s = LengthBucketBatchSampler(lengths, batch_size=8, seed=3, pool_batches=20)
    epoch0 = list(s)
    assert len(epoch0) == len(s) == 125
    assert sorted(i for b in epoch0 for i in b) == list(range(1000))
    assert epoch0 == list(LengthBucketBatchSampler(lengths, batch_size=8, seed=3, pool_batches=20))  # seeded
    s.set_epoch(1)
    assert list(s) != epoch0  # a new order every epoch

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    perm = torch.randperm(1000, generator=g).tolist()
    random_batches = [perm[i : i + 8] for i in range(0, 1000, 8)]
    assert padding(epoch0) < 0.2 * padding(random_batches)
    ranks = [list(LengthBucketBatchSampler(lengths, 8, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 62 and not {i for b in ranks[0] for i in b} & {
        i for b in ranks[1] for i in b
    }


def test_dataloader_batches_are_well_formed(tmp_path: Path, tok) -> None:
    dm = _dm(tmp_path, tok, val_fraction=0.2)
    train = list(dm.train_dataloader())
    assert sum(len(b["role_ids"]) for b in train) == len(dm.train_set)
    for b in train + list(dm.val_dataloader()):
        assert b["labels"].shape == b["input_ids"].shape == b["attention_mask"].shape
        sup = b["labels"] != IGNORE_INDEX
        assert torch.equal(sup.sum(1), b["lengths"] - b["context_len"])
        assert (b["prefix_len"] < b["context_len"]).all() and (b["prefix_len"] >= 0).all()
        assert torch.equal(b["attention_mask"].sum(1), b["lengths"])


# ----------------------------------------------------------------------------------------- refusals, by their value


def test_file_level_errors_name_the_file_and_line(tmp_path: Path) -> None:
    from datamodules.role_examples import read_local_records

    missing = tmp_path / "none.jsonl"
    with pytest.raises(ValueError, match=f"^data file not found: {missing}$"):
        read_local_records(missing)
    for name, text in (("empty.json", "[ ]\n"), ("blank.jsonl", "\n\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"^{tmp_path / name}: no records$"):
            read_local_records(tmp_path / name)
    arr = tmp_path / "arr.json"
    arr.write_text('[\n {"input": "q", "output": "a"}\n {"input": "q", "output": "b"}\n]')
    with pytest.raises(ValueError, match=rf"^{arr}:3: not valid JSON \(expected ',' or '\]' in the array\)$"):
        read_local_records(arr)
    arr.write_text('[\n {"input": "q", "output": "a"}\n]\n\nmore')
    with pytest.raises(ValueError, match=f"^{arr}:3: unexpected text after the JSON array$"):
        read_local_records(arr)
    bad_gz = tmp_path / "plan.jsonl.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=f"^{bad_gz}: cannot be read as gzip-compressed UTF-8 text: "):
        read_local_records(bad_gz)


def test_tokenizers_that_cannot_frame_an_example_are_refused() -> None:
    from datamodules.role_examples import special_token_layout

    class Rewrites:
        eos_token_id = 0

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [9, 9] if add_special_tokens else [1]}  # the text's own token is gone

    with pytest.raises(ValueError, match="^cannot tell which special tokens the tokenizer adds around a text$"):
        special_token_layout(Rewrites())
    no_eos = byte_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="^the tokenizer has no eos_token_id; one is needed to end every output$"):
        tokenize_example(no_eos, RoleRecord("q", "a", "f:1"), 0, 32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size must be > 0, got 0"),
        ({"pool_batches": 0}, "pool_batches must be > 0, got 0"),
        ({"num_replicas": 2, "rank": 2}, "rank must be in [0, num_replicas=2), got 2"),
        ({"rank": -1}, "rank must be in [0, num_replicas=1), got -1"),
        ({"groups": [[0, 1], [2]], "drop_last": True}, "drop_last is not supported with groups"),
    ],
)
def test_length_bucket_sampler_refuses_bad_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        LengthBucketBatchSampler([5, 6, 7], **{"batch_size": 2, **kwargs})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data_files": {}}, "data_files: give one data file per role, got none"),
        ({"spec": 3}, "data_files['plan'] must be a path or dataset name, got 3"),
        ({"spec": ""}, "data_files['plan'] must be a path or dataset name, got ''"),
        ({"max_length": 1}, "max_length must be >= 2, got 1"),
        ({"batch_size": 0}, "batch_size must be > 0, got 0"),
        ({"val_max_per_role": 0}, "val_max_per_role must be > 0 or null, got 0"),
        ({"num_workers": -1}, "num_workers must be >= 0, got -1"),
    ],
)
def test_data_module_refuses_bad_settings_naming_them(tmp_path: Path, tok, change, message) -> None:
    files = {r: str(_write_jsonl(tmp_path / f"{r}.jsonl", _records(r, 5))) for r in ROLES}
    change = dict(change)
    if "spec" in change:
        files["plan"] = change.pop("spec")
    files = change.pop("data_files", files)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RoleExampleDataModule(files, tokenizer=tok, **change)


def test_resuming_with_other_roles_is_refused(tmp_path: Path, tok) -> None:
    files = {r: str(_write_jsonl(tmp_path / f"{r}.jsonl", _records(r, 5))) for r in ROLES}
    dm = RoleExampleDataModule(files, tokenizer=tok)
    dm.load_state_dict(dm.state_dict())  # the same roles: resumed
    expected = "trained with roles ['plan', 'action'], this run has ['plan', 'action', 'reflect']"
    with pytest.raises(ValueError, match=re.escape(expected)):
        dm.load_state_dict({**dm.state_dict(), "roles": ["plan", "action"]})


def test_chains_and_packing_refuse_what_they_cannot_group() -> None:
    from datamodules.cross_role_prefixes import cross_role_groups
    from datamodules.prefix_packing import pack_prefix_chains
    from datamodules.records import TokenizedExample

    e = TokenizedExample([1, 2, 3, 4], 2, 0, 0, "f:1")
    with pytest.raises(ValueError, match="^max_group must be >= 1, got 0$"):
        cross_role_groups([e], 0)
    packed = TokenizedExample([1, 2, 3, 4], 2, 0, 0, "f:2", segments=((1, (2, 3)),))
    with pytest.raises(ValueError, match="^f:2: example is already packed$"):
        pack_prefix_chains([e, packed])


def test_a_spec_that_is_no_file_and_no_loadable_dataset_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name with no local file is read as ``name[:split]`` (split default ``train``); any failure of the loader is
    one line naming the spec and the loader's first line."""
    import datasets

    asked = []

    def load_dataset(name: str, split: str):
        asked.append((name, split))
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub\nor cannot be accessed.")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    for spec, split in (("someone/role-data", "train"), ("someone/role-data:validation", "validation")):
        with pytest.raises(ValueError) as info:
            read_records(spec)
        assert str(info.value) == (
            f"data not found: {spec!r} is no local file and no loadable dataset "
            "(Dataset 'someone/role-data' doesn't exist on the Hub)"
        )
        assert asked[-1] == ("someone/role-data", split)
