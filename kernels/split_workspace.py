"""Cached fp32 workspaces with one int32 counter per output tile, for kernels that split a reduction over several
programs and let the last program to finish combine the partials: one launch, no second kernel and no host
synchronisation (the decode attention's split-K merge, :mod:`kernels.flash_lora_decode`; the GEMVs' split K,
:mod:`kernels.fused_gemv`).

The contract a kernel keeps: each program stores its partial, then takes a ticket on its tile's counter
(``tl.atomic_add(..., sem="acq_rel")``); the program that draws the last ticket reads every partial in a fixed order
(the same bits whichever program finishes last) and sets the counter back to zero, so the next launch, or the next
replay of a captured graph, finds it zeroed. One stream at a time per key: two launches of one shape running at once
would share the partials.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CACHE: dict[tuple, list] = {}  # (device, *key) -> [fp32 workspace, int32 counters, counters_need_zeroing]


def split_workspace(key: tuple, numel: int, counters: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The cached ``(workspace, counters)`` of ``key`` on ``device``: ``numel`` float32 elements and ``counters``
    zeroed int32 counters, allocated on first use only (a key must fix both sizes).

    Allocated during graph capture, the counters' zeroing is a node of the graph that runs only at its replays: the
    first eager call after such a capture zeroes them itself."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    entry = _CACHE.get((device, *key))
    if entry is None:
        ws = torch.empty(numel, dtype=torch.float32, device=device)
        cnt = torch.zeros(counters, dtype=torch.int32, device=device)
        entry = _CACHE[(device, *key)] = [ws, cnt, capturing]
    elif entry[2] and not capturing:
        entry[1].zero_()
        entry[2] = False
    return entry[0], entry[1]
