"""The serving scheduler's parts, driven one worker round at a time on the test's thread (lragent/serving/scheduler.py;
tiny two-layer model, CPU): construction and submission checks, the length check, failures, streaming without
passing a stop string, admission (extend, fork, cut in place, evict, wait), cancellation, a failed decode round and
what a finished request reports. The threaded end-to-end checks are in test_serve_core.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_multi_lora

from lragent.engine import Engine, StepResult
from lragent.serving import scheduler as scheduler_mod
from lragent.serving.metrics import ServeMetrics
from lragent.serving.scheduler import (
    Admitted,
    Delta,
    Failed,
    Finished,
    RequestError,
    Scheduler,
    ServeRequest,
    _Run,
)
from lragent.serving.trajectories import TextTrajectory

TWO = {"num_hidden_layers": 2}


class Bytes:
    """One token per byte; id 0 is a special token (a BOS added unless ``add_special_tokens=False``, as transformers'
    tokenizers do) that ``skip_special_tokens`` leaves out of a decode (else ``<s>``)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [0] * bool(add_special_tokens) + list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        special = "" if skip_special_tokens is True else "<s>"
        return (
            "".join(special if i == 0 else bytes([i]).decode("latin-1") for i in ids)
            if any(i == 0 for i in ids)
            else bytes(int(i) for i in ids).decode("utf-8", "replace")
        )


class Wide(Bytes):
    """Bytes, with ``!`` an id past the tiny model's 256-token vocabulary (the engine refuses it)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = super().__call__(text, add_special_tokens)["input_ids"]
        return {"input_ids": [300 if i == ord("!") else i for i in ids]}


def _scheduler(rows: int = 2, capacity: int = 64, scheme: str = "base_lr_shared", tok=None, **kw) -> Scheduler:
    tok = tok or Bytes()
    model = tiny_multi_lora("tiny-llama", b_std=0.3, overrides=TWO)
    eng = Engine(model, scheme, rows=rows, capacity=capacity, tokenizer=tok, eos_token_ids=[])
    return Scheduler(eng, tok, **kw)


def _request(role: str, prompt: str, **kw) -> tuple[ServeRequest, list]:
    events: list = []
    return ServeRequest(role, prompt, events.append, **kw), events


def _round(sch: Scheduler) -> bool:
    """One pass of the worker's loop body (queue, cancel, admit, one decode round, publish)."""
    sch._waiting.extend(sch._inbox)
    sch._inbox.clear()
    sch._cancel_requested()
    admitted = sch._admit()
    if sch._running:
        sch._step()
    sch._publish()
    return admitted


def _drain(sch: Scheduler, limit: int = 300) -> None:
    for _ in range(limit):
        if not (sch._inbox or sch._waiting or sch._running):
            return
        _round(sch)
    raise AssertionError("requests still pending")


def _serve(sch: Scheduler, role: str, prompt: str, **kw) -> list:
    req, events = _request(role, prompt, **kw)
    sch.submit(req)
    _drain(sch)
    return events


def _slow_tokenizer(sch: Scheduler, seconds: float = 0.05) -> list[str]:
    """Makes each of ``sch``'s tokenizer calls take ``seconds`` more; returns the list the tokenised texts go to."""
    calls: list[str] = []
    plain = sch._tokenize

    def slow(text: str) -> list[int]:
        calls.append(text)
        time.sleep(seconds)
        return plain(text)

    sch._tokenize = slow
    return calls


# ---- construction and submission ----------------------------------------------------------------------------------
def _fake_engine(cuda_graphs: bool) -> SimpleNamespace:
    router = SimpleNamespace(roles=["plan", "act"])
    return SimpleNamespace(rows=3, pool=SimpleNamespace(capacity=65), sync_every=8, cuda_graphs=cuda_graphs,
                           model=SimpleNamespace(router=router))  # fmt: skip


def test_a_scheduler_takes_its_context_rounds_and_roles_from_the_engine():
    """Context: the pool's capacity less one; decode steps per round: the engine's ``sync_every`` with CUDA graphs,
    else 1, unless given; the roles as a tuple; its own metrics unless given; one store row per engine row."""
    sch = Scheduler(_fake_engine(True), Bytes())
    assert (sch.context, sch.steps_per_sync, sch.roles, sch.store.rows) == (64, 8, ("plan", "act"), 3)
    assert isinstance(sch.metrics, ServeMetrics) and sch.launch_ahead is False and sch._launched is False
    assert not sch.alive and sch._thread is None and sch._stopping is False
    assert Scheduler(_fake_engine(False), Bytes()).steps_per_sync == 1
    metrics = ServeMetrics()
    other = Scheduler(_fake_engine(True), Bytes(), steps_per_sync=3, metrics=metrics, launch_ahead=1)
    assert other.steps_per_sync == 3 and other.metrics is metrics and other.launch_ahead is True
    with pytest.raises(ValueError, match=r"^a served model needs a tokenizer \(the prompts are text\)$"):
        Scheduler(_fake_engine(False), None)


def test_submit_refuses_an_unknown_role_and_a_server_shutting_down():
    """An unknown role: 400 naming the allowed ones, param ``model``; after stop(): 503 ``shutting_down``; a good
    request is queued in the inbox."""
    sch = Scheduler(_fake_engine(False), Bytes())
    req, _ = _request("planner", "x")
    with pytest.raises(RequestError) as exc:
        sch.submit(req)
    assert str(exc.value) == "The model `planner` does not exist: allowed plan, act"
    assert (exc.value.param, exc.value.code, exc.value.status) == ("model", "model_not_found", 400)
    ok, _ = _request("act", "x")
    sch.submit(ok)
    assert list(sch._inbox) == [ok]
    sch.stop()
    with pytest.raises(RequestError) as exc:
        sch.submit(ok)
    assert str(exc.value) == "the server is shutting down"
    assert (exc.value.param, exc.value.code, exc.value.status) == (None, "shutting_down", 503)
    assert list(sch._inbox) == [ok]


def test_a_request_error_defaults_to_400_without_param_or_code():
    err = RequestError("bad")
    assert (str(err), err.param, err.code, err.status) == ("bad", None, None, 400)
    assert isinstance(err, ValueError)


def test_a_served_request_defaults_and_cancel():
    """Defaults: 16 tokens, greedy, top_p 1, no stop, seed 0, not streamed, field ``prompt``; cancel() sets the flag."""
    req, _ = _request("plan", "x")
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed, req.stream, req.prompt_field) == (
        16, 0.0, 1.0, (), 0, False, "prompt",
    )  # fmt: skip
    assert abs(req.arrived - time.perf_counter()) < 5 and not req.cancelled.is_set()
    req.cancel()
    assert req.cancelled.is_set()


def test_start_runs_one_worker_and_stop_ends_it():
    """start() twice starts one named daemon thread; stop() serves what is queued and ends it."""
    sch = _scheduler()
    assert sch.start() is sch
    thread = sch._thread
    assert sch.start() is sch and sch._thread is thread and thread.name == "lragent-scheduler" and thread.daemon
    req, events = _request("plan", "hello ", max_tokens=2)
    sch.submit(req)
    sch.stop(timeout=10)
    assert not sch.alive and isinstance(events[-1], Finished)
    snap = sch.metrics.snapshot()
    assert snap["decode_steps"] == sch.engine.decode_steps > 0 and snap["worker_s"]["decode"] > 0
    assert snap["worker_s"]["admit"] > 0 and snap["worker_s"]["other"] > 0 and snap["running"] == 0


def test_the_worker_tells_its_profiler_the_decode_steps_at_the_top_of_each_round():
    """A profiler (``LRAGENT_SERVE_PROFILE``'s recorder) is told the engine's decode step count once per round, before
    that round's admissions: 0 first, then the counts as they grow, none past the last step."""

    class Recorder:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def step(self, n: int) -> None:
            self.seen.append(n)

    rec = Recorder()
    sch = _scheduler(profiler=rec)
    req, events = _request("plan", "hello ", max_tokens=4)
    sch.submit(req)
    sch.start()
    sch.stop(timeout=10)
    assert isinstance(events[-1], Finished) and sch.engine.decode_steps > 1
    assert rec.seen[0] == 0 and rec.seen == sorted(rec.seen) and len(set(rec.seen)) > 1
    assert rec.seen[-1] < sch.engine.decode_steps  # told before its round's steps, never after the last


def test_the_worker_loop_serves_what_is_queued_then_returns_once_stopping():
    """The worker's loop run on this thread with two requests queued and the stop asked: it serves both (one row:
    the second waits for the first), publishes an empty queue and returns; its seconds per phase (admit, decode,
    other; nothing captured) add up to at most the wall time and its decode steps are the engine's."""
    sch = _scheduler(rows=1)
    a, a_events = _request("plan", "one ", max_tokens=3)
    b, b_events = _request("plan", "two ", max_tokens=2)
    sch.submit(a)
    sch.submit(b)
    sch._stopping = True
    t0 = time.perf_counter()
    sch._loop(torch.device("cpu"))
    wall = time.perf_counter() - t0
    assert isinstance(a_events[-1], Finished) and isinstance(b_events[-1], Finished)
    assert not (sch._inbox or sch._waiting or sch._running)
    snap = sch.metrics.snapshot()
    phases = snap["worker_s"]
    assert snap["requests"] == {"length": 2} and (snap["running"], snap["waiting"], snap["trajectories"]) == (0, 0, 1)
    assert snap["decode_steps"] == sch.engine.decode_steps > 0 and phases["capture"] == 0
    assert all(0 < phases[k] < wall for k in ("admit", "decode", "other")) and 0 <= phases["idle"] < wall
    assert sum(phases.values()) <= wall
    # the placing of the two requests, by part: each part ran and together they lie inside the admit phase
    parts = snap["admit_s"]
    assert set(parts) == {"match", "tokenize", "rows", "start"} and all(v > 0 for v in parts.values())
    assert sum(parts.values()) <= phases["admit"]


class _Backend:
    """A fast tokenizer's backend as text_encoder reads it: byte ids, its ``encode`` calls recorded."""

    truncation = padding = None
    encode_special_tokens = False

    def __init__(self) -> None:
        self.texts: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        self.texts.append(text)
        return SimpleNamespace(ids=[0] * bool(add_special_tokens) + list(text.encode("utf-8")))


class FastBytes(Bytes):
    """Bytes with a fast backend; its own call (which would give up the interpreter lock) is recorded."""

    def __init__(self) -> None:
        self.backend_tokenizer = _Backend()
        self.called: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.called.append(text)
        return super().__call__(text, add_special_tokens)


def test_the_scheduler_tokenises_prompts_through_the_backends_encode():
    """A served prompt is tokenised by the fast backend's single-text encode, never by the tokenizer's own call, and
    gives the same tokens (byte ids, no special token added)."""
    tok = FastBytes()
    sch = _scheduler(tok=tok)
    events = _serve(sch, "plan", "hello ", max_tokens=0)
    assert isinstance(events[-1], Finished), events
    assert tok.backend_tokenizer.texts == ["hello "] and tok.called == []
    assert [list(sch.engine.traj[r].ids) for r in sch.store.held] == [list(b"hello ")]


def test_the_admission_counts_the_tokenizers_calls_apart_from_the_match():
    """The tokenizer's calls while placing requests (each made 50 ms long here) are counted as ``tokenize``, and
    ``match`` holds only the comparisons around them: a first prompt tokenised whole, then a continuing prompt whose
    new text alone is tokenised."""
    sch = _scheduler(rows=1)
    calls = _slow_tokenizer(sch)
    for prompt in ("hello ", "hello world "):
        events = _serve(sch, "plan", prompt, max_tokens=2)
        assert isinstance(events[-1], Finished), events
    assert calls[0] == "hello " and len(calls) == 2 and calls[1].endswith("world ")
    parts = sch.metrics.snapshot()["admit_s"]
    assert 0.1 <= parts["tokenize"] < 0.1 + 0.5 and 0 < parts["match"] < 0.05, parts


def test_the_admission_adds_up_every_tokenizer_call_of_a_request():
    """One request whose match tokenises twice (non_shared: the plan role's trajectory, ranked first, serves the action
    role nothing, so the action role's own shorter trajectory is matched too, from its own piece boundary): every
    call's 50 ms is in ``tokenize``."""
    sch = _scheduler(rows=2, scheme="non_shared")
    calls = _slow_tokenizer(sch)
    for role, prompt in (("plan", "abcdefgh"), ("action", "ab"), ("action", "abcd")):
        events = _serve(sch, role, prompt, max_tokens=0)
        assert isinstance(events[-1], Finished), events
    assert calls == ["abcdefgh", "ab", "abcd", "cd"]
    assert 0.2 <= sch.metrics.snapshot()["admit_s"]["tokenize"] < 0.2 + 0.5


def test_the_worker_accounts_its_seconds_by_phase_and_serves_everything_queued_before_it_stops(monkeypatch):
    """The worker idles in ticks of IDLE_TICK_S (5 ms here; counted as they pass), drops a request cancelled while it
    waited without waiting more, serves a request to its end while nothing else arrives, and on stop() the one still
    queued; its seconds per phase (idle, admit, decode, other; no graph capture on the CPU) add up to at most the
    wall time, idle only while no request was there, and its decode steps are the engine's."""
    monkeypatch.setattr(scheduler_mod, "IDLE_TICK_S", 0.005)
    sch = _scheduler(rows=1)
    waits: list = []
    real_wait = sch._cond.wait
    sch._cond.wait = lambda timeout=None: (waits.append(timeout), real_wait(timeout))[1]
    t0 = time.perf_counter()
    sch.start()
    try:
        time.sleep(0.03)
        gone, gone_events = _request("plan", "gone ", max_tokens=2)
        gone.cancel()
        sch.submit(gone)
        time.sleep(0.01)
        before = time.perf_counter() - t0
        req, events = _request("plan", "hello ", max_tokens=6)
        sch.submit(req)
        for _ in range(500):  # served alone, without a stop or another request to wake the worker
            if events and isinstance(events[-1], Finished):
                break
            time.sleep(0.01)
        assert isinstance(events[-1], Finished)
        late, late_events = _request("plan", "late ", max_tokens=2)
        sch.submit(late)
    finally:
        sch.stop(timeout=10)
    wall = time.perf_counter() - t0
    assert not sch.alive and gone_events == [] and isinstance(late_events[-1], Finished)
    assert len(waits) > 2 and all(w == 0.005 for w in waits)
    snap = sch.metrics.snapshot()
    phases = snap["worker_s"]
    assert snap["requests"] == {"cancelled": 1, "length": 2} and snap["running"] == snap["waiting"] == 0
    assert snap["decode_steps"] == sch.engine.decode_steps > 0 and phases["capture"] == 0
    assert all(0 < phases[k] < wall for k in ("idle", "admit", "decode", "other")) and sum(phases.values()) <= wall
    assert phases["idle"] < before + 0.5


# ---- the length check -----------------------------------------------------------------------------------------------
def test_the_length_check_names_the_field_and_the_numbers():
    """No token: refused; no max_tokens: the rest of the context unless the prompt fills it; else prompt plus
    completion must fit the context (exactly fitting is fine)."""
    sch = Scheduler(_fake_engine(False), Bytes())  # context 64
    req, _ = _request("plan", "", max_tokens=None, prompt_field="messages")
    with pytest.raises(RequestError) as exc:
        sch._check_length(req, 0)
    assert str(exc.value) == (
        "Invalid value for 'messages': it holds no token of text. Allowed: at least one token."
    ) and (exc.value.param, exc.value.code, exc.value.status) == ("messages", None, 400)
    assert sch._check_length(req, 1) == 63 and sch._check_length(req, 63) == 1
    for n in (64, 65):
        with pytest.raises(RequestError) as exc:
            sch._check_length(req, n)
        assert str(exc.value) == (
            f"This model's maximum context length is 64 tokens. However, your messages holds {n} tokens, leaving "
            "none to generate. Please reduce the length of the messages."
        ) and (exc.value.param, exc.value.code) == ("messages", "context_length_exceeded")
    req.max_tokens = 10
    assert sch._check_length(req, 54) == 10
    with pytest.raises(RequestError) as exc:
        sch._check_length(req, 55)
    assert str(exc.value) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens (55 in the messages, 10 "
        "in the completion). Please reduce the length of the messages or max_tokens."
    ) and (exc.value.param, exc.value.code) == ("messages", "context_length_exceeded")


# ---- failures -------------------------------------------------------------------------------------------------------
def test_a_failure_is_503_for_out_of_memory_and_a_logged_500_otherwise(capsys):
    sch = Scheduler(_fake_engine(False), Bytes())
    oom = sch._failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom == Failed(503, "out of memory serving this request; the server goes on: retry, or send a shorter "
                              "prompt or a smaller max_tokens", None, "out_of_memory")  # fmt: skip
    assert capsys.readouterr().err == ""
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        failed = sch._failure(exc)
    assert failed == Failed(500, "internal error while serving this request (logged by the server)", None,
                            "internal_error")  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("lragent serve: internal error: RuntimeError('boom')\nTraceback (most recent call last):")
    assert err.rstrip().endswith("RuntimeError: boom")


def test_a_sink_that_raises_does_not_stop_the_worker():
    sch = Scheduler(_fake_engine(False), Bytes())

    def gone(event):
        raise RuntimeError("event loop closed")

    sch._send(ServeRequest("plan", "x", gone), Delta("a"))  # no exception


# ---- streaming ------------------------------------------------------------------------------------------------------
def _stream_run(sch, stop=(), sent: str = "") -> tuple[_Run, list]:
    req, events = _request("plan", "x", stream=True, stop=stop)
    run = _Run(req, 3)
    run.sent = sent
    return run, events


def test_streaming_sends_only_new_text_and_never_past_or_into_a_stop_string():
    """No stop string: all the text, special tokens skipped; a stop string: the text before it, and without one in
    the text, all but the last len(longest stop) - 1 characters (they could start one); an unfinished character is
    held back; nothing is sent when the text does not extend what was sent; ``seen`` is the token count."""
    sch = Scheduler(_fake_engine(False), Bytes())
    run, events = _stream_run(sch)
    sch._stream(run, 3, [0, ord("a"), ord("b")])
    assert events == [Delta("ab")] and run.sent == "ab" and run.seen == 3
    sch._stream(run, 5, [ord("a"), ord("b"), ord("c"), ord("d")])
    assert events[-1] == Delta("cd") and run.sent == "abcd" and run.seen == 5
    sch._stream(run, 6, list(b"abcdXX"))  # only an unfinished character is held back, not its neighbours
    assert events[-1] == Delta("XX") and run.sent == "abcdXX"
    run, events = _stream_run(sch, stop=("XYZ", "Q"))
    sch._stream(run, 4, list(b"abcd"))
    assert events == [Delta("ab")] and run.sent == "ab"
    sch._stream(run, 7, list(b"abcdeXYZf"))
    assert events[-1] == Delta("cde") and run.sent == "abcde"
    run, events = _stream_run(sch, stop=("Q",))
    sch._stream(run, 3, list(b"abQc"))
    assert events == [Delta("ab")]
    run, events = _stream_run(sch)
    sch._stream(run, 2, list("aé".encode())[:2])  # "a" and the first byte of "é"
    assert events == [Delta("a")] and run.sent == "a"
    run, events = _stream_run(sch, sent="zz")
    sch._stream(run, 9, list(b"abc"))
    assert events == [] and run.sent == "zz" and run.seen == 9
    run, events = _stream_run(sch, sent="abc")
    sch._stream(run, 3, list(b"abc"))
    assert events == [] and run.seen == 3


# ---- admission ------------------------------------------------------------------------------------------------------
def test_a_new_prompt_takes_an_empty_row_and_reports_its_tokens():
    """A first request: Admitted with its prompt tokens, then Finished with the whole accounting; the row holds the
    prompt and the generated text; the metrics count it as ended by length."""
    sch = _scheduler()
    req, events = _request("plan", "Question: who? ", max_tokens=3)
    req.arrived = time.perf_counter() - 100
    sch.submit(req)
    _drain(sch)
    n = len("Question: who? ")
    assert events[0] == Admitted(prompt_tokens=n) and len(events) == 2
    res = events[1]
    assert isinstance(res, Finished) and res.finish_reason == "length" and len(res.text) == 3
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (n, 3, 0)
    assert (res.prefill_tokens, res.recomputed_tokens, res.trajectory_tokens) == (n, 0, n + 3)
    assert 100 <= res.ttft_s < 160 and res.prefill_s > 0 and res.decode_s >= 0
    held = sch.store.held[0]
    assert held.text == "Question: who? " + res.text and held.n_tokens == n + 3 == len(sch.engine.ids(0))
    snap = sch.metrics.snapshot()
    assert snap["requests"] == {"length": 1} and snap["prompt_tokens"] == n and snap["generation_tokens"] == 3
    assert snap["trajectories"] == 1 and snap["running"] == 0 and snap["waiting"] == 0
    assert sch.metrics.ttft.count == 1 and sch.metrics.tpot.count == 1
    assert snap["cache_bytes"] == sch.engine.cache_bytes() and sum(snap["cache_bytes"].values()) > 0


def test_a_single_token_completion_has_no_time_per_output_token():
    sch = _scheduler()
    res = _serve(sch, "plan", "abc", max_tokens=1)[-1]
    assert res.completion_tokens == 1 and sch.metrics.tpot.count == 0 and sch.metrics.ttft.count == 1


def test_a_stop_string_ends_the_request_with_reason_stop():
    """The greedy text of a request, then the same request with a stop string inside that text: cut before it,
    finish_reason ``stop``, the completion tokens counting the stop string's."""
    sch = _scheduler(rows=1)
    full = _serve(sch, "plan", "abc", max_tokens=8)[-1].text
    stop = full[2:4]
    sch2 = _scheduler(rows=1)
    events = _serve(sch2, "plan", "abc", max_tokens=8, stop=(stop,), stream=True)
    res = events[-1]
    assert res.finish_reason == "stop" and res.text == full[: full.index(stop)]
    assert "".join(e.text for e in events if isinstance(e, Delta)) == res.text
    assert sch2.metrics.snapshot()["requests"] == {"stop": 1}


def test_a_prompt_extending_a_held_trajectory_continues_it_in_its_row():
    """The second turn carries the first's text: same row, its tokens cached, no fork or eviction."""
    sch = _scheduler()
    first = _serve(sch, "plan", "abc ", max_tokens=3)[-1]
    events = _serve(sch, "action", "abc " + first.text + " next", max_tokens=2)
    res = events[-1]
    n = len("abc ") + 3 + len(" next")
    assert events[0] == Admitted(n) and res.prompt_tokens == n and res.cached_tokens == len("abc ") + 3 - 1
    assert list(sch.store.held) == [0] and sch.store.held[0].text.startswith("abc " + first.text + " next")
    assert sch.store.held[0].marks == [(0, 0), (4, 4), (7, 7), (12, 12), (12 + len(res.text), 14)]
    snap = sch.metrics.snapshot()
    assert (snap["forks"], snap["evictions"], snap["trajectories"]) == (0, 0, 1)


def test_a_prompt_parting_from_a_trajectory_forks_to_a_spare_row_or_cuts_in_place():
    """With a spare row the shared part is forked there (forks 1, the first trajectory kept); with one row the
    trajectory is cut to the shared part in place; both give the same text and cached tokens."""
    outs = []
    for rows in (2, 1):
        sch = _scheduler(rows=rows)
        _serve(sch, "plan", "shared head A", max_tokens=2)
        res = _serve(sch, "plan", "shared head B", max_tokens=3)[-1]
        snap = sch.metrics.snapshot()
        assert res.cached_tokens == len("shared head ") and snap["evictions"] == 0
        assert snap["forks"] == (rows == 2) and len(sch.store) == rows
        assert sch.store.held[rows - 1].text == "shared head B" + res.text
        if rows == 2:
            assert sch.store.held[0].text.startswith("shared head A")
        outs.append(res.text)
    assert outs[0] == outs[1]


def test_a_new_trajectory_evicts_the_least_recently_used_idle_row():
    """Two rows held, a third unrelated prompt: the least recently used row is emptied and reused (evictions 1)."""
    sch = _scheduler(rows=2)
    _serve(sch, "plan", "one ", max_tokens=2)
    _serve(sch, "plan", "two ", max_tokens=2)
    _serve(sch, "plan", "one " + sch.store.held[0].text[4:] + "more", max_tokens=1)  # row 0 used last
    res = _serve(sch, "plan", "xyz ", max_tokens=2)[-1]
    assert sch.metrics.snapshot()["evictions"] == 1 and res.cached_tokens == 0
    assert sch.store.held[1].text.startswith("xyz ") and sch.store.held[0].text.startswith("one ")


def test_a_request_waits_while_every_row_generates_and_keeps_its_place():
    """One row generating: a new unrelated request is not placed (admit reports no progress) and keeps the queue's
    head; it is served once the row is free."""
    sch = _scheduler(rows=1)
    a, a_events = _request("plan", "first ", max_tokens=4)
    b, b_events = _request("plan", "second ", max_tokens=2)
    sch.submit(a)
    assert _round(sch) is True and list(sch._running) == [0]
    sch.submit(b)
    c, _ = _request("plan", "third ", max_tokens=1)
    sch.submit(c)
    assert _round(sch) is False and list(sch._waiting) == [b, c] and b_events == []
    snap = sch.metrics.snapshot()
    assert (snap["running"], snap["waiting"], snap["peak_waiting"]) == (1, 2, 2)
    _drain(sch)
    assert isinstance(a_events[-1], Finished) and isinstance(b_events[-1], Finished)


def test_a_request_too_long_fails_with_400_and_the_queue_goes_on():
    sch = _scheduler(rows=1, capacity=16)
    bad, bad_events = _request("plan", "x" * 20, max_tokens=1)
    good, good_events = _request("plan", "y", max_tokens=1)
    sch.submit(bad)
    sch.submit(good)
    assert _round(sch) is True
    (failed,) = bad_events
    assert failed.status == 400 and failed.code == "context_length_exceeded" and failed.param == "prompt"
    assert "maximum context length is 15 tokens" in failed.message
    _drain(sch)
    assert isinstance(good_events[-1], Finished) and sch.metrics.snapshot()["requests"] == {"error": 1, "length": 1}


def test_a_cancelled_request_that_fails_counts_as_cancelled():
    sch = _scheduler(rows=1, capacity=16)
    bad, events = _request("plan", "x" * 20, max_tokens=1)
    sch._waiting.append(bad)
    bad.cancelled.set()
    sch._admit()  # placed before the cancel check of the next round: it fails, counted as cancelled
    assert isinstance(events[-1], Failed) and sch.metrics.snapshot()["requests"] == {"cancelled": 1}


def test_a_start_that_fails_empties_its_row_and_fails_the_request(monkeypatch):
    """An exception in the engine's start: the row is dropped from the store and emptied, the request fails (503
    for out of memory), nothing is running and the next request is served in that row."""
    sch = _scheduler(rows=1)
    _serve(sch, "plan", "held ", max_tokens=2)
    real = sch.engine.start
    monkeypatch.setattr(sch.engine, "start", lambda row, gen: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    events = _serve(sch, "plan", "held " + sch.store.held[0].text[5:] + "x", max_tokens=2)
    assert events[-1].status == 503 and events[-1].code == "out_of_memory"
    assert len(sch.store) == 0 and sch.engine.ids(0) == [] and not sch._running and not sch.engine._pending
    monkeypatch.setattr(sch.engine, "start", real)
    assert isinstance(_serve(sch, "plan", "again", max_tokens=1)[-1], Finished)
    assert sch.metrics.snapshot()["requests"] == {"length": 2, "error": 1}


def test_max_tokens_none_generates_to_the_end_of_the_context():
    sch = _scheduler(rows=1, capacity=24)
    res = _serve(sch, "plan", "abcd", max_tokens=None)[-1]
    assert res.completion_tokens == 23 - 4 and res.finish_reason == "length"


def test_the_generation_request_carries_the_sampling_options(monkeypatch):
    """The engine gets the role's id, the bound, the stop strings as a tuple and the sampling options as numbers."""
    sch = _scheduler(rows=1)
    seen = []
    real = sch.engine.start
    monkeypatch.setattr(sch.engine, "start", lambda row, gen: seen.append((row, gen)) or real(row, gen))
    _serve(sch, "reflect", "abc", max_tokens=5, stop=["zz"], temperature=1, top_p=0.5, seed=7)
    ((row, gen),) = seen
    assert row == 0 and gen.role == 2 and gen.max_new_tokens == 5 and gen.stop == ("zz",)
    assert (gen.temperature, gen.top_p, gen.seed) == (1.0, 0.5, 7)
    assert type(gen.temperature) is float and type(gen.top_p) is float


def test_a_zero_token_budget_finishes_at_admission(monkeypatch):
    """A start that returns its result right away (no decode): the request is answered in the admission round."""
    sch = _scheduler(rows=1)
    real = sch.engine.start

    def at_once(row, gen):
        gen.max_new_tokens = 0
        return real(row, gen)

    monkeypatch.setattr(sch.engine, "start", at_once)
    req, events = _request("plan", "abc", max_tokens=2)
    sch.submit(req)
    sch._waiting.extend(sch._inbox)
    sch._inbox.clear()
    assert sch._admit() is True
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 0 and not sch._running


# ---- cancellation ---------------------------------------------------------------------------------------------------
def test_cancelling_removes_a_waiting_request_and_stops_a_running_one():
    """A cancelled waiting request leaves the queue unanswered; a cancelled running one stops at its next token and
    is counted as cancelled with its tokens, without a Finished event; its trajectory stays held."""
    sch = _scheduler(rows=1)
    a, a_events = _request("plan", "long ", max_tokens=30, stream=True)
    b, b_events = _request("plan", "waits ", max_tokens=2)
    sch.submit(a)
    _round(sch)
    sch.submit(b)
    _round(sch)
    b.cancel()
    a.cancel()
    sch._cancel_requested()
    assert list(sch._waiting) == [] and sch._running[0].stopping is True
    assert int(sch.engine.d_remaining[0]) == 0
    _drain(sch)
    assert b_events == [] and not any(isinstance(e, Finished) for e in a_events)
    snap = sch.metrics.snapshot()
    assert snap["requests"] == {"cancelled": 2} and 0 < snap["generation_tokens"] < 30
    assert len(sch.store) == 1 and sch.store.held[0].text.startswith("long ")


# ---- a failed decode round ------------------------------------------------------------------------------------------
def test_a_failed_decode_round_fails_every_generating_request_and_drops_their_rows(monkeypatch):
    sch = _scheduler(rows=2)
    reqs = [_request("plan", p, max_tokens=5) for p in ("one ", "two ")]
    for req, _ in reqs:
        sch.submit(req)
    _round(sch)
    assert sorted(sch._running) == [0, 1]
    monkeypatch.setattr(sch.engine, "advance", lambda **k: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    sch._step()
    for _, events in reqs:
        assert events[-1].status == 503 and events[-1].code == "out_of_memory"
    assert not sch._running and len(sch.store) == 0 and not sch.engine._pending
    assert sch.engine.ids(0) == [] and sch.engine.ids(1) == []
    assert sch.metrics.snapshot()["requests"] == {"error": 2}


def test_launch_ahead_queues_the_next_round_and_a_failed_launch_fails_only_the_rows_still_generating(monkeypatch):
    """With launch_ahead a round queues the next one (collected by the next round); a launch that raises fails the
    requests still generating while the one that finished in that round is answered."""
    sch = _scheduler(rows=2, launch_ahead=True)
    short, s_events = _request("plan", "one ", max_tokens=1)
    long, l_events = _request("plan", "two ", max_tokens=6)
    sch.submit(short)
    sch.submit(long)
    sch._waiting.extend(sch._inbox)
    sch._inbox.clear()
    sch._admit()
    calls = []
    real_launch, real_collect, real_advance = sch.engine.launch, sch.engine.collect, sch.engine.advance
    monkeypatch.setattr(sch.engine, "collect", lambda: calls.append("collect") or real_collect())
    monkeypatch.setattr(sch.engine, "advance", lambda **k: calls.append("advance") or real_advance(**k))
    monkeypatch.setattr(sch.engine, "launch", lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    sch._step()
    assert calls[0] == "advance" and sch._launched is False
    assert isinstance(s_events[-1], Finished) and l_events[-1] == Failed(
        503, sch._failure(torch.OutOfMemoryError("x")).message, None, "out_of_memory"
    )
    assert not sch._running
    sch2 = _scheduler(rows=1, launch_ahead=True)
    calls.clear()
    monkeypatch.setattr(
        sch2.engine, "collect", lambda: calls.append("collect") or sch2.engine.__class__.collect(sch2.engine)
    )
    req, events = _request("plan", "abc", max_tokens=4)
    sch2.submit(req)
    _round(sch2)
    assert sch2._launched is True
    _drain(sch2)
    assert "collect" in calls and isinstance(events[-1], Finished) and sch2._launched is False
    assert real_launch is not None


# ---- what a finished request reports --------------------------------------------------------------------------------
def _finish_case(sch, text="ab", generated=(5, 6), prefill=4, recomputed=1, stream=False, sent="", first=None):
    req, events = _request("plan", "abcd", stream=stream)
    req.arrived = 10.0
    sch.engine.append(0, list(b"abcd") + [5, 6])
    sch.store.set(0, TextTrajectory("abcd", [(0, 0), (4, 4)]))
    run = _Run(req, 4, first_token=first)
    run.sent = sent
    sch._running[0] = run
    res = StepResult("plan", prefill, recomputed, list(generated), text, 2, 0.5, 0.25, "length", row=0)
    return res, req, events


def test_finish_reports_cached_tokens_times_and_the_rest_of_the_stream():
    """cached = prompt - (prefill - recomputed), never negative; ttft from arrival to the first token (or now);
    time per output token over the tokens after the first; a streamed request gets the unsent rest of the text."""
    sch = _scheduler(rows=1)
    res, req, events = _finish_case(sch, first=12.0, stream=True, sent="a")
    sch._finish(res, 20.0)
    assert events == [Delta("b"), Finished("ab", "length", 4, 2, 1, 4, 1, 6, 0.5, 0.25, 2.0)]
    assert sch.metrics.tpot.sum == pytest.approx(8.0) and sch.metrics.ttft.sum == pytest.approx(2.0)
    assert sch.store.held[0].text == "abcdab" and sch.store.held[0].n_tokens == 6
    sch = _scheduler(rows=1)
    res, req, events = _finish_case(sch, prefill=9, recomputed=0, generated=(5,), sent="zz", stream=True)
    sch._finish(res, 30.0)
    assert events == [Finished("ab", "length", 4, 1, 0, 9, 0, 6, 0.5, 0.25, 20.0)]
    assert sch.metrics.tpot.count == 0 and sch.metrics.ttft.sum == pytest.approx(20.0)
    sch = _scheduler(rows=1)
    res, req, events = _finish_case(sch, first=12.0, sent="ab", stream=True)
    sch._finish(res, 20.0)
    assert [type(e) for e in events] == [Finished]
    sch = _scheduler(rows=1)
    res, req, events = _finish_case(sch, first=12.0, stream=False)
    res.stop_reason = "eos"
    sch._finish(res, 20.0)
    assert [type(e) for e in events] == [Finished] and events[0].finish_reason == "stop"
    assert sch.metrics.snapshot()["requests"] == {"stop": 1}


def test_finish_of_a_cancelled_request_counts_it_without_answering():
    sch = _scheduler(rows=1)
    res, req, events = _finish_case(sch, first=12.0)
    req.cancel()
    sch._finish(res, 20.0)
    snap = sch.metrics.snapshot()
    assert events == [] and snap["requests"] == {"cancelled": 1}
    assert (snap["prompt_tokens"], snap["generation_tokens"], snap["cached_tokens"]) == (4, 2, 1)
    assert sch.metrics.ttft.count == 0 and not sch._running


def test_progress_marks_the_first_token_and_reads_streaming_rows_only():
    """The first round with a token sets first_token; a non-streaming row already started is not read back."""
    sch = _scheduler(rows=2)
    a, _ = _request("plan", "one ", max_tokens=6, stream=True)
    b, _ = _request("plan", "two ", max_tokens=6)
    sch.submit(a)
    sch.submit(b)
    _round(sch)
    runs = dict(sch._running)
    assert all(r.first_token is not None for r in runs.values())
    assert runs[0].seen == 1 and runs[1].seen == 0
    assert sch._progress([(1, runs[1])]) == []
    got = sch._progress([(0, runs[0]), (1, runs[1])])
    assert [(n, ids is None) for _, n, ids in got] == [(1, True), (1, True)] or got[0][2] is None
    runs[0].seen = 0
    got = sch._progress([(0, runs[0]), (1, runs[1])])
    assert got[0][0] is runs[0] and got[0][1] == 1 and len(got[0][2]) == 1 and got[1][2] is None


def test_a_launch_that_queues_nothing_leaves_the_next_round_to_advance(monkeypatch):
    """launch() returning 0 (no step queued): nothing to collect, the next round advances."""
    sch = _scheduler(rows=1, launch_ahead=True)
    req, events = _request("plan", "abc", max_tokens=5)
    sch.submit(req)
    monkeypatch.setattr(sch.engine, "launch", lambda: 0)
    _round(sch)
    assert sch._launched is False
    calls = []
    real = sch.engine.advance
    monkeypatch.setattr(sch.engine, "advance", lambda **k: calls.append(k) or real(**k))
    sch._step()
    assert calls == [{"max_steps": 1}]


def test_a_request_admitted_while_a_round_is_queued_has_no_first_token_until_it_gets_one():
    """launch_ahead: a request placed while the next round is already queued joins the round after; the round
    collected meanwhile gives it no token, so its first-token time stays unset (its TTFT is not cut short)."""
    sch = _scheduler(rows=2, launch_ahead=True)
    a, _ = _request("plan", "one ", max_tokens=8)
    sch.submit(a)
    _round(sch)
    assert sch._launched is True
    b, _ = _request("plan", "two ", max_tokens=8, stream=True)
    sch.submit(b)
    _round(sch)
    assert sch._running[0].first_token is not None and sch._running[1].first_token is None
    assert sch._running[1].seen == 0


def test_publish_counts_the_inbox_as_waiting():
    sch = _scheduler(rows=1)
    for prompt in ("a", "b", "c"):
        sch.submit(_request("plan", prompt)[0])
    sch._waiting.append(sch._inbox.popleft())
    sch._publish()
    snap = sch.metrics.snapshot()
    assert (snap["running"], snap["waiting"], snap["trajectories"]) == (0, 3, 0)


def test_stop_waits_no_longer_than_its_timeout():
    """stop(timeout) returns after the timeout while the worker still serves a long request; stop() then waits."""
    sch = _scheduler(rows=1, capacity=128)
    req, events = _request("plan", "long ", max_tokens=40)
    sch.start()
    sch.submit(req)
    t0 = time.perf_counter()
    sch.stop(timeout=0.001)
    assert time.perf_counter() - t0 < 1.0 and sch.alive
    sch.stop()
    assert not sch.alive and isinstance(events[-1], Finished) and events[-1].completion_tokens == 40


def test_admission_fails_bad_requests_and_places_the_rest_in_one_pass(monkeypatch):
    """A request too long (RequestError) and one whose start raises are answered and leave the queue; the request
    behind them is placed in the same pass; any of that is progress."""
    sch = _scheduler(rows=2, capacity=16)
    bad, bad_events = _request("plan", "x" * 20, max_tokens=1)
    sch._waiting.append(bad)
    assert sch._admit() is True and bad_events[-1].status == 400 and not sch._waiting
    real = sch.engine.start
    monkeypatch.setattr(sch.engine, "start", lambda row, gen: real(row, gen) if gen.max_new_tokens != 3 else 1 / 0)
    boom, boom_events = _request("plan", "boom", max_tokens=3)
    sch._waiting.append(boom)
    assert sch._admit() is True and boom_events[-1].status == 500 and not sch._waiting
    bad2, bad2_events = _request("plan", "y" * 20, max_tokens=1)
    boom2, boom2_events = _request("plan", "boom2", max_tokens=3)
    good, good_events = _request("plan", "ok", max_tokens=2)
    sch._waiting.extend([bad2, boom2, good])
    assert sch._admit() is True and not sch._waiting and list(sch._running) == [0]
    assert bad2_events[-1].status == 400 and boom2_events[-1].status == 500 and good_events == [Admitted(2)]


def test_a_request_that_fails_after_its_row_was_emptied_leaves_no_stale_trajectory():
    """A new prompt evicts the one held trajectory, then its tokens are refused by the engine (an id past the
    vocabulary): the request fails and the store no longer names the emptied row."""
    sch = _scheduler(rows=1, tok=Wide())
    _serve(sch, "plan", "abc", max_tokens=2)
    assert len(sch.store) == 1
    events = _serve(sch, "plan", "x!", max_tokens=2)
    assert events[-1].status == 500 and len(sch.store) == 0 and sch.engine.ids(0) == []


def test_the_time_per_output_token_spreads_the_decode_time_over_the_tokens_after_the_first():
    sch = _scheduler(rows=1)
    res, _, events = _finish_case(sch, generated=(5, 6, 7), first=12.0)
    sch._finish(res, 20.0)
    assert events[-1].completion_tokens == 3 and sch.metrics.tpot.sum == pytest.approx(4.0)


def test_a_finished_request_makes_its_row_the_most_recently_used():
    """A (long) is admitted before B (short) but finishes after it: A's row was used last, so a new unrelated
    prompt evicts B's row."""
    sch = _scheduler(rows=2)
    a, _ = _request("plan", "alpha ", max_tokens=6)
    b, _ = _request("plan", "beta ", max_tokens=1)
    sch.submit(a)
    sch.submit(b)
    _drain(sch)
    _serve(sch, "plan", "xyz", max_tokens=1)
    assert sch.store.held[0].text.startswith("alpha ") and sch.store.held[1].text.startswith("xyz")
