"""Paired comparison of two evaluation rows, and the validity of ScienceQA answers.

Two rows (say ``base_lr_shared`` and ``non_shared`` of one adapter set) answer the same questions with the same
per-run seeds, so their difference is measured **paired**: for question ``q`` the difference is the mean over the runs
both rows have of ``score(row, q, run) - score(ref, q, run)``; the reported difference is the mean of those over the
questions both rows answered, and its 95% interval is the percentile interval of that mean over ``n_boot`` bootstrap
resamples of the questions (with replacement; questions, not episodes, are the independent units, since one
question's runs share its difficulty). Pairing removes the between-question variance that separate per-row intervals
carry, which is most of it.

Validity (ScienceQA): an answer is *valid* when it is a lone letter (``B``, ``(B)``, ``Option B.``) of one of the
question's own options: ``B`` is valid for two options, ``D`` is not. The validity rate is over the episodes that
answered (``Finish``), not over those that ran out of steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from eval_suite.scoring.answer_scores import _LETTER_ONLY


def valid_letter(prediction: str | None, n_choices: int) -> bool:
    """Whether ``prediction`` is a lone letter naming one of ``n_choices`` options (``A`` .. the last letter)."""
    if prediction is None:
        return False
    m = _LETTER_ONLY.match(str(prediction))
    return bool(m) and ord(m.group(1).upper()) - ord("A") < n_choices


def validity(records: Iterable[dict]) -> dict[str, Any]:
    """Validity of the answers of ScienceQA episode records (one row).

    Returns:
        ``{"answered", "valid", "rate", "invalid_examples"}``: answered episodes (not OOF), those with a valid letter,
        their share (None when none answered) and up to 10 distinct invalid answers with their counts.
    """
    answered = valid = 0
    invalid: dict[str, int] = defaultdict(int)
    for r in records:
        if r.get("oof") or r.get("prediction") is None:
            continue
        answered += 1
        if valid_letter(r["prediction"], len(r["choices"])):
            valid += 1
        else:
            invalid[f"{r['prediction']!s:.40} ({len(r['choices'])} options)"] += 1
    top = sorted(invalid.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return {
        "answered": answered,
        "valid": valid,
        "rate": valid / answered if answered else None,
        "invalid_examples": [{"answer": k, "count": v} for k, v in top],
    }


def score_of(record: dict, field: str) -> float:
    """One episode's score: a score field (``em``, ``f1``, ``correct``) or ``oof`` (1 when it did not answer)."""
    if field == "oof":
        return float(bool(record.get("oof")))
    if field not in record:
        raise KeyError(f"episode record {record.get('qid')!r} has no score field {field!r}")
    return float(record[field])


def per_question_differences(records: Iterable[dict], row: str, ref: str, field: str) -> dict[str, list[float]]:
    """``qid -> [score(row) - score(ref) for each run both rows have]`` (questions missing from either are left out).

    Records are keyed by ``(row, qid, run)``; a duplicate key keeps its last record (as resumed logs do).
    """
    scores: dict[tuple[str, str, int], float] = {}
    for r in records:
        if r["row"] in (row, ref):
            scores[(r["row"], str(r["qid"]), int(r["run"]))] = score_of(r, field)
    out: dict[str, list[float]] = defaultdict(list)
    for (rw, qid, run), value in sorted(scores.items()):
        if rw == row and (ref, qid, run) in scores:
            out[qid].append(value - scores[(ref, qid, run)])
    return dict(out)


def bootstrap_mean_interval(
    values: Sequence[float], n_boot: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """Mean of ``values`` and the percentile bootstrap interval of the mean (resampling the values).

    Args:
        values: one value per independent unit (question), ``(Q,)``.
        n_boot: bootstrap resamples.
        seed: seed of the resampling (the interval is reproducible).
        level: coverage of the interval.

    Returns:
        ``(mean, low, high)``.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap of no values")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))  # (n_boot, Q)
    means = x[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha], method="linear")
    return float(x.mean()), float(low), float(high)


def paired_difference(
    records: Iterable[dict], row: str, ref: str, field: str, n_boot: int = 10_000, seed: int = 0
) -> dict[str, Any] | None:
    """Paired difference ``row - ref`` of one score field, with its 95% bootstrap interval over questions.

    Returns:
        ``{"mean", "ci95": [low, high], "questions", "pairs", "std_over_questions"}`` (fractions), or None when the
        rows share no (question, run).
    """
    diffs = per_question_differences(records, row, ref, field)
    if not diffs:
        return None
    per_q = [sum(v) / len(v) for v in diffs.values()]
    mean, low, high = bootstrap_mean_interval(per_q, n_boot=n_boot, seed=seed)
    n = len(per_q)
    std = math.sqrt(sum((d - mean) ** 2 for d in per_q) / (n - 1)) if n > 1 else 0.0
    return {
        "mean": mean,
        "ci95": [low, high],
        "questions": n,
        "pairs": sum(len(v) for v in diffs.values()),
        "std_over_questions": std,
    }
