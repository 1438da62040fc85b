"""Accuracy metrics of the agent evaluation, as torchmetrics ``Metric`` objects.

* HotpotQA: exact match and F1 after the official answer normalisation (lower case, punctuation and
  the articles a/an/the removed, whitespace collapsed), with the official rule that a ``yes``/``no``/
  ``noanswer`` prediction or gold answer scores F1 0 unless both are equal
  (``hotpot_evaluate_v1.py``; the same functions are in AutoAct/LRAgent's agent code).
* ScienceQA: choice accuracy; a prediction (a letter ``A`` / ``(B)``, the choice text, or an int index)
  is mapped to a choice index by :func:`parse_choice`, which never applies article stripping (so ``A``
  stays option A).
* Out-of-function (OOF) rate: the share of episodes with no final answer within the step limit.
* :class:`GroupedMetric`: any of these per level / grade band, plus the average over groups.
* :class:`RunMeanStd` and :func:`aggregate_runs`: mean and standard deviation over repeated runs.

Predictions of ``None`` (no answer: OOF) count as wrong everywhere.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.wrappers.abstract import WrapperMetric

HOTPOTQA_LEVELS: tuple[str, ...] = ("easy", "medium", "hard")
SCIENCEQA_BANDS: tuple[str, ...] = ("1-4", "5-8", "9-12")

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_LETTER_ONLY = re.compile(r"^\s*(?:option|answer|choice)?\s*[\(\[]?\s*([A-Za-z])\s*[\)\]]?\s*[.:]?\s*$", re.I)
_LETTER_PREFIX = re.compile(r"^\s*(?:option|answer|choice)?\s*(?:\(([A-Za-z])\)|([A-Z])\))\s*\S", re.I)


# --------------------------------------------------------------------------------------------- HotpotQA
def normalize_answer(s: str) -> str:
    """Official SQuAD/HotpotQA normalisation: lower, drop punctuation, drop articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match_score(prediction: str | None, ground_truth: str) -> float:
    """1.0 if the normalised strings are equal, else 0.0 (None: 0.0)."""
    if prediction is None:
        return 0.0
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str | None, ground_truth: str) -> float:
    """Official HotpotQA token F1 (``yes``/``no``/``noanswer`` must match exactly; None: 0.0)."""
    if prediction is None:
        return 0.0
    pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
    special = ("yes", "no", "noanswer")
    if (pred in special or gold in special) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


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
def _norm_choice(s: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed; articles kept on purpose."""
    s = "".join(ch if ch not in _PUNCT else " " for ch in s.lower())
    return " ".join(s.split())


def parse_choice(prediction: str | int | None, choices: Sequence[str]) -> int | None:
    """Maps a prediction to a choice index, or None when it names no choice.

    Rules, in order: an int is the 0-based index; a string equal to exactly one choice's text (compared
    as is, then ignoring case, then ignoring punctuation and spacing) is that choice; a lone letter
    (``A``, ``(b)``, ``[C]``, ``Option D.``) or a letter in parentheses before text (``(B) Wind power``,
    ``B) Wind power``) is that option; a string that contains exactly one choice's text as whole words is
    that choice; otherwise the choice with the strictly highest word-overlap F1 (> 0). Articles are never
    removed, so ``A`` cannot become ``""``. Unlike AutoAct's fallback, a prediction that names no choice
    scores wrong instead of defaulting to the best (possibly zero) overlap.

    Args:
        prediction: the agent's answer.
        choices: the options, in order.
    """
    n = len(choices)
    if prediction is None or n == 0:
        return None
    if isinstance(prediction, bool):
        return None
    if isinstance(prediction, int):
        return prediction if 0 <= prediction < n else None
    text = str(prediction)
    for key in (str.strip, lambda s: s.strip().casefold(), _norm_choice):  # strictest text match first
        k = key(text)
        hits = [i for i, c in enumerate(choices) if k and key(c) == k]
        if len(hits) == 1:
            return hits[0]
    norm = _norm_choice(text)
    norm_choices = [_norm_choice(c) for c in choices]
    m = _LETTER_ONLY.match(text) or _LETTER_PREFIX.match(text)
    if m:
        letter = next(g for g in m.groups() if g).upper()
        idx = ord(letter) - ord("A")
        return idx if idx < n else None
    if not norm:
        return None
    contained = [i for i, c in enumerate(norm_choices) if c and re.search(rf"(?<!\w){re.escape(c)}(?!\w)", norm)]
    if len(contained) == 1:
        return contained[0]
    scores = []
    pred_tokens = norm.split()
    for c in norm_choices:
        common = sum((Counter(pred_tokens) & Counter(c.split())).values())
        scores.append(0.0 if common == 0 else 2 * common / (len(pred_tokens) + len(c.split())))
    best = max(scores)
    if best > 0 and scores.count(best) == 1:
        return scores.index(best)
    return None


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


def grade_band(grade: int | str) -> str:
    """Returns the ScienceQA grade band (``1-4``, ``5-8``, ``9-12``) of a grade (``3`` or ``"grade3"``)."""
    g = int(re.sub(r"\D", "", str(grade)) or -1)
    if 1 <= g <= 4:
        return "1-4"
    if 5 <= g <= 8:
        return "5-8"
    if 9 <= g <= 12:
        return "9-12"
    raise ValueError(f"grade must be 1..12, got {grade!r}")


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
