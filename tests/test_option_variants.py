"""Option-count variants of the ScienceQA training data (the agents once answered with letters that are no option).

The shipped ScienceQA recipe must train on questions with 2, 3 and 4 options whose answers are letters of the
question's own options; each variant must be the original trajectory with only its options line and its ``Finish``
letters changed, consistently across the trajectory's role examples.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from datamodules.option_variants import (
    LETTERS,
    describe_trajectories,
    format_options,
    option_count_variants,
    parse_options,
    question_key,
)
from datamodules.role_examples import RoleExampleDataModule, RoleRecord, read_local_records, split_indices

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("plan", "action", "reflect")
FINISH = re.compile(r"Finish\[(?:\n### Response:\n)?([A-J])\]")


@pytest.fixture(scope="module")
def scienceqa() -> dict[str, list[RoleRecord]]:
    return {r: read_local_records(ROOT / f"data/trajectories/scienceqa/{r}.jsonl.gz") for r in ROLES}


def _answer_letters(rec: RoleRecord) -> list[str]:
    text = rec.input + (rec.output.strip() + "]" if rec.input.endswith("Finish[\n### Response:\n") else rec.output)
    return FINISH.findall(text)


def _training_records(config: str) -> dict[str, list[RoleRecord]]:
    """The training records exactly as the shipped config's data module builds them (tokenisation aside)."""
    data = yaml.safe_load((ROOT / config).read_text())["data"]
    dm = RoleExampleDataModule(
        data_files={r: str(ROOT / p) for r, p in data["data_files"].items()},
        tokenizer="byte",
        val_fraction=data["val_fraction"],
        seed=data["seed"],
        option_variants=data.get("option_variants"),
    )
    train = {}
    for role in ROLES:
        records = read_local_records(dm.data_files[role])
        tr, _ = split_indices(len(records), dm.val_fraction, dm.seed, role)
        train[role] = [records[i] for i in tr]
    if dm.option_variants:
        train, _ = option_count_variants(train, dm.option_variants, dm.seed)
    return train


def test_shipped_recipe_trains_on_two_three_and_four_options_with_valid_letters() -> None:
    """Fails on the old recipe: every training question had four options (a letter prior over A-D)."""
    train = _training_records("configs/embedded_scienceqa.yaml")
    n_options: Counter[int] = Counter()
    gold_by_count: dict[int, Counter[str]] = {}
    for role, recs in train.items():
        for rec in recs:
            key = question_key(rec.input)
            assert key is not None, rec.source
            n = len(parse_options(key[1]))
            n_options[n] += 1
            for letter in _answer_letters(rec):
                assert LETTERS.index(letter) < n, f"{rec.source}: Finish[{letter}] with {n} options"
            if role == "action" and rec.input.endswith("Finish[\n### Response:\n"):
                gold_by_count.setdefault(n, Counter())[rec.output.strip()] += 1
    assert n_options[2] > 0.15 * sum(n_options.values()), n_options
    assert n_options[3] > 0.15 * sum(n_options.values()), n_options
    # Finish outputs of two-option questions: both letters, neither dominating (the gold letters are balanced).
    two = gold_by_count[2]
    assert set(two) == {"A", "B"} and min(two.values()) >= 0.35 * sum(two.values()), two


def test_variant_changes_only_the_options_line_and_finish_letters(scienceqa) -> None:
    out, stats = option_count_variants(scienceqa, [2, 3], seed=0)
    trajectories = describe_trajectories([r for recs in scienceqa.values() for r in recs])
    originals = {(r.source): r for recs in scienceqa.values() for r in recs}
    assert stats["varied"] > 0.6 * stats["trajectories"]
    checked = 0
    for role in ROLES:
        assert out[role][: len(scienceqa[role])] == scienceqa[role]  # originals first, unchanged
        for var in out[role][len(scienceqa[role]) :]:
            orig = originals[var.source.rsplit(" [", 1)[0]]
            okey, vkey = question_key(orig.input), question_key(var.input)
            traj = trajectories[okey]
            old_opts, new_opts = parse_options(okey[1]), parse_options(vkey[1])
            # every option the trajectory answers with survives, texts unchanged
            assert {old_opts[LETTERS.index(x)] for x in traj.answered} <= set(new_opts)
            assert set(new_opts) <= set(old_opts) and len(set(new_opts)) == len(new_opts)
            to_old = {LETTERS[i]: LETTERS[old_opts.index(t)] for i, t in enumerate(new_opts)}
            # map the variant's letters back: the text must be the original's, character for character
            back_in = FINISH.sub(
                lambda m, to_old=to_old: m.group(0)[:-2] + to_old[m.group(1)] + "]",
                var.input.replace(f"Options:{vkey[1]}\n", f"Options:{okey[1]}\n"),
            )
            assert back_in == orig.input, var.source
            if orig.input.endswith("Finish[\n### Response:\n"):
                assert to_old[var.output.strip()] == orig.output.strip()
            else:
                back_out = FINISH.sub(lambda m, to_old=to_old: m.group(0)[:-2] + to_old[m.group(1)] + "]", var.output)
                assert back_out == orig.output
            checked += 1
    assert checked == sum(len(out[r]) - len(scienceqa[r]) for r in ROLES) > 1000


def test_one_variant_per_trajectory_and_count(scienceqa) -> None:
    """All role examples of a trajectory agree on the variant (their shared prefixes stay packable)."""
    out, _ = option_count_variants(scienceqa, [2, 3], seed=0)
    originals = {r.source: r for recs in scienceqa.values() for r in recs}
    lines: dict[tuple[tuple[str, str], int], set[str]] = {}
    for role in ROLES:
        for var in out[role][len(scienceqa[role]) :]:
            okey = question_key(originals[var.source.rsplit(" [", 1)[0]].input)
            opts = question_key(var.input)[1]
            lines.setdefault((okey, len(parse_options(opts))), set()).add(opts)
    assert len(lines) > 200
    assert all(len(v) == 1 for v in lines.values())


def test_letter_talking_trajectories_are_not_varied(scienceqa) -> None:
    out, stats = option_count_variants(scienceqa, [2], seed=0)
    trajectories = describe_trajectories([r for recs in scienceqa.values() for r in recs])
    originals = {r.source: r for recs in scienceqa.values() for r in recs}
    talkers = {k for k, t in trajectories.items() if t.talks_letters}
    assert stats["skipped_talks_letters"] == len(talkers) > 10
    for role in ROLES:
        for var in out[role][len(scienceqa[role]) :]:
            assert question_key(originals[var.source.rsplit(" [", 1)[0]].input) not in talkers


def test_gold_letter_agrees_with_the_raw_trajectories(scienceqa) -> None:
    trajectories = describe_trajectories([r for recs in scienceqa.values() for r in recs])
    with gzip.open(ROOT / "data/trajectories/raw/70b_scienceqa_200.jsonl.gz", "rt", encoding="utf-8") as f:
        raw = [json.loads(line) for line in f]
    keys = Counter(r["question"] for r in raw)
    checked = 0
    for r in raw:
        if keys[r["question"]] > 1:  # the same question and options answered twice (two golds): ambiguous
            continue
        question, options = r["question"].split("\nOptions:")
        key = (question.strip(), options)
        if key not in trajectories:
            continue
        answer = r["answer"].strip().casefold()
        hits = [i for i, o in enumerate(trajectories[key].options) if o.strip().casefold().startswith(answer)]
        if len(hits) == 1:
            assert trajectories[key].gold == LETTERS[hits[0]], (key, r["answer"])
            checked += 1
    assert checked > 120


def test_options_round_trip_and_bad_counts() -> None:
    opts = ["Divergent boundary", "Convergent (plate) boundary", "X-ray", "Continental drift"]
    assert parse_options(format_options(opts)) == opts
    with pytest.raises(ValueError, match="lettered"):
        parse_options("(B) x (A) y")
    with pytest.raises(ValueError, match="option_variants"):
        option_count_variants({"plan": []}, [1])
    with pytest.raises(ValueError, match="option_variants"):
        RoleExampleDataModule({"plan": str(ROOT / "data/trajectories/scienceqa/plan.jsonl.gz")}, option_variants=[])
