"""DroidSpeak layer selection: profile which layer groups matter, pick contiguous recompute groups, save a config.

DroidSpeak reuses another agent's K/V in most layers and recomputes a few contiguous layer groups for context the
current agent has not seen. Which groups to recompute is profiled with the fidelity measure of
:mod:`eval_suite.fidelity` on a few dev examples (the ``--holdout`` examples just before each role file's held-out
tail, so the fidelity test set stays untouched):

1. the layers are cut into units of ``--group-size`` consecutive layers;
2. for each unit, DroidSpeak recomputes *only that unit*; its KL to ``non_shared`` is compared with ``full_shared``
   (nothing recomputed). The **gain** ``KL(full_shared) - KL(unit)`` is how much recomputing the unit helps: a lower
   KL when recomputed means a more critical unit;
3. the selection takes units covering ``round(n_layers * --fraction)`` layers (default a third, the paper's Pareto
   point) in at most ``--max-runs`` contiguous runs (each run is one recompute group, and each group stores one
   hidden-state buffer), maximising the summed gain (gains are treated as additive: an approximation, so the chosen
   set is measured again). The candidates (the best selection with ``--max-runs`` runs, the best single window,
   and the default middle third when it has the same size) are measured jointly on the same examples and the one
   with the lowest KL is kept; every candidate's KL is stored in the profile.

The config (``{"droidspeak_layers": [...], "groups": [[start, end], ...], "profile": {...}}``) is read by
``cli.py eval --droidspeak-config`` and ``cli.py fidelity --droidspeak-config``; the list also fits
``cli.py session --droidspeak-layers``.

Usage::

    python -m eval_suite.droidspeak_select --benchmark hotpotqa --adapters runs/hp/adapters --limit 4 \\
        --max-context-tokens 1024 --out configs/droidspeak_hotpotqa.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from eval_suite.fidelity import (
    FidelityExample,
    add_common_args,
    build_model,
    compare,
    examples_from_args,
    producer_for,
    scheme_logits,
    validate_common,
)
from eval_suite.report import check_writable, write_json
from lragent.lora_model import MultiLoraModel
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
        shared_split: ``last`` or ``piece`` (see :mod:`eval_suite.fidelity`).
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


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cli.py droidspeak-select", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.set_defaults(limit=4)
    p.add_argument("--group-size", type=int, default=2, help="layers per profiled unit")
    p.add_argument("--fraction", type=float, default=1 / 3, help="share of the layers to recompute")
    p.add_argument("--max-runs", type=int, default=2, help="most contiguous recompute groups")
    p.add_argument("--out", default="droidspeak.json", help="config file to write (JSON)")
    return p


def main(argv: list[str] | None = None) -> int:
    from lragent.command import parse_with_config

    args = parse_with_config(make_parser(), argv)
    if isinstance(args, int):  # --print_config done (0), or a bad --config (2)
        return args
    try:
        validate_common(args)
        check_writable(args.out, is_dir=False)
        if args.group_size < 1 or args.max_runs < 1:
            raise ValueError(f"--group-size and --max-runs must be >= 1, got {args.group_size}, {args.max_runs}")
        if not 0 < args.fraction <= 1:
            raise ValueError(f"--fraction must be in (0, 1], got {args.fraction}")
        model, tokenizer = build_model(args)
        examples = examples_from_args(args, model, tokenizer, "dev")
        config = select_droidspeak_layers(
            model, examples, group_size=args.group_size, fraction=args.fraction, max_runs=args.max_runs,
            producer=args.producer, shared_split=args.shared_split, use_kernel=not args.no_kernel,
            progress=not args.quiet,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config["profile"].update(
        benchmark=args.benchmark,
        model=args.model,
        adapters=str(Path(args.adapters).resolve()) if args.adapters else f"init:{args.adapter_init}",
        seed=args.seed,
    )
    from lragent.provenance import provenance

    config["provenance"] = provenance(
        dtype=args.dtype,
        device=str(next(model.parameters()).device.type),
        command=None if argv is None else ["cli.py", "droidspeak-select", *argv],
    )
    out = Path(args.out)
    write_json(out, config)
    prof = config["profile"]
    cands = ", ".join(f"{name} {c['kl']:.3e}" for name, c in prof["candidates"].items())
    print(
        f"droidspeak_layers {config['droidspeak_layers']} (groups {config['groups']}); KL full_shared "
        f"{prof['kl_full_shared']:.3e}, chosen {prof['chosen']} {prof['kl_selected']:.3e} (candidates: {cands}) "
        f"-> {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
