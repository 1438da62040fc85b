"""The decode profile's bookkeeping on the CPU (tiny model): every class gets time from the ops the labels cover, the
labels are removed afterwards, and kernel names map to their classes (the CUDA pass is the GPU run's)."""

from __future__ import annotations

import torch
from conftest import tiny_multi_lora

from eval_suite import profile_decode as P
from lragent.decoder import DecoderEngine
from lragent.multi_lora import MultiLoraLinear


def test_eager_pass_attributes_time_to_every_class():
    model = tiny_multi_lora("tiny-llama", rank=4)
    before = (MultiLoraLinear.lora_input, DecoderEngine.__dict__["_norm"], DecoderEngine.logits)
    with torch.no_grad():
        row = P.profile_batch(model, "base_lr_shared", batch=2, context=16, steps=3, device=torch.device("cpu"))
    assert (MultiLoraLinear.lora_input, DecoderEngine.__dict__["_norm"], DecoderEngine.logits) == before
    ms = row["eager_ms_per_step_by_class"]
    assert set(ms) == set(P.CLASSES)
    for cls in ("GEMV (base weights)", "LoRA", "attention kernel", "norms/RoPE/SiLU", "LM head", "sampling"):
        assert ms[cls] > 0, (cls, ms)
    assert row["eager_wall_ms_per_step"] > 0


def test_kernel_names_map_to_classes():
    assert P.kernel_class("_flash_lora_decode_kernel") == "attention kernel"
    assert P.kernel_class("_rope_store_kernel") == "norms/RoPE/SiLU"
    assert P.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMV/GEMM (base, LoRA and LM head)"
    assert P.kernel_class("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "GEMV/GEMM (base, LoRA and LM head)"
    assert P.kernel_class("void at::native::bitonicSortKVInPlace<...>") == "sampling"
    assert P.kernel_class("void at::native::vectorized_elementwise_kernel<4, ...>") == (
        "other (embedding, adds, bookkeeping)"
    )
