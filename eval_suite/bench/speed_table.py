"""The README's speed table from the benchmark records of one or more GPUs, with the commit each figure came from.

``python -m eval_suite.bench.speed_table DIR [DIR ...] [--out FILE]``: each ``DIR`` holds one GPU's records (searched
recursively): ``bench_decode.json`` (``bench decode``: ms/token against the bandwidth floor, and transformers) and
``bench_trace.json`` (``bench trace``: throughput, TTFT and prefill MFU per scheme and context). One column per GPU,
in the order given; a row per figure the records hold:

- decode at each context and batch, per lragent scheme: ms/token and × the floor (a range over repeats, the
  default plan only: the records' other ``--plans`` are experiments, not the product);
- transformers' eager loop at each batch;
- the trace at each context: ``base_lr_shared``'s throughput against ``non_shared``'s, and ``full_shared``'s;
- the trace's prefill MFU per context, ``base_lr_shared`` (``full_shared``) and their ratio.

Below the table it names the commit of every record and says whether they are one commit (the
README's table must be); it never fills in a figure the records lack ("–").
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SHARED_SCHEMES = ("base_lr_shared", "full_shared")


def _records(directory: Path, name: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every ``name`` below ``directory`` that parses as a JSON object, sorted by path."""
    out = []
    for path in sorted(directory.rglob(name)):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict):
            out.append((path, data))
    return out


def _span(values: Iterable[float], fmt: str) -> str:
    """``a`` or ``a-b`` (smallest-largest) in ``fmt``; ``–`` for none."""
    vals = sorted(values)
    if not vals:
        return "–"
    lo, hi = fmt.format(vals[0]), fmt.format(vals[-1])
    return lo if lo == hi else f"{lo}-{hi}"


def _short_model(model: str) -> str:
    return {"llama-3.1-8b": "8B", "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B"}.get(model, model)


def collect(directory: Path) -> dict[str, Any]:
    """One GPU's figures: ``{"device", "commits", "cells": {row label: cell text}}``.

    Raises:
        FileNotFoundError: ``directory`` holds neither record (named, with what was looked for).
    """
    decodes, traces = _records(directory, "bench_decode.json"), _records(directory, "bench_trace.json")
    if not decodes and not traces:
        raise FileNotFoundError(f"{directory}: no bench_decode.json or bench_trace.json below it")
    cells: dict[str, str] = {}
    devices, commits = [], []
    for path, rec in decodes + traces:
        prov = rec.get("provenance") or {}
        devices.append((prov.get("device") or {}).get("name") or "?")
        sha = (prov.get("git_commit") or "unknown")[:7] + (" (dirty)" if prov.get("git_dirty") else "")
        commits.append((sha, path))
    # every decode record of a model and context pooled: the repeats of the run (decode1, decode2) are one range
    pooled: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for _, rec in decodes:
        key = (_short_model(str(rec.get("model", "?"))), rec.get("context", "?"))
        pooled.setdefault(key, []).extend(r for r in rec.get("rows", []) if isinstance(r, dict))
    for (model, ctx), rows in pooled.items():
        for batch in sorted({r.get("batch") for r in rows if isinstance(r.get("batch"), int)}):
            for scheme in SHARED_SCHEMES:
                mine = [r for r in rows if r.get("impl") == "lragent graph" and r.get("scheme") == scheme
                        and r.get("batch") == batch and not r.get("plan")]  # fmt: skip
                if mine:
                    ms = _span((r["ms_per_token"] for r in mine), "{:.2f}")
                    vs = _span((r["vs_floor"] for r in mine if "vs_floor" in r), "{:.2f}")
                    cells[f"{model}, decode at {ctx} context, batch {batch}, `{scheme}` (ms/token; × the floor)"] = (
                        f"{ms} ({vs}×)"
                    )
            eager = [r for r in rows if r.get("impl") == "transformers eager" and r.get("batch") == batch]
            if eager:
                cells[f"{model}, transformers' eager loop, batch {batch} (ms/token)"] = _span(
                    (r["ms_per_token"] for r in eager), "{:.2f}"
                )
    for _, rec in traces:
        model = _short_model(str(rec.get("model", "?")))
        runs = [r for r in rec.get("runs", []) if isinstance(r, dict) and r.get("kernel", True)]
        for ctx in sorted({r.get("l_ctx") for r in runs if isinstance(r.get("l_ctx"), int)}):
            by = {r.get("scheme"): r for r in runs if r.get("l_ctx") == ctx}
            lr, full, base = by.get("base_lr_shared"), by.get("full_shared"), by.get("non_shared")
            if lr and (base or full):
                ratio = f"{lr['throughput_tok_s'] / base['throughput_tok_s']:.2f}×" if base else "no `non_shared` run"
                tail = f"; `full_shared` {full['throughput_tok_s'] / 1e3:.1f}k" if full else ""
                cells[f"{model}, the trace at L_ctx {ctx // 1024}k: `base_lr_shared` throughput vs `non_shared`"] = (
                    f"{ratio} ({lr['throughput_tok_s'] / 1e3:.1f}k tokens/s{tail})"
                )
            if lr and lr.get("prefill_mfu") is not None:
                cell = f"{100 * lr['prefill_mfu']:.1f}%"
                if full and full.get("prefill_mfu"):
                    cell += f" ({100 * full['prefill_mfu']:.1f}%; ratio {lr['prefill_mfu'] / full['prefill_mfu']:.3f})"
                label = f"{model}, the trace's prefill MFU at L_ctx {ctx // 1024}k, `base_lr_shared` (`full_shared`)"
                cells[label] = cell
    return {"device": ", ".join(sorted(set(devices))), "commits": commits, "cells": cells}


def render(columns: list[dict[str, Any]]) -> str:
    """The Markdown table (one column per GPU) and the commits it came from."""
    labels: list[str] = []
    for col in columns:
        labels += [k for k in col["cells"] if k not in labels]
    lines = ["| | " + " | ".join(c["device"] for c in columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {label} | " + " | ".join(c["cells"].get(label, "–") for c in columns) + " |" for label in labels]
    shas = sorted({sha for c in columns for sha, _ in c["commits"]})
    lines.append("")
    if len(shas) == 1:
        lines.append(f"Every figure from commit {shas[0]}.")
    else:
        lines.append(f"**Not one commit**: {', '.join(shas)}.")
    for col in columns:
        lines += [f"- {col['device']}: `{path}` at {sha}" for sha, path in col["commits"]]
    return "\n".join(lines) + "\n"


def speed_table(dirs: list[str], out: str | None = None) -> int:
    """The README's speed table from benchmark records, one column per GPU.

    Args:
        dirs: one folder of records per GPU (searched recursively).
        out: also write the table here.

    Returns:
        the exit status.
    """
    text = render([collect(Path(d)) for d in dirs])
    print(text, end="")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eval_suite.bench.speed_table DIR... [--out FILE]`` (:func:`speed_table`)."""
    from lragent.command import run_command

    return run_command(speed_table, argv, "python -m eval_suite.bench.speed_table", positional=["dirs"])


if __name__ == "__main__":
    raise SystemExit(main())
