"""GPU tests of Flash-LoRA decode (marked ``gpu``, skipped without CUDA).

The kernel's max error against the fp32 reference must be at most twice eager PyTorch's at the same precision
(``flash_lora_decode_reference(..., upcast=False)``) plus a small atol. Batches mix lengths (0, 1, capacity and
between), roles and cache slots; one test captures a decode step in a CUDA graph and replays it at three lengths.
"""

from __future__ import annotations

import pytest
import torch

import kernels.flash_lora_attention as fla
import kernels.flash_lora_decode as fld
from kernels.flash_lora_attention import flash_lora_attention, flash_lora_attention_reference
from kernels.flash_lora_decode import flash_lora_decode, flash_lora_decode_reference
from tests.test_kernel_decode import make_decode_inputs
from tests.test_kernel_reference import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = 1e-3


def mixed_rows(bsz: int, cap: int, n_roles: int, seed: int) -> dict:
    """Lengths capacity, 1, 0 (an idle row) and random in between; random roles; slots permuted over bsz + 2."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, cap, (bsz,), generator=gen)
    lens[: min(3, bsz)] = torch.tensor([cap, 1, 0])[: min(3, bsz)]
    slots = torch.randperm(bsz + 2, generator=gen)[:bsz]
    return {
        "kv_lens": lens.to(device="cuda", dtype=torch.int32),
        "role_ids": torch.randint(0, n_roles, (bsz,), generator=gen).cuda(),
        "kv_slot": slots.to(device="cuda", dtype=torch.int32),
        "lr_slot": slots.flip(0).to(device="cuda", dtype=torch.int32),
    }


def check(x: dict, rows: dict, scaling: float = 2.0, group_rows: int = 1) -> tuple[float, float]:
    """Kernel vs fp32 reference, next to eager-at-same-precision vs fp32 reference; idle rows must be zero."""
    kw = {**rows, "scaling": scaling, "group_rows": group_rows}
    out = torch.full_like(x["q"], float("nan"))  # poisoned: every element must be written
    res = flash_lora_decode(**x, **kw, out=out)
    exact = flash_lora_decode_reference(**x, **kw).float()
    eager = flash_lora_decode_reference(**x, **kw, upcast=False).float()
    assert res is out and torch.isfinite(out).all()
    idle = rows["kv_lens"] == 0
    assert torch.equal(out[idle], torch.zeros_like(out[idle]))
    err = (out.float() - exact).abs().max().item()
    eager_err = (eager - exact).abs().max().item()
    assert err <= 2 * eager_err + ATOL, f"kernel err {err:.3e} vs eager err {eager_err:.3e}"
    return err, eager_err


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("rank", [1, 8, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_matches_reference(record_property, dtype, head_dim, rank, group):
    bsz, hkv, cap = 6, 2, 3000
    x = make_decode_inputs(bsz, hkv * group, hkv, cap, head_dim, rank, dtype, n_slots=bsz + 2, device="cuda", seed=rank)
    err, eager_err = check(x, mixed_rows(bsz, cap, 3, seed=group))
    record_property("kernel_err", err)
    record_property("eager_err", eager_err)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_plain_decode_matches_reference(dtype, head_dim, group):
    bsz, hkv, cap = 5, 2, 2049
    x = make_decode_inputs(bsz, hkv * group, hkv, cap, head_dim, None, dtype, n_slots=bsz + 2, device="cuda")
    rows = mixed_rows(bsz, cap, 1, seed=group)
    del rows["role_ids"], rows["lr_slot"]
    check(x, rows)


@pytest.mark.parametrize("bsz", [1, 32, 64])
def test_decode_llama_shapes_at_batch(bsz):
    """LLaMA-3.1-8B layout (32 q heads, 8 KV heads, D 128, r 8) at the batch sizes the engine buckets."""
    x = make_decode_inputs(bsz, 32, 8, 4096, 128, 8, torch.bfloat16, n_slots=bsz + 2, device="cuda", seed=bsz)
    check(x, mixed_rows(bsz, 4096, 3, seed=bsz))


def fed_groups(bsz: int, tokens: int, cap: int, n_roles: int, seed: int) -> dict:
    """Token groups as an engine's fed rows make them: each group of ``tokens`` rows a sequence's consecutive
    positions in its own slot and role (a random depth, lengths 1 … capacity), some padding rows of length 0 and
    another slot at a group's end, a ragged last group."""
    gen = torch.Generator().manual_seed(seed)
    n_groups = -(-bsz // tokens)
    slots = torch.randperm(n_groups + 2, generator=gen)[:n_groups]
    depth = torch.randint(0, cap - tokens + 1, (n_groups,), generator=gen)
    depth[:2] = torch.tensor([0, cap - tokens])[: min(2, n_groups)]
    row = torch.arange(bsz)
    lens = depth[row // tokens] + row % tokens + 1
    pad = (row % tokens == tokens - 1) & (row // tokens % 3 == 1)  # every third group's last row is padding
    lens[pad] = 0
    kv_slot = torch.where(pad, n_groups + 1, slots[row // tokens])
    return {
        "kv_lens": lens.to(device="cuda", dtype=torch.int32),
        "role_ids": torch.randint(0, n_roles, (n_groups,), generator=gen)[row // tokens].cuda(),
        "kv_slot": kv_slot.to(device="cuda", dtype=torch.int32),
        "lr_slot": kv_slot.flip(0).to(device="cuda", dtype=torch.int32),
    }


@pytest.mark.parametrize(
    "heads, tokens, bsz", [((12, 2), 8, 2048), ((12, 2), 16, 300), ((32, 8), 8, 100), ((9, 3), 8, 203), ((8, 8), 2, 7)]
)
def test_grouped_decode_matches_reference(heads, tokens, bsz):
    """Fed token rows in groups (``group_rows``): Qwen2.5-1.5B's heads (12, 2) at 2,048 rows in groups of 8 and 300
    in groups of 16 (96 queries a program), LLaMA-8B's, SmolLM2's and one query head a KV head (a 16-query tile of
    2 rows), bf16 and fp16 at a 4k cache; idle and padding rows, ragged last groups."""
    hq, hkv = heads
    for dtype in (torch.bfloat16, torch.float16):
        x = make_decode_inputs(bsz, hq, hkv, 4096, 128, 8, dtype, n_slots=-(-bsz // tokens) + 2, device="cuda")
        check(x, fed_groups(bsz, tokens, 4096, 3, seed=bsz), group_rows=tokens)


def test_grouped_decode_graph_replays_at_new_lengths():
    """A grouped step captured once at capacity replays at other depths and roles, as the engine's fed step does."""
    bsz, tokens, cap = 96, 8, 2048
    x = make_decode_inputs(bsz, 12, 2, cap, 128, 8, torch.bfloat16, n_slots=14, device="cuda", seed=6)
    rows = fed_groups(bsz, tokens, cap, 3, seed=1)
    out = torch.empty_like(x["q"])
    step = lambda: flash_lora_decode(**x, **rows, scaling=2.0, out=out, group_rows=tokens)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (2, 3, 4):
        for name, value in fed_groups(bsz, tokens, cap, 3, seed=seed).items():
            rows[name].copy_(value)
        out.fill_(float("nan"))
        graph.replay()
        exact = flash_lora_decode_reference(**x, **rows, scaling=2.0, group_rows=tokens).float()
        eager = flash_lora_decode_reference(**x, **rows, scaling=2.0, group_rows=tokens, upcast=False).float()
        assert torch.isfinite(out).all()
        err, eager_err = (out.float() - exact).abs().max().item(), (eager - exact).abs().max().item()
        assert err <= 2 * eager_err + ATOL, (seed, err, eager_err)


def test_decode_graph_captured_once_replays_at_three_lengths():
    """One capture at a fixed capacity; replays after changing lengths (and roles) give the reference each time."""
    bsz, cap = 4, 4096
    x = make_decode_inputs(bsz, 32, 8, cap, 128, 8, torch.bfloat16, device="cuda", seed=5)
    lens = torch.zeros(bsz, dtype=torch.int32, device="cuda")
    roles = torch.zeros(bsz, dtype=torch.long, device="cuda")
    out = torch.empty_like(x["q"])
    step = lambda: flash_lora_decode(**x, kv_lens=lens, scaling=2.0, role_ids=roles, out=out)  # noqa: E731
    lens.fill_(cap)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles and allocates the workspace before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_lens, new_roles in (
        ([1, 17, 300, 0], [0, 1, 2, 0]),
        ([cap, 2, 4000, 1000], [2, 2, 1, 0]),
        ([5] * 4, [1] * 4),
    ):
        lens.copy_(torch.tensor(new_lens))
        roles.copy_(torch.tensor(new_roles))
        out.fill_(float("nan"))
        graph.replay()
        exact = flash_lora_decode_reference(**x, kv_lens=lens, scaling=2.0, role_ids=roles).float()
        eager = flash_lora_decode_reference(**x, kv_lens=lens, scaling=2.0, role_ids=roles, upcast=False).float()
        assert torch.isfinite(out).all()
        err, eager_err = (out.float() - exact).abs().max().item(), (eager - exact).abs().max().item()
        assert err <= 2 * eager_err + ATOL, (new_lens, err, eager_err)


def test_decode_launcher_never_syncs_and_reuses_its_workspace():
    """After a warm-up of each path (the LoRA and the plain kernel have plans of their own, hence workspaces): no host
    synchronisation (sync debug mode raises on one), no new allocation at new lengths."""
    x = make_decode_inputs(3, 16, 4, 5000, 128, 8, torch.bfloat16, n_slots=5, device="cuda", seed=6)  # slots < 3 + 2
    rows = mixed_rows(3, 5000, 3, seed=6)
    out = torch.empty_like(x["q"])
    flash_lora_decode(**x, **rows, scaling=2.0, out=out)
    flash_lora_decode(x["q"], x["k_cache"], x["v_cache"], rows["kv_lens"], out=out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in (1, 2500, 5000):
            rows["kv_lens"].fill_(n)
            flash_lora_decode(**x, **rows, scaling=2.0, out=out)
        flash_lora_decode(x["q"], x["k_cache"], x["v_cache"], rows["kv_lens"], out=out)  # the plain path too
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_decode_is_deterministic_across_split_arrival_orders():
    """Same bits on every call: the merge reads the splits in a fixed order whichever finishes last (a race between
    the partial stores and the merge would show as changing bits)."""
    x = make_decode_inputs(2, 32, 8, 65536, 128, 8, torch.bfloat16, device="cuda", seed=7)
    lens = torch.tensor([65536, 40000], dtype=torch.int32, device="cuda")
    roles = torch.tensor([2, 1], device="cuda")
    first = flash_lora_decode(**x, kv_lens=lens, scaling=2.0, role_ids=roles)
    assert fld._PLANS[(2, 8, 4, 65536, 128, first.device, True)].n_splits > 1  # the merge path runs
    for _ in range(5):
        assert torch.equal(flash_lora_decode(**x, kv_lens=lens, scaling=2.0, role_ids=roles), first)


def test_two_owners_replaying_on_two_streams_keep_their_own_split_merges():
    """Two engines' decode graphs of one shape replayed at once on two CUDA streams (``eval --concurrent_schemes``):
    each captured inside its own ``workspace_owner``, each keeps the bits it gives alone. Sharing one workspace and
    its counters, the merges of the two would mix (a counter left off zero never merges its tile again)."""
    from kernels.split_workspace import workspace_owner

    class Owner:
        pass

    owners = (Owner(), Owner())
    lens = torch.tensor([65536, 40000], dtype=torch.int32, device="cuda")
    roles = torch.tensor([2, 1], device="cuda")
    inputs = [make_decode_inputs(2, 32, 8, 65536, 128, 8, torch.bfloat16, device="cuda", seed=s) for s in (7, 8)]
    alone, graphs, outs, streams = [], [], [], []
    for owner, x in zip(owners, inputs, strict=True):
        with workspace_owner(owner):
            alone.append(flash_lora_decode(**x, kv_lens=lens, scaling=2.0, role_ids=roles).clone())
            out = torch.empty_like(x["q"])
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                flash_lora_decode(**x, kv_lens=lens, scaling=2.0, role_ids=roles, out=out)  # warm-up
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                flash_lora_decode(**x, kv_lens=lens, scaling=2.0, role_ids=roles, out=out)
        graphs.append(graph)
        outs.append(out)
        streams.append(stream)
    assert fld._PLANS[(2, 8, 4, 65536, 128, lens.device, True)].n_splits > 1  # the merge path runs
    torch.cuda.synchronize()
    for _ in range(200):  # queued on both streams without a sync: the two graphs' kernels overlap on the device
        for graph, stream in zip(graphs, streams, strict=True):
            with torch.cuda.stream(stream):
                graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(outs, alone, strict=True):
        assert torch.equal(out, ref)


def test_decode_fp32_takes_the_torch_path_without_syncing():
    x = make_decode_inputs(3, 8, 2, 700, 64, 4, torch.float32, n_slots=5, device="cuda", seed=8)
    rows = mixed_rows(3, 700, 3, seed=8)
    flash_lora_decode(**x, **rows, scaling=2.0)  # logs the fallback once
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = flash_lora_decode(**x, **rows, scaling=2.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got, flash_lora_decode_reference(**x, **rows, scaling=2.0), rtol=1e-5, atol=1e-5)


def test_decode_bad_inputs_on_gpu():
    x = make_decode_inputs(2, 8, 2, 64, 64, 8, torch.bfloat16, device="cuda")
    lens = torch.tensor([64, 3], dtype=torch.int32, device="cuda")
    cases = [
        ({"kv_lens": lens.cpu()}, "kv_lens is on cpu"),
        ({"role_ids": torch.tensor([0, 1])}, "role_ids is on cpu"),
        ({"k_cache": x["k_cache"].cpu()}, "k_cache is on cpu"),
        ({"q": x["q"].transpose(-1, -2).contiguous().mT}, "q must be contiguous in its last dim"),
    ]
    for override, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            flash_lora_decode(**{**x, "kv_lens": lens, **override}, scaling=1.0)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("seq", [1000, 2048])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_full_prefill_rule_matches_reference(record_property, dtype, head_dim, group, seq):
    """A full causal prefill (kv_lens None, Lc == L) goes through the dispatch rule; its accuracy is the kernel's."""
    x = make_inputs(2, 2 * group, 2, seq, seq, head_dim, 8, dtype, device="cuda", seed=seq)
    roles = torch.tensor([2, 0], device="cuda")
    out = flash_lora_attention(**x, scaling=2.0, role_ids=roles)
    exact = flash_lora_attention_reference(**x, scaling=2.0, role_ids=roles).float()
    eager = flash_lora_attention_reference(**x, scaling=2.0, role_ids=roles, upcast=False).float()
    err, eager_err = (out.float() - exact).abs().max().item(), (eager - exact).abs().max().item()
    record_property("path", "triton" if (out.device, dtype, head_dim, group) in fla._CUDNN_REFUSED else "cudnn")
    assert err <= 2 * eager_err + ATOL, f"err {err:.3e} vs eager {eager_err:.3e}"
