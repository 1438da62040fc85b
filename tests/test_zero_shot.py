"""The zero-shot probe (`cli.py zero-shot`, the study's reference row): its answer parsing and summary by hand, and one
run on the embedded model that resumes without redoing a question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import cli
from eval_suite.evaluate.zero_shot import LETTERS, hotpotqa_prompt, scienceqa_prompt, short_answer, summarize


def test_short_answer_takes_the_first_line_without_prefix_or_full_stop() -> None:
    assert short_answer("\n  Answer: Bath, Maine.\nBecause ...") == "Bath, Maine"
    assert short_answer("Arthur's Magazine") == "Arthur's Magazine"
    assert short_answer("   \n") == ""


def test_prompts_carry_what_the_probe_is_given() -> None:
    row = {"question": "Which?", "choices": ["a", "b", "c"], "caption": "no img"}
    text = scienceqa_prompt(row)
    assert "(A) a\n(B) b\n(C) c" in text and "Image:" not in text
    assert "Image: a fox" in scienceqa_prompt({**row, "caption": "a fox"})
    ctx = {"title": ["T1", "T2"], "sentences": [["One. ", "Two."], ["Three."]]}
    text = hotpotqa_prompt({"question": "Who?", "context": ctx})
    assert "T1: One. Two." in text and "T2: Three." in text and text.endswith("Question: Who?")


def test_summary_by_hand() -> None:
    # 3 questions with 2, 3 and 4 options, right on the first two: accuracy 2/3, chance (1/2 + 1/3 + 1/4) / 3
    recs = [{"correct": 1.0, "n_choices": 2}, {"correct": 1.0, "n_choices": 3}, {"correct": 0.0, "n_choices": 4}]
    s = summarize("scienceqa", recs)
    assert s["correct"]["mean"] == pytest.approx(200 / 3) and s["questions"] == 3
    assert s["chance"] == pytest.approx(100 * (1 / 2 + 1 / 3 + 1 / 4) / 3)
    assert s["correct"]["low"] <= s["correct"]["mean"] <= s["correct"]["high"]
    h = summarize("hotpotqa", [{"em": 1.0, "f1": 1.0}, {"em": 0.0, "f1": 0.5}])
    assert (h["em"]["mean"], h["f1"]["mean"]) == (pytest.approx(50.0), pytest.approx(75.0)) and "chance" not in h


@pytest.mark.model
def test_probe_on_the_embedded_model_answers_a_letter_and_resumes(tmp_path: Path) -> None:
    argv = ["zero-shot", "--benchmark", "scienceqa", "--limit", "3", "--device", "cpu", "--dtype", "float32",
            "--quiet", "true", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    recs = [json.loads(x) for x in (tmp_path / "zero_shot.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(r["answer"] in LETTERS[: r["n_choices"]] for r in recs)
    assert cli.main([*argv[:4], "4", *argv[5:]]) == 0  # one question more: only it is asked
    recs2 = [json.loads(x) for x in (tmp_path / "zero_shot.jsonl").read_text().splitlines()]
    assert recs2[:3] == recs and len(recs2) == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["questions"] == 4 and summary["provenance"]["command"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--benchmark", "gsm8k"], "--benchmark 'gsm8k': allowed scienceqa, hotpotqa"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1, got 0"),
        (["--model", "tiny-llama", "--limit", "1"], "--model 'tiny-llama' has random weights and no tokenizer"),
    ],
)
def test_probe_options_are_refused_naming_the_value(tmp_path: Path, capsys, argv, message) -> None:
    out = tmp_path / "zs"
    assert cli.main(["zero-shot", "--device", "cpu", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not (out / "zero_shot.jsonl").exists()


def test_no_records_and_letters_of_several_tokens_are_named() -> None:
    from eval_suite.evaluate.zero_shot import letter_token_ids

    with pytest.raises(ValueError, match="no answered questions to summarize"):
        summarize("scienceqa", [])

    class Spelling:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text] * (2 if text == "C" else 1)

    assert letter_token_ids(Spelling(), 2) == [ord("A"), ord("B")]
    with pytest.raises(ValueError, match="the tokenizer splits the option letter 'C' into 2 tokens"):
        letter_token_ids(Spelling(), 3)
