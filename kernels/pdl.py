"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later GPUs.

Why: a batch-1 decode step of an 8B model is a chain of about 200 short kernels (two norm GEMVs, two GEMVs, the
RoPE-and-store and the attention a layer), and between two of them the GPU idles while the next one launches and its
first programs start: 0.15 ms of an H100's 6.2 ms step in the profile (``results/engine_h100/decode_2026-11-28``),
more of the step on an H200, whose kernels are shorter. With PDL the next kernel is launched while the previous one
still runs (``cudaLaunchAttributeProgrammaticStreamSerialization``, which CUDA graphs keep as a programmatic edge);
its programs start, compute their offsets and wait in ``griddepcontrol.wait`` until the previous grid has finished
and its memory is visible. CUTLASS, TensorRT-LLM and FlashInfer launch their decode kernels this way.

The contract every kernel here keeps where its ``PDL`` flag is set: **every program calls** :func:`gdc_wait` **before
its first load or store of anything another kernel writes or reads** (so the previous grid's results are visible and
nothing it still reads is overwritten), which also makes each grid's end come after its predecessor's end (the chain
stays ordered through kernels that exit early); it calls ``gdc_launch_dependents`` once its main work is done, so the
next kernel's launch overlaps only its last stores. Kernels launched without PDL (cuBLAS, PyTorch's own) keep the
stream's order as before.

``LRAGENT_PDL=0`` launches them as before (to time the two side by side); the Triton interpreter (CPU tests) and GPUs
before compute capability 9 never use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import Tensor

PDL_ENV = "LRAGENT_PDL"
_CAPABLE: dict[int, bool] = {}


def pdl_setting(env: Mapping[str, str] | None = None) -> bool:
    """``LRAGENT_PDL``: unset, empty or ``1`` on; ``0`` off.

    Raises:
        ValueError: any other value, named with what is allowed.
    """
    raw = (os.environ if env is None else env).get(PDL_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV}={raw!r}: expected 1 (launch the decode kernels with PDL, the default) or 0")
    return raw != "0"


def pdl_switch(value: str | None = None) -> int:
    """``LRAGENT_PDL`` (or ``value``) as ``bench decode --plans`` records it: 1 on, 0 off.

    Raises:
        ValueError: a value :func:`pdl_setting` refuses.
    """
    return int(pdl_setting(None if value is None else {PDL_ENV: value}))


def use_pdl(t: Tensor) -> bool:
    """Whether a Triton kernel over ``t``'s device launches with PDL: a CUDA device of compute capability 9 or more
    (PDL's hardware), not under ``TRITON_INTERPRET=1``, and :func:`pdl_setting` on."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1" or not pdl_setting():
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def pdl_launch(t: Tensor) -> dict[str, bool]:
    """The two launch arguments of a kernel that keeps the contract above, from :func:`use_pdl`: its ``PDL``
    constexpr (the waits compiled in) and Triton's ``launch_pdl`` (the launch attribute), always alike: a launch with
    the attribute and no wait compiled in would read its predecessor's output early."""
    pdl = use_pdl(t)
    return {"PDL": pdl, "launch_pdl": pdl}
