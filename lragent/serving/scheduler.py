"""Continuous batching of served requests over one :class:`~lragent.engine.Engine`'s rows.

Each engine row holds one trajectory; the :class:`~lragent.serving.trajectories.TrajectoryStore` keeps its text.
Requests arrive from any thread (:meth:`Scheduler.submit`) and are served by one worker thread that owns the engine:

1. **admission**, at a step boundary, first come first served: the prompt is matched to the held trajectories that
   are not generating (:meth:`~lragent.serving.trajectories.TrajectoryStore.best_match`; the best is the one whose
   caches serve the requesting role the most positions under the scheme: any role's under ``base_lr_shared``, the
   role's own under ``non_shared``). A prompt that extends a trajectory continues it in its row; one that parts from
   it takes a spare row with the shared part's caches copied (:func:`~lragent.serving.rows.fork_row`; with no spare
   row, the trajectory is cut in place); a prompt that shares nothing takes an empty row or evicts the least recently
   used trajectory. Then the engine starts the role's step (:meth:`~lragent.engine.Engine.start`): the scheme's plan,
   i.e. only what the role's caches lack, is computed. A request waits while every row is generating.
2. **decoding**: one batched :meth:`~lragent.engine.Engine.advance` over every generating row (one step on the CPU,
   ``sync_every`` graph replays on CUDA), after which new tokens are streamed, finished rows leave the batch and
   waiting requests join it.

So a served greedy request computes what ``MultiAgentSession`` computes when the same role takes its turn on the
same trajectory (tested through the HTTP server against the session, every scheme). Requests and the worker talk
through events sent to a request's ``sink``: :class:`Admitted` (the response can start), :class:`Delta` (streamed
text), :class:`Finished`, :class:`Failed`. Nothing here knows HTTP.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lragent.device_share import is_oom
from lragent.engine import Engine, GenerationRequest, StepResult, find_stop
from lragent.serving.metrics import ServeMetrics
from lragent.serving.rows import abandon_rows, fork_row
from lragent.serving.text_encoder import text_encoder
from lragent.serving.trajectories import TextTrajectory, TrajectoryStore

IDLE_TICK_S = 0.1
"""How often an idle worker adds its idle seconds to the metrics."""


class RequestError(ValueError):
    """A request the server cannot serve as asked (a 4xx for the front end).

    Args:
        message: one line for the client.
        param: the request field at fault.
        code: a machine-readable code (``context_length_exceeded``, ``model_not_found``).
        status: the HTTP status the front end answers with.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


@dataclass(frozen=True)
class Admitted:
    """The request has a row and its prefill ran: the response can start."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """Streamed text (never past a stop string; the deltas of a request add up to its final text)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The request's result.

    Attributes:
        text: generated text, cut before the first stop string.
        finish_reason: ``stop`` (a stop string or end of sequence) or ``length``.
        prompt_tokens: tokens of the prompt (the trajectory's own for the matched part).
        completion_tokens: tokens generated (a stop string's and an end-of-sequence token included).
        cached_tokens: prompt tokens the role's step did not forward anew: held in the caches it reads
            (``prompt_tokens - (prefill_tokens - recomputed_tokens)``). Under ``droidspeak`` and ``base_shared`` part
            of them is processed again (``recomputed_tokens``): DroidSpeak's layer groups, the LR prefill.
        prefill_tokens: positions the step ran the model over (new positions plus recomputed ones).
        recomputed_tokens: of those, cached context processed again.
        trajectory_tokens: tokens of the trajectory after the request (its generated tokens kept).
        prefill_s: prefill seconds.
        decode_s: decode seconds.
        ttft_s: seconds from arrival to the first generated token.
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_tokens: int
    recomputed_tokens: int
    trajectory_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float


@dataclass(frozen=True)
class Failed:
    """The request ended without a result.

    Attributes:
        status: HTTP status (400, 500, 503).
        message: one line.
        param: the field at fault, if any.
        code: a machine-readable code, if any.
    """

    status: int
    message: str
    param: str | None = None
    code: str | None = None


Event = Admitted | Delta | Finished | Failed


@dataclass
class ServeRequest:
    """One completion request, as the scheduler serves it.

    Attributes:
        role: the role adapter (the request's ``model``).
        prompt: the prompt text (the trajectory so far).
        sink: receives the request's events, from the worker thread (must not block).
        max_tokens: generation bound; None: the rest of the context.
        temperature: 0 for greedy.
        top_p: nucleus mass in (0, 1].
        stop: stop strings.
        seed: sampling seed (token i uses noise keyed by (seed, i)).
        stream: send :class:`Delta` events as text is generated.
        prompt_field: the request field that holds the prompt (``prompt``, or ``messages`` for chat): errors name it.
        cancelled: set by :meth:`cancel` (a client gone): the request leaves the queue, or its row stops generating.
        arrived: when it arrived (``time.perf_counter()``).
    """

    role: str
    prompt: str
    sink: Callable[[Event], None]
    max_tokens: int | None = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    stream: bool = False
    prompt_field: str = "prompt"
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class _Run:
    """A request in a row."""

    req: ServeRequest
    prompt_tokens: int
    first_token: float | None = None
    sent: str = ""  # text streamed so far
    seen: int = 0  # generated tokens seen at the last sync
    stopping: bool = False


class Scheduler:
    """Serves :class:`ServeRequest` objects on ``engine``'s rows from one worker thread (see the module docstring).

    Args:
        engine: the engine (its rows, capacity and scheme are the server's); only the worker thread touches it.
        tokenizer: the model's tokenizer (``tokenizer(text, add_special_tokens=False)["input_ids"]``, ``decode``).
        steps_per_sync: decode steps per :meth:`~lragent.engine.Engine.advance` (default: the engine's
            ``sync_every`` with CUDA graphs, else 1): how often tokens are streamed and rows join or leave.
        metrics: where counters go (default: a new :class:`~lragent.serving.metrics.ServeMetrics`).
        launch_ahead: after each round, the next decode steps of the requests still generating are queued before the
            worker streams, finishes and admits (:meth:`~lragent.engine.Engine.launch`), so the device decodes while
            the host works; a request admitted then joins the round after. Each request gets the same tokens (its
            sampling depends on its seed and token index only); on a GPU the decode widths it meets may differ.
        profiler: a diagnostic recorder told the engine's decode step count at the top of each round (``step(n)``,
            as ``eval``'s ``LRAGENT_EVAL_PROFILE`` recorder is; the serving commands pass the one
            ``LRAGENT_SERVE_PROFILE`` asks for); None: nothing is recorded.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: object,
        *,
        steps_per_sync: int | None = None,
        metrics: ServeMetrics | None = None,
        launch_ahead: bool = False,
        profiler: Any | None = None,
    ) -> None:
        if tokenizer is None:
            raise ValueError("a served model needs a tokenizer (the prompts are text)")
        self.engine = engine
        self.tokenizer = tokenizer
        self._tokenize = text_encoder(tokenizer)  # text -> ids, keeping the interpreter lock (see text_encoder)
        self.store = TrajectoryStore(engine.rows)
        self.context = engine.pool.capacity - 1  # the prompt and its completion, per trajectory
        self.steps_per_sync = steps_per_sync or (engine.sync_every if engine.cuda_graphs else 1)
        self.metrics = metrics or ServeMetrics()
        self.roles = tuple(engine.model.router.roles)
        self._inbox: deque[ServeRequest] = deque()
        self._waiting: deque[ServeRequest] = deque()
        self._running: dict[int, _Run] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.launch_ahead = bool(launch_ahead)
        self._launched = False  # a round of decode steps is queued and not yet collected
        self.profiler = profiler

    # ---- the client side (any thread) ----------------------------------------------------------------------------
    def submit(self, req: ServeRequest) -> None:
        """Queues ``req``; its events go to ``req.sink``. Raises :class:`RequestError` for an unknown role (400) or
        a server that is shutting down (503)."""
        if req.role not in self.roles:
            raise RequestError(
                f"The model `{req.role}` does not exist: allowed {', '.join(self.roles)}",
                param="model",
                code="model_not_found",
            )
        with self._cond:
            if self._stopping:
                raise RequestError("the server is shutting down", code="shutting_down", status=503)
            self._inbox.append(req)
            self._cond.notify()

    def start(self) -> Scheduler:
        """Starts the worker thread."""
        if self._thread is None:
            device = self.engine.device
            self._thread = threading.Thread(target=self._loop, args=(device,), name="lragent-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Refuses new requests, serves every queued and running one to its end, then stops the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the worker ----------------------------------------------------------------------------------------------
    def _loop(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        clock = time.perf_counter
        with torch.no_grad():
            while True:
                t0 = clock()
                with self._cond:
                    while not (self._inbox or self._waiting or self._running or self._stopping):
                        # idle counted as it passes (not all at the wake): a reader of /metrics between two requests
                        # sees the idle seconds up to its read, so a window between two reads holds its own only
                        self._cond.wait(IDLE_TICK_S)
                        now = clock()
                        self.metrics.worker_time("idle", now - t0)
                        t0 = now
                    self._waiting.extend(self._inbox)
                    self._inbox.clear()
                    if self._stopping and not (self._waiting or self._running):
                        self._publish()
                        return
                t1 = clock()
                self.metrics.worker_time("idle", t1 - t0)
                if self.profiler is not None:  # told the decode steps so far at the top of each round
                    self.profiler.step(self.engine.decode_steps)
                self._cancel_requested()
                admitted = self._admit()
                t2 = clock()
                self.metrics.worker_time("admit", t2 - t1)
                if self._running:
                    steps, captured = self.engine.decode_steps, self.engine.capture_s
                    self._step()
                    t3 = clock()
                    capture = self.engine.capture_s - captured  # a new decode width's graphs, inside the step
                    self.metrics.worker_time("capture", capture)
                    self.metrics.worker_time("decode", t3 - t2 - capture, self.engine.decode_steps - steps)
                    t2 = t3
                elif self._waiting and not admitted:  # defensive: nothing can run now; wait for a change
                    with self._cond:
                        self._cond.wait(0.05)
                    t3 = clock()
                    self.metrics.worker_time("idle", t3 - t2)
                    t2 = t3
                self._publish()
                self.metrics.worker_time("other", clock() - t2)

    def _send(self, req: ServeRequest, event: Event) -> None:
        try:
            req.sink(event)
        except Exception:  # a client's sink that is gone (its event loop closed) must not stop the worker
            pass

    def _publish(self) -> None:
        with self._cond:
            waiting = len(self._waiting) + len(self._inbox)
        self.metrics.set_queue(len(self._running), waiting)
        self.metrics.set_cache(len(self.store), self.engine.cache_bytes())

    def _cancel_requested(self) -> None:
        for req in [r for r in self._waiting if r.cancelled.is_set()]:
            self._waiting.remove(req)
            self.metrics.finished("cancelled")
        for row, run in self._running.items():
            if run.req.cancelled.is_set() and not run.stopping:
                # the row ends at its next sampled token, through the engine's own bookkeeping (its caches stay
                # consistent and the trajectory, with what it generated, stays held)
                self.engine.d_remaining[row].fill_(0)  # queued behind any steps in flight: no wait for them
                run.stopping = True

    def _admit(self) -> bool:
        """Places waiting requests in rows while there are rows; returns whether any request left the queue."""
        progress = False
        while self._waiting:
            req = self._waiting[0]
            try:
                placed = self._place(req)
            except RequestError as exc:
                self._waiting.popleft()
                self._fail(req, Failed(exc.status, str(exc), exc.param, exc.code))
                progress = True
                continue
            except Exception as exc:  # out of memory in the prefill (or a bug): this request fails, the server serves
                self._waiting.popleft()
                self._fail(req, self._failure(exc))
                progress = True
                continue
            if not placed:
                break
            self._waiting.popleft()
            progress = True
        return progress

    def _check_length(self, req: ServeRequest, n: int) -> int:
        """The request's generation bound once its prompt is ``n`` tokens; raises :class:`RequestError` when the two
        do not fit in the context."""
        if n == 0:
            raise RequestError(
                f"Invalid value for '{req.prompt_field}': it holds no token of text. Allowed: at least one token.",
                req.prompt_field,
            )
        limit = self.context
        if req.max_tokens is None:
            if n >= limit:
                raise RequestError(
                    f"This model's maximum context length is {limit} tokens. However, your {req.prompt_field} "
                    f"holds {n} tokens, leaving none to generate. Please reduce the length of the {req.prompt_field}.",
                    req.prompt_field,
                    "context_length_exceeded",
                )
            return limit - n
        if n + req.max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + req.max_tokens} tokens ({n} in the {req.prompt_field}, {req.max_tokens} in the completion). "
                f"Please reduce the length of the {req.prompt_field} or max_tokens.",
                req.prompt_field,
                "context_length_exceeded",
            )
        return req.max_tokens

    def _place(self, req: ServeRequest) -> bool:
        """Gives ``req`` a row and starts its step; False when every row is generating."""
        eng = self.engine
        t0 = time.perf_counter()
        role = eng.model.router.id(req.role)
        busy = set(self._running)
        candidates = [r for r in self.store.held if r not in busy]

        def reusable(row: int, shared: int) -> int:
            return min(shared, eng.scheme.cached_len(eng.traj[row], role))

        tokenize_s = 0.0

        def tokenize(text: str) -> list[int]:  # timed apart: the tokenizer's calls, not the comparisons around them
            nonlocal tokenize_s
            started = time.perf_counter()
            try:
                return self._tokenize(text)
            finally:
                tokenize_s += time.perf_counter() - started

        match = self.store.best_match(req.prompt, candidates, eng.ids, reusable, tokenize)
        tokens = match.tokens if match is not None else tokenize(req.prompt)
        max_tokens = self._check_length(req, len(tokens))
        t1 = time.perf_counter()
        self.metrics.admit_time("tokenize", tokenize_s)
        self.metrics.admit_time("match", t1 - t0 - tokenize_s)
        evicted = forked = False
        if match is not None and match.extends:
            row = match.row
        elif match is not None:
            row = self.store.spare_row(busy, exclude=[match.row])
            if row is None:  # no other row: the trajectory is cut to the shared part in place
                row = match.row
                eng.truncate(row, match.shared)
            else:
                evicted = self._empty(row)
                fork_row(eng, match.row, row, match.shared)
                forked = True
        else:
            row = self.store.spare_row(busy)
            if row is None:
                return False  # (the match's seconds are counted: the request is matched again when a row frees)
            evicted = self._empty(row)
        held = (
            match.trajectory
            if match is not None
            else TextTrajectory(req.prompt, [(0, 0), (len(req.prompt), len(tokens))])
        )
        eng.append(row, tokens[len(eng.ids(row)) :])
        self.store.set(row, held)
        t2 = time.perf_counter()
        self.metrics.admit_time("rows", t2 - t1)
        gen = GenerationRequest(
            role=role,
            max_new_tokens=max_tokens,
            stop=tuple(req.stop),
            temperature=float(req.temperature),
            top_p=float(req.top_p),
            seed=int(req.seed),
        )
        try:
            done = eng.start(row, gen)
        except Exception:
            self._discard(row)
            raise
        finally:
            self.metrics.admit_time("start", time.perf_counter() - t2)
        self.metrics.count_event(evicted=evicted, forked=forked)
        self._running[row] = _Run(req, len(tokens))
        self._send(req, Admitted(prompt_tokens=len(tokens)))
        if done is not None:
            self._finish(done, time.perf_counter())
        return True

    def _empty(self, row: int) -> bool:
        """Empties a spare row; returns whether it held a trajectory (evicted)."""
        evicted = row in self.store.held
        self.store.drop(row)
        self.engine.reset(row)
        return evicted

    def _discard(self, row: int) -> None:
        """Drops a row's trajectory after a failure (its caches may be half written)."""
        self.store.drop(row)
        abandon_rows(self.engine, [row])

    def _failure(self, exc: BaseException) -> Failed:
        if is_oom(exc):
            return Failed(503, "out of memory serving this request; the server goes on: retry, or send a shorter "
                               "prompt or a smaller max_tokens", code="out_of_memory")  # fmt: skip
        print(f"lragent serve: internal error: {exc!r}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return Failed(500, "internal error while serving this request (logged by the server)", code="internal_error")

    def _fail(self, req: ServeRequest, failed: Failed) -> None:
        self.metrics.finished("cancelled" if req.cancelled.is_set() else "error")
        self._send(req, failed)

    def _step(self) -> None:
        """One round: the decode steps (collected when queued by the last round), what they produced read back, the
        next round queued with ``launch_ahead``, then the text streamed and the finished requests answered."""
        eng = self.engine
        try:
            if self._launched:
                self._launched = False
                finished = eng.collect()
            else:
                finished = eng.advance(max_steps=self.steps_per_sync)
        except Exception as exc:  # out of memory mid-decode: every generating request fails, the server goes on
            self._fail_rows(list(self._running), exc)
            return
        now = time.perf_counter()
        done = {res.row for res in finished}
        live = [(row, run) for row, run in self._running.items() if row not in done]
        progress = self._progress(live)  # read back before the next round is queued (a read then would wait for it)
        if self.launch_ahead and live:
            try:
                self._launched = eng.launch() > 0
            except Exception as exc:  # the requests still generating fail; those that finished are answered
                self._fail_rows([row for row, _ in live], exc)
                progress = []
        for run, n, ids in progress:
            if n and run.first_token is None:
                run.first_token = now
            if ids is not None:
                self._stream(run, n, ids)
        for res in finished:
            self._finish(res, now)

    def _progress(self, live: list[tuple[int, _Run]]) -> list[tuple[_Run, int, list[int] | None]]:
        """Per generating row: its token count and, for a streaming row with new tokens, its generated ids."""
        if not any(run.first_token is None or run.req.stream for _, run in live):
            return []
        counts = self.engine.d_count.cpu()
        ids = self.engine.generated_ids(counts, [row for row, run in live if run.req.stream and counts[row] > run.seen])
        return [(run, int(counts[row]), ids.get(row)) for row, run in live]

    def _fail_rows(self, rows: list[int], exc: BaseException) -> None:
        """Fails the requests of ``rows`` with ``exc`` and drops their trajectories (their caches may be half
        written)."""
        failed = self._failure(exc)
        for row in rows:
            self._fail(self._running.pop(row).req, failed)
            self.store.drop(row)
        abandon_rows(self.engine, rows)

    def _stream(self, run: _Run, n: int, ids: list[int]) -> None:
        """Sends the new text of a streaming row: never past a stop string, holding back what could still be the
        start of one (and an unfinished character)."""
        stops = run.req.stop
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = find_stop(text, stops) if stops else None
        if cut is not None:
            text = text[:cut]
        else:
            hold = max((len(s) for s in stops), default=1) - 1
            text = text[: len(text) - hold]
        text = text.rstrip("\ufffd")
        if len(text) > len(run.sent) and text.startswith(run.sent):
            self._send(run.req, Delta(text[len(run.sent) :]))
            run.sent = text
        run.seen = n

    def _finish(self, res: StepResult, now: float) -> None:
        run = self._running.pop(res.row)
        held = self.store.held[res.row]
        held.append(res.text, res.kept_tokens)
        self.store.touch(res.row)
        assert held.n_tokens == len(self.engine.ids(res.row)), (held.n_tokens, len(self.engine.ids(res.row)))
        req, generated = run.req, len(res.generated_ids)
        cached = max(0, run.prompt_tokens - (res.prefill_tokens - res.recomputed_tokens))
        first = run.first_token if run.first_token is not None else now
        tpot = (now - first) / (generated - 1) if generated > 1 else None
        if req.cancelled.is_set():
            self.metrics.finished("cancelled", run.prompt_tokens, generated, cached)
            return
        if req.stream and len(res.text) > len(run.sent) and res.text.startswith(run.sent):
            self._send(req, Delta(res.text[len(run.sent) :]))
        reason = "length" if res.stop_reason == "length" else "stop"
        self.metrics.finished(reason, run.prompt_tokens, generated, cached, first - req.arrived, tpot)
        self._send(
            req,
            Finished(
                text=res.text,
                finish_reason=reason,
                prompt_tokens=run.prompt_tokens,
                completion_tokens=generated,
                cached_tokens=cached,
                prefill_tokens=res.prefill_tokens,
                recomputed_tokens=res.recomputed_tokens,
                trajectory_tokens=len(self.engine.ids(res.row)),
                prefill_s=res.prefill_s,
                decode_s=res.decode_s,
                ttft_s=first - req.arrived,
            ),
        )
