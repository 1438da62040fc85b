"""Answer-naming thoughts (``data.answer_thoughts``) on the bundled ScienceQA trajectories and their option-count
variants: every thought before a ``Finish`` names the text of the very option that ``Finish`` picks (read from the
record's own ``Options:`` line), the plan's own thought examples agree with what later examples read, and nothing
else changes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from datamodules.answer_thoughts import THOUGHT, add_answer_thoughts, answer_sentence
from datamodules.option_variants import LETTERS, option_count_variants, parse_options, question_key
from datamodules.records import RoleRecord
from datamodules.role_examples import read_records

DATA = Path(__file__).resolve().parent.parent / "data" / "trajectories" / "scienceqa"
ROLES = ("plan", "action", "reflect")
_BEFORE_FINISH = re.compile(
    r"Thought: \n### Response:\n([^\n]*)\n"
    r"(?:Action: \n### Response:\nFinish\[([A-J])\]|Aciton: Finish\[\n### Response:\n([A-J])\])"
)


@pytest.fixture(scope="module")
def varied() -> tuple[dict, dict, dict]:
    raw = {r: read_records(DATA / f"{r}.jsonl.gz") for r in ROLES}
    variants, _ = option_count_variants(raw, [2, 3], seed=0)
    out, stats = add_answer_thoughts(variants)
    return variants, out, stats


def _options(rec: RoleRecord) -> list[str]:
    return parse_options(question_key(rec.input)[1])


def test_every_finish_thought_names_its_options_text(varied) -> None:
    _, out, stats = varied
    assert stats["trajectories"] == stats["with_finish_thought"] == 391
    seen = 0
    for recs in out.values():
        for rec in recs:
            full = rec.input + (rec.output.strip() + "]" if rec.input.endswith("Finish[\n### Response:\n") else "")
            for m in _BEFORE_FINISH.finditer(full):
                letter = m.group(2) or m.group(3)
                want = answer_sentence(_options(rec)[LETTERS.index(letter)])
                assert m.group(1).endswith(want), (rec.source, m.group(1)[-80:], want)
                seen += 1
    assert seen > 1000  # every trajectory has at least one; most examples after the Finish read it too


def test_plan_thoughts_agree_with_what_later_examples_read(varied) -> None:
    """A plan example that writes a thought before Finish writes it with the answer sentence, exactly as every later
    example of its trajectory reads it."""
    _, out, _ = varied
    read: dict[tuple, set[str]] = {}
    for recs in out.values():
        for rec in recs:
            full = rec.input + (rec.output.strip() + "]" if rec.input.endswith("Finish[\n### Response:\n") else "")
            read.setdefault(question_key(rec.input), set()).update(m.group(1) for m in _BEFORE_FINISH.finditer(full))
    named = [rec for rec in out["plan"] if rec.input.endswith(THOUGHT) and " So the answer is " in rec.output]
    assert len(named) > 200
    for rec in named:
        assert rec.output in read[question_key(rec.input)], (rec.source, rec.output)
    unnamed = [rec for rec in out["plan"] if rec.input.endswith(THOUGHT) and rec.output in
               {t.rsplit(" So the answer is ", 1)[0] for t in read[question_key(rec.input)]}]  # fmt: skip
    assert not unnamed, unnamed[0].source  # a finish thought written without its sentence
    # the plan's action-type example that decides Finish reads its thought with the sentence too
    deciding = [rec for rec in out["plan"] if rec.input.endswith("\nAction: \n### Response:\n")
                and rec.output.strip().startswith("Finish")]  # fmt: skip
    checked = 0
    for rec in deciding:
        thought = rec.input[: -len("\nAction: \n### Response:\n")].rpartition(THOUGHT)[2]
        known = {t.rsplit(" So the answer is ", 1)[0] for t in read[question_key(rec.input)]}
        if thought.rsplit(" So the answer is ", 1)[0] in known:  # its Finish letter is in the trajectory
            assert " So the answer is " in thought, (rec.source, thought[-80:])
            checked += 1
    assert checked > 50, checked


def test_only_thoughts_before_finish_change_and_it_is_idempotent(varied) -> None:
    before, out, _ = varied
    for role in ROLES:
        assert len(before[role]) == len(out[role])
        for a, b in zip(before[role], out[role], strict=True):
            strip = lambda t: re.sub(r" So the answer is [^\n]*?\.(?=\n|$)", "", t)  # noqa: E731
            assert strip(b.input) == a.input and strip(b.output) == a.output, a.source
    again, _ = add_answer_thoughts(out)
    assert again == out
    plain = {"plan": [RoleRecord(input="Question: no options\nThought: \n### Response:\n", output="x", source="s")]}
    assert add_answer_thoughts(plain)[0] == plain


def test_datamodule_applies_it_to_training_only() -> None:
    from datamodules.role_examples import RoleExampleDataModule
    from datamodules.tiny_tokenizer import byte_tokenizer

    files = {r: str(DATA / f"{r}.jsonl.gz") for r in ROLES}
    dms = {}
    for flag in (False, True):
        dm = RoleExampleDataModule(files, tokenizer=byte_tokenizer(), max_length=4096, option_variants=[2, 3],
                                   answer_thoughts=flag)  # fmt: skip
        dm.setup("fit")
        dms[flag] = dm
    on, off = dms[True], dms[False]
    assert on.answer_thought_stats["records_changed"] > 1000 and not off.answer_thought_stats
    assert [e.input_ids for e in on.val_set.examples] == [e.input_ids for e in off.val_set.examples]
    assert [e.input_ids for e in on.train_set.examples] != [e.input_ids for e in off.train_set.examples]
