"""Benchmark Flash-LoRA-Attention against plain FlashAttention (torch SDPA) and naive expansion.

For LLaMA-3.1-8B attention shapes (32 query heads, 8 KV heads, head dim 128, LoRA rank 8, bf16) and each
key length L, it times, in one run on one GPU:

- ``fused``: ``flash_lora_attention`` over (K, V_base, V_lr, B);
- ``floor``: plain attention through torch SDPA over a value cache of the same length (the best of the
  flash, cuDNN and memory-efficient backends; GQA through ``enable_gqa``), i.e. what attention costs
  without any LoRA term;
- ``naive``: materialise ``V = V_base + V_lr B s`` for all L keys, then the same SDPA call;

for decode (Lc = 1) and for a prefill chunk (Lc = min(4096, L) queries at the end of the L keys, causal
aligned bottom-right). Times are medians of ``triton.testing.do_bench`` (which clears L2 before each
repetition) after a warm-up/autotune call. Writes ``bench_kernel.json`` and ``bench_kernel.md``.

Run: ``python -m kernels.bench --out DIR [--lengths 2048,8192] [--quick]`` (also ``python cli.py bench kernel``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.flash_lora_attention import flash_lora_attention

HQ, HKV, HEAD_DIM, RANK = 32, 8, 128, 8  # LLaMA-3.1-8B attention, LoRA r = 8
SCALING = 2.0  # alpha 16 / r 8
TARGETS = {"decode": {"vs_floor_max": 1.15, "vs_naive_min": 3.0}, "prefill": {"vs_floor_max": 1.10}}


def _sdpa_backends() -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    names = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


def _sdpa_call(backend: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain attention, bottom-right causal for a chunk (no mask needed for Lc = 1), GQA via enable_gqa."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    lc, seq = q.shape[2], k.shape[2]
    with sdpa_kernel([backend]):
        if lc == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if lc == seq:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lc, seq), enable_gqa=True)


def _make_inputs(bsz: int, lc: int, seq: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)

    n_roles = 3
    b_peft = rnd(n_roles, HKV * HEAD_DIM, RANK, scale=0.05)  # PEFT layout (n_roles, Hkv*D, r)
    return {
        "q": rnd(bsz, lc, HQ, HEAD_DIM).transpose(1, 2),  # (B, Hq, Lc, D) as a projection produces it
        "k": rnd(bsz, HKV, seq, HEAD_DIM),
        "v_base": rnd(bsz, HKV, seq, HEAD_DIM),
        "v_lr": rnd(bsz, seq, RANK),
        "lora_b": b_peft.view(n_roles, HKV, HEAD_DIM, RANK).transpose(-1, -2),  # (n_roles, Hkv, r, D) view
        "role_ids": torch.arange(bsz, device="cuda") % n_roles,
    }


def _naive_values(x: dict) -> torch.Tensor:
    """The literal eager formula V = V_base + (V_lr B_role) s for all L keys: (B, Hkv, L, D)."""
    b_sel = x["lora_b"][x["role_ids"]]  # (B, Hkv, r, D)
    return x["v_base"] + torch.matmul(x["v_lr"].unsqueeze(1), b_sel) * SCALING


def _naive_values_one_pass(x: dict) -> torch.Tensor:
    """The same expansion in one baddbmm (reads V_base once, writes V once): the cheapest naive variant."""
    b_sel = x["lora_b"][x["role_ids"]]  # (B, Hkv, r, D)
    return torch.baddbmm(
        x["v_base"].flatten(0, 1),
        x["v_lr"].unsqueeze(1).expand(-1, HKV, -1, -1).flatten(0, 1),
        b_sel.flatten(0, 1),
        alpha=SCALING,
    ).view_as(x["v_base"])


TIMINGS = ("graph", "eager")


def _time(fn: Callable[[], object], quick: bool) -> dict[str, float]:
    """Median ms two ways: ``graph`` replays a CUDA graph of fn (GPU time, no launch overhead; the kernel
    comparison) and ``eager`` calls fn from Python with L2 cleared before each call (includes launch overhead
    whenever the CPU is slower than the GPU work)."""
    import triton

    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    times = {"eager": float(triton.testing.do_bench(fn, warmup=10 if quick else 50, rep=50 if quick else 200,
                                                    return_mode="median"))}  # fmt: skip
    try:
        times["graph"] = float(triton.testing.do_bench_cudagraph(fn, rep=30 if quick else 100, return_mode="median"))
    except Exception:  # noqa: BLE001 - a method that cannot be captured keeps its eager time only
        times["graph"] = float("nan")
    return times


def bench_case(mode: str, seq: int, bsz: int, chunk: int, dtype: torch.dtype, quick: bool) -> dict:
    """Time fused, floor and naive for one (mode, L); check the fused output against naive expansion."""
    lc = 1 if mode == "decode" else min(chunk, seq)
    x = _make_inputs(bsz, lc, seq, dtype, seed=seq + lc)
    args = (x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], SCALING)
    row: dict = {"mode": mode, "L": seq, "Lc": lc, "batch": bsz}

    fused = lambda: flash_lora_attention(*args, role_ids=x["role_ids"])
    row["fused"] = _time(fused, quick)

    by_backend: dict[str, dict[str, float]] = {}
    for name, backend in _sdpa_backends():
        try:
            _sdpa_call(backend, x["q"], x["k"], x["v_base"])
        except Exception as err:  # noqa: BLE001 - a backend that cannot run this shape/mask is recorded, not fatal
            row.setdefault("floor_unavailable", {})[name] = str(err).splitlines()[0][:160]
            continue
        by_backend[name] = _time(lambda b=backend: _sdpa_call(b, x["q"], x["k"], x["v_base"]), quick)
    if not by_backend:
        raise RuntimeError(f"no SDPA backend ran {mode} L={seq}: {row.get('floor_unavailable')}")
    row["floor_by_backend"] = by_backend
    best = min(by_backend, key=lambda n: by_backend[n]["graph"] if not math.isnan(by_backend[n]["graph"]) else 1e9)
    backend = dict(_sdpa_backends())[best]
    row["floor_backend"] = best
    row["floor"] = by_backend[best]
    row["naive"] = _time(lambda: _sdpa_call(backend, x["q"], x["k"], _naive_values(x)), quick)
    row["naive_1p"] = _time(lambda: _sdpa_call(backend, x["q"], x["k"], _naive_values_one_pass(x)), quick)

    ref = _sdpa_call(backend, x["q"], x["k"], _naive_values(x)).float()
    row["max_abs_diff_vs_naive"] = (fused().float() - ref).abs().max().item()
    # roofline inputs: bytes that must move (K, V_base, V_lr, q, out) and the attention matmul flops
    visible = sum(seq - lc + i + 1 for i in range(lc))  # keys seen, summed over the Lc query positions
    item = x["k"].element_size()
    row["min_bytes"] = bsz * item * (2 * HKV * seq * HEAD_DIM + seq * RANK + 2 * HQ * lc * HEAD_DIM)
    row["flops"] = bsz * 4 * HQ * HEAD_DIM * visible
    row["fused_tb_per_s"] = row["min_bytes"] / row["fused"]["graph"] / 1e9
    row["fused_tflop_per_s"] = row["flops"] / row["fused"]["graph"] / 1e9
    for t in TIMINGS:
        row[f"fused_vs_floor_{t}"] = row["fused"][t] / row["floor"][t]
        row[f"naive_vs_fused_{t}"] = row["naive"][t] / row["fused"][t]
        row[f"naive_1p_vs_fused_{t}"] = row["naive_1p"][t] / row["fused"][t]
    return row


def _markdown(result: dict) -> str:
    lines = [
        f"# Flash-LoRA-Attention benchmark ({result['gpu']})",
        "",
        f"torch {result['torch']}, triton {result['triton']}, {result['dtype']}, batch {result['batch']}; "
        f"Hq={HQ}, Hkv={HKV}, D={HEAD_DIM}, r={RANK}. Median ms. **graph** = CUDA-graph replay "
        "(`do_bench_cudagraph`: GPU time, no launch overhead); **eager** = Python calls (`do_bench`, L2 cleared "
        "each call; includes launch overhead). floor = best torch SDPA backend (by graph time) on V_base alone; "
        "naive = eager `V_base + (V_lr B) s`, then SDPA; naive-1p = that expansion in one baddbmm, then SDPA.",
        "",
    ]
    for t in TIMINGS:
        lines += [
            f"## {t}",
            "",
            "| mode | L | Lc | fused ms | floor ms (backend) | naive ms | naive-1p ms | fused / floor | naive / fused "
            "| naive-1p / fused |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["rows"]:
            lines.append(
                f"| {r['mode']} | {r['L']} | {r['Lc']} | {r['fused'][t]:.4f} | {r['floor'][t]:.4f} "
                f"({r['floor_backend']}) | {r['naive'][t]:.4f} | {r['naive_1p'][t]:.4f} "
                f"| {r[f'fused_vs_floor_{t}']:.3f} | {r[f'naive_vs_fused_{t}']:.2f} "
                f"| {r[f'naive_1p_vs_fused_{t}']:.2f} |"
            )
        lines.append("")
    diffs = ", ".join(f"{r['mode']} L={r['L']}: {r['max_abs_diff_vs_naive']:.1e}" for r in result["rows"])
    rates = ", ".join(
        f"{r['mode']} L={r['L']}: {r['fused_tb_per_s']:.2f} TB/s, {r['fused_tflop_per_s']:.0f} TFLOP/s"
        for r in result["rows"]
    )
    lines += [f"Max |fused - naive| per case: {diffs}.", "", f"Fused kernel achieved (graph time): {rates}."]
    lines += ["", "Targets (acceptance):"]
    for t in result["targets"]:
        lines.append(f"- {t['what']}: measured {t['measured']:.3f}, target {t['target']} -> {t['status']}")
    return "\n".join(lines) + "\n"


def _targets(rows: list[dict]) -> list[dict]:
    out = []

    def find(mode: str, seq: int) -> dict | None:
        return next((r for r in rows if r["mode"] == mode and r["L"] == seq), None)

    for t in TIMINGS:
        if (r := find("decode", 65536)) is not None:
            out.append({"what": f"decode L=64k fused/floor ({t})", "measured": r[f"fused_vs_floor_{t}"],
                        "target": "<= 1.15"})  # fmt: skip
            out.append({"what": f"decode L=64k naive/fused ({t})", "measured": r[f"naive_vs_fused_{t}"],
                        "target": ">= 3.0"})  # fmt: skip
            out.append({"what": f"decode L=64k naive-1p/fused ({t})", "measured": r[f"naive_1p_vs_fused_{t}"],
                        "target": ">= 3.0"})  # fmt: skip
        if (r := find("prefill", 32768)) is not None:
            out.append({"what": f"prefill 4096 @ L=32k fused/floor ({t})", "measured": r[f"fused_vs_floor_{t}"],
                        "target": "<= 1.10"})  # fmt: skip
    for t in out:
        op, val = t["target"].split()
        met = t["measured"] <= float(val) if op == "<=" else t["measured"] >= float(val)
        t["status"] = "met" if met else "MISSED"
    return out


def _autotune_choices() -> dict[str, str]:
    """The config each autotuner picked, per key (GROUP, HEAD_DIM, R_PAD, L/Lc bucket, ...)."""
    fla = importlib.import_module("kernels.flash_lora_attention")  # the package re-exports a same-named function

    out = {}
    for name in ("_prefill_tuned", "_decode_tuned"):
        for key, cfg in getattr(getattr(fla, name, None), "cache", {}).items():
            out[f"{name}{key}"] = str(cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write bench_kernel.json and bench_kernel.md under --out. Returns an exit code."""
    parser = argparse.ArgumentParser(prog="bench kernel", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_kernel"), help="output directory")
    parser.add_argument("--lengths", type=str, default="2048,8192,32768,65536", help="comma-separated key lengths")
    parser.add_argument("--quick", action="store_true", help="lengths 2048,8192 and shorter timing")
    parser.add_argument("--batch", type=int, default=1, help="sequences per launch")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk length Lc")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--modes", type=str, default="decode,prefill", help="comma-separated: decode,prefill")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench kernel: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    lengths = [2048, 8192] if args.quick else [int(s) for s in args.lengths.split(",") if s]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        for seq in lengths:
            row = bench_case(mode, seq, args.batch, args.chunk, dtype, args.quick)
            rows.append(row)
            print(
                f"{mode:8s} L={seq:6d} Lc={row['Lc']:5d} graph: fused {row['fused']['graph']:.4f} floor "
                f"{row['floor']['graph']:.4f} ({row['floor_backend']}) naive {row['naive']['graph']:.4f} | eager: "
                f"fused {row['fused']['eager']:.4f} floor {row['floor']['eager']:.4f} naive {row['naive']['eager']:.4f}"
                f" | maxdiff {row['max_abs_diff_vs_naive']:.1e}",
                flush=True,
            )
            torch.cuda.empty_cache()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": args.dtype,
        "batch": args.batch,
        "shapes": {"Hq": HQ, "Hkv": HKV, "D": HEAD_DIM, "r": RANK, "scaling": SCALING},
        "rows": rows,
    }
    result["targets"] = _targets(rows)
    result["autotune"] = _autotune_choices()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_kernel.json").write_text(json.dumps(result, indent=2) + "\n")
    md = _markdown(result)
    (args.out / "bench_kernel.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
