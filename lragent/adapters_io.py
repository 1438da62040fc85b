"""Adapter interchange: one standard PEFT LoRA directory per role, and one native checkpoint for the whole set.

PEFT directories hold ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's key names
(``base_model.model.<module path>.lora_A.weight``); with shared A every role's directory carries the same A. They
load with ``peft.PeftModel.from_pretrained`` and therefore in serving engines that read PEFT adapters.

The native checkpoint (``lragent_adapters.safetensors``) keeps A once and every role's B, with the
:class:`~lragent.multi_lora.MultiLoraConfig` as JSON metadata.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lragent.command import first_line
from lragent.lora_model import MultiLoraModel
from lragent.multi_lora import MultiLoraConfig

NATIVE_FILE = "lragent_adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"


def export_peft(
    model: MultiLoraModel,
    out_dir: str | Path,
    base_model_name: str = "",
    meta: dict | None = None,
    dtype: torch.dtype | None = None,
) -> dict:
    """Writes ``out_dir/<role>/`` (PEFT LoRA) for every role and ``out_dir/lragent_adapters.safetensors``.

    Args:
        model: the multi-LoRA model.
        out_dir: target directory (created).
        base_model_name: recorded as ``base_model_name_or_path``.
        meta: extra JSON-serialisable information stored with the native checkpoint (e.g. the training config).
        dtype: dtype of the stored tensors (e.g. ``torch.bfloat16`` to halve the size); ``None``: the model's.
            Loading casts them back to the model's dtype.

    Returns:
        ``{role: path}`` of the PEFT directories.
    """
    from peft import LoraConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.lora_config
    paths = {}
    for rid, role in enumerate(cfg.roles):
        role_dir = out / role
        role_dir.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, module in model.lora_modules().items():
            a = module.lora_A[0 if cfg.shared_a else rid]
            tensors[f"base_model.model.{name}.lora_A.weight"] = _stored(a, dtype)
            tensors[f"base_model.model.{name}.lora_B.weight"] = _stored(module.lora_B[rid], dtype)
        save_file(tensors, str(role_dir / PEFT_WEIGHTS), metadata={"format": "pt"})
        LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=sorted(cfg.targets),
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_name or None,
        ).save_pretrained(str(role_dir))
        paths[role] = role_dir
    save_native(model, out / NATIVE_FILE, meta=meta, dtype=dtype)
    return paths


def _stored(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A detached, contiguous CPU copy of ``t`` in ``dtype`` (default: its own)."""
    return t.detach().to("cpu", dtype=dtype or t.dtype).contiguous().clone()


def save_native(
    model: MultiLoraModel, path: str | Path, meta: dict | None = None, dtype: torch.dtype | None = None
) -> None:
    """One safetensors file with A (once if shared) and every role's B (in ``dtype``, default the model's), plus
    the adapter config as metadata."""
    tensors = {}
    for name, module in model.lora_modules().items():
        for i, a in enumerate(module.lora_A):
            tensors[f"{name}.lora_A.{i}"] = _stored(a, dtype)
        for i, b in enumerate(module.lora_B):
            tensors[f"{name}.lora_B.{i}"] = _stored(b, dtype)
    metadata = {"lragent_config": json.dumps(model.lora_config.to_dict()), "meta": json.dumps(meta or {})}
    save_file(tensors, str(path), metadata=metadata)


@contextmanager
def _readable(path: str | Path) -> Iterator[None]:
    """Turns the errors of reading a damaged weights file (truncated, not safetensors, no lragent metadata) into one
    ``ValueError`` naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable adapter weights file ({first_line(exc)})") from None


def read_peft_config(path: str | Path) -> dict:
    """A PEFT ``adapter_config.json``, checked: a JSON mapping with a positive integer ``r``, a positive
    ``lora_alpha`` and a non-empty list of ``target_modules``.

    Raises:
        ValueError: one line naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        pc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable PEFT adapter config ({first_line(exc)})") from None
    if not isinstance(pc, dict):
        raise ValueError(f"{path} is not a PEFT adapter config: a JSON mapping is needed, got {type(pc).__name__}")
    r, alpha, targets = pc.get("r"), pc.get("lora_alpha"), pc.get("target_modules")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{path}: target_modules must be a non-empty list of module names, got {targets!r}")
    return pc


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """``dst.copy_(src)`` that refuses a shape mismatch with one line (a config that disagrees with its tensors)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)


def read_native_config(path: str | Path) -> MultiLoraConfig:
    """The adapter config stored in a native checkpoint.

    Raises:
        ValueError: the file is damaged or not a native lragent checkpoint.
    """
    with _readable(path), safe_open(str(path), "pt") as f:
        return MultiLoraConfig.from_dict(json.loads((f.metadata() or {})["lragent_config"]))


@torch.no_grad()
def load_native(model: MultiLoraModel, path: str | Path) -> None:
    """Loads a native checkpoint into ``model``; the layouts must match."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"adapter checkpoint {path} does not exist")
    stored = read_native_config(path)
    mine = model.lora_config
    for field_name in ("roles", "rank", "targets", "shared_a"):
        if getattr(stored, field_name) != getattr(mine, field_name):
            raise ValueError(
                f"adapter checkpoint {path} has {field_name}={getattr(stored, field_name)!r}, "
                f"the model has {getattr(mine, field_name)!r}"
            )
    with _readable(path), safe_open(str(path), "pt") as f:
        for name, module in model.lora_modules().items():
            for i, a in enumerate(module.lora_A):
                _copy(a, f.get_tensor(f"{name}.lora_A.{i}"), f"{path}: {name}.lora_A.{i}")
            for i, b in enumerate(module.lora_B):
                _copy(b, f.get_tensor(f"{name}.lora_B.{i}"), f"{path}: {name}.lora_B.{i}")


@torch.no_grad()
def load_peft_role(model: MultiLoraModel, peft_dir: str | Path, role: str) -> None:
    """Loads one PEFT LoRA directory into ``role``'s slot.

    With shared A the directory's A must equal the model's current A unless this is the first role loaded
    (``role`` is the model's first role), which sets it.
    """
    from safetensors.torch import load_file

    peft_dir = Path(peft_dir)
    cfg_path = peft_dir / PEFT_CONFIG
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{peft_dir} is not a PEFT adapter directory (no {PEFT_CONFIG})")
    pc = read_peft_config(cfg_path)
    mine = model.lora_config
    if int(pc["r"]) != mine.rank or float(pc["lora_alpha"]) != float(mine.alpha):
        raise ValueError(
            f"{peft_dir}: r={pc['r']}, lora_alpha={pc['lora_alpha']} differ from the model's r={mine.rank}, "
            f"alpha={mine.alpha}"
        )
    rid = model.router.id(role)
    with _readable(peft_dir / PEFT_WEIGHTS):
        weights = load_file(str(peft_dir / PEFT_WEIGHTS))
    for name, module in model.lora_modules().items():
        a = weights.get(f"base_model.model.{name}.lora_A.weight")
        b = weights.get(f"base_model.model.{name}.lora_B.weight")
        if a is None or b is None:
            raise ValueError(f"{peft_dir} has no adapter for {name}")
        if mine.shared_a:
            if rid == 0:
                _copy(module.lora_A[0], a, f"{peft_dir}: {name} lora_A")
            elif a.shape != module.lora_A[0].shape or not torch.equal(
                module.lora_A[0].detach().cpu(), a.to(module.lora_A[0].dtype)
            ):
                raise ValueError(f"{peft_dir}: lora_A of {name} differs from the shared A; load with shared_a=False")
        else:
            _copy(module.lora_A[rid], a, f"{peft_dir}: {name} lora_A")
        _copy(module.lora_B[rid], b, f"{peft_dir}: {name} lora_B")


def load_adapter_dir(model: MultiLoraModel, adapter_dir: str | Path) -> None:
    """Loads an adapter set: the native checkpoint if present, else one PEFT directory per role."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"adapter directory {d} does not exist")
    if (d / NATIVE_FILE).is_file():
        load_native(model, d / NATIVE_FILE)
        return
    missing = [r for r in model.lora_config.roles if not (d / r / PEFT_CONFIG).is_file()]
    if missing:
        raise FileNotFoundError(f"adapter directory {d} has no {NATIVE_FILE} and no PEFT directory for {missing}")
    for role in model.lora_config.roles:
        load_peft_role(model, d / role, role)


def adapter_config_of(adapter_dir: str | Path, roles: Sequence[str] = ()) -> MultiLoraConfig:
    """The adapter layout stored in an adapter directory (native checkpoint, else the PEFT configs), checked
    without building a model: the native checkpoint's header, or every PEFT role's config and weights (readable,
    rank as configured). Cheap next to loading a model, so commands call it before they load one.

    Args:
        adapter_dir: a directory written by ``export`` (or by PEFT, one directory per role).
        roles: roles the caller needs (e.g. the agents' plan, action, reflect); each must be in the set.

    Raises:
        FileNotFoundError: the directory, or any adapter in it, is missing (naming the missing roles).
        ValueError: a damaged or inconsistent file (one line naming it).
    """
    d = Path(adapter_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"adapter directory {d} does not exist")
    if (d / NATIVE_FILE).is_file():
        cfg = read_native_config(d / NATIVE_FILE)
        missing = [r for r in roles if r not in cfg.roles]
        if missing:
            raise FileNotFoundError(f"adapter checkpoint {d / NATIVE_FILE} has no adapter for roles {missing}")
        return cfg
    found = sorted(p.parent.name for p in d.glob(f"*/{PEFT_CONFIG}"))
    if not found:
        raise FileNotFoundError(f"adapter directory {d} has neither {NATIVE_FILE} nor PEFT role directories")
    missing = [r for r in roles if r not in found]
    if missing:
        raise FileNotFoundError(f"adapter directory {d} has no {NATIVE_FILE} and no PEFT directory for {missing}")
    from safetensors.torch import load_file

    configs = {r: read_peft_config(d / r / PEFT_CONFIG) for r in found}
    pc = configs[found[0]]
    for r, other in configs.items():
        if (other["r"], other["lora_alpha"], sorted(other["target_modules"])) != (
            pc["r"], pc["lora_alpha"], sorted(pc["target_modules"])
        ):  # fmt: skip
            raise ValueError(f"{d / r / PEFT_CONFIG}: r, lora_alpha or target_modules differ from {found[0]}'s")
    known = [r for r in ("plan", "action", "reflect") if r in found]
    order = known + [r for r in found if r not in known]
    a_sets = []
    for r in order:
        weights_path = d / r / PEFT_WEIGHTS
        if not weights_path.is_file():
            raise FileNotFoundError(f"PEFT adapter directory {d / r} has no {PEFT_WEIGHTS}")
        with _readable(weights_path):
            weights = load_file(str(weights_path))
        for key, t in weights.items():
            rank_dim = 0 if ".lora_A." in key else 1 if ".lora_B." in key else None
            if rank_dim is not None and (t.dim() != 2 or t.shape[rank_dim] != pc["r"]):
                raise ValueError(f"{weights_path}: {key} has shape {tuple(t.shape)}, not rank r={pc['r']}")
        a_sets.append({k: v for k, v in weights.items() if ".lora_A." in k})
    # Shared A exactly when every role directory carries the same A tensors.
    shared = all(a.keys() == a_sets[0].keys() and all(torch.equal(a[k], a_sets[0][k]) for k in a) for a in a_sets)
    return MultiLoraConfig(
        roles=tuple(order),
        rank=int(pc["r"]),
        alpha=float(pc["lora_alpha"]),
        dropout=float(pc.get("lora_dropout", 0)),
        targets=tuple(sorted(pc["target_modules"])),
        shared_a=shared,
    )
