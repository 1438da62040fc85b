"""The record of every ``fit`` call (lit_modules/run_status.py): one JSON line per call, appended, with why the fit
ended, how far it got, how long it trained (on a clock the test sets) and how many tokens, the best checkpoint and
its score; from tiny real fits on the CPU."""

from __future__ import annotations

import datetime as dt
import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import SetClock
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lit_modules import run_status
from lit_modules.run_status import FINISHED_REASONS, STOP_REASONS, RunStatus
from lit_modules.time_budget import TimeBudget, TimeBudgetExceeded


@pytest.fixture
def clock(monkeypatch) -> SetClock:
    c = SetClock()
    monkeypatch.setattr(run_status, "time", SimpleNamespace(time=c))  # the module's clock only, not Lightning's
    monkeypatch.setattr(TimeBudget, "clock", c)
    return c


class Tick(Callback):
    """Advances the clock ``seconds`` per training batch (before RunStatus and TimeBudget see the batch end), and
    raises ``error`` at the end of the batch of global step ``raise_at_step``."""

    def __init__(
        self, clock: SetClock, raise_at_step: int = -1, error: BaseException | None = None, seconds: float = 10.0
    ) -> None:
        self.clock, self.raise_at_step, self.error, self.seconds = clock, raise_at_step, error, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.now += self.seconds
        if trainer.global_step == self.raise_at_step:
            raise self.error


class Tiny(LightningModule):
    """One linear layer; 4 training batches per epoch of 2 examples and 3, 4, 5, 6 tokens (as the data module's
    batches count them; ``counts=False``: dicts without the counts; ``dict_batches=False``: tuples); validation logs
    a scripted ``val/loss`` per epoch."""

    def __init__(
        self, dict_batches: bool = True, counts: bool = True, val_losses=(3.0, 2.0, 2.5, 2.6, 2.7, 2.8)
    ) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.dict_batches, self.counts, self.val_losses = dict_batches, counts, val_losses

    def training_step(self, batch, batch_idx):
        x, y = (batch["x"], batch["y"]) if self.dict_batches else batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("val/loss", self.val_losses[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = [
            {
                "x": torch.randn(2, 4, generator=g),
                "y": torch.randn(2, 1, generator=g),
                "n_tokens": 3 + i,
                "n_examples": 2,
            }
            for i in range(4)
        ]
        if not self.counts:
            data = [{"x": d["x"], "y": d["y"]} for d in data]
        if not self.dict_batches:
            data = [(d["x"], d["y"]) for d in data]
        return DataLoader(data, batch_size=None)

    def val_dataloader(self):
        return DataLoader([torch.zeros(1)], batch_size=None)


def trainer(tmp_path: Path, callbacks: list[Callback], **kwargs) -> Trainer:
    args = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tmp_path, max_epochs=2, enable_checkpointing=False,
    )  # fmt: skip
    return Trainer(**{**args, **kwargs}, callbacks=callbacks)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_finished_fit_is_recorded_with_its_times_tokens_and_reason(tmp_path: Path, clock: SetClock) -> None:
    status = RunStatus(str(tmp_path / "runs" / "a" / "status.jsonl"))  # the directory is made when written
    clock.now = 1100.0  # 100 s between the callback's creation and the fit's first epoch: wall time, not training
    trainer(tmp_path, [Tick(clock), status]).fit(Tiny())
    (record,) = records(tmp_path / "runs" / "a" / "status.jsonl")
    utc = dt.datetime.strptime(record.pop("utc"), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert abs((dt.datetime.now(dt.timezone.utc) - utc).total_seconds()) < 60
    assert record == {
        "reason": "max_epochs",
        "finished": True,
        "error": None,
        "start_epoch": 0,
        "epochs_done": 2,
        "start_step": 0,
        "global_step": 8,
        "wall_s": 180.0,  # from 1000 to 1180
        "train_s": 80.0,  # two epochs of four 10-s batches
        "train_tokens": 2 * (3 + 4 + 5 + 6),
        "train_examples": 2 * 4 * 2,
        "tokens_per_s": round(36 / 80.0, 1),
        "best_checkpoint": None,
        "best_score": None,
        "device": "cpu",
        "max_memory_gb": None,
    }
    assert STOP_REASONS == ("early_stopping", "max_epochs", "max_steps", "time_budget", "interrupted", "error", "other")
    assert FINISHED_REASONS == ("early_stopping", "max_epochs", "max_steps")


def test_each_fit_appends_a_line_that_starts_where_the_last_one_ended(tmp_path: Path, clock: SetClock) -> None:
    """Two fit calls (the second resumes from the first's last checkpoint): two lines, in the default file under
    the trainer's root directory; batches that are not dicts count no tokens."""
    ckpt = tmp_path / "ckpt"
    first = RunStatus()
    trainer(
        tmp_path, [Tick(clock), first, ModelCheckpoint(dirpath=ckpt, save_last=True)], enable_checkpointing=True
    ).fit(Tiny())
    second = RunStatus()
    t = trainer(
        tmp_path,
        [Tick(clock), second, ModelCheckpoint(dirpath=tmp_path / "ckpt2")],
        max_epochs=3,
        enable_checkpointing=True,
    )
    t.fit(Tiny(dict_batches=False), ckpt_path=str(ckpt / "last.ckpt"))
    one, two = records(tmp_path / "fit_status.jsonl")
    assert (one["start_epoch"], one["epochs_done"], one["start_step"], one["global_step"]) == (0, 2, 0, 8)
    assert (two["start_epoch"], two["epochs_done"], two["start_step"], two["global_step"]) == (2, 3, 8, 12)
    assert two["reason"] == "max_epochs" and two["train_s"] == 40.0
    assert (two["train_tokens"], two["train_examples"], two["tokens_per_s"]) == (0, 0, 0.0)


def test_the_best_checkpoint_and_its_score_are_recorded(tmp_path: Path, clock: SetClock) -> None:
    """val/loss 3.0, 2.0, 2.5, 2.6: early stopping (patience 2) ends the fit after epoch 3; the best is epoch 1."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    last = ModelCheckpoint(dirpath=tmp_path / "last", save_last=True)  # no monitor: neither best nor a score
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val/loss", mode="min", save_top_k=1)
    stop = EarlyStopping(monitor="val/loss", mode="min", patience=2)
    t = trainer(tmp_path, [Tick(clock), last, best, stop, status], max_epochs=6, enable_checkpointing=True)
    t.fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "early_stopping" and record["finished"] and record["epochs_done"] == 4
    assert record["best_score"] == 2.0 and record["best_checkpoint"] == best.best_model_path
    assert Path(record["best_checkpoint"]).name.startswith("epoch=1-")


def test_a_fit_ended_by_its_step_limit_is_finished(tmp_path: Path, clock: SetClock) -> None:
    status = RunStatus(str(tmp_path / "status.jsonl"))
    trainer(tmp_path, [Tick(clock), status], max_epochs=5, max_steps=6).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "max_steps" and record["finished"] and record["global_step"] == 6
    assert record["train_tokens"] == 3 + 4 + 5 + 6 + 3 + 4 and record["train_examples"] == 12


def test_a_fit_stopped_by_the_time_budget_is_not_finished(tmp_path: Path, clock: SetClock) -> None:
    """40-s epochs, 48 s assumed for the next, the deadline 100 s after the start: stopped after two epochs."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    budget = TimeBudget(deadline=clock.now + 100)
    trainer(tmp_path, [Tick(clock), budget, status], max_epochs=5).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "time_budget" and not record["finished"] and record["epochs_done"] == 2


@pytest.mark.parametrize(
    ("error", "raised", "reason"),
    [
        (KeyboardInterrupt("ctrl-c"), SystemExit, "interrupted"),  # Lightning shuts down and exits with status 1
        (SIGTERMException("15"), SIGTERMException, "interrupted"),
        (RuntimeError("NaN loss"), RuntimeError, "error"),
    ],
)
def test_a_fit_that_raised_is_recorded_with_the_error_and_the_time_it_trained(
    tmp_path: Path, clock: SetClock, error: BaseException, raised: type, reason: str
) -> None:
    """The error comes at the end of epoch 1's second batch: 40 + 20 s trained, the partial epoch counted (the batch
    whose end raised is not: RunStatus never saw it end)."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    t = trainer(tmp_path, [Tick(clock, raise_at_step=6, error=error), status], max_epochs=5)
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C while it shuts down
    try:
        with pytest.raises(raised):
            t.fit(Tiny())
    finally:
        signal.signal(signal.SIGINT, sigint)
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == reason and not record["finished"]
    assert record["error"] == f"{type(error).__name__}: {error}"
    assert record["train_s"] == 60.0 and record["global_step"] == 6 and record["epochs_done"] == 1
    assert record["train_tokens"] == 3 + 4 + 5 + 6 + 3 and record["tokens_per_s"] == round(21 / 60.0, 1)


def test_a_hard_time_budget_stop_is_recorded_as_the_budgets(tmp_path: Path, clock: SetClock) -> None:
    """The deadline passes at the second batch: the budget raises mid-epoch, and the record names the budget."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    budget = TimeBudget(deadline=clock.now + 15)
    with pytest.raises(TimeBudgetExceeded):
        trainer(tmp_path, [Tick(clock), budget, status], max_epochs=5).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "time_budget" and not record["finished"] and record["train_s"] == 20.0
    assert record["error"] == (
        "TimeBudgetExceeded: time budget exceeded mid-epoch 0 (step 2); the partial epoch is dropped, resume with "
        "--ckpt_path last"
    )


def test_batches_without_token_counts_count_none(tmp_path: Path, clock: SetClock) -> None:
    status = RunStatus(str(tmp_path / "status.jsonl"))
    trainer(tmp_path, [Tick(clock), status], max_epochs=1).fit(Tiny(counts=False))
    (record,) = records(tmp_path / "status.jsonl")
    assert (record["train_tokens"], record["train_examples"], record["tokens_per_s"]) == (0, 0, 0.0)


def test_times_are_kept_to_the_hundredth_of_a_second(tmp_path: Path, clock: SetClock) -> None:
    """Two batches of 0.1234 s: 0.2468 s trained (and since the callback was made), 7 tokens in it."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    trainer(tmp_path, [Tick(clock, seconds=0.1234), status], max_steps=2).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert (record["wall_s"], record["train_s"], record["tokens_per_s"]) == (0.25, 0.25, round(7 / 0.2468, 1))
    assert record["reason"] == "max_steps"


def test_a_fit_that_fails_before_training_is_recorded_from_its_start(tmp_path: Path, clock: SetClock) -> None:
    """configure_optimizers fails: nothing trained, no epoch timed, no tokens (no rate either)."""

    class Broken(Tiny):
        def configure_optimizers(self):
            raise ValueError("lr must be > 0")

    status = RunStatus(str(tmp_path / "status.jsonl"))
    with pytest.raises(ValueError, match="lr must be > 0"):
        trainer(tmp_path, [status]).fit(Broken())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "error" and record["error"] == "ValueError: lr must be > 0"
    assert (record["start_epoch"], record["start_step"], record["epochs_done"], record["global_step"]) == (0, 0, 0, 0)
    assert (record["train_s"], record["train_tokens"], record["tokens_per_s"]) == (0.0, 0, None)
    assert record["device"] == "cpu"


def test_a_callback_reused_after_a_crash_mid_epoch_records_the_next_fit_too(tmp_path: Path, clock: SetClock) -> None:
    status = RunStatus(str(tmp_path / "status.jsonl"))
    with pytest.raises(RuntimeError):
        trainer(tmp_path, [Tick(clock, raise_at_step=2, error=RuntimeError("boom")), status]).fit(Tiny())

    class Broken(Tiny):
        def configure_optimizers(self):
            raise ValueError("no optimizer")

    with pytest.raises(ValueError, match="no optimizer"):
        trainer(tmp_path, [status]).fit(Broken())
    first, second = records(tmp_path / "status.jsonl")
    assert (first["reason"], first["error"]) == ("error", "RuntimeError: boom")
    assert (second["reason"], second["error"]) == ("error", "ValueError: no optimizer")
    assert second["train_s"] == first["train_s"] == 20.0  # the crashed epoch was counted once


class StopAfterFirstEpoch(Callback):
    """Ends the fit after epoch 0 for a reason of its own (neither early stopping nor the time budget)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.should_stop = True


def test_a_fit_ended_for_another_reason_is_not_finished(tmp_path: Path, clock: SetClock) -> None:
    status = RunStatus(str(tmp_path / "status.jsonl"))
    trainer(tmp_path, [Tick(clock), StopAfterFirstEpoch(), status], max_epochs=5).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert (record["reason"], record["finished"], record["epochs_done"]) == ("other", False, 1)


def test_the_reason_is_the_limit_reached_whatever_else_watched(tmp_path: Path, clock: SetClock) -> None:
    """Early stopping that never fired leaves max_epochs; one that fired after epoch 1 is early stopping; a one-step
    limit is max_steps; zero epochs asked and run is max_epochs."""
    path = tmp_path / "status.jsonl"
    calm = EarlyStopping(monitor="val/loss", mode="min", patience=5)
    trainer(tmp_path, [Tick(clock), calm, RunStatus(str(path))], max_epochs=2).fit(Tiny())
    early = EarlyStopping(monitor="val/loss", mode="min", patience=1)  # 3.0 then 3.5: stops after epoch 1
    trainer(tmp_path, [Tick(clock), early, RunStatus(str(path))], max_epochs=5).fit(Tiny(val_losses=(3.0, 3.5, 1.0)))
    trainer(tmp_path, [Tick(clock), RunStatus(str(path))], max_steps=1).fit(Tiny())
    trainer(tmp_path, [Tick(clock), RunStatus(str(path))], max_epochs=0).fit(Tiny())
    assert [(r["reason"], r["epochs_done"], r["global_step"]) for r in records(path)] == [
        ("max_epochs", 2, 8),
        ("early_stopping", 2, 8),
        ("max_steps", 1, 1),  # Lightning counts the epoch the limit cut short
        ("max_epochs", 0, 0),
    ]
    assert early.stopped_epoch == 1


def test_a_zero_step_limit_is_no_limit_reached(tmp_path: Path) -> None:
    """max_steps 0 with epochs left to run is not a step limit reached: the fit ended for another reason."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    t = trainer(tmp_path, [status], max_steps=0, max_epochs=5)
    status.on_train_start(t, Tiny())
    status.on_fit_end(t, Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "other" and not record["finished"]


class Snapshot(Checkpoint):
    """A checkpoint callback of its own kind: no best model, no score."""


def test_a_checkpoint_callback_without_a_score_is_passed_over(tmp_path: Path, clock: SetClock) -> None:
    status = RunStatus(str(tmp_path / "status.jsonl"))
    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val/loss", mode="min", save_top_k=1)
    trainer(tmp_path, [Tick(clock), Snapshot(), best, status], enable_checkpointing=True).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    assert record["best_score"] == 2.0 and record["best_checkpoint"] == best.best_model_path


@pytest.fixture
def tokyo(monkeypatch):
    """The machine's local time is UTC+9."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_record_time_is_utc_whatever_the_local_time(tmp_path: Path, tokyo) -> None:
    status = RunStatus(str(tmp_path / "status.jsonl"))
    trainer(tmp_path, [status], max_steps=1).fit(Tiny())
    (record,) = records(tmp_path / "status.jsonl")
    utc = dt.datetime.strptime(record["utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert abs((dt.datetime.now(dt.timezone.utc) - utc).total_seconds()) < 60


def test_the_gpu_that_trained_is_named_with_its_peak_memory(tmp_path: Path, monkeypatch) -> None:
    """CUDA cannot be real here: the machine says it has a GPU, which names itself and reports 1.005000001 GB
    allocated at most; the module is on cuda:1 when training starts, back on the CPU when the fit ends (as Lightning
    leaves it)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: asked.append(("name", d)) or "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(("memory", d)) or 1_005_000_001)
    status = RunStatus(str(tmp_path / "status.jsonl"))
    t, module = trainer(tmp_path, [status]), Tiny()
    module._device = torch.device("cuda", 1)  # where the strategy put it
    status.on_train_start(t, module)
    module._device = torch.device("cpu")
    status.on_fit_end(t, module)
    on_cpu = RunStatus(str(tmp_path / "status.jsonl"))  # a CPU run on the same machine: no GPU named
    on_cpu.on_train_start(t, module)
    on_cpu.on_fit_end(t, module)
    gpu, cpu = records(tmp_path / "status.jsonl")
    assert (gpu["device"], gpu["max_memory_gb"]) == ("NVIDIA Test GPU", 1.01)
    assert (cpu["device"], cpu["max_memory_gb"]) == ("cpu", None)
    assert asked == [("name", torch.device("cuda", 1)), ("memory", torch.device("cuda", 1))]
