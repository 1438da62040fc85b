"""Triton kernels with torch references.

``flash_lora_attention`` (Triton, CUDA) and ``flash_lora_attention_reference`` (eager PyTorch, any device)
compute attention over a base value cache plus a low-rank LoRA value cache (prefill, chunks); see
``kernels/flash_lora_attention.py``. ``flash_lora_decode`` / ``flash_lora_decode_reference`` do one batched decode
step over a static cache (per-row lengths, roles and slots; CUDA-graph capturable); see
``kernels/flash_lora_decode.py``. Importing this package never needs a GPU.
"""

from kernels.flash_lora_attention import flash_lora_attention, flash_lora_attention_reference
from kernels.flash_lora_decode import flash_lora_decode, flash_lora_decode_reference

__all__ = ["flash_lora_attention", "flash_lora_attention_reference", "flash_lora_decode", "flash_lora_decode_reference"]
