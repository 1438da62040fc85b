"""Progress bars whose totals are what the run will do (Lightning's bars, with the training total corrected).

Lightning's bars count an epoch's training batches to ``trainer.num_training_batches``, the length of the epoch
(after ``limit_train_batches``), and take ``max_steps`` into account only when ``max_epochs`` is -1. A run that
``max_steps`` ends inside its first epoch (the smoke run: 30 steps of a 595-batch epoch) then shows a total and an
estimated time of arrival for the whole epoch. :class:`RunProgressBar` (tqdm) and :class:`RunRichProgressBar`
(rich) count to the batches the epoch will actually run:

    ``min(batches in the epoch, (max_steps - global_step at the epoch's start) x accumulate_grad_batches)``

``global_step`` counts optimizer steps, and an optimizer step takes ``accumulate_grad_batches`` batches (the last,
shorter window of an epoch also steps, so an epoch of N batches takes ``ceil(N / accumulate)`` steps). The unit of
the bar stays the batch, so its rate and ETA are those of the loop. Validation bars count to
``trainer.num_val_batches`` (after ``limit_val_batches``), what Lightning's validation loop runs; those totals are
Lightning's own. ``max_time`` cannot be foreseen and is not reflected, nor is a run resumed inside an epoch
(Lightning calls no epoch-start hook then, and its bar shows no total).

Use it in a config's ``trainer.callbacks`` (``class_path: lit_modules.progress.RunProgressBar``);
:class:`lit_modules.cli.LRAgentCLI` adds one when the config names no progress bar.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


def batches_this_epoch(
    epoch_batches: int | float, max_steps: int | None, global_step: int, accumulate: int
) -> int | float:
    """Training batches an epoch that starts at ``global_step`` will run.

    Args:
        epoch_batches: batches in the epoch (``trainer.num_training_batches``; ``inf`` for an iterable of unknown
            length).
        max_steps: the trainer's ``max_steps`` (-1 or ``None``: no limit).
        global_step: optimizer steps taken before the epoch.
        accumulate: ``accumulate_grad_batches``.

    Returns:
        ``min(epoch_batches, (max_steps - global_step) * accumulate)``; ``epoch_batches`` without ``max_steps``.
    """
    if max_steps is None or max_steps < 0:
        return epoch_batches
    return min(epoch_batches, max(0, max_steps - global_step) * max(1, accumulate))


class _RunTotals:
    """Mixin over a Lightning ``ProgressBar``: :attr:`total_train_batches` from :func:`batches_this_epoch`."""

    @property
    def total_train_batches(self) -> int | float:
        """Training batches this epoch will run (read at its start): ``max_steps`` and accumulation counted."""
        trainer = self.trainer
        return batches_this_epoch(
            trainer.num_training_batches, trainer.max_steps, trainer.global_step, trainer.accumulate_grad_batches
        )


class RunProgressBar(_RunTotals, TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` whose training total is the batches the run will take (module docstring).

    Args: as ``TQDMProgressBar`` (``refresh_rate``, ``process_position``, ``leave``).
    """


class RunRichProgressBar(_RunTotals, RichProgressBar):
    """Lightning's ``RichProgressBar`` whose training total is the batches the run will take (module docstring).

    Args: as ``RichProgressBar``.
    """
