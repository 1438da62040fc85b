"""``eval --server URL`` gives the in-process eval's episode records (greedy, two questions of each benchmark,
embedded model): the agents as HTTP clients of a live server on 127.0.0.1, two episodes in flight."""

from __future__ import annotations

import json

import pytest

from lragent.paths import DATA_DIR

pytestmark = pytest.mark.model

# what a served episode may differ in: its seconds, and its prefill cost (the server reuses another episode's cached
# system prompt, which the in-process eval's fresh session per episode computes again)
COST_FIELDS = ("prefill_tokens", "prefill_s", "decode_s", "recomputed_tokens")
AGENT = {"max_steps": 2, "thought_tokens": 12, "argument_tokens": 8}


def _records(out) -> dict:
    recs = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    return {(r["row"], r["run"], r["qid"]): r for r in recs}


def _comparable(rec: dict) -> dict:
    rec = {k: v for k, v in rec.items() if k not in ("wall_s", "provenance")}
    rec["roles"] = {role: {k: v for k, v in s.items() if k not in COST_FIELDS} for role, s in rec["roles"].items()}
    return rec


@pytest.mark.parametrize("bench_name", ["hotpotqa", "scienceqa"])
def test_eval_through_a_server_gives_the_in_process_records(tmp_path, bench_name):
    from eval_suite.evaluate.run_eval import evaluate
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.models import embedded_model_missing
    from lragent.serving.model import load_served_model
    from lragent.serving.scheduler import Scheduler

    if embedded_model_missing():
        pytest.skip(embedded_model_missing())
    common = dict(benchmark=bench_name, limit=2, runs=1, temperature=0.0, scheme="base_lr_shared", quiet=True, **AGENT)
    assert evaluate(**common, out=str(tmp_path / "local")) == 0
    adapters = str(DATA_DIR / "adapters" / f"{bench_name}_sharedA")
    lm, tok = load_served_model(model="default", adapters=adapters)
    scheduler = Scheduler(Engine(lm, "base_lr_shared", rows=3, capacity=2048, tokenizer=tok), tok)
    server = ServerThread(build_app(ServerState(scheduler, "base_lr_shared", "SmolLM2-135M-Instruct", tok))).start()
    try:
        assert evaluate(**common, out=str(tmp_path / "served"), server=server.url, batch=2) == 0
        snap = scheduler.metrics.snapshot()
    finally:
        server.stop()
    local, served = _records(tmp_path / "local"), _records(tmp_path / "served")
    assert len(local) == 2 and local.keys() == served.keys()
    for key in local:
        assert _comparable(served[key]) == _comparable(local[key]), key
    assert snap["requests"].get("error", 0) == 0
    assert snap["cached_tokens"] > 0  # the second episode reused the first one's system prompt, and every turn its own


def test_eval_server_refuses_what_the_api_cannot_do(capsys):
    from lragent.cli_main import main

    cases = [
        (["--server", "ftp://x"], "allowed a URL like http://127.0.0.1:8000"),
        (["--server", "http://127.0.0.1:9", "--constrain", "all"], "allowed --constrain none with --server"),
        (["--server", "http://127.0.0.1:9", "--batch", "auto"], "the server sizes its own rows"),
    ]
    for args, words in cases:
        assert main(["eval", "--benchmark", "scienceqa", "--limit", "1", "--runs", "1", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and words in err[-1], err


def test_eval_server_names_an_unreachable_server_and_a_scheme_it_does_not_serve(tmp_path, capsys):
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.cli_main import main

    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    args = ["eval", "--benchmark", "scienceqa", "--limit", "1", "--runs", "1", "--temperature", "0", "--quiet", "true"]
    assert main([*args, "--server", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "a")]) == 2
    assert "cannot reach the server" in capsys.readouterr().err.strip().splitlines()[-1]
    from conftest import tiny_multi_lora
    from test_serve_reliability import ByteTokenizer

    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    tok = ByteTokenizer()
    eng = Engine(tiny_multi_lora("tiny-llama"), "non_shared", rows=1, capacity=8192, tokenizer=tok, eos_token_ids=[])
    server = ServerThread(build_app(ServerState(Scheduler(eng, tok), "non_shared", "tiny", tok))).start()
    try:
        out = str(tmp_path / "b")
        assert main([*args, "--server", server.url, "--scheme", "base_lr_shared", "--out", out]) == 2
    finally:
        server.stop()
    assert "serves scheme non_shared" in capsys.readouterr().err.strip().splitlines()[-1]
