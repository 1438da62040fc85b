"""Whether the fused RMSNorm/SiLU GEMVs (:mod:`kernels.fused_gemv`) beat the unfused kernels plus cuBLAS at decode.

At LLaMA-3.1-8B's decode shapes (the q/k/v GEMV with the shared A rows after the input norm, gate/up after the
post-attention norm, down after SiLU·mul), each at a few input rows, one run times in CUDA graphs (20 calls per
replay, the median of 5 rounds):

- ``unfused``: the elementwise kernel (:mod:`kernels.fused_ops`) then ``F.linear`` (cuBLAS), what the decoder runs;
- ``cublas``: ``F.linear`` alone on the prepared input (the GEMV the fusion must keep up with);
- ``fused <config>``: one launch per config of ``--configs`` (for the o projection, which nothing precedes, the plain
  Triton GEMV the fused ones are built on: whether Triton beats cuBLAS's 83% of the floor there);

against the floor: the weight's bytes over the device-to-device copy bandwidth measured in the same run. Calls cycle
through copies of the weight, twice the L2 in all, so each reads its weight from DRAM as a decode step does. Each fused
row also records its largest difference to the unfused output (relative to that output's largest magnitude).

    python -m eval_suite.bench.fused_gemv --rows [1,4,16,32] --out bench_out/fused_gemv
    python -m eval_suite.bench.fused_gemv --configs '["block_n=8,block_k=512", "block_n=16,block_k=256,num_warps=8"]'
    python -m eval_suite.bench.fused_gemv --rows [32] --configs '["block_n=64,block_k=256,num_warps=8,split_k=4"]'

writes ``OUT/fused_gemv.json`` and ``OUT/fused_gemv.md``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from eval_suite.report import markdown_table, write_json, write_text
from lragent.provenance import provenance, provenance_footer

# name: (what precedes the GEMV, K, N); q/k/v carries the shared A rows of q and v (r 8 each) as the decoder fuses them
SHAPES: dict[str, tuple[str, int, int]] = {
    "q/k/v + A (input norm)": ("norm", 4096, 4096 + 2 * 1024 + 16),
    "gate/up (post-attention norm)": ("norm", 4096, 2 * 14336),
    "down (SiLU·mul)": ("silu", 14336, 4096),
    "o (nothing before it: the plain Triton GEMV)": ("plain", 4096, 4096),
}
DEFAULT_CONFIGS = (  # more outputs per program read the input row (and the norm's statistic) fewer times from L2
    "block_n=8,block_k=512",
    "block_n=16,block_k=512",
    "block_n=32,block_k=256",
    "block_n=16,block_k=512,num_warps=8",
    "block_n=32,block_k=512,num_warps=8",
    "block_n=64,block_k=256,num_warps=8",  # kernels.fused_gemv.ROWS_CONFIG: several rows
    "block_n=128,block_k=128,num_warps=8",
    "block_n=8,block_k=512,deferred=1",  # one row: the sum over K taken once, after the loop
    "block_n=16,block_k=512,num_warps=8,deferred=1",
    "block_n=16,block_k=256,deferred=1",  # the H200's gate/up launch (kernels.fused_gemv.DEVICE_LAUNCHES)
    "block_n=4,block_k=512,deferred=1",  # the H200's o and down launch
    # K split over programs (GemvConfig.split_k): for several rows, where N = 4096 gives few output blocks, and for
    # the one-row GEMVs of few programs (q/k/v, o)
    "block_n=64,block_k=256,num_warps=8,split_k=2",
    "block_n=64,block_k=256,num_warps=8,split_k=4",
    "block_n=32,block_k=256,num_warps=4,split_k=4",
    "block_n=128,block_k=128,num_warps=8,split_k=4",
    "block_n=16,block_k=512,num_warps=8,deferred=1,split_k=2",
)


def parse_config(spec: str):
    """``"block_n=8,block_k=512"`` -> :class:`kernels.fused_gemv.GemvConfig` (unnamed fields keep their defaults)."""
    from kernels.fused_gemv import GemvConfig

    fields = {f.name for f in dataclasses.fields(GemvConfig)}
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        if key not in fields or not value.isdigit() or int(value) < (0 if key == "deferred" else 1):
            raise ValueError(f"--configs {spec!r}: {part!r} must be one of {sorted(fields)} = a positive integer")
        values[key] = int(value)
    config = GemvConfig(**values)
    if config.deferred not in (0, 1):
        raise ValueError(f"--configs {spec!r}: deferred must be 0 or 1")
    for key in ("block_n", "block_k"):
        if getattr(config, key) & (getattr(config, key) - 1):
            raise ValueError(f"--configs {spec!r}: {key} must be a power of two")
    return config


def weight_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Copies of a weight to cycle through so that none is still in L2 when its turn comes again (twice the L2 in
    all): in a decode step every layer reads its own weights, which L2 never holds (an 8B model's are 16 GB), while
    one 4096 x 4096 bf16 weight (33.5 MB) timed over and over stays in an H100's 50 MB L2 and beats the DRAM floor."""
    return max(1, -(-2 * l2_bytes // max(1, weight_bytes)))


def _graph_us(fn: Callable[[Tensor], object], weights: list[Tensor], calls: int = 20, rounds: int = 5) -> float:
    """Microseconds per call of ``fn(weight)``, ``calls`` calls cycling through ``weights`` captured in one CUDA
    graph, median over ``rounds`` replays."""
    fn(weights[0])  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def bench_fused_gemv(
    rows: list[int] | None = None,
    configs: list[str] | None = None,
    dtype: str = "bfloat16",
    out: str = "bench_out/fused_gemv",
) -> int:
    """Fused RMSNorm/SiLU GEMVs against the unfused kernels + cuBLAS and the bandwidth floor (one GPU, one run).

    Args:
        rows: input rows (decode batch) to time (default [1, 4, 16, 32]; at most kernels.fused_gemv.MAX_ROWS).
        configs: fused launches, each ``"block_n=8,block_k=512[,num_warps=4][,num_stages=3][,deferred=1][,split_k=4]"``
            (default :data:`DEFAULT_CONFIGS`; ``split_k``: programs along K per output block).
        dtype: bfloat16 or float16.
        out: output directory.

    Returns:
        0.
    """
    from eval_suite.bench.decode import measure_copy_bandwidth
    from kernels.fused_gemv import MAX_ROWS, gemv, rms_norm_linear, silu_mul_linear
    from kernels.fused_ops import rms_norm, silu_mul

    rows = rows or [1, 4, 16, 32]
    bad = [r for r in rows if not 1 <= r <= MAX_ROWS]
    if bad:
        raise ValueError(f"--rows {bad}: allowed 1..{MAX_ROWS} (the fused GEMVs are for decode)")
    parsed = {spec: parse_config(spec) for spec in (configs or DEFAULT_CONFIGS)}
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if dt is None:
        raise ValueError(f"--dtype {dtype!r}: allowed bfloat16, float16")
    if not torch.cuda.is_available():
        raise ValueError("bench_fused_gemv times CUDA graphs: it needs a CUDA GPU")
    dev = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(dev)
    l2_bytes = torch.cuda.get_device_properties(dev).L2_cache_size
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for name, (kind, k, n) in SHAPES.items():
        w = (torch.randn(n, k, device=dev, generator=g) * k**-0.5).to(dt)
        weights = [w] + [w.clone() for _ in range(weight_copies(w.numel() * w.element_size(), l2_bytes) - 1)]
        floor_us = w.numel() * w.element_size() / bandwidth * 1e6
        for r in rows:
            if kind == "norm":
                x, res = (torch.randn(r, k, device=dev, generator=g).to(dt) for _ in range(2))
                norm_w = (torch.rand(k, device=dev, generator=g) + 0.5).to(dt)
                prepared = rms_norm(x, norm_w, 1e-5, res)[0]

                def unfused(w, x=x, res=res, norm_w=norm_w):
                    return torch.nn.functional.linear(rms_norm(x, norm_w, 1e-5, res)[0], w)

                def fused(cfg, w, x=x, res=res, norm_w=norm_w):
                    return rms_norm_linear(x, norm_w, 1e-5, w, res, config=cfg)[0]
            elif kind == "plain":
                prepared = torch.randn(r, k, device=dev, generator=g).to(dt)

                def unfused(w, p=prepared):
                    return torch.nn.functional.linear(p, w)

                def fused(cfg, w, p=prepared):
                    return gemv(p, w, config=cfg)
            else:
                gu = torch.randn(r, 2 * k, device=dev, generator=g).to(dt)
                gate, up = gu[:, :k], gu[:, k:]
                prepared = silu_mul(gate, up)

                def unfused(w, gate=gate, up=up):
                    return torch.nn.functional.linear(silu_mul(gate, up), w)

                def fused(cfg, w, gate=gate, up=up):
                    return silu_mul_linear(gate, up, w, config=cfg)

            reference = unfused(w).float()
            scale = reference.abs().max().item() or 1.0
            timed = {
                "unfused": _graph_us(unfused, weights),
                "cublas": _graph_us(lambda w, p=prepared: torch.nn.functional.linear(p, w), weights),
            }
            diffs = {}
            for spec, cfg in parsed.items():
                timed[f"fused {spec}"] = _graph_us(lambda w, cfg=cfg: fused(cfg, w), weights)
                diffs[f"fused {spec}"] = (fused(cfg, w).float() - reference).abs().max().item() / scale
            for impl, us in timed.items():
                results.append({
                    "shape": name, "k": k, "n": n, "rows": r, "impl": impl, "us": us, "floor_us": floor_us,
                    "weight_copies": len(weights),
                    "over_floor": us / floor_us, "max_rel_diff_to_unfused": diffs.get(impl),
                })  # fmt: skip
    prov = provenance(dtype=dtype, device="cuda")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "fused_gemv.json", {"copy_bandwidth_bytes_per_s": bandwidth, "results": results,
                                             "provenance": prov})  # fmt: skip
    table = markdown_table(
        ["shape (K → N)", "rows", "impl", "µs", "× floor", "max rel diff to unfused"],
        [[f"{x['shape']} ({x['k']} → {x['n']})", str(x["rows"]), x["impl"], f"{x['us']:.2f}", f"{x['over_floor']:.3f}",
          "–" if x["max_rel_diff_to_unfused"] is None else f"{x['max_rel_diff_to_unfused']:.1e}"] for x in results],
    )  # fmt: skip
    write_text(
        out_dir / "fused_gemv.md",
        f"# Fused RMSNorm/SiLU GEMVs against unfused + cuBLAS ({dtype})\n\nCUDA graphs, 20 calls per replay cycling"
        f" through copies of the weight (twice the {l2_bytes / 2**20:.0f} MiB L2 in all: read from DRAM, as in a decode"
        f" step), median of 5. Floor: the weight's bytes over the measured copy bandwidth {bandwidth / 1e12:.2f} TB/s."
        f"\n\n{table}\n" + provenance_footer(prov),
    )
    best = {}
    for x in results:
        key = (x["shape"], x["rows"])
        if x["impl"].startswith("fused") and (key not in best or x["us"] < best[key]["us"]):
            best[key] = x
    for (shape, r), x in best.items():
        unf = next(y for y in results if y["shape"] == shape and y["rows"] == r and y["impl"] == "unfused")
        print(f"{shape}, {r} row(s): unfused {unf['us']:.2f} µs, best {x['impl']} {x['us']:.2f} µs "
              f"({unf['us'] / x['us']:.2f}x), floor {x['floor_us']:.2f} µs")  # fmt: skip
    print(f"-> {out_dir / 'fused_gemv.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:

    from lragent.command import run_command

    return run_command(bench_fused_gemv, argv, prog="python -m eval_suite.bench.fused_gemv")


if __name__ == "__main__":
    raise SystemExit(main())
