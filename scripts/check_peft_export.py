"""Do the PEFT directories that ``export`` wrote load back into transformers + peft with the trained logits?

For every role: logits of the checkpoint's :class:`MultiLoraModule` (the base rebuilt from its ``model_name`` and
seed, as training does) against ``PeftModel.from_pretrained(base, EXPORT/<role>)`` on the same random tokens, in
float32. Passes when every role's PEFT logits equal lragent's for that role (max |Δ| ≤ ``--rtol`` × max |logit|),
and, where the roles' own logits differ, lie far closer to their own role than to any other (so the check can see
a wrong adapter). Writes ``--out`` (JSON) and exits 1 on a failure.

    python scripts/check_peft_export.py --ckpt RUN/checkpoints/last.ckpt --export DIR --out check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint written by fit")
    parser.add_argument("--export", required=True, help="directory written by export (one PEFT directory per role)")
    parser.add_argument("--out", required=True, help="JSON result")
    parser.add_argument("--tokens", type=int, default=48, help="random tokens per role")
    parser.add_argument("--rtol", type=float, default=1e-4, help="max |Δ| allowed, relative to max |logit|")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from peft import PeftModel

    from lit_modules.multi_lora_module import MultiLoraModule
    from lragent.models import load_model

    dev = torch.device(args.device)
    with dev:  # the base is built where it runs, in float32
        module = MultiLoraModule.load_from_checkpoint(args.ckpt, map_location=dev, model_dtype="float32")
    module.eval()
    hp = module.hparams
    roles = list(module.roles)
    vocab = module.lora_model.model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        ours = {r: module(ids, torch.tensor([i], device=dev))[0].float().cpu() for i, r in enumerate(roles)}
    del module
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    base, _ = load_model(
        hp.model_name, dtype=torch.float32, device=dev, overrides=hp.model_overrides, seed=hp.model_seed
    )
    theirs = {}
    for role in roles:
        peft_model = PeftModel.from_pretrained(base, str(Path(args.export) / role)).eval()
        with torch.no_grad():
            theirs[role] = peft_model(input_ids=ids).logits[0].float().cpu()
        base = peft_model.unload()
    rows, ok = [], True
    for role in roles:
        scale = ours[role].abs().max().item()
        same = (theirs[role] - ours[role]).abs().max().item()
        others = [(theirs[role] - ours[o]).abs().max().item() for o in roles if o != role]
        closest_other = min(others) if others else None
        good = same <= args.rtol * scale and (closest_other is None or closest_other == 0 or same < closest_other / 10)
        ok &= good
        rows.append(
            {"role": role, "max_abs_logit": scale, "max_diff_same_role": same, "min_diff_other_roles": closest_other,
             "top1_agreement": (theirs[role].argmax(-1) == ours[role].argmax(-1)).float().mean().item(), "ok": good}
        )  # fmt: skip
        print(json.dumps(rows[-1]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ckpt": args.ckpt, "export": args.export, "ok": ok, "roles": rows}, indent=1))
    print("PEFT export check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
