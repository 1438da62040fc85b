"""Option sets for constrained choices (an evaluation option, off by default; LRAgent's protocol generates freely).

With constraints on, the agent loop replaces a generation by a :class:`~lragent.agents.requests.Choose` among:

* the **action type**: the benchmark's tools plus ``Finish`` (:func:`action_type_options`), in the order of the
  system prompt; ``Reflect`` is left out, since the loop hands a ``Finish`` to the reflect role itself;
* the **Finish argument** (:func:`answer_options`): on ScienceQA the letters of the question's options (the action
  role's training outputs after ``Finish[`` are such letters, e.g. ``C``); on HotpotQA ``yes``/``no`` for a
  judgement question, recognised from the question text alone (:func:`is_judgement_question`), and free
  generation otherwise;
* the **Finish argument by option text** (ScienceQA only, :func:`answer_texts`): the same choice among the option
  letters, but each letter is scored by its option's **text** (as the ``Options:`` line shows it, without the
  letter) as the continuation of ``Finish[``, ranked by :data:`ANSWER_TEXT_SCORE`; the chosen option's letter is
  what the trajectory gets and what the episode answers.

Nothing here looks at a gold answer or at a benchmark's answer-type field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from lragent.agents.prompts import OPTION_LETTERS, BenchmarkSpec

ANSWER_TEXT_SCORE = "mean"
"""How the ``answer_text`` constraint ranks option texts: ``mean`` token log-prob (``sum`` favours short options).

Measured with ``scripts/answer_text_score_cpu.py`` (``git show d89e4ca:scripts/answer_text_score_cpu.py``; the embedded
SmolLM2-135M base model, no adapters, CPU fp32, the 90 ScienceQA dev questions, chance = mean 1/#options = 41.1%),
option text as the continuation of a prompt ending with the question and its options: sum 50.0%, mean 51.1% (picks
differ on 16 questions: right 5 by sum, 6 by mean; the sum picks the fewest-token option 55 times, the mean 43); after
the agent's own prompt up to ``Finish[``: sum 48.9%, mean 51.1%. A difference of 1-2 questions: the mean is kept because
it is never worse here and has no length bias.
"""

YES_NO: tuple[str, str] = ("yes", "no")
"""The ``Finish`` arguments of a HotpotQA judgement question, as the system prompt asks for them."""

_AUX = r"(?:is|are|was|were|am|do|does|did|can|could|will|would|has|have|had|should|shall|may|might|must)(?:n't)?"
_STARTS_WITH_AUX = re.compile(rf"^{_AUX}\b", re.IGNORECASE)
_WH = re.compile(r"\b(?:what|which|who|whom|whose|when|where|why|how)\b", re.IGNORECASE)
_OR = re.compile(r"\bor\b(?!\s+not\b)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def action_type_options(spec: BenchmarkSpec) -> tuple[str, ...]:
    """The action types a constrained plan chooses among: the benchmark's tools, then ``Finish``."""
    return (*spec.tools, "Finish")


def option_letters(n: int) -> tuple[str, ...]:
    """The letters ``A``, ``B``, ... of ``n`` answer options (as :func:`~lragent.agents.prompts.format_question`)."""
    if not 1 <= n <= len(OPTION_LETTERS):
        raise ValueError(f"number of options must be 1..{len(OPTION_LETTERS)}, got {n}")
    return tuple(OPTION_LETTERS[:n])


def is_judgement_question(question: str) -> bool:
    """True when ``question`` asks for yes or no, judged from its text alone.

    The asking sentence is the question's last sentence. It is a judgement question when its main clause is a
    yes/no question: the sentence starts with an auxiliary verb (``Are both Coldplay and Pierre Bouvier from the
    same country?``), or its last comma-separated clause does and neither that clause nor the sentence's first word
    is a wh-word (``Yukio Mishima and Roberto Bolaño, are Chilean?``); and it offers no alternatives (``Is Bell
    Atlantic or Cellular One older?`` names its answers; ``or not`` is no alternative).

    Args:
        question: the question text (HotpotQA's ``question`` field).
    """
    text = _SENTENCE_END.split(" ".join(question.split()))[-1]  # the asking sentence: the last one
    if not text or _OR.search(text):
        return False
    if _STARTS_WITH_AUX.match(text):
        return True
    clauses = [c.strip() for c in text.split(",")]
    last, first_word = clauses[-1], text.split(" ", 1)[0]
    return (
        len(clauses) > 1 and bool(_STARTS_WITH_AUX.match(last)) and not _WH.search(last) and not _WH.match(first_word)
    )


def answer_options(spec: BenchmarkSpec, question: str, choices: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The ``Finish`` arguments a constrained action role chooses among, or None where it generates freely.

    Args:
        spec: the benchmark (``scienceqa``: option letters; ``hotpotqa``: yes/no for judgement questions).
        question: the question text (without its options).
        choices: the question's answer options (ScienceQA).

    Returns:
        ``("A", "B", ...)`` for a multiple-choice question, ``("yes", "no")`` for a HotpotQA judgement question,
        else None.
    """
    if choices:
        return option_letters(len(choices))
    if spec.name == "hotpotqa" and is_judgement_question(question):
        return YES_NO
    return None


def answer_texts(choices: Sequence[str]) -> tuple[str, ...]:
    """The texts the ``answer_text`` constraint scores, one per option letter: each option as the question's
    ``Options:`` line shows it after its ``(X)`` (stripped).

    Args:
        choices: the question's answer options (ScienceQA), in letter order.

    Raises:
        ValueError: no options, more than there are letters, or an option that is empty once stripped.
    """
    texts = tuple(str(c).strip() for c in choices)
    option_letters(len(texts))  # 1..10 options, as format_question allows
    if any(not t for t in texts):
        raise ValueError(f"answer_text needs a non-empty text for every option, got {list(choices)!r}")
    return texts
