"""Adapter export: one standard PEFT LoRA directory per role plus lragent's native checkpoint, with the config.

Used at the end of ``fit`` (:class:`ExportAdapters`, which exports the best validation checkpoint's adapters, not
the last weights) and by ``python cli.py export --ckpt ... --out DIR``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

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
    module: LightningModule,
    out_dir: str | Path,
    datamodule_hparams: dict[str, Any] | None = None,
    dtype: str | torch.dtype | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Writes ``out_dir/<role>/`` (PEFT LoRA), ``out_dir/lragent_adapters.safetensors`` and ``train_config.json``.

    Args:
        module: a configured :class:`~lit_modules.multi_lora_module.MultiLoraModule`.
        out_dir: target directory (created).
        datamodule_hparams: the data settings that trained the adapters, stored with the config.
        dtype: dtype of the stored tensors (``bfloat16`` halves the size); ``None``: the module's (float32).
        source: where the weights come from (checkpoint, epoch, step, validation score), stored with the config.

    Returns:
        ``{role: directory}`` of the PEFT adapters.
    """
    from lragent.adapters_io import export_peft
    from lragent.models import parse_dtype

    config = {
        "model": _jsonable(dict(module.hparams)),
        "data": _jsonable(dict(datamodule_hparams or {})),
        "lora_config": module.lora_config.to_dict(),
        "exported_from": _jsonable(source or {}),
        "dtype": None if dtype is None else str(parse_dtype(dtype)).replace("torch.", ""),
    }
    out = Path(out_dir)
    name = module.hparams.model_name
    with torch.no_grad():
        paths = export_peft(
            module.lora_model,
            out,
            base_model_name=name if name else "",
            meta=config,
            dtype=None if dtype is None else parse_dtype(dtype),
        )
    (out / TRAIN_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return paths


def checkpoint_source(ckpt: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """``{"checkpoint", "epoch", "global_step", "monitor", "score"}`` of a loaded Lightning checkpoint."""
    source: dict[str, Any] = {
        "checkpoint": str(path),
        "epoch": ckpt.get("epoch"),
        "global_step": ckpt.get("global_step"),
    }
    for key, state in (ckpt.get("callbacks") or {}).items():
        if str(key).startswith("ModelCheckpoint") and state.get("monitor"):
            source["monitor"] = state["monitor"]
            score = state.get("current_score")
            source["score"] = None if score is None else float(score)
            break
    return source


@contextmanager
def adapters_from_checkpoint(module: LightningModule, ckpt_path: str | Path) -> Iterator[dict[str, Any]]:
    """Puts the adapter weights of a Lightning checkpoint into ``module`` for the ``with`` block, then restores
    the module's own.

    Yields:
        :func:`checkpoint_source` of the checkpoint.

    Raises:
        ValueError: the checkpoint lacks some adapter tensor of the module.
    """
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    stored = ckpt["state_dict"]
    keys = module.adapter_state_keys()
    missing = sorted(keys - set(stored))
    if missing:
        raise ValueError(f"{ckpt_path}: no weights for {len(missing)} adapter tensors, e.g. {missing[0]}")
    params = dict(module.named_parameters())
    own = {k: params[k].detach().clone() for k in keys}
    with torch.no_grad():
        for k in keys:
            params[k].copy_(stored[k])
    try:
        yield checkpoint_source(ckpt, ckpt_path)
    finally:
        with torch.no_grad():
            for k in keys:
                params[k].copy_(own[k])


def best_checkpoint(trainer: Trainer) -> str | None:
    """Path of the best checkpoint of the trainer's first monitoring :class:`ModelCheckpoint`, if it exists."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.monitor and cb.best_model_path:
            if Path(cb.best_model_path).is_file():
                return cb.best_model_path
    return None


class ExportAdapters(Callback):
    """Exports the adapters when ``fit`` ends (on rank 0): those of the best checkpoint by default.

    Under FSDP (:class:`~lit_modules.strategies.LoraFSDPStrategy`) each rank holds a shard of the adapters (and
    Lightning's teardown, before ``on_fit_end``, leaves them so): the export then happens at ``on_train_end``, with
    the adapters' unit gathered on every rank (a collective) and rank 0 writing. The files are those of a one-device
    run.

    Args:
        out_dir: target directory; ``None``: ``<trainer.log_dir>/adapters``.
        best: export the weights of the best checkpoint of the monitoring ``ModelCheckpoint`` (lowest
            ``val/loss``), not the last weights; falls back to the last weights when there is none.
        dtype: dtype of the stored tensors (``bfloat16`` halves the size); ``None``: float32.
    """

    def __init__(self, out_dir: str | None = None, best: bool = True, dtype: str | None = None) -> None:
        if dtype is not None:
            from lragent.models import parse_dtype

            parse_dtype(dtype)
        self.out_dir = out_dir
        self.best = best
        self.dtype = dtype
        self._exported = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exported = False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning.pytorch.strategies import FSDPStrategy

        if not isinstance(trainer.strategy, FSDPStrategy):
            return
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # the root unit holds the adapters (LoraFSDPStrategy); gathered on every rank, never written back
        with FSDP.summon_full_params(trainer.strategy.model, recurse=False, writeback=False):
            if trainer.is_global_zero:
                self._export(trainer, pl_module)
        self._exported = True

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._exported and trainer.is_global_zero:
            self._export(trainer, pl_module)

    def _export(self, trainer: Trainer, pl_module: LightningModule) -> None:
        out = Path(self.out_dir) if self.out_dir else Path(trainer.log_dir or trainer.default_root_dir) / "adapters"
        dm = trainer.datamodule
        hparams = dict(dm.hparams) if dm is not None else None
        best = best_checkpoint(trainer) if self.best else None
        if best is None:
            source = {"checkpoint": None, "epoch": trainer.current_epoch, "global_step": trainer.global_step}
            paths = export_adapters(pl_module, out, hparams, self.dtype, source)
            rank_zero_info(f"adapters (last weights) exported to {out} ({', '.join(paths)})")
            return
        with adapters_from_checkpoint(pl_module, best) as source:
            paths = export_adapters(pl_module, out, hparams, self.dtype, source)
        rank_zero_info(f"adapters of the best checkpoint {best} exported to {out} ({', '.join(paths)})")
