"""The server's errors and its behaviour under failure, over HTTP on 127.0.0.1: bad requests are 400s naming their
field, a missing key a 401, out of memory a 503 after which the server goes on, a client that leaves mid-stream frees
its row, SIGTERM answers every request in flight before the process exits; no traceback reaches a client.

A tiny random model with a byte tokenizer serves the in-process cases; the SIGTERM case runs ``cli.py serve`` (the
embedded model) as its own process."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import tiny_multi_lora

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent


class ByteTokenizer:
    """One token per UTF-8 byte; no chat template."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", "replace")


@contextmanager
def tiny_server(rows: int = 2, capacity: int = 64, api_key: str | None = None, scheme: str = "base_lr_shared"):
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    engine = Engine(model, scheme, rows=rows, capacity=capacity, tokenizer=tok, eos_token_ids=[])
    scheduler = Scheduler(engine, tok)
    server = ServerThread(build_app(ServerState(scheduler, scheme, "tiny-llama", tok, api_key))).start()
    try:
        yield server, scheduler
    finally:
        server.stop()


def post(server, path: str, body: bytes | dict, headers: dict | None = None, method: str = "POST"):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, body=data if method == "POST" else None,
                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    return resp.status, raw


OK = {"model": "plan", "prompt": "hello", "max_tokens": 3, "temperature": 0}
BAD_COMPLETIONS = [  # (body, the field the error must name)
    ({"prompt": "x"}, "model"),
    ({**OK, "model": "planner"}, "model"),
    ({"model": "plan"}, "prompt"),
    ({**OK, "prompt": 42}, "prompt"),
    ({**OK, "prompt": ["a", "b"]}, "prompt"),
    ({**OK, "prompt": ""}, "prompt"),
    ({**OK, "prompt": "x" * 70}, "prompt"),  # longer than the context (63)
    ({**OK, "prompt": "x" * 60, "max_tokens": 10}, "prompt"),  # with max_tokens, past the context
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "max_tokens": "ten"}, "max_tokens"),
    ({**OK, "max_tokens": 2.5}, "max_tokens"),
    ({**OK, "temperature": -0.5}, "temperature"),
    ({**OK, "temperature": 2.5}, "temperature"),
    ({**OK, "temperature": "hot"}, "temperature"),
    ({**OK, "top_p": 0}, "top_p"),
    ({**OK, "top_p": 1.5}, "top_p"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**OK, "stop": [""]}, "stop"),
    ({**OK, "stop": 7}, "stop"),
    ({**OK, "seed": "x"}, "seed"),
    ({**OK, "stream": "yes"}, "stream"),
    ({**OK, "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({**OK, "n": 2}, "n"),
    ({**OK, "logprobs": 3}, "logprobs"),
    ({**OK, "echo": True}, "echo"),
]
BAD_CHAT = [
    ({"model": "plan"}, "messages"),
    ({"model": "plan", "messages": []}, "messages"),
    ({"model": "plan", "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"model": "plan", "messages": [{"role": "user", "content": "x"}]}, "messages"),  # this model has no chat template
    (
        {"model": "plan", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),  # fmt: skip
    ({"model": "plan", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
]


def test_bad_requests_are_400s_naming_their_field_and_what_is_allowed():
    with tiny_server() as (server, scheduler):
        named = 0
        for path, cases in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHAT)):
            for body, field in cases:
                status, raw = post(server, path, body)
                assert status == 400, (body, status, raw)
                err = json.loads(raw)["error"]
                assert err["param"] == field, (body, err)
                assert err["type"] == "invalid_request_error"
                assert "Allowed" in err["message"] or err["code"] == "context_length_exceeded", err
                assert "Traceback" not in raw
                named += 1
        assert named >= 12
        for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):  # not a JSON object: no field to name
            status, raw = post(server, "/v1/completions", body)
            assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json", raw
        status, raw = post(server, "/v1/nowhere", {})
        assert status == 404 and json.loads(raw)["error"]["message"].startswith("POST /v1/nowhere")
        status, raw = post(server, "/v1/completions", b"", method="GET")
        assert status == 405 and "error" in json.loads(raw)
        err = json.loads(post(server, "/v1/completions", {**OK, "model": "planner"})[1])["error"]
        assert err["code"] == "model_not_found" and "plan, action, reflect" in err["message"]
        long = json.loads(post(server, "/v1/completions", {**OK, "prompt": "x" * 60, "max_tokens": 10})[1])["error"]
        assert long["code"] == "context_length_exceeded" and "63 tokens" in long["message"]
        assert "(60 in the prompt, 10 in the completion)" in long["message"]
        status, raw = post(server, "/v1/completions", OK)  # and the server still serves
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
        assert scheduler.metrics.snapshot()["requests"].get("length") == 1


def test_a_request_without_the_key_is_a_401():
    with tiny_server(api_key="s3cret") as (server, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, raw = post(server, "/v1/completions", OK, headers)
            assert status == 401, headers
            assert json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert post(server, "/v1/completions", OK, {"Authorization": "Bearer s3cret"})[0] == 200
        assert post(server, "/health", b"", method="GET")[0] == 200  # health and metrics are not behind the key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["plan", "action", "reflect"]


def test_a_client_that_leaves_mid_stream_frees_its_row():
    with tiny_server(rows=1, capacity=512) as (server, scheduler):
        sock = socket.create_connection((server.host, server.port), timeout=30)
        body = json.dumps({**OK, "max_tokens": 400, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        got = b""
        while got.count(b"data: ") < 2:
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        sock.close()  # gone mid-stream
        for _ in range(300):
            snap = scheduler.metrics.snapshot()
            if snap["requests"].get("cancelled") == 1 and snap["running"] == 0:
                break
            time.sleep(0.05)
        snap = scheduler.metrics.snapshot()
        assert snap["requests"].get("cancelled") == 1 and snap["running"] == 0, snap
        assert snap["generation_tokens"] < 400  # it stopped generating
        status, raw = post(server, "/v1/completions", OK)  # the one row serves the next client
        assert status == 200, raw


def test_out_of_memory_is_a_503_in_one_line_and_an_internal_error_a_500_without_details(monkeypatch):
    with tiny_server() as (server, scheduler):
        start = scheduler.engine.start
        errors = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), RuntimeError("secret")]

        def failing(row, req):
            if errors:
                raise errors.pop(0)
            return start(row, req)

        monkeypatch.setattr(scheduler.engine, "start", failing)
        status, raw = post(server, "/v1/completions", OK)
        err = json.loads(raw)["error"]
        assert status == 503 and err["code"] == "out_of_memory" and err["type"] == "server_error"
        assert "\n" not in err["message"]
        status, raw = post(server, "/v1/completions", OK)
        assert status == 500 and "secret" not in raw and "Traceback" not in raw
        status, raw = post(server, "/v1/completions", OK)
        assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"


def test_serve_refuses_bad_options_in_one_line(capsys):
    from lragent.cli_main import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        cases = [
            (["--scheme", "bogus"], "unknown scheme 'bogus'"),
            (["--port", "70000"], "--port 70000"),
            (["--max_rows", "0"], "--max_rows must be >= 1 or auto"),
            (["--port", str(busy.getsockname()[1])], "cannot listen on 127.0.0.1"),
        ]
        for args, words in cases:
            assert main(["serve", *args]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    finally:
        busy.close()


@pytest.mark.model
def test_sigterm_answers_every_request_in_flight_then_the_process_exits():
    """cli.py serve as a process (embedded model, 2 rows, a key): three requests in flight (one streamed; two
    generating, so the third waits for a row) when SIGTERM comes; each gets its whole answer, then the process exits
    with status 0."""
    from lragent.models import embedded_model_missing

    if embedded_model_missing():
        pytest.skip(embedded_model_missing())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "cli.py", "serve", "--port", "0", "--max_rows", "2", "--capacity", "512", "--api_key", "k3y"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("serve: http://"):
                url = line.split()[1].removesuffix("/v1")
        assert url, "".join(lines)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        host, port = url.removeprefix("http://").split(":")

        class Srv:
            pass

        srv = Srv()
        srv.host, srv.port = host, int(port)
        key = {"Authorization": "Bearer k3y"}
        assert post(srv, "/v1/models", b"", method="GET")[0] == 401
        results: dict[int, tuple[int, str]] = {}
        ended: dict[int, float] = {}

        def run(i: int, stream: bool) -> None:
            body = {"model": ("plan", "action", "reflect")[i], "prompt": f"Story {i}. Once upon a time, by the sea,",
                    "max_tokens": 120, "temperature": 0, "stream": stream}  # fmt: skip
            results[i] = post(srv, "/v1/completions", body, key)
            ended[i] = time.monotonic()

        threads = [threading.Thread(target=run, args=(i, i == 1)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in range(600):  # until two generate (the third waits for a row)
            metrics = post(srv, "/metrics", b"", method="GET")[1]
            if "lragent_num_requests_running 2" in metrics:
                break
            time.sleep(0.05)
        assert "lragent_num_requests_running 2" in metrics, metrics
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(120)
        assert proc.wait(120) == 0
        assert len(results) == 3 and sum(t > signalled for t in ended.values()) >= 2  # answered after the signal
        for i in (0, 2):
            status, raw = results[i]
            assert status == 200, raw
            answer = json.loads(raw)
            assert answer["choices"][0]["finish_reason"] in ("length", "stop") and answer["usage"]["completion_tokens"]
        status, raw = results[1]
        assert status == 200 and raw.rstrip().endswith("data: [DONE]"), raw[-200:]
        assert any(line.startswith("serve: stopped") for line in lines), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
