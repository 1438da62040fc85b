"""The AutoAct agent loop as LRAgent evaluates it, on one shared trajectory.

One **cycle** (LRAgent's ``step``) is::

    plan    -> thought          after "Thought: \\n### Response:\\n"          (stop "\\n")
    plan    -> action type      after "\\nAction: \\n### Response:\\n"        (stop "[", "\\n")
    action  -> argument         after "[\\n### Response:\\n"                  (stop "]", "\\n")
    tool    -> observation      appended as "]\\nObversation: {obs}\\n" + the next "Thought: \\n### Response:\\n"

After the first ``Finish[answer]`` the observation is ``Please reflect your answer.`` and the next cycle is
the two-stage **reflect** step::

    reflect -> thought          after "Thought: \\n### Response:\\n"          (stop "\\n")
    reflect -> Reflect[x]       after "\\n"                                   (stop "\\n")

``Reflect[right]`` accepts the answer and ends the episode (so does ``Finish[x]``, with answer x, as in
LRAgent). Anything else (``Reflect[wrong]``, ``Reflect[yes]``, another action, an unparsable output)
appends ``The answer maybe wrong, please try to solve the question again.`` and hands control back to plan.
As in LRAgent (and in the training trajectories), a later ``Finish`` ends the episode with its answer
directly, without a second reflect. ``Reflect`` before any ``Finish`` is an
invalid action with its own observation. The episode is **out of function (OOF)** when no answer is
accepted within ``max_steps`` cycles (LRAgent default 15) or before the context budget is spent.

Why the text looks like this, and where it differs from each role's training inputs, is documented in
:mod:`lragent.agents.prompts`. Every piece the loop appends ends with a newline (or is the ``[`` marker
ending in a newline), so text appended in pieces tokenises at natural boundaries; the one exception is
the single ``"\\n"`` before ``Reflect[...]``, which is what the reflect training inputs end with.

**Requests.** An episode is a generator (:meth:`AgentLoop.episode`) that yields one request per model call
(:mod:`lragent.agents.requests`): :class:`Generate` carries only the text appended since the previous call, so an
engine backed by a shared KV cache prefills just that. :func:`drive` answers the requests one by one with a
:class:`~lragent.agents.policies.Policy` (:meth:`AgentLoop.run`); a batched engine answers many episodes at once.

**Constrained choices** (off by default; LRAgent's protocol generates freely): with ``action_types`` the plan's
action type is a :class:`Choose` among them instead of a generation, and with ``answer_options`` the action
role's ``Finish`` argument is a :class:`Choose` among them (ScienceQA option letters, ``yes``/``no`` for a
HotpotQA judgement question). With ``answer_texts`` as well (ScienceQA's ``answer_text`` constraint) the
:class:`Choose` scores those texts instead (option ``i``'s text stands for answer ``answer_options[i]``, ranked by
``answer_score``: ``sum`` or ``mean`` token log-prob) and the trajectory and the answer get the chosen
``answer_options`` entry (the letter), exactly as if the letter had been chosen. The loop never forces an answer:
an episode that does not ``Finish`` in time is OOF whatever the constraints.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lragent.agents.policies import Policy, ScriptedPolicy, SessionPolicy, cut_at_stop
from lragent.agents.prompts import (
    ACTION_MARKER,
    ARGUMENT_MARKER,
    OBS_MAYBE_WRONG,
    OBS_PLEASE_REFLECT,
    OBS_REFLECT_INVALID,
    REFLECT_ACTION_MARKER,
    BenchmarkSpec,
    initial_text,
    observation_text,
)
from lragent.agents.requests import Choose, Generate, Reply, StepStats, check_choice_score

if TYPE_CHECKING:
    from lragent.agents.tools import Toolbox

__all__ = [
    "ROLES",
    "AgentConfig",
    "AgentLoop",
    "Choose",
    "EpisodeResult",
    "Generate",
    "Policy",
    "Reply",
    "RoleStats",
    "ScriptedPolicy",
    "SessionPolicy",
    "Step",
    "StepStats",
    "answer_request",
    "cut_at_stop",
    "drive",
    "is_accept",
    "parse_reflect",
    "run_episode",
]

ROLES: tuple[str, ...] = ("plan", "action", "reflect")

_ACTION_RE = re.compile(r"^\s*(\w+)\s*\[(.*?)\]?\s*\.?\s*$", re.DOTALL)

Request = Generate | Choose
Episode = Generator[Request, Reply, "EpisodeResult"]
"""An episode: yields requests, receives replies, returns its :class:`EpisodeResult`."""


@dataclass
class RoleStats:
    """Totals of one role over an episode: number of calls plus the summed :class:`StepStats` fields."""

    calls: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_tokens: int = 0

    def add(self, stats: StepStats | None) -> None:
        """Counts one call and adds its stats (None: a call whose cost the policy does not report)."""
        self.calls += 1
        if stats is not None:
            self.prefill_tokens += stats.prefill_tokens
            self.decode_tokens += stats.decode_tokens
            self.prefill_s += stats.prefill_s
            self.decode_s += stats.decode_s
            self.recomputed_tokens += stats.recomputed_tokens


CYCLE_RESERVE_TOKENS = 2048  # positions kept free past the context bound: one more cycle (thought, action, observation)


def context_bound(capacity: int) -> int | None:
    """The default ``max_context_tokens`` of episodes run on trajectories of ``capacity`` positions: the capacity less
    one cycle's reserve (:data:`CYCLE_RESERVE_TOKENS`), so an episode stops as out of function before its trajectory
    outgrows its cache; None (no bound) when the capacity leaves no such room."""
    bound = capacity - CYCLE_RESERVE_TOKENS
    return bound if bound >= 1 else None


@dataclass
class AgentConfig:
    """Budgets of the agent loop.

    Attributes:
        max_steps: cycles (thought + action + observation, or a reflect step) before the episode is OOF.
        thought_tokens: generation budget of a thought (plan or reflect).
        action_type_tokens: generation budget of the plan's action type.
        argument_tokens: generation budget of the action's argument.
        reflect_tokens: generation budget of ``Reflect[...]``.
        max_context_tokens: the episode stops (OOF) at the start of a cycle when the trajectory has more tokens than
            this (as the replies report it); None: no limit.
    """

    max_steps: int = 15
    thought_tokens: int = 128
    action_type_tokens: int = 8
    argument_tokens: int = 64
    reflect_tokens: int = 16
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "thought_tokens", "action_type_tokens", "argument_tokens", "reflect_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context_tokens is not None and self.max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1 or None, got {self.max_context_tokens}")


@dataclass
class Step:
    """One cycle of an episode.

    Attributes:
        kind: ``act`` (plan/plan/action + observation) or ``reflect``.
        thought: the thought generated.
        action_type: the parsed action type (``Retrieve``, ``Finish``, ``Reflect``, ...; may be anything).
        argument: the parsed argument.
        observation: the observation appended (``None`` for the action that ended the episode).
    """

    kind: str
    thought: str
    action_type: str
    argument: str
    observation: str | None


@dataclass
class EpisodeResult:
    """What one episode produced.

    Attributes:
        answer: the accepted final answer, or None (OOF).
        candidate: the last ``Finish`` argument, accepted or not.
        steps: the cycles, in order.
        cycles: ``len(steps)``.
        trajectory: the shared trajectory text: everything sent to and generated by the policy (an observation
            made after the last model call was never sent; it is only in ``steps``).
        role_stats: per-role call count, prefill/decode tokens and seconds.
        oof: True when no answer was accepted (step limit or context budget).
        stop_reason: ``finished``, ``step_limit`` or ``context_limit``.
        num_tokens: tokens in the trajectory at the end (the last reply's ``trajectory_tokens``; 0 if never
            reported).
        wall_s: episode wall time in seconds (from the first request to the result, waiting for replies included).
        constrained_calls: :class:`Choose` requests the episode made (0 without constraints).
        extra: free-form additions of whoever runs the episode.
    """

    answer: str | None
    candidate: str | None
    steps: list[Step]
    cycles: int
    trajectory: str
    role_stats: dict[str, RoleStats]
    oof: bool
    stop_reason: str
    num_tokens: int = 0
    wall_s: float = 0.0
    constrained_calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def parse_reflect(text: str) -> tuple[str, str]:
    """Splits ``Reflect[right]`` (or any ``Type[arg]``) into ``(type, arg)``; ``(text, "")`` if unparsable."""
    m = _ACTION_RE.match(text)
    if m is None:
        return text.strip(), ""
    return m.group(1), m.group(2).strip()


def is_accept(argument: str) -> bool:
    """True for a reflect argument that accepts the answer: ``right`` (any case, surrounding spaces/period)."""
    return argument.strip().strip(".").strip().lower() == "right"


class AgentLoop:
    """Runs AutoAct episodes on one benchmark, as request generators or with a :class:`Policy`.

    Args:
        policy: the model side for :meth:`run` (None when episodes are only driven through :meth:`episode`).
        spec: the benchmark (prompt, tools, observation strings).
        config: budgets; defaults to :class:`AgentConfig()`.
    """

    def __init__(self, policy: Policy | None, spec: BenchmarkSpec, config: AgentConfig | None = None) -> None:
        self.policy = policy
        self.spec = spec
        self.config = config or AgentConfig()

    def episode(
        self,
        question_text: str,
        toolbox: Toolbox | Callable[[str, str], str],
        *,
        action_types: Sequence[str] | None = None,
        answer_options: Sequence[str] | None = None,
        answer_texts: Sequence[str] | None = None,
        answer_score: str = "sum",
    ) -> Episode:
        """One episode as a generator of model requests.

        The first request's ``new_text`` starts the trajectory: whoever answers must start a fresh one for it.
        Tools run inside the generator, between requests.

        Args:
            question_text: the question as :func:`lragent.agents.prompts.format_question` formats it.
            toolbox: executes tool actions: ``toolbox(action_type, argument) -> observation``; a fresh
                :class:`~lragent.agents.tools.Toolbox` per episode.
            action_types: None (default): plan generates the action type. Otherwise the action type is a
                :class:`Choose` among these (e.g. the benchmark's tools plus ``Finish``).
            answer_options: None (default): action generates the ``Finish`` argument. Otherwise, after the action
                type ``Finish``, the argument is a :class:`Choose` among these.
            answer_texts: None (default): the :class:`Choose` scores ``answer_options`` themselves. Otherwise one
                text per answer option, scored in its place (e.g. a ScienceQA option's text for its letter); the
                chosen answer option is what the trajectory gets and what the episode answers.
            answer_score: how the answer :class:`Choose` ranks its options, ``sum`` or ``mean`` token log-prob.

        Yields:
            :class:`Generate` / :class:`Choose` requests; each must be answered with a :class:`Reply` through
            ``send`` (``Reply.choice`` indexes the request's options).

        Returns:
            The :class:`EpisodeResult` (as ``StopIteration.value``).

        Raises:
            ValueError: a reply to a :class:`Choose` without a valid option index; empty constraint lists.
        """
        choose_types = _options("action_types", action_types)
        choose_answers = _options("answer_options", answer_options)
        answer_scored = _options("answer_texts", answer_texts)
        check_choice_score(answer_score)
        if answer_scored is not None and (choose_answers is None or len(answer_scored) != len(choose_answers)):
            raise ValueError(f"answer_texts needs one text per answer option: {answer_texts!r} for {answer_options!r}")
        cfg, spec = self.config, self.spec
        t0 = time.perf_counter()
        stats = {r: RoleStats() for r in ROLES}
        parts: list[str] = []
        pending = initial_text(spec, question_text)
        tokens = 0
        constrained = 0
        steps: list[Step] = []
        answer: str | None = None
        candidate: str | None = None
        awaiting_reflect = False
        stop_reason = "step_limit"

        def take(role: str, reply: Reply, new_text: str, text: str) -> None:
            nonlocal tokens
            stats[role].add(reply.stats)
            if reply.stats is not None and reply.stats.trajectory_tokens is not None:
                tokens = int(reply.stats.trajectory_tokens)
            parts.append(new_text)
            parts.append(text)

        def call(role: str, max_new_tokens: int, stop: tuple[str, ...]) -> Generator[Request, Reply, str]:
            nonlocal pending
            new_text, pending = pending, ""
            reply = yield Generate(role, new_text, max_new_tokens, stop)
            take(role, reply, new_text, reply.text)
            return reply.text

        def pick(
            role: str, options: tuple[str, ...], score: str = "sum", appends: tuple[str, ...] | None = None
        ) -> Generator[Request, Reply, str]:
            nonlocal pending, constrained
            new_text, pending = pending, ""
            request = Choose(role, new_text, options, score=score, appends=appends)
            reply = yield request
            if not isinstance(reply.choice, int) or not 0 <= reply.choice < len(options):
                raise ValueError(f"a Choose among {len(options)} options got choice {reply.choice!r}")
            constrained += 1
            chosen = request.appended(reply.choice)
            take(role, reply, new_text, chosen)
            return chosen

        for _ in range(cfg.max_steps):
            if cfg.max_context_tokens is not None and tokens > cfg.max_context_tokens:
                stop_reason = "context_limit"
                break
            if awaiting_reflect:
                awaiting_reflect = False
                thought = yield from call("reflect", cfg.thought_tokens, ("\n",))
                pending = REFLECT_ACTION_MARKER
                out = yield from call("reflect", cfg.reflect_tokens, ("\n",))
                action_type, argument = parse_reflect(out)
                if (action_type == "Reflect" and is_accept(argument)) or action_type == "Finish":
                    if action_type == "Finish":  # LRAgent: a Finish with an answer pending ends the episode
                        candidate = argument
                    answer = candidate
                    steps.append(Step("reflect", thought, action_type, argument, None))
                    stop_reason = "finished"
                    break
                observation = OBS_MAYBE_WRONG
                steps.append(Step("reflect", thought, action_type, argument, observation))
                pending = observation_text(observation)
                continue

            thought = yield from call("plan", cfg.thought_tokens, ("\n",))
            pending = ACTION_MARKER
            if choose_types is not None:
                action_type = yield from pick("plan", choose_types)
            else:
                action_type = (yield from call("plan", cfg.action_type_tokens, ("[", "\n"))).strip()
            pending = ARGUMENT_MARKER
            if action_type == "Finish" and answer_scored is not None:
                argument = yield from pick("action", answer_scored, answer_score, choose_answers)
            elif action_type == "Finish" and choose_answers is not None:
                argument = yield from pick("action", choose_answers, answer_score)
            else:
                argument = yield from call("action", cfg.argument_tokens, ("]", "\n"))
            arg = argument.strip()
            if action_type == "Finish":
                if candidate is not None:  # a Finish after a rejected answer ends the episode (LRAgent)
                    candidate = answer = arg
                    steps.append(Step("act", thought, action_type, arg, None))
                    stop_reason = "finished"
                    break
                candidate = arg
                awaiting_reflect = True
                observation = OBS_PLEASE_REFLECT
            elif action_type == "Reflect":
                observation = OBS_REFLECT_INVALID
            elif action_type in spec.tools:
                observation = toolbox(action_type, arg)
            else:
                observation = spec.invalid_action
            steps.append(Step("act", thought, action_type, arg, observation))
            pending = observation_text(observation, closing="]")

        return EpisodeResult(
            answer=answer,
            candidate=candidate,
            steps=steps,
            cycles=len(steps),
            trajectory="".join(parts),
            role_stats=stats,
            oof=answer is None,
            stop_reason=stop_reason,
            num_tokens=tokens,
            wall_s=time.perf_counter() - t0,
            constrained_calls=constrained,
        )

    def run(
        self,
        question_text: str,
        toolbox: Toolbox | Callable[[str, str], str],
        *,
        action_types: Sequence[str] | None = None,
        answer_options: Sequence[str] | None = None,
        answer_texts: Sequence[str] | None = None,
        answer_score: str = "sum",
    ) -> EpisodeResult:
        """Runs one episode with this loop's policy: ``policy.reset()``, then :func:`drive` over :meth:`episode`.

        Args:
            question_text: the question as :func:`lragent.agents.prompts.format_question` formats it.
            toolbox: executes tool actions (see :meth:`episode`).
            action_types: constrained action types (see :meth:`episode`; None: generated).
            answer_options: constrained ``Finish`` arguments (see :meth:`episode`; None: generated).
            answer_texts: texts scored in place of ``answer_options`` (see :meth:`episode`).
            answer_score: ``sum`` or ``mean`` (see :meth:`episode`).

        Returns:
            The :class:`EpisodeResult`.
        """
        if self.policy is None:
            raise ValueError("AgentLoop.run needs a policy; drive AgentLoop.episode with an engine instead")
        self.policy.reset()
        episode = self.episode(
            question_text,
            toolbox,
            action_types=action_types,
            answer_options=answer_options,
            answer_texts=answer_texts,
            answer_score=answer_score,
        )
        return drive(episode, self.policy)


def _options(name: str, options: Sequence[str] | None) -> tuple[str, ...] | None:
    if options is None:
        return None
    opts = tuple(options)
    if not opts or any(not isinstance(o, str) or not o for o in opts):
        raise ValueError(f"{name} must be None or non-empty strings, got {options!r}")
    return opts


def answer_request(policy: Policy, request: Request) -> Reply:
    """Answers one request with a policy (``generate`` or ``choose``) and attaches the call's stats.

    A :class:`Choose` passes ``score`` and ``appends`` on only where they differ from a plain choice (``sum``, None).
    The stats are the policy's ``last_stats`` (copied); when the policy reports ``num_tokens`` and the stats do not
    say the trajectory length, it is filled in from there.
    """
    if isinstance(request, Generate):
        reply = Reply(
            text=policy.generate(
                request.role, request.new_text, max_new_tokens=request.max_new_tokens, stop=list(request.stop)
            )
        )
    elif isinstance(request, Choose):
        extra: dict[str, Any] = {}  # only what differs from a plain choice: policies written before these keep working
        if request.score != "sum":
            extra["score"] = request.score
        if request.appends is not None:
            extra["appends"] = request.appends
        index = policy.choose(request.role, request.new_text, request.options, **extra)
        text = request.options[index] if isinstance(index, int) and 0 <= index < len(request.options) else ""
        reply = Reply(text=text, choice=index)
    else:
        raise TypeError(f"unknown request {request!r}")
    stats = getattr(policy, "last_stats", None)
    tokens = getattr(policy, "num_tokens", None)
    if stats is not None:
        stats = dataclasses.replace(stats)
    if tokens is not None:
        stats = stats or StepStats()
        if stats.trajectory_tokens is None:
            stats.trajectory_tokens = int(tokens)
    reply.stats = stats
    return reply


def drive(episode: Episode, policy: Policy) -> EpisodeResult:
    """Runs an episode generator to its end, answering every request with ``policy`` (one at a time).

    The caller starts the policy's trajectory (``policy.reset()``) beforehand.

    Returns:
        The episode's :class:`EpisodeResult`.
    """
    try:
        request = next(episode)
        while True:
            request = episode.send(answer_request(policy, request))
    except StopIteration as done:
        return done.value


def run_episode(
    policy: Policy,
    spec: BenchmarkSpec,
    question_text: str,
    toolbox: Toolbox | Callable[[str, str], str],
    config: AgentConfig | None = None,
) -> EpisodeResult:
    """Runs one episode; shorthand for ``AgentLoop(policy, spec, config).run(question_text, toolbox)``."""
    return AgentLoop(policy, spec, config).run(question_text, toolbox)
