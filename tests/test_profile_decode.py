"""The decode profile's bookkeeping on the CPU (tiny model): every class gets time from the ops the labels cover, the
labels are removed afterwards, and kernel names map to their classes (the CUDA pass is the GPU run's)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_multi_lora

from eval_suite.bench import profile_decode as P
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
    assert P.kernel_class("_rms_norm_kernel") == "norms/RoPE/SiLU"
    # the GEMVs with the norm or SiLU·mul inside read a weight: GEMV time, not norm time (at batch 1 they were
    # counted as 3.4 ms of norms in the H100 profile at 155fbee)
    assert P.kernel_class("_rms_norm_gemv_kernel") == "GEMV/GEMM (base, LoRA and LM head)"
    assert P.kernel_class("_gemv_kernel") == "GEMV/GEMM (base, LoRA and LM head)"
    assert P.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMV/GEMM (base, LoRA and LM head)"
    assert P.kernel_class("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "GEMV/GEMM (base, LoRA and LM head)"
    assert P.kernel_class("void at::native::bitonicSortKVInPlace<...>") == "sampling"
    # first_argmax's two reductions (the chunk maxima, then the arg-max over them)
    assert P.kernel_class(
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<f"
    ) == ("sampling")
    assert P.kernel_class(
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<f"
    ) == ("sampling")
    assert P.kernel_class("void at::native::vectorized_elementwise_kernel<4, ...>") == (
        "other (embedding, adds, bookkeeping)"
    )


def test_graph_kernels_are_summed_per_class_and_counted_per_step():
    """The graph pass's bookkeeping: time per class and per name over the steps, launches per name and in all, idle
    as wall minus busy (never negative); the report shows the counts, and an older record without them still renders."""
    kernels = [("_flash_lora_decode_kernel", 15.0), ("_rms_norm_kernel", 2.0), ("_rms_norm_kernel", 2.0)] * 32
    out = P.summarize_kernels(kernels, steps=2, wall_ms=0.5)
    assert out["graph_kernels_per_step"] == 48
    assert out["graph_kernel_ms_per_step"] == (32 * 19.0) / 1e3 / 2
    assert out["graph_idle_ms_per_step"] == 0.5 - 0.304
    assert out["graph_ms_per_step_by_kernel_class"] == {"attention kernel": 0.24, "norms/RoPE/SiLU": 0.064}
    assert out["graph_top_kernels"] == [("_flash_lora_decode_kernel", 0.24, 16.0), ("_rms_norm_kernel", 0.064, 32.0)]
    assert P.summarize_kernels(kernels, steps=2, wall_ms=0.1)["graph_idle_ms_per_step"] == 0.0
    row = {"batch": 1, "eager_ms_per_step_by_class": dict.fromkeys(P.CLASSES, 0.0), "eager_wall_ms_per_step": 1.0,
           "graph_wall_ms_per_step": 0.5, **out}  # fmt: skip
    result = {"model": "m", "scheme": "base_lr_shared", "context": 8, "steps": 2, "rows": [row],
              "provenance": {"device": {"name": "fake"}, "dtype": "bfloat16"}}  # fmt: skip
    md = P._markdown(result)
    assert "| kernel launches (count) | 48 |" in md and "- `_rms_norm_kernel`: 0.064 (32 launches)" in md
    old_row = {k: v for k, v in row.items() if k != "graph_kernels_per_step"}
    old_row["graph_top_kernels"] = [(n, ms) for n, ms, _ in out["graph_top_kernels"]]
    old = P._markdown({**result, "rows": [old_row]})
    assert "kernel launches" not in old and "- `_rms_norm_kernel`: 0.064\n" in old


def test_plans_are_profiled_one_after_the_other_and_the_environment_restored(tmp_path, monkeypatch):
    """--plans: every batch under every plan on the one model, each row with its plan and the switches it ran with (the
    environment's where the plan names none), the environment as before afterwards, the plan in each column's title;
    a bad plan is refused before the model loads."""
    import json

    import pytest

    monkeypatch.setenv("LRAGENT_FUSED_GEMV", "0")
    monkeypatch.delenv("LRAGENT_DECODE_PLAN", raising=False)
    with pytest.raises(ValueError, match="LRAGENT_FUSED_GEMV='33'"):
        P.profile_decode(model="tiny-llama", device="cpu", plans=["fused_gemv=33"], out=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()
    P.profile_decode(model="tiny-llama", context=8, batches=[1, 2], steps=2, device="cpu",
                     plans=["", "fused_gemv=3,num_warps=4"], out=str(tmp_path))  # fmt: skip
    rows = json.loads((tmp_path / "decode_profile.json").read_text())["rows"]
    assert [(r["batch"], r["plan"]) for r in rows] == [(1, ""), (2, ""), (1, "fused_gemv=3,num_warps=4"),
                                                       (2, "fused_gemv=3,num_warps=4")]  # fmt: skip
    assert [r["fused_gemv_rows"] for r in rows] == [0, 0, 3, 3]
    assert os.environ["LRAGENT_FUSED_GEMV"] == "0" and "LRAGENT_DECODE_PLAN" not in os.environ
    assert "eager b=2 fused_gemv=3,num_warps=4 (ms/step)" in (tmp_path / "decode_profile.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "[0, 4]"], "batches, context and steps must be >= 1, got [0, 4], "),
        (["--context", "0"], "batches, context and steps must be >= 1, got [1, 32], 0, "),
    ],
)
def test_profile_decode_sizes_are_refused_naming_them(argv, message, capsys):
    from eval_suite.bench.profile_decode import main

    assert main([*argv, "--device", "cuda"]) == 2  # the sizes are checked first; without a GPU nothing runs after
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_profile_decode_on_cuda_without_a_gpu_is_refused_before_writing(device, tmp_path, monkeypatch):
    """``--device cuda`` or ``cuda:N`` without CUDA: one error naming the device and cpu, and no output folder."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "profile"
    with pytest.raises(ValueError, match=f"^--device '{device}' but CUDA is not available: allowed cpu$"):
        P.profile_decode(model="tiny-llama", batches=[1], context=16, steps=1, device=device, out=str(out))
    assert not out.exists()
