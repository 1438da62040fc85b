"""Summary and Markdown report of an evaluation, computed from its episode records alone.

Records are deduplicated and sorted by key first (:func:`eval_suite.evaluate.episode_log.dedupe`), so an uninterrupted
run, a resumed run and merged shards give the same numbers. Per row (a scheme, ``untrained``, or either under
constraints, e.g. ``base_lr_shared+constrained``):

- accuracy per level and average over levels: mean ± sample std over runs and the Student-t 95% interval of the
  mean over runs, and the average's difference to ``non_shared`` of the same protocol (the paper's Table 3;
  HotpotQA: exact match and F1, ScienceQA: choice accuracy);
- out-of-function rate per level, same layout (Table 16);
- per question: total sequence length (tokens) and steps (cycles) (Table 15), and per role prefill/decode tokens
  and seconds.

A row never mixes protocols: the records of one row must agree on adapters, temperature, top-p and constraints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eval_suite.evaluate.benchmarks import get_benchmark
from eval_suite.evaluate.episode_log import EPISODES_FILE, ROLE_FIELDS, dedupe, read_episodes, row_order
from eval_suite.report import fmt_over_runs, fmt_signed, markdown_table, write_json, write_text
from eval_suite.scoring.metrics import (
    GroupedMetric,
    HotpotQAExactMatch,
    HotpotQAF1,
    OOFRate,
    RunMeanStd,
    ScienceQAAccuracy,
    aggregate_runs,
    mean_interval,
)
from eval_suite.scoring.paired import paired_difference, validity
from lragent.agents.loop import ROLES
from lragent.provenance import provenance_footer
from lragent.sampling import recorded_sampler

METRIC_TITLES = {"em": "exact match", "f1": "F1", "accuracy": "accuracy"}
_MAKERS = {
    "em": HotpotQAExactMatch,
    "f1": HotpotQAF1,
    "accuracy": ScienceQAAccuracy,
}


def protocol_of(rec: dict) -> dict:
    """The decoding protocol of a record: ``{"temperature", "top_p", "constraints", "sampler"}`` (None where not
    recorded; a record without ``sampler`` was drawn by sampler 1, see :data:`lragent.sampling.SAMPLER_VERSION`),
    plus ``answer_score`` (``sum``/``mean``) where the record has one (the ``answer_text`` constraint)."""
    p = rec.get("protocol") or {}
    out = {
        "temperature": p.get("temperature"),
        "top_p": p.get("top_p"),
        "constraints": list(p.get("constraints") or []),
        "sampler": recorded_sampler(p),
    }
    if p.get("answer_score") is not None:
        out["answer_score"] = p["answer_score"]
    return out


def _over_runs(values: Sequence[float]) -> dict[str, Any]:
    if not values:  # e.g. a level that one merged row did not run: nothing to compute
        return {"mean": float("nan"), "std": float("nan"), "runs": 0, "ci95": None}
    m = RunMeanStd()
    for v in values:
        m.update(v)
    out = m.compute()
    ci = mean_interval(list(values))
    return {
        "mean": float(out["mean"]),
        "std": float(out["std"]),
        "runs": int(out["runs"]),
        "ci95": None if ci is None else [ci[0], ci[1]],
    }


def _reference_row(row: str) -> str:
    """``non_shared`` of the same protocol variant (``x+constrained`` -> ``non_shared+constrained``,
    ``x+answer_text`` -> ``non_shared+answer_text``)."""
    _, plus, variant = row.partition("+")
    return "non_shared" + plus + variant


def summarize(records: Iterable[dict]) -> dict:
    """The summary of episode records (any order, duplicates dropped); see the module docstring.

    Returns:
        ``{"benchmark", "levels", "rows", "metrics", "adapters", "protocol", "episodes", "duplicates", "accuracy",
        "oof", "efficiency"}``; ``accuracy[metric][row][level | "avg"] = {"mean", "std", "runs", "ci95"}``
        (fractions; ``ci95`` is ``[low, high]`` or None with one run), plus ``accuracy[metric][row]
        ["diff_vs_non_shared"]`` (difference of the mean average to ``non_shared`` of the same protocol).
    """
    recs, dups = dedupe(records)
    if not recs:
        raise ValueError("no episode records to summarise")
    names = sorted({r["benchmark"] for r in recs})
    if len(names) != 1:
        raise ValueError(f"records of several benchmarks {names}: summarise them separately")
    bench = get_benchmark(names[0])
    all_levels = bench.levels
    levels = [lv for lv in all_levels if any(r["level"] == lv for r in recs)]
    rows = row_order(r["row"] for r in recs)
    protocols: dict[str, dict] = {}
    for row in rows:
        sources = sorted({r["adapters"] for r in recs if r["row"] == row})
        if len(sources) > 1:
            raise ValueError(f"row {row!r} mixes results of different adapters {sources}: merge them separately")
        kinds = {repr(protocol_of(r)) for r in recs if r["row"] == row}
        if len(kinds) > 1:
            raise ValueError(f"row {row!r} mixes decoding protocols {sorted(kinds)}: merge them separately")
        protocols[row] = protocol_of(next(r for r in recs if r["row"] == row))
    metrics = bench.metrics
    per_run: dict[str, dict[str, dict[int, dict[str, float]]]] = {m: {} for m in (*metrics, "oof")}
    episodes: dict[str, dict[str, int]] = {}
    efficiency: dict[str, dict] = {}
    for row in rows:
        row_recs = [r for r in recs if r["row"] == row]
        run_ids = sorted({int(r["run"]) for r in row_recs})
        episodes[row] = {str(run): sum(int(r["run"]) == run for r in row_recs) for run in run_ids}
        eff_runs = []
        for run in run_ids:
            rr = [r for r in row_recs if int(r["run"]) == run]
            group = [r["level"] for r in rr]
            preds = [r["prediction"] for r in rr]
            for m in metrics:
                gm = GroupedMetric(_MAKERS[m](), all_levels)
                if m == "accuracy":
                    gm.update(group, preds, [int(r["gold"]) for r in rr], [r["choices"] for r in rr])
                else:
                    gm.update(group, preds, [str(r["gold"]) for r in rr])
                per_run[m].setdefault(row, {})[run] = {k: float(v) for k, v in gm.compute().items()}
            oof = GroupedMetric(OOFRate(), all_levels)
            oof.update(group, [None if r["oof"] else (r["prediction"] or "") for r in rr])
            per_run["oof"].setdefault(row, {})[run] = {k: float(v) for k, v in oof.compute().items()}
            n = len(rr)
            eff = {"num_tokens": sum(r["num_tokens"] for r in rr) / n, "steps": sum(r["steps"] for r in rr) / n}
            for role in ROLES:
                for k in ROLE_FIELDS:
                    eff[f"{role}.{k}"] = sum(r["roles"].get(role, {}).get(k, 0) for r in rr) / n
            eff_runs.append(eff)
        efficiency[row] = aggregate_runs(eff_runs)

    def over_runs(values: dict[int, dict[str, float]]) -> dict[str, dict[str, Any]]:
        return {k: _over_runs([v[k] for _, v in sorted(values.items()) if k in v]) for k in [*levels, "avg"]}

    accuracy = {m: {row: over_runs(per_run[m][row]) for row in rows} for m in metrics}
    for m in metrics:
        for row in rows:
            ref = accuracy[m].get(_reference_row(row), {}).get("avg", {}).get("mean")
            accuracy[m][row]["diff_vs_non_shared"] = None if ref is None else accuracy[m][row]["avg"]["mean"] - ref
    oof = {row: over_runs(per_run["oof"][row]) for row in rows}
    # Paired by question and run against non_shared of the same protocol, 95% bootstrap interval over questions.
    paired: dict[str, dict[str, Any]] = {}
    for m, score_field in zip(metrics, bench.score_fields, strict=True):
        paired[m] = {
            row: paired_difference(recs, row, _reference_row(row), score_field)
            for row in rows
            if row != _reference_row(row) and _reference_row(row) in rows
        }
    paired["oof"] = {
        row: paired_difference(recs, row, _reference_row(row), "oof")
        for row in rows
        if row != _reference_row(row) and _reference_row(row) in rows
    }
    valid = {row: validity(r for r in recs if r["row"] == row) for row in rows} if bench.name == "scienceqa" else {}
    # the commits the records name (a record whose provenance names none adds nothing, not the text "None")
    commits = sorted({str(c) for r in recs if (c := (r.get("provenance") or {}).get("git_commit")) is not None})
    return {
        "benchmark": bench.name,
        "levels": levels,
        "rows": rows,
        "metrics": list(metrics),
        "adapters": {row: next(r["adapters"] for r in recs if r["row"] == row) for row in rows},
        "protocol": protocols,
        "episodes": episodes,
        "episode_commits": commits,
        "duplicates": dups,
        "accuracy": accuracy,
        "oof": oof,
        "paired_vs_non_shared": paired,
        "validity": valid,
        "efficiency": efficiency,
    }


def _fmt_interval(ci: Sequence[float] | None) -> str:
    if ci is None:
        return "–"
    return f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _fmt_paired(cell: dict | None) -> str:
    if not cell:
        return "–"
    lo, hi = cell["ci95"]
    return f"{100 * cell['mean']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _fmt_protocol(p: dict) -> str:
    temp = p.get("temperature")
    if temp is None:
        decoding = "not recorded"
    elif temp == 0:
        decoding = "greedy"
    else:
        top_p = p.get("top_p")  # None where not recorded: the policies' default, no nucleus cut
        decoding = f"sampling T={temp:g}, top-p={1.0 if top_p is None else top_p:g}"
    cons = ", ".join(p.get("constraints") or []) or "none"
    if p.get("answer_score"):
        cons += f" (option texts by {p['answer_score']} log-prob)"
    return f"{decoding}; constraints: {cons}"


def render_markdown(summary: dict) -> str:
    """Markdown report: Table 3 (accuracy), Table 16 (OOF), Table 15 (length and steps), per-role costs."""
    levels, rows = summary["levels"], summary["rows"]
    level_cols = [lv.capitalize() if summary["benchmark"] == "hotpotqa" else f"Grade {lv}" for lv in levels]
    parts = [f"# {summary['benchmark']} evaluation\n"]
    parts.append(
        "Mean ± std over runs, in % (the value alone for one run); 95% CI: Student-t interval of the mean over "
        "runs (– with one run). "
        "Each row is one protocol:\n\n"
    )
    body = []
    for row in rows:
        n = summary["episodes"][row]
        protocol = _fmt_protocol(summary.get("protocol", {}).get(row, {}))
        body.append([row, summary["adapters"][row], protocol, str(sum(n.values())), str(len(n))])
    parts.append(markdown_table(["Row", "Adapters", "Decoding", "Episodes", "Runs"], body, ["l", "l", "l", "r", "r"]))
    for m in summary["metrics"]:
        parts.append(f"\n## Accuracy ({METRIC_TITLES[m]}), Table 3 layout\n\n")
        body = []
        for row in rows:
            cell = summary["accuracy"][m][row]
            vals = [fmt_over_runs(cell[lv]) for lv in [*levels, "avg"]]
            body.append([row, *vals, _fmt_interval(cell["avg"]["ci95"]), fmt_signed(cell["diff_vs_non_shared"])])
        parts.append(markdown_table(["Scheme", *level_cols, "Avg", "Avg 95% CI", "Δ vs non_shared"], body))
    paired = summary.get("paired_vs_non_shared") or {}
    if any(paired.get(m) for m in summary["metrics"]):
        parts.append(
            "\n## Paired difference to non_shared\n\nPer question: the mean over the runs both rows have of "
            "(row − non_shared); the mean over questions, in points, and its 95% bootstrap interval over questions "
            "(10,000 resamples). An interval that contains 0 is no measured difference.\n\n"
        )
        header = ["Scheme", *[f"Δ {METRIC_TITLES[m]} [95% CI]" for m in summary["metrics"]], "Δ OOF [95% CI]", "Pairs"]
        body = []
        for row in rows:
            cells = [paired.get(m, {}).get(row) for m in (*summary["metrics"], "oof")]
            if not any(cells):
                continue
            pairs = next(c["pairs"] for c in cells if c)
            body.append([row, *[_fmt_paired(c) for c in cells], str(pairs)])
        parts.append(markdown_table(header, body))
    if summary.get("validity"):
        parts.append(
            "\n## Answer validity\n\nShare of the answered episodes (not OOF) whose answer is a lone letter of one "
            "of the question's own options.\n\n"
        )
        body = []
        for row in rows:
            v = summary["validity"][row]
            rate = "–" if v["rate"] is None else f"{100 * v['rate']:.1f}%"
            top = "; ".join(f"{e['answer']} ×{e['count']}" for e in v["invalid_examples"][:4]) or "–"
            body.append([row, str(v["answered"]), str(v["valid"]), rate, top])
        parts.append(markdown_table(["Scheme", "Answered", "Valid", "Valid %", "Most frequent invalid"], body))
    parts.append("\n## Out-of-function rate, Table 16 layout\n\n")
    body = []
    for row in rows:
        cell = summary["oof"][row]
        body.append([row, *[fmt_over_runs(cell[lv]) for lv in [*levels, "avg"]]])
    parts.append(markdown_table(["Scheme", *level_cols, "Avg"], body))
    parts.append("\n## Per question: sequence length and steps, Table 15 layout\n\n")
    eff = summary["efficiency"]
    body = [
        [row, fmt_over_runs(eff[row]["num_tokens"], 1.0), fmt_over_runs(eff[row]["steps"], 1.0, 2)]
        for row in rows
    ]  # fmt: skip
    parts.append(markdown_table(["Scheme", "Sequence length (tokens)", "Cycles"], body))
    parts.append("\n## Per question and role: prefill / decode (mean over runs)\n\n")
    cols = ("prefill tok", "prefill s", "decode tok", "decode s")
    header = ["Scheme"] + [f"{role} {c}" for role in ROLES for c in cols]
    body = []
    for row in rows:
        cells = [row]
        for role in ROLES:
            for k, digits in (("prefill_tokens", 0), ("prefill_s", 3), ("decode_tokens", 0), ("decode_s", 3)):
                cells.append(f"{eff[row][f'{role}.{k}']['mean']:.{digits}f}")
        body.append(cells)
    parts.append(markdown_table(header, body))
    return "".join(parts)


def write_summary(records: Iterable[dict], out_dir: str | Path, provenance: dict | None = None) -> dict:
    """Writes ``summary.json`` (with ``provenance``) and ``report.md`` (with its footer) into ``out_dir``.

    Args:
        records: episode records.
        out_dir: output directory (created).
        provenance: this process's :func:`lragent.provenance.provenance` record (default: made here). Without a
            dtype (a merge) it takes the dtype(s) the episodes recorded.

    Returns:
        the summary (without the provenance, which differs between processes that agree on every number).
    """
    from lragent.provenance import provenance as make_provenance

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = list(records)
    summary = summarize(records)
    prov = dict(provenance or make_provenance())
    if prov.get("dtype") is None:  # a merge: the dtype is the one the episodes ran in
        dtypes = sorted({str(r["provenance"]["dtype"]) for r in records if (r.get("provenance") or {}).get("dtype")})
        prov["dtype"] = ", ".join(dtypes) or None
    write_json(out / "summary.json", {**summary, "provenance": prov})
    write_text(out / "report.md", render_markdown(summary) + provenance_footer(prov))
    return summary


def merge_dirs(dirs: Sequence[str | Path], out_dir: str | Path, provenance: dict | None = None) -> dict:
    """Summarises the episodes of several output directories (shards, the untrained row) into ``out_dir``."""
    records: list[dict] = []
    for d in dirs:
        path = Path(d) / EPISODES_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--merge {d}: no {EPISODES_FILE} there")
        records += read_episodes(path)
    return write_summary(records, out_dir, provenance)
