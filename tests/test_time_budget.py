"""The wall-clock budget of ``fit`` (lit_modules/time_budget.py): where the deadline lies, when an epoch end stops
the run (the next epoch, ``safety`` times the last one, would not finish in time), and the hard stop mid-epoch; on
a clock the test sets, through the callback's hooks on a real Trainer and through a tiny real fit."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import SetClock
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lit_modules.time_budget import TimeBudget, TimeBudgetExceeded


@pytest.fixture
def clock(monkeypatch) -> SetClock:
    c = SetClock()
    monkeypatch.setattr(TimeBudget, "clock", c)  # before any TimeBudget exists: __init__ reads it too
    return c


def bare_trainer() -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


def epoch(budget: TimeBudget, trainer: Trainer, clock: SetClock, seconds: float) -> None:
    """One epoch of ``seconds`` through the budget's hooks."""
    budget.on_train_epoch_start(trainer, None)
    clock.now += seconds
    budget.on_train_epoch_end(trainer, None)


def test_the_deadline_is_the_given_one_or_seconds_after_creation(clock: SetClock) -> None:
    assert TimeBudget(seconds=50).deadline == 1050.0
    assert TimeBudget(seconds=0.5).deadline == 1000.5  # any positive budget, under a second too
    assert TimeBudget(deadline=1234.0, seconds=50).deadline == 1234.0  # an absolute deadline wins
    assert TimeBudget(deadline=0.0).deadline == 0.0
    unlimited = TimeBudget()
    assert unlimited.deadline is None and unlimited.safety == 1.2
    assert unlimited.stopped is False and unlimited.last_epoch_s is None  # a flag, not just falsy
    assert TimeBudget(seconds=10, safety=1).safety == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seconds": -5}, "seconds must be > 0 or null, got -5"),
        ({"seconds": 0.0}, "seconds must be > 0 or null, got 0.0"),
        ({"safety": 0.99}, "safety must be >= 1, got 0.99"),
    ],
)
def test_a_bad_budget_is_refused_naming_the_value(kwargs, message) -> None:
    with pytest.raises(ValueError) as info:
        TimeBudget(**kwargs)
    assert str(info.value) == message


def test_an_epoch_end_stops_when_the_next_epoch_would_not_finish_in_time(clock: SetClock, caplog) -> None:
    trainer = bare_trainer()
    budget = TimeBudget(deadline=1100.0, safety=1.5)
    epoch(budget, trainer, clock, 20.0)  # at 1020: 1.5 x 20 s more ends at 1050, in time
    assert budget.last_epoch_s == 20.0 and not budget.stopped and not trainer.should_stop
    epoch(budget, trainer, clock, 30.0)  # at 1050: 1.5 x 30 s more ends at exactly 1095, still in time
    assert budget.last_epoch_s == 30.0 and not budget.stopped and not trainer.should_stop
    with caplog.at_level(logging.INFO):
        epoch(budget, trainer, clock, 25.0)  # at 1075: 1.5 x 25 s more would end at 1112.5, past it
    assert budget.last_epoch_s == 25.0 and budget.stopped and trainer.should_stop
    assert "time budget: stopping after epoch 0 (25 s per epoch, 25 s left); resume with --ckpt_path last" in [
        r.getMessage() for r in caplog.records
    ]


def test_the_next_epoch_ending_exactly_at_the_deadline_still_runs(clock: SetClock) -> None:
    trainer = bare_trainer()
    budget = TimeBudget(deadline=1044.0)  # default safety 1.2: after a 20 s epoch ending at 1020, 24 s more
    epoch(budget, trainer, clock, 20.0)
    assert not budget.stopped and not trainer.should_stop
    late = TimeBudget(deadline=1063.5)  # the same from 1040 would need until 1064: half a second short
    epoch(late, trainer, clock, 20.0)
    assert late.stopped and trainer.should_stop


def test_no_deadline_no_estimate_or_a_stop_already_asked_leaves_the_run_alone(clock: SetClock) -> None:
    trainer = bare_trainer()
    unlimited = TimeBudget()
    epoch(unlimited, trainer, clock, 1e6)
    assert unlimited.last_epoch_s == 1e6 and not unlimited.stopped and not trainer.should_stop
    unlimited.on_train_batch_end(trainer, None, None, None, 0)  # no deadline: never a hard stop either

    passed = TimeBudget(deadline=clock.now - 1)  # already past, but no epoch was timed: nothing to estimate from
    passed.on_train_epoch_end(trainer, None)
    assert passed.last_epoch_s is None and not passed.stopped and not trainer.should_stop

    trainer.should_stop = True  # another callback (early stopping) ended the run: not the budget's doing
    epoch(passed, trainer, clock, 10.0)
    assert passed.last_epoch_s == 10.0 and not passed.stopped


def test_the_deadline_passing_mid_epoch_is_a_hard_stop_naming_where(clock: SetClock) -> None:
    trainer = bare_trainer()
    budget = TimeBudget(deadline=1010.0)
    clock.now = 1010.0
    budget.on_train_batch_end(trainer, None, None, None, 0)  # at the deadline: not yet past it
    assert not budget.stopped
    clock.now = 1010.5
    with pytest.raises(TimeBudgetExceeded) as info:
        budget.on_train_batch_end(trainer, None, None, None, 0)
    assert budget.stopped
    assert str(info.value) == (
        "time budget exceeded mid-epoch 0 (step 0); the partial epoch is dropped, resume with --ckpt_path last"
    )


class Tiny(LightningModule):
    """One linear layer on 4 batches of random data per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)), batch_size=2)


class Tick(Callback):
    """Advances the clock 10 s per training batch, and ``slow`` s on the batch of global step ``slow_step``."""

    def __init__(self, clock: SetClock, slow_step: int = -1, slow: float = 0.0) -> None:
        self.clock, self.slow_step, self.slow = clock, slow_step, slow

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.now += self.slow if trainer.global_step == self.slow_step else 10.0


def fit(clock: SetClock, budget: TimeBudget, max_epochs: int = 5, **tick) -> Trainer:
    t = Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_epochs=max_epochs, callbacks=[Tick(clock, **tick), budget],
    )  # fmt: skip
    t.fit(Tiny())
    return t


def test_a_fit_ends_at_the_last_epoch_end_that_leaves_room_for_the_next(clock: SetClock) -> None:
    """40 s epochs, 48 s assumed for the next: from 1000 with the deadline at 1130, epochs end at 1040, 1080 (1128
    fits) and 1120 (1168 does not): three epochs run, of the five asked."""
    budget = TimeBudget(deadline=1130.0)
    t = fit(clock, budget)
    assert budget.stopped and t.current_epoch == 3 and t.global_step == 12 and budget.last_epoch_s == 40.0
    unlimited = TimeBudget()
    t = fit(clock, unlimited)
    assert not unlimited.stopped and t.current_epoch == 5 and t.global_step == 20


def test_a_fit_past_its_deadline_mid_epoch_raises_naming_the_epoch_and_step(clock: SetClock) -> None:
    """Epoch 0 (40 s) leaves room for epoch 1, whose first batch (global step 5 when it ends) takes 1000 s."""
    budget = TimeBudget(deadline=1100.0)
    with pytest.raises(TimeBudgetExceeded) as info:
        fit(clock, budget, slow_step=5, slow=1000.0)
    assert budget.stopped
    assert str(info.value) == (
        "time budget exceeded mid-epoch 1 (step 5); the partial epoch is dropped, resume with --ckpt_path last"
    )
