"""How one answer is scored: HotpotQA's official normalisation, exact match and F1, and ScienceQA's choice parsing.

Plain Python (no torch, no torchmetrics), so that what runs the episodes and scores each record as it finishes
(:mod:`eval_suite.evaluate.benchmarks`, a shard of ``eval --devices N``) does not import the metric classes that only
the summary needs (:mod:`eval_suite.scoring.metrics`, which aggregates these scores as torchmetrics ``Metric`` objects).

* HotpotQA: exact match and F1 after the official answer normalisation (lower case, punctuation and the articles
  a/an/the removed, whitespace collapsed), with the official rule that a ``yes``/``no``/``noanswer`` prediction or gold
  answer scores F1 0 unless both are equal (``hotpot_evaluate_v1.py``; the same functions are in AutoAct/LRAgent's
  agent code).
* ScienceQA: a prediction (a letter ``A`` / ``(B)``, the choice text, or an int index) is mapped to a choice index by
  :func:`parse_choice`, which never applies article stripping (so ``A`` stays option A).

Predictions of ``None`` (no answer: OOF) score wrong everywhere.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

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
