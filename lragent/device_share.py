"""Sharing one device between processes: a memory share per process, sizing under a lock, out-of-memory in one line.

Several evaluations on one GPU (a study fills a card with a 135M or 1.5B model that way) must not each size their
batch to all the memory that is free when they start. Three pieces make that safe:

- **a share** (``--memory_fraction f``): the process plans for at most ``f`` of the device's total memory, less
  what it already holds, and the CUDA caching allocator is capped there
  (``torch.cuda.set_per_process_memory_fraction``), so a process that misjudges fails itself, not its neighbours;
- **sizing under a lock** (:func:`allocation_lock`): measuring what is free and allocating the caches happen under a
  file lock per physical GPU, so processes that start together size one after another, each seeing what the ones
  before it took;
- **one line for out-of-memory** (:func:`oom_line`): what was asked, what is free of what total, and the options to
  change, instead of a traceback.
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 1 << 30


def check_memory_fraction(fraction: float | None, option: str = "--memory_fraction") -> None:
    """Raises ``ValueError`` (one line) unless ``fraction`` is None or in (0, 1]."""
    if fraction is None:
        return
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(f"{option} {fraction!r}: allowed a share of the device's memory in (0, 1], e.g. 0.15")


def total_memory(device: str | torch.device) -> int | None:
    """Bytes the device has in all (CUDA: the card; CPU: ``MemTotal``), or None if unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(device_index(dev)).total_memory)
    return meminfo_bytes("MemTotal")


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemTotal``, ``MemAvailable``) in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def held_memory(device: str | torch.device) -> int:
    """Bytes this process already holds on the device (CUDA: reserved by the caching allocator; CPU: 0)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.memory_reserved(device_index(dev)))
    return 0


def device_index(dev: torch.device) -> int:
    """The CUDA index of ``dev`` (its own, else the current device's)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


def apply_memory_fraction(device: str | torch.device, fraction: float | None) -> None:
    """Caps this process's CUDA caching allocator at ``fraction`` of the card (nothing to cap elsewhere)."""
    check_memory_fraction(fraction)
    dev = torch.device(device)
    if fraction is not None and dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(fraction), device_index(dev))


def memory_budget(free: int | None, device: str | torch.device, fraction: float | None) -> int | None:
    """What this process may still take: ``free``, and with a share at most ``fraction x total - held``.

    Args:
        free: bytes free on the device now (None: unknown).
        device: the device.
        fraction: this process's share of the device's total memory (None: no share, everything free).
    """
    check_memory_fraction(fraction)
    if fraction is None:
        return free
    total = total_memory(device)
    if total is None:
        return free
    share = max(0, int(fraction * total) - held_memory(device))
    return share if free is None else min(free, share)


def _lock_path(device: torch.device) -> Path:
    """One lock file per physical GPU: ``CUDA_VISIBLE_DEVICES`` renumbers cards, their UUIDs stay."""
    props = torch.cuda.get_device_properties(device_index(device))
    uuid = str(getattr(props, "uuid", "")) or f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}-{device_index(device)}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", uuid)
    return Path(os.environ.get("LRAGENT_LOCK_DIR", tempfile.gettempdir())) / f"lragent-gpu-{name}.lock"


@contextmanager
def allocation_lock(device: str | torch.device) -> Iterator[None]:
    """Held while a process measures the free memory of a GPU and allocates what it sized (no-op off CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        yield
        return
    path = _lock_path(dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error of torch (any device)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


_TRIED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")


def oom_line(exc: BaseException, device: str | torch.device | None, options: str) -> str:
    """One line for an out-of-memory error: what was asked, what is free of what total, and what to change.

    Args:
        exc: the error.
        device: where it happened (None: CUDA's current device when there is one).
        options: what the user can try (``"a smaller --capacity, a larger --memory_fraction"``).
    """
    tried = _TRIED.search(str(exc))
    asked = f"allocating {tried.group(1)}" if tried else "an allocation"
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = str(dev)
    state = ""
    if dev.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device_index(dev))
        state = f": {free / GIB:.2f} GiB free of {total / GIB:.2f} GiB, {held_memory(dev) / GIB:.2f} GiB held here"
    return f"out of memory on {where} {asked}{state}; try {options}"
