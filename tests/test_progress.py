"""Progress bars count to what the run does: the training bar's total is the batches each epoch runs (max_steps,
limit_train_batches, accumulation), the validation bar's the batches each validation runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Callback

from lit_modules.cli import LRAgentCLI
from lit_modules.progress import RunProgressBar, batches_this_epoch
from tests.test_training import REPO, tiny_data, tiny_module, tiny_trainer


class BarTotals(Callback):
    """Per epoch: the training bar's total and the batches run; per validation: the bar's total and batches run."""

    def __init__(self, bar: RunProgressBar) -> None:
        self.bar = bar
        self.train: list[list[int]] = []  # [total, batches run] per epoch
        self.val: list[list[int]] = []  # [total, batches run] per validation

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.train.append([self.bar.train_progress_bar.total, 0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train[-1][1] += 1

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.val.append([None, 0])

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.val[-1] = [self.bar.val_progress_bar.total, self.val[-1][1] + 1]


@pytest.mark.parametrize(
    "trainer_args",
    [
        {"max_steps": 5, "max_epochs": 1},  # stops inside the first epoch (the smoke run's case)
        {"max_steps": 3, "max_epochs": 1, "accumulate_grad_batches": 2},  # 3 steps x 2 batches
        {"max_steps": 4, "max_epochs": 3, "accumulate_grad_batches": 5},  # 12 batches = 3 steps, then 1 step = 5
        {"max_steps": 14, "max_epochs": 3},  # a whole epoch, then 2 batches
        {"max_epochs": 2, "limit_train_batches": 4},  # no max_steps
        {"max_steps": 5, "max_epochs": 2, "limit_train_batches": 5, "accumulate_grad_batches": 2},  # 5 + 4
        {"max_steps": 6, "max_epochs": 1, "val_check_interval": 2, "limit_val_batches": 2},
    ],
    ids=["max_steps", "accumulate", "accumulate-ragged", "two-epochs", "limit_train", "all-three", "validation"],
)
def test_bar_totals_equal_the_batches_run(tmp_path: Path, trainer_args: dict) -> None:
    bar = RunProgressBar(refresh_rate=1)
    totals = BarTotals(bar)
    dm = tiny_data(tmp_path, n=16, val_fraction=0.25 if "val_check_interval" in trainer_args else 0.0)
    args = {"limit_val_batches": 0, **trainer_args}
    trainer = tiny_trainer(tmp_path, enable_progress_bar=True, callbacks=[bar, totals], **args)
    trainer.fit(tiny_module(), dm)
    assert totals.train and all(total == run for total, run in totals.train), totals.train
    if "max_steps" in trainer_args:
        assert trainer.global_step == trainer_args["max_steps"]
    if "val_check_interval" in trainer_args:
        assert len(totals.val) == 3 and all(total == run == 2 for total, run in totals.val), totals.val


@pytest.mark.parametrize(
    ("epoch", "max_steps", "step", "acc", "expected"),
    [
        (595, 30, 0, 1, 30),  # the smoke run, whose bar showed 595 before
        (595, 30, 0, 4, 120),
        (595, -1, 0, 1, 595),
        (595, None, 0, 1, 595),
        (10, 100, 98, 3, 6),
        (float("inf"), 8, 0, 2, 16),
        (float("inf"), -1, 0, 2, float("inf")),
        (595, 0, 0, 1, 0),  # max_steps=0: no step, so no batch (only negative values mean no limit)
        (595, 0, 0, 4, 0),
        (10, 5, 7, 2, 0),  # resumed past max_steps: nothing left, not a negative or one-step total
        (10, 5, 5, 3, 0),
    ],
)
def test_batches_this_epoch(epoch, max_steps, step, acc, expected) -> None:
    assert batches_this_epoch(epoch, max_steps, step, acc) == expected


def test_the_cli_adds_the_run_progress_bar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The smoke config names it; a config that names no progress bar gets it from the CLI."""
    monkeypatch.chdir(REPO)
    base = ["--config", "configs/smoke.yaml", "--trainer.default_root_dir", str(tmp_path)]
    cli = LRAgentCLI(run=False, args=base)
    assert type(cli.trainer.progress_bar_callback) is RunProgressBar
    cli = LRAgentCLI(run=False, args=[*base, "--trainer.callbacks", "[]"])
    assert type(cli.trainer.progress_bar_callback) is RunProgressBar
    cli = LRAgentCLI(run=False, args=[*base, "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]"])
    assert cli.trainer.progress_bar_callback is None
