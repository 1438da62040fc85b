"""Whether to stop on SIGTERM, agreed by the ranks on the host every few training batches, not through the GPU.

Lightning 2.6's training loop, under any multi-process strategy, broadcasts rank 0's SIGTERM flag at the start of
every training batch as a tensor on the rank's GPU over the default (NCCL) group and reads it with ``.item()``
(``_TrainingEpochLoop._broadcast_sigterm_tensor``, Lightning PR #20825). The read waits for everything queued on the
GPU before it, the previous step's backward and optimizer step included, and NCCL runs the broadcast after the
previous gradient all-reduce of every rank. So at every micro-batch the host stops launching until its GPU has
drained, its wait in the all-reduce for the slowest rank included, and no rank's host can run ahead to absorb another
rank's slow step. On 4 × H200 each DDP rank's GPU finished a micro-batch of the embedded model 9-37 ms after its host
had issued it (one GPU: 0.4-2.6 ms), a lag the host then waited out at every batch
(``results/ddp_embedded_h200x4_2026-11-28``, evening). Lightning PR #21640 (open) would broadcast every n steps.
Measured since (same README, night): replacing the check did not speed the step (303k against 306k tokens/s on one
host, within the fits' spread); it stays for the stopping guarantee below.

:class:`HostSigtermAgreement` keeps the guarantee (all ranks stop at the same batch, none is left waiting in a
collective) without the GPU: at every training batch start the ranks all-reduce (max) their own SIGTERM flags over a
gloo group of the same processes (a host collective: 0.19 ms between two processes on a 2-core CPU machine, against
a 135M micro-batch's 130-160 ms on an H200), and all raise Lightning's
``SIGTERMException`` there when any rank got the signal: a SIGTERM that reaches one rank alone (rank 0 or any other)
stops every rank, where Lightning's broadcast carries rank 0's flag only. The SIGTERM handler then only records the
signal (rank 0 still passes it on to the processes it started, as Lightning's does) and no longer raises at the end
of the batch on one rank alone. A signal during validation is acted on at the next agreement; one after the last
agreement of the fit lets the fit finish.

**Every few batches, not every batch**: an agreement is a barrier of the ranks' hosts, so at every batch no host could
run ahead of another's slow step, and the step took the slowest of the ranks' host times (the embedded model's
micro-batch is host-bound, with a standard deviation of about 20 ms on 140). The ranks agree at the first batch start
and then every :func:`next_interval` batches: as many as fit in :data:`TARGET_S` at the pace since the last agreement
(the slowest rank's: the elapsed time is all-reduced with the flag, so every rank takes the same interval), at least
1 and at most :data:`MAX_EVERY`. The embedded model's 170 ms micro-batches then meet every 5 batches, an 8B step of
seconds at every batch; a stop comes about :data:`TARGET_S` after the signal at most, or one batch where batches are
slower. Between agreements the hosts are coupled only through the gradient all-reduce on their GPUs.
``LRAGENT_SIGTERM_EVERY=N`` fixes the interval instead (1: every batch, as before).

:class:`~lit_modules.multi_lora_module.MultiLoraModule` adds it to every fit (``configure_callbacks``); with one
process, or a Lightning without the per-batch broadcast, it does nothing. ``LRAGENT_LIGHTNING_SIGTERM=1`` leaves
Lightning's own check in place (to time the two side by side).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

LOOP_CHECK = "_broadcast_sigterm_tensor"
"""Lightning's per-batch check on ``trainer.fit_loop.epoch_loop`` (Lightning 2.6), replaced on the instance."""
NOTIFIER = "_sigterm_notifier_fn"
"""Lightning's SIGTERM handler on ``trainer._signal_connector``, replaced before Lightning registers it."""
TARGET_S = 1.0
"""Seconds of training between two agreements, about (the most a stop waits, where a batch takes less)."""
MAX_EVERY = 8
"""The most training batches between two agreements."""
EVERY_ENV = "LRAGENT_SIGTERM_EVERY"


def agreement_interval(env: Mapping[str, str]) -> int | None:
    """A fixed number of training batches between two agreements (``LRAGENT_SIGTERM_EVERY``, a whole number >= 1),
    or None: :func:`next_interval` decides from the pace.

    Raises:
        ValueError: the variable is set to anything else, named with what is allowed.
    """
    raw = env.get(EVERY_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdecimal() or int(raw) < 1:
        raise ValueError(
            f"{EVERY_ENV}={raw!r}: expected a whole number of training batches >= 1 (unset: from the pace, 1 to "
            f"{MAX_EVERY})"
        )
    return int(raw)


def next_interval(seconds: float, batches: int) -> int:
    """Batches until the next agreement when the last ``batches`` took ``seconds`` (the slowest rank's): as many as
    fit in :data:`TARGET_S` at that pace, between 1 and :data:`MAX_EVERY`."""
    if batches < 1 or seconds <= 0:
        return 1
    return max(1, min(MAX_EVERY, int(TARGET_S * batches / seconds)))


class HostSigtermAgreement(Callback):
    """Replaces Lightning's per-batch GPU broadcast of the SIGTERM flag with a gloo all-reduce of every rank's flag
    (and of its time since the last one) at the first training batch start and then every few (module doc).

    Installed in ``setup`` (fit only, more than one process, the default group initialised, both Lightning
    attributes present); Lightning registers its signal handlers after the setup hooks, so it registers this
    notifier. Removed in ``teardown``.
    """

    def __init__(self) -> None:
        self.group: Any = None
        self.signalled = False
        self.every: int | None = None  # fixed interval (LRAGENT_SIGTERM_EVERY), or None: from the pace
        self.batches = 0  # training batch starts seen in this fit, the same count on every rank
        self.next_at = 1  # the batch start of the next agreement, the same on every rank
        self.last_at, self.last_time = 0, 0.0  # the last agreement's batch start and this rank's clock then
        self._trainer: Trainer | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        loop, connector = trainer.fit_loop.epoch_loop, trainer._signal_connector
        if stage != "fit" or trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        if os.environ.get("LRAGENT_LIGHTNING_SIGTERM") == "1":
            log.info("LRAGENT_LIGHTNING_SIGTERM=1: Lightning's per-batch SIGTERM broadcast stays")
            return
        if not (hasattr(loop, LOOP_CHECK) and hasattr(connector, NOTIFIER)):
            log.debug("Lightning has no per-batch SIGTERM broadcast here: its own handling stays")
            return
        self.every = agreement_interval(os.environ)  # before the group: a bad value stops every rank alike
        self.group = dist.new_group(backend="gloo")  # every rank runs setup: the group is made collectively
        self.signalled, self.batches, self.next_at, self.last_at = False, 0, 1, 0
        self._trainer = trainer
        setattr(loop, LOOP_CHECK, self.agree)
        setattr(connector, NOTIFIER, self.notify)

    def notify(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler: records the signal; rank 0 sends it on to the processes it started (Lightning's
        subprocess launcher), once."""
        log.info("rank %s received SIGTERM (%s): every rank stops at the next training batch", self._rank(), signum)
        if not self.signalled and self._trainer is not None:
            launcher = self._trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        self.signalled = True

    def agree(self) -> None:
        """At a training batch start, on every rank, at the agreed batches: stop (``SIGTERMException``) when any rank
        got SIGTERM; else set the next agreement's batch from the slowest rank's pace since this one's."""
        self.batches += 1
        if self.batches < self.next_at:
            return
        now = time.monotonic()
        # [flag, seconds since the last agreement]: MAX of each, so every rank sees the same two numbers
        shared = torch.tensor(
            [float(self.signalled), now - self.last_time if self.last_at else 0.0], dtype=torch.float64
        )
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.group)
        flag, seconds = shared.tolist()
        interval = self.every or next_interval(seconds, self.batches - self.last_at)  # the first: 0 s, so 1
        self.last_at, self.last_time, self.next_at = self.batches, now, self.batches + interval
        if flag:
            if self._trainer is not None:
                self._trainer._signal_connector.received_sigterm = True
            raise SIGTERMException()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.group is None:
            return
        trainer.fit_loop.epoch_loop.__dict__.pop(LOOP_CHECK, None)
        trainer._signal_connector.__dict__.pop(NOTIFIER, None)
        dist.destroy_process_group(self.group)
        self.group, self._trainer = None, None

    def _rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0
