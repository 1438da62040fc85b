"""The zero-shot probe's bookkeeping (`eval_suite.evaluate.zero_shot`), fast: its prompts, token ids, answer parsing and
summary exactly, and whole runs of :func:`zero_shot` on the real benchmark rows with a stand-in model whose answers are
known (a character tokenizer; next-token logits and replies fixed per question), so every record, the resume, the
summary and the report can be checked to the value. The run on the embedded model is in test_zero_shot.py (22 s)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lragent.models
from eval_suite.evaluate.benchmarks import get_benchmark
from eval_suite.evaluate.zero_shot import (
    HOTPOTQA_INSTRUCTION,
    SCIENCEQA_INSTRUCTION,
    chat_ids,
    hotpotqa_prompt,
    letter_token_ids,
    scienceqa_prompt,
    short_answer,
    summarize,
    zero_shot,
)
from eval_suite.scoring.answer_scores import f1_score
from eval_suite.scoring.paired import bootstrap_mean_interval


class CharTokenizer:
    """One token per character (its code point); id 1 is the only special token (BOS)."""

    eos_token_id = 0

    def __init__(self, chat_template: str | None = "{{ chat }}", wrap=None) -> None:
        self.chat_template = chat_template
        self.wrap = wrap  # how apply_chat_template returns its ids: a list (None), a dict, an object with input_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>" * add_generation_prompt
        ids = self.encode(text)
        return ids if self.wrap is None else self.wrap(ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (0, 1)))


class BatchEncodingLike:
    """What transformers' tokenizers may return from apply_chat_template: no dict, but ``["input_ids"]`` and an
    ``input_ids`` attribute (iterating it gives its keys, not the ids)."""

    def __init__(self, input_ids: list[int]) -> None:
        self.input_ids = input_ids

    def __getitem__(self, key: str) -> list[int]:
        return {"input_ids": self.input_ids}[key]

    def __iter__(self):
        return iter(["input_ids"])


class StandInModel:
    """Next-token logits that rank J > B > A at the last position (A everywhere else); ``generate`` appends the reply
    given for the question found in the prompt."""

    def __init__(self, replies: dict[str, str] | None = None) -> None:
        self.replies = replies or {}
        self.asked: list[list[int]] = []
        self.generate_kwargs: list[dict] = []
        self.devices: list[torch.device] = []
        self.eos = CharTokenizer.eos_token_id

    def __call__(self, x: torch.Tensor) -> SimpleNamespace:
        self.devices.append(x.device)
        self.asked.append(x[0].tolist())
        logits = torch.zeros(1, x.shape[1], 128, dtype=torch.bfloat16, device="cpu")
        logits[0, :, ord("A")] = 9.0
        logits[0, -1, ord("A")] = 1.0
        logits[0, -1, ord("B")] = 5.0
        logits[0, -1, ord("J")] = 10.0
        return SimpleNamespace(logits=logits)

    def generate(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        self.devices.append(x.device)
        self.asked.append(x[0].tolist())
        self.generate_kwargs.append({k: (v.tolist() if torch.is_tensor(v) else v) for k, v in kwargs.items()})
        prompt = "".join(chr(i) for i in x[0].tolist())
        reply = next(r for q, r in self.replies.items() if f"Question: {q}<assistant>" in prompt)
        new = ([ord(c) for c in reply] + [self.eos])[: kwargs["max_new_tokens"]]  # ends with the EOS, a special token
        return torch.cat([x, torch.tensor([new], dtype=x.dtype, device=x.device)], dim=1)


@pytest.fixture
def stand_in(monkeypatch):
    """Replaces load_model (imported by zero_shot at call time); records what it was asked to load."""
    state = SimpleNamespace(model=StandInModel(), tokenizer=CharTokenizer(), loads=[])

    def load_model(name, dtype, device):
        state.loads.append((name, dtype, device))
        return state.model, state.tokenizer

    monkeypatch.setattr(lragent.models, "load_model", load_model)
    return state


def _rows(benchmark: str, n: int, split: str = "dev") -> list[dict]:
    bench = get_benchmark(benchmark)
    return [row for row, _, _ in bench.load_rows(limit=n, splits=bench.parse_splits(split))]


def _log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "zero_shot.jsonl").read_text().splitlines() if x]


def test_prompts_are_exactly_the_question_its_options_and_the_instruction() -> None:
    row = {"question": "Which?", "choices": ["a", "b", "c"], "caption": "no img"}
    assert scienceqa_prompt(row) == f"Question: Which?\nOptions:\n(A) a\n(B) b\n(C) c\n{SCIENCEQA_INSTRUCTION}"
    assert scienceqa_prompt({**row, "caption": ""}) == scienceqa_prompt(row)
    assert scienceqa_prompt({k: v for k, v in row.items() if k != "caption"}) == scienceqa_prompt(row)
    assert scienceqa_prompt({**row, "caption": "a fox"}) == "Image: a fox\n" + scienceqa_prompt(row)
    ctx = {"title": ["T1", "T2"], "sentences": [[" One. ", "Two. "], ["Three."]]}
    text = hotpotqa_prompt({"question": "Who?", "context": ctx})
    assert text == f"{HOTPOTQA_INSTRUCTION}\n\nT1: One. Two.\n\nT2: Three.\n\nQuestion: Who?"
    with pytest.raises(ValueError, match="zip"):  # a title without its sentences is refused, not dropped
        hotpotqa_prompt({"question": "Who?", "context": {"title": ["T1", "T2"], "sentences": [["One."]]}})


@pytest.mark.parametrize("wrap", [None, lambda ids: {"input_ids": ids}, lambda ids: BatchEncodingLike(input_ids=ids)])
def test_chat_ids_are_one_user_turn_with_the_generation_prompt(wrap) -> None:
    ids = chat_ids(CharTokenizer(wrap=wrap), "Hi?")
    assert ids == [ord(c) for c in "<user>Hi?<assistant>"] and type(ids) is list


def test_chat_ids_without_a_chat_template_are_the_plain_prompt_with_its_special_tokens() -> None:
    for template in (None, ""):
        assert chat_ids(CharTokenizer(chat_template=template), "Hi?") == [1] + [ord(c) for c in "Hi?\nAnswer: "]
    tok = CharTokenizer()
    del tok.chat_template  # no chat_template attribute at all
    assert chat_ids(tok, "Q") == [1, ord("Q"), *[ord(c) for c in "\nAnswer: "]]


def test_letter_token_ids_are_the_single_tokens_of_the_first_n_letters() -> None:
    assert letter_token_ids(CharTokenizer(), 10) == [ord(c) for c in "ABCDEFGHIJ"]
    assert letter_token_ids(CharTokenizer(), 1) == [ord("A")]

    class Specials(CharTokenizer):  # the letters must be encoded without special tokens
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return super().encode(text, add_special_tokens)

    assert letter_token_ids(Specials(), 2) == [ord("A"), ord("B")]

    class Spelling(CharTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return super().encode(text) * (3 if text == "B" else 1)

    with pytest.raises(ValueError) as e:
        letter_token_ids(Spelling(), 2)
    assert str(e.value) == "the tokenizer splits the option letter 'B' into 3 tokens"


@pytest.mark.parametrize(
    "text, answer",
    [
        ("\n  Answer: Bath, Maine.\nBecause ...", "Bath, Maine"),
        ("answer:   yes", "yes"),
        ("ANSWER: 1.5.", "1.5"),
        ("Paris ...  \n", "Paris"),
        ("MAX.", "MAX"),
        ("The answer: Paris", "The answer: Paris"),
        ("  \n\n", ""),
        ("", ""),
    ],
)
def test_short_answer_is_the_first_line_without_prefix_or_full_stops(text: str, answer: str) -> None:
    assert short_answer(text) == answer


def test_summary_values_are_the_bootstrap_of_each_field_in_percent() -> None:
    recs = [{"correct": c, "n_choices": n} for c, n in [(1.0, 2), (0.0, 3), (1.0, 4), (1.0, 5)]]
    s = summarize("scienceqa", recs)
    mean, low, high = bootstrap_mean_interval([1.0, 0.0, 1.0, 1.0])
    assert s == {
        "questions": 4,
        "correct": {"mean": 100 * mean, "low": 100 * low, "high": 100 * high},
        "chance": pytest.approx(100 * (1 / 2 + 1 / 3 + 1 / 4 + 1 / 5) / 4),
    }
    assert s["correct"]["mean"] == 75.0 and low < mean < high
    h = summarize("hotpotqa", [{"em": 1.0, "f1": 1.0}, {"em": 0.0, "f1": 0.5}, {"em": 0.0, "f1": 0.0}])
    assert set(h) == {"questions", "em", "f1"} and h["questions"] == 3
    for field, values in (("em", [1.0, 0.0, 0.0]), ("f1", [1.0, 0.5, 0.0])):
        m, lo, hi = bootstrap_mean_interval(values)
        assert h[field] == {"mean": 100 * m, "low": 100 * lo, "high": 100 * hi}
    with pytest.raises(ValueError) as e:
        summarize("hotpotqa", [])
    assert str(e.value) == "no answered questions to summarize"


def test_scienceqa_run_answers_among_the_options_by_the_last_logit(stand_in, tmp_path: Path, capsys) -> None:
    rows = _rows("scienceqa", 3)  # answers A (2 options), C (4 options), B (2 options)
    assert [(r["answer"], len(r["choices"])) for r in rows] == [(0, 2), (2, 4), (1, 2)]
    out = tmp_path / "zs"
    assert zero_shot("scienceqa", out=str(out), model="m", dtype="float32", device="cpu", limit=3) == 0
    assert stand_in.loads == [("m", torch.float32, "cpu")]
    # J has the highest logit but is no option; B beats A at the last position (A wins everywhere else)
    prompts = [chat_ids(CharTokenizer(), scienceqa_prompt(r)) for r in rows]
    assert stand_in.model.asked == prompts
    assert _log(out) == [
        {"qid": str(r["pid"]), "answer": "B", "gold": gold, "correct": correct, "n_choices": n,
         "prompt_tokens": len(p), "split": "dev"}
        for r, gold, correct, n, p in zip(rows, "ACB", (0.0, 0.0, 1.0), (2, 4, 2), prompts, strict=True)
    ]  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        f"[{i + 1}/3] {r['pid']}: 'B' (gold {g!r})" for i, (r, g) in enumerate(zip(rows, "ACB", strict=True))
    ]
    summary = json.loads((out / "summary.json").read_text())
    mean, low, high = bootstrap_mean_interval([0.0, 0.0, 1.0])
    assert summary["benchmark"] == "scienceqa" and summary["model"] == "m" and summary["split"] == ["dev"]
    assert summary["questions"] == 3
    assert summary["correct"] == {"mean": 100 * mean, "low": 100 * low, "high": 100 * high}
    assert summary["chance"] == pytest.approx(100 * (1 / 2 + 1 / 4 + 1 / 2) / 3)
    assert summary["provenance"]["dtype"] == "float32" and 0 <= summary["seconds"] < 60
    line = (f"accuracy {100 * mean:.1f}% [{100 * low:.1f}, {100 * high:.1f}], chance {summary['chance']:.1f}%, "
            "3 questions")  # fmt: skip
    assert line.startswith("accuracy 33.3% [0.0, ") and "chance 41.7%" in line
    assert (out / "report.md").read_text() == f"# Zero-shot probe: scienceqa, m\n\n{line}\n"
    assert lines[3:] == [f"scienceqa zero-shot (m): {line}"]


def test_a_rerun_asks_only_the_questions_not_in_the_log(stand_in, tmp_path: Path, capsys) -> None:
    rows = _rows("scienceqa", 3, "test")
    out = tmp_path / "zs"
    out.mkdir()
    # the first question already answered (A, right) by an earlier run, then a blank line
    seeded = {"qid": str(rows[0]["pid"]), "answer": "A", "gold": "A", "correct": 1.0, "n_choices": 2,
              "prompt_tokens": 7, "split": "test"}  # fmt: skip
    (out / "zero_shot.jsonl").write_text(json.dumps(seeded) + "\n\n")
    assert zero_shot("scienceqa", out=str(out), dtype="float32", device="cpu", limit=2, split="test", quiet=True) == 0
    assert stand_in.model.asked == [chat_ids(CharTokenizer(), scienceqa_prompt(rows[1]))]
    first = _log(out)
    assert first[0] == seeded and [r["qid"] for r in first] == [str(r["pid"]) for r in rows[:2]]
    assert first[1]["split"] == "test" and first[1]["answer"] == "B"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions"] == 2 and summary["split"] == ["test"] and summary["model"] == "default"
    assert summary["correct"]["mean"] == 100 * (1.0 + float(rows[1]["answer"] == 1)) / 2
    assert summary["chance"] == pytest.approx(100 * (1 / 2 + 1 / len(rows[1]["choices"])) / 2)
    assert capsys.readouterr().out.splitlines()[0].startswith("scienceqa zero-shot (default): accuracy ")
    stand_in.model.asked.clear()
    assert zero_shot("scienceqa", out=str(out), dtype="float32", device="cpu", limit=3, split="test", quiet=True) == 0
    assert stand_in.model.asked == [chat_ids(CharTokenizer(), scienceqa_prompt(rows[2]))]
    assert [r["qid"] for r in _log(out)] == [str(r["pid"]) for r in rows]
    assert json.loads((out / "summary.json").read_text())["questions"] == 3


def test_hotpotqa_run_scores_the_first_line_of_the_greedy_reply(stand_in, tmp_path: Path, capsys) -> None:
    rows = _rows("hotpotqa", 3)
    golds = [r["answer"] for r in rows]
    replies = [f"Answer: {golds[0]}.\nbecause", f"\n{golds[1]} and more\n", "zzz"]
    stand_in.model.replies = {r["question"]: reply for r, reply in zip(rows, replies, strict=True)}
    out = tmp_path / "hq"
    assert zero_shot("hotpotqa", out=str(out), dtype="float32", device="cpu", limit=3, max_new_tokens=120) == 0
    prompts = [chat_ids(CharTokenizer(), hotpotqa_prompt(r)) for r in rows]
    assert stand_in.model.asked == prompts
    assert stand_in.model.generate_kwargs == [
        {"attention_mask": [[1] * len(p)], "max_new_tokens": 120, "do_sample": False, "pad_token_id": 0}
        for p in prompts
    ]
    preds = [golds[0].rstrip("."), f"{golds[1]} and more", "zzz"]  # the first gold ends with a full stop
    f1 = f1_score(preds[1], golds[1])
    assert 0 < f1 < 1
    assert _log(out) == [
        {"qid": r["id"], "answer": p, "gold": g, "raw": raw, "em": em, "f1": f, "prompt_tokens": len(ids),
         "split": "dev"}
        for r, p, g, raw, em, f, ids in zip(rows, preds, golds, replies, (1.0, 0.0, 0.0), (1.0, f1, 0.0), prompts,
                                            strict=True)
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions"] == 3 and "chance" not in summary and "correct" not in summary
    e, f = summary["em"], summary["f1"]
    assert e["mean"] == pytest.approx(100 / 3) and f["mean"] == pytest.approx(100 * (1 + f1) / 3)
    line = (f"EM {e['mean']:.1f} [{e['low']:.1f}, {e['high']:.1f}], F1 {f['mean']:.1f} "
            f"[{f['low']:.1f}, {f['high']:.1f}], 3 questions")  # fmt: skip
    assert line.startswith("EM 33.3 [0.0, 100.0], F1 ")
    assert (out / "report.md").read_text() == f"# Zero-shot probe: hotpotqa, default\n\n{line}\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"[1/3] {rows[0]['id']}: {preds[0]!r} (gold {golds[0]!r})"
    assert printed[-1] == f"hotpotqa zero-shot (default): {line}"


def test_defaults_write_under_out_and_generate_at_most_32_tokens(stand_in, tmp_path: Path, monkeypatch) -> None:
    row = _rows("hotpotqa", 1)[0]
    stand_in.model.replies = {row["question"]: "Metallica"}
    clock = iter([100.0, 112.3456])
    monkeypatch.setattr("eval_suite.evaluate.zero_shot.time", SimpleNamespace(time=lambda: next(clock)))
    monkeypatch.chdir(tmp_path)
    assert zero_shot("hotpotqa", device="cpu", limit=1, quiet=True) == 0
    assert stand_in.model.generate_kwargs[0]["max_new_tokens"] == 32
    assert _log(tmp_path / "out" / "zero_shot")[0]["raw"] == "Metallica"  # the EOS after it is a special token
    summary = json.loads((tmp_path / "out" / "zero_shot" / "summary.json").read_text())
    assert summary["seconds"] == 12.3 and summary["questions"] == 1


def test_inputs_go_to_the_device_asked_for(stand_in, tmp_path: Path, monkeypatch) -> None:
    """--device cpu on a machine that (as faked here) has CUDA: the model is loaded there, its inputs are put there
    (not on torch's default device, meta here) and the provenance names it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    row = _rows("hotpotqa", 1)[0]
    stand_in.model.replies = {row["question"]: "Nevada"}
    with torch.device("meta"):
        for bench in ("scienceqa", "hotpotqa"):
            assert zero_shot(bench, out=str(tmp_path / bench), device="cpu", limit=1, quiet=True) == 0
    assert stand_in.model.devices == [torch.device("cpu")] * 2 and [d for _, _, d in stand_in.loads] == ["cpu"] * 2
    for bench in ("scienceqa", "hotpotqa"):
        assert json.loads((tmp_path / bench / "summary.json").read_text())["provenance"]["device"]["type"] == "cpu"


def test_hotpotqa_reply_is_cut_at_max_new_tokens(stand_in, tmp_path: Path) -> None:
    row = _rows("hotpotqa", 1)[0]
    stand_in.model.replies = {row["question"]: "Answer: Nevada.\n"}
    assert zero_shot("hotpotqa", out=str(tmp_path), device="cpu", limit=1, max_new_tokens=1, quiet=True) == 0
    assert _log(tmp_path)[0]["raw"] == "A" and stand_in.model.generate_kwargs[0]["max_new_tokens"] == 1
    assert stand_in.loads == [("default", torch.bfloat16, "cpu")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"benchmark": "gsm8k"}, "--benchmark 'gsm8k': allowed scienceqa, hotpotqa"),
        ({"limit": 0}, "--limit must be >= 1, got 0"),
        ({"limit": -2}, "--limit must be >= 1, got -2"),
        ({"max_new_tokens": 0}, "--max_new_tokens must be >= 1, got 0"),
    ],
)
def test_bad_options_are_refused_before_anything_is_loaded(stand_in, tmp_path: Path, kwargs, message) -> None:
    with pytest.raises(ValueError) as e:
        zero_shot(out=str(tmp_path / "zs"), device="cpu", **kwargs)
    assert str(e.value) == message
    assert not (tmp_path / "zs").exists() and stand_in.loads == []


def test_a_model_without_tokenizer_is_refused_naming_it(stand_in, tmp_path: Path) -> None:
    stand_in.tokenizer = None
    with pytest.raises(ValueError) as e:
        zero_shot(out=str(tmp_path), model="tiny", device="cpu", limit=1)
    assert str(e.value) == "--model 'tiny' has random weights and no tokenizer: the probe needs text"
    assert stand_in.model.asked == [] and not (tmp_path / "summary.json").exists()
