"""Triton kernels with torch references.

``flash_lora_attention`` (Triton, CUDA) and ``flash_lora_attention_reference`` (eager PyTorch, any device)
compute attention over a base value cache plus a low-rank LoRA value cache; see
``kernels/flash_lora_attention.py``. Importing this package never needs a GPU.
"""

from kernels.flash_lora_attention import flash_lora_attention, flash_lora_attention_reference

__all__ = ["flash_lora_attention", "flash_lora_attention_reference"]
