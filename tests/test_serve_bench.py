"""``bench serve``: the 17-step text trace, the percentiles, and a small run against a live server (tiny model)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_multi_lora
from test_serve_reliability import ByteTokenizer

from eval_suite.serve.bench_serve import bench_serve, percentile, trace_steps


def test_the_trace_is_the_papers_17_steps():
    steps = trace_steps("Who?", "hotpotqa", context=5, generated=[48, 4, 16, 48, 4], session=3)
    assert len(steps) == 17
    assert [r for r, *_ in steps] == ["plan", "plan", "action"] * 5 + ["reflect", "reflect"]
    assert [m for _, _, m, _ in steps] == [48, 4, 16] * 5 + [48, 4]
    assert "Who?" in steps[0][1]
    passages = [t for _, t, *_ in steps if "Passage 3." in t]
    assert len(passages) == 4
    assert all(len(re.search(r"Passage 3\.\d: ([a-z ]+)\.", p).group(1).split()) == 5 for p in passages)


def test_percentile_is_the_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([5.0, 1.0, 3.0, 2.0], 50) == 2.0


def test_bench_serve_against_a_running_server(tmp_path, capsys):
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    tok = ByteTokenizer()
    engine = Engine(tiny_multi_lora("tiny-llama"), "base_lr_shared", rows=4, capacity=8192, tokenizer=tok)
    scheduler = Scheduler(engine, tok)
    server = ServerThread(build_app(ServerState(scheduler, "base_lr_shared", "tiny", tok))).start()
    try:
        small = dict(clients=2, sessions=2, context=4, generated=[1, 1, 1, 1, 1], max_steps=1, thought_tokens=2,
                     argument_tokens=2, temperature=0.0)  # fmt: skip
        assert bench_serve(server=server.url, out=str(tmp_path), **small) == 0
        err = capsys.readouterr().err  # each workload's sessions counted on a progress bar as they end
        assert re.search(r"bench serve trace: 100%.*2/2", err) and re.search(r"bench serve autoact: 100%.*2/2", err)
        with pytest.raises(ValueError, match="serves base_lr_shared: allowed --schemes base_lr_shared"):
            bench_serve(server=server.url, schemes="non_shared", out=str(tmp_path / "x"), **small)
    finally:
        server.stop()
    report = json.loads((tmp_path / "bench_serve.json").read_text())
    runs = {r["workload"]: r for r in report["runs"]}
    assert set(runs) == {"trace", "autoact"} and all(r["scheme"] == "base_lr_shared" for r in runs.values())
    trace = runs["trace"]
    assert trace["requests"] == 34 and trace["failed_requests"] == 0 and trace["sessions"] == 2
    assert trace["cached_prefix_fraction"] > 0.5  # every step continues its session's trajectory
    assert trace["ttft_p50_s"] > 0 and trace["ttft_p99_s"] >= trace["ttft_p50_s"]
    assert trace["peak_cache_bytes"] > 0 and set(trace["cache_bytes"]) == {"k", "v_base", "v_lr"}
    assert runs["autoact"]["requests"] >= 2 * 3 and runs["autoact"]["failed_requests"] == 0
    assert report["provenance"]["command"] and report["config"]["server"] == server.url
    md = (tmp_path / "bench_serve.md").read_text()
    assert "| base_lr_shared | trace | 2 | 34 | 0 |" in md
    # where the time went, from the server's counters over the workload alone (the warm-up and the other workload
    # not counted): each batched step samples at most one token per row (4 rows), and the scheduler's thread accounts
    # for its time by phase, never more than the workload's wall
    for r in runs.values():
        assert r["decode_steps"] > 0 and 1 <= r["tokens_per_decode_step"] <= 4, r
        assert r["tokens_per_decode_step"] == r["generated_tokens"] / r["decode_steps"]
        assert set(r["worker_s"]) == {"admit", "decode", "capture", "idle", "other"}, r
        assert min(r["worker_s"].values()) >= 0, r
        assert r["worker_s"]["capture"] == 0  # no CUDA graphs on the CPU
        # the phases that work fit in the run's wall time (idle is credited a tick at a time, so a tick begun before
        # the first snapshot can land after it: on a loaded machine that alone passed the wall by a few ms)
        busy = sum(v for k, v in r["worker_s"].items() if k != "idle")
        assert r["worker_s"]["decode"] > 0 and busy <= r["wall_s"] + 0.5, r
        # admission split by part, read from the server's counters over the workload: within the admit phase
        assert set(r["admit_s"]) == {"match", "tokenize", "rows", "start"} and min(r["admit_s"].values()) > 0, r
        assert sum(r["admit_s"].values()) <= r["worker_s"]["admit"] + 1e-6, r
        # collections' seconds by generation, read the same way (this in-process server does not count them: zero)
        assert r["gc_s"] == {"0": 0.0, "1": 0.0, "2": 0.0}, r
        assert 0 < r["server_decode_mean_s"] and 0 < r["server_ttft_mean_s"] < r["request_wall_mean_s"], r


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "trace,replay"], "--workload 'trace,replay': allowed trace, autoact, or trace,autoact"),
        (["--workload", ","], "--workload ',': allowed trace, autoact, or trace,autoact"),
        (["--clients", "0"], "--clients must be >= 1, got 0"),
        (["--max_steps", "0"], "--max_steps must be >= 1, got 0"),
        (["--generated", "[1, 1, 1, 1]"], "--generated [1, 1, 1, 1]: allowed five integers >= 1"),
        (["--generated", "[1, 1, 0, 1, 1]"], "--generated [1, 1, 0, 1, 1]: allowed five integers >= 1"),
    ],
)
def test_bench_serve_options_are_refused_naming_the_value(tmp_path, capsys, argv, message):
    from lragent.cli_main import main

    out = tmp_path / "b"
    assert main(["bench", "serve", "--server", "http://127.0.0.1:9", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_bench_serve_refuses_a_server_that_is_not_lragent_serve(tmp_path, capsys):
    """An OpenAI-compatible server whose answers carry no ``lragent`` field (a plain server: the scheme it serves is
    unknown, so its figures could not be labelled) is one ``error:`` line naming the URL, exit 2, nothing written."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from lragent.cli_main import main

    class Plain(BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (the handler's API)
            self._send({"object": "list", "data": [{"id": "plain", "object": "model"}]})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            self._send({"choices": [{"text": "!", "finish_reason": "length", "index": 0}], "usage": usage})

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        capsys.readouterr()
        assert main(["bench", "serve", "--server", url, "--out", str(tmp_path / "o")]) == 2
    finally:
        httpd.shutdown()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"error: --server {url}: its answers carry no lragent.scheme; is it lragent serve?"], lines
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_served_episodes_stop_at_the_servers_context_instead_of_being_refused(tmp_path):
    """A server states its context (``max_model_len``); ``bench serve`` and ``eval --server`` bound their episodes at
    it less one cycle's reserve (as ``eval --batch`` bounds its own rows), so a long episode ends as out of function
    (``context_limit``) where it used to send a prompt the server must refuse (400), which stopped the whole run."""
    from eval_suite.evaluate.run_eval import evaluate
    from eval_suite.evaluate.server_client import ServeClient, served_context_bound
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    tok = ByteTokenizer()  # one token per byte: the HotpotQA prompt alone is about 1,600 tokens
    engine = Engine(tiny_multi_lora("tiny-llama"), "base_lr_shared", rows=2, capacity=4096, tokenizer=tok,
                    eos_token_ids=[])  # fmt: skip
    scheduler = Scheduler(engine, tok)
    server = ServerThread(build_app(ServerState(scheduler, "base_lr_shared", "tiny", tok))).start()
    try:
        cards = ServeClient(server.url).get("/v1/models")["data"]
        assert {c["max_model_len"] for c in cards} == {4095}
        assert served_context_bound(server.url) == 4096 - 2048
        agent = dict(max_steps=15, thought_tokens=128, argument_tokens=64, temperature=0.0)
        assert bench_serve(server=server.url, workload="autoact", clients=1, sessions=1, out=str(tmp_path / "b"),
                           **agent) == 0  # fmt: skip
        out = tmp_path / "e"
        rc = evaluate(benchmark="hotpotqa", limit=1, runs=1, scheme="base_lr_shared", quiet=True, server=server.url,
                      out=str(out), **agent)  # fmt: skip
        snap = scheduler.metrics.snapshot()
    finally:
        server.stop()
    report = json.loads((tmp_path / "b" / "bench_serve.json").read_text())
    assert report["config"]["agent"]["max_context_tokens"] == 2048
    assert report["runs"][0]["failed_requests"] == 0
    assert rc == 0
    (record,) = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert record["stop_reason"] == "context_limit", record["stop_reason"]
    assert json.loads((out / "run_config.json").read_text())["agent"]["max_context_tokens"] == 2048
    assert snap["requests"].get("error", 0) == 0


@pytest.mark.model
def test_bench_serve_starts_each_server_in_a_process_of_its_own(tmp_path, monkeypatch):
    """By default each scheme's server is a ``cli.py serve`` process (embedded model, CPU): the run is measured
    against it through HTTP alone (its /metrics give the cache figures), and it is stopped afterwards (this one was
    started with --launch_ahead); a server that cannot start is one error naming its own last line."""
    from eval_suite.evaluate.server_client import ServeClient, ServerError
    from eval_suite.serve import bench_serve as module

    urls = []
    real = module._spawn

    def spawn(*args, **kwargs):
        url, stop = real(*args, **kwargs)
        urls.append(url)
        assert args[-1] is True  # --launch_ahead handed to the server's command line (its serve runs with it)
        assert ServeClient(url).get("/health") is not None  # a process of its own, listening
        return url, stop

    monkeypatch.setattr(module, "_spawn", spawn)
    small = dict(workload="trace", clients=1, sessions=1, context=2, generated=[1, 1, 1, 1, 1], temperature=0.0,
                 capacity=2048, max_rows=1, schemes="base_lr_shared")  # fmt: skip
    assert bench_serve(out=str(tmp_path / "ok"), launch_ahead=True, **small) == 0
    assert len(urls) == 1
    with pytest.raises(ServerError, match="cannot reach the server"):
        ServeClient(urls[0], timeout=5).get("/health")  # stopped after its run
    report = json.loads((tmp_path / "ok" / "bench_serve.json").read_text())
    (run,) = report["runs"]
    assert report["config"]["launch_ahead"] is True
    assert run["requests"] == 17 and run["failed_requests"] == 0
    assert run["peak_cache_bytes"] > 0 and run["cached_prefix_fraction"] > 0.5  # read from the server's /metrics
    with pytest.raises(ValueError, match=r"base_lr_shared server ended \(exit 2\) before it listened: .*error: "):
        bench_serve(out=str(tmp_path / "bad"), adapters=str(tmp_path / "no_such_adapters"), **small)
