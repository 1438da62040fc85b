"""The host thread pool of a process whose model runs on a GPU: a few threads, not one per core.

A GPU process's host work is many small tensor ops (kernel launches, autograd's bookkeeping, sampling, prompt
building); torch's OpenMP pool, as wide as the machine by default, only slows it down, and several such processes on
one host (DDP ranks, eval shards, a study's evaluations side by side) oversubscribe the cores. Measured: one Qwen-1.5B
eval on an H100 of a 64-core host (results/multi_gpu_h100x4, lease 5; same 180 HotpotQA episodes, same records) ran
its episode loop in 157 s at 64 threads, 68 s at 16 and 64 s at 4. vLLM and ``torchrun`` set ``OMP_NUM_THREADS=1``
where the user has not, for the same reason. Lightning's DDP gives each rank its share of the cores (it sets
``OMP_NUM_THREADS``: 16 threads a rank at 4 ranks on 64 cores), which this then leaves alone; a DDP fit at 64 threads a
rank was no slower than at 16 (results/ddp_embedded_h200x4_2026-11-28).

Stdlib only: the eval launcher imports this before torch.
"""

from __future__ import annotations

from collections.abc import Mapping

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
