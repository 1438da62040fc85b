"""A wall-clock budget for ``fit`` that ends runs at epoch boundaries, so that ``--ckpt_path last`` resumes cleanly.

Lightning's ``max_time`` stops in the middle of an epoch; a run resumed from such a checkpoint restarts the epoch's
data from the beginning (Lightning warns that this is unreliable). :class:`TimeBudget` instead stops at the end of
an epoch when the next epoch (timed like the last one, validation included) would not finish before the deadline.
As a last resort, it raises :class:`TimeBudgetExceeded` when the deadline itself passes mid-epoch: the partial
epoch is then dropped, and the last checkpoint (the end of the previous epoch) is what a resumed run continues
from.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info


class TimeBudgetExceeded(RuntimeError):
    """The hard deadline passed in the middle of an epoch."""


class TimeBudget(Callback):
    """Stops ``fit`` at the last epoch end that leaves room for the next epoch before the deadline.

    Args:
        deadline: absolute end (Unix time, seconds); ``None``: ``seconds`` after this callback is created.
        seconds: budget from creation (about the process start); ignored when ``deadline`` is given. Neither:
            no budget.
        safety: the next epoch is assumed to take ``safety`` times as long as the last one.
    """

    clock = staticmethod(time.time)
    """Time source (tests replace it)."""

    def __init__(self, deadline: float | None = None, seconds: float | None = None, safety: float = 1.2) -> None:
        if seconds is not None and seconds <= 0:
            raise ValueError(f"seconds must be > 0 or null, got {seconds}")
        if safety < 1:
            raise ValueError(f"safety must be >= 1, got {safety}")
        self.deadline = deadline if deadline is not None else (self.clock() + seconds if seconds else None)
        self.safety = safety
        self.stopped = False
        """True when this callback ended the fit (at an epoch end or, hard, mid-epoch)."""
        self._epoch_start: float | None = None
        self.last_epoch_s: float | None = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = self.clock()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.deadline is not None and self.clock() > self.deadline:
            self.stopped = True
            raise TimeBudgetExceeded(
                f"time budget exceeded mid-epoch {trainer.current_epoch} (step {trainer.global_step}); the partial "
                "epoch is dropped, resume with --ckpt_path last"
            )

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation of this epoch has run (val_check_interval 1.0): the duration covers training + validation.
        now = self.clock()
        if self._epoch_start is not None:
            self.last_epoch_s = now - self._epoch_start
        if self.deadline is None or self.last_epoch_s is None or trainer.should_stop:
            return
        if now + self.safety * self.last_epoch_s > self.deadline:
            self.stopped = True
            trainer.should_stop = True
            rank_zero_info(
                f"time budget: stopping after epoch {trainer.current_epoch} ({self.last_epoch_s:.0f} s per epoch, "
                f"{self.deadline - now:.0f} s left); resume with --ckpt_path last"
            )
