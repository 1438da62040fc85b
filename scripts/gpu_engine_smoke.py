"""GPU smoke check of the engine: every scheme, 4 rows with mixed roles, graph vs eager decoding, kernel on/off.

Prints one line per case and exits non-zero on a mismatch. Used before the timed benchmarks of a device call:

    python scripts/gpu_engine_smoke.py [--arch smollm2-135m]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from lragent.engine import Engine, GenerationRequest
from lragent.lora_model import MultiLoraModel
from lragent.models import load_model
from lragent.multi_lora import MultiLoraConfig
from lragent.schemes import SCHEMES


def run(model, scheme: str, graphs: bool, use_kernel: bool, rows: int = 4) -> list[list[int]]:
    eng = Engine(model, scheme, rows=rows, capacity=512, eos_token_ids=[], cuda_graphs=graphs, use_kernel=use_kernel)
    g = torch.Generator().manual_seed(0)
    out: list[list[int]] = [[] for _ in range(rows)]
    for step in range(3):
        for r in range(rows):
            eng.append(r, torch.randint(3, 200, (5 + 7 * r + step,), generator=g).tolist())
            eng.start(r, GenerationRequest(role=(r + step) % 3, max_new_tokens=6 + 3 * r, temperature=0.0))
        while eng._pending:
            for res in eng.advance():
                out[res.row].append(res.generated_ids)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="smollm2-135m")
    args = p.parse_args()
    hf, _ = load_model(args.arch, dtype=torch.bfloat16, device="cuda", overrides={"num_hidden_layers": 6})
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0)).eval()
    model.init_adapters("random", seed=0, b_std=0.02)
    bad = 0
    for scheme in SCHEMES:
        t0 = time.perf_counter()
        runs = {(g, k): run(model, scheme, graphs=g, use_kernel=k) for g in (False, True) for k in (True, False)}

        def agree(a, b):
            n = sum(len(t) for row in a for t in row)
            pairs = (
                (x, y)
                for r1, r2 in zip(a, b, strict=True)
                for t1, t2 in zip(r1, r2, strict=True)
                for x, y in zip(t1, t2, strict=False)
            )
            same = sum(x == y for x, y in pairs)
            return f"{same}/{n}"

        exact = runs[(True, True)] == runs[(False, True)]  # same kernels: graph replay must change nothing
        bad += not exact
        print(
            f"{scheme:15s} graph vs eager (kernel): {agree(runs[(True, True)], runs[(False, True)])} "
            f"{'OK' if exact else 'MISMATCH'}; graph vs eager (torch): "
            f"{agree(runs[(True, False)], runs[(False, False)])}; kernel vs torch (eager): "
            f"{agree(runs[(False, True)], runs[(False, False)])} ({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
