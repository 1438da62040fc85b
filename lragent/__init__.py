"""lragent core: shared-A multi-LoRA role adapters and KV caches shared across LoRA agents.

Plain PyTorch + transformers + peft; nothing here imports Lightning.
"""

from lragent.roles import RoleRouter
from lragent.schemes import SCHEMES, Scheme

__all__ = ["RoleRouter", "SCHEMES", "Scheme"]
__version__ = "0.1.0"
