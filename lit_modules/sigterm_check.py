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

**Every few batches, not every batch** (``LRAGENT_SIGTERM_EVERY``, default :data:`EVERY`): an agreement is a barrier
of the ranks' hosts, so at every batch no host could run ahead of another's slow step, and the step took the slowest
of the ranks' host times (the embedded model's micro-batch is host-bound, with a standard deviation of about 20 ms
on 140). Agreeing at every :data:`EVERY`-th batch start (the batch counts of the ranks are equal, so they agree at
the same batches) leaves the hosts coupled only through the gradient all-reduce on their GPUs, and delays a stop by
at most that many batches (8 micro-batches of the embedded model: about 1.4 s on an H200). ``LRAGENT_SIGTERM_EVERY=1``
agrees at every batch, as before.

:class:`~lit_modules.multi_lora_module.MultiLoraModule` adds it to every fit (``configure_callbacks``); with one
process, or a Lightning without the per-batch broadcast, it does nothing. ``LRAGENT_LIGHTNING_SIGTERM=1`` leaves
Lightning's own check in place (to time the two side by side).
"""

from __future__ import annotations

import logging
import os
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
EVERY = 8
"""Training batches between two agreements unless ``LRAGENT_SIGTERM_EVERY`` says otherwise."""
EVERY_ENV = "LRAGENT_SIGTERM_EVERY"


def agreement_interval(env: Mapping[str, str]) -> int:
    """Training batches between two agreements: ``LRAGENT_SIGTERM_EVERY`` (a whole number >= 1) or :data:`EVERY`.

    Raises:
        ValueError: the variable is set to anything else, named with what is allowed.
    """
    raw = env.get(EVERY_ENV, "").strip()
    if not raw:
        return EVERY
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{EVERY_ENV}={raw!r}: expected a whole number of training batches >= 1 (default {EVERY})")
    return int(raw)


class HostSigtermAgreement(Callback):
    """Replaces Lightning's per-batch GPU broadcast of the SIGTERM flag with a gloo all-reduce of every rank's flag
    at every :attr:`every`-th training batch start.

    Installed in ``setup`` (fit only, more than one process, the default group initialised, both Lightning
    attributes present); Lightning registers its signal handlers after the setup hooks, so it registers this
    notifier. Removed in ``teardown``.
    """

    def __init__(self) -> None:
        self.group: Any = None
        self.signalled = False
        self.every = EVERY
        self.batches = 0  # training batch starts seen in this fit, the same count on every rank
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
        self.signalled, self.batches = False, 0
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
        """At a training batch start, on every rank, every :attr:`every`-th time: stop (``SIGTERMException``) when any
        rank got SIGTERM."""
        self.batches += 1
        if (self.batches - 1) % self.every:
            return
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
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
