"""The host-side SIGTERM agreement of the training ranks without processes (lit_modules/sigterm_check.py): the
interval from ``LRAGENT_SIGTERM_EVERY`` or from the pace, when the callback installs itself on a trainer, and what an
agreement does, with ``torch.distributed``'s collectives replaced by a recorder that plays the other rank."""

from __future__ import annotations

import logging
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

import lit_modules.sigterm_check as sc
from lit_modules.sigterm_check import (
    EVERY_ENV,
    LOOP_CHECK,
    MAX_EVERY,
    NOTIFIER,
    TARGET_S,
    HostSigtermAgreement,
    agreement_interval,
    next_interval,
)


# ---- the interval ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw, every", [(None, None), ("", None), ("  ", None), ("1", 1), (" 3 ", 3), ("12", 12), ("٣", 3)]
)
def test_a_fixed_interval_is_a_whole_number_of_batches_or_none(raw, every):
    assert EVERY_ENV == "LRAGENT_SIGTERM_EVERY"
    assert agreement_interval({} if raw is None else {EVERY_ENV: raw}) == every


@pytest.mark.parametrize("raw", ["0", "00", "-1", "x", "1.5", "2 batches", "²", "1²"])  # ² is a digit, not decimal
def test_any_other_interval_is_refused_naming_the_variable(raw):
    with pytest.raises(ValueError) as exc:
        agreement_interval({EVERY_ENV: raw})
    assert str(exc.value) == (
        f"LRAGENT_SIGTERM_EVERY={raw.strip()!r}: expected a whole number of training batches >= 1 "
        "(unset: from the pace, 1 to 8)"
    )


@pytest.mark.parametrize(
    "seconds, batches, interval",
    [
        (1.0, 5, 5),
        (0.5, 2, 4),
        (0.9, 3, 3),
        (0.2, 1, 5),
        (0.125, 1, 8),
        (0.1, 5, 8),
        (10.0, 1, 1),
        (1.01, 1, 1),
        (0.0, 5, 1),
        (-1.0, 5, 1),
        (1.0, 0, 1),
        (0.1, 0, 1),
        (0.5, -1, 1),
    ],
)
def test_the_pace_sets_as_many_batches_as_fit_in_the_target_between_1_and_8(seconds, batches, interval):
    assert (TARGET_S, MAX_EVERY) == (1.0, 8)
    assert next_interval(seconds, batches) == interval


# ---- installing -----------------------------------------------------------------------------------------------------
class Loop:
    def _broadcast_sigterm_tensor(self) -> None:  # Lightning's per-batch check
        raise AssertionError("Lightning's check ran")


class Connector:
    received_sigterm = False

    def _sigterm_notifier_fn(self, signum, frame) -> None:
        raise AssertionError("Lightning's notifier ran")


class Launcher:
    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, signum: int) -> None:
        self.killed.append(signum)


def trainer(world_size: int = 2, rank: int = 1, launcher: Launcher | None = None):
    return SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=Loop()),
        _signal_connector=Connector(),
        world_size=world_size,
        global_rank=rank,
        strategy=SimpleNamespace(launcher=launcher),
    )


class Dist:
    """torch.distributed as the callback uses it, for a run of two ranks: the other rank's [flag, seconds] is
    ``other``; records the groups made and destroyed and every all-reduce."""

    def __init__(self, monkeypatch, initialized: bool = True, available: bool = True) -> None:
        self.other = [0.0, 0.0]
        self.reduced: list[tuple[list[float], object, object]] = []
        self.made: list[dict] = []
        self.destroyed: list[object] = []

        def all_reduce(tensor, op=None, group=None):
            self.reduced.append((tensor.tolist(), op, group))
            assert tensor.dtype == torch.float64
            tensor.copy_(torch.maximum(tensor, torch.tensor(self.other, dtype=torch.float64)))

        def new_group(**kwargs):
            self.made.append(kwargs)
            return "GLOO"

        monkeypatch.setattr(dist, "is_available", lambda: available)
        monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
        monkeypatch.setattr(dist, "new_group", new_group)
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroyed.append)


def installed(cb: HostSigtermAgreement, t) -> bool:
    loop, connector = t.fit_loop.epoch_loop, t._signal_connector
    return LOOP_CHECK in vars(loop) or NOTIFIER in vars(connector)


def test_it_installs_on_a_multi_process_fit_replacing_both_lightning_hooks(monkeypatch):
    d = Dist(monkeypatch)
    monkeypatch.delenv("LRAGENT_LIGHTNING_SIGTERM", raising=False)
    monkeypatch.setenv(EVERY_ENV, "3")
    cb, t = HostSigtermAgreement(), trainer()
    cb.signalled, cb.batches, cb.next_at, cb.last_at = True, 9, 12, 7  # a previous fit's state
    cb.setup(t, None, "fit")
    assert vars(t.fit_loop.epoch_loop)[LOOP_CHECK] == cb.agree and vars(t._signal_connector)[NOTIFIER] == cb.notify
    assert d.made == [{"backend": "gloo"}] and cb.group == "GLOO" and cb.every == 3 and cb._trainer is t
    assert (cb.signalled, cb.batches, cb.next_at, cb.last_at) == (False, 0, 1, 0)
    cb.teardown(t, None, "fit")
    assert not installed(cb, t) and d.destroyed == ["GLOO"] and (cb.group, cb._trainer) == (None, None)
    assert hasattr(t.fit_loop.epoch_loop, LOOP_CHECK)  # Lightning's own again
    cb.teardown(t, None, "fit")  # nothing installed: nothing to undo
    assert d.destroyed == ["GLOO"]


@pytest.mark.parametrize(
    "case",
    ["validate", "one process", "no group", "no distributed", "lightning's asked", "no loop check", "no notifier"],
)
def test_it_leaves_lightning_alone_where_it_has_nothing_to_replace(monkeypatch, caplog, case):
    d = Dist(monkeypatch, initialized=case != "no group", available=case != "no distributed")
    monkeypatch.delenv(EVERY_ENV, raising=False)
    if case == "lightning's asked":
        monkeypatch.setenv("LRAGENT_LIGHTNING_SIGTERM", "1")
    else:
        monkeypatch.setenv("LRAGENT_LIGHTNING_SIGTERM", "0")
    t = trainer(world_size=1 if case == "one process" else 2)
    if case == "no loop check":
        t.fit_loop.epoch_loop = SimpleNamespace()
    if case == "no notifier":
        t._signal_connector = SimpleNamespace()
    cb = HostSigtermAgreement()
    with caplog.at_level(logging.DEBUG, logger=sc.__name__):
        cb.setup(t, None, "validate" if case == "validate" else "fit")
    assert not installed(cb, t) and d.made == [] and cb.group is None and cb._trainer is None
    messages = [r.getMessage() for r in caplog.records]
    if case == "lightning's asked":
        assert messages == ["LRAGENT_LIGHTNING_SIGTERM=1: Lightning's per-batch SIGTERM broadcast stays"]
        assert caplog.records[0].levelno == logging.INFO
    elif case.startswith("no ") and case not in ("no group", "no distributed"):
        assert messages == ["Lightning has no per-batch SIGTERM broadcast here: its own handling stays"]
        assert caplog.records[0].levelno == logging.DEBUG
    else:
        assert messages == []
    cb.teardown(t, None, "fit")
    assert d.destroyed == []


def test_a_bad_interval_stops_setup_before_the_group_is_made(monkeypatch):
    d = Dist(monkeypatch)
    monkeypatch.delenv("LRAGENT_LIGHTNING_SIGTERM", raising=False)
    monkeypatch.setenv(EVERY_ENV, "0")
    t = trainer()
    with pytest.raises(ValueError, match="LRAGENT_SIGTERM_EVERY='0'"):
        HostSigtermAgreement().setup(t, None, "fit")
    assert d.made == [] and not installed(HostSigtermAgreement(), t)


# ---- the signal and the agreements ----------------------------------------------------------------------------------
def test_the_notifier_records_the_signal_and_passes_it_on_once(caplog):
    launcher = Launcher()
    cb = HostSigtermAgreement()
    cb._trainer = trainer(rank=3, launcher=launcher)
    with caplog.at_level(logging.INFO, logger=sc.__name__):
        cb.notify(signal.SIGTERM, None)
        assert cb.signalled and launcher.killed == [signal.SIGTERM]  # at the first signal
        cb.notify(signal.SIGTERM, None)
    assert cb.signalled and launcher.killed == [signal.SIGTERM]  # not again
    assert caplog.records[0].getMessage() == (
        f"rank 3 received SIGTERM ({int(signal.SIGTERM)}): every rank stops at the next training batch"
    )
    lone = HostSigtermAgreement()  # not installed (no trainer): rank 0, nothing to pass on
    lone.notify(signal.SIGTERM, None)
    assert lone.signalled and lone._rank() == 0
    no_launcher = HostSigtermAgreement()
    no_launcher._trainer = trainer(launcher=None)
    no_launcher.notify(signal.SIGTERM, None)
    assert no_launcher.signalled


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def agreeing(monkeypatch, every: int | None = None):
    d = Dist(monkeypatch)
    clock = Clock()
    monkeypatch.setattr(sc, "time", clock)
    cb = HostSigtermAgreement()
    cb.group, cb.every, cb._trainer = "GLOO", every, trainer()
    return cb, d, clock


def test_the_ranks_agree_at_the_first_batch_then_at_the_slowest_ranks_pace(monkeypatch):
    cb, d, clock = agreeing(monkeypatch)
    cb.agree()  # the first batch start: always an agreement, 0 s so far, so the next is one batch later
    assert d.reduced == [([0.0, 0.0], dist.ReduceOp.MAX, "GLOO")]
    assert (cb.batches, cb.last_at, cb.last_time, cb.next_at) == (1, 1, 100.0, 2)
    clock.now = 100.2
    d.other = [0.0, 0.25]  # the other rank took 0.25 s for that batch: its pace sets the interval
    cb.agree()
    assert d.reduced[-1][0] == pytest.approx([0.0, 0.2])
    assert (cb.batches, cb.last_at, cb.last_time, cb.next_at) == (2, 2, 100.2, 2 + 4)
    for _ in range(3):  # batches 3, 4, 5: no agreement
        cb.agree()
    assert len(d.reduced) == 2 and cb.batches == 5
    clock.now = 100.8  # batch 6: 4 batches in 0.6 s here, 0.5 s on the other rank
    d.other = [0.0, 0.5]
    cb.agree()
    assert len(d.reduced) == 3 and d.reduced[-1][0] == pytest.approx([0.0, 0.6])
    assert (cb.batches, cb.last_at, cb.next_at) == (6, 6, 6 + 6)  # int(1.0 * 4 / 0.6) = 6


def test_a_fixed_interval_ignores_the_pace(monkeypatch):
    cb, d, clock = agreeing(monkeypatch, every=2)
    for _ in range(7):
        clock.now += 1.0
        cb.agree()
    assert len(d.reduced) == 4 and cb.next_at == 9  # batches 1, 3, 5, 7


@pytest.mark.parametrize("who", ["this rank", "the other rank"])
def test_a_signal_on_any_rank_stops_every_rank_at_the_next_agreement(monkeypatch, who):
    cb, d, clock = agreeing(monkeypatch)
    cb.agree()
    cb.agree()  # batch 2 agreed (0 s since: the next at 3)
    assert cb.next_at == 3
    if who == "this rank":
        cb.signalled = True
    else:
        d.other = [1.0, 0.0]
    with pytest.raises(SIGTERMException):
        cb.agree()
    assert d.reduced[-1][0][0] == (1.0 if who == "this rank" else 0.0)
    assert cb._trainer._signal_connector.received_sigterm is True
    cb._trainer = None  # not installed: it still stops
    with pytest.raises(SIGTERMException):
        cb.agree()
