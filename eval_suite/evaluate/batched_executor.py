"""Many episodes at once on one engine: the batched :class:`~eval_suite.evaluate.executors.EpisodeExecutor`.

Each engine row holds one episode's trajectory. An episode's requests are answered as they come: a
:class:`~lragent.agents.requests.Choose` at once (teacher-forced scoring on its row), a
:class:`~lragent.agents.requests.Generate` by prefilling its row and entering it into the batched decode, which
advances every generating row together (CUDA graphs on a GPU). When a row's generation ends, its episode gets the
reply and asks for the next call; when an episode ends, the next task takes its row (continuous refill).

Sampling follows the eval's protocol: generate call ``i`` of an episode samples with seed ``episode seed + i``; the
noise depends only on that seed and the token index, so an episode draws the same tokens whatever shares its batch.
Tasks of different schemes are run scheme by scheme (one engine, hence one cache layout, at a time).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from eval_suite.evaluate.prompt_template import PromptTemplate, prompt_template_enabled
from lragent.agents import EpisodeResult
from lragent.agents.requests import Choose, Generate, Reply, StepStats, best_option
from lragent.engine import Engine, GenerationRequest, StepResult
from lragent.lora_model import MultiLoraModel

PREFILL_IN_DECODE = 2048
"""On CUDA, agent calls that append up to this many tokens are fed through the batched decode graph: with
:data:`FEED_BUDGET` that takes in the prompts too (a HotpotQA prompt with its paragraphs is about 1,400 tokens), whose
eager prefill on a row alone, hundreds of kernel launches from Python, was most of the host's time between decode steps
(results/eval_speed/README.md, 2026-11-27: an H100's HotpotQA loop 1.95x shorter than at 128 without a budget)."""
FEED_BUDGET = 256
"""On CUDA, the extra token rows of a decode step for fed tokens (``Engine``'s ``feed_budget``), lent in row order to
the rows that feed. Records in bf16 differ from one-token feeding (``--feed_budget 0 --prefill_in_decode 128`` gives
the records of runs before 2026-11-27); the same at any ``--devices`` with ``--batch_invariant true``."""

PROFILE_ENV = "LRAGENT_EVAL_PROFILE"
"""``LRAGENT_EVAL_PROFILE=DIR[:FIRST:COUNT]``: torch's profiler records the engine's decode calls FIRST .. FIRST + COUNT
(default 300 and 100: past the graph captures) and writes where their device and host time went to
``DIR/eval_profile_<pid>.txt`` (a diagnostic: the profiler slows the steps it records, not the others)."""

PY_PROFILE_HEADING = "Python, by cumulative time (every thread on Python 3.12+, where cProfile records them all):"
"""The heading of the Python profile written after torch's tables."""

SERVE_PROFILE_ENV = "LRAGENT_SERVE_PROFILE"
"""The same for a server (``lragent serve``, the servers ``bench serve`` starts): its scheduler's rounds from decode
step FIRST until COUNT steps later, admissions and streaming included, into ``DIR/serve_profile_<pid>.txt``."""

_ENGINE_COUNTERS = (
    "decode_steps", "advance_s", "sync_s", "replay_s", "wait_s", "capture_s", "feed_rows", "feed_tokens",
)  # fmt: skip
"""The engine's counters an executor sums over its engines (its timing.json figures)."""


@dataclass
class _Lane:
    """One scheme's engine in :meth:`BatchedExecutor._run_lanes`: its tasks still to start, its rows."""

    eng: Engine
    queue: list
    free: list[int]
    stream: torch.cuda.Stream | None = None
    name: str = ""  # the scheme's name (a stall report names the lane)
    active: dict[int, _Row] = field(default_factory=dict)
    launched: bool = False
    template: PromptTemplate | None = None  # the engine's template row (LRAGENT_PROMPT_TEMPLATE=1), else None

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.active)


def _on(stream: torch.cuda.Stream | None):
    """``torch.cuda.stream(stream)``, or nothing without one."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass
class _Row:
    task: object
    calls: int = 0
    request: object | None = None
    done: list = field(default_factory=list)


class BatchedExecutor:
    """Runs episode tasks ``batch`` at a time on one engine per scheme.

    Args:
        model: the multi-LoRA model (on its device).
        tokenizer: its tokenizer.
        batch: rows (episodes in flight).
        capacity: positions per trajectory; keep it above the agent loop's ``max_context_tokens`` plus one cycle.
        temperature: sampling temperature (0: greedy).
        top_p: nucleus mass.
        use_kernel: fused kernels on CUDA.
        cuda_graphs: CUDA-graph decoding (default: on CUDA).
        droidspeak_layers: DroidSpeak's recompute layers.
        eos_token_ids: tokens that end a generation (default: the model's generation config).
        prefill_in_decode: steps that append at most this many tokens feed them through the batched decode step
            instead of an eager prefill of their row (:class:`~lragent.engine.Engine`); default
            :data:`PREFILL_IN_DECODE` on CUDA, 0 (off) elsewhere, where eager decode steps gain nothing.
        feed_budget: extra token rows per decode step for fed tokens, lent in row order to the rows that feed
            (default :data:`FEED_BUDGET` where ``prefill_in_decode`` is on by default, i.e. on CUDA; else 0).
        batch_invariant: an engine of ``batch`` rows even for fewer tasks, decoding every step at that width
            (:class:`~lragent.engine.Engine`): an episode's tokens then do not depend on the other episodes beside
            it, so ``--devices N``, a resumed run or another ``--limit`` give the same episodes at the same batch.
        concurrent_schemes: tasks of several schemes run at once, each scheme on its own engine of ``batch`` rows
            (and on CUDA its own stream), the host serving one engine while the device runs the others; the episodes
            are those of one scheme at a time. Each scheme's engine needs its memory at the same time.
        launch_ahead: after each collect, the next decode steps of the rows still generating are queued before the
            host answers the rows that finished (their agents' tools, prompts and the next calls' starts), so the
            device decodes while the host works; a row that starts then joins the steps after those. Each row draws
            the same tokens (its sampling depends on its seed and token index only); on a GPU the decode widths a
            row meets may differ, as with another batch.
    """

    def __init__(
        self,
        model: MultiLoraModel,
        tokenizer: object,
        *,
        batch: int = 64,
        capacity: int = 8192,
        temperature: float = 0.0,
        top_p: float = 1.0,
        use_kernel: bool = True,
        cuda_graphs: bool | None = None,
        droidspeak_layers: list[int] | None = None,
        eos_token_ids: list[int] | None = None,
        prefill_in_decode: int | None = None,
        batch_invariant: bool = False,
        feed_budget: int | None = None,
        concurrent_schemes: bool = False,
        launch_ahead: bool = False,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        on_cuda = next(model.model.parameters()).device.type == "cuda"
        if prefill_in_decode is None:
            prefill_in_decode = PREFILL_IN_DECODE if on_cuda else 0
        if feed_budget is None:
            feed_budget = FEED_BUDGET if on_cuda and prefill_in_decode else 0
        if isinstance(feed_budget, bool) or feed_budget < 0:
            raise ValueError(f"feed_budget must be >= 0, got {feed_budget!r}")
        self.prefill_in_decode = prefill_in_decode
        self.feed_budget = int(feed_budget)
        self.batch_invariant = batch_invariant
        self.model = model
        self.tokenizer = tokenizer
        self.batch = batch
        self.capacity = capacity
        self.temperature = temperature
        self.top_p = top_p
        self.use_kernel = use_kernel
        self.cuda_graphs = cuda_graphs
        self.droidspeak_layers = droidspeak_layers
        self.eos_token_ids = eos_token_ids
        self.generated_tokens = 0
        self.decode_steps = 0  # the engines' batched decode steps (timing.json: hardware-free cost of a run)
        # timing.json's split of the loop: seconds in the engines' advance() (of which sync_s reading results back)
        # and serving the episodes' requests between them (tools, tokenizer, prompts, eager engine calls)
        self.advance_s = 0.0
        self.sync_s = 0.0
        self.replay_s = 0.0  # of advance_s: the CUDA-graph replay calls (lragent.engine.Engine.replay_s)
        self.wait_s = 0.0  # of sync_s: the first read-back of each sync, the wait for the device
        self.capture_s = 0.0  # of advance_s: the graph captures, kernel compiles included (a fixed cost)
        self.feed_rows = 0  # the feeding steps' extra token rows computed (lragent.engine.Engine.feed_rows)
        self.feed_tokens = 0  # of those, rows that carried a fed token (the rest: padding to the step's width)
        self.agent_s = 0.0
        self._reserved: dict[str, tuple[int, Engine]] = {}  # scheme -> (rows, engine) made under the alloc lock
        self.concurrent_schemes = bool(concurrent_schemes)
        self.launch_ahead = bool(launch_ahead)
        self.model_device = next(model.model.parameters()).device
        self._profile = _StepProfiler.from_env()
        # progress for a stall watchdog (eval_suite.evaluate.stall_watchdog): called as each engine call returns
        self.heartbeat: Callable[[], None] = lambda: None
        self._lanes: list[_Lane] = []
        self._in_call: str | None = None  # the engine call the host is in ("<scheme> <call>"), for describe()
        # LRAGENT_PROMPT_TEMPLATE=1: each engine has one more row, whose caches of the shared opening episodes copy
        self.prompt_template = prompt_template_enabled()
        self._templates: list[PromptTemplate] = []  # every lane's, kept past its lane for template_tokens

    @property
    def template_tokens(self) -> int:
        """Opening tokens episodes copied from a template row instead of computing them (timing.json)."""
        return sum(t.copied_tokens for t in self._templates)

    def describe(self) -> str:
        """The executor's state in a few words: the engine call in progress, each lane's rows and queue."""
        lanes = ", ".join(
            f"{lane.name}: {len(lane.active)} rows active, {len(lane.queue)} queued" for lane in self._lanes
        )
        call = f"in {self._in_call}" if self._in_call else "between engine calls"
        return f"{call}; {self.decode_steps} decode steps; lanes: {lanes or 'none'}"

    def reserve(self, scheme: str, tasks: int) -> None:
        """Allocates the engine (its static caches) that running ``tasks`` tasks of ``scheme`` first needs, now:
        under the caller's allocation lock, so the next process that sizes its batch sees this memory as taken."""
        rows = self._rows(tasks)
        if rows >= 1:
            self._reserved[str(scheme)] = (rows, self._engine(scheme, rows))

    def _rows(self, tasks: int) -> int:
        """Engine rows for ``tasks`` tasks: the batch, or fewer when fewer tasks come (not when batch-invariant)."""
        return self.batch if self.batch_invariant and tasks >= 1 else min(self.batch, tasks)

    def _engine(self, scheme: str, rows: int) -> Engine:
        return Engine(
            self.model,
            scheme,
            rows=rows + int(self.prompt_template),  # the template's row is the last
            capacity=self.capacity,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            droidspeak_layers=self.droidspeak_layers if scheme == "droidspeak" else None,
            use_kernel=self.use_kernel,
            cuda_graphs=self.cuda_graphs,
            prefill_in_decode=self.prefill_in_decode,
            batch_invariant=self.batch_invariant,
            feed_budget=self.feed_budget,
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def run(self, tasks: Iterable) -> Iterator[tuple[object, EpisodeResult]]:
        """Runs every task; yields ``(task, result)`` as episodes end (any order).

        One scheme at a time, or with ``concurrent_schemes`` every scheme's engine at once (:meth:`_run_lanes`)."""
        if self.concurrent_schemes:
            by_scheme: dict[str, list] = {}
            for task in tasks:
                by_scheme.setdefault(str(task.scheme), []).append(task)
            yield from self._run_lanes([group[0].scheme for group in by_scheme.values()], list(by_scheme.values()))
            return
        pending = iter(tasks)
        carry = None
        while True:
            first = carry if carry is not None else next(pending, None)
            carry = None
            if first is None:
                return
            group = [first]
            # one scheme at a time: take tasks while they share the first one's scheme
            for task in pending:
                if task.scheme != first.scheme:
                    carry = task
                    break
                group.append(task)
            yield from self._run_lanes([first.scheme], [group])

    def _lane(self, scheme: object, tasks: list) -> _Lane:
        """The engine (a reserved one if it fits) and row state of one scheme's tasks."""
        rows = self._rows(len(tasks))
        reserved = self._reserved.pop(str(scheme), None)
        stream = None
        if self.concurrent_schemes and self.model_device.type == "cuda":
            stream = torch.cuda.Stream(self.model_device)
            stream.wait_stream(torch.cuda.current_stream(self.model_device))  # the model and caches are made there
        with _on(stream):
            eng = reserved[1] if reserved is not None and reserved[0] >= rows else self._engine(scheme, rows)
        template = PromptTemplate(eng.rows - 1) if self.prompt_template else None
        if template is not None:
            self._templates.append(template)
        return _Lane(eng, list(tasks), list(range(rows)), stream, name=f"{scheme}", template=template)

    @torch.no_grad()
    def _run_lanes(self, schemes: list, groups: list[list]) -> Iterator[tuple[object, EpisodeResult]]:
        """Runs each scheme's tasks on its own engine (a *lane*). With one lane: fill its free rows, run decode steps
        until a row finishes, answer it, repeat. With several (``concurrent_schemes``), each lane's steps are queued
        on its own CUDA stream and the lanes are waited for and answered in turn, each queuing its next steps at
        once, so the host's work for one lane overlaps the device's work for the others. Each lane's engine sees the
        same calls in the same order either way: the episodes are the same."""
        self._lanes = []  # the previous scheme's engine goes before the next is made: one at a time holds one
        lanes = self._lanes = [self._lane(s, g) for s, g in zip(schemes, groups, strict=True)]
        self._reserved.clear()  # a reservation serves the run that follows it; unused, its memory goes back
        queued = self.concurrent_schemes or self.launch_ahead  # steps queued by launch(), then collected
        while any(lane.busy for lane in lanes):
            # each lane in turn: wait for its steps, answer what finished, refill its rows and queue its next steps;
            # meanwhile the device runs the steps the other lanes queued
            for lane in lanes:
                with _on(lane.stream):
                    finished = []
                    if lane.launched:
                        finished = self._count(lane, lane.eng.collect)
                        lane.launched = False
                    elif lane.active and not queued:  # one lane: steps until a row finishes
                        finished = self._count(lane, lane.eng.advance)
                    if self.launch_ahead and len(lane.active) > len(finished):
                        # the rows still generating decode on while the host answers those that finished
                        lane.launched = self._count(lane, lane.eng.launch) > 0
                    for res in finished:
                        self.generated_tokens += len(res.generated_ids)
                        state = lane.active[res.row]
                        result = self._timed_answer(lane, res.row, state, self._reply(res, lane.eng, res.row))
                        if result is not None:
                            del lane.active[res.row]
                            lane.free.append(res.row)
                            lane.free.sort()  # refill low rows first: the decode batch stays small at the tail
                            yield state.task, result
                    yield from self._fill(lane)
                    if lane.active and queued and not lane.launched:
                        lane.launched = self._count(lane, lane.eng.launch) > 0

    def _count(self, lane: _Lane, call):
        """Calls ``call`` (one of the lane's engine's) and adds what the engine's counters moved to this executor's."""
        eng = lane.eng
        before = {k: getattr(eng, k) for k in _ENGINE_COUNTERS}
        if self._profile is not None:
            self._profile.step(self.decode_steps)
        self._in_call = f"{lane.name} {call.__name__}"
        out = call()
        self._in_call = None
        for k in _ENGINE_COUNTERS:
            setattr(self, k, getattr(self, k) + getattr(eng, k) - before[k])
        self.heartbeat()
        return out

    def _fill(self, lane: _Lane) -> Iterator[tuple[object, EpisodeResult]]:
        """Starts the next tasks on the lane's free rows (an episode that ends at once frees its row again)."""
        while lane.free and lane.queue:
            task = lane.queue.pop(0)
            if not task.take():  # a shard of a shared queue took it first
                continue
            row = lane.free.pop(0)
            lane.eng.reset(row)
            state = _Row(task)
            lane.active[row] = state
            result = self._timed_answer(lane, row, state, None)
            if result is not None:
                del lane.active[row]
                lane.free.append(row)
                yield task, result

    def _timed_answer(self, lane: _Lane, row: int, state: _Row, reply: Reply | None) -> EpisodeResult | None:
        started = time.perf_counter()
        try:
            return self._answer(lane.eng, row, state, reply, lane.template)
        finally:
            self.agent_s += time.perf_counter() - started

    def _answer(
        self, eng: Engine, row: int, state: _Row, reply: Reply | None, template: PromptTemplate | None = None
    ) -> EpisodeResult | None:
        """Sends ``reply`` and serves the episode's requests until it waits on generation or ends; an episode's
        opening starts from ``template`` where it shares it."""
        episode = state.task.episode
        try:
            request = episode.send(reply) if reply is not None else next(episode)
            while True:
                if request.new_text:
                    tokens = self._encode(request.new_text)
                    if template is not None and not eng.ids(row):
                        tokens = template.open(eng, row, tokens, self.model.router.id(request.role))
                    eng.append(row, tokens)
                if isinstance(request, Choose):
                    options = [self._encode(o) for o in request.options]
                    role = self.model.router.id(request.role)
                    scores = eng.score(row, role, options)
                    best = best_option(scores, [len(o) for o in options], request.score)
                    eng.append(row, self._encode(request.appended(best)))
                    stats = StepStats(prefill_tokens=sum(len(o) for o in options), trajectory_tokens=len(eng.ids(row)))
                    request = episode.send(Reply(choice=best, stats=stats))
                    continue
                assert isinstance(request, Generate), request
                seed = state.task.seed + state.calls  # generate call i samples with seed + i (SessionPolicy)
                state.calls += 1
                req = GenerationRequest(
                    role=self.model.router.id(request.role),
                    max_new_tokens=request.max_new_tokens,
                    stop=tuple(request.stop),
                    temperature=self.temperature,
                    top_p=self.top_p,
                    seed=seed,
                )
                done = eng.start(row, req)
                if done is None:
                    return None  # generating: the reply comes from the engine's collect()
                request = episode.send(self._reply(done, eng, row))
        except StopIteration as stop:
            return stop.value

    @staticmethod
    def _reply(res: StepResult, eng: Engine, row: int) -> Reply:
        stats = StepStats(
            prefill_tokens=res.prefill_tokens,
            decode_tokens=len(res.generated_ids),
            prefill_s=res.prefill_s,
            decode_s=res.decode_s,
            recomputed_tokens=res.recomputed_tokens,
            trajectory_tokens=len(eng.ids(row)),
        )
        return Reply(text=res.text, stats=stats)


class _StepProfiler:
    """:data:`PROFILE_ENV`'s recorder: starts torch's profiler at decode call ``first`` and writes its table after
    ``count`` calls, with Python's own profile of the calling thread over the same calls (the functions by their
    cumulative time: where the host's seconds go between the device's kernels)."""

    def __init__(self, folder: str, first: int = 300, count: int = 100, name: str = "eval") -> None:
        self.folder, self.first, self.count, self.name = folder, first, count, name
        self._prof = None
        self._done = False

    @classmethod
    def from_env(cls, env: str = PROFILE_ENV, name: str = "eval") -> _StepProfiler | None:
        """The recorder ``env`` asks for (``DIR[:FIRST:COUNT]``), writing ``DIR/<name>_profile_<pid>.txt``; None when
        it is unset or empty."""
        import os

        spec = os.environ.get(env)
        if not spec:
            return None
        folder, *rest = spec.split(":")
        return cls(folder, *(int(x) for x in rest[:2]), name=name)

    def step(self, calls: int) -> None:
        if self._done:
            return
        if self._prof is None and calls >= self.first:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            import cProfile

            self._py = cProfile.Profile()
            self._py.enable()
            self._start = (calls, time.perf_counter())
        elif self._prof is not None and calls >= self._start[0] + self.count:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self._start[1]
            self._py.disable()
            self._prof.__exit__(None, None, None)
            import io
            import os
            import pstats
            from pathlib import Path

            table = self._prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
            cpu = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            py = io.StringIO()
            pstats.Stats(self._py, stream=py).sort_stats("cumulative").print_stats(45)
            path = Path(self.folder) / f"{self.name}_profile_{os.getpid()}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            text = f"decode calls {self._start[0]}..{calls}, wall {wall:.3f} s\n\n{table}\n\n{cpu}\n"
            path.write_text(f"{text}\n{PY_PROFILE_HEADING}\n{py.getvalue()}\n")
            self._done = True


def serve_profiler() -> _StepProfiler | None:
    """The recorder :data:`SERVE_PROFILE_ENV` asks for (the serving commands hand it to their scheduler); None when
    unset."""
    return _StepProfiler.from_env(SERVE_PROFILE_ENV, "serve")
