"""``cli.py data-stats``: token lengths of the role files and what batching makes of them, for choosing settings.

Per role file: example count and token lengths (whole examples, nothing cut: p50 / p95 / p99 / max), the share of
output tokens (what the loss sees), and the share of examples that fit ``max_length``. For the training split under
two data paths, the one configured and the old one (one example per sequence, fixed batches of ``batch_size``):
sequences, real and padded tokens per epoch, padding, batches per epoch, and real tokens and examples per optimizer
step. Writes ``data_stats.json`` (with provenance) and ``data_stats.md``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datamodules.role_examples import (
    LengthBucketBatchSampler,
    RoleExampleDataModule,
    read_records,
    resolve_tokenizer,
    tokenize_example,
)
from eval_suite.report import check_writable, markdown_table, write_json, write_text
from lragent.paths import DATA_DIR

BENCHMARKS: tuple[str, ...] = ("hotpotqa", "scienceqa")
ROLES: tuple[str, ...] = ("plan", "action", "reflect")


def length_stats(lengths: list[int], outputs: list[int], max_length: int) -> dict[str, Any]:
    """``{"n", "p50", "p95", "p99", "max", "output_share", "fit_share"}`` of full example lengths."""
    x = np.asarray(lengths)
    return {
        "n": len(lengths),
        "p50": float(np.percentile(x, 50)),
        "p95": float(np.percentile(x, 95)),
        "p99": float(np.percentile(x, 99)),
        "max": int(x.max()),
        "output_share": float(sum(outputs) / x.sum()),
        "fit_share": float((x <= max_length).mean()),
    }


def batching_stats(
    dm: RoleExampleDataModule, accumulate: int, pool_batches: int, batch_size: int, max_tokens: int | None
) -> dict[str, Any]:
    """Epoch-level numbers of the training split of a set-up data module under a batching."""
    seqs = dm.train_set
    lengths = seqs.lengths
    sampler = LengthBucketBatchSampler(
        lengths, batch_size, seed=dm.seed, pool_batches=pool_batches, max_tokens=max_tokens
    )
    batches = list(sampler)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    real = sum(lengths)
    steps = len(batches) / accumulate
    examples = sum(e.n_examples for e in seqs.examples)
    return {
        "examples": examples,
        "sequences": len(seqs),
        "tokens": real,
        "padded_tokens": padded,
        "padding": 1 - real / padded,
        "batches": len(batches),
        "optimizer_steps": steps,
        "tokens_per_step": real / steps,
        "padded_tokens_per_step": padded / steps,
        "examples_per_step": examples / steps,
        "max_rows": max(len(b) for b in batches),
    }


def data_stats(
    out: str,
    benchmarks: list[str] | None = None,
    tokenizer: str = "default",
    max_length: int = 4096,
    max_tokens: int | None = 16384,
    pack_prefixes: bool = True,
    accumulate: int = 1,
    batch_size: int = 4,
    pool_batches: int = 50,
    baseline_accumulate: int = 8,
    val_fraction: float = 0.05,
    seed: int = 0,
) -> int:
    """Token lengths of the bundled role files and the batches the training data path makes of them.

    Args:
        out: output directory (``data_stats.json``, ``data_stats.md``).
        benchmarks: which trajectory sets (``hotpotqa``, ``scienceqa``); default both.
        tokenizer: tokenizer name (``default``: the embedded SmolLM2's).
        max_length: the configured ``data.max_length`` (coverage is reported against it).
        max_tokens: the configured ``data.max_tokens`` (``None``: fixed batches of ``batch_size``).
        pack_prefixes: the configured ``data.pack_prefixes``.
        accumulate: the configured ``trainer.accumulate_grad_batches``.
        batch_size: examples per batch of the baseline path (and of the configured one without ``max_tokens``).
        pool_batches: sorting pools of fixed-size batches.
        baseline_accumulate: gradient accumulation of the baseline path (the paper configs: 8).
        val_fraction: held-out share per role.
        seed: split and order seed.

    Returns:
        0.
    """
    benchmarks = list(benchmarks or BENCHMARKS)
    unknown = [b for b in benchmarks if b not in BENCHMARKS]
    if unknown:
        raise ValueError(f"benchmark {unknown[0]!r} not bundled: allowed {', '.join(BENCHMARKS)}")
    if max_length < 2 or (max_tokens is not None and max_tokens < max_length):
        raise ValueError(f"need max_length >= 2 and max_tokens >= max_length, got {max_length}, {max_tokens}")
    out_dir = check_writable(out, is_dir=True)
    from lragent.provenance import provenance, provenance_footer

    tok = resolve_tokenizer(tokenizer)
    result: dict[str, Any] = {"settings": {
        "tokenizer": tokenizer, "max_length": max_length, "max_tokens": max_tokens, "pack_prefixes": pack_prefixes,
        "accumulate": accumulate, "batch_size": batch_size, "baseline_accumulate": baseline_accumulate,
    }, "benchmarks": {}}  # fmt: skip
    md = ["# Role data: token lengths and batches", ""]
    for bench in benchmarks:
        files = {r: str(DATA_DIR / "trajectories" / bench / f"{r}.jsonl.gz") for r in ROLES}
        roles = {}
        for role, path in files.items():
            full = [tokenize_example(tok, rec, 0, 10**7) for rec in read_records(path)]
            lengths = [len(e.input_ids) for e in full]
            roles[role] = length_stats(
                lengths, [n - e.context_len for n, e in zip(lengths, full, strict=True)], max_length
            )
        common = dict(tokenizer=tok, max_length=max_length, val_fraction=val_fraction, seed=seed, pin_memory=False)
        configured = RoleExampleDataModule(files, pack_prefixes=pack_prefixes, max_tokens=max_tokens,
                                           batch_size=batch_size, pool_batches=pool_batches, **common)  # fmt: skip
        baseline = RoleExampleDataModule(files, batch_size=batch_size, pool_batches=pool_batches, **common)
        configured.setup()
        baseline.setup()
        paths = {
            "configured": batching_stats(configured, accumulate, pool_batches, batch_size, max_tokens),
            "baseline": batching_stats(baseline, baseline_accumulate, pool_batches, batch_size, None),
        }
        result["benchmarks"][bench] = {"roles": roles, "batching": paths}
        md += [
            f"## {bench}",
            "",
            f"Token lengths of whole examples (input + output + EOS), `max_length` {max_length}:",
            "",
        ]
        md.append(markdown_table(
            ["role", "examples", "p50", "p95", "p99", "max", "output tokens", f"fit {max_length}"],
            [[r, str(s["n"]), f"{s['p50']:.0f}", f"{s['p95']:.0f}", f"{s['p99']:.0f}", str(s["max"]),
              f"{100 * s['output_share']:.1f}%", f"{100 * s['fit_share']:.1f}%"] for r, s in roles.items()],
        ))  # fmt: skip
        pack = "prefix-packed" if pack_prefixes else "one example per sequence"
        budget = f"batches of <= {max_tokens} padded tokens" if max_tokens else f"batches of {batch_size}"
        labels = {
            "configured": f"configured: {pack}, {budget}, accumulate {accumulate}",
            "baseline": (
                f"baseline: one example per sequence, batches of {batch_size}, accumulate {baseline_accumulate}"
            ),
        }
        md += ["", f"Training split ({100 * (1 - val_fraction):.0f}% of each role), one epoch:", ""]
        md.append(markdown_table(
            ["data path", "examples", "sequences", "tokens", "padding", "batches", "optimizer steps",
             "tokens / step", "examples / step"],
            [[labels[k], str(p["examples"]), str(p["sequences"]), f"{p['tokens']:,}", f"{100 * p['padding']:.1f}%",
              str(p["batches"]), f"{p['optimizer_steps']:.0f}", f"{p['tokens_per_step']:,.0f}",
              f"{p['examples_per_step']:.1f}"] for k, p in paths.items()],
            align=["l"] + ["r"] * 8,
        ))  # fmt: skip
        md.append("")
    prov = provenance(dtype=None, device="cpu")
    result["provenance"] = prov
    write_json(out_dir / "data_stats.json", result)
    write_text(out_dir / "data_stats.md", "\n".join(md) + provenance_footer(prov))
    print((out_dir / "data_stats.md").read_text())
    return 0
