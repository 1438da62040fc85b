"""Programmatic dependent launch of the decode kernels (kernels/pdl.py): the switch is parsed and named, never on where
there is no griddepcontrol (the CPU and its interpreter), and on a GPU the engine decodes bit for bit what it decodes
with plain launches (every kernel waits for its predecessor before touching memory)."""

from __future__ import annotations

import os

import pytest
import torch


def test_the_switch_is_0_or_1_and_anything_else_is_named(monkeypatch):
    from kernels.pdl import pdl_requested

    monkeypatch.delenv("LRAGENT_PDL", raising=False)
    assert pdl_requested() is False
    for value, expected in (("0", False), ("1", True), ("", False), (" 1 ", True)):
        monkeypatch.setenv("LRAGENT_PDL", value)
        assert pdl_requested() is expected
    for bad in ("2", "on", "true", "-1"):
        with pytest.raises(ValueError, match=rf"LRAGENT_PDL='{bad}': allowed 0 \(plain launches\) or 1"):
            pdl_requested(bad)


def test_a_cpu_tensor_never_launches_with_pdl(monkeypatch):
    """The interpreter has no griddepcontrol: on the CPU the prologue is compiled out even with the switch on."""
    from kernels.pdl import pdl_launch

    monkeypatch.setenv("LRAGENT_PDL", "1")
    assert pdl_launch(torch.zeros(2, dtype=torch.float16)) == {"USE_PDL": False}


def _decode(device: str, pdl: str, scheme: str, rows: int) -> list:
    from conftest import decode_rows, tiny_multi_lora

    os.environ["LRAGENT_PDL"] = pdl
    m = tiny_multi_lora("tiny-llama", b_std=0.3)
    m.to(device)
    m.model.half()
    return decode_rows(m, scheme, rows=rows, capacity=48, prompt_len=9, max_new_tokens=6)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_gemv", ["0", "2"])
def test_the_engine_decodes_bit_for_bit_the_same_with_pdl_on_a_gpu(monkeypatch, fused_gemv):
    """Decode steps captured as CUDA graphs, every Triton kernel of the step (norms or the fused GEMVs, RoPE-and-store,
    the decode attention, SiLU·mul) launched with PDL on a Hopper GPU: the same tokens and the same logits, bit for bit,
    as plain launches, for one and two rows and both shared schemes."""
    from kernels.pdl import pdl_launch

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    monkeypatch.setenv("LRAGENT_FUSED_GEMV", fused_gemv)
    monkeypatch.setenv("LRAGENT_PDL", "1")
    assert pdl_launch(torch.zeros(1, device="cuda")) == {"USE_PDL": True, "launch_pdl": True}
    for scheme in ("base_lr_shared", "full_shared"):
        for rows in (1, 2):  # _decode sets LRAGENT_PDL itself; monkeypatch restores the environment after the test
            plain, pdl = _decode("cuda", "0", scheme, rows), _decode("cuda", "1", scheme, rows)
            for a, b in zip(plain, pdl, strict=True):
                assert a.generated_ids == b.generated_ids, (scheme, rows)
                assert torch.equal(a.logits, b.logits), (scheme, rows)
