"""Sweep the decode kernel's launch rule inside the real engine (issue 18): graph decode of LLaMA-3.1-8B shapes
(random weights) at 2k context, batch 1 and 32, one model load, every setting timed in two rounds side by side.

The kernel benchmark (``kernels/bench.py``) times the kernel over a 64k-capacity cache; the engine sizes its cache
to the request (2k + new tokens), where the rule gives one 64-key tile per split at batch 1. This sweep measures
what the engine sees.

Usage (GPU machine, repo root)::

    python scripts/sweep_decode_plan.py --out DIR [--settings "" "min_split_tiles=4" ...]

Each setting is a ``LRAGENT_DECODE_PLAN`` value (``kernels.flash_lora_decode.plan_overrides``); ``cublas_fp32_reduce``
in a setting also turns off cuBLAS's reduced-precision bf16 reductions (``torch.backends.cuda.matmul``). Results are
written after every measurement: ``DIR/sweep_decode_plan.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eval_suite.bench_decode import measure_copy_bandwidth, time_engine, weight_bytes  # noqa: E402
from lragent.provenance import provenance  # noqa: E402
from lragent.report_io import write_json  # noqa: E402

DEFAULT_SETTINGS = [
    "",
    "min_split_tiles=2",
    "min_split_tiles=4",
    "min_split_tiles=8",
    "programs_per_sm=1",
    "programs_per_sm=1,min_split_tiles=4",
    "min_split_tiles=4,num_warps=4",
    "cublas_fp32_reduce",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", nargs="*", default=DEFAULT_SETTINGS)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scheme", default="base_lr_shared")
    args = ap.parse_args(argv)

    import kernels.flash_lora_decode as fld
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(dev)
    hf, _ = load_model("llama-3.1-8b", dtype=torch.bfloat16, device=dev)
    lm = MultiLoraModel(hf, MultiLoraConfig(rank=8, alpha=16, dropout=0.0)).eval()
    lm.init_adapters("random", seed=0, b_std=0.02)
    w_bytes = weight_bytes(lm)
    rows: list[dict] = []
    result = {
        "what": "engine graph decode per launch setting of the decode kernel (LRAGENT_DECODE_PLAN)",
        "model": "llama-3.1-8b (random weights)",
        "scheme": args.scheme,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_with_adapters": w_bytes,
        "rows": rows,
        "provenance": provenance(dtype=torch.bfloat16, device="cuda", command=" ".join(sys.argv)),
    }
    for rnd in range(args.rounds):
        for setting in args.settings:
            knobs = ",".join(x for x in setting.split(",") if x and x != "cublas_fp32_reduce")
            os.environ["LRAGENT_DECODE_PLAN"] = knobs
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = "cublas_fp32_reduce" not in setting
            fld._PLANS.clear()
            for b in args.batches:
                t = time_engine(lm, args.scheme, b, args.context, args.new_tokens, graphs=True)
                floor_ms = 1e3 * (w_bytes + t["cache_bytes_read_per_step"]) / bandwidth
                plan = next((p for k, p in fld._PLANS.items() if k[0] == b), None)
                row = {
                    "round": rnd,
                    "setting": setting or "(rule)",
                    "batch": b,
                    "ms_per_token": t["ms_per_token"],
                    "floor_ms": floor_ms,
                    "vs_floor": t["ms_per_token"] / floor_ms,
                    "n_splits": None if plan is None else plan.n_splits,
                    "min_split": None if plan is None else plan.min_split,
                }
                rows.append(row)
                print(
                    f"round {rnd} {row['setting']:<40} b={b:<3} {row['ms_per_token']:.3f} ms/token "
                    f"({row['vs_floor']:.3f}x floor {floor_ms:.3f} ms; splits {row['n_splits']})",
                    flush=True,
                )
                write_json(out / "sweep_decode_plan.json", result)
    os.environ.pop("LRAGENT_DECODE_PLAN", None)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
