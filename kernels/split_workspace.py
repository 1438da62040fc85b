"""Cached fp32 workspaces with one int32 counter per output tile, for kernels that split a reduction over several
programs and let the last program to finish combine the partials: one launch, no second kernel and no host
synchronisation (the decode attention's split-K merge, :mod:`kernels.flash_lora_decode`; the GEMVs' split K,
:mod:`kernels.fused_gemv`).

The contract a kernel keeps: each program stores its partial, then takes a ticket on its tile's counter
(``tl.atomic_add(..., sem="acq_rel")``); the program that draws the last ticket reads every partial in a fixed order
(the same bits whichever program finishes last) and sets the counter back to zero, so the next launch, or the next
replay of a captured graph, finds it zeroed. Two launches of one key running at once would share the partials and
the counters (a counter left off zero never lets its tile merge again), so every owner that may run beside another
(each engine of ``eval --concurrent_schemes``, one CUDA stream each) takes its workspaces inside
:func:`workspace_owner`: the owner's own buffers, captured into its own graphs, freed with the owner.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor

_Cache = dict[tuple, list]  # (device, *key) -> [fp32 workspace, int32 counters, counters_need_zeroing]
_SHARED: _Cache = {}  # outside any owner (kernel tests, a single engine's callers that set none)
_BY_OWNER: weakref.WeakKeyDictionary[object, _Cache] = weakref.WeakKeyDictionary()
_OWNER: contextvars.ContextVar[object | None] = contextvars.ContextVar("split_workspace_owner", default=None)


@contextlib.contextmanager
def workspace_owner(owner: object) -> Iterator[None]:
    """Within the block, :func:`split_workspace` hands out ``owner``'s own buffers (made on first use, dropped when
    ``owner`` is garbage-collected); ``owner`` must accept weak references."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


def _cache() -> _Cache:
    owner = _OWNER.get()
    if owner is None:
        return _SHARED
    cache = _BY_OWNER.get(owner)
    if cache is None:
        cache = _BY_OWNER[owner] = {}
    return cache


def split_workspace(key: tuple, numel: int, counters: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The cached ``(workspace, counters)`` of ``key`` on ``device`` (of the current :func:`workspace_owner`, if
    any): ``numel`` float32 elements and ``counters`` zeroed int32 counters, allocated on first use only (a key must
    fix both sizes).

    Allocated during graph capture, the counters' zeroing is a node of the graph that runs only at its replays: the
    first eager call after such a capture zeroes them itself."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cache = _cache()
    entry = cache.get((device, *key))
    if entry is None:
        ws = torch.empty(numel, dtype=torch.float32, device=device)
        cnt = torch.zeros(counters, dtype=torch.int32, device=device)
        entry = cache[(device, *key)] = [ws, cnt, capturing]
    elif entry[2] and not capturing:
        entry[1].zero_()
        entry[2] = False
    return entry[0], entry[1]
