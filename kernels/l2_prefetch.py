"""L2 prefetch of a weight on a side stream, while the decode step's latency-bound kernels run (issue 38).

What it is for: at batch 1 the decode attention of an 8B model takes about 15 µs per layer on an H100
(``results/engine_h100/decode_profile_2026-11-27``) while its 2k-token cache needs about 3 µs of the card's
bandwidth: the memory system idles for most of it. The o projection that follows reads a 33.5 MB weight from DRAM
(13.9 µs in the engine); read from the 50 MB L2 the same GEMV took 7.95 µs (Triton) and 10.5 µs (cuBLAS) in
``bench_fused_gemv``'s first, L2-hot run. :func:`prefetch` streams the weight through L2 on a side stream that forks
from the compute stream after the q/k/v GEMV and joins it before the o projection, so the attention and the weight's
DRAM reads overlap. In a CUDA graph the fork and join are captured as two parallel branches.

What it computes: nothing the step uses. Each program reads its chunk of the tensor's 32-bit words through L2
(``.cg``) and folds them into an XOR checksum, stored only when a device flag is set (never, in the engine): the
loads stay in the kernel because their use depends on a value the compiler cannot know. :func:`checksum` runs the same
kernel with the flag set, which is how the tests prove that every word is read exactly once.

Limits: CUDA (or ``TRITON_INTERPRET=1`` on the CPU) tensors whose size is a multiple of 4 bytes, contiguous; whether
the weight is still in L2 when the GEMV reads it depends on what the attention reads meanwhile (its cache: 8.4 MB per
layer at 2k tokens of 8B shapes, 67 MB at 16k, where the prefetch also competes with it for bandwidth). Not yet run on
a GPU; off by default (``LRAGENT_L2_PREFETCH``, :func:`l2_prefetch_rows`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels.device_guard import on_tensor_device
from kernels.fused_ops import kernels_usable

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - platforms without Triton: no prefetch
    triton = None
    tl = None

ROWS_ENV = "LRAGENT_L2_PREFETCH"
"""The decoder's switch: the most rows of a decode step that prefetches its o projection's weight (0: off)."""

MAX_ROWS = 64
"""The widest step the switch may name: past it the attention reads far more than the weight (its cache), so the
prefetch could only compete with it for bandwidth."""

BLOCK_WORDS = 4096
"""32-bit words a program loads per loop step: 16 KB, 32 words (eight 16-byte loads) per thread at 4 warps, so one
program per SM keeps about 2 MB in flight on an H100, enough for the copy rate at DRAM latency."""


def l2_prefetch_rows(value: str | None = None) -> int:
    """The rows up to which decode steps prefetch (``LRAGENT_L2_PREFETCH``, or ``value``): 0 (off, also unset or
    empty) to :data:`MAX_ROWS`.

    Raises:
        ValueError: anything but an integer in 0..MAX_ROWS, named with what is allowed.
    """
    raw = (os.environ.get(ROWS_ENV, "") if value is None else value).strip() or "0"
    if not raw.isdigit() or int(raw) > MAX_ROWS:
        raise ValueError(f"{ROWS_ENV}={raw!r}: allowed 0 (off) to {MAX_ROWS}, the most rows of a prefetching step")
    return int(raw)


if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(SRC, n_words, SINK, FLAG, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (programs,): program p reads words [p·CHUNK, (p+1)·CHUNK) of SRC through L2 and XORs them; the
        checksum is stored at SINK[p] only where FLAG[0] != 0."""
        pid = tl.program_id(0)
        lo = pid.to(tl.int64) * CHUNK
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, CHUNK, BLOCK):
            idx = lo + start + offs
            acc ^= tl.load(SRC + idx, mask=idx < n_words, other=0, cache_modifier=".cg")
        total = tl.xor_sum(acc, axis=0)
        tl.store(SINK + pid, total, mask=tl.load(FLAG) != 0)


_SINKS: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, programs) -> (sink, flag = 0), made once (before capture)
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs, so that chunk edges are crossed


def _words(t: Tensor) -> Tensor:
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        raise ValueError(f"prefetch needs a contiguous tensor of whole 32-bit words, got {tuple(t.shape)} {t.dtype}")
    return t.view(-1).view(torch.int32)


def _launch(t: Tensor, programs: int, flag: Tensor, sink: Tensor) -> None:
    words = _words(t)
    n = words.numel()
    chunk = max(1, -(-n // programs))
    chunk = -(-chunk // BLOCK_WORDS) * BLOCK_WORDS if chunk > BLOCK_WORDS else triton.next_power_of_2(chunk)
    block = min(BLOCK_WORDS, chunk)
    _l2_prefetch_kernel[(programs,)](words, n, sink, flag, CHUNK=chunk, BLOCK=block, num_warps=4)


@on_tensor_device
def checksum(t: Tensor, programs: int | None = None) -> int:
    """The XOR of all 32-bit words of ``t``, computed by the prefetch kernel with its flag set (the tests' proof that
    it reads every word once, against numpy's ``bitwise_xor`` reduction).

    Args:
        t: any contiguous tensor whose size is a multiple of 4 bytes.
        programs: programs launched (default: the SM count on CUDA, 4 under the interpreter).

    Returns:
        The checksum as a Python int (int32 range).
    """
    programs = programs or _programs(t.device)
    sink = torch.zeros(programs, dtype=torch.int32, device=t.device)
    flag = torch.ones(1, dtype=torch.int32, device=t.device)
    _launch(t, programs, flag, sink)
    out = 0
    for v in sink.tolist():
        out ^= v
    return out


@on_tensor_device
def prefetch(t: Tensor) -> None:
    """Reads every byte of ``t`` through L2 on the current stream (one launch, one program per SM), storing nothing.

    Args:
        t: the weight, contiguous, a multiple of 4 bytes.
    """
    programs = _programs(t.device)
    key = (t.device, programs)
    if key not in _SINKS:
        _SINKS[key] = (torch.zeros(programs, dtype=torch.int32, device=t.device),
                       torch.zeros(1, dtype=torch.int32, device=t.device))  # fmt: skip
    sink, flag = _SINKS[key]
    _launch(t, programs, flag, sink)


class PrefetchFork:
    """Prefetches a weight on a side stream from now until :meth:`join` (CUDA; elsewhere it runs in line).

    The side stream first waits for the compute stream (what was enqueued before the fork, the q/k/v GEMV, has written
    its outputs and read its weight), then launches :func:`prefetch`; :meth:`join` makes the compute stream wait for
    it, before the GEMV that reads the weight. Side streams are made once per device, on first use: the engine's two
    warm-up steps come before its graph capture, so none is created while capturing.

    Args:
        weight: the weight the next GEMV reads.
    """

    def __init__(self, weight: Tensor) -> None:
        self._main = None
        if not kernels_usable(weight):
            return  # nothing to prefetch into (a CPU run without the interpreter; fp32)
        if weight.is_cuda:
            dev = weight.device
            if dev not in _SIDE_STREAMS:
                _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
            side = _SIDE_STREAMS[dev]
            self._main = torch.cuda.current_stream(dev)
            side.wait_stream(self._main)
            with torch.cuda.stream(side):
                prefetch(weight)
            self._side = side
        else:
            prefetch(weight)

    def join(self) -> None:
        """The compute stream waits for the prefetch."""
        if self._main is not None:
            self._main.wait_stream(self._side)
