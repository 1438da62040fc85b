"""Lightning modules, callbacks and CLI for multi-LoRA role training (thin adapters over :mod:`lragent`)."""

from lit_modules.export import ExportAdapters, export_adapters
from lit_modules.multi_lora_module import MultiLoraModule, TrainingConfig

__all__ = ["ExportAdapters", "MultiLoraModule", "TrainingConfig", "export_adapters"]
