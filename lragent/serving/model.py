"""The served model: the adapter set's roles plus one more, the base model itself (B = 0).

A server lists the role adapters and the base model (``GET /v1/models``), and a request names one of them as its
``model``. The base model is served as one more role whose B is zero (its A, shared or its own, is then multiplied
by zero): its output is the base model's, and under every scheme it shares the trajectories' caches as any role
does. The stored roles keep their ids (``0 .. n-1``) and weights, so a stored role computes exactly what it computes
in a model loaded without the extra role.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lragent.adapters_io import NATIVE_FILE, adapter_config_of, load_peft_role
from lragent.loading import resolve_device
from lragent.lora_model import MultiLoraModel
from lragent.models import EMBEDDED_NAMES, load_model, parse_dtype
from lragent.multi_lora import MultiLoraConfig
from lragent.paths import DATA_DIR


def base_model_name(model: str) -> str:
    """The name the base model is served under: ``SmolLM2-135M-Instruct`` for the embedded default, else the last
    part of ``--model`` (a hub name's or a directory's)."""
    if model.lower() in EMBEDDED_NAMES:
        return "SmolLM2-135M-Instruct"
    return Path(model.rstrip("/")).name or model


def default_serve_adapters(model: str) -> str:
    """The adapters served without ``--adapters``: the model's shipped HotpotQA shared-A set."""
    from lragent.accuracy_model import NAMES as ACCURACY_NAMES

    prefix = "qwen_" if model.lower() in ACCURACY_NAMES else ""
    return str(DATA_DIR / "adapters" / f"{prefix}hotpotqa_sharedA")


@torch.no_grad()
def _copy(dst: torch.nn.Parameter, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def load_served_model(
    *, model: str, adapters: str, dtype: str = "float32", device: str | None = None, base_name: str | None = None
) -> tuple[MultiLoraModel, Any]:
    """The model with the adapter set's roles and a base-model role last, in eval mode, and its tokenizer.

    Args:
        model: ``default``, a registered name, a hub name or a local directory (must have a tokenizer).
        adapters: the adapter directory (native checkpoint, else PEFT role directories).
        dtype: compute dtype name.
        device: ``cpu``, ``cuda``, ``cuda:N`` or None (CUDA when there is one).
        base_name: the base model's role name (default :func:`base_model_name`).

    Returns:
        ``(MultiLoraModel, tokenizer)``.
    """
    stored = adapter_config_of(adapters)
    base_name = base_name or base_model_name(model)
    if base_name in stored.roles:
        raise ValueError(f"--adapters {adapters}: a role is named {base_name!r}, the base model's name; rename it")
    cfg = MultiLoraConfig(
        (*stored.roles, base_name), stored.rank, stored.alpha, 0.0, stored.targets, stored.shared_a
    )  # fmt: skip
    device = resolve_device(device)
    if device.startswith("cuda:"):
        torch.cuda.set_device(torch.device(device))
    hf, tokenizer = load_model(model, dtype=parse_dtype(dtype), device=device)
    if tokenizer is None:
        raise ValueError(f"--model {model!r} has random weights and no tokenizer: a server needs text")
    lm = MultiLoraModel(hf, cfg)
    lm.init_adapters("zero")  # every B zero: the base role stays the base model
    d = Path(adapters)
    if (d / NATIVE_FILE).is_file():
        from safetensors import safe_open

        n_a = 1 if stored.shared_a else len(stored.roles)
        with safe_open(str(d / NATIVE_FILE), "pt") as f:
            for name, module in lm.lora_modules().items():
                for i in range(n_a):
                    _copy(module.lora_A[i], f.get_tensor(f"{name}.lora_A.{i}"), f"{d / NATIVE_FILE}: {name}.lora_A.{i}")
                for i in range(len(stored.roles)):
                    _copy(module.lora_B[i], f.get_tensor(f"{name}.lora_B.{i}"), f"{d / NATIVE_FILE}: {name}.lora_B.{i}")
    else:
        for role in stored.roles:  # the first role sets the shared A
            load_peft_role(lm, d / role, role)
    return lm.eval(), tokenizer
