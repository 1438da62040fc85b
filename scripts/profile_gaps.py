"""Where the GPU waits during a training step (issue 19): one step of a few-layer model (plain pass, shared pass, or
the weighted λ 0.5 step) under the torch profiler with CPU and CUDA activity; lists the longest idle gaps between
consecutive kernels with the Python frames that launched the kernel after the gap (a gap after a host sync or a slow
stretch of host work shows up here, not in a kernel table).

    python scripts/profile_gaps.py --layers 8 --scored 32 --out gaps.json      # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from lragent.lora_model import MultiLoraModel  # noqa: E402
from lragent.models import load_model  # noqa: E402
from lragent.multi_lora import MultiLoraConfig  # noqa: E402
from lragent.provenance import provenance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--scored", type=int, default=32)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="gaps.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hf, _ = load_model(args.model, dtype=torch.bfloat16, device=dev, overrides={"num_hidden_layers": args.layers})
    lm = MultiLoraModel(hf, MultiLoraConfig(roles=("plan", "action", "reflect"), rank=8, alpha=16.0, dropout=0.05))
    for p in lm.lora_parameters():
        p.data = p.data.float()
    lm.init_adapters("random", seed=0)
    lm.model.train()
    b, t = args.batch, args.seq
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (b, t), generator=g).to(dev)
    roles = torch.tensor([i % 3 for i in range(b)], device=dev)
    producers = (roles + 1) % 3
    split = torch.full((b,), t - args.scored - 1)  # on the host, as the training step passes it (no sync)
    index = (torch.arange(b, device=dev)[:, None] * t + torch.arange(t - args.scored, t, device=dev)).flatten()
    targets = torch.randint(0, hf.config.vocab_size, (index.numel(),), generator=g).to(dev)
    passes = {
        "plain": lambda: [lm(ids, roles, None, output_index=index)],
        "shared_base_lr": lambda: [lm.shared_sequence_forward(ids, split, producers, roles, "base_lr_shared", index)],
    }
    passes["weighted_lambda_0.5"] = lambda: passes["plain"]() + passes["shared_base_lr"]()
    result: dict = {"args": vars(args), "passes": {}}
    for name, fwd in passes.items():

        def step(fwd=fwd) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                terms = fwd()
            sum(torch.nn.functional.cross_entropy(x.float(), targets) for x in terms).div(len(terms)).backward()
            for p in lm.lora_parameters():
                p.grad = None

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            step()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        events.sort(key=lambda e: e.time_range.start)
        launches = {e.id: e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CUDA}
        gaps = []
        for prev, nxt in zip(events, events[1:], strict=False):
            gap = nxt.time_range.start - prev.time_range.end
            if gap > 0:
                gaps.append((gap, prev, nxt))
        gaps.sort(key=lambda x: -x[0])
        busy = sum(e.time_range.elapsed_us() for e in events)
        span = events[-1].time_range.end - events[0].time_range.start
        rows = []
        for gap, prev, nxt in gaps[: args.top]:
            parent = nxt.cpu_parent or launches.get(getattr(nxt, "correlation_id", -1))
            frames = []
            p = parent
            while p is not None and not frames:
                frames = [f for f in (p.stack or []) if "lragent" in f or "kernels" in f or "lit_modules" in f]
                p = p.cpu_parent
            rows.append({"gap_us": gap, "after": prev.name[:60], "before": nxt.name[:60], "frames": frames[:4]})
        total_gap = sum(x[0] for x in gaps)
        result["passes"][name] = {"span_us": span, "busy_us": busy, "idle_us": total_gap, "top_gaps": rows,
                                  "n_gaps_over_20us": sum(1 for x in gaps if x[0] > 20)}  # fmt: skip
        print(f"== {name}: span {span / 1e3:.2f} ms, kernels {busy / 1e3:.2f} ms, idle {total_gap / 1e3:.2f} ms, "
              f"{result['passes'][name]['n_gaps_over_20us']} gaps > 20 us")  # fmt: skip
        for r in rows[:12]:
            print(f"  {r['gap_us']:8.0f} us  before {r['before']}  <- {r['frames'][:2]}")
    result["provenance"] = provenance(dtype="bfloat16", device="cuda")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
