"""Where one decode step's time goes, per op class, next to the decode benchmark (``bench decode``).

For one architecture (random weights: time does not depend on the values), one scheme and each batch size, rows
of ``context`` tokens decode under ``torch.profiler`` twice:

- **eager** decoding with labelled regions (this module wraps the engine's LoRA, attention, norm/RoPE/SiLU, LM-head
  and sampling calls in ``record_function`` for the run; the library is not changed): the GPU time of every kernel
  is attributed to the innermost label around the op that launched it, and the remaining matrix products to the
  base weights' GEMV/GEMM. The kernels are the ones a CUDA graph replays, so these per-class kernel times are the
  graph's too.
- **CUDA-graph** decoding (what ``bench decode`` times): the step's wall time and the kernel time inside it; the
  difference is the GPU's idle time (launch gaps, host syncs every ``sync_every`` steps). Per kernel name, the
  graph's kernel times are also classified by name (GEMM kernels of base and LoRA products together there).

Classes: GEMV (base weights), LoRA, attention kernel, norms/RoPE/SiLU, LM head, sampling, other (embedding,
residual adds, the step's bookkeeping), and idle.

    python -m eval_suite.bench.profile_decode --model llama-3.1-8b --context 2048 --batches [1,32] --out out/decode
    python -m eval_suite.bench.profile_decode ... --plans '["fused_gemv=0", "fused_gemv=1"]'   # switches side by side

writes ``OUT/decode_profile.json`` and ``OUT/decode_profile.md``. On the CPU (``--device cpu``, tests) the eager pass
runs alone and the classes hold CPU op time.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from eval_suite.report import markdown_table, write_json, write_text
from lragent.provenance import provenance, provenance_footer

CLASSES = (
    "GEMV (base weights)",
    "LoRA",
    "attention kernel",
    "norms/RoPE/SiLU",
    "LM head",
    "sampling",
    "other (embedding, adds, bookkeeping)",
)
_MATMULS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm")
_LABEL = "lragent::"  # prefix of this module's record_function labels: "lragent::<class>"


def _labelled(cls: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.profiler.record_function(_LABEL + cls):
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def labelled_regions() -> Iterator[None]:
    """Wraps the engine's per-class calls in ``record_function`` labels for the duration (restored after)."""
    import kernels.fused_ops as fused_ops
    import lragent.decoder as decoder
    import lragent.engine as engine
    from lragent.cache_views import DecodeView
    from lragent.decoder import DecoderEngine as Decoder
    from lragent.multi_lora import MultiLoraLinear

    targets = [
        (MultiLoraLinear, "lora_input", "LoRA"),
        (MultiLoraLinear, "_add_lora", "LoRA"),
        (MultiLoraLinear, "add_lora_masked", "LoRA"),  # the fused path's B (its X·A is in the base GEMM)
        (decoder, "role_masked", "LoRA"),
        (Decoder, "role_mask_for", "LoRA"),
        (DecodeView, "attend", "attention kernel"),
        (DecodeView, "rope_store", "norms/RoPE/SiLU"),
        (fused_ops, "silu_mul", "norms/RoPE/SiLU"),
        (Decoder, "logits", "LM head"),
        (engine, "sample_next", "sampling"),
    ]
    saved = []
    for owner, name, cls in targets:
        if not hasattr(owner, name):
            continue
        raw = owner.__dict__.get(name, getattr(owner, name))
        saved.append((owner, name, raw))
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(_labelled(cls, raw.__func__)))
        else:
            setattr(owner, name, _labelled(cls, raw))
    norm = Decoder.__dict__["_norm"]  # a staticmethod: norms, fused or not
    saved.append((Decoder, "_norm", norm))
    Decoder._norm = staticmethod(_labelled("norms/RoPE/SiLU", norm.__func__))
    try:
        yield
    finally:
        for owner, name, raw in reversed(saved):
            setattr(owner, name, raw)


def _label_of(evt) -> str | None:
    """The class of the innermost ``lragent::`` label around ``evt`` (itself included), or None."""
    e = evt
    while e is not None:
        if e.name.startswith(_LABEL):
            return e.name[len(_LABEL) :]
        e = e.cpu_parent
    return None


def classify_eager(events, device_type: str) -> Counter:
    """Microseconds per class over a profile's events: kernel time on CUDA, CPU self time on the CPU."""
    out: Counter = Counter({c: 0.0 for c in CLASSES})
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        if device_type == "cuda":
            spent = sum(k.duration for k in evt.kernels)
        else:
            spent = evt.self_cpu_time_total
        if spent <= 0:
            continue
        cls = _label_of(evt)
        if cls is None:
            cls = "GEMV (base weights)" if evt.name in _MATMULS else "other (embedding, adds, bookkeeping)"
        out[cls] += spent
    return out


def kernel_class(name: str) -> str:
    """A CUDA kernel's class from its name alone (graph replays: no op around it)."""
    n = name.lower()
    if "flash_lora" in n or "flash" in n and "attn" in n or "fmha" in n:
        return "attention kernel"
    # before the norms: a GEMV with the norm or SiLU inside (kernels.fused_gemv) is bound by its weight's bytes
    if any(k in n for k in ("gemv", "gemm", "cutlass", "xmma", "sm90", "sm80", "cublas", "splitk")):
        return "GEMV/GEMM (base, LoRA and LM head)"
    if any(k in n for k in ("rms_norm", "rope_store", "silu_mul")):
        return "norms/RoPE/SiLU"
    # "maxops": the chunk maxima of lragent.sampling.first_argmax (the step's only max reduction: the norms are Triton)
    if any(k in n for k in ("sort", "scan", "cumsum", "argmax", "maxops", "softmax")):
        return "sampling"
    return "other (embedding, adds, bookkeeping)"


def _kernel_events(events) -> list:
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]


def _engine(lm, scheme: str, batch: int, capacity: int, graphs: bool, prompts, new_tokens: int):
    from lragent.engine import Engine, GenerationRequest

    eng = Engine(lm, scheme, rows=batch, capacity=capacity, eos_token_ids=[], cuda_graphs=graphs, sync_every=32)
    for r in range(batch):
        eng.append(r, prompts[r])
        eng.start(r, GenerationRequest(role=r % len(lm.router), max_new_tokens=new_tokens))
    return eng


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_batch(lm, scheme: str, batch: int, context: int, steps: int, device: torch.device) -> dict:
    """Per-step milliseconds per class for ``batch`` rows at ``context`` tokens (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    warm = 2 * 32  # graph capture and kernel compilation happen here, outside the timings
    capacity = context + warm + 3 * steps + 8
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, lm.decoder.vocab_size, (batch, context), generator=g).tolist()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result: dict = {"batch": batch}

    # eager, labelled: per-class time
    eng = _engine(lm, scheme, batch, capacity, False, prompts, warm + 3 * steps)
    result["fuse_lora"] = eng.fuse_lora  # LRAGENT_FUSE_LORA=0: the previous path (A GEMMs, per-layer B gather)
    eng.advance(max_steps=4)
    _sync(device)
    with labelled_regions(), profile(activities=activities) as prof:
        eng.advance(max_steps=steps)
        _sync(device)
    events = prof.events()
    per_class = classify_eager(events, device.type)
    result["eager_ms_per_step_by_class"] = {c: per_class[c] / 1e3 / steps for c in CLASSES}
    t0 = time.perf_counter()
    eng.advance(max_steps=steps)
    _sync(device)
    result["eager_wall_ms_per_step"] = 1e3 * (time.perf_counter() - t0) / steps
    del eng
    if device.type != "cuda":
        return result

    # CUDA graphs: wall time, kernel time, idle; kernels classified by name
    eng = _engine(lm, scheme, batch, capacity, True, prompts, warm + 3 * steps)
    eng.advance(max_steps=warm)
    _sync(device)
    t0 = time.perf_counter()
    eng.advance(max_steps=steps)
    _sync(device)
    wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    with profile(activities=activities) as prof:
        eng.advance(max_steps=steps)
        _sync(device)
    kernels = [(k.name, k.time_range.end - k.time_range.start) for k in _kernel_events(prof.events())]
    result.update(graph_wall_ms_per_step=wall_ms, **summarize_kernels(kernels, steps, wall_ms))
    del eng
    torch.cuda.empty_cache()
    return result


def summarize_kernels(kernels: list[tuple[str, float]], steps: int, wall_ms: float) -> dict:
    """The graph pass's figures from its kernels ``(name, microseconds)`` over ``steps`` steps of ``wall_ms`` each:
    busy and idle milliseconds per step, per class, the top 15 names with their launches per step, and the launches
    per step in all (every launch is a graph node: the idle time between nodes grows with their number)."""
    by_name: Counter = Counter()
    launches: Counter = Counter()
    by_class: Counter = Counter()
    for name, us in kernels:
        by_name[name] += us
        launches[name] += 1
        by_class[kernel_class(name)] += us
    busy_ms = sum(by_name.values()) / 1e3 / steps
    return {
        "graph_kernel_ms_per_step": busy_ms,
        "graph_idle_ms_per_step": max(wall_ms - busy_ms, 0.0),
        "graph_kernels_per_step": len(kernels) / steps,
        "graph_ms_per_step_by_kernel_class": {c: v / 1e3 / steps for c, v in by_class.most_common()},
        "graph_top_kernels": [(n[:90], v / 1e3 / steps, launches[n] / steps) for n, v in by_name.most_common(15)],
    }


def profile_decode(
    model: str = "llama-3.1-8b",
    scheme: str = "base_lr_shared",
    context: int = 2048,
    batches: list[int] | None = None,
    steps: int = 32,
    rank: int = 8,
    dtype: str = "bfloat16",
    device: str = "cuda",
    overrides: dict | None = None,
    plans: list[str] | None = None,
    out: str = "bench_out/decode",
) -> int:
    """Per-step decode time per op class (torch profiler), eager with labels and under CUDA graphs.

    Args:
        model: a named random-weight architecture (``llama-3.1-8b``, ``smollm2-135m``, ``tiny-llama``, ...).
        scheme: sharing scheme.
        context: tokens in each row's cache when decoding starts.
        batches: batch sizes (rows decoding together).
        steps: decode steps profiled (and timed) per pass.
        rank: LoRA rank of the random adapters (q_proj, v_proj; B != 0).
        dtype: compute dtype.
        device: cuda (the profile the benchmark needs) or cpu (eager pass only; tests).
        overrides: config fields to change (e.g. ``{"num_hidden_layers": 2}`` for a quick look).
        plans: decode plans profiled one after the other on the same model, each as ``bench decode --plans`` takes
            them (the attention kernel's knobs, ``fused_gemv=N``); default: the
            environment's settings. Each row records its plan and switches.
        out: output directory (``decode_profile.json`` and ``.md``; the decode benchmark's directory by default).
    """
    from eval_suite.bench.decode import check_plans, plan_environment
    from eval_suite.bench.timed_model import random_adapter_model
    from lragent.memory_plan import choose_batch
    from lragent.models import load_model, parse_dtype
    from lragent.schemes import Scheme

    scheme = Scheme.parse(scheme)  # parsed once
    batches = list(batches or [1, 32])
    plans = [""] if plans is None else [str(p).strip() for p in plans]
    check_plans(plans)  # a bad plan or switch is named before anything loads
    if any(b < 1 for b in batches) or context < 1 or steps < 1:
        raise ValueError(f"batches, context and steps must be >= 1, got {batches}, {context}, {steps}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} but CUDA is not available: allowed cpu")
    dt = parse_dtype(dtype)
    if not overrides:  # the plan reads the architecture's own config
        for b in batches:
            choose_batch(model, [scheme], b, context + 64 + 3 * steps + 8, dtype=dt, device=dev, rank=rank,
                         option="--batches", auto_ok=False)  # fmt: skip
    hf, _ = load_model(model, dtype=dt, device=dev, overrides=overrides)
    lm = random_adapter_model(hf, rank)
    rows = []
    with torch.no_grad():
        for spec in plans:
            with plan_environment(spec) as switched:
                for b in batches:
                    rows.append({**profile_batch(lm, scheme, b, context, steps, dev), "plan": spec, **switched})
                    print(f"b={b} plan={spec or 'environment'}: {rows[-1]}", flush=True)
    result = {
        "model": model,
        "scheme": scheme,
        "context": context,
        "steps": steps,
        "rank": rank,
        "overrides": overrides,
        "rows": rows,
        "provenance": provenance(dtype=dt, device=str(dev)),
    }
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "decode_profile.json", result)
    write_text(out_dir / "decode_profile.md", _markdown(result))
    print(_markdown(result))
    return 0


def _column(r: dict) -> str:
    """A row's column title: its batch, and its plan where it names one (records before plans had none)."""
    return f"b={r['batch']}" + (f" {r['plan']}" if r.get("plan") else "")


def _markdown(result: dict) -> str:
    head = ["class"] + [f"eager {_column(r)} (ms/step)" for r in result["rows"]]
    table = [[c] + [f"{r['eager_ms_per_step_by_class'][c]:.3f}" for r in result["rows"]] for c in CLASSES]
    table.append(["eager wall"] + [f"{r['eager_wall_ms_per_step']:.3f}" for r in result["rows"]])
    lines = [
        f"# Decode step profile: {result['model']} (random weights), {result['scheme']}, "
        f"context {result['context']}, {result['steps']} steps",
        "",
        "Eager decoding with labelled regions: kernel time per class (CPU op time on the CPU). Fused LoRA path "
        f"(A in the fused GEMMs, B through the role mask): {'on' if result['rows'][0].get('fuse_lora') else 'off'}.",
        "",
        markdown_table(head, table),
    ]
    graph_rows = [r for r in result["rows"] if "graph_wall_ms_per_step" in r]
    if graph_rows:
        classes = sorted({c for r in graph_rows for c in r["graph_ms_per_step_by_kernel_class"]})
        head = ["CUDA graphs"] + [f"{_column(r)} (ms/step)" for r in graph_rows]
        table = [["wall"] + [f"{r['graph_wall_ms_per_step']:.3f}" for r in graph_rows]]
        table.append(["kernels"] + [f"{r['graph_kernel_ms_per_step']:.3f}" for r in graph_rows])
        table.append(["idle"] + [f"{r['graph_idle_ms_per_step']:.3f}" for r in graph_rows])
        if all("graph_kernels_per_step" in r for r in graph_rows):  # records before it lack the count
            table.append(["kernel launches (count)"] + [f"{r['graph_kernels_per_step']:.0f}" for r in graph_rows])
        for c in classes:
            table.append([c] + [f"{r['graph_ms_per_step_by_kernel_class'].get(c, 0.0):.3f}" for r in graph_rows])
        lines += ["", "CUDA-graph decoding: wall, kernel and idle time per step; kernels by name.", ""]
        lines.append(markdown_table(head, table))
        for r in graph_rows:
            lines += ["", f"Top kernels, {_column(r)} (ms/step):", ""]
            lines += [f"- `{k[0]}`: {k[1]:.3f}" + (f" ({k[2]:.0f} launches)" if len(k) > 2 else "")
                      for k in r["graph_top_kernels"]]  # fmt: skip
    lines += ["", provenance_footer(result["provenance"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:

    from lragent.command import run_command

    return run_command(profile_decode, argv, prog="python -m eval_suite.bench.profile_decode")


if __name__ == "__main__":
    raise SystemExit(main())
