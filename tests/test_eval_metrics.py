"""Metrics of the agent evaluation: normalisation, EM/F1, choice parsing, OOF, grouping, repeated runs."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from eval_suite.scoring.metrics import (
    HOTPOTQA_LEVELS,
    SCIENCEQA_BANDS,
    GroupedMetric,
    HotpotQAExactMatch,
    HotpotQAF1,
    OOFRate,
    RunMeanStd,
    ScienceQAAccuracy,
    aggregate_runs,
    exact_match_score,
    f1_score,
    grade_band,
    normalize_answer,
    parse_choice,
)

BENCH = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (BENCH / name).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  An   apple, a day ", "apple day"),
        ("Bath, Maine", "bath maine"),
        ("the theatre", "theatre"),  # only whole-word articles go
        ("Anne's 'A-Team'", "annes ateam"),
        ("THE", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_exact_match_and_f1() -> None:
    assert exact_match_score("the Bath, Maine.", "Bath Maine") == 1.0
    assert exact_match_score("Bath", "Bath, Maine") == 0.0
    assert exact_match_score(None, "x") == 0.0
    # precision 3/3, recall 3/5 -> F1 0.75
    assert f1_score("Hetfield and Ulrich", "Hetfield and Ulrich, Kirk Hammett") == pytest.approx(0.75)
    assert f1_score("completely different", "Bath, Maine") == 0.0
    assert f1_score(None, "x") == 0.0


def test_yes_no_rule() -> None:
    assert f1_score("Yes.", "yes") == 1.0
    assert f1_score("yes", "no") == 0.0
    # official hotpot rule: a yes/no gold answer needs an exact (normalised) match, partial overlap scores 0
    assert f1_score("yes it is", "yes") == 0.0
    assert f1_score("no", "no way") == 0.0
    assert f1_score("noanswer", "an answer") == 0.0


def test_gold_answers_score_one_on_real_benchmark() -> None:
    answers = [r["answer"] for level in HOTPOTQA_LEVELS for r in _rows(f"hotpotqa_{level}.dev.jsonl")]
    assert len(answers) == 90
    em, f1 = HotpotQAExactMatch(), HotpotQAF1()
    em.update(answers, answers)
    f1.update(answers, answers)
    assert em.compute().item() == 1.0 and f1.compute().item() == 1.0


@pytest.mark.parametrize(
    ("pred", "expected"),
    [
        ("A", 0),  # not swallowed by article stripping
        ("a", 0),
        ("(B)", 1),
        ("[b]", 1),
        ("B.", 1),
        ("Option B", 1),
        ("(B) the Bible", 1),
        ("B) the Bible", 1),
        ("the Bible", 1),
        ("The Bible.", 1),
        ("bible", 1),  # word overlap with exactly one choice
        ("a movie", 0),
        ("It is from the Bible", 1),  # contains exactly one choice's text
        (1, 1),
        (0, 0),
        (2, None),
        ("C", None),  # letter out of range
        ("", None),
        (None, None),
        (True, None),
        ("no idea", None),
    ],
)
def test_parse_choice(pred: object, expected: int | None) -> None:
    assert parse_choice(pred, ["a movie", "the Bible"]) == expected


def test_parse_choice_on_real_scienceqa_questions() -> None:
    rows = [r for band in ("1_4", "5_8", "9_12") for r in _rows(f"scienceqa_grade{band}.dev.jsonl")]
    assert len(rows) == 90
    for r in rows:
        ans, choices = r["answer"], r["choices"]
        assert parse_choice(choices[ans], choices) == ans, (r["pid"], choices)
        assert parse_choice("ABCDE"[ans], choices) == ans
        assert parse_choice(f"({'ABCDE'[ans]})", choices) == ans
        assert parse_choice(ans, choices) == ans


def test_scienceqa_accuracy() -> None:
    acc = ScienceQAAccuracy()
    choices = [["glass", "clay"], ["Santa Fe", "Honolulu", "Hilo", "Phoenix"], ["x", "y"], ["p", "q"]]
    acc.update(["A", "Honolulu", None, "(A)"], [0, 1, 0, 1], choices)
    assert acc.compute().item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same length"):
        acc.update(["A"], [0, 1], choices[:2])


def test_oof_rate() -> None:
    oof = OOFRate()
    oof.update([None, "x", None, "y"])
    oof.update(["z"])
    assert oof.compute().item() == pytest.approx(2 / 5)
    with pytest.warns(UserWarning, match="before the ``update``"):
        assert math.isnan(OOFRate().compute().item())


def test_grade_band() -> None:
    assert [grade_band(g) for g in (1, 4, 5, 8, 9, 12)] == ["1-4", "1-4", "5-8", "5-8", "9-12", "9-12"]
    assert grade_band("grade7") == "5-8"
    with pytest.raises(ValueError):
        grade_band(13)


def test_grouped_metric_per_level_and_average() -> None:
    em = GroupedMetric(HotpotQAExactMatch(), HOTPOTQA_LEVELS)
    em.update(["easy", "easy", "hard", "hard", "hard", "hard"], ["a", "b", "c", "d", "e", "f"], list("axcdxx"))
    out = em.compute()
    assert set(out) == {"easy", "hard", "avg"}  # medium has no data and is left out of the average
    assert out["easy"].item() == pytest.approx(0.5)
    assert out["hard"].item() == pytest.approx(0.5)
    assert out["avg"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown groups"):
        em.update(["extreme"], ["a"], ["a"])
    em.reset()
    assert math.isnan(em.compute()["avg"].item())


def test_grouped_scienceqa_by_band() -> None:
    acc = GroupedMetric(ScienceQAAccuracy(), SCIENCEQA_BANDS)
    bands = [grade_band(g) for g in (3, 6, 10, 11)]
    acc.update(bands, ["A", "B", "A", "A"], [0, 0, 0, 1], [["x", "y"]] * 4)
    out = acc.compute()
    assert {k: round(v.item(), 4) for k, v in out.items()} == {"1-4": 1.0, "5-8": 0.0, "9-12": 0.5, "avg": 0.5}


def test_run_mean_std_matches_statistics() -> None:
    values = [0.31, 0.28, 0.35, 0.30, 0.29]
    m = RunMeanStd()
    for v in values:
        m.update(torch.tensor(v))
    out = m.compute()
    assert out["mean"].item() == pytest.approx(statistics.mean(values))
    assert out["std"].item() == pytest.approx(statistics.stdev(values))
    assert out["runs"].item() == 5
    one = RunMeanStd()
    one.update(0.4)
    assert one.compute()["std"].item() == 0.0
    with pytest.raises(ValueError):
        one.update(float("nan"))


def test_aggregate_runs() -> None:
    runs = [{"em": 0.2, "f1": 0.30}, {"em": 0.4, "f1": 0.50}, {"em": 0.3}]
    out = aggregate_runs(runs)
    assert out["em"]["mean"] == pytest.approx(0.3) and out["em"]["std"] == pytest.approx(0.1)
    assert out["f1"]["runs"] == 2 and out["f1"]["std"] == pytest.approx(statistics.stdev([0.3, 0.5]))


def test_student_t_quantiles_against_closed_forms():
    from statistics import NormalDist

    from eval_suite.scoring.metrics import mean_interval, student_t_cdf, student_t_quantile

    for p in (0.6, 0.9, 0.975, 0.995):
        assert student_t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)  # Cauchy
        assert student_t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
        assert student_t_quantile(p, 10**6) == pytest.approx(NormalDist().inv_cdf(p), rel=1e-5)
        assert student_t_quantile(1 - p, 3) == pytest.approx(-student_t_quantile(p, 3))
        assert student_t_cdf(student_t_quantile(p, 7), 7) == pytest.approx(p, abs=1e-12)
    lo, hi = mean_interval([0.2, 0.4, 0.3])
    half = student_t_quantile(0.975, 2) * 0.1 / math.sqrt(3)
    assert (lo, hi) == pytest.approx((0.3 - half, 0.3 + half))
    assert mean_interval([0.5]) is None
