"""A mixed-precision fit keeps its frozen linear weights in the compute dtype: autocast's own numbers, not its casts.

Under ``bf16-mixed`` (or ``16-mixed``) autocast runs every linear layer in the low dtype and casts a float32 weight to
it at every call: it caches the casts of leaves that require grad only, and the base weights are frozen. The embedded
model's micro-batch re-cast all seven projections of each of its 30 layers at every forward (210 ``_to_copy`` of the
2,009 ops a CPU census counted, 2026-11-28), on a step whose pace is the host's. A frozen weight never changes, so
storing it in the dtype autocast would cast it to gives the same operands, the same products and the same gradients
for the adapters, bit for bit, with half its memory and none of those casts.

What is cast: the weight and bias of every ``nn.Linear`` whose parameters are frozen (the base projections, inside
:class:`~lragent.multi_lora.MultiLoraLinear` too, and an untied LM head). What is not: the adapters (trained, float32),
norms and embeddings (autocast keeps their ops in float32), and a weight an embedding shares (a tied LM head: the
embedding's output would change dtype). When: a fit's ``configure_model`` under a mixed precision with a float32 base,
not under FSDP (its units gather and shard the weights as they are). ``LRAGENT_FROZEN_CAST=0`` keeps float32.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

SWITCH_ENV = "LRAGENT_FROZEN_CAST"

MIXED_DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""Lightning precisions whose autocast casts a linear's weight, and the dtype it casts to."""


def frozen_cast_switch(env: Mapping[str, str] | None = None) -> bool:
    """``LRAGENT_FROZEN_CAST``: 1 (the default, unset or empty too) or 0.

    Raises:
        ValueError: anything else, named with what is allowed.
    """
    raw = (os.environ if env is None else env).get(SWITCH_ENV, "").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"{SWITCH_ENV}={raw!r}: allowed 0 (frozen weights stay float32) or 1 (autocast's dtype)")
    return raw == "1"


def frozen_cast_dtype(
    precision: str, strategy: str, base_dtype: torch.dtype, env: Mapping[str, str] | None = None
) -> torch.dtype | None:
    """The dtype a fit stores its frozen linear weights in, or None to leave them.

    Args:
        precision: the trainer's precision (``bf16-mixed``, ``16-mixed``, ``32-true``, ...).
        strategy: the trainer's strategy class name (an FSDP strategy leaves the weights as they are).
        base_dtype: the dtype the base was loaded in (``model_dtype``); only a float32 base is cast.
        env: the environment (``LRAGENT_FROZEN_CAST``); default this process's.
    """
    dtype = MIXED_DTYPES.get(str(precision))
    if dtype is None or base_dtype != torch.float32 or "fsdp" in strategy.lower():
        return None
    return dtype if frozen_cast_switch(env) else None


def cast_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Stores the weight and bias of every frozen ``nn.Linear`` of ``model`` in ``dtype``, in place (the parameters
    stay the same objects); a weight an ``nn.Embedding`` shares is left as it is.

    Returns:
        How many linear layers were cast.
    """
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    n = 0
    for m in model.modules():
        if not isinstance(m, nn.Linear) or id(m.weight) in shared:
            continue
        params = [p for p in (m.weight, m.bias) if p is not None]
        if any(p.requires_grad for p in params) or m.weight.dtype == dtype:
            continue
        for p in params:
            p.data = p.data.to(dtype)
        n += 1
    return n
