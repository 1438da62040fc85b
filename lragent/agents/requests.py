"""What an episode asks of the model, and what it gets back: the seam between the agent loop and an engine.

An episode (:meth:`lragent.agents.loop.AgentLoop.episode`) is a generator. It yields one request per model call
and receives a :class:`Reply` for it::

    request = next(episode)                 # Generate(...) or Choose(...)
    while True:
        reply = engine_answers(request)     # Reply(text=...) or Reply(choice=...)
        request = episode.send(reply)       # ... until StopIteration(value=EpisodeResult)

Both requests first append ``new_text`` (everything the loop wrote since the previous call: prompt pieces,
observations) to the episode's one shared trajectory, then let ``role`` act on it:

* :class:`Generate`: ``role`` generates up to ``max_new_tokens`` tokens, stopping at the first stop string; the
  trajectory keeps the text before the stop string, and the reply carries that text.
* :class:`Choose`: ``role`` scores each option as a teacher-forced continuation of the trajectory (the sum of the
  option's token log-probabilities, or their mean with ``score="mean"``; each option tokenised on its own, as
  appended pieces are); the best option's text (or its ``appends`` entry) is appended to the trajectory and the
  reply carries its index (ties: the first best option). Both engines pick through :func:`best_option`.

A sequential engine answers one request at a time (:func:`lragent.agents.loop.drive` over a
:class:`~lragent.agents.policies.Policy`); a batched one may hold many episodes' requests and answer them in any
order, since every request names everything its answer depends on except the trajectory the engine keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHOICE_SCORES: tuple[str, ...] = ("sum", "mean")
"""How a :class:`Choose` ranks its options: ``sum`` of the option's token log-probs (favours short options), or
their ``mean`` (per token)."""


def check_choice_score(score: str) -> str:
    """Returns ``score`` if it is one of :data:`CHOICE_SCORES`; raises ``ValueError`` naming them otherwise."""
    if score not in CHOICE_SCORES:
        raise ValueError(f"choice score {score!r}: allowed {', '.join(CHOICE_SCORES)}")
    return score


def best_option(sums: Sequence[float], lengths: Sequence[int], score: str = "sum") -> int:
    """The index a :class:`Choose` picks, from each option's summed token log-probs and token count.

    The one ranking rule of every engine (sequential policy and batched executor), so they cannot differ.

    Args:
        sums: per option, the sum of its token log-probs as a continuation.
        lengths: per option, its number of tokens (>= 1).
        score: ``sum`` ranks by ``sums``; ``mean`` by ``sums[i] / lengths[i]``.

    Returns:
        The index of the best option (ties: the first).
    """
    check_choice_score(score)
    if not sums or len(sums) != len(lengths) or any(n < 1 for n in lengths):
        raise ValueError(f"best_option needs one positive length per score, got {list(sums)} / {list(lengths)}")
    ranked = [s / n for s, n in zip(sums, lengths, strict=True)] if score == "mean" else list(sums)
    return ranked.index(max(ranked))


@dataclass
class StepStats:
    """Cost of one model call.

    Attributes:
        prefill_tokens: tokens prefilled for the call (the appended text, plus whatever the cache scheme
            recomputes, plus the option tokens a :class:`Choose` scores).
        decode_tokens: tokens generated.
        prefill_s: prefill wall time in seconds.
        decode_s: decode wall time in seconds.
        recomputed_tokens: context tokens the cache scheme re-processed for this role (0 when not reported).
        trajectory_tokens: tokens in the shared trajectory after the call (None when not reported); the loop's
            context budget and the episode's ``num_tokens`` read it.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_tokens: int = 0
    trajectory_tokens: int | None = None


@dataclass(frozen=True)
class Generate:
    """Append ``new_text``, then let ``role`` generate.

    Attributes:
        role: ``plan``, ``action`` or ``reflect``.
        new_text: text appended to the shared trajectory since the previous call (may be empty).
        max_new_tokens: generation budget.
        stop: generation stops at the first of these strings; the trajectory keeps the text before it.
    """

    role: str
    new_text: str
    max_new_tokens: int
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Choose:
    """Append ``new_text``, then let ``role`` pick one of ``options`` by teacher forcing.

    Each option is scored by the sum (``score="sum"``) or the mean (``score="mean"``) of its token log-probabilities
    as a continuation of the trajectory (each option tokenised on its own; :func:`best_option`). The chosen option's
    text is appended to the trajectory, or ``appends[i]`` in its place when given (the ScienceQA ``answer_text``
    constraint scores option texts and appends the chosen option's letter); the reply gives its index.

    Attributes:
        role: ``plan``, ``action`` or ``reflect``.
        new_text: text appended to the shared trajectory since the previous call (may be empty).
        options: the continuations scored (non-empty strings, at least one).
        score: ``sum`` (default) or ``mean`` of the token log-probs.
        appends: None (append the chosen option itself), or one non-empty string per option: what the trajectory
            gets when that option is chosen.
    """

    role: str
    new_text: str
    options: tuple[str, ...]
    score: str = "sum"
    appends: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.options or any(not isinstance(o, str) or not o for o in self.options):
            raise ValueError(f"Choose needs at least one non-empty option string, got {self.options!r}")
        check_choice_score(self.score)
        if self.appends is not None and (
            len(self.appends) != len(self.options) or any(not isinstance(a, str) or not a for a in self.appends)
        ):
            raise ValueError(f"Choose appends must be one non-empty string per option, got {self.appends!r}")

    def appended(self, index: int) -> str:
        """The text the trajectory gets when option ``index`` is chosen."""
        return self.options[index] if self.appends is None else self.appends[index]


@dataclass
class Reply:
    """The answer to a request.

    Attributes:
        text: for :class:`Generate`, the generated text (cut before the stop string); for :class:`Choose`, the
            chosen option's text (informational; the loop reads ``choice``).
        choice: for :class:`Choose`, the index of the chosen option; None for :class:`Generate`.
        stats: the call's cost, or None when the engine does not measure it.
    """

    text: str = ""
    choice: int | None = None
    stats: StepStats | None = None
