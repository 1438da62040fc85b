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

Each model call goes through a :class:`Policy`: ``generate(role, new_text, ...)`` gets only the text
appended since its previous call, so an implementation backed by a shared KV cache
(:class:`SessionPolicy`) prefills just that.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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

if TYPE_CHECKING:
    from lragent.agents.tools import Toolbox

ROLES: tuple[str, ...] = ("plan", "action", "reflect")

_ACTION_RE = re.compile(r"^\s*(\w+)\s*\[(.*?)\]?\s*\.?\s*$", re.DOTALL)


@dataclass
class StepStats:
    """Cost of one model call.

    Attributes:
        prefill_tokens: tokens prefilled for the call (the appended text, plus whatever the cache scheme
            recomputes).
        decode_tokens: tokens generated.
        prefill_s: prefill wall time in seconds.
        decode_s: decode wall time in seconds.
        recomputed_tokens: context tokens the cache scheme re-processed for this role (0 when not reported).
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_tokens: int = 0


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


@runtime_checkable
class Policy(Protocol):
    """The model side of the loop: one shared trajectory, extended by role calls.

    Attributes:
        last_stats: cost of the latest :meth:`generate` call, or None when the policy does not measure it.
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


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """Returns ``text`` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stop:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


class ScriptedPolicy:
    """A :class:`Policy` that plays canned outputs in order, for tests.

    Each output is cut at the call's stop strings, as a model session cuts generation, so a canned
    ``"Retrieve[Metallica]"`` for the action-type call yields ``"Retrieve"``. Every call is recorded in
    :attr:`calls` and the trajectory it saw is kept in :attr:`trajectory`.

    Args:
        outputs: canned generations, consumed one per :meth:`generate` call (across episodes).
        roles: if given, the role each call must have; a mismatch raises ``AssertionError`` (a test failure).

    Attributes:
        calls: ``(role, new_text, stop, output)`` per call.
        trajectory: the text of the current episode's shared trajectory.
        contexts: the full trajectory text each call generated after.
    """

    def __init__(self, outputs: Sequence[str], roles: Sequence[str] | None = None) -> None:
        if roles is not None and len(roles) != len(outputs):
            raise ValueError(f"roles has {len(roles)} entries for {len(outputs)} outputs")
        self.outputs = list(outputs)
        self.roles = list(roles) if roles is not None else None
        self.position = 0
        self.calls: list[tuple[str, str, list[str], str]] = []
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

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        """Plays the next canned output (see :class:`Policy`)."""
        if self.position >= len(self.outputs):
            raise IndexError(f"script exhausted after {self.position} outputs (role {role!r} asked for more)")
        if self.roles is not None:
            assert self.roles[self.position] == role, (
                f"call {self.position}: expected role {self.roles[self.position]!r}, got {role!r}"
            )
        self.trajectory += new_text
        self.contexts.append(self.trajectory)
        out = cut_at_stop(self.outputs[self.position], stop)
        self.position += 1
        self.trajectory += out
        self.calls.append((role, new_text, list(stop), out))
        self.last_stats = StepStats(prefill_tokens=len(new_text.split()), decode_tokens=len(out.split()))
        return out


class SessionPolicy:
    """A :class:`Policy` over the lead's ``lragent.session.MultiAgentSession`` (one shared KV cache).

    Each :meth:`reset` opens a new session; :meth:`generate` appends ``new_text`` with
    ``session.append_text`` and runs ``session.step(role, ...)``. The session keeps the generated text's
    tokens and drops the stop string's, matching what the loop expects.

    Tokenisation: text appended in pieces may tokenise slightly differently from the whole string at once.
    The loop appends at natural boundaries (pieces that end with a newline, or ``[\\n### Response:\\n``),
    which keeps the difference to the junction tokens.

    Args:
        model: the ``lragent`` MultiLoraModel.
        tokenizer: its tokenizer.
        scheme: cache sharing scheme (``non_shared``, ``full_shared``, ``droidspeak``, ``base_shared``,
            ``base_lr_shared``).
        temperature: sampling temperature (0 = greedy).
        seed: base seed; call ``i`` of an episode uses ``seed + i`` (None: no seeding).
        session_factory: builds a session from ``(model, scheme=..., tokenizer=...)``; defaults to
            ``lragent.session.MultiAgentSession`` (imported on first use).
        session_kwargs: extra keyword arguments for the session.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        scheme: str = "base_lr_shared",
        temperature: float = 0.0,
        seed: int | None = None,
        session_factory: Callable[..., Any] | None = None,
        session_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.model = model
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.temperature = temperature
        self.seed = seed
        self._factory = session_factory
        self._session_kwargs = dict(session_kwargs or {})
        self.session: Any = None
        self.last_stats: StepStats | None = None
        self._calls = 0

    def reset(self) -> None:
        """Opens a new, empty session."""
        factory = self._factory
        if factory is None:
            from lragent.session import MultiAgentSession  # torch-heavy; imported only when used

            factory = MultiAgentSession
        self.session = factory(self.model, scheme=self.scheme, tokenizer=self.tokenizer, **self._session_kwargs)
        self.last_stats = None
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
            role, max_new_tokens=max_new_tokens, temperature=self.temperature, seed=seed, stop=list(stop)
        )
        self.last_stats = StepStats(
            prefill_tokens=int(res.prefill_tokens),
            decode_tokens=len(res.generated_ids),
            prefill_s=float(res.prefill_s),
            decode_s=float(res.decode_s),
            recomputed_tokens=int(getattr(res, "recomputed_tokens", 0)),
        )
        return res.text


@dataclass
class AgentConfig:
    """Budgets of the agent loop.

    Attributes:
        max_steps: cycles (thought + action + observation, or a reflect step) before the episode is OOF.
        thought_tokens: generation budget of a thought (plan or reflect).
        action_type_tokens: generation budget of the plan's action type.
        argument_tokens: generation budget of the action's argument.
        reflect_tokens: generation budget of ``Reflect[...]``.
        max_context_tokens: the episode stops (OOF) when the policy's ``num_tokens`` exceeds this; None: no limit.
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
        num_tokens: the policy's token count at the end (0 if it does not report one).
        wall_s: episode wall time in seconds.
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
    """Runs AutoAct episodes with a :class:`Policy` on one benchmark.

    Args:
        policy: the model side.
        spec: the benchmark (prompt, tools, observation strings).
        config: budgets; defaults to :class:`AgentConfig()`.
    """

    def __init__(self, policy: Policy, spec: BenchmarkSpec, config: AgentConfig | None = None) -> None:
        self.policy = policy
        self.spec = spec
        self.config = config or AgentConfig()

    def run(self, question_text: str, toolbox: Toolbox | Callable[[str, str], str]) -> EpisodeResult:
        """Runs one episode.

        Args:
            question_text: the question as :func:`lragent.agents.prompts.format_question` formats it.
            toolbox: executes tool actions: ``toolbox(action_type, argument) -> observation``; a fresh
                :class:`~lragent.agents.tools.Toolbox` per episode.

        Returns:
            The :class:`EpisodeResult`.
        """
        cfg, spec, policy = self.config, self.spec, self.policy
        t0 = time.perf_counter()
        policy.reset()
        stats = {r: RoleStats() for r in ROLES}
        parts: list[str] = []
        pending = initial_text(spec, question_text)
        steps: list[Step] = []
        answer: str | None = None
        candidate: str | None = None
        awaiting_reflect = False
        stop_reason = "step_limit"

        def call(role: str, max_new_tokens: int, stop: list[str]) -> str:
            nonlocal pending
            new_text, pending = pending, ""
            out = policy.generate(role, new_text, max_new_tokens=max_new_tokens, stop=stop)
            stats[role].add(getattr(policy, "last_stats", None))
            parts.append(new_text)
            parts.append(out)
            return out

        for _ in range(cfg.max_steps):
            if cfg.max_context_tokens is not None and getattr(policy, "num_tokens", 0) > cfg.max_context_tokens:
                stop_reason = "context_limit"
                break
            if awaiting_reflect:
                awaiting_reflect = False
                thought = call("reflect", cfg.thought_tokens, ["\n"])
                pending = REFLECT_ACTION_MARKER
                out = call("reflect", cfg.reflect_tokens, ["\n"])
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

            thought = call("plan", cfg.thought_tokens, ["\n"])
            pending = ACTION_MARKER
            action_type = call("plan", cfg.action_type_tokens, ["[", "\n"]).strip()
            pending = ARGUMENT_MARKER
            argument = call("action", cfg.argument_tokens, ["]", "\n"])
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
            num_tokens=int(getattr(policy, "num_tokens", 0)),
            wall_s=time.perf_counter() - t0,
        )


def run_episode(
    policy: Policy,
    spec: BenchmarkSpec,
    question_text: str,
    toolbox: Toolbox | Callable[[str, str], str],
    config: AgentConfig | None = None,
) -> EpisodeResult:
    """Runs one episode; shorthand for ``AgentLoop(policy, spec, config).run(question_text, toolbox)``."""
    return AgentLoop(policy, spec, config).run(question_text, toolbox)
