"""A record of every ``fit`` call of a run: why it ended, how far it got, how long it took, how fast it trained.

:class:`RunStatus` appends one JSON line per ``fit`` call to a file (``fit_status.jsonl`` in the sweep's run
directories): the stop reason (``early_stopping``, ``max_epochs``, ``max_steps``, ``time_budget``, ``interrupted``
(Ctrl-C or SIGTERM), ``error``), epochs and optimizer steps done, wall and training seconds, real tokens trained
and tokens per second, the best checkpoint with its score, the device and (on CUDA) the peak memory allocated.
Tokens are counted from the batches' host-side ``n_tokens`` (no device sync).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.utilities import rank_zero_only

from lit_modules.export import best_checkpoint
from lit_modules.time_budget import TimeBudget

STOP_REASONS: tuple[str, ...] = (
    "early_stopping", "max_epochs", "max_steps", "time_budget", "interrupted", "error", "other",
)  # fmt: skip
"""Values of a record's ``reason``; ``early_stopping``, ``max_epochs`` and ``max_steps`` mean the run is finished."""
FINISHED_REASONS: tuple[str, ...] = ("early_stopping", "max_epochs", "max_steps")


def _device_name(device: torch.device) -> str:
    """``NVIDIA H200`` / ``cpu``: what trained."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


class RunStatus(Callback):
    """Appends one JSON line per ``fit`` call to ``path`` (on rank 0).

    Args:
        path: the JSON lines file; ``None``: ``<default_root_dir>/fit_status.jsonl``.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._t0 = time.time()
        self._train_s = 0.0
        self._epoch_t0: float | None = None
        self._tokens = 0
        self._examples = 0
        self._start_epoch = 0
        self._device: torch.device | None = None
        self._start_step = 0

    def _file(self, trainer: Trainer) -> Path:
        return Path(self.path) if self.path else Path(trainer.default_root_dir) / "fit_status.jsonl"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_epoch, self._start_step = trainer.current_epoch, trainer.global_step
        # recorded here: by on_fit_end Lightning has moved the module back to the CPU
        self._device = pl_module.device

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_t0 = time.time()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._epoch_t0 is not None:
            self._train_s += time.time() - self._epoch_t0
            self._epoch_t0 = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(batch, dict):
            self._tokens += int(batch.get("n_tokens", 0))
            self._examples += int(batch.get("n_examples", 0))

    def _reason(self, trainer: Trainer) -> str:
        if any(isinstance(cb, TimeBudget) and cb.stopped for cb in trainer.callbacks):
            return "time_budget"
        if any(isinstance(cb, EarlyStopping) and cb.stopped_epoch > 0 for cb in trainer.callbacks):
            return "early_stopping"
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            return "max_steps"
        if trainer.max_epochs is not None and trainer.max_epochs >= 0 and trainer.current_epoch >= trainer.max_epochs:
            return "max_epochs"
        return "other"

    def _write(self, trainer: Trainer, pl_module: LightningModule, reason: str, error: str | None = None) -> None:
        if self._epoch_t0 is not None:  # an epoch cut short by an error
            self._train_s += time.time() - self._epoch_t0
            self._epoch_t0 = None
        best = best_checkpoint(trainer)
        device = self._device or pl_module.device
        score = None
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "best_model_score", None) is not None:
                score = float(cb.best_model_score)
                break
        record = {
            "reason": reason,
            "finished": reason in FINISHED_REASONS,
            "error": error,
            "start_epoch": self._start_epoch,
            "epochs_done": trainer.current_epoch,
            "start_step": self._start_step,
            "global_step": trainer.global_step,
            "wall_s": round(time.time() - self._t0, 2),
            "train_s": round(self._train_s, 2),
            "train_tokens": self._tokens,
            "train_examples": self._examples,
            "tokens_per_s": round(self._tokens / self._train_s, 1) if self._train_s > 0 else None,
            "best_checkpoint": best,
            "best_score": score,
            "device": _device_name(device),
            "max_memory_gb": (
                round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None
            ),
            "utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        path = self._file(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write(trainer, pl_module, self._reason(trainer))

    @rank_zero_only
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        stopped = any(isinstance(cb, TimeBudget) and cb.stopped for cb in trainer.callbacks)
        interrupted = isinstance(exception, KeyboardInterrupt) or type(exception).__name__ == "SIGTERMException"
        reason = "time_budget" if stopped else ("interrupted" if interrupted else "error")
        self._write(trainer, pl_module, reason, f"{type(exception).__name__}: {exception}")
