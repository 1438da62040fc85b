"""Where the trace's prefill time goes, per op class and per scheme, next to ``bench trace``'s prefill MFU.

``bench trace`` reports each scheme's prefill TFLOP/s and MFU (model FLOPs over TTFT). This profile says where the
rest of the time goes: the paper's 17-step trace (:mod:`eval_suite.bench.trace`) runs once per scheme, eager, under
``torch.profiler`` with the decode profile's labels (:func:`eval_suite.bench.profile_decode.labelled_regions`) plus the
prefill path's own (its attention, its RoPE and cache stores), and only the ops inside ``Engine.prefill`` count:
the GPU time of every kernel goes to the innermost label around the op that launched it, and the remaining matrix
products to the base weights' GEMMs.

Classes: GEMM (base weights), LoRA (``X·A``, the per-role B, role masks), attention kernel, RoPE and cache writes,
norms/SiLU, LM head, other (embedding, adds, copies), and the share of the prefill's wall time no kernel covers
(idle: launches and host work between kernels).

    python -m eval_suite.bench.profile_prefill --model llama-3.1-8b --context 32768 --out bench_out/trace

writes ``OUT/prefill_profile.json`` and ``OUT/prefill_profile.md``. On the CPU (``--device cpu``, tests) the classes
hold CPU op time.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

from eval_suite.bench.model_flops import ModelShape, peak_flops
from eval_suite.bench.profile_decode import _LABEL, _MATMULS, _labelled, labelled_regions
from eval_suite.bench.trace import final_length, run_trace
from eval_suite.report import markdown_table, write_json, write_text
from lragent.provenance import provenance, provenance_footer

CLASSES = (
    "GEMM (base weights)",
    "LoRA",
    "attention kernel",
    "RoPE and cache writes",
    "norms/SiLU",
    "LM head",
    "other (embedding, adds, copies)",
)
_PHASE = "lragent-phase::prefill"  # the label around Engine.prefill: only the ops under it are counted
# the decode profile's label whose name differs here (the prefill's RoPE is labelled with its cache writes)
_RENAME = {"norms/RoPE/SiLU": "norms/SiLU"}


@contextlib.contextmanager
def prefill_regions() -> Iterator[None]:
    """The decode profile's labels, plus the prefill path's attention and cache stores and a phase label around
    ``Engine.prefill`` (restored after)."""
    from lragent.cache_views import PrefillView
    from lragent.engine import Engine

    targets = [
        (PrefillView, "attend", "attention kernel"),
        (PrefillView, "rope_store", "RoPE and cache writes"),
        (PrefillView, "store", "RoPE and cache writes"),
        (PrefillView, "store_lr", "RoPE and cache writes"),
    ]
    saved = []
    with labelled_regions():
        for owner, name, cls in targets:
            raw = owner.__dict__[name]
            saved.append((owner, name, raw))
            setattr(owner, name, _labelled(cls, raw))
        raw = Engine.__dict__["prefill"]
        saved.append((Engine, "prefill", raw))

        def prefill(self, *args, **kwargs):
            with torch.profiler.record_function(_PHASE):
                return raw(self, *args, **kwargs)

        Engine.prefill = prefill
        try:
            yield
        finally:
            for owner, name, raw_fn in reversed(saved):
                setattr(owner, name, raw_fn)


def _in_prefill(evt) -> bool:
    e = evt
    while e is not None:
        if e.name == _PHASE:
            return True
        e = e.cpu_parent
    return False


def _class_of(evt) -> str:
    e = evt
    while e is not None:
        if e.name.startswith(_LABEL):
            return _RENAME.get(e.name[len(_LABEL) :], e.name[len(_LABEL) :])
        e = e.cpu_parent
    return "GEMM (base weights)" if evt.name in _MATMULS else "other (embedding, adds, copies)"


def classify_prefill(events, device_type: str) -> Counter:
    """Microseconds per class of the ops inside ``Engine.prefill``: kernel time on CUDA, CPU self time on the CPU.
    A class outside :data:`CLASSES` (a decode-only label such as sampling) would show the phase filter failed."""
    out: Counter = Counter({c: 0.0 for c in CLASSES})
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CPU or not _in_prefill(evt):
            continue
        spent = sum(k.duration for k in evt.kernels) if device_type == "cuda" else evt.self_cpu_time_total
        if spent > 0:
            out[_class_of(evt)] += spent
    return out


def profile_scheme(
    lm, scheme, context: int, device: torch.device, shape: ModelShape | None, timed_runs: bool = True
) -> dict:
    """Traces of ``scheme`` at retrieved-context length ``context``: a warm-up, a timed trace (its TTFT and FLOP
    rate) and a profiled one; ``timed_runs=False`` runs the profiled trace alone (CPU tests)."""
    from torch.profiler import ProfilerActivity, profile

    from lragent.engine import Engine

    eng = Engine(lm, scheme, rows=1, capacity=final_length(context) + 64, eos_token_ids=[])
    timed = None
    if timed_runs:
        run_trace(eng, lm, context, seed=context)  # warm-up: kernel compilation, allocator
        timed = run_trace(eng, lm, context, seed=context, shape=shape)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prefill_regions(), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        profiled = run_trace(eng, lm, context, seed=context)
        profiled_wall = time.perf_counter() - t0
    per_class = classify_prefill(prof.events(), device.type)
    ms = {c: v / 1e3 for c, v in per_class.items()}
    busy = sum(ms.values())
    timed = timed or profiled
    res = {
        "scheme": str(scheme),
        "ttft_ms": 1e3 * timed["ttft_s"],  # the unprofiled run's (the profiled one's with timed_runs=False)
        "prefill_tokens": timed["prefill_tokens"],
        "prefill_ms_by_class": ms,
        "prefill_busy_ms": busy,
        # the profiled run's own prefill time (the profiler slows the host side): idle = its wall minus kernel time
        "profiled_ttft_ms": 1e3 * profiled["ttft_s"],
        "idle_ms": max(1e3 * profiled["ttft_s"] - busy, 0.0) if device.type == "cuda" else None,
        "profiled_wall_s": profiled_wall,
    }
    if shape is not None and timed.get("prefill_flops"):
        res["prefill_flops"] = timed["prefill_flops"]
        res["prefill_tflops_s"] = timed["prefill_flops"] / timed["ttft_s"] / 1e12
    del eng
    return res


def profile_prefill(
    model: str = "llama-3.1-8b",
    schemes: list[str] | None = None,
    context: int = 32768,
    rank: int = 8,
    dtype: str = "bfloat16",
    device: str = "cuda",
    overrides: dict | None = None,
    out: str = "bench_out/trace",
) -> int:
    """Prefill time of the paper's trace per op class, for each scheme (torch profiler, eager).

    Args:
        model: a named random-weight architecture (``llama-3.1-8b``, ``smollm2-135m``, ``tiny-llama``, ...) or a
            model name.
        schemes: sharing schemes (default: full_shared and base_lr_shared, the pair whose prefill MFU the
            speed table compares).
        context: the retrieved-context length L_ctx of the trace.
        rank: LoRA rank of the random adapters (q_proj, v_proj; B != 0).
        dtype: compute dtype.
        device: cuda (the profile the trace needs) or cpu (tests).
        overrides: config fields to change (e.g. ``{"num_hidden_layers": 2}`` for a quick look).
        out: output directory (``prefill_profile.json`` and ``.md``; the trace benchmark's directory by default).
    """
    from eval_suite.bench.timed_model import random_adapter_model
    from eval_suite.bench.trace import check_trace_memory
    from lragent.models import load_model, parse_dtype
    from lragent.schemes import Scheme

    parsed = [Scheme.parse(s) for s in (schemes or ["full_shared", "base_lr_shared"])]  # parsed once
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} but CUDA is not available: allowed cpu")
    dt = parse_dtype(dtype)
    if not overrides:  # the memory check reads the architecture's own config
        check_trace_memory(model, parsed, [context], dt, device, rank, None)
    hf, _ = load_model(model, dtype=dt, device=dev, overrides=overrides)
    lm = random_adapter_model(hf, rank)
    shape = ModelShape.from_config(hf.config, rank, targets=tuple(lm.lora_config.targets))
    prov = provenance(dtype=dt, device=str(dev))
    peak = peak_flops(prov["device"]["name"]) if dev.type == "cuda" else None
    rows = []
    with torch.no_grad():
        for scheme in parsed:
            rows.append(profile_scheme(lm, scheme, context, dev, shape))
            if peak and rows[-1].get("prefill_tflops_s") is not None:
                rows[-1]["prefill_mfu"] = rows[-1]["prefill_tflops_s"] * 1e12 / peak
            print(f"{scheme}: {rows[-1]['prefill_ms_by_class']}", flush=True)
    result = {"model": model, "context": context, "rank": rank, "overrides": overrides, "peak_flops": peak,
              "rows": rows, "provenance": prov}  # fmt: skip
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "prefill_profile.json", result)
    write_text(out_dir / "prefill_profile.md", _markdown(result))
    print(_markdown(result))
    return 0


def _markdown(result: dict) -> str:
    rows = result["rows"]
    head = ["class"] + [f"{r['scheme']} (ms)" for r in rows] + [f"{r['scheme']} (%)" for r in rows]
    table = []
    for c in CLASSES:
        ms = [r["prefill_ms_by_class"][c] for r in rows]
        pct = [100 * r["prefill_ms_by_class"][c] / max(r["prefill_busy_ms"], 1e-9) for r in rows]
        table.append([c] + [f"{x:.1f}" for x in ms] + [f"{x:.1f}" for x in pct])
    table.append(["kernels (sum)"] + [f"{r['prefill_busy_ms']:.1f}" for r in rows] + ["100.0"] * len(rows))
    if all(r.get("idle_ms") is not None for r in rows):
        table.append(["idle (profiled TTFT − kernels)"] + [f"{r['idle_ms']:.1f}" for r in rows] + [""] * len(rows))
    table.append(["TTFT, unprofiled run"] + [f"{r['ttft_ms']:.1f}" for r in rows] + [""] * len(rows))
    lines = [
        f"# Prefill profile of the 17-step trace: {result['model']}, L_ctx {result['context']}",
        "",
        "Eager, kernel time per op class of the ops inside `Engine.prefill` (CPU op time on the CPU); the trace's "
        "decode steps are not counted.",
        "",
        markdown_table(head, table),
    ]
    rated = [r for r in rows if r.get("prefill_tflops_s") is not None]
    if rated:
        lines += ["", "Model FLOPs over the unprofiled run's TTFT (as `bench trace`):", ""]
        for r in rated:
            mfu = f", MFU {100 * r['prefill_mfu']:.1f}%" if r.get("prefill_mfu") is not None else ""
            lines.append(f"- `{r['scheme']}`: {r['prefill_flops'] / 1e12:.3g} TFLOP, {r['prefill_tflops_s']:.3g} "
                         f"TFLOP/s{mfu}")  # fmt: skip
    lines += ["", provenance_footer(result["provenance"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:

    from lragent.command import run_command

    return run_command(profile_prefill, argv, prog="python -m eval_suite.bench.profile_prefill")


if __name__ == "__main__":
    raise SystemExit(main())
