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


# ------------------------------------------------------------------------------------ the summary, number by number
T1 = 12.706204736172367  # Student-t 0.975 quantile, 1 degree of freedom (two runs)


def _hotpot(row: str, qid: str, level: str, run: int, pred: str | None, gold: str, em: float, f1: float, **kw) -> dict:
    rec = {
        "benchmark": "hotpotqa", "qid": qid, "level": level, "row": row, "scheme": row.split("+")[0],
        "adapters": f"ckpt/{row}", "run": run, "prediction": pred, "gold": gold, "em": em, "f1": f1,
        "oof": pred is None, "steps": 1, "num_tokens": 10, "roles": {},
    }  # fmt: skip
    rec.update(kw)
    return rec


def _rounded(obj):
    """Floats rounded to 6 decimals and NaN spelled "nan", so nested summaries compare with ``==``."""
    if isinstance(obj, float):
        return "nan" if obj != obj else round(obj, 6)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    return obj


def _cell(values: list[float]) -> dict:
    """The expected ``{"mean", "std", "runs", "ci95"}`` of per-run values (one or two runs), worked out by hand."""
    if not values:
        return {"mean": "nan", "std": "nan", "runs": 0, "ci95": None}
    mean = sum(values) / len(values)
    if len(values) == 1:
        return {"mean": mean, "std": 0.0, "runs": 1, "ci95": None}
    std = abs(values[0] - values[1]) / 2**0.5
    half = T1 * std / 2**0.5
    return _rounded({"mean": mean, "std": std, "runs": 2, "ci95": [mean - half, mean + half]})


def _hotpot_records() -> list[dict]:
    """non_shared: two runs over an easy and a medium question; base_lr_shared: one run of the easy one only."""
    ns = {"protocol": {"temperature": 0.9, "top_p": 0.75, "constraints": []}, "provenance": {"git_commit": "bbb"}}
    blr = {"protocol": {"temperature": 0.0, "top_p": 1.0, "constraints": [], "sampler": 2}}
    plan = {"calls": 2, "prefill_tokens": 40, "decode_tokens": 10, "prefill_s": 0.5, "decode_s": 0.25}
    return [
        _hotpot("non_shared", "q1", "easy", 0, "Paris", "Paris", 1.0, 1.0, num_tokens=100, steps=2,
                roles={"plan": plan}, **ns),
        # "the big cat" vs "big dog": articles dropped, one token of two in common: F1 1/2
        _hotpot("non_shared", "q2", "medium", 0, "the big cat", "big dog", 0.0, 0.5, num_tokens=300, steps=4,
                roles={"plan": {"prefill_tokens": 20}, "action": {"decode_tokens": 6}}, **ns),
        _hotpot("non_shared", "q1", "easy", 1, None, "Paris", 0.0, 0.0, num_tokens=50, steps=1, **ns),
        _hotpot("non_shared", "q2", "medium", 1, "Big Dog.", "big dog", 1.0, 1.0, num_tokens=150, steps=3,
                roles={"plan": {"prefill_tokens": 10}}, **ns),
        _hotpot("non_shared", "q2", "medium", 1, "cat", "big dog", 0.0, 0.0, **ns),  # a duplicate key: dropped
        _hotpot("base_lr_shared", "q1", "easy", 0, "paris", "Paris", 1.0, 1.0, num_tokens=80, steps=2,
                roles={"reflect": {"calls": 1, "decode_s": 0.125}}, provenance={"git_commit": "aaa"}, **blr),
    ]  # fmt: skip


def test_hotpotqa_summary_gives_em_f1_and_oof_per_level_over_runs_with_t_intervals_and_differences() -> None:
    """Exact match and F1 are scored from the predictions (not the records' own fields), per level and averaged over
    the levels a run has; each cell is mean, sample std, runs and the Student-t 95% interval over runs (None with one
    run; NaN with none); ``diff_vs_non_shared`` is the difference of the average to non_shared's; levels no record
    has are left out."""
    recs = _hotpot_records()
    for r in recs:
        r["em"] = r["f1"] = -1.0  # the summary's accuracy comes from prediction and gold
    s = summarize([*reversed(recs[:4] + recs[5:]), recs[4]])  # any order; of a duplicated key the first is kept
    assert s["benchmark"] == "hotpotqa" and s["levels"] == ["easy", "medium"] and s["metrics"] == ["em", "f1"]
    assert s["rows"] == ["non_shared", "base_lr_shared"] and s["duplicates"] == 1
    assert s["episodes"] == {"non_shared": {"0": 2, "1": 2}, "base_lr_shared": {"0": 1}}
    assert s["adapters"] == {"non_shared": "ckpt/non_shared", "base_lr_shared": "ckpt/base_lr_shared"}
    assert s["protocol"] == {
        "non_shared": {"temperature": 0.9, "top_p": 0.75, "constraints": [], "sampler": 1},
        "base_lr_shared": {"temperature": 0.0, "top_p": 1.0, "constraints": [], "sampler": 2},
    }
    assert s["episode_commits"] == ["aaa", "bbb"] and s["validity"] == {}
    recs[0]["provenance"] = {"python": "3.12"}  # provenance without a commit names none
    assert summarize(recs)["episode_commits"] == ["aaa", "bbb"]
    acc = _rounded(s["accuracy"])
    assert acc["em"] == {
        "non_shared": {"easy": _cell([1, 0]), "medium": _cell([0, 1]), "avg": _cell([0.5, 0.5]),
                       "diff_vs_non_shared": 0.0},
        "base_lr_shared": {"easy": _cell([1]), "medium": _cell([]), "avg": _cell([1]), "diff_vs_non_shared": 0.5},
    }  # fmt: skip
    assert acc["f1"] == {
        "non_shared": {"easy": _cell([1, 0]), "medium": _cell([0.5, 1]), "avg": _cell([0.75, 0.5]),
                       "diff_vs_non_shared": 0.0},
        "base_lr_shared": {"easy": _cell([1]), "medium": _cell([]), "avg": _cell([1]), "diff_vs_non_shared": 0.375},
    }  # fmt: skip
    assert _rounded(s["oof"]) == {
        "non_shared": {"easy": _cell([0, 1]), "medium": _cell([0, 0]), "avg": _cell([0, 0.5])},
        "base_lr_shared": {"easy": _cell([0]), "medium": _cell([]), "avg": _cell([0])},
    }
    assert _cell([0.5, 0.5])["ci95"] == [0.5, 0.5] and _cell([1, 0])["ci95"] == [
        round(0.5 - T1 / 2, 6),
        round(0.5 + T1 / 2, 6),
    ]


def test_hotpotqa_summary_pairs_each_row_with_non_shared_on_em_f1_and_oof() -> None:
    recs = _hotpot_records()
    blr_q2 = _hotpot("base_lr_shared", "q2", "medium", 1, None, "big dog", 0.0, 0.0, protocol=recs[-1]["protocol"])
    recs.append(blr_q2)  # q2 run 1: non_shared 1, base_lr_shared 0 (and OOF)
    s = summarize(recs)
    one_pair = {"mean": 0.0, "ci95": [0.0, 0.0], "questions": 1, "pairs": 1, "std_over_questions": 0.0}
    both = {"questions": 2, "pairs": 2}
    paired = _rounded(s["paired_vs_non_shared"])
    assert set(paired) == {"em", "f1", "oof"}
    assert paired["em"] == {"base_lr_shared": {"mean": -0.5, "ci95": [-1.0, 0.0], **both,
                                               "std_over_questions": round(0.5**0.5, 6)}}  # fmt: skip
    assert paired["f1"] == paired["em"]
    assert paired["oof"] == {"base_lr_shared": {"mean": 0.5, "ci95": [0.0, 1.0], **both,
                                                "std_over_questions": round(0.5**0.5, 6)}}  # fmt: skip
    only_q1 = summarize(_hotpot_records())["paired_vs_non_shared"]
    assert only_q1 == {m: {"base_lr_shared": one_pair} for m in ("em", "f1", "oof")}


def test_hotpotqa_summary_costs_are_per_question_means_per_run_then_over_runs() -> None:
    """Sequence length, steps and each role's calls, tokens and seconds: the mean over a run's questions (a role or
    field a record lacks counts 0), then mean, sample std and run count over runs."""
    from eval_suite.evaluate.episode_log import ROLE_FIELDS
    from lragent.agents.loop import ROLES

    eff = summarize(_hotpot_records())["efficiency"]

    def expect(**over: list[float]) -> dict:
        out = {}
        for k in ["num_tokens", "steps", *[f"{r}.{f}" for r in ROLES for f in ROLE_FIELDS]]:
            v = over.get(k.replace(".", "_"), [0.0] * len(next(iter(over.values()))))
            mean = sum(v) / len(v)
            std = abs(v[0] - v[1]) / 2**0.5 if len(v) == 2 else 0.0
            out[k] = {"mean": mean, "std": std, "runs": float(len(v))}
        return _rounded(out)

    assert _rounded(eff["non_shared"]) == expect(
        num_tokens=[200, 100], steps=[3, 2], plan_calls=[1, 0], plan_prefill_tokens=[30, 5], plan_decode_tokens=[5, 0],
        plan_prefill_s=[0.25, 0], plan_decode_s=[0.125, 0], action_decode_tokens=[3, 0],
    )  # fmt: skip
    assert _rounded(eff["base_lr_shared"]) == expect(num_tokens=[80], steps=[2], reflect_calls=[1],
                                                     reflect_decode_s=[0.125])  # fmt: skip


def _sq(row: str, qid: str, pred: str | None, run: int = 0, oof: bool | None = None, **kw) -> dict:
    rec = _episode(row, qid, run, pred, 0, 2)
    rec.update(adapters=f"ckpt/{row.split('+')[0]}", oof=pred is None if oof is None else oof, **kw)
    return rec


def test_constrained_rows_compare_with_non_shared_of_the_same_protocol_and_rows_without_one_get_none() -> None:
    """``base_lr_shared+constrained`` is compared (average and pairs) with ``non_shared+constrained``, not the
    unconstrained ``non_shared``; a row whose own non_shared variant is missing gets no difference and no pairs;
    a non_shared row is never paired with itself."""
    recs = [
        _sq("non_shared", "q1", "A"), _sq("non_shared", "q2", "A"),  # 100%
        _sq("non_shared+constrained", "q1", "A"), _sq("non_shared+constrained", "q2", "B"),  # 50%
        _sq("base_lr_shared+constrained", "q1", "B"), _sq("base_lr_shared+constrained", "q2", "B"),  # 0%
        _sq("untrained+constrained:answer", "q1", "A"), _sq("untrained+constrained:answer", "q2", "B"),  # 50%
    ]  # fmt: skip
    s = summarize(recs)
    assert s["rows"] == ["untrained+constrained:answer", "non_shared", "non_shared+constrained",
                         "base_lr_shared+constrained"]  # fmt: skip
    diffs = {row: cell["diff_vs_non_shared"] for row, cell in s["accuracy"]["accuracy"].items()}
    assert diffs == {"untrained+constrained:answer": None, "non_shared": 0.0, "non_shared+constrained": 0.0,
                     "base_lr_shared+constrained": -0.5}  # fmt: skip
    paired = s["paired_vs_non_shared"]
    # q1: 0 - 1, q2: 0 - 0; the resampled means of two questions are -1, -0.5, 0 (1/4, 1/2, 1/4): the extremes
    assert paired["accuracy"] == {
        "base_lr_shared+constrained": {
            "mean": -0.5,
            "ci95": [-1.0, 0.0],
            "questions": 2,
            "pairs": 2,
            "std_over_questions": 0.5**0.5,
        }
    }
    zero = {"mean": 0.0, "ci95": [0.0, 0.0], "questions": 2, "pairs": 2, "std_over_questions": 0.0}
    assert paired["oof"] == {"base_lr_shared+constrained": zero}
    assert set(s["validity"]) == set(s["rows"])  # ScienceQA: answer validity per row


def test_the_oof_rate_reads_each_records_oof_flag_not_its_prediction() -> None:
    """An episode recorded as OOF counts as OOF even where a prediction was kept; one recorded as answered counts as
    answered even without a prediction."""
    recs = [_sq("non_shared", "q1", "A", oof=True), _sq("non_shared", "q2", None, oof=False),
            _sq("non_shared", "q3", "B", oof=True), _sq("non_shared", "q4", "B", oof=False)]  # fmt: skip
    cell = summarize(recs)["oof"]["non_shared"]
    assert cell["1-4"]["mean"] == 0.5 and cell["avg"]["mean"] == 0.5 and cell["1-4"]["runs"] == 1


def test_protocol_of_reads_the_records_decoding_settings_with_defaults_for_what_is_missing() -> None:
    from eval_suite.evaluate.eval_report import protocol_of

    full = {"temperature": 0.7, "top_p": 0.9, "constraints": ("answer_text",), "sampler": 2, "answer_score": "mean"}
    assert protocol_of({"protocol": full}) == {"temperature": 0.7, "top_p": 0.9, "constraints": ["answer_text"],
                                               "sampler": 2, "answer_score": "mean"}  # fmt: skip
    # nothing recorded: no temperature or top-p, no constraints, sampler 1 (before versions); no answer_score key
    assert protocol_of({}) == {"temperature": None, "top_p": None, "constraints": [], "sampler": 1}
    assert protocol_of({"protocol": None}) == protocol_of({"protocol": {"constraints": None, "answer_score": None}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"adapters": "ckpt/other"},
            r"^row 'non_shared' mixes results of different adapters \['ckpt/non_shared', "
            r"'ckpt/other'\]: merge them separately$",
        ),
        (
            {"protocol": {"temperature": 0.0}},
            r"^row 'non_shared' mixes decoding protocols \[.*'temperature': 0\.0.*"
            r"'temperature': 0\.9.*\]: merge them separately$",
        ),
        ({"benchmark": "scienceqa"}, r"^records of several benchmarks \['hotpotqa', 'scienceqa'\]"),
    ],
)
def test_a_summary_refuses_a_row_that_mixes_adapters_or_protocols_naming_the_row_and_both(change, message) -> None:
    recs = _hotpot_records()
    recs[2] = {**recs[2], **change}  # non_shared, run 1
    with pytest.raises(ValueError, match=message):
        summarize(recs)


def test_a_summary_of_no_records_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="^no episode records to summarise$"):
        summarize([])


# ------------------------------------------------------------------------------------------ the Markdown report
def _c(mean: float, std: float = 0.0, runs: int = 1, ci: list[float] | None = None) -> dict:
    return {"mean": mean, "std": std, "runs": runs, "ci95": ci}


def _eff(tokens: dict, steps: dict, **role_means: float) -> dict:
    """An efficiency row: sequence length and steps cells, and every role field's mean (0 unless given)."""
    out = {"num_tokens": tokens, "steps": steps}
    for role in ("plan", "action", "reflect"):
        for k in ("prefill_tokens", "prefill_s", "decode_tokens", "decode_s"):
            out[f"{role}.{k}"] = {"mean": role_means.get(f"{role}_{k}", 0.0), "std": 0.0, "runs": 1.0}
    return out


def _scienceqa_summary() -> dict:
    nan = float("nan")
    rows = ["untrained", "non_shared", "base_lr_shared", "base_lr_shared+answer_text"]
    return {
        "benchmark": "scienceqa",
        "levels": ["1-4", "9-12"],
        "rows": rows,
        "metrics": ["accuracy"],
        "adapters": {"untrained": "zero", "non_shared": "runs/ns", "base_lr_shared": "runs/blr",
                     "base_lr_shared+answer_text": "runs/blr"},
        "protocol": {  # untrained: not recorded
            "non_shared": {"temperature": 0.9, "top_p": 0.75, "constraints": [], "sampler": 2},
            "base_lr_shared": {"temperature": 0.0, "top_p": 1.0, "constraints": ["action_type", "answer"]},
            "base_lr_shared+answer_text": {"temperature": 1.5, "constraints": ["answer_text"], "answer_score": "mean"},
        },
        "episodes": {"untrained": {"0": 3}, "non_shared": {"0": 3, "1": 2}, "base_lr_shared": {"0": 4},
                     "base_lr_shared+answer_text": {"0": 2, "1": 2, "2": 2}},
        "accuracy": {"accuracy": {
            "untrained": {"1-4": _c(0.25), "9-12": _c(nan, nan, 0), "avg": _c(0.25), "diff_vs_non_shared": -0.5},
            "non_shared": {"1-4": _c(0.8, 0.1, 2, [0.2, 1.4]), "9-12": _c(0.7, 0.05, 2, [0.25, 1.15]),
                           "avg": _c(0.75, 0.0707, 2, [0.1234, 1.3766]), "diff_vs_non_shared": 0.0},
            "base_lr_shared": {"1-4": _c(0.5), "9-12": _c(0.625), "avg": _c(0.5625), "diff_vs_non_shared": -0.1875},
            "base_lr_shared+answer_text": {"1-4": _c(0.4, 0.3, 3, [0.1, 0.7]), "9-12": _c(0.6, 0.2, 3, [0.3, 0.9]),
                                           "avg": _c(0.5, 0.25, 3, [0.2, 0.8]), "diff_vs_non_shared": None},
        }},
        "oof": {
            "untrained": {"1-4": _c(0.5), "9-12": _c(nan, nan, 0), "avg": _c(0.5)},
            "non_shared": {"1-4": _c(0.1, 0.02, 2), "9-12": _c(0.0, 0.0, 2), "avg": _c(0.05, 0.01, 2)},
            "base_lr_shared": {"1-4": _c(0.25), "9-12": _c(0.125), "avg": _c(0.1875)},
            "base_lr_shared+answer_text": {"1-4": _c(0.0, 0.0, 3), "9-12": _c(0.3, 0.1, 3), "avg": _c(0.15, 0.05, 3)},
        },
        "paired_vs_non_shared": {
            "accuracy": {
                "base_lr_shared": {"mean": -0.125, "ci95": [-0.25, 0.3], "questions": 4, "pairs": 8},
                "base_lr_shared+answer_text": {"mean": 0.1, "ci95": [0.05, 0.15], "questions": 2, "pairs": 6},
            },
            "oof": {"base_lr_shared": {"mean": 0.02, "ci95": [-0.14, 0.33], "questions": 4, "pairs": 8}},
        },
        "validity": {
            "untrained": {"answered": 3, "valid": 1, "rate": 1 / 3, "invalid_examples": [
                {"answer": "E (2 options)", "count": 3}, {"answer": "Z (2 options)", "count": 2},
                {"answer": "maybe (2 options)", "count": 1}, {"answer": "C (2 options)", "count": 1},
                {"answer": "D (2 options)", "count": 1}]},
            "non_shared": {"answered": 0, "valid": 0, "rate": None, "invalid_examples": []},
            "base_lr_shared": {"answered": 4, "valid": 4, "rate": 1.0, "invalid_examples": []},
            "base_lr_shared+answer_text": {"answered": 6, "valid": 5, "rate": 5 / 6,
                                           "invalid_examples": [{"answer": "F (3 options)", "count": 1}]},
        },
        "efficiency": {
            "untrained": _eff(_c(256.0), _c(2.0)),
            "non_shared": _eff(_c(512.34, 10.52, 2), _c(3.456, 0.5, 2), plan_prefill_tokens=120.4,
                               plan_prefill_s=0.12345, plan_decode_tokens=30.6, plan_decode_s=0.98765,
                               action_prefill_tokens=7.0, reflect_decode_s=2.5),
            "base_lr_shared": _eff(_c(300.06), _c(2.25)),
            "base_lr_shared+answer_text": _eff(_c(280.0, 4.44, 3), _c(2.0, 0.125, 3), action_decode_tokens=3.5),
        },
    }  # fmt: skip


SCIENCEQA_REPORT = """\
# scienceqa evaluation
Mean ± std over runs, in % (the value alone for one run); 95% CI: Student-t interval of the mean over runs (– with \
one run). Each row is one protocol:

| Row | Adapters | Decoding | Episodes | Runs |
| :--- | :--- | :--- | ---: | ---: |
| untrained | zero | not recorded; constraints: none | 3 | 1 |
| non_shared | runs/ns | sampling T=0.9, top-p=0.75; constraints: none | 5 | 2 |
| base_lr_shared | runs/blr | greedy; constraints: action_type, answer | 4 | 1 |
| base_lr_shared+answer_text | runs/blr | sampling T=1.5, top-p=1; constraints: answer_text (option texts by mean \
log-prob) | 6 | 3 |

## Accuracy (accuracy), Table 3 layout

| Scheme | Grade 1-4 | Grade 9-12 | Avg | Avg 95% CI | Δ vs non_shared |
| :--- | ---: | ---: | ---: | ---: | ---: |
| untrained | 25.0 | – | 25.0 | – | -50.0 |
| non_shared | 80.0 ± 10.0 | 70.0 ± 5.0 | 75.0 ± 7.1 | [12.3, 137.7] | +0.0 |
| base_lr_shared | 50.0 | 62.5 | 56.2 | – | -18.8 |
| base_lr_shared+answer_text | 40.0 ± 30.0 | 60.0 ± 20.0 | 50.0 ± 25.0 | [20.0, 80.0] | – |

## Paired difference to non_shared

Per question: the mean over the runs both rows have of (row − non_shared); the mean over questions, in points, and \
its 95% bootstrap interval over questions (10,000 resamples). An interval that contains 0 is no measured difference.

| Scheme | Δ accuracy [95% CI] | Δ OOF [95% CI] | Pairs |
| :--- | ---: | ---: | ---: |
| base_lr_shared | -12.5 [-25.0, +30.0] | +2.0 [-14.0, +33.0] | 8 |
| base_lr_shared+answer_text | +10.0 [+5.0, +15.0] | – | 6 |

## Answer validity

Share of the answered episodes (not OOF) whose answer is a lone letter of one of the question's own options.

| Scheme | Answered | Valid | Valid % | Most frequent invalid |
| :--- | ---: | ---: | ---: | ---: |
| untrained | 3 | 1 | 33.3% | E (2 options) ×3; Z (2 options) ×2; maybe (2 options) ×1; C (2 options) ×1 |
| non_shared | 0 | 0 | – | – |
| base_lr_shared | 4 | 4 | 100.0% | – |
| base_lr_shared+answer_text | 6 | 5 | 83.3% | F (3 options) ×1 |

## Out-of-function rate, Table 16 layout

| Scheme | Grade 1-4 | Grade 9-12 | Avg |
| :--- | ---: | ---: | ---: |
| untrained | 50.0 | – | 50.0 |
| non_shared | 10.0 ± 2.0 | 0.0 ± 0.0 | 5.0 ± 1.0 |
| base_lr_shared | 25.0 | 12.5 | 18.8 |
| base_lr_shared+answer_text | 0.0 ± 0.0 | 30.0 ± 10.0 | 15.0 ± 5.0 |

## Per question: sequence length and steps, Table 15 layout

| Scheme | Sequence length (tokens) | Cycles |
| :--- | ---: | ---: |
| untrained | 256.0 | 2.00 |
| non_shared | 512.3 ± 10.5 | 3.46 ± 0.50 |
| base_lr_shared | 300.1 | 2.25 |
| base_lr_shared+answer_text | 280.0 ± 4.4 | 2.00 ± 0.12 |

## Per question and role: prefill / decode (mean over runs)

| Scheme | plan prefill tok | plan prefill s | plan decode tok | plan decode s | action prefill tok | \
action prefill s | action decode tok | action decode s | reflect prefill tok | reflect prefill s | \
reflect decode tok | reflect decode s |
| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| untrained | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 |
| non_shared | 120 | 0.123 | 31 | 0.988 | 7 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 2.500 |
| base_lr_shared | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 |
| base_lr_shared+answer_text | 0 | 0.000 | 0 | 0.000 | 0 | 0.000 | 4 | 0.000 | 0 | 0.000 | 0 | 0.000 |
"""


def test_the_scienceqa_report_renders_every_table_exactly() -> None:
    """Rows with their adapters, decoding (not recorded / greedy / sampling, top-p 1 when not given; constraints, the
    option-text score), episodes and runs; accuracy and OOF per grade band in % (mean ± std over several runs, the
    value alone for one, – for a band a row did not run), the average's 95% interval and difference (– when there is
    none); paired differences (rows without any pair left out, a missing cell –); answer validity with the four most
    frequent invalid answers; sequence length (1 decimal) and cycles (2 decimals); per-role costs (tokens whole,
    seconds to the millisecond)."""
    assert render_markdown(_scienceqa_summary()) == SCIENCEQA_REPORT


def test_the_hotpotqa_report_names_levels_and_renders_an_older_summary_without_protocols_or_pairs() -> None:
    """HotpotQA columns are the capitalised level names; a summary written before protocols, validity and OOF pairs
    were recorded still renders: decoding "not recorded", no validity section, – where a pair is missing."""
    s = _scienceqa_summary()
    s.update(benchmark="hotpotqa", levels=["1-4", "9-12"], metrics=["em"])
    s["accuracy"] = {"em": s["accuracy"]["accuracy"]}
    s["paired_vs_non_shared"] = {"em": {"non_shared": {"mean": 0.5, "ci95": [0.25, 0.75], "pairs": 3}}}
    for k in ("protocol", "validity"):
        del s[k]
    md = render_markdown(s)
    assert md.startswith("# hotpotqa evaluation\n")
    assert "| untrained | zero | not recorded; constraints: none | 3 | 1 |\n" in md
    assert "| non_shared | runs/ns | not recorded; constraints: none | 5 | 2 |\n" in md
    assert "\n## Accuracy (exact match), Table 3 layout\n\n| Scheme | 1-4 | 9-12 | Avg | Avg 95% CI |" in md
    paired = "| Scheme | Δ exact match [95% CI] | Δ OOF [95% CI] | Pairs |\n| :--- | ---: | ---: | ---: |\n"
    assert paired + "| non_shared | +50.0 [+25.0, +75.0] | – | 3 |\n\n## Out-of-function rate" in md  # no OOF pairs
    assert "Answer validity" not in md
    s.update(levels=["easy", "hard"], paired_vs_non_shared={})
    for table in (s["accuracy"]["em"], s["oof"]):
        for cells in table.values():
            cells["easy"], cells["hard"] = cells.pop("1-4"), cells.pop("9-12")
    md = render_markdown(s)
    assert "| Scheme | Easy | Hard | Avg | Avg 95% CI | Δ vs non_shared |\n" in md
    assert "| Scheme | Easy | Hard | Avg |\n" in md and "Paired difference" not in md


# ------------------------------------------------------------------------------------------ files on disk
_PROV = {"device": {"name": "cpu", "type": "cpu"}, "git_commit": "abc123", "utc": "2026-01-02T03:04:05",
         "versions": {"torch": "2.4"}, "command": "lragent eval --merge a b", "dtype": None}  # fmt: skip


def test_write_summary_leaves_summary_json_with_provenance_and_report_md_with_its_footer(tmp_path) -> None:
    """A merge's provenance has no dtype: it takes the episodes' dtypes (sorted, joined); the caller's provenance is
    left as it was; the returned summary has no provenance; the folder is made, parents included, and may exist."""
    import json

    from eval_suite.evaluate.eval_report import write_summary

    recs = _hotpot_records()
    recs[0]["provenance"] = {"git_commit": "bbb", "dtype": "float32"}
    recs[-1]["provenance"] = {"git_commit": "aaa", "dtype": "bfloat16"}
    out = tmp_path / "merged" / "hotpotqa"
    summary = write_summary(iter(recs), out, _PROV)
    assert "provenance" not in summary and _PROV["dtype"] is None
    assert _rounded(summary) == _rounded(summarize(recs))
    saved = json.loads((out / "summary.json").read_text())
    assert saved.pop("provenance") == {**_PROV, "dtype": "bfloat16, float32"}
    assert _rounded(saved) == _rounded(summary)
    report = (out / "report.md").read_text()
    assert report.startswith(render_markdown(summary) + "\n---\nProduced on cpu (cpu), dtype bfloat16, float32, ")
    assert report.endswith("commit abc123, 2026-01-02T03:04:05; torch 2.4.  \nCommand: `lragent eval --merge a b`\n")
    # a process that knows its dtype keeps it; episodes without one leave it unknown
    write_summary(recs, out, {**_PROV, "dtype": "float16"})
    assert json.loads((out / "summary.json").read_text())["provenance"]["dtype"] == "float16"
    for r in recs:
        r.pop("provenance", None)
    write_summary(recs, out, _PROV)
    assert json.loads((out / "summary.json").read_text())["provenance"]["dtype"] is None
    assert ", dtype n/a, " in (out / "report.md").read_text()


def test_merge_dirs_summarises_the_episodes_of_every_folder_and_names_one_without_them(tmp_path) -> None:
    import json

    from eval_suite.evaluate.eval_report import merge_dirs

    recs = _hotpot_records()
    shards = [tmp_path / "shard_0", tmp_path / "shard_1"]
    for d, part in zip(shards, (recs[:3], recs[3:]), strict=True):
        d.mkdir()
        (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    out = tmp_path / "out" / "merged"
    summary = merge_dirs(shards, out, {**_PROV, "dtype": "float32"})
    assert _rounded(summary) == _rounded(summarize(recs)) and summary["duplicates"] == 1
    assert summary["episodes"] == {"non_shared": {"0": 2, "1": 2}, "base_lr_shared": {"0": 1}}
    assert json.loads((out / "summary.json").read_text())["provenance"]["dtype"] == "float32"
    assert (out / "report.md").read_text().startswith(render_markdown(summary))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"^--merge {empty}: no episodes.jsonl there$"):
        merge_dirs([shards[0], empty], tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_sampling_protocol_without_its_top_p_is_rendered_with_the_policies_default() -> None:
    """A record whose protocol holds ``top_p: None`` (a caller that gave none: the policies sample without a nucleus
    cut) renders as top-p 1, as one without the key does, instead of failing to format None."""
    from eval_suite.evaluate.eval_report import _fmt_protocol

    assert _fmt_protocol({"temperature": 0.9, "top_p": None}) == "sampling T=0.9, top-p=1; constraints: none"
    assert _fmt_protocol({"temperature": 0.9}) == "sampling T=0.9, top-p=1; constraints: none"
    assert _fmt_protocol({"temperature": 0.9, "top_p": 0.75}) == "sampling T=0.9, top-p=0.75; constraints: none"
    assert _fmt_protocol({"temperature": 0.0, "top_p": None}) == "greedy; constraints: none"
