"""The host thread pool of a process whose model runs on a GPU: a few threads, not one per core.

A GPU process's host work is many small tensor ops (kernel launches, autograd's bookkeeping, sampling, prompt
building); torch's OpenMP pool, as wide as the machine by default, only slows it down, and several such processes on
one host (DDP ranks, eval shards, a study's evaluations side by side) oversubscribe the cores. Measured: one Qwen-1.5B
eval on an H100 of a 64-core host (results/multi_gpu_h100x4, lease 5; same 180 HotpotQA episodes, same records) ran
its episode loop in 157 s at 64 threads, 68 s at 16 and 64 s at 4. vLLM and ``torchrun`` set ``OMP_NUM_THREADS=1``
where the user has not, for the same reason. Lightning's DDP gives each rank its share of the cores (it sets
``OMP_NUM_THREADS``: 16 threads a rank at 4 ranks on 64 cores), which this then leaves alone; a DDP fit at 64 threads a
rank was no slower than at 16 (results/ddp_embedded_h200x4_2026-11-28).

Opt-in, for a host that runs one job: ``LRAGENT_PIN_CORES=1`` gives each local rank of a several-GPU fit its own
contiguous share of the physical cores it may use (:func:`rank_cpu_share`), so that the ranks' host threads, whose
pace sets a small model's step, do not share cores or hyperthread siblings. Not by default: two jobs on one host
would pin their ranks onto the same cores.

Stdlib only: the eval launcher imports this before torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

PIN_ENV = "LRAGENT_PIN_CORES"

GPU_HOST_THREADS = 4
"""The most torch threads a process whose model runs on a GPU takes, unless the user set ``OMP_NUM_THREADS``."""


def host_threads(device: str, env: Mapping[str, str], current: int) -> int | None:
    """The torch thread count a process should take, or None to keep ``current``.

    Args:
        device: where its model runs (``cuda``, ``cuda:1``, ``cpu``, ...).
        env: its environment: ``OMP_NUM_THREADS`` set there is the user's choice and holds.
        current: ``torch.get_num_threads()`` now.

    Returns:
        :data:`GPU_HOST_THREADS` for a GPU process with a wider pool; None otherwise (a CPU process keeps its pool:
        there the model's own matmuls use it).
    """
    if not str(device).startswith("cuda") or env.get("OMP_NUM_THREADS"):
        return None
    return GPU_HOST_THREADS if current > GPU_HOST_THREADS else None


def physical_core(cpu: int, sys_cpu: Path = Path("/sys/devices/system/cpu")) -> tuple[int, int]:
    """``(package, core)`` of a logical CPU from sysfs; ``(0, cpu)`` where the topology is not readable."""
    top = sys_cpu / f"cpu{cpu}" / "topology"
    try:
        return int((top / "physical_package_id").read_text()), int((top / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu


def rank_cpu_share(allowed: Sequence[int], core_of: Mapping[int, tuple[int, int]], rank: int, ranks: int) -> list[int]:
    """The logical CPUs of local rank ``rank`` of ``ranks``: the allowed CPUs grouped by physical core (siblings
    together), the cores in package-then-CPU order split into ``ranks`` contiguous runs as equal as they go.

    Args:
        allowed: the CPUs the process may use (``os.sched_getaffinity(0)``).
        core_of: ``(package, core)`` of each allowed CPU (:func:`physical_core`).
        rank: this process's local rank, ``0 <= rank < ranks``.
        ranks: local ranks on this host.

    Returns:
        The share, sorted; every allowed CPU when there are fewer physical cores than ranks.
    """
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of the {ranks} local ranks")
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(allowed):
        cores.setdefault(core_of[cpu], []).append(cpu)
    groups = sorted(cores.values(), key=lambda cpus: (core_of[cpus[0]][0], cpus[0]))
    if len(groups) < ranks:
        return sorted(allowed)
    lo, hi = rank * len(groups) // ranks, (rank + 1) * len(groups) // ranks
    return sorted(cpu for cpus in groups[lo:hi] for cpu in cpus)


def pin_requested(env: Mapping[str, str]) -> bool:
    """``LRAGENT_PIN_CORES``: ``1`` asks for pinning; unset, empty or ``0`` not.

    Raises:
        ValueError: any other value, named with what is allowed.
    """
    flag = env.get(PIN_ENV, "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{PIN_ENV}={flag!r}: expected 1 (pin each local rank to its share of the cores) or 0")
    return flag == "1"


def pin_rank(rank: int, ranks: int, env: Mapping[str, str]) -> list[int] | None:
    """Pins the calling thread, and the threads it starts from then on, to this rank's :func:`rank_cpu_share` when
    ``LRAGENT_PIN_CORES=1`` and there are several local ranks (the fit calls it from its main thread in ``setup``,
    before the data loader's workers); the CPUs it took, or None (not asked, one rank, or a platform without CPU
    affinity)."""
    if not pin_requested(env) or ranks < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    share = rank_cpu_share(allowed, {cpu: physical_core(cpu) for cpu in allowed}, rank, ranks)
    os.sched_setaffinity(0, share)
    return share
