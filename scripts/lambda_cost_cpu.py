"""Step time of the λ = 0.5 loss over the λ = 0 loss on the CPU (forward + backward, the same batches, interleaved).

Runs against whichever checkout is on ``PYTHONPATH`` (to compare a change with the code before it)::

    PYTHONPATH=. python scripts/lambda_cost_cpu.py --layers 6 --seq_len 512 --batch_size 1 --rounds 3

Prints one JSON line: median seconds per step at each λ and their ratio, and the FLOPs of the same steps as
``torch.utils.flop_counter`` counts them (matmuls and attention, forward and backward), which machine load cannot
change. The 135M shapes with the byte tokenizer
(49K-row LM head, as the embedded model) and random weights; fp32; dropout 0.05 as in the configs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="data/trajectories/hotpotqa")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from datamodules.role_examples import RoleExampleDataModule
    from lit_modules.multi_lora_module import MultiLoraModule

    roles = ["plan", "action", "reflect"]
    dm = RoleExampleDataModule(
        {r: f"{args.data}/{r}.jsonl.gz" for r in roles}, roles=roles, tokenizer="byte", max_length=args.seq_len,
        batch_size=args.batch_size, val_fraction=0.0,
    )  # fmt: skip
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(args.rounds + 1)]
    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    m = MultiLoraModule(
        model_name=args.model,
        model_overrides=overrides,
        tokenizer_name="byte",
        roles=roles,
        dropout=0.05,
        val_schemes=[],
    )
    m.configure_model()
    m.train()
    times: dict[float, list[float]] = {0.0: [], 0.5: []}
    for i, batch in enumerate(batches):
        for lam in (0.0, 0.5):
            m.train_config.lambda_shared = lam
            t0 = time.perf_counter()
            m.compute_loss(batch, seed=i)["loss"].backward()
            if i > 0:  # the first batch warms up
                times[lam].append(time.perf_counter() - t0)
            for p in m.lora_model.lora_parameters():
                p.grad = None
    med = {lam: statistics.median(v) for lam, v in times.items()}
    # the same steps' operation counts (matmuls and attention, forward and backward): what the load cannot change
    from torch.utils.flop_counter import FlopCounterMode

    flops = {}
    for lam in (0.0, 0.5):
        m.train_config.lambda_shared = lam
        with FlopCounterMode(display=False) as counter:
            for i, batch in enumerate(batches[1:], start=1):
                m.compute_loss(batch, seed=i)["loss"].backward()
        flops[lam] = counter.get_total_flops()
        for p in m.lora_model.lora_parameters():
            p.grad = None
    print(
        json.dumps(
            {
                "model": args.model,
                "layers": args.layers,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "tokens_per_batch": [int(b["lengths"].sum()) for b in batches[1:]],
                "seconds_lambda0": med[0.0],
                "seconds_lambda0.5": med[0.5],
                "ratio": med[0.5] / med[0.0],
                "flops_lambda0": flops[0.0],
                "flops_lambda0.5": flops[0.5],
                "flop_ratio": flops[0.5] / flops[0.0],
                "all": {str(k): v for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
