"""``eval --server``'s client side against a stub HTTP server on 127.0.0.1 (eval_suite/evaluate/server_client.py):
the URLs it takes, the requests it sends (headers, the trajectory as the prompt, per-call seeds), how it reads plain
and streamed answers and errors, its one retry on a kept-alive connection the server closed, the episodes it runs
``concurrency`` at a time, and the context bound it reads from ``/v1/models``."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from eval_suite.evaluate.server_client import (
    Completion,
    ServeClient,
    ServerError,
    ServerExecutor,
    ServerPolicy,
    check_server_args,
    check_server_url,
    served_context_bound,
    server_executor,
)
from lragent.agents.requests import Choose, Generate, Reply, StepStats
from lragent.schemes import Scheme

Answer = tuple[int, str | None, bytes | list[bytes]]  # status, content type (None: no header), body (parts: sent
# 0.15 s apart)


class Stub:
    """An HTTP/1.1 server (keep-alive) whose answer to each request is ``route(method, path, headers, body)``;
    it records the requests (and their raw bodies), counts the connections and the answers sent. ``close_after``
    requests on a connection, it closes it."""

    def __init__(self, route: Callable[[str, str, dict, dict | None], Answer], close_after: int = 0) -> None:
        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.raw: list[bytes] = []
        self.connections = 0
        self.answered = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            served = 0

            def setup(self) -> None:
                super().setup()
                stub.connections += 1

            def log_message(self, *args) -> None:
                pass

            def answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                body = json.loads(raw) if n else None
                headers = {k.lower(): v for k, v in self.headers.items()}
                stub.requests.append((self.command, self.path, headers, body))
                stub.raw.append(raw)
                status, kind, data = route(self.command, self.path, headers, body)
                parts = data if isinstance(data, list) else [data]
                self.send_response(status)
                if kind is not None:
                    self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(sum(map(len, parts))))
                self.end_headers()
                for i, part in enumerate(parts):
                    if i:
                        time.sleep(0.15)
                    self.wfile.write(part)
                    self.wfile.flush()
                stub.answered += 1
                self.served += 1
                if close_after and self.served >= close_after:
                    self.close_connection = True

            do_GET = do_POST = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)


@contextmanager
def stub_server(route, close_after: int = 0):
    stub = Stub(route, close_after)
    stub.thread.start()
    try:
        yield stub
    finally:
        stub.server.shutdown()
        stub.server.server_close()


def as_json(obj: object, status: int = 200) -> Answer:
    return status, "application/json", json.dumps(obj).encode()


USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 4}}
DETAILS = {
    "scheme": "base_lr_shared",
    "prefill_tokens": 8,
    "recomputed_tokens": 2,
    "trajectory_tokens": 25,
    "prefill_s": 0.5,
    "decode_s": 0.25,
    "ttft_s": 0.1,
}


def completions(method: str, path: str, headers: dict, body: dict | None) -> Answer:
    """A server that answers each completion with ``<model:prompt length>``, streamed when asked."""
    if path == "/health":
        return 200, "text/plain", b""
    text = f"<{body['model']}:{len(body['prompt'])}>"
    if not body.get("stream"):
        return as_json({"choices": [{"text": text, "finish_reason": "stop"}], "usage": USAGE, "lragent": DETAILS})
    events = [
        ": a comment line",
        "data: " + json.dumps({"choices": [{"text": "", "finish_reason": None}]}),
        "data: " + json.dumps({"choices": [{"text": text[:2], "finish_reason": None}]}),
        "data: " + json.dumps({"choices": [{"text": text[2:], "finish_reason": None}]}),
        "data: " + json.dumps({"choices": [{"text": "", "finish_reason": "length"}], "usage": None}),
        "data: " + json.dumps({"choices": [], "usage": USAGE, "lragent": DETAILS}),
        "data: [DONE]",
        "data: " + json.dumps({"choices": [{"text": "after done", "finish_reason": "stop"}]}),
    ]
    first, rest = events[:3], events[3:]  # the first text, then (0.15 s later) the rest
    return 200, "text/event-stream", ["".join(e + "\n\n" for e in part).encode() for part in (first, rest)]


# ---- URLs -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url, base",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://h:1/v1", "http://h:1"),
        ("http://h:1/v1/", "http://h:1"),
        ("https://example.org", "https://example.org"),
    ],
)
def test_a_server_url_is_its_base_with_or_without_v1(url, base):
    assert check_server_url(url) == base


@pytest.mark.parametrize("url", ["ftp://h:1", "127.0.0.1:8000", "http://", "http://:80"])
def test_a_url_that_is_not_http_host_port_is_refused(url):
    with pytest.raises(ValueError) as exc:
        check_server_url(url)
    assert str(exc.value) == f"--server {url!r}: allowed a URL like http://127.0.0.1:8000 (or .../v1)"


@pytest.mark.parametrize("url", ["http://h:1/v2", "http://h:1/v1/completions", "http://h:1/X", "http://h:1/v1X"])
def test_a_url_with_another_path_is_refused(url):
    with pytest.raises(ValueError) as exc:
        check_server_url(url)
    assert str(exc.value) == f"--server {url!r}: allowed a URL like http://127.0.0.1:8000 (or .../v1), no other path"


def test_a_client_connects_to_the_url_port_or_the_scheme_default():
    plain, tls = ServeClient("http://example.org/v1"), ServeClient("https://example.org", timeout=7.0)
    assert (plain.host, plain.port, plain.https, plain.base) == ("example.org", 80, False, "http://example.org")
    assert (tls.host, tls.port, tls.https) == ("example.org", 443, True)
    assert ServeClient("https://h:8443").port == 8443 and ServeClient("http://h:8000").port == 8000
    conn = tls._connection()  # lazy: nothing is sent yet
    assert isinstance(conn, http.client.HTTPSConnection) and conn.timeout == 7.0 and tls._connection() is conn
    assert type(plain._connection()) is http.client.HTTPConnection and plain._connection().timeout == 600.0
    tls.close()
    assert tls._conn is None
    tls.close()  # twice: nothing to close


# ---- requests and answers -------------------------------------------------------------------------------------------
def test_a_completion_sends_json_with_the_key_and_reads_the_answer():
    with stub_server(completions) as stub:
        client = ServeClient(stub.url + "/v1", api_key="k3y")
        body = {"model": "plan", "prompt": "Question", "max_tokens": 4}
        done = client.completion(body)
        client.close()
    assert (done.text, done.finish_reason, done.usage, done.details) == ("<plan:8>", "stop", USAGE, DETAILS)
    assert done.request is body and done.ttft_s == done.wall_s and 0 < done.wall_s < 30
    ((method, path, headers, sent),) = stub.requests
    assert stub.raw == [json.dumps(body).encode()]
    assert (method, path, sent) == ("POST", "/v1/completions", body)
    assert headers["authorization"] == "Bearer k3y" and headers["content-type"] == "application/json"


def test_without_a_key_no_authorization_is_sent_and_a_get_reads_json_or_text():
    def route(method, path, headers, body):
        return as_json({"data": [1]}) if path == "/v1/models" else (200, "text/plain", b"lragent_up 1\n")

    with stub_server(route) as stub:
        client = ServeClient(stub.url, api_key="")
        assert client.get("/v1/models") == {"data": [1]}
        assert client.get("/metrics") == "lragent_up 1\n"
        client.close()
    assert all("authorization" not in h for _, _, h, _ in stub.requests) and stub.raw == [b"", b""]  # no body
    assert [(m, p, b) for m, p, _, b in stub.requests] == [("GET", "/v1/models", None), ("GET", "/metrics", None)]
    assert stub.connections == 1  # one keep-alive connection


@pytest.mark.parametrize(
    "answer, message",
    [
        (as_json({"error": {"message": "The model `x` does not exist."}}, 404), "The model `x` does not exist."),
        ((502, "text/html", b"<h1>Bad gateway</h1>" + b"x" * 400), "<h1>Bad gateway</h1>" + "x" * 280),
        (as_json({"detail": "nope"}, 401), '{"detail": "nope"}'),
        (as_json(["a"], 400), '["a"]'),
        ((500, "text/plain", b"\xffbad"), "\ufffdbad"),
    ],
)
def test_an_error_answer_is_one_line_with_its_status_and_message(answer, message):
    with stub_server(lambda *a: answer) as stub:
        client = ServeClient(stub.url)
        for call in (lambda: client.get("/v1/models"), lambda: client.completion({"model": "plan", "prompt": "x"})):
            with pytest.raises(ServerError) as exc:
                call()
            assert str(exc.value) == f"the server answered {answer[0]}: {message}" and exc.value.status == answer[0]
        client.close()


def test_a_streamed_completion_joins_its_text_and_keeps_the_connection():
    with stub_server(completions) as stub:
        client = ServeClient(stub.url)
        body = {"model": "action", "prompt": "abc", "stream": True}
        done = client.completion(body)
        again = client.completion({"model": "plan", "prompt": "abcd"})  # the same connection serves the next one
        client.close()
    assert (done.text, done.finish_reason, done.usage, done.details) == ("<action:3>", "length", USAGE, DETAILS)
    assert 0 < done.ttft_s < done.wall_s - 0.1 and done.wall_s < 30 and done.request is body  # text came first
    assert again.text == "<plan:4>" and stub.connections == 1


def test_a_stream_without_text_or_usage_times_its_first_token_as_the_whole_request():
    def route(method, path, headers, body):
        events = ["data: " + json.dumps({"choices": [{"text": "", "finish_reason": "stop"}]}), "data: [DONE]"]
        return 200, "text/event-stream", "".join(e + "\n\n" for e in events).encode()

    with stub_server(route) as stub:
        done = ServeClient(stub.url).completion({"model": "plan", "prompt": "x", "stream": True})
    assert (done.text, done.finish_reason, done.usage, done.details) == ("", "stop", {}, {})
    assert done.ttft_s == done.wall_s and 0 < done.wall_s < 30


def test_a_stream_that_fails_midway_is_a_server_error():
    def route(method, path, headers, body):
        events = [
            "data: " + json.dumps({"choices": [{"text": "a", "finish_reason": None}]}),
            "data: " + json.dumps({"error": {"message": "out of memory", "type": "server_error"}}),
            "data: [DONE]",
        ]
        return 200, "text/event-stream", "".join(e + "\n\n" for e in events).encode()

    with stub_server(route) as stub:
        with pytest.raises(ServerError) as exc:
            ServeClient(stub.url).completion({"model": "plan", "prompt": "x", "stream": True})
    assert str(exc.value) == "the server failed the request: out of memory" and exc.value.status == 500


def test_a_plain_answer_without_server_figures_has_none():
    def route(method, path, headers, body):
        return as_json({"choices": [{"text": "t", "finish_reason": "length"}], "usage": USAGE, "lragent": None})

    with stub_server(route) as stub:
        done = ServeClient(stub.url).completion({"model": "plan", "prompt": "x"})
    assert done.details == {} and done.finish_reason == "length"


def test_a_kept_alive_connection_the_server_closed_is_retried_once_on_a_fresh_one():
    with stub_server(completions, close_after=1) as stub:
        client = ServeClient(stub.url)
        assert client.completion({"model": "plan", "prompt": "a"}).text == "<plan:1>"
        time.sleep(0.05)  # the server has closed its end
        assert client.completion({"model": "plan", "prompt": "ab"}).text == "<plan:2>"
        client.close()
    assert stub.connections == 2 and len(stub.requests) == 2


def test_a_server_that_cannot_be_reached_is_one_line():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    client = ServeClient(f"http://127.0.0.1:{port}")
    with pytest.raises(ServerError) as exc:
        client.get("/health")
    assert str(exc.value).startswith(f"--server http://127.0.0.1:{port}: cannot reach the server (")
    assert "Connection refused" in str(exc.value) and exc.value.status is None and client._conn is None


def test_a_server_that_does_not_answer_in_time_is_not_retried():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()[0]) for _ in range(2)], daemon=True).start()
    try:
        client = ServeClient(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.3)
        with pytest.raises(ServerError) as exc:
            client.get("/health")
        assert "cannot reach the server (timed out)" in str(exc.value) and client._conn is None
        time.sleep(0.2)
        assert len(accepted) == 1  # a timeout is not a closed keep-alive connection: no second try
    finally:
        for s in accepted:
            s.close()
        listener.close()


# ---- the policy -----------------------------------------------------------------------------------------------------
def test_the_policy_sends_the_whole_trajectory_with_a_seed_per_call():
    policy = ServerPolicy(None, temperature=0.5, top_p=0.9, seed=100)
    first = policy.body("plan", "Q: x\n", 8, ["\n"])
    assert first == {
        "model": "plan",
        "prompt": "Q: x\n",
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 100,
        "stop": ["\n"],
    }
    assert policy.answer(Completion("Thought", "stop", USAGE, DETAILS, 0.1, 0.2)) == "Thought"
    second = policy.body("action", " Act:", 4, [])
    assert (second["prompt"], second["seed"], second["stop"], second["model"]) == (
        "Q: x\nThought Act:",
        101,
        None,
        "action",
    )
    assert policy.calls == 2 and policy.text == "Q: x\nThought Act:"
    streaming = ServerPolicy(None, temperature=0.0, top_p=1.0, stream=True)
    body = streaming.body("plan", "a", 1, ("]", "\n"))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["seed"] == 0
    assert body["stop"] == ["]", "\n"] and "stream" not in first


def test_the_policy_keeps_each_calls_cost_from_the_server_figures_or_the_usage():
    policy = ServerPolicy(None, temperature=0.0, top_p=1.0)
    assert policy.last_stats is None  # no call yet
    policy.body("plan", "a", 3, [])
    policy.answer(Completion("b", "stop", USAGE, DETAILS, 0.1, 0.2))
    assert policy.last_stats == StepStats(
        prefill_tokens=8, decode_tokens=3, prefill_s=0.5, decode_s=0.25, recomputed_tokens=2, trajectory_tokens=25
    )
    plain = {"prompt_tokens": 10, "completion_tokens": 3}
    policy.answer(Completion("c", "stop", plain, {}, 0.1, 0.2))  # no server figures, no cached tokens
    assert policy.last_stats == StepStats(
        prefill_tokens=10, decode_tokens=3, prefill_s=0.0, decode_s=0.0, recomputed_tokens=0, trajectory_tokens=13
    )
    policy.answer(Completion("d", "stop", {**plain, "prompt_tokens_details": {"cached_tokens": 6}}, {}, 0.1, 0.2))
    assert policy.last_stats.prefill_tokens == 4 and policy.last_stats.trajectory_tokens == 13
    policy.answer(Completion("e", "stop", {**plain, "prompt_tokens_details": None}, {}, 0.1, 0.2))
    assert policy.last_stats.prefill_tokens == 10
    policy.answer(Completion("f", "stop", {}, {}, 0.1, 0.2))
    assert policy.last_stats == StepStats(trajectory_tokens=0)
    assert policy.text == "abcdef" and len(policy.completions) == 5
    policy.reset()
    assert (policy.text, policy.calls, policy.last_stats, policy.completions) == ("", 0, None, [])


def test_the_policy_generates_through_its_client_and_refuses_constrained_choices():
    with stub_server(completions) as stub:
        policy = ServerPolicy(ServeClient(stub.url), temperature=0.0, top_p=1.0, seed=3)
        assert policy.generate("reflect", "abc", max_new_tokens=2, stop=["\n"]) == "<reflect:3>"
        policy.client.close()
    assert stub.requests[0][3]["seed"] == 3 and stub.requests[0][3]["max_tokens"] == 2
    assert policy.text == "abc<reflect:3>"
    with pytest.raises(ServerError) as exc:
        policy.choose("plan", "x", ["a", "b"])
    assert str(exc.value) == (
        "--server: constrained choices (--constrain) score options by teacher forcing, which the "
        "completions API does not return; run them without --server"
    )


# ---- the executor ---------------------------------------------------------------------------------------------------
def episode(name: str, calls: int) -> Generator:
    """``calls`` plan calls, each appending its call number; returns (name, the texts the server gave, the stats)."""
    texts, stats = [], []
    for i in range(calls):
        reply = yield Generate("plan", f"{name}{i}|", 5, ("\n",))
        texts.append(reply.text)
        stats.append(reply.stats)
    return name, texts, stats


def task(name: str, calls: int, seed: int = 0, take: bool = True, scheme: Scheme = Scheme.BASE_LR_SHARED):
    return SimpleNamespace(
        key=(name, 0, name), scheme=scheme, seed=seed, episode=episode(name, calls), take=lambda: take
    )


@pytest.mark.parametrize("concurrency", [1, 3])
def test_the_executor_runs_every_taken_episode_and_yields_its_result(concurrency):
    with stub_server(completions) as stub:
        ex = ServerExecutor(stub.url + "/v1/", temperature=0.0, top_p=1.0, concurrency=concurrency)
        tasks = [task("a", 2, seed=10), task("skipped", 1, take=False), task("b", 0), task("c", 1, seed=7)]
        got = {t.key[0]: result for t, result in ex.run(tasks)}
    assert ex.url == stub.url and set(got) == {"a", "b", "c"}
    assert got["a"][:2] == ("a", ["<plan:3>", "<plan:14>"]) and got["b"] == ("b", [], [])
    assert got["c"][:2] == ("c", ["<plan:3>"])
    assert got["a"][2][0] == StepStats(8, 3, 0.5, 0.25, 2, 25)
    sent = sorted((b["prompt"], b["seed"]) for _, _, _, b in stub.requests)
    assert sent == [("a0|", 10), ("a0|<plan:3>a1|", 11), ("c0|", 7)]
    for _, _, headers, body in stub.requests:  # the episode's budget and stops, the executor's sampling, not streamed
        assert (body["model"], body["max_tokens"], body["stop"], body["temperature"], body["top_p"]) == (
            "plan",
            5,
            ["\n"],
            0.0,
            1.0,
        )
        assert "stream" not in body and "authorization" not in headers
    assert [d.text for d in ex.episode_calls[("a", 0, "a")]] == ["<plan:3>", "<plan:14>"]
    assert ex.episode_calls[("b", 0, "b")] == [] and len(ex.completions) == 3
    assert ("skipped", 0, "skipped") not in ex.episode_calls


def test_the_executor_runs_concurrency_episodes_at_once():
    seen: list[int] = []
    active = [0]
    lock = threading.Lock()

    def slow(method, path, headers, body):
        with lock:
            active[0] += 1
            seen.append(active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return completions(method, path, headers, body)

    with stub_server(slow) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0, concurrency=2)
        assert len(list(ex.run([task(n, 1) for n in "abcd"]))) == 4
    assert max(seen) == 2 and stub.connections == 2  # two at a time, each worker thread on its own connection
    seen.clear()
    with stub_server(slow) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0)  # one at a time unless told
        assert ex.concurrency == 1 and len(list(ex.run([task(n, 1) for n in "ab"]))) == 2
    assert max(seen) == 1


def test_a_task_is_taken_only_when_a_slot_is_free():
    """With a shared work queue another process may run a task meanwhile: the executor claims the next task only
    once one of its ``concurrency`` episodes has ended."""
    yielded: list[str] = []
    ended_at_take: list[list[str]] = []

    def take() -> bool:
        ended_at_take.append(list(yielded))
        return True

    tasks = [task("a", 1), task("b", 1)]
    tasks[1].take = take
    with stub_server(completions) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0, concurrency=1)
        for t, _ in ex.run(tasks):
            yielded.append(t.key[0])
    assert yielded == ["a", "b"] and ended_at_take == [["a"]]  # b was claimed once a had ended


def test_an_episode_goes_on_as_soon_as_its_own_request_is_answered():
    """Episodes in flight do not wait for each other: a fast episode's next calls go while a slow one's request is
    still being served, so the fast one ends first."""

    def route(method, path, headers, body):
        if body["prompt"].startswith("slow"):
            time.sleep(0.6)
        return completions(method, path, headers, body)

    with stub_server(route) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0, concurrency=2)
        order = [t.key[0] for t, _ in ex.run([task("slow", 1), task("fast", 3)])]
    assert order == ["fast", "slow"]


def test_the_executor_streams_when_told_and_sends_its_key():
    with stub_server(completions) as stub:
        ex = ServerExecutor(stub.url, temperature=0.5, top_p=0.9, api_key="k3y", stream=True)
        ((_, (name, texts, _)),) = list(ex.run([task("a", 1)]))
    assert texts == ["<plan:3>"] and ex.completions[0].finish_reason == "length"
    ((_, _, headers, body),) = stub.requests
    assert headers["authorization"] == "Bearer k3y"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_p"]) == (0.5, 0.9)


class Recording(ServeClient):
    """ServeClient, recording the timeout of every client made."""

    made: list[float | None] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        Recording.made.append(self.timeout)


def test_probes_wait_10_s_and_episode_requests_the_executors_timeout(monkeypatch):
    """The health check and the context probe give up after 10 s; an episode's requests wait ``timeout`` (600 s
    unless told: a long generation)."""
    import eval_suite.evaluate.server_client as server_client

    monkeypatch.setattr(server_client, "ServeClient", Recording)
    Recording.made = []
    with stub_server(
        lambda m, p, h, b: as_json({"data": []}) if p == "/v1/models" else completions(m, p, h, b)
    ) as stub:
        ServerExecutor(stub.url, temperature=0.0, top_p=1.0).check()
        served_context_bound(stub.url)
        list(ServerExecutor(stub.url, temperature=0.0, top_p=1.0).run([task("a", 1)]))
        list(ServerExecutor(stub.url, temperature=0.0, top_p=1.0, timeout=5.0).run([task("b", 1)]))
    assert Recording.made == [10, 10, 600.0, 5.0]


def test_an_episode_run_under_another_scheme_than_the_servers_is_refused():
    with stub_server(completions) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0)
        with pytest.raises(ServerError) as exc:
            list(ex.run([task("a", 1, scheme=Scheme.NON_SHARED)]))
    assert str(exc.value) == (
        f"--server {stub.url} serves scheme base_lr_shared, the episode asked for non_shared: "
        "allowed --scheme base_lr_shared with this server"
    )


def test_an_episode_asking_a_constrained_choice_is_refused():
    def choosing() -> Generator:
        yield Choose("plan", "x", ("a", "b"))
        return None

    with stub_server(completions) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0)
        bad = SimpleNamespace(
            key=("a", 0, "a"), scheme=Scheme.BASE_LR_SHARED, seed=0, episode=choosing(), take=lambda: True
        )
        with pytest.raises(ServerError, match="constrained choices"):
            list(ex.run([bad]))
    assert stub.requests == []


def test_a_request_the_server_refuses_ends_the_run():
    with stub_server(lambda *a: as_json({"error": {"message": "too long"}}, 400)) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0)
        with pytest.raises(ServerError, match="the server answered 400: too long"):
            list(ex.run([task("a", 1)]))


def test_the_executor_checks_its_options_and_the_servers_health():
    with pytest.raises(ValueError) as exc:
        ServerExecutor("http://h:1", temperature=0.0, top_p=1.0, concurrency=0)
    assert str(exc.value) == "concurrency must be >= 1, got 0"
    with stub_server(lambda m, p, h, b: (200 if p == "/health" else 404, "text/plain", b"")) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0, api_key="k")
        ex.reserve(Scheme.NON_SHARED, 4)  # nothing to reserve
        ex.check()
        assert stub.requests[0][:2] == ("GET", "/health") and stub.requests[0][2]["authorization"] == "Bearer k"
    with stub_server(lambda *a: (503, "text/plain", b"")) as stub:
        with pytest.raises(ServerError) as exc:
            ServerExecutor(stub.url, temperature=0.0, top_p=1.0).check()
    assert str(exc.value) == "the server answered 503: " and exc.value.status == 503


def test_eval_server_builds_its_executor_from_batch_and_the_environment(monkeypatch):
    with stub_server(completions) as stub:
        monkeypatch.setenv("LRAGENT_API_KEY", "env-key")
        for batch, concurrency in ((0, 1), (None, 1), (1, 1), (4, 4), ("3", 3)):
            ex = server_executor({"server": stub.url}, 0.3, 0.8, batch)
            assert (ex.concurrency, ex.api_key, ex.temperature, ex.top_p) == (concurrency, "env-key", 0.3, 0.8)
        monkeypatch.setenv("LRAGENT_API_KEY", "")
        assert server_executor({"server": stub.url}, 0.0, 1.0, 0).api_key is None
    assert {p for _, p, _, _ in stub.requests} == {"/health"} and len(stub.requests) == 6  # checked every time


def test_eval_server_refuses_what_the_api_cannot_do():
    check_server_args({"server": "http://h:1", "batch": 2}, [])
    with pytest.raises(ValueError, match="allowed a URL like"):
        check_server_args({"server": "h:1"}, [])
    with pytest.raises(ValueError) as exc:
        check_server_args({"server": "http://h:1"}, ["answer", "action"])
    assert str(exc.value) == (
        "--server with --constrain answer,action: constrained choices score options by teacher "
        "forcing, which the completions API does not return; allowed --constrain none with "
        "--server"
    )
    with pytest.raises(ValueError) as exc:
        check_server_args({"server": "http://h:1", "batch": "auto"}, [])
    assert str(exc.value) == (
        "--server with --batch auto: the server sizes its own rows; allowed --batch N (episodes "
        "in flight, default 0: one at a time)"
    )


@pytest.mark.parametrize(
    "listing, bound",
    [
        ({"data": [{"max_model_len": 4095}, {"max_model_len": 8191}]}, 4096 - 2048),
        (
            {
                "data": [
                    {"max_model_len": 3000},
                    {"max_model_len": True},
                    {"max_model_len": 0},
                    {"max_model_len": "9"},
                    {},
                ]
            },
            3001 - 2048,
        ),
        ({"data": [{"max_model_len": 2047}]}, None),
        ({"data": [{"max_model_len": 2048}]}, 1),
        ({"data": []}, None),
        ({"data": [{"max_model_len": 1}, {"max_model_len": 4095}]}, None),  # the smallest context counts
        ({}, None),
        ("not json", None),
    ],
)
def test_the_served_context_bound_is_the_smallest_context_less_a_cycle(listing, bound):
    def route(method, path, headers, body):
        assert path == "/v1/models"
        return as_json(listing) if isinstance(listing, dict) else (200, "text/plain", listing.encode())

    with stub_server(route) as stub:
        assert served_context_bound(stub.url, "k") == bound
    assert stub.requests[0][2]["authorization"] == "Bearer k"


def test_the_context_bound_of_a_server_that_refuses_is_its_error():
    with stub_server(lambda *a: as_json({"error": {"message": "Incorrect API key"}}, 401)) as stub:
        with pytest.raises(ServerError, match="the server answered 401: Incorrect API key"):
            served_context_bound(stub.url)


def test_a_reply_carries_a_copy_of_the_calls_stats():
    """The executor hands each episode its own StepStats (the policy's last_stats is replaced at the next call)."""
    with stub_server(completions) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0)
        ((_, (name, texts, stats)),) = list(ex.run([task("a", 2)]))
    assert stats[0] == stats[1] == StepStats(8, 3, 0.5, 0.25, 2, 25) and stats[0] is not stats[1]
    assert isinstance(Reply(text="x", stats=stats[0]).stats, StepStats)


def test_an_answer_without_a_content_type_is_text():
    with stub_server(lambda *a: (200, None, b'{"a": 1}')) as stub:
        assert ServeClient(stub.url).get("/v1/models") == '{"a": 1}'


def test_a_run_ended_by_an_error_returns_only_once_its_requests_in_flight_are_done():
    """No request of a run is still being served when ``run`` returns: its connections close after the last
    answer, not under a request."""
    finished: list[str] = []

    def route(method, path, headers, body):
        if body["prompt"].startswith("slow"):
            time.sleep(0.5)
            finished.append("slow")
        return completions(method, path, headers, body)

    with stub_server(route) as stub:
        ex = ServerExecutor(stub.url, temperature=0.0, top_p=1.0, concurrency=2)
        tasks = [task("slow", 1), task("wrong", 1, scheme=Scheme.NON_SHARED)]  # the second one ends the run
        with pytest.raises(ServerError, match="serves scheme base_lr_shared"):
            list(ex.run(tasks))
        assert finished == ["slow"]
