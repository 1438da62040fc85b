"""`lragent serve`: the role adapters behind an OpenAI-compatible server whose prefix cache is shared across adapters.

    lragent serve                                   # the embedded model and its HotpotQA adapters, 127.0.0.1:8000
    lragent serve --scheme non_shared --port 8001
    lragent serve --model qwen2.5-coder-1.5b --dtype bfloat16 --max_rows auto --memory_fraction 0.5

Then any OpenAI client: ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")``, ``model`` = a role
(``plan``, ``action``, ``reflect``, or the adapter set's own names) or the base model. See docs/serving.md.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Literal

CPU_AUTO_ROWS = 4
"""``--max_rows auto`` on the CPU: a few rows (the CPU's memory is not sized; its decode gains little from more)."""
GPU_AUTO_ROWS = 64
"""``--max_rows auto`` on a GPU: at most this many rows, fewer where the caches would not fit."""
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
SWITCH_INTERVAL_ENV = "LRAGENT_SWITCH_INTERVAL_MS"
"""Python's thread switch interval in the server process, in milliseconds (default: Python's own, 5 ms). The worker
thread and the HTTP event loop share one interpreter lock: a thread that wants it back after a torch or tokenizer
call waits until the other gives it up, at most this long."""


def freeze_startup_heap() -> int:
    """Collects once, then moves every object alive (the model's modules, the tokenizer, the imports: about 450,000
    with the embedded model) out of the collector's sight for good (``gc.freeze``), so that a full collection while
    serving walks only what requests made. Such a collection pauses every thread, the scheduler's included: on the CPU
    here, with the embedded model loaded, one took 218 ms before the freeze and under 0.1 ms after. Returns the
    objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def apply_switch_interval(environ: dict[str, str] | None = None) -> float:
    """Sets ``sys.setswitchinterval`` from ``$LRAGENT_SWITCH_INTERVAL_MS`` (unset or empty: unchanged); returns the
    interval in force, in seconds. Raises ValueError naming the value unless it is a number of milliseconds > 0."""
    raw = (os.environ if environ is None else environ).get(SWITCH_INTERVAL_ENV, "").strip()
    if raw:
        try:
            ms = float(raw)
        except ValueError:
            ms = float("nan")
        if not ms > 0 or ms == float("inf"):
            raise ValueError(f"{SWITCH_INTERVAL_ENV}={raw!r}: allowed a number of milliseconds > 0 (e.g. 0.5)")
        sys.setswitchinterval(ms / 1000)
    return sys.getswitchinterval()


def serve(
    model: str = "default",
    adapters: str | None = None,
    scheme: str = "base_lr_shared",
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str | None = None,
    device: str | None = None,
    memory_fraction: float | None = None,
    max_rows: int | Literal["auto"] = "auto",
    capacity: int = 4096,
    api_key: str | None = None,
    droidspeak_config: str | None = None,
    cuda_graphs: bool = True,
    launch_ahead: bool = True,
    log_level: str = "warning",
) -> int:
    """Serves the role adapters on an OpenAI-compatible HTTP server whose prefix cache is shared across adapters.

    Each request's prompt is matched to the trajectories the server holds; the longest cached prefix is reused under
    the scheme's rule (any role's under base_lr_shared, only the role's own under non_shared) and only the rest is
    computed. Requests join and leave the batched decode at step boundaries. Routes: GET /v1/models, POST
    /v1/completions, POST /v1/chat/completions (the model's chat template), GET /health, GET /metrics. SIGTERM or
    Ctrl-C: the requests in flight are finished, then the server exits.

    Args:
        model: base model: default (embedded SmolLM2-135M-Instruct), qwen2.5-coder-1.5b, a hub name or a local
            directory (it needs a tokenizer).
        adapters: adapter directory (native checkpoint or PEFT role directories); its roles are the served models,
            with the base model beside them. Default: data/adapters/hotpotqa_sharedA (qwen_hotpotqa_sharedA for the
            accuracy model).
        scheme: cache sharing scheme: non_shared, full_shared, droidspeak, base_shared or base_lr_shared.
        host: address to listen on; 127.0.0.1 (this machine only) unless told otherwise.
        port: TCP port (0: a free one, printed at start).
        dtype: compute dtype (float32, bfloat16, float16); default bfloat16 on a GPU, float32 on the CPU.
        device: cpu or cuda (default cuda when available).
        memory_fraction: this process's share of the device's memory, in (0, 1]: --max_rows auto sizes within it
            and the CUDA allocator is capped there.
        max_rows: trajectories held at once (engine rows; the most requests generating together): an integer, or
            auto (the most whose caches fit in free memory, at most 64 on a GPU; 4 on the CPU). The least recently
            used trajectory is evicted when a new one needs a row.
        capacity: positions per trajectory: a prompt plus its max_tokens must fit in capacity - 1.
        api_key: requests to /v1 must carry 'Authorization: Bearer KEY' (default: $LRAGENT_API_KEY if set, else no
            key). Without a key, keep the default host.
        droidspeak_config: JSON/YAML with droidspeak_layers (as droidspeak-select writes).
        cuda_graphs: decode with CUDA graphs on a GPU.
        launch_ahead: queue the next decode steps of the requests still generating before streaming, answering and
            admitting (the device decodes while the host works; a request admitted then joins the round after).
            The same tokens per request; on an H100, 1.66x the served agent sessions per second at 16 rows
            (``results/bench_serve_gpu/README.md``). False: one round at a time.
        log_level: uvicorn's log level (warning, info, debug).

    Returns:
        0 once the server has stopped.
    """
    from lragent.device_share import apply_memory_fraction, check_memory_fraction
    from lragent.loading import check_model_args, read_droidspeak_config, resolve_device
    from lragent.schemes import Scheme

    sch = Scheme.parse(scheme)
    check_memory_fraction(memory_fraction)
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: allowed 0..65535 (0: a free port)")
    if max_rows != "auto" and (isinstance(max_rows, bool) or max_rows < 1):
        raise ValueError(f"--max_rows must be >= 1 or auto, got {max_rows}")
    if capacity < 16:
        raise ValueError(f"--capacity must be >= 16 positions, got {capacity}")
    if log_level not in ("critical", "error", "warning", "info", "debug"):
        raise ValueError(f"--log_level {log_level!r}: allowed critical, error, warning, info, debug")
    api_key = api_key if api_key is not None else os.environ.get("LRAGENT_API_KEY") or None
    apply_switch_interval()
    run_device = resolve_device(device)
    on_gpu = run_device.startswith("cuda")
    dtype = dtype or ("bfloat16" if on_gpu else "float32")
    from lragent.serving.model import default_serve_adapters

    adapters = adapters or default_serve_adapters(model)
    stored = check_model_args(model=model, adapters=adapters, dtype=dtype, device=run_device, needs_text=True)
    layers = read_droidspeak_config(droidspeak_config) if droidspeak_config else None

    from eval_suite.serve.api_server import bind

    sock = bind(host, port)  # the address is taken before the model loads: a busy port is one line, at once
    rows = _size_rows(model, sch, max_rows, capacity, dtype, run_device, stored, layers, memory_fraction)
    apply_memory_fraction(run_device, memory_fraction)

    from eval_suite.evaluate.batched_executor import FEED_BUDGET, PREFILL_IN_DECODE, serve_profiler
    from eval_suite.serve.api_server import build_app, serve_until_stopped
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.model import base_model_name, load_served_model
    from lragent.serving.scheduler import Scheduler

    base = base_model_name(model)
    lm, tokenizer = load_served_model(model=model, adapters=adapters, dtype=dtype, device=run_device, base_name=base)
    engine = Engine(
        lm, sch, rows=rows, capacity=capacity, tokenizer=tokenizer, droidspeak_layers=layers,
        cuda_graphs=cuda_graphs and on_gpu, prefill_in_decode=PREFILL_IN_DECODE if on_gpu else 0,
        feed_budget=FEED_BUDGET if on_gpu else 0,
    )  # fmt: skip
    scheduler = Scheduler(engine, tokenizer, launch_ahead=launch_ahead, profiler=serve_profiler())
    scheduler.metrics.watch_gc()  # /metrics: the seconds collections pause the scheduler and the HTTP loop
    app = build_app(ServerState(scheduler, str(sch), base, tokenizer, api_key))
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(
        f"serve: http://{shown}:{bound_port}/v1 serving {', '.join(scheduler.roles)} (scheme {sch}, {rows} rows x "
        f"{capacity} positions, {dtype} on {run_device}{', API key required' if api_key else ''}); "
        "SIGTERM or Ctrl-C stops it once the requests in flight are done",
        file=sys.stderr,
        flush=True,
    )
    if host not in LOCAL_HOSTS and not api_key:
        print(f"serve: warning: listening on {host} without --api_key: anyone who can reach it can use it",
              file=sys.stderr, flush=True)  # fmt: skip
    freeze_startup_heap()  # last: what loading made stays alive for the server's whole life
    serve_until_stopped(app, sock, log_level)
    print("serve: stopped (every request in flight was answered)", file=sys.stderr, flush=True)
    return 0


def _size_rows(model, scheme, max_rows, capacity, dtype, device, stored, layers, memory_fraction) -> int:
    """The engine's rows: ``--max_rows`` checked against free memory, or ``auto`` sized to it."""
    from lragent.memory_plan import choose_batch

    n_roles = len(stored.roles) + 1  # the base model is one more role
    upper = GPU_AUTO_ROWS if device.startswith("cuda") else CPU_AUTO_ROWS
    return choose_batch(
        model, [str(scheme)], max_rows, capacity, dtype=dtype, device=device, rank=stored.rank, n_roles=n_roles,
        shared_a=stored.shared_a, droidspeak_layers=layers, max_batch=upper, option="--max_rows",
        memory_fraction=memory_fraction,
    )  # fmt: skip
