"""Triton kernels with torch references.

``kernels.flash_lora_attention.flash_lora_attention`` (Triton, CUDA) and ``flash_lora_attention_reference`` (eager
PyTorch, any device) compute attention over a base value cache plus a low-rank LoRA value cache (prefill, chunks).
``kernels.flash_lora_decode.flash_lora_decode`` / ``flash_lora_decode_reference`` do one batched decode step over a
static cache (per-row lengths, roles and slots; CUDA-graph capturable). ``kernels.fused_ops`` holds the fused
elementwise kernels of a decoder layer and ``kernels.fused_gemv`` the GEMVs with a norm or SiLU·mul inside.

Import the functions from their modules. The package re-exports nothing: a function re-exported under its module's
name would shadow the module (``import kernels.flash_lora_attention as m`` would then bind the function, and a test
patching ``m.flash_lora_attention`` would patch nothing the engine calls). Importing this package never needs a GPU.
"""
