"""On this device: does the one-pass λ term (a role per token) equal the two-pass form, with gradients?

A tiny random LLaMA and real HotpotQA role examples (byte tokens): the λ = 1 loss of ``MultiLoraModule`` (one pass,
LM head at the supervised positions) against ``token_loss`` over the two-pass form's target logits, per scheme, in
float32 and under bf16 autocast; then one backward (every adapter gets a gradient). Prints JSON lines, writes
``--out``, exits 1 on a mismatch.

    python scripts/check_shared_pass.py --out shared_pass.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from datamodules.role_examples import RoleExampleDataModule, collate_examples
    from lit_modules.multi_lora_module import MultiLoraModule, split_for_sharing, token_loss

    dev = torch.device(args.device)
    roles = ["plan", "action", "reflect"]
    dm = RoleExampleDataModule(
        {r: f"data/trajectories/hotpotqa/{r}.jsonl.gz" for r in roles}, roles=roles, tokenizer="byte",
        max_length=768, batch_size=4, val_fraction=0.0,
    )  # fmt: skip
    dm.setup("fit")
    rows, ok = [], True
    for scheme in ("base_lr_shared", "full_shared"):
        m = MultiLoraModule(
            model_name="tiny-llama", tokenizer_name="byte", model_overrides={"vocab_size": 258}, dropout=0.0,
            lambda_shared=1.0, shared_scheme=scheme, producer="next",
        )  # fmt: skip
        with dev:
            m.configure_model()
        m.lora_model.init_adapters("random", seed=1, b_std=0.3)
        m.to(dev)
        picks = [i for i in range(0, len(dm.train_set), max(1, len(dm.train_set) // 4))][:4]
        batch = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in collate_examples(
            [dm.train_set[i] for i in picks], pad_id=dm.pad_id).items()}  # fmt: skip
        producers = m.draw_producers(batch["role_ids"], seed=0)
        for autocast in (False, True):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                parts = split_for_sharing(batch, m.shared_split(batch), m.pad_id)
                with torch.no_grad():
                    two = m.lora_model.shared_context_forward(
                        parts["context_ids"], parts["context_mask"], parts["target_ids"], parts["target_mask"],
                        producers, batch["role_ids"], scheme=scheme,
                    )  # fmt: skip
                    ref, _ = token_loss(two, parts["target_labels"])
                loss = m.compute_loss(batch, seed=0)["loss"]
            for p in m.lora_model.lora_parameters():
                p.grad = None
            loss.backward()
            grads = all(
                p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in m.lora_model.lora_parameters()
            )
            diff = abs(loss.item() - ref.item())
            tol = 2e-2 if autocast else 1e-4
            good = diff <= tol and grads
            ok &= good
            rows.append({"scheme": scheme, "bf16_autocast": autocast, "one_pass": loss.item(), "two_pass": ref.item(),
                         "abs_diff": diff, "tol": tol, "grads": grads, "ok": good})  # fmt: skip
            print(json.dumps(rows[-1]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": str(dev), "ok": ok, "rows": rows}, indent=1))
    print("shared-pass check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
