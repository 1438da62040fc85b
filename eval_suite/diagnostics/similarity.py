"""`python cli.py similarity`: how alike the agents' caches are when every role processes the same context alone.

The evidence behind cache sharing (LRAgent §3.1, Tables 1, 2, 6, Figures 1, 6, 7), measured on your model, adapters
and contexts. For each context every role runs the whole context **on its own** (a plain cache, nothing shared; all
roles in one batch, one row per role), and per decoder layer ``l`` the inputs ``X_i`` of ``v_proj`` / outputs of
``k_proj`` of role ``i`` are captured (forward hooks); from them, with the layer's own :class:`MultiLoraLinear`:

- base cache ``V_base,i = X_i W0 (+ b)`` (what the decomposed cache stores and shares),
- adapter output ``ΔV_i = s · (X_i A_i) B_i``,
- full value cache ``V_i = V_base,i + ΔV_i`` (what a plain cache stores),
- LR cache ``V_lr,i = X_i A_i`` (r-wide; the same kind of quantity for all roles only with shared A),
- K cache ``K_i`` (``k_proj`` output; RoPE rotates both roles' key of a token by the same orthogonal matrix, so the
  per-token cosine below is the same before and after RoPE),
- hidden input ``X_i`` itself (``input_layernorm`` output; with shared A, ``V_lr`` differs across roles only
  through it).

**Cosine similarity** (exact definition). For a quantity ``Z`` (one of the above) the vector of token ``t`` is the
``d``-wide row ``Z[t]`` with all KV heads flattened (``d = H_kv · D`` for K/V, ``r`` for ``V_lr``, ``hidden`` for
``X``). For roles ``i, j``: ``cos_t = <Z_i[t], Z_j[t]> / (‖Z_i[t]‖₂ ‖Z_j[t]‖₂)`` in float64; a token where either
vector is exactly zero is **undefined** and left out (every token of ``ΔV`` when B = 0: the value is then reported
as undefined, not 0 or 1). ``s[n, l, p]`` is the mean of ``cos_t`` over the tokens of sample ``n`` (every sample
counts equally whatever its length) for layer ``l`` and role pair ``p``. **Pairs** are all role pairs ``i < j`` in
the adapters' role order (plan–action, plan–reflect, action–reflect for three roles). The headline value of a
quantity is the mean of ``s`` over samples, layers and pairs; its **spread** is the standard deviation over
(sample, pair) of the layer-averaged ``s``. Per-layer curves average over samples (and pairs); their band is the
standard deviation over (sample, pair) at that layer.

**Cross terms** (Table 6): ``cos(V_base,i , ΔV_j)`` for every ordered role pair, ``i = j`` included, same averaging.

**L1 norms** (Figure 6): ``‖V_base,i[t]‖₁`` and ``‖ΔV_i[t]‖₁`` (sum of absolute values over the ``d`` entries of
the token's vector), averaged over tokens, samples and roles per layer; the **ratio** is mean adapter L1 / mean base
L1 (per layer, and over all layers: the ratio of the two overall means); its spread is the standard deviation over
samples of the per-sample ratio.

Contexts: by default ``input`` texts of the benchmark's role examples (``data/trajectories/<benchmark>/*.jsonl.gz``,
all role files pooled, exact duplicates dropped), ``--samples`` of them drawn with ``random.Random(sample_seed)``,
each cut to its first ``--max_tokens`` tokens (a prefix of a real trajectory, which is what agents share); or
``--data FILE``, JSON lines with ``"text"`` or ``"input"`` (or ``"ids"``: token ids, for models without a tokenizer).

Outputs in ``--out``: ``similarity.json`` (every per-sample value, the summary, provenance; rewritten after every
sample), ``report.md`` (tables in the layout of Tables 1, 2 and 6, Figure 6's norms, per-layer values),
``fig1_base_vs_full.png``, ``fig6_l1_norms.png``, ``fig7_k_similarity.png`` and ``report.html`` (tables and plots on
one page, no external resources). ``--merge DIR ...`` combines finished runs into ``summary.md`` / ``summary.json``.

Usage::

    python cli.py similarity --adapters data/adapters/hotpotqa_sharedA_lam0 --benchmark hotpotqa --out out/sim
    python cli.py similarity --adapter_init zero --benchmark hotpotqa --out out/sim_zero     # untrained control
    python cli.py similarity --merge out/sim out/sim_zero --out out/sim_all
"""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eval_suite.report import write_json
from lragent.lora_model import MultiLoraModel
from lragent.multi_lora import MultiLoraConfig, MultiLoraLinear
from lragent.paths import DATA_DIR

BENCHMARKS: tuple[str, ...] = ("hotpotqa", "scienceqa")
ADAPTER_INITS: tuple[str, ...] = ("zero", "random")
PAIR_METRICS: tuple[str, ...] = ("full", "base", "adapter", "lr", "k", "hidden")
METRIC_TITLES: dict[str, str] = {
    "full": "full V (X W0 + s X A B)",
    "base": "base V (X W0)",
    "adapter": "adapter output (s X A B)",
    "lr": "LR cache (X A)",
    "k": "K cache",
    "hidden": "layer input X",
}
RESULT_FILE = "similarity.json"


# ------------------------------------------------------------------------------------------------------- contexts
@dataclass(frozen=True)
class Context:
    """One context every role processes.

    Attributes:
        source: ``file:line`` it came from.
        ids: its token ids (already cut to ``max_tokens``).
    """

    source: str
    ids: tuple[int, ...]


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i} is not a JSON line ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{i} must be a JSON object with a text, input or ids field")
            records.append((f"{path.name}:{i}", rec))
    return records


def _record_content(source: str, rec: dict) -> str | list[int]:
    for key in ("text", "input"):
        if isinstance(rec.get(key), str):
            return rec[key]
    ids = rec.get("ids")
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    raise ValueError(f"{source} has no text, input (a string) or ids (a non-empty list of integers) field")


def load_contexts(
    tokenizer: Any | None,
    samples: int,
    max_tokens: int,
    sample_seed: int = 0,
    benchmark: str = "hotpotqa",
    data: str | Path | None = None,
    data_dir: Path = DATA_DIR,
) -> list[Context]:
    """The contexts of a run: a deterministic draw from the benchmark's role examples or from ``data``.

    Args:
        tokenizer: turns texts into ids (``None``: every record must carry ``ids``).
        samples: how many contexts (all of them when the source has fewer).
        max_tokens: each context is cut to its first ``max_tokens`` ids.
        sample_seed: seed of ``random.Random`` for the draw.
        benchmark: ``hotpotqa`` or ``scienceqa`` (used when ``data`` is ``None``).
        data: a JSONL file (``.gz`` allowed) with ``text``, ``input`` or ``ids`` per line.
        data_dir: the bundled data directory.

    Returns:
        the drawn contexts in source order.
    """
    if data is not None:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"--data {str(data)!r}: no such file")
        records = _read_jsonl(path)
    else:
        if benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {benchmark!r}: allowed {', '.join(BENCHMARKS)}")
        files = sorted((data_dir / "trajectories" / benchmark).glob("*.jsonl.gz"))
        if not files:
            raise FileNotFoundError(f"no role example files in {data_dir / 'trajectories' / benchmark}")
        records = [(src, {"input": rec.get("input")}) for f in files for src, rec in _read_jsonl(f)]
    pool: list[tuple[str, str | list[int]]] = []
    seen: set[tuple] = set()
    for source, rec in records:
        content = _record_content(source, rec)
        # text and ids apart: the text "[1, 2]" is no duplicate of the ids [1, 2]
        key = ("text", content) if isinstance(content, str) else ("ids", tuple(content))
        if (isinstance(content, str) and not content.strip()) or key in seen:
            continue
        seen.add(key)
        pool.append((source, content))
    if not pool:
        raise ValueError(f"no usable context in {data if data is not None else benchmark}")
    picked = sorted(random.Random(sample_seed).sample(range(len(pool)), min(samples, len(pool))))
    contexts = []
    for i in picked:
        source, content = pool[i]
        if isinstance(content, str):
            if tokenizer is None:
                raise ValueError(f"{source} is text but the model has no tokenizer: give --data with ids fields")
            ids = tokenizer(content, add_special_tokens=True)["input_ids"]
        else:
            ids = content
        contexts.append(Context(source, tuple(int(t) for t in ids[:max_tokens])))
    return contexts


# ---------------------------------------------------------------------------------------------------- measurement
def role_pairs(n_roles: int) -> list[tuple[int, int]]:
    """All pairs ``(i, j)`` with ``i < j``, in order."""
    return [(i, j) for i in range(n_roles) for j in range(i + 1, n_roles)]


def token_cosine(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per-token cosine similarity in float64; NaN where either vector is exactly zero.

    Args:
        u: ``(T, d)``.
        v: ``(T, d)``.

    Returns:
        ``(T,)`` float64.
    """
    u, v = u.double(), v.double()
    denom = u.norm(dim=-1) * v.norm(dim=-1)
    cos = (u * v).sum(-1) / denom
    return torch.where(denom > 0, cos, torch.full_like(cos, float("nan")))


def _nanmean(x: torch.Tensor) -> float:
    return float(x.nanmean()) if bool((~x.isnan()).any()) else float("nan")


@contextlib.contextmanager
def capture_projections(model: MultiLoraModel) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """Forward hooks that keep, per layer, the input ``x`` of ``v_proj`` and the output ``k`` of ``k_proj``.

    Yields:
        ``{layer: {"x": (B, T, hidden), "k": (B, T, H_kv·D)}}``, filled by the forwards run inside the block.
    """
    store: dict[int, dict[str, torch.Tensor]] = {}
    handles = []

    def keep_input(i: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            if "x" in store.setdefault(i, {}):
                raise RuntimeError(f"v_proj of layer {i} ran twice in one forward; the capture expects one call")
            store[i]["x"] = x.detach()

        return hook

    def keep_output(i: int):
        def hook(module, args, kwargs, out):
            store.setdefault(i, {})["k"] = out.detach()

        return hook

    for i, layer in enumerate(model.model.model.layers):
        attn = layer.self_attn
        handles.append(attn.v_proj.register_forward_pre_hook(keep_input(i), with_kwargs=True))
        handles.append(attn.k_proj.register_forward_hook(keep_output(i), with_kwargs=True))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def _forward_roles(model: MultiLoraModel, ids: torch.Tensor, role_ids: torch.Tensor) -> None:
    """One plain forward of the rows of ``ids`` ``(R, T)``, row ``i`` as role ``role_ids[i]``, with a fresh plain
    cache (the only place that drives the runtime; logits of the last position only)."""
    model.decoder.forward(ids, role_ids, last_only=True)


@torch.no_grad()
def measure_context(model: MultiLoraModel, ids: Sequence[int]) -> dict:
    """Every role processes ``ids`` on its own; per layer, the pairwise similarities and the L1 norms.

    Args:
        model: the multi-LoRA model (in eval mode), with a LoRA on ``v_proj``.
        ids: the context's token ids (length ``T``).

    Returns:
        ``{"tokens": T, "cos": {metric: [L][P]}, "cross": [L][R][R], "l1_base": [L][R], "l1_adapter": [L][R],
        "undefined_tokens": {metric: n}}`` with the metrics of :data:`PAIR_METRICS`, ``P`` the pairs of
        :func:`role_pairs`, ``cross[l][i][j] = cos(V_base,i, ΔV_j)``; values are token means (NaN: undefined).
    """
    n_roles = len(model.router)
    pairs = role_pairs(n_roles)
    device = next(model.parameters()).device
    role_ids = torch.arange(n_roles, device=device)
    batch = torch.tensor([list(ids)], dtype=torch.long, device=device).expand(n_roles, -1)
    with capture_projections(model) as store:
        _forward_roles(model, batch, role_ids)
    out: dict[str, Any] = {"tokens": len(ids), "cos": {m: [] for m in PAIR_METRICS}, "cross": []}
    out["l1_base"], out["l1_adapter"] = [], []
    undefined = dict.fromkeys([*PAIR_METRICS, "cross"], 0)
    for layer_index, layer in enumerate(model.model.model.layers):
        v_mod = layer.self_attn.v_proj
        assert isinstance(v_mod, MultiLoraLinear), "checked by the caller"
        x, k = store[layer_index]["x"], store[layer_index]["k"]
        base, lr = v_mod.forward_parts(x, role_ids)  # (R, T, d_out), (R, T, r)
        adapter = v_mod.lora_output(lr, role_ids)  # (R, T, d_out)
        parts = {"full": base + adapter, "base": base, "adapter": adapter, "lr": lr, "k": k, "hidden": x}
        for metric, z in parts.items():
            row = []
            for i, j in pairs:
                cos = token_cosine(z[i], z[j])
                undefined[metric] += int(cos.isnan().sum())
                row.append(_nanmean(cos))
            out["cos"][metric].append(row)
        cross = []
        for i in range(n_roles):
            cross_row = []
            for j in range(n_roles):
                cos = token_cosine(base[i], adapter[j])
                undefined["cross"] += int(cos.isnan().sum())
                cross_row.append(_nanmean(cos))
            cross.append(cross_row)
        out["cross"].append(cross)
        out["l1_base"].append(base.double().abs().sum(-1).mean(-1).tolist())
        out["l1_adapter"].append(adapter.double().abs().sum(-1).mean(-1).tolist())
        del store[layer_index]
    out["undefined_tokens"] = undefined
    return out


# -------------------------------------------------------------------------------------------------------- summary
def _f(x: float) -> float | None:
    """JSON-safe float (NaN -> None)."""
    x = float(x)
    return None if np.isnan(x) else x


def _flist(a: np.ndarray) -> list:
    return [_flist(v) for v in a] if a.ndim > 1 else [_f(v) for v in a]


def summarize(samples: Sequence[dict], roles: Sequence[str]) -> dict:
    """Averages of :func:`measure_context` results over samples, layers and pairs (see the module docstring).

    Args:
        samples: per-sample results.
        roles: role names in adapter order.

    Returns:
        ``{"n_samples", "tokens_total", "cos": {metric: {"mean", "std", "per_pair", "per_layer", "per_layer_std",
        "per_layer_pair"}}, "cross": {"mean", "std", "per_layer"}, "l1": {...}}``; undefined values are ``None``.
    """
    if not samples:
        raise ValueError("no samples to summarize")
    names = [f"{roles[i]}-{roles[j]}" for i, j in role_pairs(len(roles))]
    summary: dict[str, Any] = {
        "n_samples": len(samples),
        "tokens_total": int(sum(s["tokens"] for s in samples)),
        "pairs": names,
        "cos": {},
    }
    for metric in PAIR_METRICS:
        s = np.array([smp["cos"][metric] for smp in samples], dtype=float)  # (N, L, P)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            layer_avg = np.nanmean(s, axis=1)  # (N, P)
            per_layer_pair = np.nanmean(s, axis=0)  # (L, P)
            per_layer = np.nanmean(s, axis=(0, 2))
            per_layer_std = np.nanstd(s, axis=(0, 2))
            mean = np.nanmean(s)
            std = np.nanstd(layer_avg)
            pair_mean, pair_std = np.nanmean(layer_avg, axis=0), np.nanstd(layer_avg, axis=0)
        summary["cos"][metric] = {
            "mean": _f(mean),
            "std": _f(std),
            "per_pair": {n: {"mean": _f(m), "std": _f(d)} for n, m, d in zip(names, pair_mean, pair_std, strict=True)},
            "per_layer": _flist(per_layer),
            "per_layer_std": _flist(per_layer_std),
            "per_layer_pair": _flist(per_layer_pair),
        }
    cross = np.array([smp["cross"] for smp in samples], dtype=float)  # (N, L, R, R)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cross_layer_avg = np.nanmean(cross, axis=1)  # (N, R, R)
        summary["cross"] = {
            "mean": _flist(np.nanmean(cross, axis=(0, 1))),
            "std": _flist(np.nanstd(cross_layer_avg, axis=0)),
            "per_layer": _flist(np.nanmean(cross, axis=0)),
        }
    l1b = np.array([smp["l1_base"] for smp in samples], dtype=float)  # (N, L, R)
    l1a = np.array([smp["l1_adapter"] for smp in samples], dtype=float)
    sample_ratio = l1a.sum(axis=(1, 2)) / l1b.sum(axis=(1, 2))
    summary["l1"] = {
        "base": {
            "mean": _f(l1b.mean()),
            "per_layer": _flist(l1b.mean(axis=(0, 2))),
            "per_role": {r: _f(l1b[:, :, k].mean()) for k, r in enumerate(roles)},
            "per_layer_role": _flist(l1b.mean(axis=0)),
        },
        "adapter": {
            "mean": _f(l1a.mean()),
            "per_layer": _flist(l1a.mean(axis=(0, 2))),
            "per_role": {r: _f(l1a[:, :, k].mean()) for k, r in enumerate(roles)},
            "per_layer_role": _flist(l1a.mean(axis=0)),
        },
        "ratio": {
            "mean": _f(l1a.mean() / l1b.mean()),
            "std": _f(sample_ratio.std()),
            "per_layer": _flist(l1a.mean(axis=(0, 2)) / l1b.mean(axis=(0, 2))),
            "per_role": {r: _f(l1a[:, :, k].mean() / l1b[:, :, k].mean()) for k, r in enumerate(roles)},
        },
    }
    return summary


def run_similarity(
    model: MultiLoraModel,
    contexts: Sequence[Context],
    progress: bool = False,
    on_sample: Any = None,
) -> list[dict]:
    """:func:`measure_context` for every context.

    Args:
        model: the multi-LoRA model (eval mode) with a LoRA on ``v_proj``.
        contexts: what every role processes.
        progress: show a tqdm bar (one step per context).
        on_sample: called with the list of finished samples after each one (incremental writes).

    Returns:
        one result per context, with its ``source``.
    """
    from tqdm.auto import tqdm

    check_model(model)
    results: list[dict] = []
    bar = tqdm(contexts, desc="similarity", unit="ctx", disable=not progress)
    for ctx in bar:
        bar.set_postfix(tokens=len(ctx.ids))
        results.append({"source": ctx.source, **measure_context(model, ctx.ids)})
        if on_sample is not None:
            on_sample(results)
    return results


def check_model(model: MultiLoraModel) -> None:
    """Raises ``ValueError`` unless every layer's ``v_proj`` carries the multi-LoRA adapters."""
    targets = model.lora_config.targets
    if "v_proj" not in targets:
        raise ValueError(f"the adapters target {list(targets)}: the similarity report needs a LoRA on v_proj")
    for i, layer in enumerate(model.model.model.layers):
        if not isinstance(layer.self_attn.v_proj, MultiLoraLinear):
            raise ValueError(f"layer {i}'s v_proj has no multi-LoRA adapter")


# ------------------------------------------------------------------------------------------------------------ CLI
def _validate(
    adapters: str | None,
    adapter_init: str | None,
    benchmark: str,
    data: str | None,
    samples: int,
    max_tokens: int,
    model: str,
    dtype: str,
    device: str,
    out: str,
) -> None:
    from lragent.models import NAMED_ARCHITECTURES, parse_dtype

    if adapters is None and adapter_init is None:
        raise ValueError(
            "give --adapters DIR (trained role adapters: a native checkpoint or PEFT role directories), "
            "or --adapter_init zero (untrained control) / --adapter_init random --seed S"
        )
    if adapters is not None and adapter_init is not None:
        raise ValueError(f"give either --adapters ({adapters!r}) or --adapter_init ({adapter_init!r}), not both")
    if adapter_init is not None and adapter_init not in ADAPTER_INITS:
        raise ValueError(f"--adapter_init {adapter_init!r} not supported: allowed {', '.join(ADAPTER_INITS)}")
    if adapters is not None and not Path(adapters).is_dir():
        raise FileNotFoundError(f"--adapters {adapters!r}: no such directory")
    if benchmark not in BENCHMARKS:
        raise ValueError(f"--benchmark {benchmark!r} unknown: allowed {', '.join(BENCHMARKS)}")
    if data is not None and not Path(data).is_file():
        raise FileNotFoundError(f"--data {data!r}: no such file")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if max_tokens < 1:
        raise ValueError(f"--max_tokens must be >= 1, got {max_tokens}")
    if parse_dtype(dtype) != torch.float32 and device == "cpu":
        raise ValueError(f"--dtype {dtype!r} on CPU is slow and imprecise: allowed float32 (bfloat16/float16 on GPU)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} but CUDA is not available: allowed cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device {device!r} unknown: allowed cpu, cuda, cuda:N")
    if model.lower() in NAMED_ARCHITECTURES and data is None:
        raise ValueError(f"--model {model!r} has random weights and no tokenizer: give --data FILE with ids fields")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out!r} is a file, not a directory")


def _build_model(
    model_name: str,
    adapters: str | None,
    adapter_init: str | None,
    seed: int,
    rank: int,
    alpha: float,
    independent_a: bool,
    dtype: str,
    device: str,
) -> tuple[MultiLoraModel, Any]:
    from lragent.adapters_io import adapter_config_of
    from lragent.loading import load_lora_model

    if rank < 1:
        raise ValueError(f"--rank must be >= 1, got {rank}")
    targets = adapter_config_of(adapters).targets if adapters is not None else MultiLoraConfig().targets
    if "v_proj" not in targets:
        raise ValueError(f"the adapters target {list(targets)}: the similarity report needs a LoRA on v_proj")
    return load_lora_model(
        model=model_name, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha,
        shared_a=not independent_a, seed=seed, dtype=dtype, device=device, needs_text=False,
    )  # fmt: skip


def similarity(
    adapters: str | None = None,
    benchmark: str = "hotpotqa",
    data: str | None = None,
    samples: int = 16,
    max_tokens: int = 2048,
    out: str = "similarity_out",
    adapter_init: str | None = None,
    seed: int = 0,
    rank: int = 8,
    alpha: float = 16.0,
    independent_a: bool = False,
    sample_seed: int = 0,
    model: str = "default",
    dtype: str = "float32",
    device: str | None = None,
    label: str | None = None,
    merge: list[str] | None = None,
    quiet: bool = False,
) -> int:
    """Cache-similarity diagnostics across role adapters (LRAgent Tables 1, 2, 6; Figures 1, 6, 7).

    Every role processes the same contexts on its own; per layer and role pair the report gives the cosine
    similarity of the base cache X W0, the full value cache, the adapter output s X A B, the LR cache X A and the K
    cache, the L1 norms of base cache and adapter output, and the cross terms cos(base_i, adapter_j). Definitions
    are in eval_suite/diagnostics/similarity.py's docstring and in the report.

    Args:
        adapters: adapter directory (native checkpoint or PEFT role directories); required unless --adapter_init.
        benchmark: hotpotqa or scienceqa: its role examples' input texts are the contexts (unless --data).
        data: JSONL file of contexts, one per line with a "text" or "input" string (or "ids", a list of token ids).
        samples: number of contexts drawn (all of them when the source has fewer).
        max_tokens: each context is cut to its first max_tokens tokens.
        out: output directory (similarity.json, report.md, report.html, PNG figures; summary.* with --merge).
        adapter_init: zero (untrained: B = 0, the control) or random (B ~ N(0, 0.02²)), instead of --adapters.
        seed: seed of --adapter_init.
        rank: LoRA rank for --adapter_init.
        alpha: LoRA alpha for --adapter_init.
        independent_a: one A per role for --adapter_init (conventional multi-LoRA).
        sample_seed: seed of the draw of contexts.
        model: default (embedded SmolLM2-135M-Instruct), a hub name or local directory, or a named random
            architecture (then --data must carry ids).
        dtype: float32, bfloat16 or float16 (bfloat16/float16 only on GPU; statistics are computed in float64).
        device: cpu or cuda (default: cuda when available).
        label: name of the run in the reports (default: benchmark and adapter directory or init).
        merge: instead of measuring, combine the similarity.json of these finished run directories into
            summary.md / summary.json in --out; a list: --merge "[DIR1, DIR2]" (or --merge+ DIR1 --merge+ DIR2).
        quiet: no progress bar.
    """
    from eval_suite.diagnostics import similarity_report
    from lragent.command import on_interrupt
    from lragent.provenance import provenance

    if merge:
        runs = similarity_report.load_runs(merge)
        Path(out).mkdir(parents=True, exist_ok=True)
        written = similarity_report.write_summary(runs, out)
        print(f"-> {', '.join(str(p) for p in written)}")
        return 0
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _validate(adapters, adapter_init, benchmark, data, samples, max_tokens, model, dtype, device, out)
    t0 = time.perf_counter()
    mlm, tokenizer = _build_model(model, adapters, adapter_init, seed, rank, alpha, independent_a, dtype, device)
    check_model(mlm)
    contexts = load_contexts(tokenizer, samples, max_tokens, sample_seed, benchmark, data)
    vocab = mlm.model.config.vocab_size
    bad = [c.source for c in contexts if any(not 0 <= t < vocab for t in c.ids)]
    if bad:
        raise ValueError(f"{bad[0]} has token ids outside the model's vocabulary 0..{vocab - 1}")
    cfg = mlm.lora_config
    config = {
        "label": label or _default_label(benchmark, data, adapters, adapter_init, independent_a),
        "benchmark": None if data is not None else benchmark,
        "data": str(data) if data is not None else None,
        "adapters": str(Path(adapters).resolve()) if adapters else None,
        "adapter_init": adapter_init,
        "seed": seed,
        "sample_seed": sample_seed,
        "samples_requested": samples,
        "max_tokens": max_tokens,
        "model": model,
        "dtype": dtype,
        "device": device,
        "roles": list(cfg.roles),
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "targets": list(cfg.targets),
        "shared_a": cfg.shared_a,
        "n_layers": mlm.n_layers,
    }
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    prov = provenance(dtype=dtype, device=device)
    on_interrupt(f"finished samples are in {out_dir / RESULT_FILE} (complete: false); rerun to redo")

    def save(results: list[dict], complete: bool) -> dict:
        doc = {
            "config": config,
            "pairs": [f"{cfg.roles[i]}-{cfg.roles[j]}" for i, j in role_pairs(len(cfg.roles))],
            "complete": complete,
            "wall_s": time.perf_counter() - t0,
            "summary": summarize(results, cfg.roles),
            "samples": results,
            "provenance": prov,
        }
        write_json(out_dir / RESULT_FILE, _json_safe(doc))
        return doc

    results = run_similarity(mlm, contexts, progress=not quiet, on_sample=lambda r: save(r, False))
    doc = save(results, True)
    written = similarity_report.write_report(doc, out_dir)
    doc["wall_s"] = time.perf_counter() - t0
    write_json(out_dir / RESULT_FILE, _json_safe(doc))
    s = doc["summary"]["cos"]
    line = "  ".join(f"{m} {_fmt(s[m]['mean'])}" for m in PAIR_METRICS)
    ratio = _fmt(doc["summary"]["l1"]["ratio"]["mean"])
    tokens = doc["summary"]["tokens_total"]
    print(f"{config['label']}: {len(results)} contexts, {tokens} tokens, {line}, L1 ratio {ratio}; "
          f"{doc['wall_s']:.1f} s", file=sys.stderr)  # fmt: skip
    print(f"-> {out_dir / RESULT_FILE}, {', '.join(str(p) for p in written)}")
    return 0


def _default_label(
    benchmark: str, data: str | None, adapters: str | None, adapter_init: str | None, independent_a: bool
) -> str:
    source = benchmark if data is None else Path(data).name
    if adapters:
        return f"{source} · {Path(adapters).name}"
    return f"{source} · init {adapter_init} ({'independent' if independent_a else 'shared'} A)"


def _fmt(x: float | None) -> str:
    return "undefined" if x is None else f"{x:.4f}"


def _json_safe(obj: Any) -> Any:
    """NaN/inf floats -> None, recursively (strict JSON)."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj
