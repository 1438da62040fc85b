"""lragent core: shared-A multi-LoRA role adapters and KV caches shared across LoRA agents.

Plain PyTorch + transformers + peft; nothing here imports Lightning. The names below load on first use, so that the
console entry (``lragent.cli_main``) starts without importing torch: ``eval --devices N`` launches its shards first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lragent.roles import RoleRouter
    from lragent.schemes import SCHEMES, Scheme

__all__ = ["RoleRouter", "SCHEMES", "Scheme"]
__version__ = "0.1.0"
_LAZY = {"RoleRouter": "lragent.roles", "SCHEMES": "lragent.schemes", "Scheme": "lragent.schemes"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lragent' has no attribute {name!r}")
