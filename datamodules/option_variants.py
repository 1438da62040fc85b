"""Option-count variants of multiple-choice role examples: teach the roles to answer among the options shown.

Every ScienceQA training trajectory of the bundled data has exactly four options, with gold letters spread evenly
over A–D, while most test questions have two or three. Trained on that data alone, the roles learn a letter prior
over A–D that ignores how many options a question has (``D`` for a two-option question). This module derives, from
each trajectory, variants with fewer options, keeping the trajectory's reasoning valid:

* the options the trajectory answers with (every ``Finish[X]`` letter, wrong attempts included, and so the gold
  one) are always kept; the others are distractors, dropped at random down to ``k`` options;
* the kept options are re-ordered so that the gold option lands on each of the ``k`` letters equally often over the
  data set (gold positions are assigned round-robin over the trajectories in a seeded order), and every letter in
  the text is rewritten to its new letter: the ``Options:`` line and every ``Finish[X]`` (plan's ``Finish[X]``,
  action/reflect's ``Finish[\\n### Response:\\nX]``, and an action example's bare-letter output);
* a trajectory whose own thoughts mention option letters (``option B``, ``the answer is not A or D``) is left as it
  is: rewriting free text would be guesswork, and dropping an option it talks about would make the text wrong.

All role examples of one trajectory (grouped by their ``Question:``/``Options:`` text) get the same variant, so
prefix packing still finds their shared prefixes. The gold option of a trajectory is the last ``Finish`` letter of
its longest example (every bundled trajectory ends with a correct ``Finish`` and ``Reflect[right]``;
``tests/test_option_variants.py`` checks this against the raw trajectories' gold answers).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from datamodules.records import RoleRecord

LETTERS = "ABCDEFGHIJ"

_QUESTION_RE = re.compile(r"\nQuestion:(?P<question>.*?)\nOptions:(?P<options>\([A-J]\) [^\n]*)\n", re.S)
_OPTION_RE = re.compile(r"\(([A-J])\) ")
# Finish[X] as plan writes it, and Finish[\n### Response:\nX] as the action/reflect inputs write it.
_FINISH_RE = re.compile(r"Finish\[(\n### Response:\n)?([A-J])\]")
_FINISH_OPEN = "Finish[\n### Response:\n"


def _free_letter_re(n: int) -> re.Pattern:
    """An option letter standing alone in free text, for a question with ``n`` options: B.. anywhere, ``A`` only
    where it cannot be the article (followed by punctuation, "or"/"and", or the end), ``(X)``, ``option X``.
    Letters inside ``Finish[...]`` are removed before this is applied. ``I`` (the pronoun) is never an option
    letter here: questions with nine or more options are not varied."""
    last = LETTERS[n - 1]
    others = f"[B-{last}]" if n > 2 else "B"
    return re.compile(
        rf"(?<![\w\[*])(?:{others}(?![\w'’*\-])|A(?=\s*(?:[,.)?:;]|or\b|and\b|$)))|\([A-{last}]\)"
        rf"|[Oo]ptions? \(?[A-{last}]\b"
    )


_OBSERVATION_RE = re.compile(r"\nObversation: [^\n]*")


@dataclass(frozen=True)
class Trajectory:
    """What the variants of one trajectory need to know.

    Attributes:
        options: the option texts in the original order (``options[0]`` is ``A``).
        answered: the letters the trajectory answers with (all ``Finish`` letters), original lettering.
        gold: the gold letter (the last ``Finish`` of the longest example).
        talks_letters: whether its free text (thoughts) mentions option letters; such a trajectory is not varied.
    """

    options: tuple[str, ...]
    answered: frozenset[str]
    gold: str
    talks_letters: bool


def parse_options(options_text: str) -> list[str]:
    """``"(A) x (B) y"`` -> ``["x", "y"]``; raises ``ValueError`` when the letters are not A, B, C, ... in order."""
    marks = list(_OPTION_RE.finditer(options_text))
    letters = "".join(m.group(1) for m in marks)
    if not marks or marks[0].start() != 0 or letters != LETTERS[: len(marks)]:
        raise ValueError(f"options {options_text[:80]!r} are not lettered (A) (B) ... in order")
    ends = [m.start() for m in marks[1:]] + [len(options_text)]
    return [options_text[m.end() : end].rstrip(" ") if i < len(marks) - 1 else options_text[m.end() : end]
            for i, (m, end) in enumerate(zip(marks, ends, strict=True))]  # fmt: skip


def format_options(options: Sequence[str]) -> str:
    """``["x", "y"]`` -> ``"(A) x (B) y"``: the training data's (and :func:`~lragent.agents.prompts.format_question`'s)
    layout."""
    return " ".join(f"({LETTERS[i]}) {text}" for i, text in enumerate(options))


def question_key(text: str) -> tuple[str, str] | None:
    """``(question, options text)`` of a role input, or None when it has no ``Options:`` line."""
    m = _QUESTION_RE.search(text)
    return None if m is None else (m.group("question"), m.group("options"))


def _full_text(rec: RoleRecord) -> str:
    """Input and output as one text; an action output that completes ``Finish[`` reads as ``Finish[...X]``."""
    if rec.input.endswith(_FINISH_OPEN):
        return rec.input + rec.output.strip() + "]"
    return rec.input + rec.output


def _answer_letters(text: str) -> list[str]:
    return [m.group(2) for m in _FINISH_RE.finditer(text)]


def _talks_letters(text: str, options_end: int, n_options: int) -> bool:
    body = _OBSERVATION_RE.sub("", text[options_end:])
    body = _FINISH_RE.sub("", body)
    return n_options >= 9 or _free_letter_re(n_options).search(body) is not None


def describe_trajectories(records: Sequence[RoleRecord]) -> dict[tuple[str, str], Trajectory]:
    """Groups role examples (of all roles) by their question and options, and describes each trajectory.

    Records without an ``Options:`` line are not multiple-choice and are left out.
    """
    groups: dict[tuple[str, str], list[RoleRecord]] = defaultdict(list)
    for rec in records:
        key = question_key(rec.input)
        if key is not None:
            groups[key].append(rec)
    out: dict[tuple[str, str], Trajectory] = {}
    for key, recs in groups.items():
        options = tuple(parse_options(key[1]))
        answered: set[str] = set()
        talks = False
        for rec in recs:
            text = _full_text(rec)
            answered.update(_answer_letters(text))
            m = _QUESTION_RE.search(text)
            talks = talks or _talks_letters(text, m.end() if m else 0, len(options))
        longest = max(recs, key=lambda r: len(_full_text(r)))
        finishes = _answer_letters(_full_text(longest))
        gold = finishes[-1] if finishes else ""
        out[key] = Trajectory(options=options, answered=frozenset(answered), gold=gold, talks_letters=talks)
    return out


def _rewrite(rec: RoleRecord, key: tuple[str, str], new_options: str, mapping: dict[str, str], tag: str) -> RoleRecord:
    """One record with the options line replaced and every ``Finish`` letter mapped."""

    def finish(m: re.Match) -> str:
        return f"Finish[{m.group(1) or ''}{mapping[m.group(2)]}]"

    old_line = f"\nQuestion:{key[0]}\nOptions:{key[1]}\n"
    new_line = f"\nQuestion:{key[0]}\nOptions:{new_options}\n"
    if old_line not in rec.input:  # cannot happen for a record of this group; refuse rather than guess
        raise ValueError(f"{rec.source}: options line not found while deriving a variant")
    text = _FINISH_RE.sub(finish, rec.input.replace(old_line, new_line))
    output = rec.output
    if rec.input.endswith(_FINISH_OPEN):
        stripped = output.strip()
        if stripped in mapping:
            output = output.replace(stripped, mapping[stripped])
    else:
        output = _FINISH_RE.sub(finish, output)
    return replace(rec, input=text, output=output, source=f"{rec.source} [{tag}]")


def option_count_variants(
    records_by_role: dict[str, list[RoleRecord]], counts: Sequence[int], seed: int = 0
) -> tuple[dict[str, list[RoleRecord]], dict[str, int]]:
    """Adds, for every multiple-choice trajectory, a variant with ``k`` options for each ``k`` in ``counts``.

    Args:
        records_by_role: role -> its (training) records; every role's records are varied together, so that one
            trajectory's examples agree on the variant.
        counts: option counts of the variants, e.g. ``[2, 3]``; each in ``2 .. len(options)``. A count equal to the
            trajectory's own option count gives a re-lettered copy (gold moved to its balanced position).
        seed: seed of the distractor choice, the option order and the gold-position assignment.

    Returns:
        ``(records_by_role, stats)``: the original records followed by the variants (same role order), and counts
        (``trajectories``, ``varied``, ``skipped_talks_letters``, ``skipped_too_many_answers``,
        ``variants_k`` per count).

    Raises:
        ValueError: a count below 2, or a record whose options are not lettered in order.
    """
    for k in counts:
        if not isinstance(k, int) or k < 2 or k > len(LETTERS):
            raise ValueError(f"option_variants: each count must be an integer in 2..{len(LETTERS)}, got {k!r}")
    all_records = [rec for recs in records_by_role.values() for rec in recs]
    trajectories = describe_trajectories(all_records)
    stats = {"trajectories": len(trajectories), "varied": 0, "skipped_talks_letters": 0, "skipped_no_answer": 0}
    stats.update({f"variants_{k}": 0 for k in counts})
    # Balanced gold positions: trajectories in a seeded order, the i-th eligible one gets position i mod k.
    order = sorted(trajectories, key=lambda key: random.Random(f"{seed}:{key}").random())
    plans: dict[tuple[str, str], list[tuple[str, dict[str, str], str]]] = {}
    seen_per_k: dict[int, int] = defaultdict(int)
    for key in order:
        traj = trajectories[key]
        if traj.talks_letters:
            stats["skipped_talks_letters"] += 1
            continue
        if not traj.gold:
            stats["skipped_no_answer"] += 1
            continue
        rng = random.Random(f"{seed}:{key}:variants")
        plan = []
        for k in counts:
            n = len(traj.options)
            keep_fixed = sorted(traj.answered)
            if k > n or len(keep_fixed) > k:
                continue
            others = [LETTERS[i] for i in range(n) if LETTERS[i] not in traj.answered]
            kept = keep_fixed + rng.sample(others, k - len(keep_fixed))
            rest = [x for x in kept if x != traj.gold]
            rng.shuffle(rest)
            pos = seen_per_k[k] % k
            seen_per_k[k] += 1
            new_order = rest[:pos] + [traj.gold] + rest[pos:]
            mapping = {old: LETTERS[i] for i, old in enumerate(new_order)}
            new_options = format_options([traj.options[LETTERS.index(old)] for old in new_order])
            plan.append((new_options, mapping, f"{k} options"))
            stats[f"variants_{k}"] += 1
        if plan:
            plans[key] = plan
            stats["varied"] += 1
    out: dict[str, list[RoleRecord]] = {}
    for role, recs in records_by_role.items():
        extra = []
        for rec in recs:
            key = question_key(rec.input)
            for new_options, mapping, tag in plans.get(key, []) if key is not None else []:
                extra.append(_rewrite(rec, key, new_options, mapping, tag))
        out[role] = list(recs) + extra
    return out, stats
