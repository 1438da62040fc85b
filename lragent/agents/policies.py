"""The model side of the agent loop, one request at a time: the :class:`Policy` protocol and two policies.

* :class:`ScriptedPolicy` plays canned outputs (tests).
* :class:`SessionPolicy` runs every call through a ``lragent.session.MultiAgentSession`` its caller opens (one
  shared KV cache per episode, under the caller's sharing scheme), sampling as LRAgent's evaluation does
  (temperature and nucleus top-p) or greedily (temperature 0), and answers
  :class:`~lragent.agents.requests.Choose` requests by teacher forcing.

:func:`lragent.agents.loop.drive` answers an episode's requests with a policy; a batched engine replaces both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from lragent.agents.requests import StepStats, best_option, check_choice_score


@runtime_checkable
class Policy(Protocol):
    """The model side of the loop: one shared trajectory, extended by role calls.

    Attributes:
        last_stats: cost of the latest :meth:`generate` / :meth:`choose` call, or None when not measured.
    """

    last_stats: StepStats | None

    def reset(self) -> None:
        """Starts a new, empty trajectory (called at the start of every episode)."""
        ...

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        """Appends ``new_text`` to the trajectory, then lets ``role`` generate.

        Args:
            role: ``plan``, ``action`` or ``reflect``.
            new_text: text appended to the shared trajectory since the previous call (may be empty).
            max_new_tokens: generation budget.
            stop: generation stops at the first of these strings.

        Returns:
            The generated text, cut before the first stop string; the trajectory now ends with it (the stop
            string itself is not kept).
        """
        ...

    def choose(
        self,
        role: str,
        new_text: str,
        options: Sequence[str],
        *,
        score: str = "sum",
        appends: Sequence[str] | None = None,
    ) -> int:
        """Appends ``new_text``, lets ``role`` score every option as a continuation, appends the best one.

        Args:
            role: ``plan``, ``action`` or ``reflect``.
            new_text: text appended to the shared trajectory since the previous call (may be empty).
            options: the continuations scored (non-empty strings).
            score: ``sum`` or ``mean`` of each option's token log-probs
                (:func:`~lragent.agents.requests.best_option`).
            appends: None, or what the trajectory gets for each option in place of the option's own text.

        Returns:
            The index of the chosen option; the trajectory now ends with that option's text (or its ``appends``
            entry).
        """
        ...


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """Returns ``text`` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def closest_option(text: str, options: Sequence[str]) -> int:
    """Index of the option ``text`` names: an exact match (after stripping), else the longest common prefix.

    Ties go to the first option, so every string maps to exactly one valid index (a deterministic stand-in for a
    model's choice in tests).
    """
    key = text.strip()
    for i, opt in enumerate(options):
        if opt == key:
            return i

    def common(a: str, b: str) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    lengths = [common(key, opt) for opt in options]
    return lengths.index(max(lengths))


class ScriptedPolicy:
    """A :class:`Policy` that plays canned outputs in order, for tests.

    Each output is cut at the call's stop strings, as a model session cuts generation, so a canned
    ``"Retrieve[Metallica]"`` for the action-type call yields ``"Retrieve"``. A :meth:`choose` call consumes one
    canned output too and picks the option it names (:func:`closest_option`). Every call is recorded in
    :attr:`calls` and the trajectory it saw is kept in :attr:`trajectory`.

    Args:
        outputs: canned generations, consumed one per call (across episodes).
        roles: if given, the role each call must have; a mismatch raises ``AssertionError`` (a test failure).

    Attributes:
        calls: ``(role, new_text, stop, output)`` per call (``stop`` is ``[]`` for a choice; ``output`` is the
            chosen option).
        choices: ``(role, options, index)`` per :meth:`choose` call.
        trajectory: the text of the current episode's shared trajectory.
        contexts: the full trajectory text each call generated (or chose) after.
    """

    def __init__(self, outputs: Sequence[str], roles: Sequence[str] | None = None) -> None:
        if roles is not None and len(roles) != len(outputs):
            raise ValueError(f"roles has {len(roles)} entries for {len(outputs)} outputs")
        self.outputs = list(outputs)
        self.roles = list(roles) if roles is not None else None
        self.position = 0
        self.calls: list[tuple[str, str, list[str], str]] = []
        self.choices: list[tuple[str, tuple[str, ...], int]] = []
        self.contexts: list[str] = []
        self.trajectory = ""
        self.last_stats: StepStats | None = None

    def reset(self) -> None:
        """Empties the trajectory; the script position carries on."""
        self.trajectory = ""
        self.last_stats = None

    @property
    def num_tokens(self) -> int:
        """Whitespace-separated words of the trajectory (a stand-in token count for tests)."""
        return len(self.trajectory.split())

    def _next(self, role: str, new_text: str) -> str:
        if self.position >= len(self.outputs):
            raise IndexError(f"script exhausted after {self.position} outputs (role {role!r} asked for more)")
        if self.roles is not None:
            assert self.roles[self.position] == role, (
                f"call {self.position}: expected role {self.roles[self.position]!r}, got {role!r}"
            )
        self.trajectory += new_text
        self.contexts.append(self.trajectory)
        out = self.outputs[self.position]
        self.position += 1
        return out

    def _record(self, role: str, new_text: str, stop: Sequence[str], out: str) -> None:
        self.trajectory += out
        self.calls.append((role, new_text, list(stop), out))
        self.last_stats = StepStats(prefill_tokens=len(new_text.split()), decode_tokens=len(out.split()))

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        """Plays the next canned output (see :class:`Policy`)."""
        out = cut_at_stop(self._next(role, new_text), stop)
        self._record(role, new_text, stop, out)
        return out

    def choose(
        self,
        role: str,
        new_text: str,
        options: Sequence[str],
        *,
        score: str = "sum",
        appends: Sequence[str] | None = None,
    ) -> int:
        """Picks the option the next canned output names (:func:`closest_option`; see :class:`Policy`); ``score``
        plays no part (nothing is scored)."""
        if not options:
            raise ValueError("choose needs at least one option")
        check_choice_score(score)
        index = closest_option(self._next(role, new_text), options)
        self._record(role, new_text, [], options[index] if appends is None else appends[index])
        self.choices.append((role, tuple(options), index))
        return index


def check_sampling(temperature: float, top_p: float) -> None:
    """Raises ``ValueError`` unless ``temperature`` is finite and >= 0 and ``top_p`` is in (0, 1]."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class SessionPolicy:
    """A :class:`Policy` over a ``lragent.session.MultiAgentSession`` (one shared KV cache per episode).

    Each :meth:`reset` opens a new session with ``new_session()``; :meth:`generate` appends ``new_text`` with
    ``session.append_text`` and runs ``session.step(role, ...)``. The session keeps the generated text's tokens and
    drops the stop string's, matching what the loop expects. :meth:`choose` scores options by teacher forcing through
    the same session (``append``, ``step(max_new_tokens=0, return_logits=True)``, ``truncate``), so each option is
    scored exactly as the session's sharing scheme lets ``role`` see the trajectory.

    The policy never sees the model or the scheme: whoever builds ``new_session`` chooses them (the eval command
    builds it with the episode's scheme), so the scheme goes from the command to the session directly.

    Tokenisation: text appended in pieces may tokenise slightly differently from the whole string at once.
    The loop appends at natural boundaries (pieces that end with a newline, or ``[\\n### Response:\\n``),
    which keeps the difference to the junction tokens. An option is tokenised on its own (with the session's
    tokenizer), like every piece.

    Args:
        new_session: opens a fresh, empty session, e.g.
            ``lambda: MultiAgentSession(model, Scheme.BASE_LR_SHARED, tokenizer=tok)``; called by every
            :meth:`reset`.
        temperature: sampling temperature (0 = greedy; LRAgent's evaluation samples at 0.9).
        top_p: nucleus mass for sampling, in (0, 1] (LRAgent: 0.75; ignored when greedy).
        seed: base seed; generate call ``i`` of an episode uses ``seed + i`` (None: no seeding).

    Attributes:
        last_scores: the option scores of the latest :meth:`choose` call (summed token log-probs; divided by the
            option's token count under ``score="mean"``).
    """

    def __init__(
        self,
        new_session: Callable[[], Any],
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> None:
        check_sampling(temperature, top_p)
        if not callable(new_session):
            raise ValueError(f"new_session must be a callable that opens a session, got {type(new_session).__name__}")
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self._new_session = new_session
        self.session: Any = None
        self.last_stats: StepStats | None = None
        self.last_scores: list[float] = []
        self._calls = 0

    def reset(self) -> None:
        """Opens a new, empty session."""
        self.session = self._new_session()
        self.last_stats = None
        self.last_scores = []
        self._calls = 0

    @property
    def num_tokens(self) -> int:
        """Tokens in the shared trajectory."""
        return 0 if self.session is None else int(self.session.num_tokens)

    @property
    def peak_cache_bytes(self) -> int:
        """Peak KV-cache bytes of the current session."""
        return 0 if self.session is None else int(self.session.peak_cache_bytes)

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        """Appends ``new_text`` and lets ``role`` generate (see :class:`Policy`)."""
        if self.session is None:
            self.reset()
        if new_text:
            self.session.append_text(new_text)
        seed = None if self.seed is None else self.seed + self._calls
        self._calls += 1
        res = self.session.step(
            role,
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            stop=list(stop),
        )
        self.last_stats = StepStats(
            prefill_tokens=int(res.prefill_tokens),
            decode_tokens=len(res.generated_ids),
            prefill_s=float(res.prefill_s),
            decode_s=float(res.decode_s),
            recomputed_tokens=int(getattr(res, "recomputed_tokens", 0)),
            trajectory_tokens=self.num_tokens,
        )
        return res.text

    def choose(
        self,
        role: str,
        new_text: str,
        options: Sequence[str],
        *,
        score: str = "sum",
        appends: Sequence[str] | None = None,
    ) -> int:
        """Appends ``new_text``, scores each option by teacher forcing as ``role``, keeps the best (:class:`Policy`).

        The score of an option with tokens ``t_1..t_m`` appended after trajectory position ``n - 1`` is
        ``sum_j log p_role(t_j | trajectory, t_1..t_{j-1})`` (``score="mean"``: that over ``m``). One prefill-only
        step gives the next-token distribution at position ``n - 1`` (which scores ``t_1`` of every option); each
        option with more than one token is then appended, scored by one more prefill-only step and cut off again
        (``truncate``). The best option (ties: the first; :func:`~lragent.agents.requests.best_option`) is appended
        at the end, or its ``appends`` entry in its place; the next step prefills it.

        Returns:
            The index of the chosen option.
        """
        import torch  # the policy module stays light; scoring needs torch

        if not options:
            raise ValueError("choose needs at least one option")
        check_choice_score(score)
        if appends is not None and len(appends) != len(options):
            raise ValueError(f"appends has {len(appends)} entries for {len(options)} options")
        if self.session is None:
            self.reset()
        if new_text:
            self.session.append_text(new_text)
        tokenizer = self.session.tokenizer
        token_lists = [list(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in options]
        empty = [o for o, ids in zip(options, token_lists, strict=True) if not ids]
        if empty:
            raise ValueError(f"options {empty!r} tokenise to nothing")
        stats = StepStats()

        def score_step() -> tuple[torch.Tensor, list[int]]:
            res = self.session.step(role, max_new_tokens=0, return_logits=True)
            stats.prefill_tokens += int(res.prefill_tokens)
            stats.prefill_s += float(res.prefill_s)
            stats.recomputed_tokens += int(getattr(res, "recomputed_tokens", 0))
            return torch.log_softmax(res.logits.float(), dim=-1), list(res.logit_positions)

        base = self.session.num_tokens
        first, positions = score_step()
        assert positions and positions[-1] == base - 1, (positions[-1:], base)
        head = first[-1]  # (vocab,): next-token log-probs after the trajectory
        scores: list[float] = []
        for ids in token_lists:
            total = float(head[ids[0]])
            if len(ids) > 1:
                self.session.append(ids)
                logp, pos = score_step()  # rows for positions base .. base + len(ids) - 1 (at least)
                row = {p: i for i, p in enumerate(pos)}
                total += sum(float(logp[row[base + j - 1], ids[j]]) for j in range(1, len(ids)))
                self.session.truncate(base)
            scores.append(total)
        lengths = [len(ids) for ids in token_lists]
        best = best_option(scores, lengths, score)
        if appends is None:
            self.session.append(token_lists[best])
        else:
            self.session.append_text(appends[best])
        stats.trajectory_tokens = self.num_tokens
        self.last_scores = [s / n for s, n in zip(scores, lengths, strict=True)] if score == "mean" else scores
        self.last_stats = stats
        return best
