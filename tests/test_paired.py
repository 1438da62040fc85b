"""Paired differences between evaluation rows (bootstrap over questions) and ScienceQA answer validity."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from eval_suite.evaluate.eval_report import render_markdown, summarize
from eval_suite.scoring.paired import (
    bootstrap_mean_interval,
    paired_difference,
    per_question_differences,
    valid_letter,
    validity,
)


def _rec(row: str, qid: str, run: int, correct: float, **kw) -> dict:
    return {"row": row, "qid": qid, "run": run, "correct": correct, "oof": False, **kw}


def test_paired_difference_by_hand() -> None:
    # q1: runs 0,1 -> (1-0) and (1-1) -> mean 0.5; q2: (0-1), (0-1) -> -1; q3: only run 0 in both -> (1-0) = 1
    recs = [
        _rec("x", "q1", 0, 1), _rec("x", "q1", 1, 1), _rec("ref", "q1", 0, 0), _rec("ref", "q1", 1, 1),
        _rec("x", "q2", 0, 0), _rec("x", "q2", 1, 0), _rec("ref", "q2", 0, 1), _rec("ref", "q2", 1, 1),
        _rec("x", "q3", 0, 1), _rec("x", "q3", 1, 1), _rec("ref", "q3", 0, 0),  # ref lacks run 1 of q3
        _rec("ref", "q4", 0, 1),  # x never answered q4: not a pair
        _rec("other", "q1", 0, 1),
    ]  # fmt: skip
    random.Random(0).shuffle(recs)
    assert per_question_differences(recs, "x", "ref", "correct") == {"q1": [1.0, 0.0], "q2": [-1.0, -1.0], "q3": [1.0]}
    out = paired_difference(recs, "x", "ref", "correct")
    assert out["mean"] == pytest.approx((0.5 - 1.0 + 1.0) / 3)
    assert out["questions"] == 3 and out["pairs"] == 5
    # three questions: each resample's mean is one of 27 equally likely values; the 2.5% and 97.5% quantiles are the
    # extremes (each has probability 1/27 > 2.5%): all three resampled questions the lowest, all the highest
    assert out["ci95"] == [pytest.approx(-1.0), pytest.approx(1.0)]
    assert paired_difference(recs, "x", "nobody", "correct") is None


def test_bootstrap_matches_exact_enumeration_and_normal_theory() -> None:
    values = [0.0, 0.25, 1.0, -0.5]
    exact = np.array([np.mean(c) for c in itertools.product(values, repeat=4)])  # all 256 equally likely resamples
    mean, low, high = bootstrap_mean_interval(values, n_boot=200_000, seed=1)
    assert mean == pytest.approx(0.1875)
    lo_exact, hi_exact = np.quantile(exact, [0.025, 0.975])
    # the Monte Carlo quantiles sit on (or next to) the exact ones: the exact distribution has steps of 1/16
    assert abs(low - lo_exact) <= 1 / 16 + 1e-9 and abs(high - hi_exact) <= 1 / 16 + 1e-9
    # many questions: half-width ~ 1.96 x the plug-in standard error of the mean
    x = np.random.default_rng(0).normal(size=400)
    m, lo, hi = bootstrap_mean_interval(x.tolist(), seed=0)
    se = x.std(ddof=0) / np.sqrt(x.size)
    assert (hi - lo) / 2 == pytest.approx(1.96 * se, rel=0.08)
    assert lo < m < hi
    # reproducible; constant differences give a zero-width interval
    assert bootstrap_mean_interval(values, seed=3) == bootstrap_mean_interval(values, seed=3)
    assert bootstrap_mean_interval([0.2] * 7) == pytest.approx((0.2, 0.2, 0.2))
    with pytest.raises(ValueError):
        bootstrap_mean_interval([])


def test_valid_letter_and_validity() -> None:
    assert valid_letter("B", 2) and valid_letter("(b)", 2) and valid_letter("Option A.", 3)
    assert not valid_letter("D", 2) and not valid_letter("C", 2)
    assert not valid_letter("Question", 4) and not valid_letter(None, 4) and not valid_letter("Both are caused", 4)
    recs = [
        {"prediction": "A", "choices": ["x", "y"], "oof": False},
        {"prediction": "D", "choices": ["x", "y"], "oof": False},
        {"prediction": "D", "choices": ["x", "y", "z", "w"], "oof": False},
        {"prediction": None, "choices": ["x", "y"], "oof": True},
    ]
    v = validity(recs)
    assert (v["answered"], v["valid"]) == (3, 2) and v["rate"] == pytest.approx(2 / 3)
    assert v["invalid_examples"] == [{"answer": "D (2 options)", "count": 1}]


def _episode(row: str, qid: str, run: int, pred: str | None, gold: int, n: int, level: str = "1-4") -> dict:
    return {
        "benchmark": "scienceqa", "qid": qid, "level": level, "row": row, "scheme": row, "adapters": "a", "run": run,
        "protocol": {"temperature": 0.9, "top_p": 0.75, "constraints": []}, "prediction": pred, "gold": gold,
        "choices": [f"c{i}" for i in range(n)], "correct": float(pred is not None and ord(pred) - 65 == gold),
        "oof": pred is None, "steps": 3, "num_tokens": 100, "roles": {},
    }  # fmt: skip


def test_summary_carries_paired_differences_and_validity() -> None:
    recs = []
    for run in range(2):
        for q in range(6):
            recs.append(_episode("non_shared", f"q{q}", run, "A", 0, 2))
            recs.append(_episode("base_lr_shared", f"q{q}", run, "A" if q < 3 else "D", 0, 2))
    s = summarize(recs)
    cell = s["paired_vs_non_shared"]["accuracy"]["base_lr_shared"]
    assert cell["mean"] == pytest.approx(-0.5) and cell["pairs"] == 12 and cell["questions"] == 6
    assert "non_shared" not in s["paired_vs_non_shared"]["accuracy"]
    assert s["validity"]["base_lr_shared"]["rate"] == pytest.approx(0.5)
    assert s["validity"]["non_shared"]["rate"] == 1.0
    md = render_markdown(s)
    assert "Paired difference to non_shared" in md and "-50.0 [" in md and "Answer validity" in md
