"""Programmatic dependent launch of the decode kernels (kernels/pdl.py): the switch, where it applies, and on a GPU
the same tokens and logits bit for bit with and without it, through kernels that really wait."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import decode_rows, tiny_multi_lora

from kernels.pdl import PDL_ENV, pdl_setting, use_pdl


def test_the_switch_reads_on_off_and_names_a_bad_value() -> None:
    assert pdl_setting({}) and pdl_setting({PDL_ENV: ""}) and pdl_setting({PDL_ENV: "1"})
    assert not pdl_setting({PDL_ENV: "0"})
    for bad in ("2", "yes", "off"):
        with pytest.raises(ValueError, match=rf"{PDL_ENV}='{bad}': expected 1 .* or 0"):
            pdl_setting({PDL_ENV: bad})


def test_never_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PDL_ENV, "1")
    assert not use_pdl(torch.zeros(2, dtype=torch.float16))


def _compiled_with_wait(fn) -> list[bool]:
    """For each compiled variant of the Triton function ``fn`` in this process: whether its PTX waits on the
    previous grid (``griddepcontrol.wait``, what ``PDL`` compiles in)."""
    found = []
    for cache in getattr(fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kernel in kernels.values():
            found.append("griddepcontrol.wait" in kernel.asm.get("ptx", ""))
    return found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 2])
def test_decode_with_and_without_pdl_is_bit_identical_and_the_kernels_wait(rows: int) -> None:
    """One and two rows of tiny LLaMA (fp16, q/v adapters, random B), both shared schemes, a 220-token prompt and 24
    new tokens under CUDA graphs, the attention split every 32 keys (``min_split_tiles=1``: 8 splits merged by the
    last, as at long contexts): the tokens and every logit equal with ``LRAGENT_PDL=1`` and ``0`` (PDL only moves
    launches; a wait placed after a load would read the previous kernel's output before it is written). On a GPU of
    compute capability 9 or more the decode attention, the RoPE-and-store and (one row) the fused GEMVs were compiled
    with the wait."""
    import kernels.flash_lora_decode as fld
    import kernels.fused_gemv as fg
    import kernels.fused_ops as fo

    saved = os.environ.get(PDL_ENV)
    plan = os.environ.get("LRAGENT_DECODE_PLAN")
    os.environ["LRAGENT_DECODE_PLAN"] = "min_split_tiles=1"
    fld._PLANS.clear()
    try:
        for scheme in ("base_lr_shared", "full_shared"):
            outs = {}
            for flag in ("0", "1"):
                os.environ[PDL_ENV] = flag
                m = tiny_multi_lora("tiny-llama", b_std=0.3).to("cuda")
                m.model.half()
                outs[flag] = decode_rows(m, scheme, rows=rows, capacity=280, prompt_len=220, max_new_tokens=24)
            for a, b in zip(outs["0"], outs["1"], strict=True):
                assert a.generated_ids == b.generated_ids, (scheme, a.generated_ids, b.generated_ids)
                assert torch.equal(a.logits, b.logits), scheme
    finally:
        for name, value in ((PDL_ENV, saved), ("LRAGENT_DECODE_PLAN", plan)):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        fld._PLANS.clear()
    if torch.cuda.get_device_capability()[0] >= 9:
        waiting = [fld._flash_lora_decode_kernel, fo._rope_store_kernel]
        waiting += [fg._rms_norm_gemv_kernel] if rows == 1 else []
        for fn in waiting:
            compiled = _compiled_with_wait(fn)
            assert True in compiled and False in compiled, (fn.__name__, compiled)  # PDL on and off both compiled
