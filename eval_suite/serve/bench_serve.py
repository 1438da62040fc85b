"""`cli.py bench serve`: a load generator for `lragent serve`: N concurrent agent sessions per scheme.

Two workloads, each a number of agent sessions run by ``--clients`` concurrent HTTP clients (streamed completions
requests, each carrying its session's whole text so far, as the agents send them):

- ``trace``: the paper's 17-step agent trace in text: the AutoAct prompt and a benchmark question, then five cycles
  of plan (thought), plan (action type), action (argument), a retrieved passage of ``--context`` words appended as
  the observation after each of the first four, then two reflect steps; generation bounds ``--generated``
  (thought, action type, argument, reflect thought, verdict; 48, 4, 16, 48, 4 as ``bench trace``).
- ``autoact``: AutoAct episodes on the benchmark's questions with its offline tools (``eval --server``'s client).

Per (scheme, workload): generated tokens per second, trajectory tokens per second (the sum over requests of the
trajectory's length after the request, over the wall time: ``bench trace``'s throughput), sessions per second, TTFT
p50 / p99 (client side: from sending a request to its first streamed text), the prompt tokens served from held
trajectories (cached-prefix fraction), the caches' peak bytes and bytes by component, failed requests.

Without ``--server`` the bench starts its own server per scheme and workload on 127.0.0.1 (a free port): by default
a ``cli.py serve`` process, as a server is deployed (``--isolate false``: in this process, the model loaded once,
where the server's scheduler shares one interpreter with the clients); with ``--server URL`` it loads nothing and
measures that server under the one scheme it serves.
Writes ``bench_serve.json`` and ``bench_serve.md`` with provenance.

    python cli.py bench serve --clients 8 --sessions 16 --out out/bench_serve                     # CPU, embedded model
    python cli.py bench serve --model qwen2.5-coder-1.5b --dtype bfloat16 --clients 32 --sessions 64 --out DIR  # GPU
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Literal

from eval_suite.evaluate.server_client import (
    Completion,
    ServeClient,
    ServerExecutor,
    ServerPolicy,
    check_server_url,
    served_context_bound,
)

WORKLOADS = ("trace", "autoact")
TRACE_GENERATED = (48, 4, 16, 48, 4)
"""Generation bounds of the trace's thought, action type, argument, reflect thought and reflect verdict."""
CYCLES = 5
_WORDS = ("river", "museum", "founded", "century", "album", "director", "island", "magazine", "released", "village",
          "singer", "county", "league", "station", "published", "novel")  # fmt: skip


def trace_steps(question: str, spec_name: str, context: int, generated: Sequence[int], session: int) -> list[tuple]:
    """The 17 ``(role, appended text, max_tokens, stop)`` steps of one trace session."""
    from lragent.agents.prompts import ACTION_MARKER, ARGUMENT_MARKER, get_spec, initial_text, observation_text

    thought, action_type, argument, reflect_thought, verdict = generated
    spec = get_spec(spec_name)
    steps: list[tuple] = []
    head = initial_text(spec, question)
    for c in range(CYCLES):
        if c:
            words = " ".join(_WORDS[(session + c + i) % len(_WORDS)] for i in range(context))
            head = observation_text(f"Passage {session}.{c}: {words}.", closing="]")
        steps += [("plan", head, thought, ()), ("plan", ACTION_MARKER, action_type, ()),
                  ("action", "Retrieve" + ARGUMENT_MARKER, argument, ())]  # fmt: skip
    steps += [("reflect", observation_text("Please reflect your answer.", closing="]"), reflect_thought, ()),
              ("reflect", "\nAction: Reflect[", verdict, ())]  # fmt: skip
    return steps


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarise(completions: list[Completion], wall_s: float, sessions: int, failed: int, server: dict,
              before: dict | None = None) -> dict:  # fmt: skip
    """A workload's figures from its requests' answers and the server's metrics (``server``; its counters less
    ``before``'s, the metrics read when the workload started).

    Where a request's time goes: ``request_wall_mean_s`` (the client's, sending to the whole answer) against the
    server's ``server_ttft_mean_s`` (arrival to first token: queue and prefill) and ``server_decode_mean_s``; the
    scheduler thread's seconds by phase (``worker_s``; ``admit_s`` splits its placing of requests), the seconds of
    Python's collections in the server process by generation (``gc_s``: they pause every thread; counted by servers
    ``lragent serve`` starts) and the mean decode batch (``tokens_per_decode_step``: generated tokens over the batched
    steps run).
    """
    prompt = sum(c.usage.get("prompt_tokens", 0) for c in completions)
    cached = sum((c.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for c in completions)
    generated = sum(c.usage.get("completion_tokens", 0) for c in completions)
    trajectory = sum(c.details.get("trajectory_tokens", 0) for c in completions)
    ttft = [c.ttft_s for c in completions]
    before = before or {}
    steps = server.get("decode_steps", 0) - before.get("decode_steps", 0) if "decode_steps" in server else None
    worker, admit, collections = (
        {k: v - (before.get(key) or {}).get(k, 0.0) for k, v in (server.get(key) or {}).items()}
        for key in ("worker_s", "admit_s", "gc_s")
    )

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return {
        "sessions": sessions,
        "requests": len(completions),
        "failed_requests": failed,
        "wall_s": wall_s,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall_s if wall_s else None,
        "trajectory_tokens_per_s": trajectory / wall_s if wall_s else None,
        "sessions_per_s": sessions / wall_s if wall_s else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_prefix_fraction": cached / prompt if prompt else None,
        "peak_cache_bytes": server.get("peak_cache_bytes"),
        "cache_bytes": server.get("cache_bytes"),
        "peak_running": server.get("peak_running"),
        "peak_waiting": server.get("peak_waiting"),
        "evictions": server.get("evictions"),
        "forks": server.get("forks"),
        "request_wall_mean_s": mean([c.wall_s for c in completions]),
        "server_ttft_mean_s": mean([c.details["ttft_s"] for c in completions if "ttft_s" in c.details]),
        "server_decode_mean_s": mean([c.details["decode_s"] for c in completions if "decode_s" in c.details]),
        "decode_steps": steps,
        "tokens_per_decode_step": generated / steps if steps else None,
        "worker_s": worker or None,
        "admit_s": admit or None,
        "gc_s": collections or None,
    }


def run_trace(
    url: str, api_key: str | None, *, sessions: int, clients: int, questions: list[str], spec: str, context: int,
    generated: Sequence[int], temperature: float, top_p: float, stream: bool = True,
) -> tuple[list, int, float]:  # fmt: skip
    """Runs ``sessions`` trace sessions on ``clients`` threads; returns the answers, the failed requests, the wall."""
    answers: list[Completion] = []
    failed = [0]
    lock = threading.Lock()

    def session(s: int) -> None:
        client = ServeClient(url, api_key)
        policy = ServerPolicy(client, temperature=temperature, top_p=top_p, seed=1000 + s, stream=stream)
        policy.reset()
        try:
            for role, text, max_tokens, stop in trace_steps(questions[s % len(questions)], spec, context, generated, s):
                policy.generate(role, text, max_new_tokens=max_tokens, stop=list(stop))
        except ValueError as exc:
            with lock:
                failed[0] += 1
            print(f"bench serve: trace session {s} failed: {exc}", file=sys.stderr)
        finally:
            client.close()
            with lock:
                answers.extend(policy.completions)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool, _bar(sessions, "trace") as bar:
        for done in as_completed([pool.submit(session, s) for s in range(sessions)]):
            done.result()
            bar.update()
    return answers, failed[0], time.perf_counter() - started


def _bar(sessions: int, workload: str):
    """The sessions' progress bar on stderr (a long run on a CPU shows it is alive)."""
    from tqdm.auto import tqdm

    return tqdm(total=sessions, desc=f"bench serve {workload}", unit="session", file=sys.stderr, mininterval=1.0)


def run_autoact(url: str, api_key: str | None, *, sessions: int, clients: int, bench, agent, temperature: float,
                top_p: float, scheme: str, stream: bool = True) -> tuple[list, int, float]:  # fmt: skip
    """Runs ``sessions`` AutoAct episodes (the benchmark's first questions, cycled) on ``clients`` threads."""
    from eval_suite.evaluate.executors import EpisodeTask
    from lragent.agents import AgentLoop

    questions = bench.load_questions(None, None)
    toolbox_factory, _ = bench.toolbox_factory()
    loop = AgentLoop(None, bench.spec, agent)
    tasks = []
    for s in range(sessions):
        q = questions[s % len(questions)]
        episode = loop.episode(q.text, toolbox_factory(q), **_free(bench, q))
        tasks.append(EpisodeTask((scheme, s, q.qid), scheme, 1000 + s, q, episode))
    ex = ServerExecutor(url, temperature=temperature, top_p=top_p, concurrency=clients, api_key=api_key,
                        stream=stream)  # fmt: skip
    started = time.perf_counter()
    failed = 0
    try:
        with _bar(sessions, "autoact") as bar:
            for _ in ex.run(tasks):
                bar.update()
    except ValueError as exc:
        failed = 1
        print(f"bench serve: autoact stopped at a failed request: {exc}", file=sys.stderr)
    return ex.completions, failed, time.perf_counter() - started


def _free(bench, q) -> dict:
    """The episode options of an unconstrained run."""
    action_types, answer_options = bench.constraint_options(q, [])
    return {"action_types": action_types, "answer_options": answer_options, "answer_texts": bench.answer_texts(q, [])}


def _server_metrics(url: str, api_key: str | None) -> dict:
    """The cache bytes, queue peaks, counters (evictions, forks, decode steps), the scheduler thread's seconds by
    phase, of admission by part and of Python's collections by generation, from a server's /metrics text."""
    text = ServeClient(url, api_key).get("/metrics")
    out: dict = {"cache_bytes": {}}
    names = {"lragent_cache_bytes_peak": "peak_cache_bytes", "lragent_trajectory_evictions_total": "evictions",
             "lragent_trajectory_forks_total": "forks", "lragent_decode_steps_total": "decode_steps"}  # fmt: skip
    seconds = {"lragent_worker_seconds_total": "worker_s", "lragent_admit_seconds_total": "admit_s",
               "lragent_gc_seconds_total": "gc_s"}  # by label  # fmt: skip
    for line in str(text).splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name in names:
            out[names[name]] = int(float(value))
        elif name.startswith('lragent_cache_bytes{component="'):
            out["cache_bytes"][name.split('"')[1]] = int(float(value))
        elif "{" in name and name.split("{")[0] in seconds:  # a labelled sample: its label's value is the key
            out.setdefault(seconds[name.split("{")[0]], {})[name.split('"')[1]] = float(value)
    return out


def bench_serve(
    server: str | None = None,
    model: str = "default",
    adapters: str | None = None,
    schemes: str = "all",
    workload: str = "trace,autoact",
    clients: int = 8,
    sessions: int = 16,
    benchmark: str = "hotpotqa",
    context: int = 256,
    generated: list[int] | None = None,
    max_steps: int = 15,
    thought_tokens: int = 128,
    argument_tokens: int = 64,
    temperature: float = 0.9,
    top_p: float = 0.75,
    max_rows: int | Literal["auto"] = "auto",
    capacity: int = 8192,
    dtype: str | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    isolate: bool = True,
    stream: bool = True,
    launch_ahead: bool = True,
    out: str = "bench_serve",
) -> int:
    """Load generator for lragent serve: concurrent agent sessions per scheme; tokens/s, sessions/s, TTFT, caches.

    Args:
        server: measure a running server at this URL (its one scheme; its key from $LRAGENT_API_KEY) instead of
            starting one per scheme here.
        model: base model of the servers started here (default: the embedded model).
        adapters: their adapter directory (default: the model's shipped HotpotQA shared-A set).
        schemes: schemes to serve: all, or a comma list (with --server: the server's scheme).
        workload: trace, autoact, or both as a comma list.
        clients: concurrent clients (sessions in flight).
        sessions: agent sessions per workload and scheme (trace iterations or AutoAct episodes).
        benchmark: hotpotqa or scienceqa: the questions (and, for autoact, the tools and prompt).
        context: words of the retrieved passage the trace appends after each of its first four cycles.
        generated: the trace's generation bounds [thought, action type, argument, reflect thought, verdict].
        max_steps: AutoAct cycles before an episode is out of function.
        thought_tokens: AutoAct thought budget.
        argument_tokens: AutoAct argument budget.
        temperature: sampling temperature (LRAgent's 0.9; 0: greedy).
        top_p: nucleus mass (LRAgent's 0.75).
        max_rows: rows of the servers started here (as serve --max_rows).
        capacity: positions per trajectory of the servers started here.
        dtype: their dtype (default bfloat16 on a GPU, float32 on the CPU).
        device: cpu or cuda (default cuda when available).
        memory_fraction: their share of the device's memory.
        isolate: start each server here as a ``cli.py serve`` process of its own (as it is deployed; its model
            loaded per server); false: in this process, the model loaded once.
        stream: stream the completions (server-sent events; the time to first token is measured client side);
            false: whole answers, as an agent that waits for them asks.
        launch_ahead: the servers started here queue each round's next decode steps before streaming and answering
            (as serve --launch_ahead, on by default there too).
        out: output directory (bench_serve.json, bench_serve.md).

    Returns:
        0 (1 when a request failed).
    """
    import os

    from eval_suite.evaluate.benchmarks import get_benchmark
    from eval_suite.report import check_writable
    from lragent.agents import AgentConfig, context_bound
    from lragent.agents.policies import check_sampling
    from lragent.device_share import check_memory_fraction
    from lragent.provenance import provenance
    from lragent.report_io import write_json, write_text
    from lragent.schemes import parse_schemes

    workloads = [w.strip() for w in workload.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise ValueError(f"--workload {workload!r}: allowed trace, autoact, or trace,autoact")
    for name, value in (("clients", clients), ("sessions", sessions), ("context", context), ("max_steps", max_steps)):
        if isinstance(value, bool) or value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    generated = list(generated if generated is not None else TRACE_GENERATED)
    if len(generated) != 5 or any(isinstance(g, bool) or g < 1 for g in generated):
        raise ValueError(f"--generated {generated}: allowed five integers >= 1 (thought, action type, argument, "
                         "reflect thought, verdict)")  # fmt: skip
    check_sampling(temperature, top_p)
    check_memory_fraction(memory_fraction)
    bench = get_benchmark(benchmark)
    out_dir = check_writable(out, is_dir=True)
    api_key = os.environ.get("LRAGENT_API_KEY") or None
    if server is not None:
        check_server_url(server)
    # an AutoAct episode ends as out of function before its trajectory outgrows the server's (as eval --batch's do)
    bound = served_context_bound(server, api_key) if server is not None else context_bound(capacity)
    agent = AgentConfig(max_steps=max_steps, thought_tokens=thought_tokens, argument_tokens=argument_tokens,
                        max_context_tokens=bound)  # fmt: skip
    questions = [q.text for q in bench.load_questions(None, None)]
    scheme_list = [str(s) for s in parse_schemes(schemes)]
    if server is not None:
        served = _served_scheme(server, api_key)
        if schemes != "all" and scheme_list != [served]:
            raise ValueError(f"--server {server} serves {served}: allowed --schemes {served} (or all) with it")
        scheme_list = [served]
    runs: list[dict] = []
    loaded = None
    dev = None
    for scheme in scheme_list:
        for wl in workloads:
            if server is not None:
                url, stop, snapshot = server, None, lambda url=server: _server_metrics(url, api_key)
            elif isolate:
                dev, dtype = _device_and_dtype(device, dtype)
                url, stop = _spawn(model, adapters, scheme, max_rows, capacity, dtype, dev, memory_fraction,
                                   launch_ahead)  # fmt: skip
                snapshot = lambda url=url: _server_metrics(url, api_key)  # noqa: E731
            else:
                if loaded is None:
                    loaded, dev, dtype = _load(model, adapters, dtype, device, memory_fraction)
                url, stop, snapshot = _start(loaded, scheme, max_rows, capacity, dev, dtype, model, launch_ahead)
            try:
                _warm_up(url, api_key)
                before = snapshot()
                common = {"sessions": sessions, "clients": clients, "temperature": temperature, "top_p": top_p,
                          "stream": stream}  # fmt: skip
                if wl == "trace":
                    answers, failed, wall = run_trace(url, api_key, questions=questions, spec=bench.name,
                                                      context=context, generated=generated, **common)  # fmt: skip
                else:
                    answers, failed, wall = run_autoact(url, api_key, bench=bench, agent=agent, scheme=scheme,
                                                        **common)  # fmt: skip
                figures = summarise(answers, wall, sessions, failed, snapshot(), before)
            finally:
                if stop is not None:
                    stop()
            runs.append({"scheme": scheme, "workload": wl, **figures})
            print(_line(runs[-1]), file=sys.stderr, flush=True)
    prov = provenance(dtype=dtype, device=dev)
    config = {
        "server": server, "model": model, "adapters": adapters, "schemes": scheme_list, "workloads": workloads,
        "clients": clients, "sessions": sessions, "benchmark": bench.name, "context": context, "generated": generated,
        "agent": vars(agent), "temperature": temperature, "top_p": top_p, "max_rows": max_rows, "capacity": capacity,
        "stream": stream, "launch_ahead": launch_ahead,
    }  # fmt: skip
    write_json(out_dir / "bench_serve.json", {"config": config, "runs": runs, "provenance": prov})
    write_text(out_dir / "bench_serve.md", render(runs, config, prov))
    print(f"-> {out_dir / 'bench_serve.json'}, {out_dir / 'bench_serve.md'}")
    return 1 if any(r["failed_requests"] for r in runs) else 0


def _served_scheme(url: str, api_key: str | None) -> str:
    """The scheme a running server serves (from one one-token request's ``lragent`` field)."""
    client = ServeClient(url, api_key, timeout=120)
    try:
        model = client.get("/v1/models")["data"][0]["id"]
        done = client.completion({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
    finally:
        client.close()
    scheme = done.details.get("scheme")
    if not scheme:
        raise ValueError(f"--server {url}: its answers carry no lragent.scheme; is it lragent serve?")
    return scheme


def _warm_up(url: str, api_key: str | None) -> None:
    """One short request per role (graphs captured, kernels compiled) before the clock starts."""
    client = ServeClient(url, api_key, timeout=600)
    try:
        for card in client.get("/v1/models")["data"]:
            client.completion({"model": card["id"], "prompt": "Warm up.", "max_tokens": 2, "temperature": 0})
    finally:
        client.close()


def _device_and_dtype(device: str | None, dtype: str | None) -> tuple[str, str]:
    from lragent.loading import resolve_device

    dev = resolve_device(device)
    return dev, dtype or ("bfloat16" if dev.startswith("cuda") else "float32")


def _spawn(model: str, adapters: str | None, scheme: str, max_rows, capacity: int, dtype: str, dev: str,
           memory_fraction: float | None, launch_ahead: bool = False):  # fmt: skip
    """A ``cli.py serve`` process of ``scheme`` on 127.0.0.1 (a free port): its URL and its stop. Its key, if any,
    is ``$LRAGENT_API_KEY``, as the clients'. Raises ``RuntimeError`` with its last lines when it ends before it
    listens."""
    import collections
    import subprocess
    from pathlib import Path

    cli = Path(__file__).resolve().parents[2] / "cli.py"
    cmd = [sys.executable, str(cli), "serve", "--scheme", scheme, "--port", "0", "--max_rows", str(max_rows),
           "--capacity", str(capacity), "--model", model, "--dtype", dtype, "--device", dev]  # fmt: skip
    if adapters is not None:
        cmd += ["--adapters", adapters]
    if memory_fraction is not None:
        cmd += ["--memory_fraction", str(memory_fraction)]
    cmd += ["--launch_ahead", "true" if launch_ahead else "false"]  # explicit: the server's default may change
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    last: collections.deque[str] = collections.deque(maxlen=3)
    url = None
    for line in proc.stderr:  # the model loads, then one line names the URL
        last.append(line.rstrip())
        if line.startswith("serve: http://"):
            url = line.split()[1]
            break
    if url is None:
        proc.wait()
        said = " | ".join(last)
        raise ValueError(f"the {scheme} server ended (exit {proc.returncode}) before it listened: {said}")
    threading.Thread(target=lambda: collections.deque(proc.stderr, maxlen=0), daemon=True).start()  # drain

    def stop() -> None:
        proc.terminate()  # SIGTERM: it answers what is in flight, then exits
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return url, stop


def _load(model: str, adapters: str | None, dtype: str | None, device: str | None, memory_fraction: float | None):
    from lragent.device_share import apply_memory_fraction, check_memory_fraction
    from lragent.serving.model import default_serve_adapters, load_served_model

    check_memory_fraction(memory_fraction)
    dev, dtype = _device_and_dtype(device, dtype)
    apply_memory_fraction(dev, memory_fraction)
    lm, tok = load_served_model(model=model, adapters=adapters or default_serve_adapters(model), dtype=dtype,
                                device=dev)  # fmt: skip
    return (lm, tok), dev, dtype


def _start(loaded, scheme: str, max_rows, capacity: int, dev: str, dtype: str, model: str, launch_ahead: bool = False):
    """A server of ``scheme`` on 127.0.0.1 over the loaded model: its URL, its stop, its metrics' snapshot."""
    import torch

    from eval_suite.evaluate.batched_executor import FEED_BUDGET, PREFILL_IN_DECODE, serve_profiler
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.memory_plan import choose_batch
    from lragent.serving.model import base_model_name
    from lragent.serving.scheduler import Scheduler

    lm, tok = loaded
    on_gpu = dev.startswith("cuda")
    rows = choose_batch(model, [scheme], max_rows, capacity, dtype=dtype, device=dev, rank=lm.lora_config.rank,
                        n_roles=len(lm.router), shared_a=lm.lora_config.shared_a, max_batch=64 if on_gpu else 4,
                        option="--max_rows", model_loaded=True)  # fmt: skip
    engine = Engine(
        lm, scheme, rows=rows, capacity=capacity, tokenizer=tok, cuda_graphs=on_gpu,
        prefill_in_decode=PREFILL_IN_DECODE if on_gpu else 0, feed_budget=FEED_BUDGET if on_gpu else 0,
    )  # fmt: skip
    scheduler = Scheduler(engine, tok, launch_ahead=launch_ahead, profiler=serve_profiler())
    srv = ServerThread(build_app(ServerState(scheduler, scheme, base_model_name(model), tok))).start()

    def stop() -> None:
        srv.stop()
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()

    return srv.url, stop, scheduler.metrics.snapshot


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _line(r: dict) -> str:
    return (f"bench serve: {r['scheme']} {r['workload']}: {r['sessions']} sessions, {r['requests']} requests in "
            f"{r['wall_s']:.1f} s; {_fmt(r['tokens_per_s'], '.1f')} tokens/s, TTFT p50 {_fmt(r['ttft_p50_s'], '.3f')} "
            f"s, cached {_fmt(r['cached_prefix_fraction'], '.1%')}, failed {r['failed_requests']}")  # fmt: skip


def render(runs: list[dict], config: dict, prov: dict) -> str:
    """The Markdown report."""
    from lragent.provenance import provenance_footer
    from lragent.report_io import markdown_table
    from lragent.serving.metrics import ADMIT_PARTS, WORKER_PHASES

    header = ["scheme", "workload", "sessions", "requests", "failed", "tokens/s", "trajectory tokens/s", "sessions/s",
              "TTFT p50 (s)", "TTFT p99 (s)", "cached prefix", "peak cache (MiB)"]  # fmt: skip
    rows = []
    for r in runs:
        peak = None if r["peak_cache_bytes"] is None else r["peak_cache_bytes"] / 2**20
        rows.append([
            r["scheme"], r["workload"], r["sessions"], r["requests"], r["failed_requests"],
            _fmt(r["tokens_per_s"], ".1f"), _fmt(r["trajectory_tokens_per_s"], ".0f"), _fmt(r["sessions_per_s"], ".3f"),
            _fmt(r["ttft_p50_s"], ".3f"), _fmt(r["ttft_p99_s"], ".3f"), _fmt(r["cached_prefix_fraction"], ".1%"),
            _fmt(peak, ".1f"),
        ])  # fmt: skip
    where = config["server"] or f"servers started here ({config['model']}, max_rows {config['max_rows']})"
    time_rows = [
        [r["scheme"], r["workload"], _fmt(r.get("request_wall_mean_s"), ".3f"),
         _fmt(r.get("server_ttft_mean_s"), ".3f"), _fmt(r.get("server_decode_mean_s"), ".3f"),
         _fmt(r.get("tokens_per_decode_step"), ".2f"),
         *[_fmt((r.get("worker_s") or {}).get(k), ".1f") for k in WORKER_PHASES],
         *[_fmt((r.get("admit_s") or {}).get(k), ".1f") for k in ADMIT_PARTS]]
        for r in runs
    ]  # fmt: skip
    time_header = ["scheme", "workload", "request (client, s)", "arrival to first token (server, s)",
                   "decode (server, s)", "mean decode batch", *[f"worker {k} (s)" for k in WORKER_PHASES],
                   *[f"of admit: {k} (s)" for k in ADMIT_PARTS]]  # fmt: skip
    return (
        "# bench serve\n\n"
        f"{config['clients']} concurrent clients, {config['sessions']} sessions per workload and scheme, "
        f"{config['benchmark']} questions, temperature {config['temperature']}, top-p {config['top_p']}; {where}. "
        "tokens/s: generated tokens over the wall time; trajectory tokens/s: the trajectory's length after each "
        "request, summed, over the wall time; TTFT: client side, from sending a streamed request to its first text; "
        "cached prefix: prompt tokens served from held trajectories, of all prompt tokens.\n\n"
        + markdown_table(header, rows)
        + "\n\nWhere the time goes (means per request; the mean decode batch is generated tokens over batched decode "
        "steps; the worker is the server's scheduler thread, during the workload):\n\n"
        + markdown_table(time_header, time_rows)
        + provenance_footer(prov)
    )
