"""The fidelity building blocks (:mod:`eval_suite.diagnostics.fidelity`) value by value, without a model where none is
needed: example bounds and splits, tokenisation and left truncation, the held-out draws, the role files, the KL and
agreement, the token-weighted sums and the Markdown table."""

from __future__ import annotations

import gzip
import json
import math
import random

import pytest
import torch

from datamodules.role_examples import split_indices
from eval_suite.diagnostics.fidelity import (
    FidelityExample,
    _Acc,
    _leading_specials,
    check_example_args,
    check_producer,
    compare,
    heldout_indices,
    load_role_examples,
    producer_for,
    render_markdown,
    tokenize_example,
)
from eval_suite.report import markdown_table
from lragent.provenance import provenance_footer

TEXT = "sys\n### Response:\nprev\nAction: \n### Response:\n"  # 46 characters, its last piece starts at 22


class BosTokenizer:
    """One id per character (mod 250), BOS 251 in front when asked for special tokens, EOS id 252."""

    eos_token_id = 252

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": ([251] if add_special_tokens else []) + [ord(c) % 250 for c in text]}


class BosEosTokenizer(BosTokenizer):
    """Special tokens on both sides (BOS 251 ... 253): only the leading one belongs in front of a context."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [ord(c) % 250 for c in text]
        return {"input_ids": [251, *ids, 253] if add_special_tokens else ids}


class PlainTokenizer(BosTokenizer):
    """No special tokens at all."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) % 250 for c in text]}


class ScramblingTokenizer(BosTokenizer):
    """Special tokens change the text's own ids (no leading run of specials to find): 0 leading specials."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [ord(c) % 250 for c in text]
        return {"input_ids": [i + 1 for i in ids] + [251] if add_special_tokens else ids}


class DefaultOffTokenizer(BosTokenizer):
    """A BOS only when asked for explicitly: its default is no special tokens."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return super().__call__(text, add_special_tokens)


def _chars(text: str) -> list[int]:
    return [ord(c) % 250 for c in text]


# ----------------------------------------------------------------------------------------------------- examples
def test_example_bounds_are_inclusive_where_documented():
    assert FidelityExample("plan", "s:1", (5, 6), context_len=1).context_len == 1  # 1 is allowed
    assert FidelityExample("plan", "s:1", (5, 6, 7), context_len=2, prefix_len=0).prefix_len == 0
    assert FidelityExample("plan", "s:1", (5, 6, 7), context_len=2, prefix_len=1).prefix_len == 1
    with pytest.raises(ValueError, match=r"^s:1: prefix_len -1 must be in 0\.\.1$"):
        FidelityExample("plan", "s:1", (5, 6, 7), context_len=2, prefix_len=-1)
    with pytest.raises(ValueError, match=r"^s:1: context_len 3 must be in 1\.\.2$"):
        FidelityExample("plan", "s:1", (5, 6, 7), context_len=3)


def test_split_is_context_minus_one_or_the_prefix():
    ex = FidelityExample("plan", "s:1", (1, 2, 3, 4, 5, 6), context_len=4, prefix_len=2)
    assert ex.split("last") == 3 and ex.split("piece") == 2


def test_leading_specials_of_each_tokenizer_kind():
    assert _leading_specials(BosTokenizer()) == 1
    assert _leading_specials(BosEosTokenizer()) == 1
    assert _leading_specials(PlainTokenizer()) == 0
    assert _leading_specials(ScramblingTokenizer()) == 0
    assert _leading_specials(DefaultOffTokenizer()) == 1  # special tokens asked for, not left to the default


def test_tokenize_whole_example_with_its_last_piece():
    ex = tokenize_example(BosTokenizer(), "action", "a.jsonl.gz:3", TEXT, "go")
    assert ex == FidelityExample("action", "a.jsonl.gz:3", (251, *_chars(TEXT), *_chars("go"), 252), 47, 23)


def test_tokenize_without_a_piece_and_with_trailing_specials():
    ex = tokenize_example(BosEosTokenizer(), "plan", "p:1", "abc", "de")
    assert ex.ids == (251, *_chars("abc"), *_chars("de"), 252) and ex.context_len == 4 and ex.prefix_len == 0
    assert tokenize_example(DefaultOffTokenizer(), "plan", "p:1", "abc", "de").ids == ex.ids  # the BOS is asked for
    ex = tokenize_example(PlainTokenizer(), "plan", "p:1", "abc", "de")
    assert ex.ids == (*_chars("abc"), *_chars("de"), 252) and ex.context_len == 3 and ex.prefix_len == 0


@pytest.mark.parametrize(("limit", "prefix"), [(47, 23), (46, 22), (26, 2), (25, 0), (24, 0), (2, 0)])
def test_left_truncation_keeps_the_bos_and_moves_the_prefix(limit, prefix):
    """Cutting ``cut = 47 - limit`` tokens after the BOS moves the piece start left by ``cut``; a piece start that
    lands on (or before) the BOS means the piece is the whole kept input: prefix 0."""
    ex = tokenize_example(BosTokenizer(), "plan", "p:1", TEXT, "go", max_context_tokens=limit)
    cut = 47 - limit
    assert ex.ids == (251, *_chars(TEXT)[cut:], *_chars("go"), 252)
    assert ex.context_len == limit and ex.prefix_len == prefix


def test_prefix_is_kept_inside_the_context():
    class Expanding(BosTokenizer):
        """The text before the piece tokenises to more ids than the whole input (a pathological tokenizer)."""

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            ids = [1] * 40 if text == TEXT[:22] else [ord(c) % 250 for c in text]
            return {"input_ids": ([251] if add_special_tokens else []) + ids}

    ex = tokenize_example(Expanding(), "plan", "p:1", TEXT, "go", max_context_tokens=10)
    assert ex.context_len == 10 and ex.prefix_len == 4  # 1 + 40 ids before the piece, 37 of them cut
    ex = tokenize_example(Expanding(), "plan", "p:1", TEXT[:30], "go")
    assert ex.context_len == 31 and ex.prefix_len == 30  # 41 capped at len(ctx) - 1


# ----------------------------------------------------------------------------------------------------- held out
def test_heldout_and_dev_pools_are_tails():
    assert heldout_indices(10, 3, None, 0, "plan") == [7, 8, 9]
    assert heldout_indices(10, 1, None, 0, "plan") == [9]
    assert heldout_indices(2, 3, None, 0, "plan") == [0, 1]
    assert heldout_indices(10, 3, None, 0, "plan", pool="dev") == [4, 5, 6]
    assert heldout_indices(5, 3, None, 0, "plan", pool="dev") == [0, 1]
    assert heldout_indices(2, 3, None, 0, "plan", pool="dev") == []


def test_val_pool_is_the_training_configs_validation_split():
    val = heldout_indices(40, 3, None, 0, "plan", pool="val")
    assert val == split_indices(40, 0.05, 0, "plan")[1] == [4, 13]
    assert heldout_indices(40, 30, None, 7, "plan", pool="val") == val  # holdout and seed play no part


def test_limit_draws_with_the_seed_and_role():
    assert heldout_indices(1000, 30, 4, 1, "plan") == sorted(random.Random("1:plan").sample(range(970, 1000), 4))
    assert heldout_indices(1000, 30, 4, 1, "plan") == [972, 975, 976, 978]
    assert heldout_indices(1000, 30, 4, 1, "action") == sorted(random.Random("1:action").sample(range(970, 1000), 4))
    assert heldout_indices(10, 3, 3, 5, "plan") == [7, 8, 9] == heldout_indices(10, 3, 4, 5, "plan")
    assert heldout_indices(10, 3, 2, 5, "plan") == sorted(random.Random("5:plan").sample(range(7, 10), 2))


def _write_roles(tmp_path, roles=("plan", "action"), n=5):
    folder = tmp_path / "trajectories" / "bench"
    folder.mkdir(parents=True)
    for role in roles:
        with gzip.open(folder / f"{role}.jsonl.gz", "wt", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps({"input": f"{role} in {i}", "output": f"o{i}"}) + "\n")
                if i == 1:
                    f.write("\n   \n")  # blank lines are not examples
    return tmp_path


def test_role_examples_read_in_role_order_with_their_line_numbers(tmp_path):
    data = _write_roles(tmp_path)
    exs = load_role_examples("bench", ["action", "plan"], BosTokenizer(), holdout=2, data_dir=data)
    assert [e.source for e in exs] == ["action.jsonl.gz:4", "action.jsonl.gz:5", "plan.jsonl.gz:4", "plan.jsonl.gz:5"]
    assert [e.role for e in exs] == ["action", "action", "plan", "plan"]
    assert exs[0] == tokenize_example(BosTokenizer(), "action", "action.jsonl.gz:4", "action in 3", "o3")


def test_role_examples_defaults_whole_small_file(tmp_path):
    data = _write_roles(tmp_path, roles=("plan",), n=5)
    exs = load_role_examples("bench", ["plan"], BosTokenizer(), data_dir=data)
    assert [e.source for e in exs] == [f"plan.jsonl.gz:{i}" for i in range(1, 6)]
    assert exs[2].ids == (251, *_chars("plan in 2"), *_chars("o2"), 252)


def test_role_examples_pass_limit_seed_pool_and_cut(tmp_path):
    data = _write_roles(tmp_path, roles=("plan",), n=5)
    exs = load_role_examples("bench", ["plan"], BosTokenizer(), holdout=2, limit=1, seed=3, pool="dev",
                             max_context_tokens=4, data_dir=data)  # fmt: skip
    [i] = heldout_indices(5, 2, 1, 3, "plan", "dev")
    assert [e.source for e in exs] == [f"plan.jsonl.gz:{i + 1}"]
    assert exs[0].ids == (251, *_chars(f"plan in {i}")[-3:], *_chars(f"o{i}"), 252) and exs[0].context_len == 4


# -------------------------------------------------------------------------------------------------- measurement
def test_producer_next_wraps_and_a_named_one_is_kept():
    roles = ["plan", "action", "reflect"]
    assert [producer_for(roles, r, "next") for r in roles] == ["action", "reflect", "plan"]
    assert producer_for(("plan",), "plan", "next") == "plan"
    assert producer_for(roles, "plan", "reflect") == "reflect"


def test_compare_is_float64_kl_of_reference_against_other():
    ref = torch.tensor([[2.0, 0.5, -1.0], [0.3, 0.1, 0.2], [0.7, 0.7, 0.1]], dtype=torch.float32)
    other = torch.tensor([[0.1, 1.1, 0.0], [0.3, 0.1, 0.2], [0.2, 0.9, 0.9]], dtype=torch.float32)
    kl, agree = compare(ref, other)
    assert kl.dtype == torch.float64 and agree.tolist() == [False, True, False]

    def kl_of(p_logits, q_logits):
        lp = [x - math.log(sum(math.exp(y) for y in p_logits)) for x in p_logits]
        lq = [x - math.log(sum(math.exp(y) for y in q_logits)) for x in q_logits]
        return sum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=True))

    want = [kl_of(r, o) for r, o in zip(ref.double().tolist(), other.double().tolist(), strict=True)]
    assert kl[0].item() == pytest.approx(want[0], rel=1e-12, abs=0) and kl[0] > kl[2] > 0
    assert kl[2].item() == pytest.approx(want[2], rel=1e-12, abs=0)
    assert kl[1].item() == 0.0  # identical rows: 0 (never a rounding-negative value)
    rev, _ = compare(other, ref)
    assert rev[0].item() == pytest.approx(kl_of(other.double()[0].tolist(), ref.double()[0].tolist()), rel=1e-12)
    assert rev[0].item() != pytest.approx(kl[0].item(), rel=1e-3)  # KL is not symmetric: the direction matters


def test_compare_clamps_rounding_below_zero():
    ref = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    kl, agree = compare(ref, ref + 1.0)  # the same distributions: KL 0 up to rounding, never below
    assert bool((kl >= 0).all()) and float(kl.max()) < 1e-12 and bool(agree.all())


def test_accumulator_weights_by_tokens():
    acc = _Acc()
    assert acc.result() == {"kl": 0.0, "top1": 0.0, "tokens": 0, "examples": 0}
    acc.add(torch.tensor([0.5], dtype=torch.float64), torch.tensor([True]))
    assert acc.result() == {"kl": 0.5, "top1": 1.0, "tokens": 1, "examples": 1}
    acc.add(torch.tensor([0.25, 0.75], dtype=torch.float64), torch.tensor([False, True]))
    assert acc.result() == {"kl": 1.5 / 3, "top1": 2 / 3, "tokens": 3, "examples": 2}


def _cell(kl, top1, tokens):
    return {"kl": kl, "top1": top1, "tokens": tokens, "examples": 1}


def test_markdown_has_a_dash_for_a_missing_role_and_the_token_counts():
    result = {
        "schemes": {
            "non_shared": {"plan": _cell(0.0, 1.0, 12), "overall": _cell(0.0, 1.0, 20)},
            "full_shared": {"overall": _cell(0.00123456, 0.5, 20)},
        }
    }
    header = ["Scheme", "plan KL", "plan top-1 %", "overall KL", "overall top-1 %"]
    rows = [["non_shared", "0.000e+00", "100.00", "0.000e+00", "100.00"],
            ["full_shared", "–", "–", "1.235e-03", "50.00"]]  # fmt: skip
    want = (
        "# Fidelity against non_shared\n\nKL(non_shared ‖ scheme) in nats per scored token; top-1 agreement in %. "
        "plan: 12 tokens, overall: 20 tokens.\n\n" + markdown_table(header, rows)
    )
    assert render_markdown(result) == want
    assert render_markdown(result, title="T").startswith("# T\n\nKL(non_shared")


def test_markdown_without_schemes_and_with_provenance():
    assert render_markdown({"schemes": {}}) == (
        "# Fidelity against non_shared\n\nKL(non_shared ‖ scheme) in nats per scored token; top-1 agreement in %. "
        ".\n\n" + markdown_table(["Scheme"], [])
    )
    prov = {"command": "lragent fidelity", "git_commit": "abc1234", "utc": "2026-01-01T00:00:00Z"}
    result = {"schemes": {"non_shared": {"overall": _cell(0.0, 1.0, 3)}}, "provenance": prov}
    md = render_markdown(result)
    assert md.endswith(provenance_footer(prov)) and md.startswith("# Fidelity against non_shared\n")
    assert md == render_markdown({"schemes": result["schemes"]}) + provenance_footer(prov)


# ------------------------------------------------------------------------------------------------------- checks
def test_example_args_accept_their_smallest_values():
    check_example_args("hotpotqa", 1, 1, None, "last")
    check_example_args("scienceqa", 1, 1, 2, "piece")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gsm8k", 1, 1, None, "last"), "unknown benchmark 'gsm8k': allowed hotpotqa, scienceqa"),
        (("hotpotqa", 0, 1, None, "last"), "--holdout must be >= 1, got 0"),
        (("hotpotqa", 1, 0, None, "last"), "--limit must be >= 1, got 0"),
        (("hotpotqa", 1, 1, 1, "last"), "--max_context_tokens must be >= 2, got 1"),
        (("hotpotqa", 1, 1, None, "middle"), "--shared_split 'middle' unknown: allowed last, piece"),
    ],
)
def test_example_args_refuse_naming_the_value(args, message):
    with pytest.raises(ValueError) as info:
        check_example_args(*args)
    assert str(info.value) == message


def test_producer_check_accepts_next_and_the_roles():
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    for producer in ("next", "plan", "action", "reflect"):
        check_producer(model, producer)
    with pytest.raises(ValueError) as info:
        check_producer(model, "Next")
    assert str(info.value) == "--producer 'Next' unknown: allowed next or plan, action, reflect"


def test_a_tokenizer_that_drops_the_text_before_the_piece_keeps_the_prefix_when_nothing_is_cut():
    """Only "a" and "A" are tokens: the text before the piece has no token, so the piece starts right after the BOS
    (prefix 1); a limit equal to the context's length cuts nothing and keeps it."""

    class OnlyA(BosTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            return {"input_ids": ([251] if add_special_tokens else []) + [ord(c) for c in text if c in "aA"]}

    ex = tokenize_example(OnlyA(), "plan", "p:1", TEXT, "go", max_context_tokens=2)
    assert ex == FidelityExample("plan", "p:1", (251, 65, 252), context_len=2, prefix_len=1)


def test_no_eos_message_in_full():
    class NoEos(BosTokenizer):
        eos_token_id = None

    with pytest.raises(ValueError) as info:
        tokenize_example(NoEos(), "plan", "p:1", "in", "out")
    assert str(info.value) == "the tokenizer has no eos_token_id; one is needed to end every output"


def test_role_examples_default_to_the_last_hundred_and_seed_zero(tmp_path):
    data = _write_roles(tmp_path, roles=("plan",), n=105)  # 2 blank lines after record 1: not counted
    exs = load_role_examples("bench", ["plan"], BosTokenizer(), data_dir=data)
    assert [e.source for e in exs] == [f"plan.jsonl.gz:{i}" for i in range(6, 106)]
    drawn = load_role_examples("bench", ["plan"], BosTokenizer(), holdout=50, limit=3, data_dir=data)
    want = heldout_indices(105, 50, 3, 0, "plan")
    assert [e.source for e in drawn] == [f"plan.jsonl.gz:{i + 1}" for i in want]
    seeded = load_role_examples("bench", ["plan"], BosTokenizer(), holdout=50, limit=3, seed=4, data_dir=data)
    assert [e.source for e in seeded] == [f"plan.jsonl.gz:{i + 1}" for i in heldout_indices(105, 50, 3, 4, "plan")]
    assert [e.source for e in seeded] != [e.source for e in drawn]


def test_role_files_are_read_as_utf8_whatever_the_locale(tmp_path):
    import locale

    folder = tmp_path / "trajectories" / "bench"
    folder.mkdir(parents=True)
    with gzip.open(folder / "plan.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"input": "é", "output": "ü"}, ensure_ascii=False) + "\n")
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # the locale's encoding is then ASCII
    try:
        [ex] = load_role_examples("bench", ["plan"], BosTokenizer(), data_dir=tmp_path)
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    assert ex.ids == (251, ord("é") % 250, ord("ü") % 250, 252)


def test_run_fidelity_shows_a_named_bar_only_when_asked(capsys, monkeypatch):
    monkeypatch.setattr("tqdm.std.tqdm.monitor_interval", 0)  # no monitor thread left behind (a fork would inherit it)
    from eval_suite.diagnostics.fidelity import run_fidelity
    from lragent.schemes import SCHEMES
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    assert run_fidelity(model, [], ["non_shared"]) == {"schemes": {"non_shared": {}}, "examples": []}
    assert capsys.readouterr().err == ""
    run_fidelity(model, [], ["non_shared"], progress=True)
    assert capsys.readouterr().err.lstrip("\r").startswith("fidelity: 0ex [")
    with pytest.raises(ValueError) as info:
        run_fidelity(model, [], ["non_shared", "half_shared"])
    assert str(info.value) == f"unknown schemes ['half_shared']: allowed {', '.join(SCHEMES)}"


def test_the_head_is_what_the_tokenizer_puts_before_an_empty_text():
    """A tokenizer that adds its BOS only to a non-empty text: one leading special, but the context starts with what
    an empty text gets (nothing), as the input's own ids follow."""

    class BosOnlyOnText(BosTokenizer):
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
            ids = [ord(c) % 250 for c in text]
            return {"input_ids": ([251] if add_special_tokens and text else []) + ids}

    assert _leading_specials(BosOnlyOnText()) == 1
    ex = tokenize_example(BosOnlyOnText(), "plan", "p:1", "abc", "de")
    assert ex.ids == (*_chars("abc"), *_chars("de"), 252) and ex.context_len == 3


def test_no_bar_on_a_terminal_unless_asked(monkeypatch):
    """On a terminal too (where tqdm would show a bar by default) progress=False shows none."""
    import io

    from eval_suite.diagnostics.fidelity import run_fidelity
    from tests.conftest import tiny_multi_lora

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    monkeypatch.setattr("tqdm.std.tqdm.monitor_interval", 0)  # no monitor thread left behind (a fork would inherit it)
    run_fidelity(tiny_multi_lora(), [], ["non_shared"])
    assert term.getvalue() == ""
    run_fidelity(tiny_multi_lora(), [], ["non_shared"], progress=True)
    assert "fidelity: 0ex [" in term.getvalue()


def test_per_example_rows_name_the_example_and_every_schemes_means():
    from eval_suite.diagnostics.fidelity import run_fidelity
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    ids = tuple(torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist())
    ex = FidelityExample("action", "f:7", ids, 14, prefix_len=5)
    res = run_fidelity(model, [ex], ["non_shared", "full_shared"])
    [row] = res["examples"]
    assert set(row) == {"source", "role", "producer", "tokens", "non_shared", "full_shared"}
    assert (row["source"], row["role"], row["producer"], row["tokens"]) == ("f:7", "action", "reflect", 20)
    assert row["non_shared"] == {"kl": 0.0, "top1": 1.0}
    overall = res["schemes"]["full_shared"]["overall"]
    assert row["full_shared"] == {"kl": pytest.approx(overall["kl"]), "top1": pytest.approx(overall["top1"])}
    assert overall["tokens"] == 6 and overall["examples"] == 1 and row["full_shared"]["kl"] > 0
    assert set(res["schemes"]["full_shared"]) == {"action", "overall"}  # roles without examples are left out


def test_run_fidelity_hands_the_droidspeak_layers_to_droidspeak():
    """DroidSpeak recomputing every layer is exact; its default (a middle third) is not."""
    from eval_suite.diagnostics.fidelity import run_fidelity
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    ids = tuple(torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist())
    ex = FidelityExample("plan", "f:1", ids, 14, prefix_len=5)
    every = run_fidelity(model, [ex], ["droidspeak"], droidspeak_layers=range(model.n_layers))
    assert every["schemes"]["droidspeak"]["overall"]["kl"] < 1e-9
    default = run_fidelity(model, [ex], ["droidspeak"])
    assert default["schemes"]["droidspeak"]["overall"]["kl"] > 1e-4


def test_run_fidelity_measures_at_the_split_asked_for():
    from eval_suite.diagnostics.fidelity import run_fidelity, scheme_logits
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    ids = tuple(torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3)).tolist())
    ex = FidelityExample("plan", "f:1", ids, 14, prefix_len=5)
    kls = {}
    for split in ("last", "piece"):
        res = run_fidelity(model, [ex], ["non_shared", "full_shared"], shared_split=split)
        ref = scheme_logits(model, "non_shared", ex, "action", shared_split=split)
        kl, agree = compare(ref, scheme_logits(model, "full_shared", ex, "action", shared_split=split))
        kls[split] = res["examples"][0]["full_shared"]["kl"]
        assert kls[split] == pytest.approx(float(kl.mean()), rel=1e-9)
        assert res["examples"][0]["full_shared"]["top1"] == pytest.approx(float(agree.double().mean()))
    assert kls["last"] != pytest.approx(kls["piece"], rel=1e-3)
