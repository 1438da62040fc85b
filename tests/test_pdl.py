"""Programmatic dependent launch of the decode kernels (kernels/pdl.py): the switch, where it applies, and on a GPU
the same tokens and logits bit for bit with and without it, through kernels that really wait."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import decode_rows, tiny_multi_lora

import kernels.pdl as pdl_mod
from kernels.pdl import PDL_ENV, pdl_launch, pdl_setting, pdl_switch, use_pdl


def test_the_switch_reads_on_off_and_names_a_bad_value() -> None:
    assert pdl_setting({}) and pdl_setting({PDL_ENV: ""}) and pdl_setting({PDL_ENV: "1"})
    assert not pdl_setting({PDL_ENV: "0"})
    for bad in ("2", "yes", "off"):
        with pytest.raises(ValueError, match=rf"{PDL_ENV}='{bad}': expected 1 .* or 0"):
            pdl_setting({PDL_ENV: bad})


def test_never_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PDL_ENV, "1")
    assert not use_pdl(torch.zeros(2, dtype=torch.float16))


def test_the_switch_reads_the_process_environment_without_a_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PDL_ENV, " 0 ")
    assert pdl_setting() is False
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_setting() is True
    monkeypatch.delenv(PDL_ENV)
    assert pdl_setting() is True
    monkeypatch.setenv(PDL_ENV, "on")
    with pytest.raises(ValueError, match=rf"{PDL_ENV}='on'"):
        pdl_setting()


def test_pdl_switch_records_the_value_given_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_switch("0") == 0 and type(pdl_switch("0")) is int  # the value given wins over the environment
    assert pdl_switch(None) == 1 and type(pdl_switch()) is int
    monkeypatch.setenv(PDL_ENV, "0")
    assert pdl_switch("1") == 1 and pdl_switch("") == 1
    assert pdl_switch() == 0
    with pytest.raises(ValueError, match=rf"{PDL_ENV}='2'"):
        pdl_switch("2")


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list:
    """cuda:0 is a Hopper (9.0), cuda:1 an Ampere (8.6), cuda:0 current; an empty capability cache; PDL on and the
    Triton interpreter off. Returns the indices get_device_capability was asked for (None: the current device)."""
    asked: list = []
    caps = {0: (9, 0), 1: (8, 6)}

    def capability(index=None):
        asked.append(index)
        return caps[0 if index is None else index]

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(pdl_mod, "_CAPABLE", {})
    monkeypatch.delenv(PDL_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return asked


def _on(device: torch.device) -> SimpleNamespace:
    return SimpleNamespace(is_cuda=True, device=device)


def test_pdl_only_on_a_device_of_compute_capability_9_asked_once(fake_gpus: list) -> None:
    hopper, ampere, current = _on(torch.device("cuda", 0)), _on(torch.device("cuda", 1)), _on(torch.device("cuda"))
    assert use_pdl(hopper) is True and use_pdl(ampere) is False
    assert use_pdl(current) is True  # an index-less device is the current one, cuda:0
    assert use_pdl(ampere) is False and use_pdl(hopper) is True
    assert fake_gpus == [0, 1] and pdl_mod._CAPABLE == {0: True, 1: False}  # each device's capability asked once


def test_no_pdl_when_switched_off_or_interpreted(fake_gpus: list, monkeypatch: pytest.MonkeyPatch) -> None:
    hopper = _on(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert use_pdl(hopper) is True
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_pdl(hopper) is False
    assert pdl_launch(hopper) == {"PDL": False, "launch_pdl": False}
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv(PDL_ENV, "0")
    assert use_pdl(hopper) is False
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_launch(hopper) == {"PDL": True, "launch_pdl": True}


def test_pdl_launch_sets_both_arguments_alike(fake_gpus: list) -> None:
    for t, on in ((_on(torch.device("cuda", 0)), True), (_on(torch.device("cuda", 1)), False), (torch.ones(1), False)):
        launch = pdl_launch(t)
        assert launch == {"PDL": on, "launch_pdl": on}
        assert launch["PDL"] is on and launch["launch_pdl"] is on


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


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _late_copy_kernel(SRC, DST, n, spins, BLOCK: tl.constexpr):
        """DST = SRC, written after letting the next kernel launch and spinning ``spins`` dependent steps."""
        tl.extra.cuda.gdc_wait()  # after the NaN fill
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start now
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        t = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(spins):
            t = t * 0.5 + 1.0
        x = tl.load(SRC + offs, mask=m)
        tl.store(DST + offs, tl.where(t > 0.0, x, x * 0), mask=m)

except ImportError:  # pragma: no cover
    triton = None


def _late_inputs(src: torch.Tensor, spins: int = 100_000) -> torch.Tensor:
    """A copy of ``src`` that a PDL-launched producer writes only after letting the next kernel launch and then
    spinning (about half a millisecond): a kernel that reads it before its ``gdc_wait`` reads the NaNs it starts as."""
    dst = torch.full_like(src, float("nan"))
    n = src.numel()
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src, dst, n, spins, BLOCK=1024, launch_pdl=True)
    return dst


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a CUDA GPU with PDL"
)
def test_every_pdl_kernel_waits_for_an_input_written_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode kernel launched with PDL right after a producer that lets it launch at once and writes its input
    half a millisecond later (NaN until then): its output is the one computed from the finished input, bit for bit.
    A kernel that loads before ``gdc_wait`` (or never waits) reads NaNs."""
    from test_fused_qkv_rope import _case, _fused

    from kernels.flash_lora_decode import flash_lora_decode
    from kernels.fused_gemv import gemv, rms_norm_linear, silu_mul_linear
    from kernels.fused_ops import rms_norm, rope_store, silu_mul

    monkeypatch.setenv(PDL_ENV, "1")
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    x, w, nw, gate = rnd(1, 4096), rnd(1024, 4096), rnd(4096), rnd(1, 4096)
    q, k, v, lens = rnd(1, 32, 128), rnd(1, 8, 2048, 128), rnd(1, 8, 2048, 128), torch.tensor([1900], device="cuda")
    cases = {
        "norm GEMV": (lambda a: rms_norm_linear(a, nw, 1e-5, w)[0], x),
        "GEMV": (lambda a: gemv(a, w), x),
        "SiLU·mul GEMV": (lambda a: silu_mul_linear(a, x, w), gate),
        "RMSNorm": (lambda a: rms_norm(a, nw, 1e-5)[0], x),
        "SiLU·mul": (lambda a: silu_mul(a, x), gate),
        "decode attention": (lambda a: flash_lora_decode(a, k, v, lens), q),
    }
    # the RoPE-and-store (queries written late) and the q/k/v launch with RoPE (its input row written late)
    pools = torch.zeros(2, 8, 64, 128, device="cuda", dtype=dt), torch.zeros(2, 8, 64, 128, device="cuda", dtype=dt)
    cos, sin, at = rnd(1, 128), rnd(1, 128), torch.tensor([1], device="cuda")
    cases["RoPE-and-store"] = (
        lambda a: rope_store(a, q[:, :8], q[:, 8:16], None, cos, sin, *pools, None, at, None, at),
        q,
    )
    # the q/k/v launch writes into pools made before the producer: a pool copied between them would be a kernel
    # without PDL, which waits for the producer to finish and so hides a launch that reads early
    qkv = _case("cuda", dt, 32, 8, 128, 4096, 8)
    made: dict[str, tuple] = {}
    for full in (False, True):
        cases[f"q/k/v GEMV with RoPE{', full cache' if full else ''}"] = (
            lambda a, full=full: _fused({**qkv, "h": a}, True, full=full, pools=made["pools"])[0],
            qkv["h"],
        )
    for name, (fn, src) in cases.items():
        made["pools"] = tuple(qkv[k].clone() for k in ("k_pool", "v_pool", "lr_pool"))
        expected = fn(src)
        made["pools"] = tuple(qkv[k].clone() for k in ("k_pool", "v_pool", "lr_pool"))
        torch.cuda.synchronize()
        got = fn(_late_inputs(src))
        torch.cuda.synchronize()
        assert not got.isnan().any(), f"{name}: read its input before the producer wrote it"
        assert torch.equal(got, expected), name
