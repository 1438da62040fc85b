"""Results page of the sharing study (:mod:`eval_suite.study.driver`): Markdown, HTML and figures from the job outputs
alone.

Per benchmark:

1. **λ study**: for each shared-A set (λ, and the term's scheme), the ``non_shared`` accuracy (mean ± std over runs),
   the paired difference of ``base_lr_shared`` and ``full_shared`` to ``non_shared`` with its 95% bootstrap interval
   over questions (:mod:`eval_suite.scoring.paired`), their OOF rates, ScienceQA answer validity, and the teacher-forced
   fidelity (KL, top-1 against ``non_shared``) on the validation examples;
2. **every row at its runs**: each adapter set under each scheme it was evaluated with, per-run mean ± std, the
   Student-t interval over runs, and the paired difference to ``non_shared``;
3. ScienceQA: each set's ``non_shared`` accuracy against the chance rate of the same questions (mean of
   1/#options), paired by question, with its 95% interval;
4. figures: accuracy and KL against λ per scheme.

Only finished evaluations are reported (a job's ``summary.json``); a row still running is listed as missing.
"""

from __future__ import annotations

import hashlib
import html
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval_suite.evaluate.episode_log import EPISODES_FILE, read_episodes
from eval_suite.evaluate.eval_report import summarize
from eval_suite.report import fmt_mean_std, markdown_table, write_json, write_text
from eval_suite.scoring.paired import bootstrap_mean_interval, score_of
from eval_suite.study.jobs import Job, is_done
from lragent.provenance import provenance, provenance_footer
from lragent.report_io import save_figure

SCHEME_ORDER = ("non_shared", "base_lr_shared", "full_shared", "base_shared", "droidspeak")
ROW_ORDER = (*SCHEME_ORDER, "untrained")
"""Rows of the every-row table; ``untrained`` is the eval's name for ``--adapter_init zero`` (run under non_shared)."""
NON_SHARED_ROWS = ("non_shared", "untrained")


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _paired_cell(cell: dict | None) -> str:
    if not cell:
        return "–"
    lo, hi = cell["ci95"]
    return f"{100 * cell['mean']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def chance_gap(records: Sequence[dict], seed: int = 0) -> dict[str, Any] | None:
    """``non_shared`` accuracy minus the chance rate, paired by question (ScienceQA), with a 95% bootstrap interval.

    Per question: the mean over runs of ``correct - 1/#options``. The untrained set's row (``untrained``, run under
    ``non_shared``) counts as its ``non_shared`` row.
    """
    per_q: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["row"] in NON_SHARED_ROWS:
            per_q[str(r["qid"])].append(float(r["correct"]) - 1.0 / len(r["choices"]))
    if not per_q:
        return None
    values = [sum(v) / len(v) for v in per_q.values()]
    mean, lo, hi = bootstrap_mean_interval(values, seed=seed)
    chance = {str(r["qid"]): 1.0 / len(r["choices"]) for r in records if r["row"] in NON_SHARED_ROWS}
    return {"mean": mean, "ci95": [lo, hi], "chance": sum(chance.values()) / len(chance), "questions": len(values)}


def collect(root: Path, plan: Sequence[Job], partial: bool = False) -> dict[str, Any]:
    """Summaries of every adapter set's finished evaluations, the fidelity results and the training runs.

    Args:
        root: the study root.
        plan: the study's jobs.
        partial: also take the episodes of unfinished evaluations (listed under ``partial`` with their counts).
    """
    sets: dict[str, dict[str, Any]] = {}
    for job in plan:
        if job.kind == "probe":  # the zero-shot reference: a line of its own (probe_line), not an adapter set
            continue
        meta = job.meta
        keys = ("benchmark", "set", "lambda", "train_scheme", "shared_a")
        fresh = {"meta": {**{k: meta[k] for k in keys}, "data": meta.get("data") or {}}, "records": [], "missing": [],
                 "partial": {}, "fidelity": None, "train": None}  # fmt: skip
        entry = sets.setdefault(meta["set"], fresh)
        if job.kind == "eval":
            episodes = root / job.name / EPISODES_FILE
            if is_done(job, root):
                entry["records"] += read_episodes(episodes)
            elif partial and episodes.is_file() and episodes.stat().st_size > 0:
                recs = read_episodes(episodes)
                entry["records"] += recs
                entry["partial"][meta["scheme"]] = len(recs)
            else:
                entry["missing"].append(meta["scheme"])
        elif job.kind == "fidelity":
            if is_done(job, root):
                entry["fidelity"] = json.loads((root / job.done_file).read_text())
            else:
                entry["missing"].append("fidelity")
        elif job.kind == "train" and is_done(job, root):
            status = root / job.name / "fit_status.jsonl"
            lines = status.read_text().splitlines() if status.is_file() else []
            entry["train"] = json.loads(lines[-1]) if lines else {"done": True}
    for entry in sets.values():
        entry["summary"] = summarize(entry["records"]) if entry["records"] else None
        if entry["summary"] and entry["meta"]["benchmark"] == "scienceqa":
            entry["chance"] = chance_gap(entry["records"])
        entry.pop("records")
    return sets


def _metric(bench: str) -> str:
    return "accuracy" if bench == "scienceqa" else "em"


def _row_mean(summary: dict, metric: str, row: str) -> tuple[float | None, float | None, int]:
    cell = (summary or {}).get("accuracy", {}).get(metric, {}).get(row)
    if not cell:
        return None, None, 0
    return cell["avg"]["mean"], cell["avg"]["std"], cell["avg"]["runs"]


def _kl(fid: dict | None, scheme: str) -> float | None:
    if not fid:
        return None
    return (fid.get("schemes", {}).get(scheme) or {}).get("overall", {}).get("kl")


def _top1(fid: dict | None, scheme: str) -> float | None:
    if not fid:
        return None
    return (fid.get("schemes", {}).get(scheme) or {}).get("overall", {}).get("top1")


def fidelity_table(sets: dict[str, dict], bench: str) -> str:
    """Teacher-forced fidelity of every set of ``bench`` under every shared scheme it was measured for: KL to
    ``non_shared`` and top-1 agreement over all held-out role examples ("–" where a scheme does not apply, e.g.
    ``base_lr_shared`` on independent A, or the job has not run)."""
    schemes = ["base_lr_shared", "full_shared", "base_shared", "droidspeak"]
    header = ["Adapters", *(f"KL {s}" for s in schemes), *(f"top-1 {s}" for s in schemes), "Examples (tokens)"]
    body = []
    for name, e in sets.items():
        fid = e["fidelity"]
        if e["meta"]["benchmark"] != bench or not fid:
            continue
        overall = next((v["overall"] for v in fid.get("schemes", {}).values() if v.get("overall")), {})
        body.append([
            name, *("–" if _kl(fid, s) is None else f"{_kl(fid, s):.3f}" for s in schemes),
            *(_pct(_top1(fid, s)) for s in schemes),
            f"{overall.get('examples', '–')} ({overall.get('tokens', '–')})",
        ])  # fmt: skip
    return markdown_table(header, body) if body else "No fidelity results yet.\n"


def lambda_table(sets: dict[str, dict], bench: str) -> str:
    metric = _metric(bench)
    header = [
        "Adapters", "λ (term)", "non_shared", "Δ base_lr_shared [95% CI]", "Δ full_shared [95% CI]",
        "OOF ns / blr / full", "Valid % ns / blr / full", "KL blr / full", "top-1 blr / full", "Runs",
    ]  # fmt: skip
    body = []
    lam_sets = [e for e in sets.values() if e["meta"]["benchmark"] == bench and e["meta"]["shared_a"]
                and e["meta"]["lambda"] is not None]  # fmt: skip
    for e in sorted(lam_sets, key=lambda e: (e["meta"]["lambda"], e["meta"]["train_scheme"])):
        s, m = e["summary"], e["meta"]
        term = "—" if m["lambda"] == 0 else m["train_scheme"]
        mean, std, runs = _row_mean(s, metric, "non_shared")
        paired = (s or {}).get("paired_vs_non_shared", {}).get(metric, {})
        oof = [(s or {}).get("oof", {}).get(r, {}).get("avg", {}).get("mean") for r in LAMBDA3]
        valid = [((s or {}).get("validity", {}).get(r) or {}).get("rate") for r in LAMBDA3]
        body.append([
            m["set"], f"{m['lambda']:g} ({term})", fmt_mean_std(mean, std) if runs > 1 else _pct(mean),
            _paired_cell(paired.get("base_lr_shared")), _paired_cell(paired.get("full_shared")),
            " / ".join(_pct(x) for x in oof), " / ".join(_pct(x) for x in valid) if bench == "scienceqa" else "–",
            " / ".join("–" if _kl(e["fidelity"], r) is None else f"{_kl(e['fidelity'], r):.3f}" for r in LAMBDA3[1:]),
            " / ".join(_pct(_top1(e["fidelity"], r)) for r in LAMBDA3[1:]),
            str(runs) + (f" (missing: {', '.join(e['missing'])})" if e["missing"] else ""),
        ])  # fmt: skip
    return markdown_table(header, body)


LAMBDA3 = ("non_shared", "base_lr_shared", "full_shared")


def rows_table(sets: dict[str, dict], bench: str) -> str:
    metric = _metric(bench)
    header = ["Adapters", "Scheme", "Accuracy" if bench == "scienceqa" else "EM", "95% CI over runs",
              "Δ vs non_shared, paired [95% CI]", "OOF", "Runs", "Episodes"]  # fmt: skip
    body = []
    for e in sets.values():
        s = e["summary"]
        if e["meta"]["benchmark"] != bench or not s:
            continue
        for row in [r for r in ROW_ORDER if r in s["rows"]]:
            cell = s["accuracy"][metric][row]["avg"]
            ci = cell["ci95"]
            oof = s["oof"][row]["avg"]
            body.append([
                e["meta"]["set"], row,
                fmt_mean_std(cell["mean"], cell["std"]) if cell["runs"] > 1 else _pct(cell["mean"]),
                "–" if ci is None else f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]",
                _paired_cell(s["paired_vs_non_shared"][metric].get(row)),
                fmt_mean_std(oof["mean"], oof["std"]) if oof["runs"] > 1 else _pct(oof["mean"]),
                str(cell["runs"]), str(sum(s["episodes"][row].values())),
            ])  # fmt: skip
    return markdown_table(header, body)


def chance_table(sets: dict[str, dict]) -> str:
    body = []
    for e in sets.values():
        c = e.get("chance")
        if e["meta"]["benchmark"] != "scienceqa" or not c:
            continue
        lo, hi = c["ci95"]
        verdict = "above chance" if lo > 0 else ("below chance" if hi < 0 else "not distinguishable from chance")
        body.append([e["meta"]["set"], _pct(c["chance"]), f"{100 * c['mean']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]",
                     verdict, str(c["questions"])])  # fmt: skip
    return markdown_table(["Adapters", "Chance rate", "non_shared − chance, paired [95% CI]", "Verdict", "Questions"],
                          body)  # fmt: skip


def plot(sets: dict[str, dict], out: Path) -> list[str]:
    """``lambda_<benchmark>.png``: accuracy (left) and KL (right) against λ for the shared-A sets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for bench in sorted({e["meta"]["benchmark"] for e in sets.values()}):
        metric = _metric(bench)
        fig, (ax_acc, ax_kl) = plt.subplots(1, 2, figsize=(10, 4))
        for term, marker in (("base_lr_shared", "o"), ("full_shared", "s")):
            pts = sorted(
                (e["meta"]["lambda"], e) for e in sets.values()
                if e["meta"]["benchmark"] == bench and e["meta"]["shared_a"] and e["meta"]["lambda"] is not None
                and not e["meta"]["data"]  # recipe variants are table rows, not points of the λ curves
                and (e["meta"]["lambda"] == 0 or e["meta"]["train_scheme"] == term)
            )  # fmt: skip
            if len(pts) < 1:
                continue
            for row, ls in zip(LAMBDA3, ("-", "--", ":"), strict=True):
                xs, ys, es = [], [], []
                for lam, e in pts:
                    mean, std, _ = _row_mean(e["summary"], metric, row)
                    if mean is not None:
                        xs.append(lam)
                        ys.append(100 * mean)
                        es.append(100 * (std or 0))
                if xs:
                    ax_acc.errorbar(xs, ys, yerr=es, marker=marker, ls=ls, capsize=3,
                                    label=f"eval {row} (train term {term})")  # fmt: skip
            for row, ls in zip(LAMBDA3[1:], ("--", ":"), strict=True):
                xs = [lam for lam, e in pts if _kl(e["fidelity"], row) is not None]
                ys = [_kl(e["fidelity"], row) for lam, e in pts if _kl(e["fidelity"], row) is not None]
                if xs:
                    ax_kl.plot(xs, ys, marker=marker, ls=ls, label=f"{row} (train term {term})")
        ax_acc.set(xlabel="λ", ylabel=f"{metric} (%)", title=f"{bench}: accuracy vs λ (mean ± std over runs)")
        ax_kl.set(xlabel="λ", ylabel="KL(non_shared ‖ scheme)", title=f"{bench}: teacher-forced KL vs λ")
        for ax in (ax_acc, ax_kl):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"lambda_{bench}.png"
        save_figure(fig, out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def _md_to_html(md: str) -> str:
    """The study page's Markdown (headings, paragraphs, pipe tables, images) as HTML; nothing else is used."""
    out, table = [], []

    def flush() -> None:
        if table:
            rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
            head, body = rows[0], [r for r in rows[2:]]
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
                       + "</table>")  # fmt: skip
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("!["):
            src = line[line.index("(") + 1 : line.rindex(")")]
            out.append(f"<img src='{html.escape(src)}' style='max-width:100%'>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    css = "body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse}" \
          "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}"  # fmt: skip
    head = f"<!doctype html><html><head><meta charset='utf-8'><style>{css}</style></head>"
    return f"{head}<body>{''.join(out)}</body></html>"


SAMPLER_RERUNS_FILE = "sampler_reruns.json"


def _episode_key(r: dict) -> tuple:
    """An episode across two drawings of one row: its question, run and sampling seed."""
    return r["qid"], r.get("run"), r.get("seed")


def _episode_outcome(r: dict) -> tuple:
    """What two drawings of an episode are compared on: prediction, token count, actions."""
    return r.get("prediction"), r.get("num_tokens"), tuple(r.get("actions") or ())


def sampler_reruns(root: Path) -> dict[str, dict[str, Any]]:
    """Each evaluation row kept beside its rerun as ``<row>.sampler<N>`` (episodes of an older sampler), against the
    rerun: per row, the episodes both have (same question, run and seed), how many give the same prediction, token
    count and actions, the differing ones, and the old file's sha256 (so a copy kept elsewhere can be checked).

    Returns:
        ``{"<set>/<row>.sampler<N>": {...}}``; empty where no older copy is kept.
    """
    out: dict[str, dict[str, Any]] = {}
    for old_dir in sorted((root / "eval").glob("*/*.sampler*")):
        new_file, old_file = (
            old_dir.with_name(old_dir.name.split(".sampler")[0]) / EPISODES_FILE,
            old_dir / EPISODES_FILE,
        )
        if not old_file.is_file():
            continue
        old = {_episode_key(r): _episode_outcome(r) for r in read_episodes(old_file)}
        new = {_episode_key(r): _episode_outcome(r) for r in read_episodes(new_file)}
        shared = sorted(set(old) & set(new), key=repr)
        differing = [list(k) for k in shared if old[k] != new[k]]
        out[f"{old_dir.parent.name}/{old_dir.name}"] = {
            "old_episodes": len(old), "rerun_episodes": len(new), "shared": len(shared),
            "identical": len(shared) - len(differing), "differing": differing,
            "old_sha256": hashlib.sha256(old_file.read_bytes()).hexdigest(),
        }  # fmt: skip
    return out


def sampler_reruns_line(reruns: dict[str, dict[str, Any]]) -> str:
    """One Markdown paragraph summing :func:`sampler_reruns` (empty when there is nothing to say)."""
    if not reruns:
        return ""
    shared = sum(v["shared"] for v in reruns.values())
    same = sum(v["identical"] for v in reruns.values())
    return (
        f"\n**Rows rerun with the current sampler** (older copies kept as `<row>.samplerN`, compared in "
        f"`{SAMPLER_RERUNS_FILE}`): {len(reruns)} rows, {shared} episodes in both, **{same} with the same prediction, "
        f"token count and actions** ({shared - same} differ).\n"
    )


def _without_examples(fidelity: dict | None) -> dict | None:
    """A fidelity result without its per-example records (they stay in the job's own output)."""
    return None if fidelity is None else {k: v for k, v in fidelity.items() if k != "examples"}


def write_report(root: Path, plan: Sequence[Job], out: Path, partial: bool = False) -> dict:
    """Writes ``study.md``, ``study.html``, ``study.json`` and the figures into ``out``.

    Args:
        root: the study root.
        plan: the study's jobs.
        out: output directory.
        partial: include unfinished evaluations (an interim page; each such row is marked with its episode count).
    """
    out.mkdir(parents=True, exist_ok=True)
    sets = collect(root, plan, partial)
    figures = plot(sets, out)
    parts = ["# Sharing study: accuracy under a shared cache, and training for sharing (λ)\n\n",
             "Every number below comes from the job outputs under the study root (`python -m eval_suite.study "
             "report`). Paired differences: per question, the mean over runs of (scheme − non_shared) with the same "
             "sampling seeds; 95% bootstrap interval over the questions. An interval containing 0 is no measured "
             "difference. `ns` / `blr` / `full`: non_shared / base_lr_shared / full_shared.\n"]  # fmt: skip
    for bench in [b for b in ("scienceqa", "hotpotqa") if any(e["meta"]["benchmark"] == b for e in sets.values())]:
        parts.append(f"\n## {bench}: λ study (shared A)\n\n")
        line = probe_line(root, bench)
        if line:
            parts.append(line + "\n\n")
        parts.append(lambda_table(sets, bench))
        parts.append(f"\n## {bench}: every row\n\n")
        parts.append(rows_table(sets, bench))
        parts.append(f"\n## {bench}: teacher-forced fidelity to non_shared (every set)\n\n")
        parts.append(fidelity_table(sets, bench))
        if bench == "scienceqa":
            parts.append("\n## scienceqa: non_shared against the chance rate\n\n")
            parts.append(chance_table(sets))
        if f"lambda_{bench}.png" in figures:
            parts.append(f"\n![{bench}](lambda_{bench}.png)\n")
    total = {j.meta["set"]: j.meta["runs"] for j in plan if j.kind == "eval"}
    unfinished = [
        f"{name}: " + ", ".join(f"{sch} {n} of {90 * total[name]} episodes" for sch, n in e["partial"].items())
        for name, e in sets.items()
        if e["partial"]
    ]
    if unfinished:
        note = (
            "\n**Interim page: some rows are unfinished** (their numbers cover only the episodes run so far, the "
            "first questions of the first run; the paired differences pair only the (question, run) both rows have). "
            "Unfinished: "
        )
        parts.insert(1, note + "; ".join(unfinished) + ".\n")
    # the older-sampler copies: compared here while they exist; the comparison file outlives them (a later report
    # rebuilt from archives without the copies keeps the file and its line)
    reruns = sampler_reruns(root)
    if reruns:
        write_json(out / SAMPLER_RERUNS_FILE, reruns)
    elif (out / SAMPLER_RERUNS_FILE).is_file():
        reruns = json.loads((out / SAMPLER_RERUNS_FILE).read_text())
    parts.append(sampler_reruns_line(reruns))
    missing = [f"{name}: {', '.join(e['missing'])}" for name, e in sets.items() if e["missing"]]
    if missing:
        parts.append("\n## Not run yet (missing evaluations and fidelity)\n\n" + "".join(f"- {m}\n" for m in missing))
    command = ["python", "-m", "eval_suite.study.driver", "report", "--root", str(root), "--out", str(out)]
    prov = provenance(command=command + (["--partial"] if partial else []))
    md = "".join(parts)
    write_text(out / "study.md", md + provenance_footer(prov))
    write_text(out / "study.html", _md_to_html(md + provenance_footer(prov)))
    # the per-example fidelity records stay in the job outputs (the study's archives): the page keeps the summaries
    data = {name: {k: _without_examples(v) if k == "fidelity" else v for k, v in e.items()} for name, e in sets.items()}
    write_json(out / "study.json", {"sets": data, "provenance": prov})
    return data


# ------------------------------------------------------------------------------------------------------ recipe sweep
def _question_interval(records: Sequence[dict], field: str) -> tuple[float, float, float] | None:
    """Mean over questions (each question's mean over runs) of ``field`` with its 95% bootstrap interval."""
    per_q: dict[str, list[float]] = defaultdict(list)
    for r in records:
        per_q[str(r["qid"])].append(float(r.get(field) or 0.0))
    if not per_q:
        return None
    return bootstrap_mean_interval([sum(v) / len(v) for v in per_q.values()])


def _ci(cell: tuple[float, float, float] | None) -> str:
    if cell is None:
        return "–"
    mean, lo, hi = cell
    return f"{100 * mean:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def probe_line(root: Path, bench: str) -> str | None:
    """The zero-shot reference row of ``bench`` (``probe/<bench>/summary.json``) as one sentence, if it ran."""
    path = root / "probe" / bench / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    if bench == "scienceqa":
        c = s["correct"]
        return (
            "Zero-shot reference (base model, no agents, letter by next-token logit): accuracy "
            f"{c['mean']:.1f}% [{c['low']:.1f}, {c['high']:.1f}], chance {s['chance']:.1f}%, "
            f"{s['questions']} questions."
        )
    e, f = s["em"], s["f1"]
    return (
        "Zero-shot reference (base model given the ten context paragraphs, greedy short answer): EM "
        f"{e['mean']:.1f} [{e['low']:.1f}, {e['high']:.1f}], F1 {f['mean']:.1f}, {s['questions']} questions."
    )


def collect_sweep(root: Path, plan: Sequence[Job], reference: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One entry per recipe point and benchmark: the recipe, its training (last val/loss, time, adapter size) and its
    dev episodes (metric with a 95% bootstrap interval over questions, OOF, ScienceQA letter validity), the older
    draws of its row (:func:`earlier_draws`) and its paired difference to the benchmark's reference point
    (``reference``: benchmark -> set name, the recipe that ships), on the same questions and sampling seeds."""
    from eval_suite.evaluate.benchmarks import get_benchmark
    from eval_suite.scoring.paired import paired_difference, validity
    from eval_suite.study.training_logs import read_metrics, read_status, validation_rows

    out = []
    for job in plan:
        if job.kind != "eval":
            continue
        meta = job.meta
        train_dir = root / "train" / meta["set"]
        vals = validation_rows(read_metrics(train_dir))
        status = read_status(train_dir)
        fresh = [i for i, r in enumerate(status) if not r.get("start_step")]  # a retraining starts over at step 0
        status = status[fresh[-1] :] if fresh else status  # the time of the training whose weights were evaluated
        # weights only: a committed root keeps the adapters' configs but not their weights (then no size is known)
        size = sum(p.stat().st_size for p in (train_dir / "adapters").rglob("*.safetensors"))
        records = read_episodes(root / job.name / EPISODES_FILE)
        bench = meta["benchmark"]
        field = get_benchmark(bench).score_fields[0]  # the headline score of an episode record: correct / em
        entry: dict[str, Any] = {
            "set": meta["set"], "benchmark": bench, "recipe": meta.get("recipe", {}), "done": is_done(job, root),
            "episodes": len(records), "runs": len({r["run"] for r in records}),
            "val_loss": float(vals[-1]["val/loss"]) if vals else None,
            "train_s": round(sum(r.get("train_s") or 0 for r in status), 1) or None,
            "adapters_mb": round(size / 1e6, 2) if size else None,
            "oof": (sum(bool(r.get("oof")) for r in records) / len(records)) if records else None,
        }  # fmt: skip
        if bench == "scienceqa":
            entry["accuracy"] = _question_interval(records, field)
            entry["valid"] = validity(records)["rate"] if records else None
        else:
            entry["em"] = _question_interval(records, field)
            entry["f1"] = _question_interval(records, "f1")
        entry["earlier"] = earlier_draws(root / job.name, field)
        ref = (reference or {}).get(bench)
        entry["vs_reference"] = None
        if ref and ref != meta["set"] and records:
            ref_records = read_episodes(root / "eval" / ref / Path(job.name).name / EPISODES_FILE)
            both = [{**r, "row": "point"} for r in records] + [{**r, "row": "reference"} for r in ref_records]
            entry["vs_reference"] = paired_difference(both, "point", "reference", field)
        out.append(entry)
    return out


def earlier_draws(row_dir: Path, field: str) -> list[dict[str, Any]]:
    """The older copies of one evaluation row (``<row>.sampler<N>``, kept when the row ran again under a newer
    sampler, after a retraining of its set): per copy, its episodes and the mean of ``field``. Two draws of the same
    recipe show the run-to-run spread that a sweep's one-run points must be read against."""
    out = []
    for d in sorted(row_dir.parent.glob(f"{row_dir.name}.sampler*")):
        records = read_episodes(d / EPISODES_FILE)
        if records:
            out.append({"copy": d.name, "episodes": len(records),
                        "mean": sum(score_of(r, field) for r in records) / len(records)})  # fmt: skip
    return out


def _delta(d: dict | None) -> str:
    if d is None:
        return "–"
    lo, hi = d["ci95"]
    return f"{100 * d['mean']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def sweep_table(entries: Sequence[dict], bench: str) -> str:
    scienceqa = bench == "scienceqa"
    metric = "Accuracy % [95% CI]" if scienceqa else "EM % [95% CI]"
    header = ["Set", "lr", "epochs", "targets", "rank", "val loss", metric, "Δ to shipped recipe [95% CI]",
              "Earlier draw", "Valid %" if scienceqa else "F1 %", "OOF %", "Episodes", "Train s", "MB"]  # fmt: skip
    body = []
    for e in entries:
        if e["benchmark"] != bench:
            continue
        r = e["recipe"]
        body.append([
            e["set"] + ("" if e["done"] else " (unfinished)"), f"{r.get('lr', 0):g}", str(r.get("epochs", "")),
            str(r.get("targets", "")), str(r.get("rank", "")),
            "–" if e["val_loss"] is None else f"{e['val_loss']:.3f}",
            _ci(e["accuracy"] if scienceqa else e["em"]), _delta(e.get("vs_reference")),
            ", ".join(f"{100 * d['mean']:.1f}" for d in e.get("earlier") or []) or "–",
            _pct(e["valid"]) if scienceqa else ("–" if e["f1"] is None else f"{100 * e['f1'][0]:.1f}"),
            _pct(e["oof"]), str(e["episodes"]), "–" if e["train_s"] is None else f"{e['train_s']:.0f}",
            "–" if e["adapters_mb"] is None else f"{e['adapters_mb']:.1f}",
        ])  # fmt: skip
    return markdown_table(header, body)


def write_sweep_report(
    root: Path, plan: Sequence[Job], out: Path, reference: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Writes ``sweep.md`` and ``sweep.json`` into ``out``: per benchmark, one row per recipe point.

    Args:
        root: the sweep's root.
        plan: the sweep's jobs (:func:`eval_suite.study.driver.build_sweep_plan`).
        out: output directory.
        reference: benchmark -> the set name of the recipe that ships (each point's paired difference is to it).
    """
    out.mkdir(parents=True, exist_ok=True)
    entries = collect_sweep(root, plan, reference)
    parts = ["# Recipe sweep: dev episodes per training recipe\n\n",
             "Each point trains one shared-A λ = 0 adapter set from the bundled trajectories and runs its agents on "
             "the 90 dev questions under `non_shared` (sampling as the evaluation protocol). The interval is a 95% "
             "bootstrap over questions (each question's mean over runs); `val loss` is the last epoch's plain "
             "validation loss on held-out role examples. `Δ to shipped recipe` is the paired difference to the point "
             "whose recipe the shipped sets use (same questions, same sampling seeds), with its 95% bootstrap interval "
             "over questions. `Earlier draw` is the same recipe trained and run once before (the row's older copy, "
             "kept when it ran again under a newer sampler): the gap between two draws of one recipe is the noise "
             "that a one-run point is read against. `Train s` is the training's wall time on a GPU that other jobs "
             "shared (not a speed figure); `MB` the adapters' weights, where the root keeps them.\n"]  # fmt: skip
    for bench in [b for b in ("scienceqa", "hotpotqa") if any(e["benchmark"] == b for e in entries)]:
        parts.append(f"\n## {bench}\n\n")
        line = probe_line(root, bench)
        if line:
            parts.append(line + "\n\n")
        parts.append(sweep_table(entries, bench))
    command = [
        "python",
        "-m",
        "eval_suite.study.driver",
        "report",
        "--stage",
        "sweep",
        "--root",
        str(root),
        "--out",
        str(out),
    ]
    prov = provenance(command=command)
    write_text(out / "sweep.md", "".join(parts) + provenance_footer(prov))
    write_json(out / "sweep.json", {"points": entries, "provenance": prov})
    return entries
