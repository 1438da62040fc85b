"""How episodes are run: an executor takes episode tasks and gives back their results, in any order.

A task is one episode as a request generator (:meth:`lragent.agents.AgentLoop.episode`) plus what the runner
needs to file its result. :class:`SequentialExecutor` runs one task at a time with a fresh policy each (the eval
command's: a :class:`~lragent.agents.SessionPolicy` over a ``MultiAgentSession``); a batched executor may hold many
episodes at once, answer their requests together and hand results back as episodes end. The runner appends each
result to the episode log as soon as it arrives, so any order is safe.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from eval_suite.evaluate.benchmarks import Question
from lragent.agents import EpisodeResult, Policy, drive
from lragent.schemes import Scheme


@dataclass
class EpisodeTask:
    """One episode to run.

    Attributes:
        key: ``(row, run, question id)``: the episode-log key of its record.
        scheme: the cache sharing scheme to run it under (parsed by the command: a ``Scheme``).
        seed: the episode's sampling seed (a function of base seed, run and question: the same for every scheme).
        question: the question.
        episode: the request generator; its first request starts a fresh trajectory.
        claim: asked once, when a row or the policy is about to start the episode: False means another process of
            a shared queue (:class:`~eval_suite.evaluate.work_queue.WorkQueue`) took it, and the executor skips it.
            None: always run.
    """

    key: tuple[str, int, str]
    scheme: Scheme
    seed: int
    question: Question
    episode: Generator
    claim: Callable[[], bool] | None = field(default=None, compare=False)

    def take(self) -> bool:
        """Whether this executor runs the task: its claim succeeds (or it has none)."""
        return self.claim is None or self.claim()


@runtime_checkable
class EpisodeExecutor(Protocol):
    """Runs episode tasks."""

    def run(self, tasks: Iterable[EpisodeTask]) -> Iterator[tuple[EpisodeTask, EpisodeResult]]:
        """Runs every task it takes (:meth:`EpisodeTask.take`, asked just before the task starts; pulling them
        lazily is allowed) and yields each with its result, in any order."""
        ...


class SequentialExecutor:
    """Runs tasks one after the other, each with a fresh policy from ``policy_factory(task)``.

    The executor does not look inside the task: the factory reads its scheme and seed (the eval command's factory
    opens a ``MultiAgentSession`` under ``task.scheme``).

    Args:
        policy_factory: ``task -> Policy``; called once per episode.
    """

    def __init__(self, policy_factory: Callable[[EpisodeTask], Policy]) -> None:
        self.policy_factory = policy_factory

    def run(self, tasks: Iterable[EpisodeTask]) -> Iterator[tuple[EpisodeTask, EpisodeResult]]:
        """Runs each task it takes (:meth:`EpisodeTask.take`) to its end (``policy.reset()``, then
        :func:`lragent.agents.drive`) and yields it."""
        for task in tasks:
            if not task.take():
                continue
            policy = self.policy_factory(task)
            policy.reset()
            yield task, drive(task.episode, policy)
