"""Do an export's PEFT role directories load in ``peft`` and compute what lragent computes?

python -m eval_suite.diagnostics.peft_check --export DIR --model llama-3.1-8b --dtype bfloat16 --device cuda \
    [--out check.json]

For every role of the export: the base model (loaded twice: lragent's multi-LoRA model with the export's adapters,
and a plain copy for PEFT), ``peft.PeftModel.from_pretrained`` (then ``load_adapter``) of ``DIR/<role>``, and the
logits of one random token sequence under both. ``ok`` is every role loaded and within tolerance of lragent's logits
(relative to the largest logit: PEFT and lragent add the LoRA term in different orders). Used by
``scripts/gpu_multi.sh`` on FSDP exports; works on any model ``load_model`` knows.

Run it in float32: in a 16-bit dtype rounding can be as large as the adapters' whole effect on the logits (bf16 on an
H100 at LLaMA-3.1-8B shapes: max diff 0.30 against an adapter effect of 0.44; on a 2-layer CPU model the diff equals
the effect, one bf16 step of the logits). ``resolved`` says per role whether the adapters' effect stands at least 10×
above the tolerance, i.e. whether agreement within it shows the adapters, not just the base, were reproduced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lragent.adapters_io import PEFT_CONFIG, adapter_config_of, load_adapter_dir
from lragent.lora_model import MultiLoraModel
from lragent.models import load_model, parse_dtype


def check_export(
    export_dir: str | Path,
    model: str = "default",
    dtype: str = "float32",
    device: str = "cpu",
    tokens: int = 16,
    overrides: dict | None = None,
    rel_tol: float | None = None,
) -> dict[str, Any]:
    """PEFT's logits against lragent's for every role directory of ``export_dir``.

    Args:
        export_dir: an ``export`` / ``ExportAdapters`` directory (``<role>/`` PEFT directories, native file optional).
        model: the base model the adapters were trained on (``load_model`` name; random architectures are seeded).
        dtype: compute dtype of both models.
        device: where both models run.
        tokens: length of the random token sequence ``(1, tokens)``.
        overrides: config overrides of a named random architecture (as ``load_model``).
        rel_tol: allowed max |PEFT − lragent| over max |logit|; default 1e-5 in float32 on the CPU, 1e-4 in float32
            on a GPU (the fused and the separate LoRA GEMMs are different cuBLAS kernels, summing in other orders
            through every layer), 3e-2 in 16-bit dtypes.

    Returns:
        ``{"ok", "rel_tol", "roles": {role: {"loaded", "max_abs_diff", "max_abs_logit", "rel_diff",
        "adapter_effect", "resolved"}}}``; ``adapter_effect`` is max |lragent's logits − the plain base's|: where it
        is near 0 (adapters barely trained) equal logits say little beyond "loads"; ``resolved`` is
        ``adapter_effect / max_abs_logit >= 10 * rel_tol``.
    """
    from peft import PeftModel

    d = Path(export_dir)
    cfg = adapter_config_of(d)
    missing = [r for r in cfg.roles if not (d / r / PEFT_CONFIG).is_file()]
    if missing:
        raise FileNotFoundError(f"{d} has no PEFT directory for role(s) {missing}: not an export directory")
    torch_dtype = parse_dtype(dtype)
    if rel_tol is not None:
        tol = rel_tol
    elif torch_dtype == torch.float32:
        tol = 1e-5 if str(device).startswith("cpu") else 1e-4
    else:
        tol = 3e-2
    hf, _ = load_model(model, dtype=torch_dtype, device=device, overrides=overrides)
    lm = MultiLoraModel(hf, cfg)
    load_adapter_dir(lm, d)
    lm.eval()
    plain, _ = load_model(model, dtype=torch_dtype, device=device, overrides=overrides)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, plain.config.vocab_size, (1, tokens), generator=gen).to(device)
    roles: dict[str, dict[str, Any]] = {}
    peft_model = None
    with torch.no_grad():
        base_logits = plain(ids).logits.float()  # the adapters' effect sets how much the comparison can see
        for role in cfg.roles:
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(plain, str(d / role), adapter_name=role).eval()
            else:
                peft_model.load_adapter(str(d / role), adapter_name=role)
            peft_model.set_adapter(role)
            want = peft_model(ids).logits.float()
            got = lm(ids, [role]).float()
            diff, scale = float((got - want).abs().max()), float(want.abs().max())
            effect = float((got - base_logits).abs().max())
            roles[role] = {"loaded": True, "max_abs_diff": diff, "max_abs_logit": scale, "rel_diff": diff / scale,
                           "adapter_effect": effect, "resolved": effect / scale >= 10 * tol}  # fmt: skip
    return {"ok": all(r["rel_diff"] <= tol for r in roles.values()), "rel_tol": tol, "roles": roles}


def peft_check(
    export: str,
    model: str = "default",
    dtype: str = "float32",
    device: str = "cpu",
    overrides: str | None = None,
    out: str | None = None,
) -> int:
    """Do an export's PEFT role directories load in ``peft`` and compute what lragent computes?

    Args:
        export: the export directory (its <role>/ PEFT directories).
        model: the base model the adapters belong to.
        dtype: the models' dtype.
        device: where both models run.
        overrides: config overrides of a named random architecture (JSON).
        out: write the result as JSON here too.

    Returns:
        0 when every role loads and matches, else 1.
    """
    res = check_export(export, model, dtype, device, overrides=json.loads(overrides) if overrides else None)
    text = json.dumps(res, indent=1)
    if out:
        Path(out).write_text(text + "\n")
    print(text)
    return 0 if res["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m eval_suite.diagnostics.peft_check`` (:func:`peft_check`)."""
    from lragent.command import run_command

    return run_command(peft_check, argv, "python -m eval_suite.diagnostics.peft_check")


if __name__ == "__main__":
    raise SystemExit(main())
