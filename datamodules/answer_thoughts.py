"""Answer-naming thoughts: the thought before each ``Finish`` names the chosen option's text.

In the bundled ScienceQA trajectories the choice is made in one token: the thought before ``Finish`` rarely names
what it picks (``Let's use Finish to select the correct answer.``), and the action role then writes a bare letter.
Trained on that, the 135M roles answer with valid letters (:mod:`datamodules.option_variants`) that carry no signal
from the question (accuracy at the chance rate; ``results/study``). Naming the option's *text* first turns the
choice into one the language model can make from the question — the option texts' likelihoods alone put the
untrained base model above chance — and leaves the letter as a lookup in the ``Options:`` line a few lines above.

Every thought that is directly followed by ``Finish[X]`` gets ``" So the answer is <text of option X>."`` appended,
wherever it occurs in one trajectory's role examples:

* in later examples' inputs, where the thought is followed by the plan's ``Action: ... Finish[X]`` or by the
  action's ``Aciton: Finish[ ... X]`` (an action example whose output is the letter counts as followed by it);
* as the plan example's own output (the thought it generates) and in the plan's action-type example that decides
  ``Finish`` after it, where the letter comes from the same thought's ``Finish`` elsewhere in the trajectory.

The letter-to-text lookup uses each record's own ``Options:`` line, so it must run after the option-count variants
(which re-letter the options). Nothing else changes; records without an ``Options:`` line are returned as they are.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from datamodules.option_variants import LETTERS, parse_options, question_key
from datamodules.records import RoleRecord

THOUGHT = "Thought: \n### Response:\n"
_FINISH_OPEN = "Aciton: Finish[\n### Response:\n"
_PLAN_ACTION = "\nAction: \n### Response:\n"
# a thought, then the Finish that follows it as plan inputs and as action/reflect inputs write it
_THOUGHT_THEN_FINISH = re.compile(
    r"(?<=Thought: \n### Response:\n)(?P<thought>[^\n]*)"
    r"(?=\n(?:Action: \n### Response:\nFinish\[(?P<x1>[A-J])\]|Aciton: Finish\[\n### Response:\n(?P<x2>[A-J])\]))"
)


def answer_sentence(option_text: str) -> str:
    """What is appended to a thought: ``" So the answer is <option text>."`` (no doubled full stop)."""
    return f" So the answer is {option_text.rstrip().rstrip('.')}."


def _full_text(rec: RoleRecord) -> str:
    """An action example that completes ``Finish[`` with a letter reads as ``...Finish[\\n### Response:\\nX]``."""
    if rec.input.endswith(_FINISH_OPEN) and rec.output.strip() in LETTERS:
        return rec.input + rec.output.strip() + "]"
    return rec.input + rec.output


def _named(thought: str, sentence: str) -> str:
    return thought if thought.endswith(sentence) else thought + sentence


def finish_thoughts(records: Sequence[RoleRecord]) -> dict[str, str]:
    """Thought text -> the ``Finish`` letter that follows it, over one trajectory's records (the last one seen)."""
    out: dict[str, str] = {}
    for rec in records:
        for m in _THOUGHT_THEN_FINISH.finditer(_full_text(rec)):
            out[m.group("thought")] = m.group("x1") or m.group("x2")
    return out


def _rewrite(rec: RoleRecord, options: list[str], letter_of: dict[str, str]) -> RoleRecord:
    def text_of(letter: str) -> str | None:
        i = LETTERS.index(letter)
        return options[i] if i < len(options) else None

    def sub(m: re.Match) -> str:
        text = text_of(m.group("x1") or m.group("x2"))
        return m.group("thought") if text is None else _named(m.group("thought"), answer_sentence(text))

    full = _full_text(rec)
    new_full = _THOUGHT_THEN_FINISH.sub(sub, full)
    added = len(full) - len(rec.input)  # the output, or an action's letter and "]" appended for the match
    new_input, new_output = new_full[: len(new_full) - added], rec.output
    # the plan's action-type example that decides Finish after a thought: the letter is known from elsewhere
    if new_input.endswith(_PLAN_ACTION) and new_output.strip().startswith("Finish"):
        head, sep, thought = new_input[: -len(_PLAN_ACTION)].rpartition(THOUGHT)
        if sep and thought in letter_of and (text := text_of(letter_of[thought])) is not None:
            new_input = head + sep + _named(thought, answer_sentence(text)) + _PLAN_ACTION
    # the plan example that writes the thought itself
    if new_input.endswith(THOUGHT) and new_output in letter_of and (text := text_of(letter_of[new_output])):
        new_output = _named(new_output, answer_sentence(text))
    if new_input == rec.input and new_output == rec.output:
        return rec
    return replace(rec, input=new_input, output=new_output)


def add_answer_thoughts(
    records_by_role: dict[str, list[RoleRecord]],
) -> tuple[dict[str, list[RoleRecord]], dict[str, int]]:
    """Appends the answer sentence to every thought followed by ``Finish`` (see the module docstring).

    Args:
        records_by_role: role -> records; one trajectory's records are found across roles by their question and
            options text (a variant's re-lettered options make it a trajectory of its own).

    Returns:
        ``(records_by_role, stats)``: the same records in the same order, rewritten; ``stats`` counts
        ``trajectories`` (with an ``Options:`` line), ``with_finish_thought`` and ``records_changed``.
    """
    groups: dict[tuple[str, str], list[RoleRecord]] = defaultdict(list)
    for recs in records_by_role.values():
        for rec in recs:
            key = question_key(rec.input)
            if key is not None:
                groups[key].append(rec)
    letters = {key: finish_thoughts(recs) for key, recs in groups.items()}
    options = {key: parse_options(key[1]) for key in groups}
    stats = {"trajectories": len(groups), "with_finish_thought": sum(1 for v in letters.values() if v),
             "records_changed": 0}  # fmt: skip
    out: dict[str, list[RoleRecord]] = {}
    for role, recs in records_by_role.items():
        new = []
        for rec in recs:
            key = question_key(rec.input)
            if key is None or not letters[key]:
                new.append(rec)
                continue
            rewritten = _rewrite(rec, options[key], letters[key])
            stats["records_changed"] += rewritten is not rec
            new.append(rewritten)
        out[role] = new
    return out, stats
