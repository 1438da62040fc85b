"""`cli.py bench trace`: the paper's emulated agent trace per sharing scheme (Tables 4, 5 and 19; Figure 4).

One iteration of the trace is 17 steps: (plan, plan, action) × 5 cycles, with a retrieved context of ``L_ctx``
tokens appended as the observation after each of the first four cycles, then two reflect steps. Token ids are
random (random-weight models); the lengths of the fixed pieces below are this toolkit's reconstruction of the
AutoAct prompt format (a 400-token system prompt and question; thought 48 tokens, action type 4, argument 16,
reflect thought 48, reflect verdict 4, markers 4–16), which gives a final trajectory of ``964 + 4·L_ctx`` tokens:
9.1k at 2k, 33.7k at 8k and 66.4k at 16k.

Per scheme (and with the fused kernels on and off for the decomposed schemes, as in Figure 4) it reports:

- **throughput** = Σ over steps of the trajectory length after the step ÷ end-to-end seconds (LRAgent's
  ``analysis.py`` sums ``total_len`` over the steps of an iteration this way);
- **TTFT** = Σ over steps of the prefill seconds;
- peak cache bytes (valid positions) and peak CUDA memory allocated;
- **prefill TFLOP/s and MFU**: the model FLOPs of each step's prefill (:mod:`eval_suite.bench.model_flops`, from the
  scheme's plan of the step: what that scheme computes) over TTFT, against the card's dense bf16 peak; the same for
  decode over the decode seconds.

Every number is the second of two identical runs on one engine (the first captures graphs and compiles kernels).
Writes ``bench_trace.json``, ``bench_trace.md`` and ``bench_trace.png``.

    python cli.py bench trace --model llama-3.1-8b --contexts [256,1024,4096,16384] --out DIR
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from eval_suite.bench.model_flops import ModelShape, decode_flops, peak_flops, prefill_flops, recompute_layer_count
from eval_suite.bench.timed_model import weights_label
from eval_suite.report import markdown_table, write_json, write_text
from lragent.provenance import provenance, provenance_footer
from lragent.report_io import save_figure

PROMPT_TOKENS = 400
# (role, appended tokens, generated tokens) of one cycle, and of the closing reflect steps
CYCLE = (("plan", 8, 48), ("plan", 8, 4), ("action", 8, 16))
REFLECT = (("reflect", 16, 48), ("reflect", 4, 4))
CYCLES = 5


def trace_steps(l_ctx: int) -> list[tuple[str, int, int]]:
    """The 17 (role, appended tokens, generated tokens) steps for a retrieved-context length ``l_ctx``."""
    steps: list[tuple[str, int, int]] = []
    for c in range(CYCLES):
        for i, (role, app, gen) in enumerate(CYCLE):
            extra = 0
            if i == 0:
                extra = PROMPT_TOKENS if c == 0 else l_ctx  # the question, or the previous cycle's observation
            steps.append((role, app + extra, gen))
    steps += list(REFLECT)
    return steps


def final_length(l_ctx: int) -> int:
    return sum(a + g for _, a, g in trace_steps(l_ctx))


def run_trace(engine, model, l_ctx: int, seed: int, shape: ModelShape | None = None) -> dict:
    """One trace on row 0 of ``engine``; returns per-step timings and the aggregates, and with ``shape`` each step's
    prefill and decode model FLOPs (:mod:`eval_suite.bench.model_flops`, from the scheme's plan of the step)."""
    from lragent.engine import GenerationRequest

    g = torch.Generator().manual_seed(seed)
    vocab = model.decoder.vocab_size
    engine.reset(0)
    steps = []
    total_len_sum = 0
    engine._sync()
    t0 = time.perf_counter()
    recompute_layers = recompute_layer_count(getattr(engine.scheme, "groups", ()))
    for role, app, gen in trace_steps(l_ctx):
        engine.append(0, torch.randint(0, vocab, (app,), generator=g).tolist())
        role_id = model.router.id(role)
        ops = engine.scheme.plan(engine.traj[0], role_id) if shape is not None else []  # what the prefill will run
        length = len(engine.ids(0))
        res = engine.generate(0, GenerationRequest(role=role_id, max_new_tokens=gen))
        total_len_sum += len(engine.ids(0))
        steps.append(
            {
                "role": role,
                "prefill_tokens": res.prefill_tokens,
                "recomputed_tokens": res.recomputed_tokens,
                "decode_tokens": len(res.generated_ids),
                "prefill_s": res.prefill_s,
                "decode_s": res.decode_s,
                "total_len": len(engine.ids(0)),
                "planned_tokens": sum(op.end - op.start for op in ops),  # = prefill_tokens (tests pin it)
                "prefill_flops": prefill_flops(shape, ops, recompute_layers) if shape is not None else None,
                "decode_flops": decode_flops(shape, length, len(res.generated_ids)) if shape is not None else None,
            }
        )
    engine._sync()
    e2e = time.perf_counter() - t0
    flops = {}
    if shape is not None:
        flops = {
            "prefill_flops": sum(s["prefill_flops"] for s in steps),
            "decode_flops": sum(s["decode_flops"] for s in steps),
        }
    return {
        **flops,
        "e2e_s": e2e,
        "ttft_s": sum(s["prefill_s"] for s in steps),
        "decode_s": sum(s["decode_s"] for s in steps),
        "total_len_sum": total_len_sum,
        "final_len": len(engine.ids(0)),
        "throughput_tok_s": total_len_sum / e2e,
        "prefill_tokens": sum(s["prefill_tokens"] for s in steps),
        "steps": steps,
    }


def positions_note(model: str, contexts: list[int]) -> str | None:
    """A one-line note where a context's trace ends past the model's ``max_position_embeddings`` (RoPE then runs on
    positions the model was never trained on: its outputs mean nothing, its speed still does, since this benchmark
    scores no output), naming the largest context within the limit; None where every trace fits."""
    from lragent.memory_plan import model_config

    limit = getattr(model_config(model), "max_position_embeddings", None)
    over = [c for c in contexts if limit is not None and final_length(c) > limit]
    if not over:
        return None
    per_token = final_length(1) - final_length(0)  # tokens a unit of L_ctx adds: one per retrieved context
    return (
        f"L_ctx {', '.join(map(str, over))}: the trace ends at {final_length(max(over))} tokens, past {model}'s "
        f"max_position_embeddings {limit} (timed, but no output is meaningful there; L_ctx <= "
        f"{(limit - final_length(0)) // per_token} stays within)"
    )


def check_trace_memory(
    model: str,
    schemes: list,
    contexts: list[int],
    dtype: torch.dtype,
    device: str,
    rank: int,
    droidspeak_layers: list[int] | None,
) -> None:
    """Refuses, in one line and before the model loads, a trace whose largest context does not fit in the device's
    free memory under one of the schemes (the model, that scheme's one-row cache and the workspace, as
    :mod:`lragent.memory_plan` counts them), naming the need, what is free and what to change."""
    from lragent.memory_plan import GIB, free_memory, model_shape, plan_memory

    free = free_memory(device)
    if free is None:
        return
    shape = model_shape(model)
    element = torch.empty((), dtype=dtype).element_size()
    largest = max(contexts)
    for scheme in schemes:
        layers = droidspeak_layers if scheme == "droidspeak" else None
        plan = plan_memory(shape, scheme, 1, final_length(largest) + 64, element_size=element, rank=rank,
                           droidspeak_layers=layers)  # fmt: skip
        if plan.total > free:
            fits = [c for c in sorted(contexts) if plan_memory(shape, scheme, 1, final_length(c) + 64,
                    element_size=element, rank=rank, droidspeak_layers=layers).total <= free]  # fmt: skip
            allowed = f"--contexts up to {fits[-1]}" if fits else "smaller --contexts"
            raise ValueError(
                f"bench trace at L_ctx {largest} needs {plan.total / GIB:.2f} GiB on {device} under {scheme} "
                f"({plan.describe()}) but {free / GIB:.2f} GiB is free: allowed {allowed}, --schemes without "
                f"{scheme}, or a device with more memory"
            )


def trace(
    model: str = "llama-3.1-8b",
    contexts: list[int] | None = None,
    schemes: list[str] | str | None = None,
    kernel_off: bool = True,
    droidspeak_layers: list[int] | None = None,
    rank: int = 8,
    dtype: str = "bfloat16",
    device: str = "cuda",
    out: str = "bench_out/trace",
) -> int:
    """The 17-step agent trace per scheme: throughput, TTFT, peak cache and CUDA memory (one GPU, one run).

    Args:
        model: a named random-weight architecture (``llama-3.1-8b`` ...) or a model name.
        contexts: retrieved-context lengths L_ctx (default 256 ... 16384, doubling).
        schemes: sharing schemes: a list, ``all`` or a comma list (default all five).
        kernel_off: also run the decomposed schemes with the fused kernels off (Figure 4).
        droidspeak_layers: DroidSpeak's recompute layers (default a middle third).
        rank: LoRA rank of the random adapters (q_proj, v_proj; B != 0).
        dtype: compute dtype.
        device: ``cuda`` (timings worth reporting) or ``cpu`` (a functional smoke run only).
        out: output directory.
    """
    from eval_suite.bench.timed_model import random_adapter_model
    from lragent.engine import Engine
    from lragent.models import load_model, parse_dtype
    from lragent.schemes import SCHEMES, resolve_schemes

    schemes = resolve_schemes(schemes, SCHEMES)  # parsed once
    contexts = list(contexts or [256, 512, 1024, 2048, 4096, 8192, 16384])
    if any(c < 1 for c in contexts):
        raise ValueError(f"contexts must be >= 1 token, got {contexts}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("bench trace on cuda needs a CUDA GPU: allowed --device cpu for a functional smoke run")
    cuda = device.startswith("cuda")
    dt = parse_dtype(dtype)
    check_trace_memory(model, schemes, contexts, dt, device, rank, droidspeak_layers)  # before the model loads
    note = positions_note(model, contexts)
    if note:
        print(f"note: {note}", flush=True)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf, _ = load_model(model, dtype=dt, device=device)
    lm = random_adapter_model(hf, rank)
    runs = []
    json_path = out_dir / "bench_trace.json"
    prov = provenance(dtype=dt, device=device)
    if note:
        prov["note"] = note
    shape = ModelShape.from_config(hf.config, rank, targets=tuple(lm.lora_config.targets))
    peak = peak_flops(prov["device"]["name"]) if cuda else None
    for l_ctx in contexts:
        for scheme in schemes:
            decomposed = scheme in ("base_shared", "base_lr_shared")
            for use_kernel in (True, False) if (kernel_off and decomposed) else (True,):
                eng = Engine(
                    lm,
                    scheme,
                    rows=1,
                    capacity=final_length(l_ctx) + 64,
                    eos_token_ids=[],
                    use_kernel=use_kernel,
                    droidspeak_layers=droidspeak_layers,
                )
                run_trace(eng, lm, l_ctx, seed=l_ctx)  # warm-up: graph capture, kernel compilation
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                eng.peak_cache_bytes = 0
                res = run_trace(eng, lm, l_ctx, seed=l_ctx, shape=shape)
                res.update(rates(res, peak))
                res.update(
                    scheme=scheme,
                    kernel=use_kernel,
                    l_ctx=l_ctx,
                    peak_cache_bytes=eng.peak_cache_bytes,
                    peak_cuda_bytes=torch.cuda.max_memory_allocated() if cuda else 0,
                )
                runs.append(res)
                print(
                    f"L_ctx={l_ctx} {scheme}{'' if use_kernel else ' (kernel off)'}: throughput "
                    f"{res['throughput_tok_s']:.0f} tok/s, TTFT {res['ttft_s']:.3f} s, e2e {res['e2e_s']:.3f} s, "
                    f"cache {res['peak_cache_bytes'] / 2**30:.2f} GiB, prefill {res['prefill_tflops_s']:.1f} TFLOP/s"
                    + (f" (MFU {100 * res['prefill_mfu']:.1f}%)" if res["prefill_mfu"] is not None else ""),
                    flush=True,
                )
                del eng
                if cuda:
                    torch.cuda.empty_cache()
                write_json(json_path, {"model": model, "rank": rank, "runs": runs, "provenance": prov})
    write_text(out_dir / "bench_trace.md", render(runs, model, dtype, prov))
    plot(runs, out_dir / "bench_trace.png")
    return 0


def rates(res: dict, peak: float | None) -> dict:
    """Prefill and decode TFLOP/s (model FLOPs over TTFT and over decode seconds) and MFU against ``peak`` FLOP/s
    (``None`` on a CPU or an unknown GPU)."""
    out = {}
    for part, seconds in (("prefill", res["ttft_s"]), ("decode", res["decode_s"])):
        rate = res[f"{part}_flops"] / seconds if seconds > 0 else 0.0
        out[f"{part}_tflops_s"] = rate / 1e12
        out[f"{part}_mfu"] = rate / peak if peak else None
    return out


def _rate_cell(r: dict | None, part: str, mfu_decimals: int, with_total: bool = False) -> str:
    """``TFLOP/s (MFU %)[, total TFLOP]`` of a run's ``part`` (``prefill`` / ``decode``); ``–`` where not measured."""
    if r is None or f"{part}_tflops_s" not in r:
        return "–"
    mfu = r.get(f"{part}_mfu")
    cell = f"{r[f'{part}_tflops_s']:.3g}" + ("" if mfu is None else f" ({100 * mfu:.{mfu_decimals}f}%)")
    return cell + (f", {r[f'{part}_flops'] / 1e12:.3g} TFLOP" if with_total else "")


def _label(r: dict) -> str:
    return r["scheme"] + ("" if r["kernel"] else " (no kernel)")


def render(runs: list[dict], model: str, dtype: str, prov: dict) -> str:
    """Markdown: throughput (Table 4 layout), TTFT (Table 5), memory (Table 19), ratios to non_shared."""
    labels = list(dict.fromkeys(_label(r) for r in runs))
    contexts = sorted({r["l_ctx"] for r in runs})
    cell = {(_label(r), r["l_ctx"]): r for r in runs}
    head = ["scheme", *[f"L_ctx {c} ({final_length(c) / 1000:.1f}k)" for c in contexts]]

    def table(fn) -> str:
        return markdown_table(head, [[lab, *[fn(cell.get((lab, c)), c) for c in contexts]] for lab in labels])

    def ratio(key: str, r: dict | None, c: int) -> str:
        ref = cell.get(("non_shared", c))
        if r is None or ref is None:
            return "–" if r is None else f"{r[key]:.4g}"
        return f"{r[key]:.4g} ({r[key] / ref[key]:.2f}×)"

    parts = [
        f"# Agent trace ({prov['device']['name']}, {model} {weights_label(model)}, {dtype})\n\n",
        "17 steps: (plan, plan, action) × 5 with L_ctx retrieved tokens after each of the first four cycles, then two "
        "reflect steps; the header gives L_ctx and the final trajectory length. Second of two identical runs.\n\n",
        f"Note: {prov['note']}\n\n" if prov.get("note") else "",
        "## Throughput, tokens/s (ratio to non_shared), Table 4 layout\n\n",
        table(lambda r, c: ratio("throughput_tok_s", r, c)),
        "\n## TTFT (Σ prefill seconds) (ratio to non_shared), Table 5 layout\n\n",
        table(lambda r, c: ratio("ttft_s", r, c)),
        "\n## Prefill: model TFLOP/s over TTFT (MFU), and the step's prefill FLOPs\n\n"
        "Model FLOPs as `bench train` counts a forward (eval_suite/bench/model_flops.py): each scheme's own prefill "
        "work (non_shared re-prefills what its role has not seen), over the summed prefill seconds; MFU against the "
        "card's dense bf16 peak.\n\n",
        table(lambda r, c: _rate_cell(r, "prefill", 1, with_total=True)),
        "\n## Decode: model TFLOP/s over decode seconds (MFU)\n\n",
        table(lambda r, c: _rate_cell(r, "decode", 2)),
        "\n## Peak cache GiB (valid positions) / peak CUDA memory GiB, Table 19 layout\n\n",
        table(
            lambda r, c: (
                "–" if r is None else f"{r['peak_cache_bytes'] / 2**30:.2f} / {r['peak_cuda_bytes'] / 2**30:.1f}"
            )
        ),
    ]
    return "".join(parts) + provenance_footer(prov)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for lab in dict.fromkeys(_label(r) for r in runs):
        rs = sorted((r for r in runs if _label(r) == lab), key=lambda r: r["l_ctx"])
        xs = [r["l_ctx"] for r in rs]
        axes[0].plot(xs, [r["throughput_tok_s"] for r in rs], marker="o", label=lab)
        axes[1].plot(xs, [r["ttft_s"] for r in rs], marker="o", label=lab)
    for ax, title in zip(axes, ("throughput (tokens/s)", "TTFT (s)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("retrieved context L_ctx (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
