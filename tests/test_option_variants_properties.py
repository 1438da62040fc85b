"""Properties of the option-count variants on small synthetic trajectories with unequal option counts.

Pinned here: a variant keeps every option the trajectory answers with (the gold one included), drops only
distractors, never duplicates an option, re-letters every ``Finish`` so that it names the same option text as
before, spreads the gold option evenly over the ``k`` letters (start, middle and end), is a function of the seed
(the same seed gives the same variants, other seeds other ones), and handles the boundaries: two options, the
largest count, counts above a question's own count, trajectories with no answer or with letter-talking thoughts.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules.option_variants import (
    LETTERS,
    _rewrite,
    _talks_letters,
    describe_trajectories,
    format_options,
    option_count_variants,
    parse_options,
    question_key,
)
from datamodules.records import RoleRecord

FINISH = re.compile(r"Finish\[(?:\n### Response:\n)?([A-J])\]")
OPEN = "Finish[\n### Response:\n"


def trajectory(i: int, n: int, attempts: list[str], question: str | None = None) -> list[RoleRecord]:
    """One synthetic trajectory with ``n`` options answered with ``attempts`` (the last one the gold letter): a plan
    example that answers with the first attempt, an action example whose bare-letter output completes the last
    ``Finish``, and a reflect example (the longest) after every attempt."""
    q = question if question is not None else f" Which item is number {i}?"
    head = f"Solve it.\nQuestion:{q}\nOptions:{format_options([f'item{i}x{j}' for j in range(n)])}\n"
    history = ""
    for w in attempts[:-1]:
        history += (
            f"Thought: \n### Response:\nmaybe this\nAciton: {OPEN}{w}]\nObversation: Please reflect your answer.\n"
            "Thought: \n### Response:\nthink again\nAction: Reflect[wrong]\nObversation: try again\n"
        )
    plan_out = f"Finish[{attempts[0]}]" if attempts else "Search[thing]"
    recs = [RoleRecord(head + "Thought: \n### Response:\nhmm\nAction: \n### Response:\n", plan_out, f"plan:{i}")]
    if attempts:
        act_in = head + history + f"Thought: \n### Response:\nsure now\nAciton: {OPEN}"
        recs.append(RoleRecord(act_in, f" {attempts[-1]}\n", f"action:{i}"))
        ref_in = act_in + attempts[-1] + "]\nObversation: Please reflect your answer.\nThought: \n### Response:\n"
        recs.append(RoleRecord(ref_in, "It is right.", f"reflect:{i}"))
    return recs


def by_role(trajectories: list[list[RoleRecord]]) -> dict[str, list[RoleRecord]]:
    out: dict[str, list[RoleRecord]] = {"plan": [], "action": [], "reflect": []}
    for recs in trajectories:
        for rec in recs:
            out[rec.source.split(":")[0]].append(rec)
    return out


def full_text(rec: RoleRecord) -> str:
    return rec.input + (rec.output.strip() + "]" if rec.input.endswith(OPEN) else rec.output)


def variants(out: dict[str, list[RoleRecord]], records: dict[str, list[RoleRecord]]) -> list[RoleRecord]:
    return [v for role in records for v in out[role][len(records[role]) :]]


def gold_text(rec: RoleRecord) -> str:
    """The option text the record's last ``Finish`` names."""
    options = parse_options(question_key(rec.input)[1])
    return options[LETTERS.index(FINISH.findall(full_text(rec))[-1])]


def check_variant(var: RoleRecord, orig: RoleRecord, k: int) -> None:
    """``var`` is ``orig`` with ``k`` options, letters re-mapped: every ``Finish`` names the same option text."""
    okey, vkey = question_key(orig.input), question_key(var.input)
    assert vkey[0] == okey[0]
    old, new = parse_options(okey[1]), parse_options(vkey[1])
    assert len(new) == k and len(set(new)) == k and set(new) <= set(old)
    answered = {old[LETTERS.index(x)] for x in FINISH.findall(full_text(orig))}
    assert answered <= set(new)  # every answered option (the gold one too) is kept
    to_old = {LETTERS[i]: LETTERS[old.index(t)] for i, t in enumerate(new)}
    back = FINISH.sub(lambda m: m.group(0)[:-2] + to_old[m.group(1)] + "]", var.input)
    assert back.replace(f"Options:{vkey[1]}\n", f"Options:{okey[1]}\n") == orig.input
    if orig.input.endswith(OPEN):
        assert var.output.replace(var.output.strip(), to_old[var.output.strip()]) == orig.output
    else:
        assert FINISH.sub(lambda m: m.group(0)[:-2] + to_old[m.group(1)] + "]", var.output) == orig.output
    assert var.source == f"{orig.source} [{k} options]"


def unequal_data() -> list[tuple[int, list[str]]]:
    """Option counts 3..6 and answers at the start, middle and end of the options, one with a wrong attempt."""
    return [(3, ["A"]), (4, ["C"]), (5, ["E"]), (6, ["B", "D"]), (4, ["D"]), (5, ["A"])]


# ------------------------------------------------------------------------------------------------ the variants


@settings(max_examples=25)
@given(
    st.lists(
        st.integers(2, 8).flatmap(
            lambda n: st.tuples(
                st.just(n),
                st.lists(st.sampled_from(LETTERS[:n]), min_size=1, max_size=3, unique=True),
            )
        ),
        min_size=1,
        max_size=5,
    ),
    st.lists(st.integers(2, 8), min_size=1, max_size=3, unique=True),
    st.integers(0, 1000),
)
def test_every_variant_keeps_the_answered_options_and_remaps_each_finish_to_the_same_text(data, counts, seed) -> None:
    records = by_role([trajectory(i, n, att) for i, (n, att) in enumerate(data)])
    out, stats = option_count_variants(records, counts, seed=seed)
    for role in records:
        assert out[role][: len(records[role])] == records[role]  # originals first, unchanged
    originals = {r.source: r for recs in records.values() for r in recs}
    made: Counter[int] = Counter()
    for var in variants(out, records):
        k = int(var.source.rsplit("[", 1)[1].split()[0])
        check_variant(var, originals[var.source.rsplit(" [", 1)[0]], k)
        made[k] += var.source.startswith("reflect")
    for k in counts:  # one variant per trajectory and count that fits: k options, all answered ones among them
        want = sum(1 for n, att in data if len(att) <= k <= n)
        assert made[k] == stats[f"variants_{k}"] == want
    assert stats["trajectories"] == len(data)
    assert stats["varied"] == sum(1 for n, att in data if any(len(att) <= k <= n for k in counts))


@settings(max_examples=15)
@given(st.integers(2, 6), st.integers(4, 9), st.integers(0, 1000))
def test_gold_positions_are_spread_evenly_over_the_k_letters(k, n_traj, seed) -> None:
    """Round-robin gold positions: over the trajectories every letter of ``k`` is the gold one n/k times (±1), so
    the first, middle and last positions all occur; the gold option text never changes."""
    data = [(8, [LETTERS[i % 8]]) for i in range(n_traj)]
    records = by_role([trajectory(i, n, att) for i, (n, att) in enumerate(data)])
    out, _ = option_count_variants(records, [k], seed=seed)
    reflect = out["reflect"][len(records["reflect"]) :]
    assert len(reflect) == n_traj
    originals = {r.source: r for r in records["reflect"]}
    positions = Counter()
    for var in reflect:
        assert gold_text(var) == gold_text(originals[var.source.rsplit(" [", 1)[0]])
        positions[FINISH.findall(full_text(var))[-1]] += 1
    assert set(positions) <= set(LETTERS[:k])
    assert all(positions[x] in (n_traj // k, -(-n_traj // k)) for x in LETTERS[:k]), positions


def test_gold_lands_at_start_middle_and_end_with_three_options() -> None:
    records = by_role([trajectory(i, n, att) for i, (n, att) in enumerate(unequal_data())])
    out, stats = option_count_variants(records, [3], seed=0)
    golds = Counter(FINISH.findall(full_text(v))[-1] for v in out["reflect"][len(records["reflect"]) :])
    assert golds == {"A": 2, "B": 2, "C": 2}
    assert stats == {
        "trajectories": 6, "varied": 6, "skipped_talks_letters": 0, "skipped_no_answer": 0, "variants_3": 6,
    }  # fmt: skip


def test_wrong_attempts_stay_and_a_count_below_the_answered_options_is_skipped() -> None:
    """``(6, [B, D])``: both answered options stay; with 2 options exactly those two; 1 answered option needs none."""
    records = by_role([trajectory(0, 6, ["B", "D", "F"]), trajectory(1, 6, ["B", "D"])])
    out, stats = option_count_variants(records, [2, 3], seed=3)
    assert stats["variants_2"] == 1 and stats["variants_3"] == 2 and stats["varied"] == 2
    for var in variants(out, records):
        opts = parse_options(question_key(var.input)[1])
        if var.source.startswith("plan:1") and var.source.endswith("[2 options]"):
            assert sorted(opts) == ["item1x1", "item1x3"]
        if var.source.startswith("plan:0"):
            assert var.source.endswith("[3 options]") and sorted(opts) == ["item0x1", "item0x3", "item0x5"]


def test_same_seed_same_variants_other_seeds_other_ones() -> None:
    records = by_role([trajectory(i, n, att) for i, (n, att) in enumerate(unequal_data())])
    first = option_count_variants(records, [2, 3], seed=7)
    assert option_count_variants(records, [2, 3], seed=7) == first
    lines = {
        seed: [
            question_key(v.input)[1] for v in variants(option_count_variants(records, [2, 3], seed=seed)[0], records)
        ]
        for seed in range(4)
    }
    assert len({tuple(x) for x in lines.values()}) == 4  # each seed its own distractors and orders
    assert option_count_variants(records, [2, 3])[0] == option_count_variants(records, [2, 3], seed=0)[0]


def test_variants_of_seed_zero_are_the_recorded_ones() -> None:
    """A regression pin of the seeded choices (distractors, order, gold positions): training data must not change
    under a refactor, or resumed runs and recorded results stop being comparable."""
    records = by_role([trajectory(i, n, att) for i, (n, att) in enumerate(unequal_data())])
    out, _ = option_count_variants(records, [2, 4], seed=0)
    got = [(v.source, question_key(v.input)[1], v.output) for v in out["action"][len(records["action"]) :]]
    assert got == RECORDED


RECORDED: list[tuple[str, str, str]] = [
    ("action:0 [2 options]", "(A) item0x0 (B) item0x1", " A\n"),
    ("action:1 [2 options]", "(A) item1x1 (B) item1x2", " B\n"),
    ("action:1 [4 options]", "(A) item1x1 (B) item1x3 (C) item1x2 (D) item1x0", " C\n"),
    ("action:2 [2 options]", "(A) item2x4 (B) item2x3", " A\n"),
    ("action:2 [4 options]", "(A) item2x4 (B) item2x2 (C) item2x1 (D) item2x0", " A\n"),
    ("action:3 [2 options]", "(A) item3x3 (B) item3x1", " A\n"),
    ("action:3 [4 options]", "(A) item3x5 (B) item3x0 (C) item3x1 (D) item3x3", " D\n"),
    ("action:4 [2 options]", "(A) item4x0 (B) item4x3", " B\n"),
    ("action:4 [4 options]", "(A) item4x0 (B) item4x3 (C) item4x2 (D) item4x1", " B\n"),
    ("action:5 [2 options]", "(A) item5x3 (B) item5x0", " B\n"),
    ("action:5 [4 options]", "(A) item5x0 (B) item5x4 (C) item5x1 (D) item5x2", " A\n"),
]


def test_two_options_and_the_own_count_are_the_boundaries() -> None:
    """2 options: a two-option question gets a re-lettered copy with k = 2; a count above a question's own count
    gives no variant; 8 options (the most that are varied) still are, 9 are not (``I`` would be a letter)."""
    records = by_role([trajectory(0, 2, ["B"]), trajectory(1, 8, ["H"]), trajectory(2, 9, ["I"])])
    out, stats = option_count_variants(records, [2, 8, 10], seed=1)
    made = sorted(v.source for v in out["plan"][len(records["plan"]) :])
    assert made == ["plan:0 [2 options]", "plan:1 [2 options]", "plan:1 [8 options]"]
    assert stats == {
        "trajectories": 3, "varied": 2, "skipped_talks_letters": 1, "skipped_no_answer": 0,
        "variants_2": 2, "variants_8": 1, "variants_10": 0,
    }  # fmt: skip
    originals = {r.source: r for recs in records.values() for r in recs}
    for var in variants(out, records):
        check_variant(var, originals[var.source.rsplit(" [", 1)[0]], int(var.source.rsplit("[", 1)[1].split()[0]))


def test_trajectories_without_an_answer_or_talking_letters_are_left_out() -> None:
    talk = trajectory(1, 4, ["C"])
    talk[0] = RoleRecord(talk[0].input, "Finish[C] since option B is wrong", talk[0].source)
    records = by_role([trajectory(0, 4, []), talk, trajectory(2, 4, ["A"]), trajectory(3, 3, [])])
    records["plan"].append(RoleRecord("no options here\n### Response:\n", "Finish[A]", "plan:9"))
    out, stats = option_count_variants(records, [2], seed=0)
    assert stats == {
        "trajectories": 4, "varied": 1, "skipped_talks_letters": 1, "skipped_no_answer": 2, "variants_2": 1,
    }  # fmt: skip
    assert sorted(v.source for v in variants(out, records)) == [
        f"{r}:2 [2 options]" for r in ("action", "plan", "reflect")
    ]


@pytest.mark.parametrize("bad", [1, 0, 11, 2.0, "3"])
def test_counts_outside_two_to_ten_are_refused(bad) -> None:
    with pytest.raises(ValueError, match=re.escape(f"each count must be an integer in 2..10, got {bad!r}")):
        option_count_variants({"plan": trajectory(0, 4, ["A"])}, [2, bad])


def test_a_one_option_question_is_described_and_not_varied() -> None:
    records = by_role([trajectory(0, 1, ["A"])])
    traj = describe_trajectories(records["plan"])[question_key(records["plan"][0].input)]
    assert traj.options == ("item0x0",) and traj.gold == "A" and not traj.talks_letters
    out, stats = option_count_variants(records, [2], seed=0)
    assert out == records and stats["varied"] == 0 and stats["variants_2"] == 0


def test_count_ten_is_accepted() -> None:
    records = by_role([trajectory(0, 4, ["A"])])
    assert option_count_variants(records, [10])[1]["variants_10"] == 0


# ------------------------------------------------------------------------------------------------- the helpers


def test_describe_takes_the_gold_from_the_longest_example_and_every_answered_letter() -> None:
    recs = trajectory(0, 5, ["E", "B", "C"])
    traj = describe_trajectories(recs)[question_key(recs[0].input)]
    assert traj.gold == "C" and traj.answered == frozenset("EBC") and not traj.talks_letters
    assert traj.options == tuple(f"item0x{j}" for j in range(5))
    # the plan example (shortest) answers E: were it taken for the gold, this would be E
    assert describe_trajectories([recs[0]])[question_key(recs[0].input)].gold == "E"
    assert describe_trajectories(trajectory(1, 3, []))[question_key(trajectory(1, 3, [])[0].input)].gold == ""


@pytest.mark.parametrize(
    ("text", "n", "talks"),
    [
        ("I think option B.", 2, True), ("the answer is (C) here", 3, True), ("not A, maybe", 2, True),
        ("A or so", 2, True), ("A and so", 2, True), ("it is A", 2, True), ("B is best", 2, True),
        ("Options A fits", 4, True), ("C is best", 3, True), ("C is best", 2, False), ("A cat sat", 4, False),
        ("I think so", 8, False), ("ok", 9, True), ("\nObversation: option B is wrong", 4, False),
        ("Finish[B] done", 4, False), ("Finish[\n### Response:\nB] done", 4, False), ("a B-tree", 4, False),
        ("Mr B's hat", 4, False), ("**B** bold", 4, False), ("[B] x", 4, False), ("word B", 4, True),
        ("so A Finish[B]", 4, True), ("so A\nObversation: fine", 4, True),  # removed pieces leave A at the end
    ],
)  # fmt: skip
def test_letters_in_free_text_are_recognised(text: str, n: int, talks: bool) -> None:
    assert _talks_letters("head\n" + text, 5, n) is talks


def test_options_parse_and_format_round_trip() -> None:
    assert parse_options("(A) x  (B) y z (C) w ") == ["x", "y z", "w "]  # inner padding dropped, the last kept
    assert parse_options("(A) tab\t (B) boX (C) z") == ["tab\t", "boX", "z"]  # only spaces are padding
    assert format_options(["x", "y z"]) == "(A) x (B) y z"
    for bad in ("", "x (A) y", "(A) x (C) y", "(B) x", "(B) " + "long text " * 12):
        with pytest.raises(ValueError, match=re.escape(f"options {bad[:80]!r} are not lettered (A) (B) ... in order")):
            parse_options(bad)
    assert question_key("a\nQuestion: q?\nOptions:(A) x (B) y\nrest") == (" q?", "(A) x (B) y")
    assert question_key("a\nQuestion: q?\nrest") is None


def test_rewrite_maps_plan_finish_and_bare_action_letters_and_refuses_a_foreign_record() -> None:
    recs = trajectory(0, 3, ["C"])
    key = question_key(recs[0].input)
    mapping = {"A": "B", "B": "C", "C": "A"}
    action = _rewrite(recs[1], key, "(A) u (B) v (C) w", mapping, "t")
    assert action.output == " A\n" and action.source == "action:0 [t]" and "Options:(A) u (B) v (C) w\n" in action.input
    plan = _rewrite(RoleRecord(recs[0].input, "Finish[B] and Finish[A]", "p"), key, "(A) u", mapping, "t")
    assert plan.output == "Finish[C] and Finish[B]"
    odd = _rewrite(RoleRecord(recs[1].input, "maybe", "a"), key, "(A) u", mapping, "t")
    assert odd.output == "maybe"  # not a letter: left as it is
    with pytest.raises(ValueError, match=re.escape("other: options line not found while deriving a variant")):
        _rewrite(RoleRecord("Question: x", "y", "other"), key, "(A) u", mapping, "t")
