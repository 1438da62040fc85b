# ruff: noqa  (a one-off driver kept as it ran; removed in the next commit, results/engine_h100/decode_2026-11-27c/)
"""Decode attention with the L2 cold, as in a decode step: 32 layers' caches, one launch per layer in a CUDA graph;
the median microseconds per launch for launch-rule variants (kernels.flash_lora_decode._plan's knobs), LoRA and plain.

One-off driver of results/engine_h100/decode_2026-11-27c/ (the rule's 32-key tiles for the LoRA kernel):
    python3 scripts/sweep_decode_cold.py OUT.json                      # 16 variants at (1, 2k), (32, 2k), (1, 16k)
    python3 scripts/sweep_decode_cold.py OUT.json '[[4, 2048], ...]'   # rule, bn32, bn32 s4 at these (batch, keys)
"""

import json
import sys

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0)

import torch  # noqa: E402
from eval_suite.bench_kernel import HEAD_DIM, HKV, HQ, N_ROLES, RANK, SCALING  # noqa: E402
from kernels.flash_lora_attention import _num_sms  # noqa: E402
from kernels.flash_lora_decode import _launch_decode, _plan  # noqa: E402

LAYERS = 32
VARIANTS = (
    {"rule": {}, "bn32": {"block_n": 32}, "bn32 s4": {"block_n": 32, "num_stages": 4}}
    if len(sys.argv) > 2
    else {
        "rule": {},
        "bn32": {"block_n": 32},
        "bn32 w4": {"block_n": 32, "num_warps": 4},
        "bn32 w4 s2": {"block_n": 32, "num_warps": 4, "num_stages": 2},
        "bn32 w4 s4": {"block_n": 32, "num_warps": 4, "num_stages": 4},
        "bn32 w4 t2": {"block_n": 32, "num_warps": 4, "min_split_tiles": 2},
        "bn32 w4 t8": {"block_n": 32, "num_warps": 4, "min_split_tiles": 8},
        "bn32 w4 p3": {"block_n": 32, "num_warps": 4, "programs_per_sm": 3},
        "bn32 w4 p4 t2": {"block_n": 32, "num_warps": 4, "programs_per_sm": 4, "min_split_tiles": 2},
        "bn32 w2 s4": {"block_n": 32, "num_stages": 4},
        "bn16 w4": {"block_n": 16, "num_warps": 4},
        "bn16 w4 t8": {"block_n": 16, "num_warps": 4, "min_split_tiles": 8},
        "bn16 w2 t8": {"block_n": 16, "min_split_tiles": 8},
        "bn64 w4": {"num_warps": 4},
        "bn64 w8": {"num_warps": 8},
        "bn128 w8": {"block_n": 128, "num_warps": 8, "num_stages": 2},
    }
)
out = []
for bsz, n in json.loads(sys.argv[2]) if len(sys.argv) > 2 else [(1, 2048), (32, 2048), (1, 16384)]:
    cap = n + 72
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s, sc=1.0: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16).mul_(sc)
    layers = [
        dict(
            k=rnd(bsz, HKV, cap, HEAD_DIM),
            v=rnd(bsz, HKV, cap, HEAD_DIM),
            lr=rnd(bsz, cap, RANK),
            b=rnd(N_ROLES, HKV * HEAD_DIM, RANK, sc=0.05).view(N_ROLES, HKV, HEAD_DIM, RANK).transpose(-1, -2),
        )
        for _ in range(LAYERS)
    ]
    q = rnd(bsz, HQ, HEAD_DIM)
    o = torch.empty_like(q)
    lens = torch.full((bsz,), n, dtype=torch.int32, device="cuda")
    roles = torch.arange(bsz, device="cuda") % N_ROLES
    ref = None
    for name, over in VARIANTS.items():
        for lora in (True, False):
            if not lora and name not in ("rule", "bn32", "bn32 w4", "bn32 w4 t2"):
                continue
            try:
                plan = _plan(bsz, HKV, HQ // HKV, cap, HEAD_DIM, _num_sms(q.device), **over)

                def step(plan=plan, lora=lora):
                    for L in layers:
                        _launch_decode(
                            q,
                            L["k"],
                            L["v"],
                            lens,
                            L["lr"] if lora else None,
                            L["b"] if lora else None,
                            SCALING,
                            roles,
                            None,
                            None,
                            o,
                            plan,
                        )

                step()
                torch.cuda.synchronize()
                if lora and name == "rule":
                    ref = o.clone()
                elif lora:
                    err = (o.float() - ref.float()).abs().max().item()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    step()
                ts = []
                for _ in range(15):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    gr.replay()
                    b.record()
                    torch.cuda.synchronize()
                    ts.append(a.elapsed_time(b) * 1000 / LAYERS)
                ts.sort()
                row = {
                    "B": bsz,
                    "L": n,
                    "variant": name,
                    "lora": lora,
                    "us": round(ts[7], 2),
                    "min": round(ts[0], 2),
                    "splits": plan.n_splits,
                    "err": None if (not lora or name == "rule") else err,
                }
                del gr
            except Exception as e:  # noqa: BLE001
                row = {"B": bsz, "L": n, "variant": name, "lora": lora, "error": str(e)[:200]}
            out.append(row)
            print(json.dumps(row), flush=True)
    del layers
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
