"""Adapter export: one standard PEFT LoRA directory per role plus lragent's native checkpoint, with the config.

Used at the end of ``fit`` (:class:`ExportAdapters`) and by ``python cli.py export --ckpt ... --out DIR``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

TRAIN_CONFIG_FILE = "train_config.json"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return repr(obj)


def export_adapters(
    module: LightningModule, out_dir: str | Path, datamodule_hparams: dict[str, Any] | None = None
) -> dict[str, Path]:
    """Writes ``out_dir/<role>/`` (PEFT LoRA), ``out_dir/lragent_adapters.safetensors`` and ``train_config.json``.

    Args:
        module: a configured :class:`~lit_modules.multi_lora_module.MultiLoraModule`.
        out_dir: target directory (created).
        datamodule_hparams: the data settings that trained the adapters, stored with the config.

    Returns:
        ``{role: directory}`` of the PEFT adapters.
    """
    from lragent.adapters_io import export_peft

    config = {
        "model": _jsonable(dict(module.hparams)),
        "data": _jsonable(dict(datamodule_hparams or {})),
        "lora_config": module.lora_config.to_dict(),
    }
    out = Path(out_dir)
    name = module.hparams.model_name
    with torch.no_grad():
        paths = export_peft(module.lora_model, out, base_model_name=name if name else "", meta=config)
    (out / TRAIN_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return paths


class ExportAdapters(Callback):
    """Exports the adapters when ``fit`` ends (on rank 0).

    Args:
        out_dir: target directory; ``None``: ``<trainer.log_dir>/adapters``.
    """

    def __init__(self, out_dir: str | None = None) -> None:
        self.out_dir = out_dir

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        out = Path(self.out_dir) if self.out_dir else Path(trainer.log_dir or trainer.default_root_dir) / "adapters"
        dm = trainer.datamodule
        paths = export_adapters(pl_module, out, dict(dm.hparams) if dm is not None else None)
        rank_zero_info(f"adapters exported to {out} ({', '.join(paths)})")
