"""Run a kernel launcher on the CUDA device of its first tensor.

Triton launches on the *current* CUDA device. A model on ``cuda:1`` in a process whose current device is still
``cuda:0`` (``eval --devices N`` shards, a user's ``model.to("cuda:1")``) would otherwise fail deep inside Triton with
"Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)". The guard switches device only when it must,
so the common one-GPU path costs one ``current_device()`` call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def on_tensor_device(fn: F) -> F:
    """Decorator: call ``fn`` with the CUDA device of its first argument (a tensor) made current.

    Args:
        fn: a function whose first positional argument is the tensor whose device the launch must use.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = args[0] if args else None
        index = t.device.index if getattr(t, "is_cuda", False) else None
        if index is not None and index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
