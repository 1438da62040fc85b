"""What every command loads, in one place: the base model with its role adapters, and a DroidSpeak layer config.

Commands check their arguments with :func:`check_model_args` before anything expensive (it reads the adapter set's
headers and configs, not the model), then call :func:`load_lora_model`. Errors are ``ValueError`` /
``FileNotFoundError`` with one line naming the bad value, which the command machinery prints as ``error: ...``
(exit status 2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lragent.adapters_io import adapter_config_of, load_adapter_dir
from lragent.lora_model import MultiLoraModel
from lragent.models import NAMED_ARCHITECTURES, check_device, load_model, parse_dtype
from lragent.multi_lora import MultiLoraConfig

ADAPTER_INITS: tuple[str, ...] = ("zero", "random")


def resolve_device(device: str | None) -> str:
    """``device``, checked (:func:`~lragent.models.check_device`); ``None`` is CUDA when there is one, else CPU."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device)
    return device


def check_model_args(
    *,
    model: str = "default",
    adapters: str | None = None,
    adapter_init: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    dtype: str = "float32",
    device: str | None = None,
    roles: Sequence[str] = (),
    exactly_one: bool = False,
    needs_text: bool = False,
) -> MultiLoraConfig | None:
    """Checks the model and adapter options without loading the model.

    Args:
        model: ``default``, a named random architecture, a hub name or a local directory.
        adapters: an adapter directory (native checkpoint or PEFT role directories).
        adapter_init: ``zero`` or ``random`` adapters instead of ``adapters``.
        rank: LoRA rank for ``adapter_init``.
        alpha: LoRA alpha for ``adapter_init``.
        dtype: compute dtype name.
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or None (see :func:`resolve_device`).
        roles: roles the command needs; an adapter set without one of them is refused.
        exactly_one: one of ``adapters`` and ``adapter_init`` is required (else at most one).
        needs_text: the command tokenizes text (a random named architecture has no tokenizer).

    Returns:
        the adapter layout stored in ``adapters`` (checked), or None with ``adapter_init``.
    """
    if exactly_one and bool(adapters) == bool(adapter_init):
        raise ValueError("give exactly one of --adapters DIR and --adapter_init {zero,random}")
    if adapters and adapter_init:
        raise ValueError(f"give either --adapters ({adapters!r}) or --adapter_init ({adapter_init!r}), not both")
    if adapter_init is not None and adapter_init not in ADAPTER_INITS:
        raise ValueError(f"--adapter_init {adapter_init!r} not supported: allowed {', '.join(ADAPTER_INITS)}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--rank must be a positive integer, got {rank}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"--alpha must be a positive number, got {alpha}")
    parse_dtype(dtype)
    resolve_device(device)
    if needs_text and model.lower() in NAMED_ARCHITECTURES:
        raise ValueError(f"--model {model!r} has random weights and no tokenizer: this command needs text")
    if not adapters:
        return None
    if not Path(adapters).is_dir():
        raise FileNotFoundError(f"--adapters {adapters!r}: no such directory")
    return adapter_config_of(adapters, roles=roles)


def load_lora_model(
    *,
    model: str = "default",
    adapters: str | None = None,
    adapter_init: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    shared_a: bool = True,
    seed: int = 0,
    dtype: str = "float32",
    device: str | None = None,
    needs_text: bool = True,
) -> tuple[MultiLoraModel, Any]:
    """The base model with role adapters, in eval mode, and its tokenizer.

    Args:
        model: see :func:`check_model_args`.
        adapters: adapter directory to load (its layout decides roles, rank, targets, shared A).
        adapter_init: ``zero`` or ``random`` adapters of the default roles instead.
        rank: LoRA rank for ``adapter_init``.
        alpha: LoRA alpha for ``adapter_init``.
        shared_a: one A shared by the roles (LRAgent) for ``adapter_init``; False: one A per role.
        seed: seed of the random adapter init.
        dtype: compute dtype name.
        device: see :func:`resolve_device`.
        needs_text: refuse a model without a tokenizer.

    Returns:
        ``(MultiLoraModel, tokenizer)`` (tokenizer None for a named random architecture when not ``needs_text``).
    """
    if not adapters and not adapter_init:
        raise ValueError("give --adapters DIR or --adapter_init {zero,random}")
    if adapters:
        stored = adapter_config_of(adapters)
        lora_cfg = MultiLoraConfig(stored.roles, stored.rank, stored.alpha, 0.0, stored.targets, stored.shared_a)
    else:
        lora_cfg = MultiLoraConfig(rank=rank, alpha=alpha, dropout=0.0, shared_a=shared_a)
    device = resolve_device(device)
    if device.startswith("cuda:"):  # the process's streams, CUDA graphs and Triton launches then use the model's GPU
        torch.cuda.set_device(torch.device(device))
    hf, tokenizer = load_model(model, dtype=parse_dtype(dtype), device=device)
    if tokenizer is None and needs_text:
        raise ValueError(f"model {model!r} has random weights and no tokenizer: this command needs text")
    lm = MultiLoraModel(hf, lora_cfg)
    if adapters:
        load_adapter_dir(lm, adapters)
    else:
        lm.init_adapters(adapter_init, seed=seed)
    return lm.eval(), tokenizer


def read_droidspeak_config(path: str | Path) -> list[int]:
    """The ``droidspeak_layers`` list of a JSON or YAML config (as ``droidspeak-select`` writes it)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"droidspeak config {path}: no such file")
    import yaml

    text = p.read_text()
    try:
        cfg = yaml.safe_load(text) if p.suffix in (".yaml", ".yml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"droidspeak config {path} is not readable ({' '.join(str(exc).split())[:200]})") from None
    layers = cfg.get("droidspeak_layers") if isinstance(cfg, dict) else None
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise ValueError(f"droidspeak config {path}: expected a non-empty integer list 'droidspeak_layers'")
    return layers
