"""Benchmark Flash-LoRA-Attention against plain attention (torch SDPA, the floor) and naive expansion.

LLaMA-3.1-8B attention shapes (32 query heads, 8 KV heads, head dim 128), LoRA rank 8, bf16, one GPU, one run.

**Decode** (``flash_lora_decode``), for batch 1 and 32 and key lengths L = 1k … 64k, every row at length L:

- ``fused``: one decode step over a static cache of capacity C = the largest L (rows of mixed roles);
- ``plain``: the same kernel without the LoRA term (what the plain-cache schemes run);
- ``floor``: plain attention through torch SDPA over dense (B, Hkv, L, D) K and V_base (the best of the flash,
  cuDNN and memory-efficient backends by graph time; GQA through ``enable_gqa``): what attention costs without
  any LoRA term;
- ``naive`` / ``naive-1p``: materialise ``V = V_base + V_lr B s`` for the L keys (eagerly / in one baddbmm),
  then the floor's SDPA backend.

**Prefill** (``flash_lora_attention``, batch 1): a full causal prefill (Lc = L) and 4096-token chunks at the end
of L keys; ``fused`` is what the function runs (its rule picks cuDNN over expanded values for full prefills where
cuDNN runs), ``kernel`` the Triton prefill kernel alone.

Timing: **graph** = median of ``triton.testing.do_bench_cudagraph`` (GPU time, no launch overhead; what a
graph-captured decode step costs); **eager** = median of ``triton.testing.do_bench`` (Python calls, L2 cleared
before each). ``fused_graph_once`` captures the decode step once at capacity and replays it at every L (the
engine's way). Achieved bandwidth = bytes that must move (K, V_base, V_lr, q, out) / graph time, next to the
device-to-device copy rate measured in the same run.

Run: ``python cli.py bench kernel --out DIR`` (on a GPU machine without jsonargparse, carry its wheel: the device
notes in ``docs/engine.md``); ``--sweep`` also times decode launch configurations (how
``kernels.flash_lora_decode._plan`` was chosen). A reporting command like ``bench decode``: it lives in
``eval_suite`` so that ``kernels/`` imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HQ, HKV, HEAD_DIM, RANK = 32, 8, 128, 8  # LLaMA-3.1-8B attention, LoRA r = 8
SCALING = 2.0  # alpha 16 / r 8
N_ROLES = 3
TIMINGS = ("graph", "eager")
DECODE_FLOOR_MAX = 1.25
EAGER_64K_MAX = 1.5
PREFILL_CHUNK_MAX = 1.10
PREFILL_FULL_MAX = 1.3


# --------------------------------------------------------------------------------------------------
# Timing and baselines
# --------------------------------------------------------------------------------------------------


def _time(fn: Callable[[], object], quick: bool) -> dict[str, float]:
    """Median ms of fn as a CUDA-graph replay (``graph``) and as Python calls with L2 cleared (``eager``)."""
    import triton

    fn()  # compile outside the timed region
    torch.cuda.synchronize()
    rep = 40 if quick else 100
    eager = triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception:  # noqa: BLE001 - a method that cannot be captured keeps its eager time only
        graph = float("nan")
    return {"graph": float(graph), "eager": float(eager)}


def _replay_time(graph: torch.cuda.CUDAGraph, calls: int, reps: int = 20) -> float:
    """Median ms per call of a captured graph holding ``calls`` calls."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def _copy_rate() -> float:
    """Device-to-device copy rate in TB/s (bytes read plus written), 1 GiB buffers."""
    import triton

    src = torch.empty(2**29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e9


def _sdpa_backends() -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    names = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]
    return [(n.lower(), getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n)]


def _sdpa_call(backend: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain attention, bottom-right causal for a chunk (no mask needed for Lc = 1), GQA via enable_gqa."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    lc, seq = q.shape[2], k.shape[2]
    with sdpa_kernel([backend]):
        if lc == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if lc == seq:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lc, seq), enable_gqa=True)


def _floor(row: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quick: bool) -> object:
    """Time every SDPA backend on (q, k, v); store the best (by graph time) as row['floor']; return its backend."""
    by_backend: dict[str, dict[str, float]] = {}
    for name, backend in _sdpa_backends():
        try:
            _sdpa_call(backend, q, k, v)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a backend that cannot run this shape is recorded, not fatal
            row.setdefault("floor_unavailable", {})[name] = str(err).splitlines()[0][:160]
            continue
        by_backend[name] = _time(lambda b=backend: _sdpa_call(b, q, k, v), quick)
    if not by_backend:
        raise RuntimeError(f"no SDPA backend ran: {row.get('floor_unavailable')}")
    best = min(by_backend, key=lambda n: by_backend[n]["graph"] if not math.isnan(by_backend[n]["graph"]) else 1e9)
    row["floor_by_backend"], row["floor_backend"], row["floor"] = by_backend, best, by_backend[best]
    return dict(_sdpa_backends())[best]


def _naive_values(v: torch.Tensor, v_lr: torch.Tensor, lora_b: torch.Tensor, roles: torch.Tensor) -> torch.Tensor:
    """The literal eager formula V = V_base + (V_lr B_role) s for all L keys: (B, Hkv, L, D)."""
    return v + torch.matmul(v_lr.unsqueeze(1), lora_b[roles]) * SCALING


def _naive_values_one_pass(
    v: torch.Tensor, v_lr: torch.Tensor, lora_b: torch.Tensor, roles: torch.Tensor
) -> torch.Tensor:
    """The same expansion in one baddbmm (reads V_base once, writes V once): the cheapest naive variant."""
    b_sel = lora_b[roles]  # (B, Hkv, r, D)
    lr = v_lr.unsqueeze(1).expand(-1, v.shape[1], -1, -1)
    return torch.baddbmm(v.flatten(0, 1), lr.flatten(0, 1), b_sel.flatten(0, 1), alpha=SCALING).view_as(v)


def _ratios(row: dict) -> None:
    for t in TIMINGS:
        row[f"fused_vs_floor_{t}"] = row["fused"][t] / row["floor"][t]
        row[f"naive_vs_fused_{t}"] = row["naive"][t] / row["fused"][t]
        row[f"naive_1p_vs_fused_{t}"] = row["naive_1p"][t] / row["fused"][t]
        if "plain" in row:
            row[f"plain_vs_floor_{t}"] = row["plain"][t] / row["floor"][t]
        if "kernel" in row:
            row[f"kernel_vs_floor_{t}"] = row["kernel"][t] / row["floor"][t]


# --------------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------------


def _decode_inputs(bsz: int, capacity: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype).mul_(scale)

    b_peft = rnd(N_ROLES, HKV * HEAD_DIM, RANK, scale=0.05)  # PEFT layout (n_roles, Hkv*D, r)
    return {
        "q": rnd(bsz, HQ, HEAD_DIM),
        "k_cache": rnd(bsz, HKV, capacity, HEAD_DIM),
        "v_cache": rnd(bsz, HKV, capacity, HEAD_DIM),
        "v_lr_cache": rnd(bsz, capacity, RANK),
        "lora_b": b_peft.view(N_ROLES, HKV, HEAD_DIM, RANK).transpose(-1, -2),  # (n_roles, Hkv, r, D) view
        "role_ids": torch.arange(bsz, device="cuda") % N_ROLES,
        "kv_lens": torch.full((bsz,), capacity, dtype=torch.int32, device="cuda"),
        "out": torch.empty(bsz, HQ, HEAD_DIM, dtype=dtype, device="cuda"),
    }


def bench_decode_batch(bsz: int, lengths: list[int], dtype: torch.dtype, quick: bool, log: Callable) -> list[dict]:
    """All decode rows of one batch size over one cache of capacity max(lengths)."""
    from kernels.flash_lora_decode import flash_lora_decode, flash_lora_decode_reference

    cap = max(lengths)
    x = _decode_inputs(bsz, cap, dtype, seed=bsz)
    lora = {k: x[k] for k in ("q", "k_cache", "v_cache", "kv_lens", "v_lr_cache", "lora_b", "role_ids", "out")}
    plain = {k: x[k] for k in ("q", "k_cache", "v_cache", "kv_lens", "out")}
    fused = lambda: flash_lora_decode(**lora, scaling=SCALING)  # noqa: E731

    fused()  # warm-up (compiles) before capture
    torch.cuda.synchronize()
    calls = 10
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fused()

    rows = []
    for seq in lengths:
        x["kv_lens"].fill_(seq)
        row: dict = {"mode": "decode", "batch": bsz, "L": seq, "capacity": cap}
        row["fused_graph_once"] = _replay_time(graph, calls)
        row["fused"] = _time(fused, quick)
        row["plain"] = _time(lambda: flash_lora_decode(**plain), quick)
        _decode_baselines(row, x, seq, quick)
        got = fused().float()
        row["max_abs_diff_vs_naive"] = (got - row.pop("_naive_out")).abs().max().item()
        row["plain_max_abs_diff_vs_floor"] = (
            (flash_lora_decode(**plain).float() - row.pop("_floor_out")).abs().max().item()
        )
        if bsz == 1:  # the fp32 reference (gathers the cache in fp32: kept to batch 1)
            exact = flash_lora_decode_reference(**lora, scaling=SCALING).float()
            row["max_abs_err_vs_reference"] = (got - exact).abs().max().item()
        item = x["q"].element_size()
        row["min_bytes"] = bsz * item * (2 * HKV * seq * HEAD_DIM + seq * RANK + 2 * HQ * HEAD_DIM)
        row["fused_tb_per_s"] = row["min_bytes"] / row["fused"]["graph"] / 1e9
        floor_bytes = bsz * item * (2 * HKV * seq * HEAD_DIM + 2 * HQ * HEAD_DIM)
        row["floor_tb_per_s"] = floor_bytes / row["floor"]["graph"] / 1e9
        _ratios(row)
        rows.append(row)
        log(
            f"decode B={bsz:2d} L={seq:6d} graph: fused {row['fused']['graph']:.4f} "
            f"(once {row['fused_graph_once']:.4f}) plain {row['plain']['graph']:.4f} floor {row['floor']['graph']:.4f} "
            f"({row['floor_backend']}) naive {row['naive']['graph']:.4f} | eager: fused {row['fused']['eager']:.4f} "
            f"floor {row['floor']['eager']:.4f}"
        )
    del graph
    return rows


def _decode_baselines(row: dict, x: dict, seq: int, quick: bool) -> None:
    """Floor and naive times of one decode row over dense copies of the first seq keys (outputs kept for checks)."""
    q4 = x["q"].unsqueeze(2)  # (B, Hq, 1, D)
    k, v = x["k_cache"][:, :, :seq].contiguous(), x["v_cache"][:, :, :seq].contiguous()
    v_lr, lora_b, roles = x["v_lr_cache"][:, :seq], x["lora_b"], x["role_ids"]
    backend = _floor(row, q4, k, v, quick)
    row["naive"] = _time(lambda: _sdpa_call(backend, q4, k, _naive_values(v, v_lr, lora_b, roles)), quick)
    row["naive_1p"] = _time(lambda: _sdpa_call(backend, q4, k, _naive_values_one_pass(v, v_lr, lora_b, roles)), quick)
    row["_naive_out"] = _sdpa_call(backend, q4, k, _naive_values(v, v_lr, lora_b, roles)).squeeze(2).float()
    row["_floor_out"] = _sdpa_call(backend, q4, k, v).squeeze(2).float()


def sweep_decode(bsz: int, lengths: list[int], dtype: torch.dtype, log: Callable) -> list[dict]:
    """Graph time of the decode kernel under launch configurations around the rule's choice."""
    import triton

    from kernels.flash_lora_attention import _num_sms
    from kernels.flash_lora_decode import _launch_decode, _plan

    variants = {
        "rule": {},
        "1 program/SM": {"programs_per_sm": 1},
        "3 programs/SM": {"programs_per_sm": 3},
        "4 programs/SM": {"programs_per_sm": 4},
        "min split 2 tiles": {"min_split_tiles": 2},
        "min split 4 tiles": {"min_split_tiles": 4},
        "4 warps": {"num_warps": 4},
        "BLOCK_N 32, 4 stages": {"block_n": 32, "num_stages": 4},
        "BLOCK_N 32, 4 stages, 3 programs/SM": {"block_n": 32, "num_stages": 4, "programs_per_sm": 3},
        "2 stages": {"num_stages": 2},
        "4 stages": {"num_stages": 4},
    }
    cap = max(lengths)
    x = _decode_inputs(bsz, cap, dtype, seed=bsz)
    args = [x[k] for k in ("q", "k_cache", "v_cache", "kv_lens", "v_lr_cache", "lora_b")]
    rows = []
    for name, over in variants.items():
        plan = _plan(bsz, HKV, HQ // HKV, cap, HEAD_DIM, _num_sms(x["q"].device), lora=True, **over)
        row = {"batch": bsz, "variant": name, "plan": dataclasses.asdict(plan), "graph_ms": {}}
        for seq in lengths:
            x["kv_lens"].fill_(seq)
            fn = lambda p=plan: _launch_decode(*args, SCALING, x["role_ids"], None, None, x["out"], p)  # noqa: E731
            fn()
            row["graph_ms"][seq] = float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))
        rows.append(row)
        log(f"sweep B={bsz:2d} {name:32s} " + " ".join(f"{s}:{t:.4f}" for s, t in row["graph_ms"].items()))
    return rows


# --------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------


def bench_prefill(seq: int, lc: int, dtype: torch.dtype, quick: bool, log: Callable) -> dict:
    """One prefill row: the public function (its dispatch rule), the Triton kernel alone, floor and naive."""
    import kernels.flash_lora_attention as fla

    gen = torch.Generator(device="cuda").manual_seed(seq + lc)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype).mul_(scale)

    q = rnd(1, lc, HQ, HEAD_DIM).transpose(1, 2)  # (B, Hq, Lc, D) as a projection produces it
    k, v, v_lr = rnd(1, HKV, seq, HEAD_DIM), rnd(1, HKV, seq, HEAD_DIM), rnd(1, seq, RANK)
    lora_b = rnd(N_ROLES, HKV * HEAD_DIM, RANK, scale=0.05).view(N_ROLES, HKV, HEAD_DIM, RANK).transpose(-1, -2)
    roles = torch.tensor([1], device="cuda")
    args = (q, k, v, v_lr, lora_b, SCALING)
    sm_scale = 1.0 / math.sqrt(HEAD_DIM)
    row: dict = {"mode": "prefill", "batch": 1, "L": seq, "Lc": lc}
    row["fused"] = _time(lambda: fla.flash_lora_attention(*args, role_ids=roles), quick)
    row["kernel"] = _time(lambda: fla._launch(*args, roles, None, sm_scale), quick)
    by_cudnn = lc == seq and fla._full_prefill_sdpa(*args, roles, sm_scale) is not None  # the rule's choice
    row["path"] = "cudnn over expanded V" if by_cudnn else "triton kernel"
    backend = _floor(row, q, k, v, quick)
    naive = lambda: _sdpa_call(backend, q, k, _naive_values(v, v_lr, lora_b, roles))  # noqa: E731
    row["naive"] = _time(naive, quick)
    row["naive_1p"] = _time(lambda: _sdpa_call(backend, q, k, _naive_values_one_pass(v, v_lr, lora_b, roles)), quick)
    ref = naive().float()
    row["max_abs_diff_vs_naive"] = (fla.flash_lora_attention(*args, role_ids=roles).float() - ref).abs().max().item()
    row["kernel_max_abs_diff_vs_naive"] = (fla._launch(*args, roles, None, sm_scale).float() - ref).abs().max().item()
    visible = sum(seq - lc + i + 1 for i in range(lc))
    row["flops"] = 4 * HQ * HEAD_DIM * visible
    row["fused_tflop_per_s"] = row["flops"] / row["fused"]["graph"] / 1e9
    _ratios(row)
    log(
        f"prefill L={seq:6d} Lc={lc:5d} graph: fused {row['fused']['graph']:.4f} ({row['path']}) kernel "
        f"{row['kernel']['graph']:.4f} floor {row['floor']['graph']:.4f} ({row['floor_backend']}) naive "
        f"{row['naive']['graph']:.4f}"
    )
    return row


# --------------------------------------------------------------------------------------------------
# Targets and report
# --------------------------------------------------------------------------------------------------


def _targets(decode: list[dict], prefill: list[dict]) -> list[dict]:
    """The kernel's targets, each with its measured value."""
    out = []
    for r in decode:
        tag = f"decode B={r['batch']} L={r['L']}"
        out.append({"what": f"{tag} fused/floor (graph)", "measured": r["fused_vs_floor_graph"],
                    "target": f"<= {DECODE_FLOOR_MAX}"})  # fmt: skip
        out.append({"what": f"{tag} plain/floor (graph)", "measured": r["plain_vs_floor_graph"],
                    "target": f"<= {DECODE_FLOOR_MAX}"})  # fmt: skip
        out.append({"what": f"{tag} naive/fused (graph)", "measured": r["naive_vs_fused_graph"], "target": ">= 1.0"})
        if r["L"] == 65536:
            out.append({"what": f"{tag} fused/floor (eager)", "measured": r["fused_vs_floor_eager"],
                        "target": f"<= {EAGER_64K_MAX}"})  # fmt: skip
    for r in prefill:
        if r["L"] == 32768 and r["Lc"] == 4096:
            out.append({"what": "prefill 4096 chunk @ L=32k fused/floor (graph)", "measured": r["fused_vs_floor_graph"],
                        "target": f"<= {PREFILL_CHUNK_MAX}"})  # fmt: skip
        if r["L"] == 2048 and r["Lc"] == 2048:
            out.append({"what": "full causal prefill 2k fused/floor (graph)", "measured": r["fused_vs_floor_graph"],
                        "target": f"<= {PREFILL_FULL_MAX}"})  # fmt: skip
    for t in out:
        op, val = t["target"].split()
        met = t["measured"] <= float(val) if op == "<=" else t["measured"] >= float(val)
        t["status"] = "met" if met else "MISSED"
    return out


def _markdown(result: dict) -> str:
    from lragent.provenance import provenance_footer
    from lragent.report_io import markdown_table

    s = result["shapes"]
    lines = [
        f"# Flash-LoRA-Attention benchmark ({result['gpu']})",
        "",
        f"{result['dtype']}; Hq={s['Hq']}, Hkv={s['Hkv']}, D={s['D']}, r={s['r']}, s={s['scaling']}; median ms. "
        "**graph** = CUDA-graph replay (`do_bench_cudagraph`: GPU time); **eager** = Python calls (`do_bench`, L2 "
        "cleared each call). floor = best torch SDPA backend (by graph time) on dense K, V_base of length L; naive = "
        "eager `V_base + (V_lr B) s` then that SDPA; naive-1p = the expansion in one baddbmm. Decode: the fused and "
        "plain kernels read a static cache of capacity C = max L; `once` = one graph captured at capacity, replayed "
        f"at each L. Device-to-device copy rate measured in this run: {result['copy_tb_per_s']:.2f} TB/s.",
        "",
    ]
    dec = result["decode"]
    for t in TIMINGS if dec else ():
        head = ["B", "L", "fused", "plain", "floor (backend)", "naive", "naive-1p", "fused/floor", "plain/floor"]
        head += ["naive/fused", "naive-1p/fused"] + (["once", "fused TB/s", "floor TB/s"] if t == "graph" else [])
        body = []
        for r in dec:
            cells = [r["batch"], r["L"], f"{r['fused'][t]:.4f}", f"{r['plain'][t]:.4f}"]
            cells += [f"{r['floor'][t]:.4f} ({r['floor_backend']})", f"{r['naive'][t]:.4f}", f"{r['naive_1p'][t]:.4f}"]
            cells += [f"{r[f'fused_vs_floor_{t}']:.3f}", f"{r[f'plain_vs_floor_{t}']:.3f}"]
            cells += [f"{r[f'naive_vs_fused_{t}']:.2f}", f"{r[f'naive_1p_vs_fused_{t}']:.2f}"]
            if t == "graph":
                cells += [f"{r['fused_graph_once']:.4f}", f"{r['fused_tb_per_s']:.2f}", f"{r['floor_tb_per_s']:.2f}"]
            body.append(cells)
        lines += [f"## Decode, {t}", "", markdown_table(head, body, ["r"] * len(head))]
    if dec:
        diffs = ", ".join(f"B={r['batch']} L={r['L']}: {r['max_abs_diff_vs_naive']:.1e}" for r in dec)
        lines += [f"Max \\|fused - naive\\| per decode case: {diffs}.", ""]
    pre = result["prefill"]
    for t in TIMINGS if pre else ():
        head = ["L", "Lc", "fused (path)", "kernel", "floor (backend)", "naive", "fused/floor", "kernel/floor"]
        head += ["naive/fused"]
        body = [
            [r["L"], r["Lc"], f"{r['fused'][t]:.4f} ({r['path']})", f"{r['kernel'][t]:.4f}",
             f"{r['floor'][t]:.4f} ({r['floor_backend']})", f"{r['naive'][t]:.4f}", f"{r[f'fused_vs_floor_{t}']:.3f}",
             f"{r[f'kernel_vs_floor_{t}']:.3f}", f"{r[f'naive_vs_fused_{t}']:.2f}"]
            for r in pre
        ]  # fmt: skip
        lines += [f"## Prefill (batch 1), {t}", "", markdown_table(head, body, ["r"] * len(head))]
    if result.get("sweep"):
        lens = list(result["sweep"][0]["graph_ms"])
        lines += ["## Decode launch-configuration sweep (graph ms)", "", "| B | variant | " + " | ".join(
            f"L={s}" for s in lens) + " |", "|---:|---|" + "---:|" * len(lens)]  # fmt: skip
        for r in result["sweep"]:
            lines.append(
                f"| {r['batch']} | {r['variant']} | " + " | ".join(f"{r['graph_ms'][s]:.4f}" for s in lens) + " |"
            )
        lines.append("")
    lines += ["## Targets", ""]
    for t in result["targets"]:
        lines.append(f"- {t['what']}: measured {t['measured']:.3f}, target {t['target']} -> {t['status']}")
    return "\n".join(lines) + "\n" + provenance_footer(result["provenance"])


def _autotune_choices() -> dict[str, str]:
    """The configs the prefill autotuner picked, per key (for the notes)."""
    import kernels.flash_lora_attention as fla

    out = {}
    for name in ("_prefill_tuned", "_decode_tuned"):
        for key, cfg in getattr(getattr(fla, name, None), "cache", {}).items():
            out[f"{name}{key}"] = str(cfg)
    return out


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{name} must list positive integers, got {text!r}")
    return vals


def bench_kernel(
    out: str = "outputs/bench_kernel",
    lengths: str = "1024,2048,4096,8192,16384,32768,65536",
    batches: str = "1,32",
    prefill: str = "2048:2048,8192:8192,8192:4096,32768:4096,65536:4096",
    modes: str = "decode,prefill",
    dtype: str = "bf16",
    quick: bool = False,
    sweep: bool = False,
) -> int:
    """Time Flash-LoRA decode and prefill against torch SDPA (the floor) and naive expansion on one GPU.

    Args:
        out: output directory for bench_kernel.json and bench_kernel.md.
        lengths: comma-separated decode key lengths L; the decode cache capacity is the largest.
        batches: comma-separated decode batch sizes.
        prefill: comma-separated L:Lc prefill cases (Lc = L is a full causal prefill).
        modes: comma-separated subset of decode,prefill.
        dtype: bf16 or fp16.
        quick: shorter timing (noisier).
        sweep: also time decode launch configurations (batch 1 and the largest batch).

    Returns:
        0 on success.
    """
    dec_lengths = _ints(lengths, "lengths")
    dec_batches = _ints(batches, "batches")
    try:
        pre_cases = [tuple(int(v) for v in c.split(":")) for c in prefill.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"prefill must be comma-separated L:Lc pairs, got {prefill!r}") from None
    if any(len(c) != 2 or not 1 <= c[1] <= c[0] for c in pre_cases):
        raise ValueError(f"prefill pairs L:Lc need 1 <= Lc <= L, got {prefill!r}")
    mode_set = {m for m in modes.split(",") if m}
    if not mode_set or not mode_set <= {"decode", "prefill"}:
        raise ValueError(f"modes must be a comma-separated subset of decode,prefill, got {modes!r}")
    if dtype not in ("bf16", "fp16"):
        raise ValueError(f"dtype must be bf16 or fp16, got {dtype!r}")
    if not torch.cuda.is_available():
        raise ValueError("bench kernel needs a CUDA GPU (torch.cuda.is_available() is False)")
    from kernels.flash_lora_attention import set_autotune

    set_autotune(True)  # prefill timings: tuned configs
    from lragent.provenance import provenance
    from lragent.report_io import write_json, write_text

    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "dtype": dtype,
        "shapes": {"Hq": HQ, "Hkv": HKV, "D": HEAD_DIM, "r": RANK, "scaling": SCALING, "n_roles": N_ROLES},
        "provenance": provenance(dtype=tdt, device="cuda"),
        "copy_tb_per_s": _copy_rate(),
        "decode": [],
        "prefill": [],
        "sweep": [],
    }

    def log(msg: str) -> None:
        print(msg, flush=True)

    def save() -> None:
        result["targets"] = _targets(result["decode"], result["prefill"])
        result["prefill_autotune"] = _autotune_choices()
        write_json(out_dir / "bench_kernel.json", result)

    log(f"{result['gpu']}: {result['sms']} SMs, copy rate {result['copy_tb_per_s']:.2f} TB/s")
    if sweep:
        for bsz in sorted({1, max(dec_batches)}):
            result["sweep"] += sweep_decode(bsz, [v for v in dec_lengths if v in (1024, 4096, 16384, 65536)]
                                            or dec_lengths, tdt, log)  # fmt: skip
            torch.cuda.empty_cache()
        save()
    if "decode" in mode_set:
        for bsz in dec_batches:
            result["decode"] += bench_decode_batch(bsz, dec_lengths, tdt, quick, log)
            torch.cuda.empty_cache()
            save()
    if "prefill" in mode_set:
        for seq, lc in pre_cases:
            result["prefill"].append(bench_prefill(seq, lc, tdt, quick, log))
            torch.cuda.empty_cache()
            save()
    save()
    md = _markdown(result)
    write_text(out_dir / "bench_kernel.md", md)
    print(md)
    return 0
