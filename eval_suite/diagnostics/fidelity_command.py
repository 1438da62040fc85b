"""`lragent fidelity`: teacher-forced next-token fidelity of each sharing scheme against ``non_shared``
(the measure: :mod:`eval_suite.diagnostics.fidelity`)."""

from __future__ import annotations

from pathlib import Path

from eval_suite.diagnostics.fidelity import (
    POOLS,
    check_example_args,
    check_producer,
    load_role_examples,
    render_markdown,
    run_fidelity,
)
from eval_suite.report import check_writable, write_json, write_text
from lragent.loading import check_model_args, load_lora_model, read_droidspeak_config
from lragent.provenance import provenance
from lragent.schemes import Scheme, parse_schemes


def fidelity(
    benchmark: str = "hotpotqa",
    model: str = "default",
    adapters: str | None = None,
    adapter_init: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    holdout: int = 100,
    limit: int = 20,
    pool: str = "heldout",
    max_context_tokens: int | None = None,
    producer: str = "next",
    shared_split: str = "last",
    scheme: str = "all",
    droidspeak_config: str | None = None,
    dtype: str = "float32",
    device: str | None = None,
    use_kernel: bool = True,
    out: str = "fidelity_out",
    quiet: bool = False,
) -> int:
    """Teacher-forced next-token fidelity (KL, top-1 agreement) of each sharing scheme against non_shared.

    A producer role encodes each held-out role example's context into the scheme's cache; the example's own role
    then processes the output teacher-forced. Writes OUT/fidelity.json and OUT/fidelity.md.

    Args:
        benchmark: hotpotqa or scienceqa (its role example files in data/trajectories).
        model: base model: default (embedded SmolLM2-135M-Instruct), a hub name or a local directory.
        adapters: adapter directory (native checkpoint or PEFT role directories).
        adapter_init: zero or random adapters instead of --adapters (one of the two is required).
        rank: LoRA rank for --adapter_init.
        alpha: LoRA alpha for --adapter_init.
        seed: seed of the adapter init and of the example draw.
        holdout: held-out tail of each role file.
        limit: examples per role drawn from the pool.
        pool: which examples: heldout (the last --holdout of each role file), dev (the --holdout before them) or val
            (the embedded configs' validation split, never trained on; --holdout is ignored).
        max_context_tokens: cut each context from the left to this many tokens (default: no cut).
        producer: next (the next role, wrapping) or a fixed role name.
        shared_split: last or piece: where the shared cache ends.
        scheme: a scheme, a comma list, or all (non_shared, the reference, is always measured).
        droidspeak_config: JSON/YAML with droidspeak_layers (as droidspeak-select writes).
        dtype: compute dtype (float32, bfloat16, float16).
        device: cpu, cuda, cuda:N or mps (default cuda when available).
        use_kernel: the fused Flash-LoRA-Attention kernel on CUDA (false: the PyTorch attention path).
        out: output directory (fidelity.json, fidelity.md).
        quiet: no progress bar.

    Returns:
        0 on success.
    """
    check_example_args(benchmark, holdout, limit, max_context_tokens, shared_split)
    check_model_args(
        model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha, dtype=dtype,
        device=device, exactly_one=True, needs_text=True,
    )  # fmt: skip
    if pool not in POOLS:
        raise ValueError(f"--pool {pool!r} unknown: allowed {', '.join(POOLS)}")
    schemes = parse_schemes(scheme)
    if "non_shared" not in schemes:
        schemes = [Scheme.NON_SHARED, *schemes]
    layers = read_droidspeak_config(droidspeak_config) if droidspeak_config else None
    out_dir = check_writable(out, is_dir=True)
    lm, tokenizer = load_lora_model(
        model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha, seed=seed, dtype=dtype,
        device=device,
    )  # fmt: skip
    check_producer(lm, producer)
    examples = load_role_examples(
        benchmark, list(lm.router.roles), tokenizer, holdout=holdout, limit=limit, seed=seed,
        max_context_tokens=max_context_tokens, pool=pool,
    )  # fmt: skip
    result = run_fidelity(
        lm, examples, schemes, producer=producer, shared_split=shared_split, droidspeak_layers=layers,
        use_kernel=use_kernel, progress=not quiet,
    )  # fmt: skip
    result["config"] = {
        "benchmark": benchmark, "model": model,
        "adapters": str(Path(adapters).resolve()) if adapters else f"init:{adapter_init}",
        "seed": seed, "pool": pool, "holdout": holdout, "limit": limit, "producer": producer,
        "shared_split": shared_split, "max_context_tokens": max_context_tokens, "droidspeak_layers": layers,
        "dtype": dtype,
    }  # fmt: skip
    result["provenance"] = provenance(dtype=dtype, device=str(next(lm.parameters()).device.type))
    write_json(out_dir / "fidelity.json", result)
    write_text(out_dir / "fidelity.md", render_markdown(result))
    for s, v in result["schemes"].items():
        print(f"{s:15s} KL {v['overall']['kl']:.3e}  top-1 {100 * v['overall']['top1']:.2f}%")
    print(f"-> {out_dir / 'fidelity.json'}, {out_dir / 'fidelity.md'}")
    return 0
