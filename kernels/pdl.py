"""Programmatic dependent launch (PDL) of the decode step's Triton kernels (issue 38; off by default).

Why: a CUDA-graph decode step of an 8B model at batch 1 is about 230 kernels, and the GPU idles about 1 µs between
each kernel and the next (0.28 ms of a 6.86 ms step on an H100, ``results/engine_h100/decode_profile_2026-11-27``):
a kernel's blocks are scheduled only once the previous kernel has finished and its writes are flushed. With PDL
(Hopper and later) a kernel launched with the attribute is scheduled while the one before it still runs; it waits at
``gdc_wait()`` (PTX ``griddepcontrol.wait``) until that kernel has completed and its memory is visible, so it computes
exactly what it computed before; only the launch and the block scheduling overlap the previous kernel's tail.

How the kernels use it: each one calls :func:`pdl_prologue` first, before touching memory (a wait, then
``gdc_launch_dependents()``, which lets the next PDL kernel be scheduled as this one's blocks start). Waiting first also
covers the reverse hazard (writing a buffer the previous kernel still reads). The launchers pass
``**pdl_launch(tensor)``: ``USE_PDL`` (the prologue compiled in or not) and, when on, ``launch_pdl=True``. cuBLAS and
torch kernels are launched as before; after one of them a PDL kernel simply starts when it ends.

Limits: CUDA devices of compute capability 9.0 and later, Triton with ``triton.language.extra.cuda.gdc_wait``; the
interpreter has no griddepcontrol, so on the CPU it is always off. ``LRAGENT_PDL=1`` turns it on; it is read at every
launch, so a CUDA graph keeps the setting it was captured with. Not yet timed on a GPU.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

try:
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:  # griddepcontrol without the launch attribute
        raise ImportError("launch_pdl")
except ImportError:  # pragma: no cover - a Triton without PDL: it cannot be turned on
    gdc_wait = gdc_launch_dependents = None

ENV = "LRAGENT_PDL"
"""The switch: ``1`` launches the decode step's Triton kernels with PDL, ``0`` (or unset) as plain launches."""


def pdl_requested(value: str | None = None) -> bool:
    """Whether ``LRAGENT_PDL`` (or ``value``) asks for PDL.

    Raises:
        ValueError: anything but ``0``, ``1`` or empty, named with what is allowed; ``1`` with a Triton without PDL
            (``launch_pdl`` and ``griddepcontrol``).
    """
    raw = (os.environ.get(ENV, "") if value is None else value).strip() or "0"
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV}={raw!r}: allowed 0 (plain launches) or 1 (programmatic dependent launch)")
    if raw == "1" and gdc_wait is None:
        version = getattr(triton, "__version__", "not installed")
        raise ValueError(f"{ENV}=1 needs Triton's PDL (launch_pdl, extra.cuda.gdc_wait), not in Triton {version}")
    return raw == "1"


def pdl_launch(t: Tensor) -> dict:
    """The launch arguments of a kernel that reads ``t``: ``{"USE_PDL": False}``, or with PDL on, a CUDA tensor and a
    device of compute capability >= 9.0, ``{"USE_PDL": True, "launch_pdl": True}``."""
    on = t.is_cuda and pdl_requested() and torch.cuda.get_device_capability(t.device)[0] >= 9
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def pdl_prologue(USE_PDL: tl.constexpr):
        """First thing in a kernel: wait for the previous kernel's completion and memory, then let the next one be
        scheduled (both no-ops in a launch without the PDL attribute)."""
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()
