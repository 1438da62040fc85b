"""Properties of the paired comparison (eval_suite/scoring/paired.py), each computed independently in the test.

Pinned: the bootstrap interval equals the exact percentile interval of the resampled mean (enumerated by hand) at
levels other than 0.95, is reproducible and its defaults are ``n_boot=10_000, seed=0``; the per-question
differences pair (question, run) keys with unequal run counts; the reported mean is a mean of per-question means
(not a pooled mean over pairs) and its spread the sample standard deviation over questions; ``oof`` is a score; and
validity counts only answered episodes, with its invalid examples counted, ordered and capped.
"""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval_suite.scoring.paired import (
    bootstrap_mean_interval,
    paired_difference,
    per_question_differences,
    score_of,
    valid_letter,
    validity,
)


def _rec(row: str, qid: str, run: int, **scores) -> dict:
    return {"row": row, "qid": qid, "run": run, "oof": False, **scores}


# ------------------------------------------------------------------------------------------ bootstrap


def _exact_quantiles(values: list[float], level: float) -> tuple[float, float]:
    """Percentiles of the mean over every equally likely resample (the limit of the bootstrap): the smallest mean
    whose cumulative probability reaches ``(1 - level) / 2``, and likewise for ``(1 + level) / 2``."""
    means = np.array([np.mean(c) for c in itertools.product(values, repeat=len(values))])
    support, counts = np.unique(means, return_counts=True)
    cdf = np.cumsum(counts) / counts.sum()
    a = (1 - level) / 2
    return float(support[np.searchsorted(cdf, a)]), float(support[np.searchsorted(cdf, 1 - a)])


def test_bootstrap_interval_converges_to_exact_percentiles_at_level_080() -> None:
    values = [0.0, 1.0, 3.0, 7.0]  # 256 equally likely resamples; percentiles 10% and 90% are 1.0 and 4.5
    lo_exact, hi_exact = _exact_quantiles(values, 0.8)
    assert (lo_exact, hi_exact) == (1.0, 4.5)
    mean, low, high = bootstrap_mean_interval(values, n_boot=40_000, seed=5, level=0.8)
    assert mean == pytest.approx(2.75)
    assert low == pytest.approx(lo_exact) and high == pytest.approx(hi_exact)


def test_bootstrap_level_half_quantiles_are_the_quartiles_of_the_resampled_means() -> None:
    # values 0 and 1: each resample mean is Binomial(4, 1/2)/4; its quartiles are 0.25 and 0.75 (linear quantiles of
    # the bootstrap means); alpha = (1 - level) / 3 instead would ask for the 1/6 and 5/6 quantiles: 0.25 and 0.75 too,
    # so use level 0.2 where the quantiles 0.4, 0.6 -> 0.5, 0.5 and the wrong ones 0.267, 0.733 -> 0.25, 0.75
    values = [0.0, 1.0, 0.0, 1.0]
    _, low, high = bootstrap_mean_interval(values, n_boot=20_000, seed=2, level=0.2)
    assert low == pytest.approx(0.5) and high == pytest.approx(0.5)
    lo_exact, hi_exact = _exact_quantiles(values, 0.2)
    assert (lo_exact, hi_exact) == pytest.approx((0.5, 0.5))


def test_bootstrap_resamples_every_value_including_the_first() -> None:
    # the first value is the smallest: a resampler that never drew index 0 would never reach the minimum
    values = [-10.0, 1.0, 2.0]
    _, low, _ = bootstrap_mean_interval(values, n_boot=5000, seed=0, level=0.99)
    assert low == pytest.approx(-10.0)  # all three draws the first value: probability 1/27 > 0.5%
    # one value: the only resample is itself
    assert bootstrap_mean_interval([0.7]) == pytest.approx((0.7, 0.7, 0.7))


def test_bootstrap_defaults_are_10000_resamples_and_seed_0() -> None:
    values = np.random.default_rng(11).normal(size=25).tolist()  # continuous: every resample count moves a quantile
    default = bootstrap_mean_interval(values)
    assert default == bootstrap_mean_interval(values, n_boot=10_000, seed=0, level=0.95)
    assert default != bootstrap_mean_interval(values, n_boot=10_001, seed=0, level=0.95)
    assert default != bootstrap_mean_interval(values, n_boot=10_000, seed=1, level=0.95)
    assert bootstrap_mean_interval(values) == default  # reproducible without a seed argument


@given(st.lists(st.integers(-5, 5), min_size=2, max_size=6), st.integers(0, 3))
@settings(max_examples=15, deadline=None)
def test_bootstrap_interval_brackets_mean_and_lies_within_range(values: list[int], seed: int) -> None:
    mean, low, high = bootstrap_mean_interval(values, n_boot=400, seed=seed, level=0.9)
    assert mean == pytest.approx(sum(values) / len(values))
    assert min(values) - 1e-12 <= low <= high <= max(values) + 1e-12


def test_bootstrap_mean_is_computed_in_double_precision() -> None:
    # float32 input: 1e8 + 1 is 1e8 in single precision, so a float32 mean would be 0, not 1/3
    values = np.array([1e8, 1.0, -1e8], dtype=np.float32)
    mean, _, _ = bootstrap_mean_interval(values, n_boot=10)
    assert mean == pytest.approx(1 / 3)


def test_bootstrap_of_nothing_raises() -> None:
    with pytest.raises(ValueError, match="^bootstrap of no values$"):
        bootstrap_mean_interval([])


# --------------------------------------------------------------------------------------- paired pieces


def test_score_of_reads_oof_flag_and_named_fields() -> None:
    assert score_of({"oof": True, "em": 0.0}, "oof") == 1.0
    assert score_of({"oof": False}, "oof") == 0.0
    assert score_of({}, "oof") == 0.0  # a record without the flag answered
    assert score_of({"f1": 0.25}, "f1") == 0.25
    with pytest.raises(KeyError, match=r"episode record 'q7' has no score field 'em'"):
        score_of({"qid": "q7", "f1": 1.0}, "em")


def test_paired_difference_of_oof_counts_runs_that_did_not_answer() -> None:
    recs = [
        {"row": "x", "qid": "a", "run": 0, "oof": True},
        {"row": "ref", "qid": "a", "run": 0, "oof": False},
        {"row": "x", "qid": "b", "run": 0, "oof": False},
        {"row": "ref", "qid": "b", "run": 0},
    ]
    assert per_question_differences(recs, "x", "ref", "oof") == {"a": [1.0], "b": [0.0]}
    assert paired_difference(recs, "x", "ref", "oof", n_boot=50)["mean"] == pytest.approx(0.5)


def test_paired_mean_is_mean_of_question_means_not_pooled_over_pairs() -> None:
    # q1 has three paired runs (diffs 1, 1, 1), q2 one (diff 0), q3 two (diffs -1, 0): question means 1, 0, -0.5
    recs = []
    for run, (x, r) in enumerate([(1, 0), (1, 0), (1, 0)]):
        recs += [_rec("x", "q1", run, em=x), _rec("ref", "q1", run, em=r)]
    recs += [_rec("x", "q2", 4, em=0.5), _rec("ref", "q2", 4, em=0.5)]
    recs += [_rec("x", "q3", 0, em=0), _rec("ref", "q3", 0, em=1), _rec("x", "q3", 1, em=0), _rec("ref", "q3", 1, em=0)]
    out = paired_difference(recs, "x", "ref", "em", n_boot=200, seed=3)
    per_q = [1.0, 0.0, -0.5]
    assert out["mean"] == pytest.approx(sum(per_q) / 3)  # pooled over the 6 pairs would be 2/6
    assert out["questions"] == 3 and out["pairs"] == 6
    assert out["std_over_questions"] == pytest.approx(statistics.stdev(per_q))
    assert set(out) == {"mean", "ci95", "questions", "pairs", "std_over_questions"}


@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=1, max_size=6), st.integers(0, 2))
@settings(max_examples=20, deadline=None)
def test_paired_summary_matches_reference_over_question_means(diffs: list[float], seed: int) -> None:
    recs = []
    for i, d in enumerate(diffs):
        recs += [_rec("x", f"q{i:02d}", 0, f1=d), _rec("ref", f"q{i:02d}", 0, f1=0.0)]
    out = paired_difference(recs, "x", "ref", "f1", n_boot=300, seed=seed)
    assert out["mean"] == pytest.approx(sum(diffs) / len(diffs))
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    assert out["std_over_questions"] == pytest.approx(sd, abs=1e-12)
    assert out["ci95"] == list(bootstrap_mean_interval(diffs, n_boot=300, seed=seed)[1:])


def test_paired_std_of_two_questions_and_of_one() -> None:
    recs = [_rec("x", "a", 0, em=1), _rec("ref", "a", 0, em=0), _rec("x", "b", 0, em=0), _rec("ref", "b", 0, em=0)]
    two = paired_difference(recs, "x", "ref", "em", n_boot=20)
    assert two["std_over_questions"] == pytest.approx(math.sqrt(0.5))  # values 1, 0: ((0.5)^2 * 2) / 1
    one = paired_difference(recs[:2], "x", "ref", "em", n_boot=20)
    assert one["std_over_questions"] == 0.0 and one["questions"] == 1


def test_paired_difference_defaults_are_10000_resamples_and_seed_0() -> None:
    recs = []
    per_q = np.random.default_rng(12).uniform(-1, 1, size=20).tolist()
    for i, d in enumerate(per_q):
        recs += [_rec("x", f"q{i:02d}", 0, f1=d), _rec("ref", f"q{i:02d}", 0, f1=0.0)]
    default = paired_difference(recs, "x", "ref", "f1")
    _, low, high = bootstrap_mean_interval(per_q, n_boot=10_000, seed=0)
    assert default["ci95"] == pytest.approx([low, high], abs=1e-12)
    assert default == paired_difference(recs, "x", "ref", "f1", n_boot=10_000, seed=0)
    assert default["ci95"] != paired_difference(recs, "x", "ref", "f1", n_boot=10_001, seed=0)["ci95"]
    assert default["ci95"] != paired_difference(recs, "x", "ref", "f1", n_boot=10_000, seed=1)["ci95"]
    # the arguments are passed on: a different seed or count moves the interval
    assert paired_difference(recs, "x", "ref", "f1", n_boot=300, seed=4)["ci95"] == pytest.approx(
        list(bootstrap_mean_interval(per_q, n_boot=300, seed=4)[1:])
    )


def test_pairs_are_matched_by_run_and_a_duplicate_keeps_the_last_record() -> None:
    recs = [
        _rec("x", "q", 0, em=1),
        _rec("ref", "q", 1, em=0),  # run 1 of ref has no x partner
        _rec("ref", "q", 0, em=0),
        _rec("ref", "q", 0, em=1),  # a resumed log: this one counts
        _rec("x", 7, 2, em=1),
        _rec("ref", "7", 2, em=0),  # qids compare as strings
    ]
    assert per_question_differences(recs, "x", "ref", "em") == {"q": [0.0], "7": [1.0]}
    assert per_question_differences(recs, "ref", "x", "em") == {"q": [0.0], "7": [-1.0]}


# ------------------------------------------------------------------------------------------- validity


def test_valid_letter_boundaries() -> None:
    assert valid_letter("A", 1) and not valid_letter("B", 1)
    assert valid_letter("e", 5) and not valid_letter("f", 5)
    assert not valid_letter("A", 0)
    assert not valid_letter("", 3) and not valid_letter("AB", 3)


def test_validity_skips_oof_episodes_even_with_a_prediction() -> None:
    recs = [
        {"prediction": "A", "choices": ["x", "y"], "oof": True},  # ran out of steps: not answered, whatever it says
        {"prediction": "Z", "choices": ["x", "y"], "oof": False},
        {"prediction": "B", "choices": ["x", "y"]},
        {"prediction": None, "choices": ["x", "y"], "oof": False},
    ]
    v = validity(recs)
    assert (v["answered"], v["valid"]) == (2, 1) and v["rate"] == pytest.approx(0.5)
    assert v["invalid_examples"] == [{"answer": "Z (2 options)", "count": 1}]


def test_validity_of_no_answers_has_no_rate() -> None:
    v = validity([{"prediction": None, "choices": ["x"], "oof": True}])
    assert v == {"answered": 0, "valid": 0, "rate": None, "invalid_examples": []}
    assert validity([])["rate"] is None


def test_validity_counts_orders_and_caps_invalid_examples() -> None:
    recs = [{"prediction": "A", "choices": ["x", "y"], "oof": False}]
    # inserted out of order: the listing is by count descending, ties by answer text
    invalid = {"Q": 3, "K": 2, **{f"answer {i:02d}": 1 for i in range(10)}, "D": 2, "M": 1}
    for answer, n in invalid.items():
        recs += [{"prediction": answer, "choices": ["x", "y", "z"], "oof": False}] * n
    v = validity(recs)
    assert v["answered"] == 1 + sum(invalid.values()) and v["valid"] == 1
    expected = sorted(invalid.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    assert [(e["answer"], e["count"]) for e in v["invalid_examples"]] == [(f"{a} (3 options)", n) for a, n in expected]
    assert [e["answer"][:1] for e in v["invalid_examples"][:5]] == ["Q", "D", "K", "M", "a"]
    assert len(v["invalid_examples"]) == 10


def test_validity_truncates_long_answers_to_40_characters() -> None:
    long = "x" * 50
    v = validity([{"prediction": long, "choices": ["a", "b", "c"], "oof": False}])
    assert v["invalid_examples"] == [{"answer": "x" * 40 + " (3 options)", "count": 1}]
