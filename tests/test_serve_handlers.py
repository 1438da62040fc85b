"""The HTTP side of the server without a model (eval_suite/serve: server_state, engine_client, serving_completion,
serving_chat, api_server): a scripted scheduler hands each request the events a real one would send, and the tests
check what the handlers answer (status, exact bodies, server-sent events), what they submit (the sampling fields of
a request), and that a client who leaves has its request cancelled."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

import eval_suite.serve.engine_client as engine_client
from eval_suite.serve.api_server import ServerThread, _config, _Server, bind, build_app, serve_until_stopped
from eval_suite.serve.engine_client import ClientGone, EngineClient, RequestEvents
from eval_suite.serve.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, parse_body
from eval_suite.serve.server_state import CLIENT_GONE, DEFAULT_TEMPERATURE, ServerState, failed_response
from eval_suite.serve.serving_chat import chat_prompt, create_chat_completion
from eval_suite.serve.serving_completion import create_completion
from lragent.serving.scheduler import Admitted, Delta, Failed, Finished, RequestError, ServeRequest

DONE = Finished(
    text="Paris",
    finish_reason="stop",
    prompt_tokens=7,
    completion_tokens=3,
    cached_tokens=4,
    prefill_tokens=5,
    recomputed_tokens=2,
    trajectory_tokens=10,
    prefill_s=0.25,
    decode_s=0.5,
    ttft_s=0.125,
)
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}
DETAILS = {
    "scheme": "base_lr_shared",
    "prefill_tokens": 5,
    "recomputed_tokens": 2,
    "trajectory_tokens": 10,
    "prefill_s": 0.25,
    "decode_s": 0.5,
    "ttft_s": 0.125,
}
STREAMED = [Admitted(prompt_tokens=7), Delta("Pa"), Delta("ris"), DONE]


class Metrics:
    def render(self) -> str:
        return "lragent_num_requests_running 0\n"


class ScriptedScheduler:
    """What the handlers use of :class:`~lragent.serving.scheduler.Scheduler`: each submitted request gets the
    events of ``script`` at once (or ``refuse`` is raised)."""

    def __init__(self, script: list | None = None, refuse: Exception | None = None) -> None:
        self.roles = ("plan", "action", "Base")
        self.context = 63
        self.alive = True
        self.metrics = Metrics()
        self.script = list(STREAMED if script is None else script)
        self.refuse = refuse
        self.submitted: list[ServeRequest] = []
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    def submit(self, req: ServeRequest) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(req)
        for event in self.script:
            req.sink(event)


class ChatTokenizer:
    """A chat template that writes each message as ``<role>content``, then ``<assistant>`` for the reply."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return text if not tokenize else list(text.encode())


class RawRequest:
    """The two things a handler reads of starlette's request: the body and whether the client left."""

    def __init__(self, body: dict, gone: bool = False) -> None:
        self.data = json.dumps(body).encode()
        self.gone = gone

    async def body(self) -> bytes:
        return self.data

    async def is_disconnected(self) -> bool:
        return self.gone


def state_of(scheduler: ScriptedScheduler, api_key: str | None = None) -> ServerState:
    return ServerState(scheduler, "base_lr_shared", "Base", ChatTokenizer(), api_key)


def handle(handler, scheduler: ScriptedScheduler, body: dict, gone: bool = False):
    """The handler's response and, for a streaming one, its events as text."""

    async def go():
        response = await handler(state_of(scheduler), RawRequest(body, gone))
        chunks = None
        if hasattr(response, "body_iterator"):
            chunks = [c async for c in response.body_iterator]
        return response, chunks

    return asyncio.run(go())


def events_of(chunks: list[str]) -> list:
    """The JSON objects of server-sent events (``[DONE]`` as the string)."""
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks), chunks
    return [c[6:-2] if c == "data: [DONE]\n\n" else json.loads(c[6:-2]) for c in chunks]


# ---- server_state -------------------------------------------------------------------------------------------------
def sampling(body: dict) -> dict:
    request = parse_body(CompletionRequest, json.dumps({"model": "plan", "prompt": "x", **body}).encode())
    return state_of(ScriptedScheduler()).sampling(request)


def test_sampling_fields_take_openai_defaults_and_the_request_values():
    """No temperature: OpenAI's 1.0 (sampled, with a random seed); greedy without a seed: seed 0; given values pass
    through as the scheduler's types."""
    assert DEFAULT_TEMPERATURE == 1.0
    given = sampling({"temperature": 0, "top_p": 0.5, "stop": "\n", "seed": 12, "stream": True})
    assert given == {"role": "plan", "temperature": 0.0, "top_p": 0.5, "stop": ("\n",), "seed": 12, "stream": True}
    assert type(given["temperature"]) is float and type(given["top_p"]) is float
    greedy = sampling({"temperature": 0})
    assert greedy == {"role": "plan", "temperature": 0.0, "top_p": 1.0, "stop": (), "seed": 0, "stream": False}
    default = sampling({"stop": ["a", "b"]})
    assert default["temperature"] == 1.0 and default["stop"] == ("a", "b") and default["top_p"] == 1.0
    seeds = [sampling({"temperature": 0.7})["seed"] for _ in range(64)]
    assert all(0 <= s < 2**31 for s in seeds) and len(set(seeds)) > 1  # a fresh 31-bit seed per sampled request
    assert sampling({"temperature": 0.7, "seed": 5})["seed"] == 5


@pytest.mark.parametrize("seed, ok", [(2**63 - 1, True), (-(2**63), True), (2**63, False), (-(2**63) - 1, False)])
def test_a_seed_must_fit_in_64_bits(seed, ok):
    if ok:
        assert sampling({"seed": seed})["seed"] == seed
    else:
        with pytest.raises(ProtocolError) as exc:
            sampling({"seed": seed})
        assert str(exc.value) == f"Invalid value for 'seed': got {seed}. Allowed: an integer in 64 bits."
        assert exc.value.param == "seed" and exc.value.status == 400


def test_an_unknown_model_is_refused_naming_the_served_ones():
    state = state_of(ScriptedScheduler())
    assert state.models == ("plan", "action", "Base") and state.check_model("action") == "action"
    with pytest.raises(ProtocolError) as exc:
        sampling({"model": "planner"})
    assert str(exc.value) == "The model `planner` does not exist. Allowed: plan, action, Base."
    assert (exc.value.param, exc.value.code, exc.value.status) == ("model", "model_not_found", 400)


def test_usage_and_details_of_a_finished_request():
    state = state_of(ScriptedScheduler())
    assert state.usage(DONE).model_dump() == USAGE
    assert state.details(DONE).model_dump() == DETAILS


@pytest.mark.parametrize(
    "status, kind",
    [(400, "invalid_request_error"), (499, "invalid_request_error"), (500, "server_error"), (503, "server_error")],
)
def test_a_failed_request_is_openai_error_object_with_its_status(status, kind):
    response = failed_response(Failed(status, "no room", "prompt", "context_length_exceeded"))
    assert response.status_code == status
    assert json.loads(response.body) == {
        "error": {"message": "no room", "type": kind, "param": "prompt", "code": "context_length_exceeded"}
    }


# ---- engine_client ------------------------------------------------------------------------------------------------
class CountingRequest:
    def __init__(self) -> None:
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1


def test_events_come_in_order_and_the_result_skips_streamed_text():
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        for e in STREAMED:
            queue.put_nowait(e)
        req = CountingRequest()
        events = RequestEvents(req, queue, None)
        first = await events.next()
        assert first == Admitted(7) and not events.ended  # neither admission nor text ends it
        assert await events.next() == Delta("Pa") and not events.ended
        assert await events.result() == DONE and events.ended
        events.close()  # ended: nothing to cancel
        return req.cancels

    assert asyncio.run(go()) == 0


def test_a_failure_ends_the_events_and_closing_an_open_request_cancels_it_once():
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(Failed(503, "out of memory"))
        req = CountingRequest()
        events = RequestEvents(req, queue, None)
        assert await events.result() == Failed(503, "out of memory") and events.ended
        events.close()
        open_req = CountingRequest()
        running = RequestEvents(open_req, asyncio.Queue(), None)
        running.close()
        running.close()
        return req.cancels, open_req.cancels, running.ended

    assert asyncio.run(go()) == (0, 1, True)


def test_a_client_that_left_is_noticed_within_a_poll_and_its_request_cancelled():
    """The wait checks the client every POLL_S (0.5 s): a client gone while nothing comes is seen at the next
    check; a client still there, or no check at all, keeps waiting."""
    checks: list[float] = []

    async def go():
        req = CountingRequest()
        t0 = time.perf_counter()

        async def gone() -> bool:
            checks.append(time.perf_counter() - t0)
            return True

        events = RequestEvents(req, asyncio.Queue(), gone)
        with pytest.raises(ClientGone):
            await events.next()
        return req.cancels, events.ended

    assert engine_client.POLL_S == 0.5
    assert asyncio.run(go()) == (1, True)
    assert len(checks) == 1 and 0.45 <= checks[0] < 1.2, checks


@pytest.mark.parametrize("disconnected", ["none", "present"])
def test_a_waiting_client_that_stays_keeps_waiting(monkeypatch, disconnected):
    monkeypatch.setattr(engine_client, "POLL_S", 0.01)
    asked: list[int] = []

    async def present() -> bool:
        asked.append(1)
        return False

    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        req = CountingRequest()
        events = RequestEvents(req, queue, present if disconnected == "present" else None)
        asyncio.get_running_loop().call_later(0.1, queue.put_nowait, DONE)
        assert await events.next() == DONE
        return req.cancels

    assert asyncio.run(go()) == 0
    assert (len(asked) >= 3) if disconnected == "present" else not asked


def test_open_submits_the_fields_and_sinks_events_into_the_loop():
    scheduler = ScriptedScheduler()

    async def go():
        events = EngineClient(scheduler).open(None, role="plan", prompt="Q", max_tokens=3, stop=("\n",))
        return [await events.next() for _ in STREAMED], events

    got, events = asyncio.run(go())
    assert got == STREAMED and events.disconnected is None
    (req,) = scheduler.submitted
    assert (req.role, req.prompt, req.max_tokens, req.stop, req.sink is not None) == ("plan", "Q", 3, ("\n",), True)
    assert events.req is req


def test_a_request_the_scheduler_refuses_is_a_protocol_error_with_its_status():
    refused = RequestError("the server is shutting down", param="x", code="shutting_down", status=503)

    async def go():
        EngineClient(ScriptedScheduler(refuse=refused)).open(None, role="plan", prompt="Q")

    with pytest.raises(ProtocolError) as exc:
        asyncio.run(go())
    assert str(exc.value) == "the server is shutting down"
    assert (exc.value.param, exc.value.code, exc.value.status) == ("x", "shutting_down", 503)


# ---- serving_completion -------------------------------------------------------------------------------------------
COMPLETION = {"model": "plan", "prompt": ["Q: capital of France?"], "max_tokens": 5, "temperature": 0, "stop": "\n"}


def test_a_completion_is_the_finished_text_with_usage_and_the_server_figures():
    scheduler = ScriptedScheduler()
    response, chunks = handle(create_completion, scheduler, COMPLETION)
    assert chunks is None and response.status_code == 200
    body = json.loads(response.body)
    assert body.pop("id").startswith("cmpl-") and abs(body.pop("created") - time.time()) < 60
    assert body == {
        "object": "text_completion",
        "model": "plan",
        "choices": [{"index": 0, "text": "Paris", "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
        "lragent": DETAILS,
    }
    (req,) = scheduler.submitted
    assert (req.role, req.prompt, req.max_tokens, req.prompt_field) == ("plan", "Q: capital of France?", 5, "prompt")
    assert (req.temperature, req.top_p, req.stop, req.seed, req.stream) == (0.0, 1.0, ("\n",), 0, False)


@pytest.mark.parametrize(
    "script",
    [
        [Failed(400, "too long", "prompt", "context_length_exceeded")],
        [Admitted(7), Delta("x"), Failed(400, "too long", "prompt", "context_length_exceeded")],
    ],
)
def test_a_completion_refused_before_or_after_admission_is_the_error(script):
    for handler, body in ((create_completion, COMPLETION), (create_chat_completion, CHAT)):
        response, chunks = handle(handler, ScriptedScheduler(script), body)
        assert response.status_code == 400 and chunks is None
        assert json.loads(response.body)["error"] == {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }


def test_a_stream_refused_at_admission_is_an_error_status_not_a_stream():
    """The status is known before a byte is sent: a request the scheduler refuses answers 400, never a 200 stream
    carrying the error."""
    script = [Failed(400, "too long", "prompt", "context_length_exceeded"), DONE]
    for handler, body in ((create_completion, COMPLETION), (create_chat_completion, CHAT)):
        response, chunks = handle(handler, ScriptedScheduler(script), {**body, "stream": True})
        assert response.status_code == 400 and chunks is None
        assert json.loads(response.body)["error"] == {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }


@pytest.mark.parametrize("script", [[], [Admitted(7), Delta("x")]])
def test_a_client_gone_before_the_answer_gets_499_and_its_request_cancelled(monkeypatch, script):
    monkeypatch.setattr(engine_client, "POLL_S", 0.01)
    for handler, body in ((create_completion, COMPLETION), (create_chat_completion, CHAT)):
        scheduler = ScriptedScheduler(script)
        response, chunks = handle(handler, scheduler, body, gone=True)
        assert CLIENT_GONE == 499 and response.status_code == 499 and chunks is None
        assert scheduler.submitted[0].cancelled.is_set()


@pytest.mark.parametrize("usage", [False, True])
def test_a_streamed_completion_sends_each_delta_then_the_reason_then_done(usage):
    body = {**COMPLETION, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
    scheduler = ScriptedScheduler()
    response, chunks = handle(create_completion, scheduler, body)
    assert response.status_code == 200 and response.media_type == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    events = events_of(chunks)
    assert events[-1] == "[DONE]"
    ids = {e.pop("id") for e in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert len({e.pop("created") for e in events[:-1]}) == 1
    head = {"object": "text_completion", "model": "plan"}

    def choice(text, reason):
        return {
            **head,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
            "usage": None,
            "lragent": None,
        }

    want = [choice("Pa", None), choice("ris", None), choice("", "stop")]
    if usage:
        want.append({**head, "choices": [], "usage": USAGE, "lragent": DETAILS})
    assert events[:-1] == want
    assert scheduler.submitted[0].stream is True and not scheduler.submitted[0].cancelled.is_set()


@pytest.mark.parametrize("status, kind", [(500, "server_error"), (499, "invalid_request_error")])
def test_a_stream_that_fails_midway_ends_with_the_error_then_done(status, kind):
    script = [Admitted(7), Delta("Pa"), Failed(status, "boom", None, "oops")]
    for handler, body in ((create_completion, COMPLETION), (create_chat_completion, CHAT)):
        scheduler = ScriptedScheduler(script)
        response, chunks = handle(handler, scheduler, {**body, "stream": True})
        events = events_of(chunks)
        assert events[-2:] == [{"error": {"message": "boom", "type": kind, "param": None, "code": "oops"}}, "[DONE]"]
        assert len(events) == (3 if handler is create_completion else 4)  # chat first opens the assistant's turn
        assert not scheduler.submitted[0].cancelled.is_set()  # it ended on its own


def test_a_stream_whose_client_leaves_midway_stops_and_cancels_its_request(monkeypatch):
    monkeypatch.setattr(engine_client, "POLL_S", 0.01)
    for handler, body in ((create_completion, COMPLETION), (create_chat_completion, CHAT)):
        scheduler = ScriptedScheduler([Admitted(7), Delta("Pa")])
        response, chunks = handle(handler, scheduler, {**body, "stream": True}, gone=True)
        texts = [
            e["choices"][0].get("text", e["choices"][0].get("delta", {}).get("content")) for e in events_of(chunks)
        ]
        assert texts[-1] == "Pa" and "[DONE]" not in chunks
        assert scheduler.submitted[0].cancelled.is_set()


def test_a_stream_closed_early_by_the_server_cancels_its_request():
    """The response's iterator closed before the end (the connection dropped): the row stops generating."""
    for handler, body in ((create_completion, COMPLETION), (create_chat_completion, CHAT)):
        scheduler = ScriptedScheduler()

        async def go(handler=handler, scheduler=scheduler, body=body):
            response = await handler(state_of(scheduler), RawRequest({**body, "stream": True}))
            it = response.body_iterator
            first = await it.__anext__()
            await it.aclose()
            return first

        assert asyncio.run(go()).startswith("data: {")
        assert scheduler.submitted[0].cancelled.is_set()


# ---- serving_chat -------------------------------------------------------------------------------------------------
CHAT = {
    "model": "action",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Capital"}, {"type": "text", "text": " of France?"}]},
    ],
    "max_tokens": 9,
    "max_completion_tokens": 4,
    "temperature": 0.5,
    "seed": 3,
}


def test_the_chat_prompt_is_the_template_with_the_assistant_turn_opened():
    request = parse_body(ChatCompletionRequest, json.dumps(CHAT).encode())
    assert chat_prompt(ChatTokenizer(), request) == "<system>Be brief.<user>Capital of France?<assistant>"


@pytest.mark.parametrize("template", ["absent", None, ""])
def test_a_model_without_a_chat_template_refuses_chat_naming_messages(template):
    class Plain:
        pass

    tok = Plain()
    if template != "absent":
        tok.chat_template = template
    request = parse_body(ChatCompletionRequest, json.dumps(CHAT).encode())
    with pytest.raises(ProtocolError) as exc:
        chat_prompt(tok, request)
    assert str(exc.value) == (
        "Invalid value for 'messages': this model has no chat template; use /v1/completions with a prompt. Allowed: a "
        "non-empty list of {role: system|user|assistant, content: a string or a list of text parts}."
    )
    assert exc.value.param == "messages" and exc.value.status == 400


def test_a_chat_completion_is_the_assistant_message_with_usage():
    scheduler = ScriptedScheduler()
    response, chunks = handle(create_chat_completion, scheduler, CHAT)
    assert chunks is None and response.status_code == 200
    body = json.loads(response.body)
    assert body.pop("id").startswith("chatcmpl-") and abs(body.pop("created") - time.time()) < 60
    assert body == {
        "object": "chat.completion",
        "model": "action",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
        "lragent": DETAILS,
    }
    (req,) = scheduler.submitted
    assert (req.role, req.prompt, req.max_tokens, req.prompt_field) == (
        "action",
        "<system>Be brief.<user>Capital of France?<assistant>",
        4,
        "messages",
    )
    assert (req.temperature, req.top_p, req.stop, req.seed, req.stream) == (0.5, 1.0, (), 3, False)


@pytest.mark.parametrize("usage", [False, True])
def test_a_streamed_chat_opens_the_assistant_turn_then_sends_deltas_then_the_reason(usage):
    body = {**CHAT, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
    response, chunks = handle(create_chat_completion, ScriptedScheduler(), body)
    assert response.status_code == 200 and response.media_type == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    events = events_of(chunks)
    assert events[-1] == "[DONE]"
    ids = {e.pop("id") for e in events[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert len({e.pop("created") for e in events[:-1]}) == 1
    head = {"object": "chat.completion.chunk", "model": "action", "usage": None, "lragent": None}

    def delta(role, content, reason=None):
        return {
            **head,
            "choices": [
                {"index": 0, "delta": {"role": role, "content": content}, "logprobs": None, "finish_reason": reason}
            ],
        }

    want = [delta("assistant", ""), delta(None, "Pa"), delta(None, "ris"), delta(None, None, "stop")]
    if usage:
        want.append({**head, "choices": [], "usage": USAGE, "lragent": DETAILS})
    assert events[:-1] == want


# ---- api_server ---------------------------------------------------------------------------------------------------
def client_of(scheduler: ScriptedScheduler, api_key: str | None = None) -> TestClient:
    return TestClient(build_app(state_of(scheduler, api_key)), raise_server_exceptions=False)


def test_the_app_starts_the_scheduler_and_stops_it_at_shutdown():
    scheduler = ScriptedScheduler()
    state = state_of(scheduler)
    assert build_app(state).state.serve is state  # the app carries what it serves
    with client_of(scheduler) as client:
        assert scheduler.calls == ["start"]
        assert client.get("/health").status_code == 200
        scheduler.alive = False
        assert client.get("/health").status_code == 503
    assert scheduler.calls == ["start", "stop"]


def test_models_lists_the_roles_with_the_base_model_as_their_parent():
    with client_of(ScriptedScheduler()) as client:
        response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    created = {card.pop("created") for card in body["data"]}
    assert len(created) == 1 and abs(created.pop() - time.time()) < 60
    card = {"object": "model", "owned_by": "lragent", "max_model_len": 63}
    assert body == {
        "object": "list",
        "data": [
            {"id": "plan", **card, "root": "plan", "parent": "Base"},
            {"id": "action", **card, "root": "action", "parent": "Base"},
            {"id": "Base", **card, "root": "Base", "parent": None},
        ],
    }


def test_metrics_are_prometheus_text():
    with client_of(ScriptedScheduler()) as client:
        response = client.get("/metrics")
    assert response.status_code == 200 and response.text == "lragent_num_requests_running 0\n"
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_the_routes_serve_completions_and_chat():
    with client_of(ScriptedScheduler()) as client:
        completion = client.post("/v1/completions", json=COMPLETION)
        chat = client.post("/v1/chat/completions", json=CHAT)
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "Paris"
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "Paris"


def test_v1_needs_the_key_and_health_does_not():
    key_error = {
        "message": "Incorrect or missing API key: send the header 'Authorization: Bearer KEY'.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    with client_of(ScriptedScheduler(), api_key="s3cret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = client.get("/v1/models", headers=headers)
            assert response.status_code == 401 and response.json() == {"error": key_error}, headers
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
    with client_of(ScriptedScheduler()) as client:  # no key: none asked
        assert client.get("/v1/models").status_code == 200


def test_errors_are_openai_error_objects_with_their_status(capsys):
    refused = RequestError("the server is shutting down", code="shutting_down", status=503)
    with client_of(ScriptedScheduler(refuse=refused)) as client:
        response = client.post("/v1/completions", json=COMPLETION)
        assert response.status_code == 503
        assert response.json() == {
            "error": {
                "message": "the server is shutting down",
                "type": "server_error",
                "param": None,
                "code": "shutting_down",
            }
        }
        response = client.post("/v1/completions", json={**COMPLETION, "model": "planner"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        assert response.json()["error"]["param"] == "model"
        response = client.get("/v1/nowhere")
        assert response.status_code == 404
        assert response.json() == {
            "error": {
                "message": "GET /v1/nowhere: Not Found",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        response = client.get("/v1/completions")
        assert response.status_code == 405
        assert response.json()["error"]["message"] == "GET /v1/completions: Method Not Allowed"
    with client_of(ScriptedScheduler(refuse=RuntimeError("secret"))) as client:
        response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 500 and "secret" not in response.text
    assert response.json() == {
        "error": {
            "message": "internal error while serving this request (logged by the server)",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    err = capsys.readouterr().err
    assert "lragent serve: internal error on /v1/completions: RuntimeError('secret')" in err
    assert "Traceback" in err  # the details go to the server's log


def test_a_route_whose_parameters_do_not_validate_is_a_400_error_object():
    app = build_app(state_of(ScriptedScheduler()))

    @app.get("/v1/probe")
    async def probe(n: int) -> dict:
        return {"n": n}

    with TestClient(app) as client:
        assert client.get("/v1/probe?n=3").json() == {"n": 3}
        response = client.get("/v1/probe?n=x")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith("Invalid request: Input should be a valid integer")
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)


def test_bind_listens_on_a_free_port_and_refuses_a_busy_one_in_one_line():
    sock = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert sock.family == socket.AF_INET and port > 0 and sock.get_inheritable()
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) != 0
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # listening
        with pytest.raises(ValueError) as exc:
            bind("127.0.0.1", port)
        assert str(exc.value) == f"cannot listen on 127.0.0.1:{port}: Address already in use; allowed: a free port"
    finally:
        sock.close()
    probe = socket.socket(socket.AF_INET6) if socket.has_ipv6 else None
    try:
        if probe is None:
            pytest.skip("no IPv6 here")
        probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    finally:
        if probe is not None:
            probe.close()
    six = bind("::1", 0)  # an address with a colon is IPv6
    assert six.family == socket.AF_INET6 and six.getsockname()[0] == "::1"
    six.close()


def test_the_server_config_serves_the_app_quietly():
    app = build_app(state_of(ScriptedScheduler()))
    config = _config(app, "info")
    assert (config.app, config.log_level, config.access_log, config.lifespan) == (app, "info", False, "on")
    assert config.timeout_keep_alive == 30


def test_a_signal_stops_the_server_gracefully_and_a_second_sigint_forces_it():
    server = _Server(_config(build_app(state_of(ScriptedScheduler())), "warning"))
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert not server.force_exit  # a second SIGTERM still waits for the requests in flight
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit
    first = _Server(_config(build_app(state_of(ScriptedScheduler())), "warning"))
    first.handle_exit(signal.SIGINT, None)
    assert first.should_exit and not first.force_exit


def test_a_server_thread_serves_until_stopped_then_stops_the_scheduler():
    scheduler = ScriptedScheduler()
    server = ServerThread(build_app(state_of(scheduler))).start()
    try:
        assert server.url == f"http://127.0.0.1:{server.port}" and server.port > 0
        assert scheduler.calls == ["start"]
        with socket.create_connection((server.host, server.port), timeout=10) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()
    assert scheduler.calls == ["start", "stop"] and not server.thread.is_alive() and server.sock.fileno() == -1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's exit(3)
def test_a_server_thread_that_cannot_start_says_so():
    scheduler = ScriptedScheduler()
    scheduler.start = lambda: (_ for _ in ()).throw(RuntimeError("no device"))  # the lifespan's startup fails
    server = ServerThread(build_app(state_of(scheduler)))
    with pytest.raises(RuntimeError) as exc:
        server.start(timeout=10)
    assert str(exc.value) == f"the server on {server.url} did not start"
    server.sock.close()


def test_the_app_publishes_no_api_schema_or_docs_pages():
    with client_of(ScriptedScheduler()) as client:
        for path in ("/openapi.json", "/docs", "/redoc"):
            response = client.get(path)
            assert response.status_code == 404 and response.json()["error"]["message"] == f"GET {path}: Not Found"


def test_serve_until_stopped_answers_until_sigterm_then_returns_without_dying(capfd):
    """In the main thread as ``lragent serve`` runs it: a SIGTERM stops the server gracefully (the scheduler is
    stopped) and is not raised again afterwards, so the process goes on to its own exit line."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("uvicorn takes the signals in the main thread only (a SIGTERM here would end the process)")
    scheduler = ScriptedScheduler()
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    answers: list[int] = []

    def client() -> None:
        for _ in range(500):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                answers.append(conn.getresponse().status)
                conn.close()
                break
            except OSError:
                time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=client, daemon=True)
    helper.start()
    serve_until_stopped(build_app(state_of(scheduler)), sock)
    helper.join(10)
    sock.close()
    assert answers == [200] and scheduler.calls == ["start", "stop"]
    assert "Started server" not in capfd.readouterr().err  # warning level: uvicorn's info lines are not shown


def test_server_threads_take_free_ports_quietly_and_do_not_keep_the_process_alive(capfd):
    first = ServerThread(build_app(state_of(ScriptedScheduler())))
    second = ServerThread(build_app(state_of(ScriptedScheduler())))
    try:
        assert first.port != second.port and first.thread.daemon and second.thread.daemon
    finally:
        first.sock.close()
        second.sock.close()
    scheduler = ScriptedScheduler()
    scheduler.start = lambda: time.sleep(0.2)  # a startup of 0.2 s: not started at the first look
    server = ServerThread(build_app(state_of(scheduler)))
    t0 = time.perf_counter()
    server.start()
    started = time.perf_counter() - t0
    server.stop()
    assert 0.2 <= started < 0.9, started  # it is polled for every 10 ms: start returns soon after the server is up
    assert "Started server" not in capfd.readouterr().err


def test_a_server_thread_waits_for_a_slow_startup():
    scheduler = ScriptedScheduler()
    scheduler.start = lambda: time.sleep(0.5)  # the lifespan takes half a second to start the scheduler
    server = ServerThread(build_app(state_of(scheduler))).start()
    try:
        assert server.server.started
    finally:
        server.stop()


def test_stop_gives_up_after_its_timeout_when_a_request_never_ends(monkeypatch):
    monkeypatch.setattr(engine_client, "POLL_S", 0.05)
    scheduler = ScriptedScheduler([Admitted(7)])  # admitted, then nothing: the request never ends
    server = ServerThread(build_app(state_of(scheduler))).start()
    conn = socket.create_connection((server.host, server.port), timeout=10)
    body = json.dumps({**COMPLETION, "stream": True}).encode()
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    for _ in range(500):
        if scheduler.submitted:
            break
        time.sleep(0.01)
    t0 = time.perf_counter()
    server.stop(timeout=0.3)
    assert 0.25 < time.perf_counter() - t0 < 5 and server.thread.is_alive()  # still serving the open request
    conn.close()  # the client leaves: its request is cancelled and the server ends
    server.thread.join(10)
    assert not server.thread.is_alive() and scheduler.submitted[0].cancelled.is_set()
