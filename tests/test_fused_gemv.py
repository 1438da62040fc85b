"""RMSNorm and SiLU·mul fused into the GEMV that reads them (kernels/fused_gemv.py): each output is the float64 product
of the unfused path's input and the weight, rounded once, up to what the unfused elementwise kernels' own last-unit
differences can move it; the residual sum comes back exact; more rows than the kernel takes go the unfused way."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import run_under_interpreter

from kernels.fused_gemv import MAX_ROWS, gemv, rms_norm_linear, silu_mul_linear
from kernels.fused_ops import rms_norm_reference, silu_mul_reference

EPS = 1e-5


def _close(y: torch.Tensor, x_in: torch.Tensor, w: torch.Tensor, add: torch.Tensor | None = None) -> None:
    """``y`` is ``x_in @ wᵀ (+ add)`` (float64, rounded to y's dtype) to one unit in the last place, plus the bound
    that last-unit differences of the input elements can add (2^-mantissa · Σ|w·x|)."""
    exact = x_in.double() @ w.double().T + (0 if add is None else add.double())
    mant = torch.finfo(y.dtype).eps  # 2^-mantissa bits
    bound = mant * exact.abs() + mant * (x_in.double().abs() @ w.double().abs().T) + torch.finfo(y.dtype).tiny
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, where the bound is {bound[err > bound].min():.3g}"


def _check_all(device: str, dtype: torch.dtype, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    w = rand(n, k, scale=k**-0.5)
    norm_w = rand(k, scale=0.5) + 1
    # one row (CUDA cores), a few and a full 16-row block (one tensor-core dot), one past it and a full 32-row block
    # (a dot over 32 rows, its K block halved: 600 inputs take three K steps, the last one partial)
    for rows in (1, 3, 16, 17, 32):
        x, res = rand(rows, k), rand(rows, k)
        for residual in (None, res):
            y, h = rms_norm_linear(x, norm_w, EPS, w, residual)
            normed, h_ref = rms_norm_reference(x, norm_w, EPS, residual)
            assert torch.equal(h, h_ref)  # x + residual, rounded as the unfused kernel does
            assert y.shape == (rows, n) and y.dtype == dtype
            _close(y, normed, w)
        gu = rand(rows, 2 * k)  # a fused gate/up output: gate and up are strided column slices of it
        gate, up = gu[:, :k], gu[:, k:]
        y = silu_mul_linear(gate, up, w)
        assert y.shape == (rows, n)
        _close(y, silu_mul_reference(gate, up), w)
        # with the residual stream added before the one rounding (the decoder's down projection, as addmm)
        res_out = rand(rows, n)
        y = silu_mul_linear(gate, up, w, residual=res_out)
        _close(y, silu_mul_reference(gate, up), w, add=res_out)
        _close(gemv(x, w), x, w)  # the plain kernel they are built on
        from kernels.fused_gemv import DEFAULT_CONFIG, NORM_CONFIG, GemvConfig

        if rows > 1:  # several rows at the one-row launches too (16 outputs per program, not ROWS_CONFIG's 64)
            _close(gemv(x, w, config=DEFAULT_CONFIG), x, w)
            normed, _ = rms_norm_reference(x, norm_w, EPS, res)
            _close(rms_norm_linear(x, norm_w, EPS, w, res, config=NORM_CONFIG)[0], normed, w)
        # the sum over K deferred to after the loop (one row; ignored with several): all three kernels
        deferred = GemvConfig(block_n=16, block_k=256, num_warps=8, deferred=1)
        _close(gemv(x, w, config=deferred), x, w)
        normed, _ = rms_norm_reference(x, norm_w, EPS, res)
        _close(rms_norm_linear(x, norm_w, EPS, w, res, config=deferred)[0], normed, w)
        _close(silu_mul_linear(gate, up, w, residual=res_out, config=deferred), silu_mul_reference(gate, up), w,
               add=res_out)  # fmt: skip
        # K split over programs, the last of each output block adding the partials in split order: 600 inputs in
        # 256-wide blocks over 3 splits (256, 256, 88), in 128-wide blocks over 4 (256, 256, 88 and an empty one);
        # each call twice, the same bits (the counters back at zero after a launch; the sum's order fixed)
        for split in (GemvConfig(block_n=16, block_k=256, split_k=3), GemvConfig(block_k=128, deferred=1, split_k=4)):
            normed, h_ref = rms_norm_reference(x, norm_w, EPS, res)
            runs = []
            for _ in range(2):
                y, h = rms_norm_linear(x, norm_w, EPS, w, res, config=split)
                assert torch.equal(h, h_ref)  # written once, by the first program of the first split
                _close(y, normed, w)
                y_silu = silu_mul_linear(gate, up, w, residual=res_out, config=split)
                _close(y_silu, silu_mul_reference(gate, up), w, add=res_out)
                y_plain = gemv(x, w, config=split)
                _close(y_plain, x, w)
                runs.append((y, y_silu, y_plain))
            assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
        if rows == 1:  # every launch measured for a GPU model (kernels.fused_gemv.DEVICE_LAUNCHES), all three kernels
            from kernels.fused_gemv import DEVICE_LAUNCHES, GemvConfig

            launches = {c for t in DEVICE_LAUNCHES.values() for c in vars(t).values() if isinstance(c, GemvConfig)}
            for launch in launches:
                _close(gemv(x, w, config=launch), x, w)
                _close(rms_norm_linear(x, norm_w, EPS, w, res, config=launch)[0], normed, w)
                _close(silu_mul_linear(gate, up, w, residual=res_out, config=launch), silu_mul_reference(gate, up),
                       w, add=res_out)  # fmt: skip
    # a batch past MAX_ROWS (and a (B, T, K) input) goes the unfused way: the same as norm then linear
    x = rand(2, MAX_ROWS, k)
    y, _ = rms_norm_linear(x, norm_w, EPS, w)
    normed, _ = rms_norm_reference(x, norm_w, EPS)
    _close(y.reshape(-1, n), normed.reshape(-1, k), w)


def test_fused_gemv_under_the_interpreter():
    """The Triton kernels under TRITON_INTERPRET=1 (a fresh process: the flag is read at import), with K past one
    K block (512) and N not a multiple of the 8-output block."""
    run_under_interpreter("import torch, tests.test_fused_gemv as t; t._check_all('cpu', torch.float16, k=600, n=37)")


def test_a_split_workspace_is_cached_per_key_with_zeroed_counters():
    """One (workspace, counters) pair per key and device, made once; its counters start at zero."""
    from kernels.split_workspace import split_workspace

    cpu = torch.device("cpu")
    ws, cnt = split_workspace(("test", 3), 12, 5, cpu)
    assert ws.dtype == torch.float32 and ws.numel() == 12 and torch.equal(cnt, torch.zeros(5, dtype=torch.int32))
    cnt.fill_(2)
    again = split_workspace(("test", 3), 12, 5, cpu)
    assert again[0] is ws and again[1] is cnt  # the same buffers: the kernels keep the counters at zero themselves
    other = split_workspace(("test", 4), 12, 5, cpu)
    assert other[0] is not ws and not other[1].any()


def test_each_workspace_owner_gets_its_own_buffers_freed_with_it():
    """Inside ``workspace_owner(o)`` a key gives o's own buffers (the same ones on every call within o), never the
    shared ones nor another owner's: two engines on two CUDA streams must not share partials or counters. An owner's
    buffers go when it is collected."""
    import gc

    from kernels import split_workspace as sw

    class Owner:
        pass

    cpu = torch.device("cpu")
    shared = sw.split_workspace(("owned", 1), 8, 3, cpu)
    a, b = Owner(), Owner()
    with sw.workspace_owner(a):
        ws_a, cnt_a = sw.split_workspace(("owned", 1), 8, 3, cpu)
        with sw.workspace_owner(b):  # nested: the inner owner's
            ws_b, _ = sw.split_workspace(("owned", 1), 8, 3, cpu)
        again = sw.split_workspace(("owned", 1), 8, 3, cpu)  # back to a's once b's block ends
    assert again[0] is ws_a and again[1] is cnt_a
    assert len({id(ws_a), id(ws_b), id(shared[0])}) == 3
    assert sw.split_workspace(("owned", 1), 8, 3, cpu)[0] is shared[0]  # outside every owner: the shared one
    assert not cnt_a.any()
    del a, ws_a, cnt_a, again
    gc.collect()
    assert b in sw._BY_OWNER and len([o for o in sw._BY_OWNER if isinstance(o, Owner)]) == 1


def test_without_triton_kernels_the_cpu_path_is_norm_then_linear():
    x, norm_w, w = torch.randn(2, 16), torch.rand(16) + 0.5, torch.randn(5, 16)
    y, h = rms_norm_linear(x, norm_w, EPS, w)
    assert torch.equal(y, torch.nn.functional.linear(rms_norm_reference(x, norm_w, EPS)[0], w)) and h is x
    g, u, res = torch.randn(2, 16), torch.randn(2, 16), torch.randn(2, 5)
    assert torch.equal(silu_mul_linear(g, u, w), torch.nn.functional.linear(silu_mul_reference(g, u), w))
    assert torch.equal(silu_mul_linear(g, u, w, residual=res), torch.addmm(res, silu_mul_reference(g, u), w.t()))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("block_n=3", "block_n must be a power of two"),
        ("block_k=0", "'block_k=0' must be one of"),
        ("warps=4", "'warps=4' must be one of"),
        ("deferred=2", "deferred must be 0 or 1"),
        ("split_k=0", "'split_k=0' must be one of"),
    ],
)
def test_a_bad_launch_config_is_named(spec, message):
    from eval_suite.bench.fused_gemv import parse_config

    assert parse_config("block_n=16,num_warps=8") == type(parse_config(""))(block_n=16, num_warps=8)
    assert parse_config("block_n=64,split_k=4").split_k == 4
    with pytest.raises(ValueError, match=message):
        parse_config(spec)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(4096, 6160), (14336, 4096), (576, 1539), (4096, 28672)])
def test_fused_gemv_cuda(dtype, k, n):
    _check_all("cuda", dtype, k=k, n=n)


def _engine_check(device: str, gate_up_fused: bool = True) -> dict[str, int]:
    """Decode with LRAGENT_FUSED_GEMV 0, 2 and 1 (two rows of different roles, tiny LLaMA with q/v adapters and
    norms that differ): at 2 the same tokens as 0, logits within 2e-3, the fused kernels used (their calls counted)
    and the o projection on the Triton GEMV, one call per fused norm pair; at 1 (steps of one row only) a two-row step
    keeps the unfused path: no fused call, no Triton GEMV, the same logits as 0. ``gate_up_fused=False``: the GPU's
    table leaves gate/up unfused (``kernels.fused_gemv.fuses_norm_gemv`` says so): its norm runs as the RMSNorm kernel,
    the q/k/v norm and the SiLU·mul stay fused, the same tokens and logits within 2e-3."""
    from conftest import decode_under_switch

    import kernels.fused_gemv as fg

    calls = {"norm": 0, "silu": 0, "o": 0}
    raw_norm, raw_silu, raw_gemv = fg.rms_norm_linear, fg.silu_mul_linear, fg.gemv

    def norm_spy(x, *a, **kw):
        calls["norm"] += fg._fusable(x, a[2])
        return raw_norm(x, *a, **kw)

    def silu_spy(g, u, w, **kw):
        calls["silu"] += fg._fusable(g, w)
        return raw_silu(g, u, w, **kw)

    def gemv_spy(x, w, *a, **kw):  # the decoder's only plain-GEMV call: o_proj (no norm before it)
        calls["o"] += fg._fusable(x, w) and w.shape == (x.shape[-1], x.shape[-1])
        return raw_gemv(x, w, *a, **kw)

    def distinct_norms(m) -> None:  # norms that differ from each other (a tiny model's are ones)
        g = torch.Generator().manual_seed(3)
        for layer in m.model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.data.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)

    raw_fuses = fg.fuses_norm_gemv
    fg.rms_norm_linear, fg.silu_mul_linear, fg.gemv = norm_spy, silu_spy, gemv_spy
    if not gate_up_fused:  # a tiny gate/up is never wide: the table's answer for a wide one, given
        fg.fuses_norm_gemv = lambda x, n_out: False
    try:
        counted = decode_under_switch("LRAGENT_FUSED_GEMV", device, calls, prepare=distinct_norms)
    finally:
        fg.rms_norm_linear, fg.silu_mul_linear, fg.gemv = raw_norm, raw_silu, raw_gemv
        fg.fuses_norm_gemv = raw_fuses
    for scheme in ("base_lr_shared", "full_shared"):
        assert counted[(scheme, "1")] == counted[(scheme, "0")] == {"norm": 0, "silu": 0, "o": 0}, counted
    # per decode step and layer: the input norm in the q/k/v GEMV and the post-attention norm in gate/up (unless the
    # table leaves gate/up to cuBLAS), SiLU in down, o_proj on the plain GEMV
    norms_a_layer = 2 if gate_up_fused else 1
    assert calls["norm"] > 0 and calls["norm"] == norms_a_layer * calls["silu"] == norms_a_layer * calls["o"], calls
    return calls


@pytest.mark.parametrize("gate_up_fused", [True, False])
def test_the_engine_with_norms_and_silu_in_the_gemvs_decodes_the_same_under_the_interpreter(gate_up_fused):
    """fp16 under TRITON_INTERPRET=1 (a fresh process): with LRAGENT_FUSED_GEMV=2 each two-row decode step's RMSNorms
    and SiLU·mul run inside the q/k/v, gate/up and down GEMVs (through the Triton kernels, two rows of different roles,
    the shared A rows of q and v in the q/k/v GEMV) and the engine gives the unfused path's tokens and logits. One
    gate/up layout per test (each its own interpreter process): the two together outlast a minute."""
    code = f"import tests.test_fused_gemv as t; print('ok', t._engine_check('cpu', {gate_up_fused}))"
    assert run_under_interpreter(code).startswith("ok")


@pytest.mark.gpu
@pytest.mark.parametrize("gate_up_fused", [True, False])
def test_the_engine_with_norms_and_silu_in_the_gemvs_decodes_the_same_on_a_gpu(gate_up_fused):
    """The same on a GPU, decode steps captured and replayed as CUDA graphs."""
    _engine_check("cuda", gate_up_fused)


def test_a_wide_norm_gemv_is_left_to_cublas_where_the_gpus_table_says(monkeypatch):
    """``wide_norm_fused``: fused everywhere (several rows, narrow GEMVs, the interpreter, GPUs not in the table, an
    entry that says fused) except a wide one-row norm GEMV on a GPU whose entry says ``wide_unfused``;
    ``LRAGENT_GEMV_WIDE`` forces either way, ``LRAGENT_GEMV_TABLE=0`` drops the entry; a bad value is named."""
    import dataclasses

    import kernels.fused_gemv as fg

    for env in (fg.WIDE_ENV, fg.TABLE_ENV):
        monkeypatch.delenv(env, raising=False)
    entry = fg.DEVICE_LAUNCHES["H200"]
    assert entry.wide_unfused and not fg.wide_norm_fused(1, 28672, "NVIDIA H200", 132)  # as shipped (its docstring)
    monkeypatch.setitem(fg.DEVICE_LAUNCHES, "H200", dataclasses.replace(entry, wide_unfused=True))
    monkeypatch.setattr(fg, "device_launches", fg.device_launches.__wrapped__)  # uncached: the entry changes below
    h200 = ("NVIDIA H200", 132)
    assert not fg.wide_norm_fused(1, 28672, *h200)  # the 8B gate/up
    assert fg.wide_norm_fused(2, 28672, *h200)  # several rows
    assert fg.wide_norm_fused(1, 6160, *h200)  # the 8B q/k/v: not wide
    assert fg.wide_norm_fused(1, 28672, "NVIDIA H100 80GB HBM3", 132)  # not in the table
    assert fg.wide_norm_fused(1, 28672)  # the interpreter
    monkeypatch.setenv(fg.TABLE_ENV, "0")
    assert fg.wide_norm_fused(1, 28672, *h200)
    monkeypatch.delenv(fg.TABLE_ENV)
    monkeypatch.setenv(fg.WIDE_ENV, "1")
    assert fg.wide_norm_fused(1, 28672, *h200)
    monkeypatch.setenv(fg.WIDE_ENV, "0")
    assert not fg.wide_norm_fused(1, 28672, "NVIDIA H100 80GB HBM3", 132)
    assert fg.wide_norm_fused(1, 6160, *h200)  # forcing reaches the wide GEMVs only
    monkeypatch.setitem(fg.DEVICE_LAUNCHES, "H200", dataclasses.replace(entry, wide_unfused=False))
    monkeypatch.delenv(fg.WIDE_ENV)
    assert fg.wide_norm_fused(1, 28672, *h200)
    assert fg.gemv_wide_setting("") == -1 and fg.gemv_wide_setting(" 0 ") == 0
    for bad in ("2", "yes"):
        with pytest.raises(ValueError, match=rf"LRAGENT_GEMV_WIDE='{bad}': expected 1 \(fused\), 0 .* or unset"):
            fg.gemv_wide_setting(bad)


def test_each_gpu_model_takes_its_measured_launches(monkeypatch):
    """One row on a GPU model of ``DEVICE_LAUNCHES`` takes its launches (a norm GEMV with at least 8 programs an SM
    under NORM_CONFIG its wide one, the plain and SiLU·mul GEMVs theirs); any other GPU, the interpreter and
    ``LRAGENT_GEMV_TABLE=0`` take the H100's; several rows ROWS_CONFIG everywhere; a bad switch value is named."""
    from kernels.fused_gemv import (
        DEFAULT_CONFIG,
        DEVICE_LAUNCHES,
        NORM_CONFIG,
        ROWS_CONFIG,
        TABLE_ENV,
        default_config,
        gemv_table_setting,
    )

    monkeypatch.delenv(TABLE_ENV, raising=False)
    h200 = DEVICE_LAUNCHES["H200"]
    assert h200.norm_wide != NORM_CONFIG and h200.plain != DEFAULT_CONFIG  # else the cases below prove nothing
    edge = 8 * 132 * NORM_CONFIG.block_n  # 16,896 outputs: 1,056 programs of 16 on 132 SMs
    assert default_config(1, True, 28672, "NVIDIA H200", 132) == h200.norm_wide  # the 8B gate/up
    assert default_config(1, True, edge, "NVIDIA H200", 132) == h200.norm_wide
    assert default_config(1, True, edge - NORM_CONFIG.block_n, "NVIDIA H200", 132) == h200.norm  # one program short
    assert default_config(1, True, 6160, "NVIDIA H200", 132) == h200.norm == NORM_CONFIG  # the 8B q/k/v
    assert default_config(1, True, 28672, "NVIDIA H200", 264) == h200.norm  # twice the SMs: no longer wide
    assert default_config(1, False, 4096, "NVIDIA H200 NVL", 132) == h200.plain
    for name, sms in (("NVIDIA H100 80GB HBM3", 132), ("NVIDIA GH200 480GB", 132), ("", 0)):  # others; the interpreter
        assert default_config(1, True, 28672, name, sms) == NORM_CONFIG
        assert default_config(1, False, 4096, name, sms) == DEFAULT_CONFIG
    for rows in (2, 32):
        assert default_config(rows, True, 28672, "NVIDIA H200", 132) == ROWS_CONFIG
        assert default_config(rows, False, 4096, "NVIDIA H200", 132) == ROWS_CONFIG
    monkeypatch.setenv(TABLE_ENV, "0")
    assert default_config(1, True, 28672, "NVIDIA H200", 132) == NORM_CONFIG
    assert default_config(1, False, 4096, "NVIDIA H200", 132) == DEFAULT_CONFIG
    monkeypatch.setenv(TABLE_ENV, "1")
    assert default_config(1, False, 4096, "NVIDIA H200", 132) == h200.plain
    for bad in ("yes", "2", "off"):
        with pytest.raises(ValueError, match=rf"LRAGENT_GEMV_TABLE='{bad}': expected 1 .* or 0"):
            gemv_table_setting(bad)


def _table_reaches_the_launch() -> list[tuple[int, int, int]]:
    """Under the interpreter, with the device faked as an H200 of 132 SMs: the (BLOCK_N, BLOCK_K, warps) each
    one-row call launches with no config given (a wide and a narrow norm GEMV, the plain and SiLU·mul GEMVs)."""
    import kernels.fused_gemv as fg

    class Launched(Exception):
        """Raised with the launch's arguments in place of the launch (interpreting a 16,896-wide GEMV takes 20 s)."""

    seen = []
    raw = fg._launch_args

    def spy(config, rows, pdl):
        args = raw(config, rows, pdl)
        seen.append((args["BLOCK_N"], args["BLOCK_K"], args["num_warps"]))
        raise Launched

    fg._launch_args, fg._device_facts = spy, lambda t: ("NVIDIA H200", 132)
    x, k = torch.randn(1, 64, dtype=torch.float16), 64
    w = torch.randn(40, k, dtype=x.dtype)
    calls = [lambda n=n: fg.rms_norm_linear(x, torch.ones(k, dtype=x.dtype), EPS, torch.randn(n, k, dtype=x.dtype))
             for n in (16896, 40)]  # fmt: skip
    calls += [lambda: fg.gemv(x, w), lambda: fg.silu_mul_linear(x, x, w)]
    for call in calls:
        try:
            call()
        except Launched:
            pass
        else:
            raise AssertionError("the call launched no kernel")
    return seen


def test_the_measured_launch_is_what_a_call_without_config_takes():
    """rms_norm_linear, gemv and silu_mul_linear read the device's name and SM count and take its table's launch (the
    selection itself is pinned above; this pins that the calls ask it with their output count and device)."""
    from kernels.fused_gemv import DEVICE_LAUNCHES

    h200 = DEVICE_LAUNCHES["H200"]
    out = run_under_interpreter("import tests.test_fused_gemv as t; print(t._table_reaches_the_launch())")
    expect = [(c.block_n, c.block_k, c.num_warps) for c in (h200.norm_wide, h200.norm, h200.plain, h200.plain)]
    assert out.strip() == str(expect)


def test_the_switch_names_the_most_rows_of_a_fused_step(monkeypatch):
    """LRAGENT_FUSED_GEMV is a row count: 0 off, 1..MAX_ROWS the widest fused step, unset the default (1); anything
    else refused with the value and what is allowed (never silently off)."""
    from kernels.fused_gemv import DEFAULT_ROWS, MAX_ROWS, fused_gemv_rows

    monkeypatch.delenv("LRAGENT_FUSED_GEMV", raising=False)
    assert fused_gemv_rows() == DEFAULT_ROWS == 1  # unset: batch-1 steps (faster on an H100; wider steps were slower)
    monkeypatch.setenv("LRAGENT_FUSED_GEMV", "")
    assert fused_gemv_rows() == DEFAULT_ROWS
    for value in range(MAX_ROWS + 1):
        monkeypatch.setenv("LRAGENT_FUSED_GEMV", str(value))
        assert fused_gemv_rows() == value
    for bad in ("33", "-1", "yes", "1.5"):
        with pytest.raises(ValueError, match=rf"LRAGENT_FUSED_GEMV='{re.escape(bad)}': allowed 0 \(off\) to 32"):
            fused_gemv_rows(bad)


def test_weight_copies_outgrow_the_l2():
    """The bench cycles through enough copies of a weight that each is read from DRAM (twice the L2 in all): an
    o projection (33.5 MB) on an H100's 50 MiB L2 takes 4 (3 make 100.7 MB, short of 104.9), gate/up (235 MB) one."""
    from eval_suite.bench.fused_gemv import weight_copies

    l2 = 50 * 2**20
    assert weight_copies(4096 * 4096 * 2, l2) == 4
    assert weight_copies(2 * 14336 * 4096 * 2, l2) == 1
    for w in (1, 10**6, 33554432, 10**9):
        n = weight_copies(w, l2)
        assert n * w >= 2 * l2 and (n - 1) * w < 2 * l2 or n == 1 and w >= 2 * l2


def test_every_row_count_gets_a_block_that_holds_it_within_the_register_budget():
    """Each row count up to MAX_ROWS launches a row block that holds all its rows (a power-of-two multiple of the dot's
    16 for several rows), with a K block that keeps row block × K block within the 16-row footprint; one row keeps the
    configs' own K block."""
    from kernels.fused_gemv import (
        DEFAULT_CONFIG,
        NORM_CONFIG,
        ROWS_CONFIG,
        TILE_ELEMENTS,
        _block_k,
        _row_block,
        default_config,
    )

    # one row keeps the configs measured at one row; several rows take more outputs per program (fewer re-reads)
    assert default_config(1, norm=True) == NORM_CONFIG and default_config(1, norm=False) == DEFAULT_CONFIG
    assert default_config(2, norm=True) == default_config(32, norm=False) == ROWS_CONFIG
    assert ROWS_CONFIG.block_n >= 4 * NORM_CONFIG.block_n
    for config in (DEFAULT_CONFIG, NORM_CONFIG):
        assert _row_block(1) == 1 and _block_k(config, 1) == config.block_k
        for rows in range(2, MAX_ROWS + 1):
            block = _row_block(rows)
            assert rows <= block and block % 16 == 0 and block < rows + 16
            assert block * _block_k(config, rows) <= TILE_ELEMENTS and _block_k(config, rows) >= 16
        assert _block_k(config, 16) == config.block_k and _block_k(config, 32) == config.block_k // 2
