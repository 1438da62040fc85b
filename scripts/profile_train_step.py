"""Where a training step's time goes: the plain pass against the shared pass (λ term), forward + backward, per CUDA
kernel (torch profiler). Random weights with a named architecture's shapes (a few layers: the per-layer mix is
what matters), bf16 autocast over a bf16 base with float32 adapters, as ``bench train`` runs them.

    python scripts/profile_train_step.py --model llama-3.1-8b --layers 4 --batch 4 --seq 2048 --out prof.json

Prints per pass the step time and the top kernels; writes them as JSON with provenance.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from lragent.lora_model import MultiLoraModel
from lragent.models import load_model
from lragent.multi_lora import MultiLoraConfig
from lragent.provenance import provenance


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--scored", type=int, default=256, help="supervised positions per sequence (at the end)")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, the passes taking turns")
    ap.add_argument("--out", default="prof_train_step.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hf, _ = load_model(args.model, dtype=torch.bfloat16, device=dev, overrides={"num_hidden_layers": args.layers})
    lm = MultiLoraModel(hf, MultiLoraConfig(roles=("plan", "action", "reflect"), rank=8, alpha=16.0, dropout=0.05))
    for p in lm.lora_parameters():
        p.data = p.data.float()
    lm.init_adapters("random", seed=0)
    lm.decoder.gradient_checkpointing = args.checkpointing
    lm.model.train()
    b, t = args.batch, args.seq
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (b, t), generator=g).to(dev)
    roles = torch.tensor([i % 3 for i in range(b)], device=dev)
    producers = (roles + 1) % 3
    split = torch.full((b,), t - args.scored - 1)  # on the host, as the training step passes it (no sync)
    index = (torch.arange(b, device=dev)[:, None] * t + torch.arange(t - args.scored, t, device=dev)).flatten()
    targets = torch.randint(0, hf.config.vocab_size, (index.numel(),), generator=g).to(dev)

    def plain():
        return [lm(ids, roles, None, output_index=index)]

    def shared(scheme: str = "base_lr_shared"):
        return [lm.shared_sequence_forward(ids, split, producers, roles, scheme, index)]

    passes = {  # each returns the logits of its terms; the loss is their mean cross-entropy (λ 0.5 for two)
        "plain": plain,
        "shared_base_lr": shared,
        "shared_full": lambda: shared("full_shared"),
        "weighted_lambda_0.5": lambda: plain() + shared(),  # the λ 0.5 step: both passes, one backward
    }
    result: dict = {"args": vars(args), "passes": {}}

    def make_step(fwd):
        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                terms = fwd()
            sum(torch.nn.functional.cross_entropy(t.float(), targets) for t in terms).div(len(terms)).backward()
            for p in lm.lora_parameters():
                p.grad = None

        return step

    steps = {name: make_step(fwd) for name, fwd in passes.items()}
    for step in steps.values():
        for _ in range(2):
            step()
    timings: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):  # the passes take turns: a drifting clock moves them alike
        for name, step in steps.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            timings[name].append((time.perf_counter() - t0) / 5 * 1e3)
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels: Counter = Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name[:90]] += ev.device_time_total / 1e3  # ms
        total = sum(kernels.values())
        ms = sum(timings[name]) / len(timings[name])
        result["passes"][name] = {
            "ms_per_step": ms,
            "round_ms_per_step": timings[name],
            "kernel_ms": total,
            "top": [[k, v] for k, v in kernels.most_common(25)],
        }
        rounds = ", ".join(f"{x:.2f}" for x in timings[name])
        print(f"== {name}: {ms:.2f} ms/step (rounds {rounds}; kernels {total:.2f} ms)")
        for k, v in kernels.most_common(18):
            print(f"  {v:8.3f}  {k}")
    result["provenance"] = provenance(dtype="bfloat16", device="cuda")
    open(args.out, "w").write(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
