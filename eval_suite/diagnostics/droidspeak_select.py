"""DroidSpeak layer selection: profile which layer groups matter, pick contiguous recompute groups, save a config.

DroidSpeak reuses another agent's K/V in most layers and recomputes a few contiguous layer groups for context the
current agent has not seen. Which groups to recompute is profiled with the fidelity measure of
:mod:`eval_suite.diagnostics.fidelity` on a few dev examples (the ``--holdout`` examples just before each role file's
held-out tail, so the fidelity test set stays untouched):

1. the layers are cut into units of ``--group_size`` consecutive layers;
2. for each unit, DroidSpeak recomputes *only that unit*; its KL to ``non_shared`` is compared with ``full_shared``
   (nothing recomputed). The **gain** ``KL(full_shared) - KL(unit)`` is how much recomputing the unit helps: a lower
   KL when recomputed means a more critical unit;
3. the selection takes units covering ``round(n_layers * --fraction)`` layers (default a third, the paper's Pareto
   point) in at most ``--max_runs`` contiguous runs (each run is one recompute group, and each group stores one
   hidden-state buffer), maximising the summed gain (gains are treated as additive: an approximation, so the chosen
   set is measured again). The candidates (the best selection with ``--max_runs`` runs, the best single window,
   and the default middle third when it has the same size) are measured jointly on the same examples and the one
   with the lowest KL is kept; every candidate's KL is stored in the profile.

The config (``{"droidspeak_layers": [...], "groups": [[start, end], ...], "profile": {...}}``) is read by
``lragent eval --droidspeak_config`` and ``lragent fidelity --droidspeak_config``; the list also fits
``lragent session --droidspeak_layers``.

Usage::

    lragent droidspeak-select --benchmark hotpotqa --adapters data/adapters/hotpotqa_sharedA --limit 4 \\
        --max_context_tokens 1024 --out configs/droidspeak_hotpotqa.json
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from eval_suite.diagnostics.fidelity import (
    FidelityExample,
    check_example_args,
    check_producer,
    compare,
    load_role_examples,
    producer_for,
    scheme_logits,
)
from eval_suite.report import check_writable, write_json
from lragent.loading import check_model_args, load_lora_model
from lragent.lora_model import MultiLoraModel
from lragent.provenance import provenance
from lragent.session import default_droidspeak_layers, groups_from_layers


def layer_units(n_layers: int, group_size: int) -> list[tuple[int, int]]:
    """Consecutive half-open units ``[(0, g), (g, 2g), ...]``; the last one may be shorter."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    return [(a, min(a + group_size, n_layers)) for a in range(0, n_layers, group_size)]


def select_units(gains: Sequence[float], k: int, max_runs: int) -> list[int]:
    """Indices of ``k`` units forming at most ``max_runs`` contiguous runs with the largest summed gain.

    Exact dynamic programme over (unit, units taken, runs opened, previous unit taken); ties go to the earlier
    units.

    Args:
        gains: gain of each unit, in layer order.
        k: units to take (``1 <= k <= len(gains)``).
        max_runs: most contiguous runs allowed (>= 1).
    """
    n = len(gains)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n}, got {k}")
    if max_runs < 1:
        raise ValueError(f"max_runs must be >= 1, got {max_runs}")
    neg = float("-inf")

    @cache
    def best(i: int, left: int, runs: int, prev: bool) -> tuple[float, tuple[int, ...]]:
        if left == 0:
            return 0.0, ()
        if i == n or n - i < left:
            return neg, ()
        options = []
        new_runs = runs if prev else runs + 1
        if new_runs <= max_runs:
            v, rest = best(i + 1, left - 1, new_runs, True)
            options.append((v + gains[i], (i, *rest)))
        v, rest = best(i + 1, left, runs, False)
        options.append((v, rest))
        return max(options, key=lambda o: o[0])  # first (take) wins ties

    value, chosen = best(0, k, 0, False)
    assert value > neg, "a single run of k units always exists"
    return list(chosen)


@torch.no_grad()
def profile_units(
    model: MultiLoraModel,
    examples: Sequence[FidelityExample],
    units: Sequence[tuple[int, int]],
    *,
    producer: str = "next",
    shared_split: str = "last",
    extra: dict[str, Sequence[int]] | None = None,
    use_kernel: bool = True,
    progress: bool = False,
) -> dict:
    """Token-mean KL to ``non_shared`` of ``full_shared`` and of DroidSpeak recomputing each unit alone.

    Args:
        model: the multi-LoRA model.
        examples: dev examples.
        units: layer units ``(start, end)``.
        producer: ``next`` or a fixed role.
        shared_split: ``last`` or ``piece`` (see :mod:`eval_suite.diagnostics.fidelity`).
        extra: further named DroidSpeak layer sets to measure (e.g. the selection).
        use_kernel: fused kernel on CUDA.
        progress: tqdm bar.

    Returns:
        ``{"full_shared": kl, "units": [kl per unit], "extra": {name: kl}, "tokens": n}``.
    """
    from tqdm.auto import tqdm

    roles = list(model.router.roles)
    configs: list[tuple[str, list[int] | None]] = [("full_shared", None)]
    configs += [(f"unit{i}", list(range(a, b))) for i, (a, b) in enumerate(units)]
    configs += [(f"extra:{name}", list(layers)) for name, layers in (extra or {}).items()]
    sums = dict.fromkeys((c for c, _ in configs), 0.0)
    tokens = 0
    for ex in tqdm(examples, desc="droidspeak profile", unit="ex", disable=not progress):
        prod = producer_for(roles, ex.role, producer)
        ref = scheme_logits(model, "non_shared", ex, prod, shared_split=shared_split, use_kernel=use_kernel)
        tokens += ref.shape[0]
        for name, layers in configs:
            scheme = "full_shared" if layers is None else "droidspeak"
            logits = scheme_logits(
                model, scheme, ex, prod, shared_split=shared_split, droidspeak_layers=layers, use_kernel=use_kernel
            )
            sums[name] += float(compare(ref, logits)[0].sum())
    mean = {k: v / max(tokens, 1) for k, v in sums.items()}
    return {
        "full_shared": mean["full_shared"],
        "units": [mean[f"unit{i}"] for i in range(len(units))],
        "extra": {name: mean[f"extra:{name}"] for name in (extra or {})},
        "tokens": tokens,
    }


def select_droidspeak_layers(
    model: MultiLoraModel,
    examples: Sequence[FidelityExample],
    *,
    group_size: int = 2,
    fraction: float = 1 / 3,
    max_runs: int = 2,
    producer: str = "next",
    shared_split: str = "last",
    use_kernel: bool = True,
    progress: bool = False,
) -> dict:
    """Profiles every unit and returns the config ``{"droidspeak_layers", "groups", "profile"}``.

    The candidate selections are measured jointly on the same examples (``profile.candidates``); the one with the
    lowest KL is returned (``profile.chosen``, ``profile.kl_selected``).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    n_layers = model.n_layers
    units = layer_units(n_layers, group_size)
    target_layers = max(1, round(n_layers * fraction))
    k = min(len(units), max(1, round(target_layers / group_size)))
    prof = profile_units(
        model, examples, units, producer=producer, shared_split=shared_split, use_kernel=use_kernel, progress=progress
    )
    gains = [prof["full_shared"] - kl for kl in prof["units"]]
    candidates: dict[str, list[int]] = {}
    for runs in sorted({max_runs, 1}, reverse=True):
        chosen = select_units(gains, k, runs)
        candidates[f"profile_{runs}run"] = sorted(i for u in chosen for i in range(*units[u]))
    default = default_droidspeak_layers(n_layers)
    if len(default) == k * group_size or len(default) == target_layers:
        candidates["middle_third"] = default
    check = profile_units(
        model, examples, [], producer=producer, shared_split=shared_split, use_kernel=use_kernel, extra=candidates
    )
    best = min(candidates, key=lambda name: check["extra"][name])  # first listed wins ties
    layers = candidates[best]
    return {
        "droidspeak_layers": layers,
        "groups": [list(g) for g in groups_from_layers(layers, n_layers)],
        "profile": {
            "n_layers": n_layers,
            "group_size": group_size,
            "fraction": fraction,
            "max_runs": max_runs,
            "producer": producer,
            "shared_split": shared_split,
            "examples": len(examples),
            "tokens": prof["tokens"],
            "kl_full_shared": prof["full_shared"],
            "units": [
                {"layers": list(u), "kl": kl, "gain": g} for u, kl, g in zip(units, prof["units"], gains, strict=True)
            ],
            "candidates": {name: {"layers": c, "kl": check["extra"][name]} for name, c in candidates.items()},
            "chosen": best,
            "kl_selected": check["extra"][best],
        },
    }


def droidspeak_select(
    benchmark: str = "hotpotqa",
    model: str = "default",
    adapters: str | None = None,
    adapter_init: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    holdout: int = 100,
    limit: int = 4,
    max_context_tokens: int | None = None,
    producer: str = "next",
    shared_split: str = "last",
    group_size: int = 2,
    fraction: float = 1 / 3,
    max_runs: int = 2,
    dtype: str = "float32",
    device: str | None = None,
    use_kernel: bool = True,
    out: str = "droidspeak.json",
    quiet: bool = False,
) -> int:
    """Profiles which layer groups DroidSpeak should recompute and writes the chosen layers as a config.

    Each unit of --group_size layers is recomputed alone on the dev examples (the --holdout examples before each
    role file's held-out tail) and compared with full_shared; units covering --fraction of the layers in at most
    --max_runs contiguous groups are chosen, and the candidates are measured jointly. The config is read by
    eval --droidspeak_config and fidelity --droidspeak_config.

    Args:
        benchmark: hotpotqa or scienceqa (its role example files in data/trajectories).
        model: base model: default (embedded SmolLM2-135M-Instruct), a hub name or a local directory.
        adapters: adapter directory (native checkpoint or PEFT role directories).
        adapter_init: zero or random adapters instead of --adapters (one of the two is required).
        rank: LoRA rank for --adapter_init.
        alpha: LoRA alpha for --adapter_init.
        seed: seed of the adapter init and of the example draw.
        holdout: size of the held-out tail (the dev pool is the holdout examples before it).
        limit: dev examples per role.
        max_context_tokens: cut each context from the left to this many tokens (default: no cut).
        producer: next (the next role, wrapping) or a fixed role name.
        shared_split: last or piece: where the shared cache ends.
        group_size: layers per profiled unit.
        fraction: share of the layers to recompute, in (0, 1].
        max_runs: most contiguous recompute groups.
        dtype: compute dtype (float32, bfloat16, float16).
        device: cpu, cuda, cuda:N or mps (default cuda when available).
        use_kernel: the fused Flash-LoRA-Attention kernel on CUDA (false: the PyTorch attention path).
        out: config file to write (JSON).
        quiet: no progress bar.

    Returns:
        0 on success.
    """
    check_example_args(benchmark, holdout, limit, max_context_tokens, shared_split)
    check_model_args(
        model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha, dtype=dtype,
        device=device, exactly_one=True, needs_text=True,
    )  # fmt: skip
    if group_size < 1 or max_runs < 1:
        raise ValueError(f"--group_size and --max_runs must be >= 1, got {group_size}, {max_runs}")
    if not 0 < fraction <= 1:
        raise ValueError(f"--fraction must be in (0, 1], got {fraction}")
    out_path = check_writable(out, is_dir=False)
    lm, tokenizer = load_lora_model(
        model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha, seed=seed, dtype=dtype,
        device=device,
    )  # fmt: skip
    check_producer(lm, producer)
    examples = load_role_examples(
        benchmark, list(lm.router.roles), tokenizer, holdout=holdout, limit=limit, seed=seed,
        max_context_tokens=max_context_tokens, pool="dev",
    )  # fmt: skip
    config = select_droidspeak_layers(
        lm, examples, group_size=group_size, fraction=fraction, max_runs=max_runs, producer=producer,
        shared_split=shared_split, use_kernel=use_kernel, progress=not quiet,
    )  # fmt: skip
    config["profile"].update(
        benchmark=benchmark,
        model=model,
        adapters=str(Path(adapters).resolve()) if adapters else f"init:{adapter_init}",
        seed=seed,
    )
    config["provenance"] = provenance(dtype=dtype, device=str(next(lm.parameters()).device.type))
    write_json(out_path, config)
    prof = config["profile"]
    cands = ", ".join(f"{name} {c['kl']:.3e}" for name, c in prof["candidates"].items())
    print(
        f"droidspeak_layers {config['droidspeak_layers']} (groups {config['groups']}); KL full_shared "
        f"{prof['kl_full_shared']:.3e}, chosen {prof['chosen']} {prof['kl_selected']:.3e} (candidates: {cands}) "
        f"-> {out_path}"
    )
    return 0
