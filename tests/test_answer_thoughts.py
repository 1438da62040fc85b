"""Answer-naming thoughts (``data.answer_thoughts``) on the bundled ScienceQA trajectories and their option-count
variants: every thought before a ``Finish`` names the text of the very option that ``Finish`` picks (read from the
record's own ``Options:`` line), the plan's own thought examples agree with what later examples read, and nothing
else changes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from datamodules.answer_thoughts import THOUGHT, add_answer_thoughts, answer_sentence, finish_thoughts
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


_ACTION = "\nAction: \n### Response:\n"
_FINISH_OPEN = "\nAciton: Finish[\n### Response:\n"
_REFLECT = "\nObversation: Please reflect your answer.\n"


def _rec(input: str, output: str, source: str = "t") -> RoleRecord:
    return RoleRecord(input=input, output=output, source=source)


def test_answer_sentence_strips_trailing_space_and_full_stops_only() -> None:
    """The option text keeps everything but its trailing white space and full stops; one full stop ends it."""
    assert answer_sentence("Osmium") == " So the answer is Osmium."
    assert answer_sentence("Mt. Everest. \t") == " So the answer is Mt. Everest."
    assert answer_sentence("beta...") == " So the answer is beta."
    assert answer_sentence(".5 m") == " So the answer is .5 m."
    assert answer_sentence("Planet X") == " So the answer is Planet X."


def test_every_role_of_one_trajectory_names_the_answer_exactly() -> None:
    """One small trajectory across the roles: the plan's thought example, the plan's action-type example that decides
    Finish (after an earlier thought), the action example completing ``Finish[`` and the examples that read
    ``Finish[B]`` all name option B's text; the example before a search and a record without options stay the very
    same objects, the order and the count of records are kept, and the stats count exactly what changed."""
    head = "Answer it.\nQuestion:Which planet?\nOptions:(A) alpha (B) beta. (C) Planet X\n"
    search = THOUGHT + "I should search." + _ACTION + "BingSearch[planets]\nObversation: Beta is a planet.\n"
    named = "It is beta. So the answer is beta."
    plain = _rec("Question: no options\n" + THOUGHT, "x", "plain")
    p1 = _rec(head + THOUGHT + "I should search." + _ACTION, "BingSearch", "p1")
    p2 = _rec(head + search + THOUGHT, "It is beta.", "p2")
    p3 = _rec(head + search + THOUGHT + "It is beta." + _ACTION, "Finish", "p3")
    p4 = _rec(head + search + THOUGHT + "It is beta." + _ACTION + "Finish[B]" + _REFLECT + THOUGHT, "Correct.", "p4")
    a1 = _rec(head + search + THOUGHT + "It is beta." + _FINISH_OPEN, "B", "a1")
    r1 = _rec(head + search + THOUGHT + "It is beta." + _FINISH_OPEN + "B]" + _REFLECT + THOUGHT, "Correct.", "r1")
    records = {"plan": [plain, p1, p2, p3, p4], "action": [a1], "reflect": [r1]}
    out, stats = add_answer_thoughts(records)
    assert stats == {"trajectories": 1, "with_finish_thought": 1, "records_changed": 5}
    assert out["plan"][0] is plain and out["plan"][1] is p1
    assert out["plan"][2:] == [
        _rec(head + search + THOUGHT, named, "p2"),
        _rec(head + search + THOUGHT + named + _ACTION, "Finish", "p3"),
        _rec(head + search + THOUGHT + named + _ACTION + "Finish[B]" + _REFLECT + THOUGHT, "Correct.", "p4"),
    ]
    assert out["action"] == [_rec(head + search + THOUGHT + named + _FINISH_OPEN, "B", "a1")]
    assert out["reflect"] == [_rec(head + search + THOUGHT + named + _FINISH_OPEN + "B]" + _REFLECT + THOUGHT,
                                   "Correct.", "r1")]  # fmt: skip
    assert records == {"plan": [plain, p1, p2, p3, p4], "action": [a1], "reflect": [r1]}  # inputs untouched
    again, stats_again = add_answer_thoughts(out)
    assert again == out and stats_again["records_changed"] == 0


def test_a_thought_is_named_only_where_finish_follows_it() -> None:
    """The same thought text before a search is left as it is, in the plan's action-type example that picks the
    search and in later inputs; only its occurrence directly before ``Finish`` is named."""
    head = "Go.\nQuestion:Which?\nOptions:(A) alpha (B) beta\n"
    p1 = _rec(head + THOUGHT + "Look it up." + _ACTION, "Retrieve")
    a1 = _rec(head + THOUGHT + "Look it up.\nAciton: Retrieve[\n### Response:\n", "beta")
    later = head + THOUGHT + "Look it up.\nAction: Retrieve[beta]\nObversation: Beta.\n" + THOUGHT + "Look it up."
    a2 = _rec(later + _FINISH_OPEN, "B")
    out, stats = add_answer_thoughts({"plan": [p1], "action": [a1, a2]})
    assert stats == {"trajectories": 1, "with_finish_thought": 1, "records_changed": 1}
    assert out["plan"][0] is p1 and out["action"][0] is a1
    assert out["action"][1] == _rec(later + " So the answer is beta." + _FINISH_OPEN, "B")


def test_a_finish_letter_without_an_option_changes_nothing() -> None:
    """``Finish[C]`` in a two-option trajectory has no option text to name: every record comes back as it is."""
    head = "Go.\nQuestion:Two options?\nOptions:(A) yes (B) no\n"
    records = {
        "plan": [
            _rec(head + THOUGHT, "Pick C."),
            _rec(head + THOUGHT + "Pick C." + _ACTION, "Finish"),
            _rec(head + THOUGHT + "Pick C." + _ACTION + "Finish[C]" + _REFLECT + THOUGHT, "ok"),
        ],
        "action": [_rec(head + THOUGHT + "Pick C." + _FINISH_OPEN, "C")],
    }
    out, stats = add_answer_thoughts(records)
    assert stats == {"trajectories": 1, "with_finish_thought": 1, "records_changed": 0}
    for role, recs in records.items():
        assert len(out[role]) == len(recs) and all(a is b for a, b in zip(out[role], recs, strict=True))


def test_only_an_open_action_finish_is_completed_by_its_output_letter() -> None:
    """An action example ending in ``Aciton: Finish[`` reads its output letter (stripped) as the Finish letter; an
    input that stops inside a plan's ``Finish[`` with a letter as output finishes nothing."""
    head = "Go.\nQuestion:Which?\nOptions:(A) alpha (B) beta\n"
    action = _rec(head + THOUGHT + "Maybe beta." + _FINISH_OPEN, " B\n")
    assert finish_thoughts([action]) == {"Maybe beta.": "B"}
    inside = _rec(head + THOUGHT + "Maybe beta." + _ACTION + "Finish[", "B")
    assert finish_thoughts([inside]) == {}
    out, stats = add_answer_thoughts({"plan": [inside]})
    assert out["plan"][0] is inside and stats == {"trajectories": 1, "with_finish_thought": 0, "records_changed": 0}
