"""A bounded load test on 127.0.0.1: 64 concurrent clients through the server's completions endpoint, greedy (tiny
random model, byte tokenizer, CPU), every HTTP request bounded in time. No request may fail, and every request and
response must be the one the client gets when it runs alone on a fresh server: requests that join and leave the
decode batch or wait for a row change nothing they compute.

Each client's text starts with its own characters, so no client continues another's cached prefix: a prefix cached
by one prefill and continued by a second gives logits that can differ in their last bit from one prefill over the
whole text (1.2e-7 measured on this model), which would make "the same as alone" a matter of luck, not of the
scheduler. The episodes use the AutoAct loop and its requests with a short system prompt."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import tiny_multi_lora
from test_serve_reliability import ByteTokenizer

from eval_suite.evaluate.executors import EpisodeTask
from lragent.agents import AgentConfig, AgentLoop, get_spec

CLIENTS = 64
REQUEST_TIMEOUT_S = 60.0


def _tasks(scheme: str, n: int) -> list[EpisodeTask]:
    tasks = []
    for i in range(n):
        prompt = f"[{i}] Solve the task with tools; finish with an answer."  # its own first characters
        spec = dataclasses.replace(get_spec("hotpotqa"), system_prompt=prompt)
        loop = AgentLoop(None, spec, AgentConfig(max_steps=2, thought_tokens=6, action_type_tokens=3,
                                                 argument_tokens=4, reflect_tokens=3))  # fmt: skip
        episode = loop.episode(f"Q{i}: is {i} odd?", lambda a, b, i=i: f"obs {i} {a}")
        tasks.append(EpisodeTask(key=(scheme, 0, str(i)), scheme=scheme, seed=i, question=None, episode=episode))
    return tasks


def _serve_episodes(model, scheme: str, rows: int, concurrency: int, tasks) -> tuple[dict, dict, dict]:
    from eval_suite.evaluate.server_client import ServerExecutor
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    tok = ByteTokenizer()
    engine = Engine(model, scheme, rows=rows, capacity=4096, tokenizer=tok, eos_token_ids=[])
    scheduler = Scheduler(engine, tok)
    server = ServerThread(build_app(ServerState(scheduler, scheme, "tiny-llama", tok))).start()
    try:
        ex = ServerExecutor(server.url, temperature=0.0, top_p=1.0, concurrency=concurrency, timeout=REQUEST_TIMEOUT_S)
        results = {task.key: res for task, res in ex.run(tasks)}
    finally:
        server.stop()
    return results, ex.episode_calls, scheduler.metrics.snapshot()


def test_64_concurrent_agent_clients_get_what_each_gets_alone():
    """base_lr_shared, a row per client: 64 AutoAct episodes at once, their turns joining and leaving the batch; every
    fourth client's requests and answers checked against the same episode served alone (one at a time, 48 more
    sequential episodes took a third of the test's time and check the same code)."""
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    started = time.monotonic()
    results, calls, snap = _serve_episodes(model, "base_lr_shared", CLIENTS, CLIENTS, _tasks("base_lr_shared", CLIENTS))
    loaded_s = time.monotonic() - started
    assert len(results) == CLIENTS
    requests = sum(len(c) for c in calls.values())
    assert sum(snap["requests"].values()) == requests and set(snap["requests"]) <= {"stop", "length"}, snap
    assert snap["peak_running"] > CLIENTS // 2  # turns of many clients shared decode steps
    assert snap["cached_tokens"] > 0  # each client's turns continued its own trajectory
    alone, alone_calls, _ = _serve_episodes(model, "base_lr_shared", 2, 1, _tasks("base_lr_shared", CLIENTS)[::4])
    assert len(alone) == CLIENTS // 4
    for key in alone:
        res = results[key]
        assert res.trajectory == alone[key].trajectory, key
        got = [(c.request["model"], c.request["prompt"], c.text, c.usage["completion_tokens"]) for c in calls[key]]
        ref = [
            (c.request["model"], c.request["prompt"], c.text, c.usage["completion_tokens"]) for c in alone_calls[key]
        ]
        assert got == ref, key
    print(f"{CLIENTS} agent clients: {requests} requests in {loaded_s:.1f} s, peak running {snap['peak_running']}")


def test_64_concurrent_clients_on_8_rows_wait_for_rows_and_get_what_each_gets_alone():
    """non_shared, 8 rows: 56 clients wait; rows are reused (trajectories evicted) as requests end; half stream."""
    from eval_suite.evaluate.server_client import ServeClient
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    model, tok = tiny_multi_lora("tiny-llama", b_std=0.3), ByteTokenizer()
    roles = ("plan", "action", "reflect")
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    bodies = [{"model": roles[i % 3], "prompt": f"<{i}> client {i} asks: " + "why " * (i % 7), "max_tokens": 4 + i % 9,
               "temperature": 0, "stop": ["zz"], **(streamed if i % 2 else {})} for i in range(CLIENTS)]  # fmt: skip

    def serve_all(rows: int, concurrency: int):
        engine = Engine(model, "non_shared", rows=rows, capacity=256, tokenizer=tok, eos_token_ids=[])
        scheduler = Scheduler(engine, tok)
        server = ServerThread(build_app(ServerState(scheduler, "non_shared", "tiny-llama", tok))).start()
        out: dict[int, tuple] = {}
        try:
            with ThreadPoolExecutor(concurrency) as pool:

                def one(i: int):
                    client = ServeClient(server.url, timeout=REQUEST_TIMEOUT_S)
                    try:
                        done = client.completion(bodies[i])
                    finally:
                        client.close()
                    return i, (done.text, done.finish_reason, done.usage["completion_tokens"])

                out = dict(pool.map(one, range(CLIENTS)))
        finally:
            server.stop()
        return out, scheduler.metrics.snapshot()

    together, snap = serve_all(8, CLIENTS)
    assert snap["peak_waiting"] > 0 and snap["peak_running"] == 8 and snap["evictions"] > 0, snap
    assert sum(snap["requests"].values()) == CLIENTS and set(snap["requests"]) <= {"stop", "length"}, snap
    alone, _ = serve_all(1, 1)
    assert together == alone


def test_server_urls_with_a_path_and_no_concurrency_are_refused_naming_them(tmp_path, capsys):
    import pytest

    import cli
    from eval_suite.evaluate.server_client import ServerExecutor

    url = "http://127.0.0.1:8000/api"
    out = tmp_path / "o"
    assert cli.main(["eval", "--server", url, "--adapter_init", "zero", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --server {url!r}: allowed a URL like http://127.0.0.1:8000 (or .../v1), no other")
    assert not out.exists()
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        ServerExecutor("http://127.0.0.1:8000/v1", temperature=0.0, top_p=1.0, concurrency=0)
    assert ServerExecutor("http://127.0.0.1:8000/v1/", temperature=0.0, top_p=1.0).url == "http://127.0.0.1:8000"
