"""Accuracy metrics of the agent evaluation, as torchmetrics ``Metric`` objects over the per-answer scores of
:mod:`eval_suite.scoring.answer_scores` (re-exported here).

* HotpotQA: exact match and F1 after the official answer normalisation (:func:`exact_match_score`, :func:`f1_score`).
* ScienceQA: choice accuracy; a prediction is mapped to a choice index by :func:`parse_choice`.
* Out-of-function (OOF) rate: the share of episodes with no final answer within the step limit.
* :class:`GroupedMetric`: any of these per level / grade band, plus the average over groups.
* :class:`RunMeanStd` and :func:`aggregate_runs`: mean and standard deviation over repeated runs.

Predictions of ``None`` (no answer: OOF) count as wrong everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.wrappers.abstract import WrapperMetric

from eval_suite.scoring.answer_scores import (  # noqa: F401  (re-exported: the metrics' public names)
    HOTPOTQA_LEVELS,
    SCIENCEQA_BANDS,
    exact_match_score,
    f1_score,
    grade_band,
    normalize_answer,
    parse_choice,
)


def _check_lengths(**seqs: Sequence[Any]) -> int:
    lengths = {name: len(s) for name, s in seqs.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"inputs must have the same length, got {lengths}")
    return next(iter(lengths.values()))


class _MeanScore(Metric):
    """Mean of a per-example score; subclasses define :meth:`score`."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total_score", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _add(self, scores: Sequence[float]) -> None:
        self.total_score += float(sum(scores))
        self.count += len(scores)

    def compute(self) -> Tensor:
        """The mean score (NaN before any example)."""
        if self.count == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.total_score / self.count


class HotpotQAExactMatch(_MeanScore):
    """HotpotQA exact match after official normalisation, averaged over examples."""

    def update(self, preds: Sequence[str | None], targets: Sequence[str]) -> None:
        """Adds examples.

        Args:
            preds: predicted answers (None: no answer).
            targets: gold answers.
        """
        _check_lengths(preds=preds, targets=targets)
        self._add([exact_match_score(p, t) for p, t in zip(preds, targets, strict=True)])


class HotpotQAF1(_MeanScore):
    """HotpotQA token F1 after official normalisation (with the yes/no rule), averaged over examples."""

    def update(self, preds: Sequence[str | None], targets: Sequence[str]) -> None:
        """Adds examples.

        Args:
            preds: predicted answers (None: no answer).
            targets: gold answers.
        """
        _check_lengths(preds=preds, targets=targets)
        self._add([f1_score(p, t) for p, t in zip(preds, targets, strict=True)])


# -------------------------------------------------------------------------------------------- ScienceQA
class ScienceQAAccuracy(_MeanScore):
    """ScienceQA choice accuracy: :func:`parse_choice` of the prediction equals the gold index."""

    def update(
        self, preds: Sequence[str | int | None], targets: Sequence[int], choices: Sequence[Sequence[str]]
    ) -> None:
        """Adds examples.

        Args:
            preds: predicted answers (letter, choice text, index or None).
            targets: gold choice indices.
            choices: the options of each question.
        """
        _check_lengths(preds=preds, targets=targets, choices=choices)
        self._add([float(parse_choice(p, c) == int(t)) for p, t, c in zip(preds, targets, choices, strict=True)])


# ------------------------------------------------------------------------------------------------- OOF
class OOFRate(_MeanScore):
    """Out-of-function rate: share of episodes with no final answer (None) within the step limit."""

    higher_is_better = False

    def update(self, answers: Sequence[str | int | None]) -> None:
        """Adds episodes.

        Args:
            answers: each episode's final answer, None when it ended without one.
        """
        self._add([float(a is None) for a in answers])


# -------------------------------------------------------------------------------------------- grouping
class GroupedMetric(WrapperMetric):
    """One copy of a metric per group (HotpotQA level, ScienceQA grade band) plus their average.

    Args:
        metric: the metric to copy (left untouched).
        groups: the group names, fixed up front so that states can be synchronised across processes.

    Example:
        >>> em = GroupedMetric(HotpotQAExactMatch(), HOTPOTQA_LEVELS)
        >>> em.update(["easy", "hard"], ["Paris", "x"], ["paris", "y"])
        >>> {k: float(v) for k, v in em.compute().items()}
        {'easy': 1.0, 'hard': 0.0, 'avg': 0.5}
    """

    def __init__(self, metric: Metric, groups: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        groups = tuple(groups)
        if not groups or len(set(groups)) != len(groups):
            raise ValueError(f"groups must be distinct and non-empty, got {list(groups)}")
        self.groups = groups
        self.metrics = nn.ModuleList([metric.clone() for _ in groups])
        self._index = {g: i for i, g in enumerate(groups)}

    def update(self, group: Sequence[str], *args: Sequence[Any]) -> None:
        """Adds examples, each to its group.

        Args:
            group: the group of each example.
            *args: the wrapped metric's ``update`` arguments, one entry per example.
        """
        n = _check_lengths(group=group, **{f"arg{i}": a for i, a in enumerate(args)})
        unknown = sorted({g for g in group if g not in self._index})
        if unknown:
            raise ValueError(f"unknown groups {unknown}: allowed {list(self.groups)}")
        for g, i in self._index.items():
            rows = [k for k in range(n) if group[k] == g]
            if rows:
                self.metrics[i].update(*[[a[k] for k in rows] for a in args])

    def compute(self) -> dict[str, Tensor]:
        """Per-group values of the groups that have examples, and ``avg``: their unweighted mean."""
        out = {g: self.metrics[i].compute() for g, i in self._index.items() if self.metrics[i].update_called}
        values = list(out.values())
        out["avg"] = torch.stack(values).mean() if values else torch.tensor(float("nan"), dtype=torch.float64)
        return out

    def reset(self) -> None:
        """Resets every group."""
        for m in self.metrics:
            m.reset()
        super().reset()

    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Same as :meth:`update` (batch values are not returned)."""
        self.update(*args, **kwargs)


# ---------------------------------------------------------------------------------------- repeated runs
class RunMeanStd(Metric):
    """Mean and standard deviation of a scalar over repeated runs (one ``update`` per run).

    The standard deviation is the sample one (``n - 1`` in the denominator), 0 for a single run.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_sq", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("runs", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, value: float | Tensor) -> None:
        """Adds one run's value."""
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"run value must be finite, got {v}")
        self.total += v
        self.total_sq += v * v
        self.runs += 1

    def compute(self) -> dict[str, Tensor]:
        """``{"mean", "std", "runs"}``."""
        n = int(self.runs)
        if n == 0:
            nan = torch.tensor(float("nan"), dtype=torch.float64)
            return {"mean": nan, "std": nan, "runs": self.runs}
        mean = self.total / n
        var = (self.total_sq - n * mean * mean).clamp_min(0.0) / (n - 1) if n > 1 else torch.zeros_like(mean)
        return {"mean": mean, "std": var.sqrt(), "runs": self.runs}


def aggregate_runs(runs: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Mean and sample standard deviation of every key over repeated runs.

    Args:
        runs: one ``{metric_name: value}`` dict per run; keys missing in a run are skipped for it.

    Returns:
        ``{metric_name: {"mean", "std", "runs"}}``.
    """
    keys: dict[str, None] = {}
    for r in runs:
        keys.update(dict.fromkeys(r))
    out: dict[str, dict[str, float]] = {}
    for k in keys:
        vals = [float(r[k]) for r in runs if k in r]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        out[k] = {"mean": mean, "std": std, "runs": float(len(vals))}
    return out


# ----------------------------------------------------------------------------------- intervals over runs
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, the regularised incomplete beta function, for ``a, b > 0`` and ``0 <= x <= 1``."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: int) -> float:
    """``P(T <= t)`` for Student's t distribution with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`student_t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Student-t confidence interval of the mean over repeated runs, or None with fewer than two runs.

    Args:
        values: one value per run.
        level: coverage (0.95: the 95% interval ``mean ± t_{0.975, n-1} · s / sqrt(n)``).
    """
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = student_t_quantile(0.5 + level / 2.0, n - 1) * std / math.sqrt(n)
    return mean - half, mean + half
