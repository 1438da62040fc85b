"""Counting the Triton kernel launches a piece of code really makes, two independent ways.

- :func:`watch_launches` wraps the ``@triton.jit`` kernel objects in their modules' globals: every launcher indexes
  them there (``kernel[grid](...)``) at call time, so each launch, eager or recorded into a CUDA graph, is counted.
- :func:`gpu_kernel_counts` counts the kernels the GPU ran, by name, in a ``torch.profiler`` trace (CUPTI reports
  kernels launched by a CUDA graph replay too, one record per graph node).

The names of the kernels of each class are fixed here, next to the counting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# class -> (module, global names of the jit kernels the launchers index)
KERNELS = {
    "prefill": ("kernels.flash_lora_attention", ("_flash_lora_fwd_kernel", "_prefill_tuned", "_decode_tuned")),
    "decode": ("kernels.flash_lora_decode", ("_flash_lora_decode_kernel",)),
}
# class -> CUDA kernel names (Triton names a kernel after its jit function; autotuned wrappers run the same kernel)
GPU_NAMES = {"prefill": ("_flash_lora_fwd_kernel",), "decode": ("_flash_lora_decode_kernel",)}


class _CountingKernel:
    """Stands in for a jit kernel: ``self[grid](...)`` counts one launch, then launches the real kernel."""

    def __init__(self, kernel: object, counts: Counter, key: str) -> None:
        self._kernel, self._counts, self._key = kernel, counts, key

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def run(*args, **kwargs):
            self._counts[self._key] += 1
            return launch(*args, **kwargs)

        return run

    def __getattr__(self, name: str):
        return getattr(self._kernel, name)


def watch_launches(monkeypatch, classes: Iterable[str] = ("prefill", "decode")) -> Counter:
    """Counts launches per kernel class from now on (undone by ``monkeypatch``); returns the live counter."""
    import importlib

    counts: Counter = Counter({c: 0 for c in classes})
    for cls in classes:
        module_name, names = KERNELS[cls]
        module = importlib.import_module(module_name)
        for name in names:
            kernel = getattr(module, name, None)
            if kernel is None:
                raise AssertionError(f"{module_name}.{name} is missing: the kernel names in {__name__} are stale")
            monkeypatch.setattr(module, name, _CountingKernel(kernel, counts, cls))
    return counts


def gpu_kernel_counts(prof, classes: Iterable[str] = ("prefill", "decode")) -> Counter:
    """Kernels of each class the GPU ran in the trace of ``prof`` (a finished ``torch.profiler.profile``)."""
    from torch.autograd import DeviceType

    counts: Counter = Counter({c: 0 for c in classes})
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        for cls in classes:
            if any(evt.name.startswith(n) for n in GPU_NAMES[cls]):
                counts[cls] += 1
    return counts
