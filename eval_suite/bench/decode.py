"""`cli.py bench decode`: per-token decode latency against the GPU's bandwidth floor and stock transformers.

For one model (a named architecture gets random weights with the real shapes: speed does not depend on the values)
and a context length, it measures in one run on one GPU:

- **floor**: the bytes one decode step must read (every weight once, plus each row's cache at that context: K and
  V, or K, V_base and V_lr) over the device-to-device copy bandwidth measured in the same run (bytes read plus
  bytes written by one large copy, as METHOD.md defines it; measured before and after the timed steps, each the
  fastest of 10 copies, and the higher taken: records before 2026-11-28 evening took one median, which moved by up to
  4% between runs on one card and, read low, flattered the ratio). An input embedding table not tied to the LM head is
  counted only for the rows the step gathers (one per sequence), not whole: 1.05 GB of LLaMA-3.1-8B's 16.06 GB that
  a step never reads (floors before 2026-11-27 counted it, so their "vs floor" ratios read about 7% low there);
- **engine**: lragent's engine per scheme and batch size (greedy, no early stop), CUDA-graph decoding and, as a
  check of what graphs buy, eager decoding;
- **transformers**: the stock transformers eager loop over the same base model (``model(input_ids=...,
  past_key_values=DynamicCache)``, one token at a time), what a user would otherwise run.

Writes ``bench_decode.json`` (with provenance) and ``bench_decode.md``; prints the table.

    python cli.py bench decode --model llama-3.1-8b --context 2048 --batches [1,32] --out DIR
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from eval_suite.bench.timed_model import weights_label
from eval_suite.report import markdown_table, write_json, write_text
from lragent.memory_plan import choose_batch, model_shape, transformers_baseline_bytes
from lragent.provenance import provenance, provenance_footer

ENGINE_SWITCHES: dict[str, tuple[str, str, str]] = {
    "fused_gemv": ("LRAGENT_FUSED_GEMV", "kernels.fused_gemv:fused_gemv_rows", "fused_gemv_rows"),
    "qkv_rope": ("LRAGENT_QKV_ROPE", "kernels.fused_qkv_rope:qkv_rope_switch", "qkv_rope"),
    "qkv_maxnreg": ("LRAGENT_QKV_MAXNREG", "kernels.fused_qkv_rope:qkv_maxnreg", "qkv_maxnreg"),
    "pdl": ("LRAGENT_PDL", "kernels.pdl:pdl_switch", "pdl"),
    "gemv_table": ("LRAGENT_GEMV_TABLE", "kernels.fused_gemv:gemv_table_switch", "gemv_table"),
    "gemv_wide": ("LRAGENT_GEMV_WIDE", "kernels.fused_gemv:gemv_wide_setting", "gemv_wide"),
}
"""The ``--plans`` names that set an engine switch rather than the attention kernel's plan: name -> (environment
variable, the parser that checks its value and reads it back, the key each result row records it under)."""


def _switch_value(name: str, value: str | None = None) -> int:
    """Switch ``name``'s value as its parser reads it (from ``value``, or the environment when None), as an int."""
    import importlib

    module, _, fn = ENGINE_SWITCHES[name][1].partition(":")
    return int(getattr(importlib.import_module(module), fn)(value))


def split_plan(spec: str) -> tuple[str, dict[str, int]]:
    """A ``--plans`` entry -> (its decode-attention part in ``LRAGENT_DECODE_PLAN``'s syntax, the engine switches it
    sets: ``fused_gemv=N`` (the norms and SiLU·mul inside the GEMVs, and the o projection on the Triton GEMV, in steps
    of at most N rows; 0 off), ``qkv_rope=0|1`` (a one-row ``base_lr_shared`` step's RoPE and cache stores inside the
    q/k/v GEMV), ``qkv_maxnreg=N`` (that launch's registers per thread; 0 the compiler's), ``pdl=0|1`` (the decode
    kernels launched with programmatic dependent launch, :mod:`kernels.pdl`), ``gemv_table=0|1`` (the one-row GEMVs'
    launches measured on this GPU model, ``kernels.fused_gemv.DEVICE_LAUNCHES``, or the H100's), ``gemv_wide=0|1`` (a
    wide one-row norm GEMV, the 8B gate/up, unfused or fused; unset: the table's choice, recorded as -1); a switch it
    does not name keeps the environment's value).

    Raises:
        ValueError: a switch's value outside what its parser allows (named with the range).
    """
    kernel, switches = [], {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        if name.strip() not in ENGINE_SWITCHES:
            kernel.append(item)
            continue
        try:
            switches[name.strip()] = _switch_value(name.strip(), value if value.strip() else "x")
        except ValueError as exc:
            raise ValueError(f"--plans {spec!r}: {exc}") from None
    return ",".join(kernel), switches


def plan_turns(plans: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(turn, plan)`` in the order ``bench decode --repeats`` times them: every plan once per turn, turn after turn
    (A, B, A, B: a drift during the run falls on every plan alike, where A, A, B, B would put it on one)."""
    return [(rep, spec) for rep in range(repeats) for spec in plans]


def check_plans(plans: list[str]) -> None:
    """Names a bad ``--plans`` entry, or a bad engine switch in the environment, before anything loads.

    Raises:
        ValueError: the setting, with what is allowed.
    """
    from kernels import flash_lora_decode as fld

    for spec in plans:
        fld.parse_plan(split_plan(spec)[0])
    for name in ENGINE_SWITCHES:
        _switch_value(name)


@contextlib.contextmanager
def plan_environment(spec: str) -> Iterator[dict[str, int]]:
    """The body runs under one ``--plans`` entry: its attention-kernel part in ``LRAGENT_DECODE_PLAN`` and its engine
    switches in their variables (a switch it does not name keeps the environment's value); the kernel's plan cache is
    cleared on the way in and out and the environment restored after. Engines made inside capture their graphs with
    these launches. Yields every switch as it reads back, under its record key (``fused_gemv_rows``, ...)."""
    from kernels import flash_lora_decode as fld

    kernel_spec, switches = split_plan(spec)
    names = ["LRAGENT_DECODE_PLAN", *(env for env, _, _ in ENGINE_SWITCHES.values())]
    saved = {k: os.environ.get(k) for k in names}
    try:
        os.environ["LRAGENT_DECODE_PLAN"] = kernel_spec
        for name, value in switches.items():
            os.environ[ENGINE_SWITCHES[name][0]] = str(value)
        fld._PLANS.clear()
        yield {key: _switch_value(n) for n, (_, _, key) in ENGINE_SWITCHES.items()}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        fld._PLANS.clear()


def copy_rate(seconds: list[float], n_bytes: int) -> float:
    """Bytes/s (read plus written) of the fastest of timed copies of ``n_bytes``: the rate the memory sustains.

    The best, not the median: a copy slowed by anything else on the card says nothing about the memory, and a low
    rate lowers the floor's time bound, which flatters every ratio measured against it.
    """
    if not seconds or min(seconds) <= 0:
        raise ValueError(f"need positive copy times, got {seconds}")
    return 2 * n_bytes / min(seconds)


def measure_copy_bandwidth(device: torch.device, n_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (:func:`copy_rate` of
    ``reps`` timed copies after two untimed)."""
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return copy_rate(times[2:], n_bytes)


def set_floors(rows: list[dict], bandwidths: list[float]) -> float:
    """Sets ``floor_ms`` and ``vs_floor`` of every row that records ``bytes_read_per_step``, over the highest of the
    run's bandwidth measurements (one before the timed steps and one after: the card's rate drifts by a few percent
    between measurements, and the floor takes the rate it can reach).

    Args:
        rows: timed rows; those with ``bytes_read_per_step`` (weights read plus the rows' cache) and ``ms_per_token``
            get a floor.
        bandwidths: the run's copy bandwidth measurements, bytes/s.

    Returns:
        The bandwidth the floors use.
    """
    bandwidth = max(bandwidths)
    for r in rows:
        if "bytes_read_per_step" in r:
            r["floor_ms"] = 1e3 * r["bytes_read_per_step"] / bandwidth
            r["vs_floor"] = r["ms_per_token"] / r["floor_ms"]
    return bandwidth


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (tied weights once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def unread_table_bytes(vocab: int, hidden: int, element_size: int, tied: bool, rows: int) -> int:
    """Bytes of a ``(vocab, hidden)`` input embedding table that one decode step of ``rows`` rows does not read: it
    gathers one row per sequence, so the rest of the table is not part of the step's floor. Zero where the table is
    tied to the LM head (which reads all of it every step)."""
    return 0 if tied else (vocab - min(rows, vocab)) * hidden * element_size


def unread_embedding_bytes(hf: torch.nn.Module, rows: int) -> int:
    """:func:`unread_table_bytes` of a loaded model.

    Args:
        hf: the transformers model (``get_input_embeddings`` / ``get_output_embeddings``).
        rows: sequences decoding together (rows gathered per step).
    """
    emb, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
    tied = emb.data_ptr() == head.data_ptr()
    return unread_table_bytes(emb.shape[0], emb.shape[1], emb.element_size(), tied, rows)


EMBEDDING_FLOOR = "gathered rows"  # how the floor counts an untied input table (records before it: "whole table")


def with_floors_recomputed(result: dict, unread: Callable[[int], int]) -> dict:
    """A record made when the floor counted an untied input embedding table whole (no ``embedding_floor`` key),
    with each row's floor recomputed from its own recorded bytes and bandwidth, less the table's unread rows.

    Args:
        result: ``bench_decode.json`` as an earlier ``decode`` wrote it.
        unread: batch size -> bytes of the input table that a step of that batch does not read.

    Returns:
        The record with ``floor_ms`` / ``vs_floor`` recomputed, ``unread_embedding_bytes`` and
        ``embedding_floor`` set, and ``refloored_from`` naming the recomputation; a current record unchanged.
    """
    if result.get("embedding_floor") == EMBEDDING_FLOOR:
        return result
    bw = result["copy_bandwidth_bytes_per_s"]
    rows = []
    for r in result["rows"]:
        r = dict(r)
        if "floor_ms" in r:
            r["floor_ms"] = 1e3 * (r["floor_ms"] / 1e3 * bw - unread(r["batch"])) / bw
            r["vs_floor"] = r["ms_per_token"] / r["floor_ms"]
        rows.append(r)
    how = "the recorded floor (input table counted whole) less the table's unread rows"
    return {**result, "rows": rows, "unread_embedding_bytes": unread(1), "embedding_floor": EMBEDDING_FLOOR,
            "refloored_from": how}  # fmt: skip


def config_unread_bytes(model: str, dtype: str) -> Callable[[int], int]:
    """:func:`unread_embedding_bytes` from ``model``'s config alone (no weights): batch -> bytes."""
    from lragent.memory_plan import model_config
    from lragent.models import parse_dtype

    cfg = model_config(model)
    element = parse_dtype(dtype).itemsize
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return lambda rows: unread_table_bytes(cfg.vocab_size, cfg.hidden_size, element, tied, rows)


def render(result: dict, dtype: str) -> str:
    """``bench_decode.md`` from a record (as :func:`decode` writes it)."""
    rows, prov, model = result["rows"], result["provenance"], result["model"]
    with_plan = any(result.get("plans") or [])  # a plan other than the launch rule was timed
    with_turn = any("repeat" in r for r in rows)  # --repeats 2 and more
    body = [
        [
            r["impl"],
            r["scheme"],
            *([(r.get("plan") or "rule") if r["impl"].startswith("lragent") else "–"] if with_plan else []),
            *([str(r.get("repeat", "–"))] if with_turn else []),
            str(r["batch"]),
            f"{r['ms_per_token']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['floor_ms']:.3f}" if "floor_ms" in r else "–",
            f"{r['vs_floor']:.2f}" if "vs_floor" in r else "–",
            f"{r['speedup_vs_transformers']:.2f}" if r["speedup_vs_transformers"] else "–",
        ]
        for r in rows
    ]
    refloored = f" Floors recomputed after the run: {result['refloored_from']}." if "refloored_from" in result else ""
    samples = result.get("copy_bandwidth_measures_bytes_per_s") or []
    measures = (
        f"; the higher of {', '.join(f'{b / 1e12:.2f}' for b in samples)} measured before and after the timed steps, "
        "each the fastest of its copies"
        if len(samples) > 1
        else ""
    )
    return (
        f"# Decode latency ({prov['device']['name']})\n\n"
        f"{model} ({weights_label(model)}), {dtype}, context {result['context']} tokens per row, "
        f"{result['new_tokens']} tokens timed per row, "
        f"LoRA rank {result['rank']} on q/v (B != 0); fused LoRA path (A in the fused GEMMs, B through the role mask): "
        f"{'on' if any(r.get('fuse_lora') for r in rows) else 'off'}. "
        f"Measured copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + write{measures}); "
        f"weights {result['weight_bytes'] / 1e9:.2f} GB ({result['weight_bytes_with_adapters'] / 1e9:.2f} GB with "
        f"adapters), of which {result['unread_embedding_bytes'] / 1e9:.2f} GB of input embedding rows a step does not "
        "gather. floor = (weights read + the rows' cache at this context) / bandwidth, per step."
        f"{refloored}\n\n"
        + markdown_table(
            [
                "impl",
                "scheme",
                *(["decode plan"] if with_plan else []),
                *(["turn"] if with_turn else []),
                "batch",
                "ms/token",
                "tokens/s",
                "floor ms",
                "vs floor",
                "speed-up vs transformers",
            ],
            body,
        )
        + provenance_footer(prov)
    )


def refloor_record(refloor: str) -> int:
    """An earlier ``bench decode`` record's floors recomputed (:func:`with_floors_recomputed`), its
    ``bench_decode.json`` and ``.md`` rewritten in place.

    Args:
        refloor: a bench decode output directory (its bench_decode.json).

    Returns:
        the exit status.
    """
    import json

    path = Path(refloor) / "bench_decode.json"
    if not path.is_file():
        raise FileNotFoundError(f"--refloor {refloor}: no bench_decode.json there")
    result = json.loads(path.read_text())
    dtype = str(result["provenance"].get("dtype", "bfloat16")).replace("torch.", "")
    new = with_floors_recomputed(result, config_unread_bytes(result["model"], dtype))
    write_json(path, new)
    write_text(path.with_suffix(".md"), render(new, dtype))
    print(f"{path}: {'already current' if new is result else 'floors recomputed'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eval_suite.bench.decode --refloor DIR`` (:func:`refloor_record`)."""

    from lragent.command import run_command

    return run_command(refloor_record, argv, "python -m eval_suite.bench.decode")


def _rows_prompt(vocab: int, rows: int, context: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, context), generator=g).tolist()


def time_engine(
    model, scheme: str, batch: int, context: int, new_tokens: int, graphs: bool, use_kernel: bool = True
) -> dict:
    """Decode time of ``batch`` rows at ``context`` tokens under ``scheme`` (second of two identical rounds)."""
    from lragent.engine import Engine, GenerationRequest

    eng = Engine(
        model,
        scheme,
        rows=batch,
        capacity=context + new_tokens + 8,
        eos_token_ids=[],
        use_kernel=use_kernel,
        cuda_graphs=graphs,
        sync_every=32,
    )
    prompts = _rows_prompt(model.decoder.vocab_size, batch, context, seed=batch)
    result = {}
    for _ in range(2):  # the first round captures graphs and compiles kernels
        for r in range(batch):
            eng.reset(r)
            eng.append(r, prompts[r])
            eng.start(r, GenerationRequest(role=r % len(model.router), max_new_tokens=new_tokens))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        done = 0
        while done < batch:
            done += len(eng.advance())
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        result = {"seconds": seconds, "ms_per_token": 1e3 * seconds / new_tokens}
    result["tokens_per_s"] = batch * new_tokens / result["seconds"]
    result["cache_bytes_read_per_step"] = sum(eng.cache_bytes().values())
    result["fuse_lora"] = eng.fuse_lora  # LRAGENT_FUSE_LORA=0: the previous path (A GEMMs, per-layer B gather)
    del eng
    torch.cuda.empty_cache()
    return result


def time_transformers(hf_model, batch: int, context: int, new_tokens: int) -> dict:
    """Stock transformers: prefill, then one eager forward per token with a DynamicCache (second of two rounds)."""
    from transformers import DynamicCache

    prompts = torch.tensor(_rows_prompt(hf_model.config.vocab_size, batch, context, seed=batch), device="cuda")
    out = {}
    with torch.no_grad():
        for _ in range(2):
            cache = DynamicCache()
            logits = hf_model(input_ids=prompts, past_key_values=cache, use_cache=True).logits[:, -1]
            tok = logits.argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                logits = hf_model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1]
                tok = logits.argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            out = {"seconds": seconds, "ms_per_token": 1e3 * seconds / new_tokens}
            del cache
    out["tokens_per_s"] = batch * new_tokens / out["seconds"]
    torch.cuda.empty_cache()
    return out


def decode(
    model: str = "llama-3.1-8b",
    schemes: list[str] | str | None = None,
    context: int = 2048,
    batches: list[int] | None = None,
    new_tokens: int = 64,
    rank: int = 8,
    dtype: str = "bfloat16",
    eager: bool = True,
    transformers_baseline: bool = True,
    plans: list[str] | None = None,
    repeats: int = 1,
    out: str = "bench_out/decode",
) -> int:
    """Decode latency per token vs the bandwidth floor and stock transformers (one GPU, one run).

    Args:
        model: a named random-weight architecture (``llama-3.1-8b``, ``smollm2-135m``, ...) or a model name.
        schemes: sharing schemes to time: a list, ``all`` or a comma list (default: full_shared and base_lr_shared).
        context: tokens in each row's cache when decoding starts.
        batches: batch sizes (rows decoding together).
        new_tokens: tokens generated per row (timed).
        rank: LoRA rank of the random adapters (q_proj, v_proj; B != 0).
        dtype: compute dtype.
        eager: also time eager decoding (no CUDA graphs).
        transformers_baseline: also time stock transformers' eager loop (batch sizes up to 32).
        plans: decode plans to time side by side, each in ``LRAGENT_DECODE_PLAN``'s syntax (``""``: the attention
            kernel's launch rule; ``"min_split_tiles=4,programs_per_sm=1"``: its knobs set), plus ``fused_gemv=N``:
            the RMSNorms and SiLU·mul inside the GEMVs and o_proj on the Triton GEMV at steps of at most N rows, 0
            off (``LRAGENT_FUSED_GEMV``, :mod:`kernels.fused_gemv`; default 1), ``qkv_rope=0|1``,
            ``qkv_maxnreg=N``, ``pdl=0|1``, ``gemv_table=0|1`` and ``gemv_wide=0|1`` (:func:`split_plan`); every
            scheme and batch under each (default: what the environment sets now). Each row records its plan and the
            switches it ran with (``fused_gemv_rows``, ``qkv_rope``, ``qkv_maxnreg``, ``pdl``, ``gemv_table``,
            ``gemv_wide``).
        repeats: times every plan is timed, in turns (plan A, B, A, B, ...: a drift of the GPU's clock or of the
            host during the run falls on every plan alike); rows of 2 and more record their turn (``repeat``).
        out: output directory.
    """
    from eval_suite.bench.timed_model import random_adapter_model
    from lragent.models import load_model, parse_dtype
    from lragent.schemes import resolve_schemes

    schemes = resolve_schemes(schemes, ["full_shared", "base_lr_shared"])  # parsed once
    batches = list(batches or [1, 32])
    plans = [os.environ.get("LRAGENT_DECODE_PLAN", "")] if plans is None else [str(p).strip() for p in plans]
    check_plans(plans)  # a bad setting is named before anything loads, the environment's switches too
    if any(b < 1 for b in batches) or context < 1 or new_tokens < 1 or repeats < 1:
        raise ValueError(f"batches, context, new_tokens and repeats must be >= 1, got {batches}, {context}, "
                         f"{new_tokens}, {repeats}")  # fmt: skip
    if not torch.cuda.is_available():
        raise ValueError("bench decode needs a CUDA GPU")
    dt = parse_dtype(dtype)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    for b in batches:  # refuse a batch whose caches (or transformers' prefill) do not fit, before loading anything
        extra = transformers_baseline_bytes(model_shape(model), b, context, dt.itemsize) if b <= 32 else 0
        extra = extra if transformers_baseline else 0
        choose_batch(model, schemes, b, context + new_tokens + 8, dtype=dt, device=dev, rank=rank,
                     option="--batches", auto_ok=False, extra_bytes=extra)  # fmt: skip
    bandwidths = [measure_copy_bandwidth(dev)]  # and again after the timed steps (set_floors)
    hf, _ = load_model(model, dtype=dt, device=dev)
    rows: list[dict] = []
    w_bytes = weight_bytes(hf)
    if transformers_baseline:
        for b in batches:
            if b <= 32:
                t = time_transformers(hf, b, context, new_tokens)
                rows.append({"impl": "transformers eager", "scheme": "-", "batch": b, **t})
                print(f"transformers b={b}: {t['ms_per_token']:.3f} ms/token", flush=True)
    lm = random_adapter_model(hf, rank)
    w_bytes_lora = weight_bytes(lm)
    for rep, spec in plan_turns(plans, repeats):  # each plan on fresh engines (graphs captured with its launches)
        with plan_environment(spec) as switched:
            for scheme in schemes:
                for b in batches:
                    for graphs in (True, False) if eager else (True,):
                        t = time_engine(lm, scheme, b, context, new_tokens, graphs)
                        t["bytes_read_per_step"] = (
                            w_bytes_lora - unread_embedding_bytes(hf, b) + t["cache_bytes_read_per_step"]
                        )
                        impl = "lragent " + ("graph" if graphs else "eager")
                        turn = {"repeat": rep + 1} if repeats > 1 else {}
                        rows.append({"impl": impl, "scheme": scheme, "batch": b, "plan": spec, **switched, **turn, **t})
                        early = 1e3 * t["bytes_read_per_step"] / bandwidths[0]  # the table's floor comes at the end
                        print(f"{scheme} b={b} graphs={graphs} plan={spec or 'rule'}: {t['ms_per_token']:.3f} ms/token "
                              f"({t['ms_per_token'] / early:.2f}x the first bandwidth measure's floor)")  # fmt: skip
    torch.cuda.empty_cache()
    try:  # the second measure needs 4 GiB free: a run whose engines filled the card keeps the first
        bandwidths.append(measure_copy_bandwidth(dev))
    except torch.OutOfMemoryError:
        print(f"note: the copy bandwidth was measured once (no 4 GiB free after the timed steps: "
              f"{torch.cuda.mem_get_info(dev)[0] / 2**30:.1f} GiB)")  # fmt: skip
    bandwidth = set_floors(rows, bandwidths)
    for r in rows:
        base = next((x for x in rows if x["impl"] == "transformers eager" and x["batch"] == r["batch"]), None)
        r["speedup_vs_transformers"] = None if base is None else base["ms_per_token"] / r["ms_per_token"]
    prov = provenance(dtype=dt, device="cuda")
    result = {
        "model": model,
        "context": context,
        "new_tokens": new_tokens,
        "rank": rank,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "copy_bandwidth_measures_bytes_per_s": bandwidths,  # before and after the timed steps; the floor takes the max
        "weight_bytes": w_bytes,
        "weight_bytes_with_adapters": w_bytes_lora,
        "unread_embedding_bytes": unread_embedding_bytes(hf, 1),  # at batch 1; the floor excludes it per batch
        "embedding_floor": EMBEDDING_FLOOR,
        "plans": plans,
        "rows": rows,
        "provenance": prov,
    }
    write_json(out_dir / "bench_decode.json", result)
    md = render(result, dtype)
    write_text(out_dir / "bench_decode.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
