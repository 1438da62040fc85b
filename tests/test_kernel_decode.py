"""CPU tests of Flash-LoRA decode: the torch reference against an independent float64 loop, its agreement with the
prefill reference, the input checks, the launch rule, and the Triton kernel logic under ``TRITON_INTERPRET=1``
(fp16 only: the interpreter's bf16 ``tl.dot`` is wrong in Triton 3.9).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.flash_lora_decode as fld
from kernels.flash_lora_attention import flash_lora_attention_reference
from kernels.flash_lora_decode import _plan, flash_lora_decode, flash_lora_decode_reference

REPO = Path(__file__).resolve().parents[1]


def make_decode_inputs(
    bsz: int,
    hq: int,
    hkv: int,
    cap: int,
    d: int,
    rank: int | None,
    dtype: torch.dtype,
    n_slots: int | None = None,
    n_roles: int = 3,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """Random pools laid out like an engine keeps them; rank None = plain cache (no LoRA pool)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    n_slots = n_slots or bsz
    x = {
        "q": rnd(bsz, 1, hq, d)[:, 0],  # (B, Hq, D), a view of a (B, 1, Hq, D) projection
        "k_cache": rnd(n_slots, hkv, cap, d),
        "v_cache": rnd(n_slots, hkv, cap, d),
    }
    if rank is not None:
        x["v_lr_cache"] = rnd(n_slots + 1, cap + 3, rank)[:, :cap]  # strided view (S_lr, C, r)
        b_peft = rnd(n_roles, hkv * d, rank, scale=0.5)  # PEFT layout (n_roles, Hkv*D, r)
        x["lora_b"] = b_peft.view(n_roles, hkv, d, rank).transpose(-1, -2)  # (n_roles, Hkv, r, D) view
    return x


def naive_decode_float64(q, k_cache, v_cache, kv_lens, v_lr_cache=None, lora_b=None, scaling=1.0, role_ids=None,
                         kv_slot=None, lr_slot=None) -> torch.Tensor:  # fmt: skip
    """Per row and head: materialise V = V_base + V_lr B s for the row's slot and length, softmax, in float64."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.zeros(bsz, hq, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(kv_lens[b])
        slot = int(kv_slot[b]) if kv_slot is not None else b
        lslot = int(lr_slot[b]) if lr_slot is not None else slot
        role = int(role_ids[b]) if role_ids is not None else 0
        if n == 0:
            continue
        for h in range(hq):
            g = h // (hq // hkv)
            kk = k_cache[slot, g, :n].double()
            vv = v_cache[slot, g, :n].double()
            if v_lr_cache is not None:
                vv = vv + v_lr_cache[lslot, :n].double() @ lora_b[role, g].double() * scaling
            p = torch.softmax(kk @ q[b, h].double() / math.sqrt(d), dim=0)
            out[b, h] = p @ vv
    return out


CASES = [
    # bsz, hq, hkv, cap, d, rank, kv_lens, role_ids, kv_slot, lr_slot, n_slots
    (1, 4, 4, 1, 16, 1, [1], [0], None, None, None),
    (3, 6, 2, 40, 16, 3, [40, 0, 1], [2, 0, 1], None, None, None),
    (2, 8, 1, 33, 32, 64, [17, 33], [1, 1], [3, 0], [1, 4], 4),
    (4, 8, 8, 20, 16, 5, [20, 3, 0, 11], [0, 2, 1, 0], [1, 0, 3, 2], None, None),
    (2, 9, 3, 50, 32, None, [50, 7], None, [1, 0], None, None),
]


@pytest.mark.parametrize("case", CASES)
def test_decode_reference_matches_naive_float64(case):
    bsz, hq, hkv, cap, d, rank, lens, roles, slots, lr_slots, n_slots = case
    x = make_decode_inputs(bsz, hq, hkv, cap, d, rank, torch.float32, n_slots=n_slots, seed=cap)
    kw = {"kv_lens": torch.tensor(lens), "scaling": 2.0}
    kw["role_ids"] = torch.tensor(roles) if roles is not None else None
    kw["kv_slot"] = torch.tensor(slots) if slots is not None else None
    kw["lr_slot"] = torch.tensor(lr_slots) if lr_slots is not None else None
    out = flash_lora_decode_reference(**x, **kw)
    assert out.shape == (bsz, hq, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_decode_float64(**x, **kw), rtol=1e-5, atol=1e-5)
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))  # an idle row is exactly zero, never NaN


def test_decode_reference_is_the_last_query_of_the_prefill_reference():
    """Slots gathered by hand, a decode step equals the prefill reference's Lc = 1 case at each row's length."""
    x = make_decode_inputs(3, 8, 2, 30, 16, 4, torch.float64, n_slots=5, seed=1)
    slots, lens, roles = torch.tensor([4, 0, 2]), torch.tensor([30, 9, 1]), torch.tensor([2, 0, 1])
    dec = flash_lora_decode_reference(**x, kv_lens=lens, scaling=1.5, role_ids=roles, kv_slot=slots, lr_slot=slots)
    pre = flash_lora_attention_reference(
        x["q"].unsqueeze(2), x["k_cache"][slots], x["v_cache"][slots], x["v_lr_cache"][slots], x["lora_b"], 1.5,
        role_ids=roles, kv_lens=lens,
    )  # fmt: skip
    torch.testing.assert_close(dec, pre.squeeze(2))


def test_decode_lora_term_is_applied_per_role_and_plain_path_drops_it():
    x = make_decode_inputs(2, 4, 2, 12, 16, 4, torch.float32, seed=2)
    lens = torch.tensor([12, 7])
    plain = flash_lora_decode_reference(x["q"], x["k_cache"], x["v_cache"], lens)
    zero = flash_lora_decode_reference(**x, kv_lens=lens, scaling=0.0)
    torch.testing.assert_close(plain, zero)
    r0 = flash_lora_decode_reference(**x, kv_lens=lens, scaling=2.0, role_ids=torch.tensor([0, 0]))
    r1 = flash_lora_decode_reference(**x, kv_lens=lens, scaling=2.0, role_ids=torch.tensor([1, 1]))
    mixed = flash_lora_decode_reference(**x, kv_lens=lens, scaling=2.0, role_ids=torch.tensor([1, 0]))
    assert (r0 - plain).abs().max() > 1e-2 and (r0 - r1).abs().max() > 1e-2
    torch.testing.assert_close(mixed[0], r1[0])
    torch.testing.assert_close(mixed[1], r0[1])


def test_decode_reference_writes_out_and_low_precision_mode():
    x = make_decode_inputs(2, 4, 2, 10, 16, 2, torch.bfloat16, seed=3)
    lens = torch.tensor([10, 4])
    buf = torch.full_like(x["q"], float("nan"))
    res = flash_lora_decode_reference(**x, kv_lens=lens, out=buf)
    assert res is buf and torch.isfinite(buf).all()
    lo = flash_lora_decode_reference(**x, kv_lens=lens, upcast=False)
    assert lo.dtype == torch.bfloat16 and 0 < (lo.float() - res.float()).abs().max() < 0.1


def test_decode_on_cpu_takes_the_torch_path_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(fld, "_FALLBACK_LOGGED", set())  # the warning is logged once per reason and process
    x = make_decode_inputs(2, 4, 2, 10, 16, 2, torch.float16, seed=4)
    lens = torch.tensor([10, 0])
    with caplog.at_level(logging.WARNING, logger="kernels.flash_lora_decode"):
        got = flash_lora_decode(**x, kv_lens=lens, scaling=2.0)
        flash_lora_decode(**x, kv_lens=lens, scaling=2.0)
    torch.testing.assert_close(got, flash_lora_decode_reference(**x, kv_lens=lens, scaling=2.0))
    warnings = [r.getMessage() for r in caplog.records if "torch path" in r.getMessage()]
    assert len(warnings) == 1 and "q is on cpu" in warnings[0]


def test_grouped_rows_read_their_group_first_rows_slots_and_role():
    """``group_rows`` T: each group of T rows reads its first row's kv_slot, lr_slot and role, every row with its own
    query and length (a ragged last group too); when a group's rows share them it is the per-row step."""
    x = make_decode_inputs(7, 6, 2, 40, 16, 3, torch.float64, n_slots=5, seed=8)
    lens = torch.tensor([40, 3, 0, 17, 33, 1, 29])
    slots, lr_slots, roles = (
        torch.tensor([4, 0, 2, 1, 3, 2, 0]),
        torch.tensor([1, 3, 4, 0, 2, 2, 4]),
        torch.tensor([2, 0, 1, 1, 0, 2, 1]),
    )
    kw = {"kv_lens": lens, "scaling": 1.5}
    grouped = flash_lora_decode_reference(**x, **kw, kv_slot=slots, lr_slot=lr_slots, role_ids=roles, group_rows=3)
    first = torch.tensor([0, 0, 0, 3, 3, 3, 6])
    per_row = naive_decode_float64(**x, **kw, kv_slot=slots[first], lr_slot=lr_slots[first], role_ids=roles[first])
    torch.testing.assert_close(grouped.double(), per_row, rtol=1e-9, atol=1e-9)
    assert torch.equal(grouped[2], torch.zeros_like(grouped[2]))  # a row of length 0 in a group stays zero
    own = flash_lora_decode_reference(**x, **kw, kv_slot=slots, lr_slot=lr_slots, role_ids=roles)
    assert (own - grouped)[1:3].abs().max() > 1e-3  # the rows past a group's first really read its slots
    torch.testing.assert_close(grouped[[0, 3, 6]], own[[0, 3, 6]])


@pytest.mark.parametrize("fn", [flash_lora_decode, flash_lora_decode_reference])
def test_bad_group_rows_is_one_line_naming_it(fn):
    x = make_decode_inputs(2, 8, 2, 12, 16, 4, torch.float16, n_slots=3)  # 4 query heads a KV head
    lens = torch.tensor([12, 3], dtype=torch.int32)
    for value in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=rf"group_rows must be an int >= 1, got {value!r}$"):
            fn(**x, kv_lens=lens, group_rows=value)
    with pytest.raises(ValueError, match=r"group_rows=33 x 4 query heads .* = 132 queries a group; at most 128 "
                                         r"\(group_rows <= 32\)"):  # fmt: skip
        fn(**x, kv_lens=lens, group_rows=33)
    assert fn(**x, kv_lens=lens, group_rows=32).shape == x["q"].shape


# ------------------------------------------------------------------------------------------------
# Bad input: one-line ValueError naming the argument
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [flash_lora_decode, flash_lora_decode_reference])
def test_decode_bad_inputs_raise_value_error(fn):
    x = make_decode_inputs(2, 8, 2, 12, 16, 4, torch.float16, n_slots=3)
    lens = torch.tensor([12, 3], dtype=torch.int32)

    def bad(match: str, **over) -> None:
        kwargs = {**x, "kv_lens": lens, "scaling": 1.0, **over}
        with pytest.raises(ValueError, match=match) as info:
            fn(**kwargs)
        assert "\n" not in str(info.value)

    bad("q must have 3 dims", q=x["q"].unsqueeze(2))
    bad("q dtype", q=x["q"].to(torch.int32))
    bad("k_cache dtype", k_cache=x["k_cache"].float())
    bad("k_cache shape", q=torch.randn(2, 7, 16, dtype=torch.float16))
    bad("v_cache shape", v_cache=x["v_cache"][:, :, :11])
    bad("v_lr_cache and lora_b must be given together", lora_b=None)
    bad("v_lr_cache must be a tensor of shape", v_lr_cache=x["v_lr_cache"][:, :11])
    bad("v_lr_cache dtype", v_lr_cache=x["v_lr_cache"].float())
    bad("lora_b shape", lora_b=x["lora_b"][:, :1])
    bad("kv_lens values", kv_lens=torch.tensor([13, 0]))
    bad("kv_lens must be a tensor of shape", kv_lens=torch.tensor([3]))
    bad("kv_lens must be an integer tensor", kv_lens=torch.tensor([3.0, 1.0]))
    bad("role_ids values", role_ids=torch.tensor([0, 3]))
    bad("kv_slot values", kv_slot=torch.tensor([0, 3]))
    bad("lr_slot values", lr_slot=torch.tensor([4, 0]))
    bad("k_cache needs >= B=2 slots", k_cache=x["k_cache"][:1], v_cache=x["v_cache"][:1])
    bad("out must be a tensor of shape", out=torch.empty(2, 8, 15, dtype=torch.float16))
    bad("out must have q's dtype", out=torch.empty(2, 8, 16))
    bad("scaling must be a finite float", scaling=float("nan"))


# ------------------------------------------------------------------------------------------------
# The launch rule: a grid fixed by the shape, never by lengths
# ------------------------------------------------------------------------------------------------


def test_plan_fills_the_gpu_and_depends_on_shape_only():
    one = _plan(1, 8, 4, 65536, 128, 132)
    assert one.block_m == 16 and one.rows == 4 and one.row_blocks == 1
    assert one.n_splits == 33  # 2 programs per SM at batch 1, one wave
    assert _plan(32, 8, 4, 65536, 128, 132).n_splits == 1  # 256 (row, KV head) programs fill 132 SMs x 2
    assert _plan(4, 8, 4, 65536, 128, 132).n_splits == 8
    assert _plan(1, 8, 4, 64, 128, 132).n_splits == 1  # a capacity of one tile needs no split
    big_group = _plan(1, 1, 128, 4096, 64, 132)
    assert big_group.block_m == 64 and big_group.row_blocks == 2
    assert _plan(1, 8, 4, 65536, 256, 132).block_n == 32  # D = 256 halves the tile


def test_plan_takes_small_tiles_for_a_lora_kernel_that_splits_its_rows():
    """The LoRA kernel takes 32-key tiles (twice the splits) where 64-key tiles would split a row 3 ways or more (the
    cold-L2 sweep in kernels/NOTES.md); the plain kernel, and batches split 2 ways or less, keep 64."""
    at = lambda b, cap=2120, **kw: _plan(b, 8, 4, cap, 128, 132, **kw)  # noqa: E731 (8B shapes on an H100)
    assert (at(1).block_n, at(1).n_splits) == (64, 9)
    assert (at(1, lora=True).block_n, at(1, lora=True).n_splits) == (32, 17)
    assert [at(b, lora=True).block_n for b in (1, 2, 4, 8, 16, 32)] == [32, 32, 32, 32, 64, 64]
    assert at(16, lora=True).n_splits == 2 and at(8).n_splits == 4
    assert at(1, cap=584, lora=True).block_n == 32  # 3 splits of a 584-key cache at 64
    assert at(1, cap=200, lora=True).block_n == 64  # one split
    assert at(1, lora=True, block_n=64).block_n == 64  # a sweep's setting holds
    assert _plan(1, 8, 4, 2120, 256, 132, lora=True).block_n == 32  # D = 256 is at 32 already


# ------------------------------------------------------------------------------------------------
# Triton kernel logic on CPU via the interpreter (subprocess: TRITON_INTERPRET must be set before import)
# ------------------------------------------------------------------------------------------------

_INTERPRET_SCRIPT = """
import dataclasses, inspect, json, torch
import kernels.flash_lora_decode as fld
from tests.test_kernel_decode import make_decode_inputs
rule_args = set(inspect.signature(fld._plan).parameters)
res = []
for (bsz, hq, hkv, cap, d, rank, lens, roles, slots, over) in CASES:
    x = make_decode_inputs(bsz, hq, hkv, cap, d, rank, torch.float16, n_slots=bsz + 1, seed=cap)
    kw = dict(kv_lens=torch.tensor(lens, dtype=torch.int32), scaling=2.0)
    if rank is not None:
        kw["role_ids"] = torch.tensor(roles)
    if slots is not None:
        kw["kv_slot"] = torch.tensor(slots, dtype=torch.int32)
    if over is None:
        out = fld.flash_lora_decode(**x, **kw)
        plan = fld._PLANS[(bsz, hkv, hq // hkv, cap, d, x["q"].device, x.get("v_lr_cache") is not None)]
    else:
        plan = fld._plan(bsz, hkv, hq // hkv, cap, d, 8, **{k: v for k, v in over.items() if k in rule_args})
        plan = dataclasses.replace(plan, **{k: v for k, v in over.items() if k not in rule_args})
        out = torch.full_like(x["q"], float("nan"))
        fld._launch_decode(x["q"], x["k_cache"], x["v_cache"], kw["kv_lens"], x.get("v_lr_cache"), x.get("lora_b"),
                           2.0, kw.get("role_ids"), kw.get("kv_slot"), None, out, plan)
    exact = fld.flash_lora_decode_reference(**x, **kw).float()
    eager = fld.flash_lora_decode_reference(**x, **kw, upcast=False).float()
    zero_rows = [b for b, n in enumerate(lens) if n == 0]
    res.append([(out.float() - exact).abs().max().item(), (eager - exact).abs().max().item(),
                bool(torch.isfinite(out).all()), all(bool((out[b] == 0).all()) for b in zero_rows),
                plan.n_splits, plan.s_chunk, plan.block_n])
print(json.dumps(res))
"""

INTERPRET_CASES = [
    # bsz, hq, hkv, cap, d, rank, kv_lens, role_ids, kv_slot, plan override (None = the public function's rule;
    # _plan keyword arguments or _DecodePlan fields). Splits: the rule gives 2 here (8 "SMs" on CPU).
    (3, 8, 2, 300, 32, 8, [300, 0, 1], [2, 0, 1], [2, 0, 3], None),  # merge, one-split row, idle row, slots
    (
        3,
        8,
        2,
        300,
        32,
        8,
        [17, 129, 300],
        [2, 0, 1],
        None,
        {"programs_per_sm": 8, "min_split_tiles": 1},
    ),  # 5 splits, one merge step
    (
        2,
        4,
        1,
        520,
        16,
        3,
        [520, 64],
        [0, 2],
        None,
        {"programs_per_sm": 64, "block_n": 16, "s_chunk": 4, "min_split_tiles": 1},
    ),
    (2, 6, 2, 150, 16, 5, [150, 77], [1, 2], None, {"programs_per_sm": 8, "block_n": 16}),  # G = 3: a padding row
    (2, 6, 3, 100, 16, None, [100, 5], None, [1, 0], {"programs_per_sm": 8}),  # plain cache
    (1, 32, 1, 64, 16, 2, [40], [1], None, {"block_n": 16, "block_m": 16, "rows": 16, "row_blocks": 2}),  # G = 32
    (2, 8, 8, 200, 64, 64, [200, 1], [0, 1], None, None),  # G = 1, rank 64, D = 64
    (1, 8, 2, 600, 32, 8, [600], [1], None, None),  # the rule's 32-key tiles: 64-key ones would split 3 ways
]


def _interpreted(script: str, cases: list) -> list:
    """Runs ``script`` over ``cases`` in a fresh process under ``TRITON_INTERPRET=1`` and checks each case's result
    (kernel error, eager error, finite, idle rows zero, ...): finite, idle rows exactly zero, the kernel's error at
    most twice eager PyTorch's at the same precision plus 1e-3. Returns the results."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", f"CASES = {cases!r}\n" + script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for case, (err, eager_err, finite, zero_rows_zero, *_) in zip(cases, results, strict=True):
        assert finite and zero_rows_zero, case
        assert err <= 2 * eager_err + 1e-3, (case, err, eager_err)
    return results


def test_decode_kernel_under_interpreter():
    results = _interpreted(_INTERPRET_SCRIPT, INTERPRET_CASES)
    assert [r[4] for r in results][:3] == [2, 5, 33] and results[2][5] == 4  # the paths meant: merge, steps
    assert (results[-1][4], results[-1][6], results[0][6]) == (5, 32, 64)  # LoRA at >= 3 splits: 32-key tiles


def test_plan_of_token_groups_holds_each_group_in_one_program():
    """A group of T token rows is one program per KV head: its T·G queries padded to a power of two (at least 16),
    all kept in the workspace, 4 warps from 64 queries (the accumulators' registers), splits filling the GPU by the
    groups' count, not the rows'."""
    rows = _plan(100, 2, 6, 4096, 128, 132)
    grouped = _plan(100, 2, 6, 4096, 128, 132, tokens=8)  # 48 queries
    assert (grouped.block_m, grouped.rows, grouped.row_blocks, grouped.num_warps, grouped.tokens) == (64, 64, 1, 4, 8)
    assert (rows.block_m, rows.rows, rows.num_warps, rows.tokens) == (16, 8, 2, 1)
    assert grouped.n_splits == 2 * 132 // (13 * 2) and rows.n_splits == 1  # 13 groups x 2 KV heads; 200 programs
    small = _plan(5, 3, 3, 256, 64, 132, tokens=2)  # 6 queries: one 16-row tile, 2 warps
    assert (small.block_m, small.rows, small.num_warps) == (16, 16, 2)
    assert _plan(5, 3, 3, 256, 64, 132, tokens=2, num_warps=8).num_warps == 8
    wide = _plan(300, 2, 6, 4096, 128, 132, tokens=16)  # 96 queries: a 128-row tile, 8 warps
    assert (wide.block_m, wide.num_warps) == (128, 8)


_GROUP_SCRIPT = """
import json, torch
import kernels.flash_lora_decode as fld
from tests.test_kernel_decode import make_decode_inputs
res = []
for (bsz, hq, hkv, cap, d, rank, tokens, lens, over) in CASES:
    x = make_decode_inputs(bsz, hq, hkv, cap, d, rank, torch.float16, n_slots=bsz + 1, seed=cap)
    gen = torch.Generator().manual_seed(bsz)
    kw = dict(kv_lens=torch.tensor(lens, dtype=torch.int32), scaling=2.0,
              kv_slot=torch.randint(0, bsz + 1, (bsz,), generator=gen).to(torch.int32))
    if rank is not None:
        kw["role_ids"] = torch.randint(0, 3, (bsz,), generator=gen)
    if over is None:
        out = fld.flash_lora_decode(**x, **kw, group_rows=tokens)
        plan = fld._PLANS[(bsz, hkv, hq // hkv, cap, d, x["q"].device, rank is not None, tokens)]
    else:
        plan = fld._plan(bsz, hkv, hq // hkv, cap, d, 8, lora=rank is not None, tokens=tokens, **over)
        out = torch.full_like(x["q"], float("nan"))
        fld._launch_decode(x["q"], x["k_cache"], x["v_cache"], kw["kv_lens"], x.get("v_lr_cache"), x.get("lora_b"),
                           2.0, kw.get("role_ids"), kw["kv_slot"], None, out, plan)
    exact = fld.flash_lora_decode_reference(**x, **kw, group_rows=tokens).float()
    eager = fld.flash_lora_decode_reference(**x, **kw, group_rows=tokens, upcast=False).float()
    zero_rows = [b for b, n in enumerate(lens) if n == 0]
    res.append([(out.float() - exact).abs().max().item(), (eager - exact).abs().max().item(),
                bool(torch.isfinite(out).all()), all(bool((out[b] == 0).all()) for b in zero_rows), plan.n_splits])
print(json.dumps(res))
"""

GROUP_CASES = [
    # bsz, hq, hkv, cap, d, rank, group_rows, kv_lens, plan override (None: the public function's rule, 8 "SMs")
    (7, 6, 2, 300, 32, 8, 4, [300, 0, 57, 12, 290, 5, 1], None),  # ragged last group, merge, a row of length 0
    (5, 8, 2, 130, 16, 3, 3, [130, 64, 9, 100, 1], {"programs_per_sm": 8, "min_split_tiles": 1, "block_n": 16}),
    (6, 4, 4, 90, 16, None, 2, [90, 89, 45, 0, 3, 4], None),  # plain cache, G = 1 (16-row tile of 2 queries)
    (
        9,
        12,
        2,
        200,
        32,
        5,
        8,
        [200, 199, 198, 10, 11, 12, 13, 14, 150],  # 48 queries a group, 4 warps, 13 splits
        {"programs_per_sm": 64, "min_split_tiles": 1, "block_n": 16},
    ),  # fmt: skip
    (4, 6, 2, 60, 16, 4, 4, [3, 4, 5, 6], None),  # one split: O written directly
]


def test_grouped_decode_kernel_under_interpreter():
    """The kernel's token groups (T·G queries a program, each masked to its own length, the group's first row's
    slots and role) against the reference with the same groups: merged splits, one split, ragged last group, idle
    rows, plain and LoRA caches."""
    results = _interpreted(_GROUP_SCRIPT, GROUP_CASES)
    assert [r[4] for r in results] == [2, 9, 1, 13, 1]  # the paths meant: merges of several splits, and one split


def test_plan_overrides_from_the_environment(monkeypatch):
    monkeypatch.setenv("LRAGENT_DECODE_PLAN", "min_split_tiles=4, programs_per_sm=1")
    over = fld.plan_overrides()
    assert over == {"min_split_tiles": 4, "programs_per_sm": 1}
    plan = fld._plan(1, 8, 4, 2120, 128, 132, **over)
    assert plan.min_split == 4 * plan.block_n and plan.n_splits == 9  # ceil(2120 / 256) splits of 4 tiles
    monkeypatch.setenv("LRAGENT_DECODE_PLAN", "min_split=4")
    with pytest.raises(ValueError, match="unknown setting 'min_split'.*min_split_tiles"):
        fld.plan_overrides()
    monkeypatch.setenv("LRAGENT_DECODE_PLAN", "num_warps=0")
    with pytest.raises(ValueError, match="num_warps must be a positive integer, got '0'"):
        fld.plan_overrides()
    monkeypatch.delenv("LRAGENT_DECODE_PLAN")
    assert fld.plan_overrides() == {}
