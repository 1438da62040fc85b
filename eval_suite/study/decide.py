"""The decisive study: does ``base_lr_shared`` stay within 2 points of ``non_shared``, with intervals that can say so.

``python -m eval_suite.study run --stage decide`` plans, for each benchmark and each λ of :data:`LAMBDAS` (the
shipped λ = 0 shared-A set, and λ = 0.5 trained from the study's recipe), one eval job that runs ``non_shared``,
``base_lr_shared`` and ``full_shared`` in one process, one scheme after the other, over the benchmark's
decision pool (:data:`POOLS`: the paper's test sets, ``dev`` + ``test``, and for ScienceQA the ``extra`` questions)
with :data:`RUNS` runs, the evaluation protocol's sampling and paired seeds; then ``base_shared`` and ``droidspeak``
of the shipped set; then one greedy pair (temperature 0: ``non_shared`` and ``base_lr_shared``) on the paper's pool.
Nothing is chosen by these questions: the recipe, λ and every setting were chosen on ``dev`` before.

Every job resumes from its episode log; raising :data:`RUNS` (``--runs`` overrides every benchmark) plans more runs
into the same folders, and the finished episodes are kept. :func:`write_decide_report` computes the paired
difference of each shared scheme to ``non_shared`` (per question the mean over runs, a bootstrap over questions:
:mod:`eval_suite.scoring.paired`) on the whole pool and on the paper's questions alone, its half-width against
:data:`TARGET_HALF_WIDTH`, and the verdict: within 2 points when the interval's lower end is at least -2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eval_suite.scoring.paired import paired_difference
from eval_suite.study.jobs import Job, _train_job, _with_python, set_name
from lragent.report_io import write_json, write_text

LAMBDAS: tuple[float, ...] = (0.0, 0.5)
POOLS: dict[str, str] = {"scienceqa": "dev,test,extra", "hotpotqa": "dev,test"}
"""The questions each benchmark's decision is taken on (name the pool in every table)."""
PAPER_POOL: tuple[str, ...] = ("dev", "test")
"""The paper's test sets (300 HotpotQA, 360 ScienceQA): the paper-comparable figure."""
RUNS: dict[str, int] = {"scienceqa": 2, "hotpotqa": 8}
"""Runs per question, from the 90-question study's variance components of the paired difference (ScienceQA:
run-to-run 0.18, between questions 0.10, so 1,772 questions x 2 runs give about +-2.0 points; HotpotQA: 0.21 and
about 0, so 300 questions x 8 runs give about +-1.8)."""
TARGET_HALF_WIDTH: dict[str, float] = {"scienceqa": 0.025, "hotpotqa": 0.020}
SCHEMES: tuple[str, ...] = ("non_shared", "base_lr_shared", "full_shared")
OTHER_SCHEMES: tuple[str, ...] = ("base_shared", "droidspeak")
GREEDY_SCHEMES: tuple[str, ...] = ("non_shared", "base_lr_shared")
BATCH = 48
"""Rows per scheme's engine: the three engines of a job (non_shared's three caches per row) fit an 80 GB card."""
CAPACITY = 8192
"""Positions per row: eval's default ``--capacity``, which the jobs keep."""
FEED_BUDGET = 2048
"""``eval --feed_budget`` of every job, with ``--launch_ahead true``: on an H100 the two gave 17.6 episodes per
GPU-second against 11.2 at the default 256 (`results/eval_throughput/README.md`), the same sampling protocol (seeds,
temperature, top-p). A job resumed with them keeps its finished episodes; its later ones round bf16 steps at other
decode widths, as another ``--batch`` would (accuracies compare, records not)."""
STALL_S = 120
"""``eval --stall_s`` of every job: a decode call that never returns ends the job after this long (its episodes kept,
the driver's next call resumes it) instead of holding the GPU for the rest of the lease."""
FIELD = {"scienceqa": "correct", "hotpotqa": "em"}
WITHIN = 0.02
VERDICT_WORDS = {"within": "yes", "outside": "no", "undecided": "undecided (interval crosses -2)"}
"""How the decisive table words each :func:`decide_cell` verdict."""


def job_gib(model: str, schemes: Sequence[str], lanes: bool) -> float:
    """GPU memory of one eval job in GiB (:mod:`lragent.memory_plan`, :data:`BATCH` rows of :data:`CAPACITY`, bf16),
    rounded up to a half: one scheme's engine at a time needs the largest scheme's plan; the lanes need every
    scheme's caches and workspace at once, beside one copy of the model. The driver packs jobs onto a GPU by it, so
    one scheme at a time lets a trainings or a two-scheme job run beside a three-scheme job on an 80 GB card."""
    from lragent.memory_plan import GIB, model_shape, plan_memory

    shape = model_shape(model)
    plans = [plan_memory(shape, s, BATCH, CAPACITY, element_size=2) for s in schemes]
    if lanes:
        need = plans[0].model_bytes + sum(p.total - p.model_bytes for p in plans)
    else:
        need = max(p.total for p in plans)
    return math.ceil(2 * need / GIB) / 2


def _eval(profile: Any, bench: str, set_name: str, label: str, adapters: list[str], schemes: Sequence[str],
          runs: int, split: str, deps: tuple[str, ...], priority: float, meta: dict,
          extra: Sequence[str] = (), lanes: bool = False) -> Job:  # fmt: skip
    name = f"eval/{set_name}/{label}"
    return Job(
        name=name, kind="eval",
        cmd=["{python}", "cli.py", "eval", "--benchmark", bench, *profile.model_args(), *adapters,
             "--scheme", ",".join(schemes), "--runs", str(runs), "--split", split, "--batch", str(BATCH),
             "--concurrent_schemes", str(lanes).lower(), "--stall_s", str(STALL_S), "--dtype", "bfloat16",
             "--launch_ahead", "true", "--feed_budget", str(FEED_BUDGET), *extra,
             "--out", f"{{root}}/{name}",
             "--quiet", "true"],
        done_file=f"{name}/summary.json", deps=deps, gb=job_gib(profile.model, schemes, lanes), priority=priority,
        meta={**meta, "rows": list(schemes), "runs": runs, "split": split, "label": label},
    )  # fmt: skip


def build_decide_plan(
    benchmarks: Sequence[str],
    profile: Any,
    runs: dict[str, int] | None = None,
    lambdas: Sequence[float] = LAMBDAS,
    epochs: int = 2,
    python: str = "python3",
    lanes: bool = False,
) -> list[Job]:
    """Every job of the decisive study, in priority order (see the module docstring).

    Args:
        benchmarks: benchmarks to decide on.
        profile: the base model's profile (:data:`eval_suite.study.driver.PROFILES`).
        runs: runs per question by benchmark (default :data:`RUNS`).
        lambdas: λ of the shared-A sets (0: the shipped set).
        epochs: training epochs of a set that is trained.
        python: the interpreter of the jobs.
        lanes: each job's schemes together (``--concurrent_schemes true``) or, by default, one at a time in its
            process.
    """
    runs = {**RUNS, **(runs or {})}
    prefix = "" if profile.model == "default" else f"{profile.config_prefix}_"
    jobs: list[Job] = []
    for bi, bench in enumerate(benchmarks):
        for li, lam in enumerate(lambdas):
            name = set_name(bench, lam)
            meta = {"benchmark": bench, "set": name, "lambda": lam, "train_scheme": "base_lr_shared",
                    "shared_a": True, "data": {}}  # fmt: skip
            deps: tuple[str, ...] = ()
            if lam == 0:  # the shipped λ = 0 set
                adapters = ["--adapters", f"data/adapters/{prefix}{bench}_sharedA"]
            else:
                train = _train_job(profile, name, 10 * li + bi * 0.1, {**meta, "epochs": epochs})
                jobs.append(train)
                deps = (train.name,)
                adapters = ["--adapters", f"{{root}}/{train.name}/adapters"]
            prio = 10 * li + 1 + bi * 0.1
            jobs.append(_eval(profile, bench, name, "decide", adapters, SCHEMES, runs[bench], POOLS[bench], deps,
                              prio, meta, lanes=lanes))  # fmt: skip
            if lam == 0:
                jobs.append(_eval(profile, bench, name, "others", adapters, OTHER_SCHEMES, runs[bench],
                                  POOLS[bench], deps, 100 + bi * 0.1, meta, lanes=lanes))  # fmt: skip
                jobs.append(_eval(profile, bench, name, "greedy", adapters, GREEDY_SCHEMES, 1, ",".join(PAPER_POOL),
                                  deps, 200 + bi * 0.1, meta, extra=("--temperature", "0"), lanes=lanes))  # fmt: skip
    return _with_python(jobs, python)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def decide_cell(records: Sequence[dict], row: str, field: str, bench: str) -> dict[str, Any] | None:
    """The paired difference ``row - non_shared`` on ``records`` with its half-width and the verdicts.

    ``verdict``: ``within`` when the interval's lower end is at least -2 points, ``outside`` when its upper end is
    below -2 (the whole interval lies further down: decided whatever its width), else ``undecided``.
    """
    d = paired_difference(records, row, "non_shared", field)
    if d is None:
        return None
    low, high = d["ci95"]
    verdict = "within" if low >= -WITHIN else "outside" if high < -WITHIN else "undecided"
    return {
        **d,
        "half_width": (high - low) / 2,
        "target_half_width": TARGET_HALF_WIDTH[bench],
        "narrow_enough": (high - low) / 2 <= TARGET_HALF_WIDTH[bench],
        "within_2_points": verdict == "within",
        "verdict": verdict,
    }


def _mean(records: Sequence[dict], row: str, field: str) -> tuple[float | None, int, int]:
    """Mean score of ``row``, its episodes and questions."""
    xs = [r for r in records if r.get("row") == row]
    if not xs:
        return None, 0, 0
    return sum(float(r.get(field) or 0.0) for r in xs) / len(xs), len(xs), len({r["qid"] for r in xs})


def collect_decide(root: Path, plan: Sequence[Job]) -> dict[str, Any]:
    """Per benchmark and set: accuracy of every row and the paired cells, on the pool and on the paper's pool.

    A job without a ``non_shared`` row of its own (``others``) is paired with its set's ``decide`` job's
    ``non_shared`` records: the same questions, runs, seeds and sampling, so ``(question, run)`` pairs the same way.
    """
    out: dict[str, Any] = {}
    evals = [job for job in plan if job.kind == "eval"]
    records = {job.name: _records(root / job.name / "episodes.jsonl") for job in evals}
    reference = {job.meta["set"]: [r for r in records[job.name] if r.get("row") == "non_shared"]
                 for job in evals if job.meta["label"] == "decide"}  # fmt: skip
    for job in evals:
        bench, set_name, label = job.meta["benchmark"], job.meta["set"], job.meta["label"]
        recs = records[job.name]
        own_reference = "non_shared" in job.meta["rows"]
        paired_recs = recs if own_reference else recs + reference.get(set_name, [])
        field = FIELD[bench]
        entry = out.setdefault(bench, {}).setdefault(set_name, {"lambda": job.meta["lambda"], "labels": {}})
        paper = [r for r in recs if r.get("split", "dev") in PAPER_POOL]
        paired_paper = [r for r in paired_recs if r.get("split", "dev") in PAPER_POOL]
        config = root / job.name / "run_config.json"  # the pool's size, as the job counted it when it started
        pool_questions = json.loads(config.read_text()).get("questions") if config.is_file() else None
        cell: dict[str, Any] = {"pool": job.meta["split"], "pool_questions": pool_questions,
                                "planned_runs": job.meta["runs"], "episodes": len(recs),
                                "rows": {}, "paired": {}, "paired_paper": {}}  # fmt: skip
        for row in job.meta["rows"]:
            mean, n, q = _mean(recs, row, field)
            pmean, pn, pq = _mean(paper, row, field)
            runs = sorted({r["run"] for r in recs if r.get("row") == row})
            cell["rows"][row] = {"mean": mean, "episodes": n, "questions": q, "runs": len(runs),
                                 "paper_mean": pmean, "paper_episodes": pn, "paper_questions": pq}  # fmt: skip
            if row != "non_shared":
                cell["paired"][row] = decide_cell(paired_recs, row, field, bench)
                cell["paired_paper"][row] = decide_cell(paired_paper, row, field, bench)
        entry["labels"][label] = cell
    return out


def _pts(x: float | None, signed: bool = False) -> str:
    return "–" if x is None else f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _cell(c: dict | None) -> str:
    if not c:
        return "–"
    low, high = c["ci95"]
    return f"{_pts(c['mean'], True)} [{_pts(low, True)}, {_pts(high, True)}] (±{100 * c['half_width']:.1f})"


def decide_table(data: dict[str, Any]) -> str:
    """The decisive table: per benchmark and λ, ``non_shared`` and the paired gaps with the pool and runs named."""
    lines = [
        "| benchmark, set | pool (questions x runs) | `non_shared` | Δ `base_lr_shared` [95%] | Δ `full_shared` [95%] "
        "| paper's questions: `non_shared`, Δ `base_lr_shared`, Δ `full_shared` | within 2 points? |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for bench, sets in data.items():
        for entry in sets.values():
            c = entry["labels"].get("decide")
            if not c:
                continue
            ns = c["rows"].get("non_shared", {})
            blr, full = c["paired"].get("base_lr_shared"), c["paired"].get("full_shared")
            pb, pf = c["paired_paper"].get("base_lr_shared"), c["paired_paper"].get("full_shared")
            # the pairs a finished job has (a job without its run_config: the questions it has reached)
            planned = (c.get("pool_questions") or ns.get("questions", 0)) * c["planned_runs"]
            verdict = []
            for name, cell in (("base_lr_shared", blr), ("full_shared", full)):
                if cell is None:
                    continue
                verdict.append(f"`{name}` {VERDICT_WORDS[cell['verdict']]}")
                if cell["pairs"] < planned:
                    verdict[-1] += f" (partial: {cell['pairs']:,} of {planned:,} pairs)"
            episodes = planned * len(c["rows"])  # a job with no pair yet: its first row's mean is partial too
            if not verdict and 0 < c["episodes"] < episodes:
                verdict.append(f"– (partial: {c['episodes']:,} of {episodes:,} episodes)")
            lines.append(
                f"| {bench}, λ {entry['lambda']:g} | {c['pool']} ({ns.get('questions', 0)} x {ns.get('runs', 0)}) "
                f"| {_pts(ns.get('mean'))} | {_cell(blr)} | {_cell(full)} "
                f"| {_pts(ns.get('paper_mean'))}, {_pts(pb['mean'] if pb else None, True)}, "
                f"{_pts(pf['mean'] if pf else None, True)} | {'; '.join(verdict) or '–'} |"
            )
    return "\n".join(lines)


def other_rows_table(data: dict[str, Any]) -> str:
    """The shipped set's ``base_shared`` / ``droidspeak`` rows and the greedy pair, each with its paired gap to
    ``non_shared`` (the ``others`` rows against the ``decide`` job's)."""
    lines = ["| benchmark, set | job | pool | rows (mean, questions x runs) |", "|---|---|---|---|"]
    for bench, sets in data.items():
        for entry in sets.values():
            for label in ("others", "greedy"):
                c = entry["labels"].get(label)
                if not c or not c["episodes"]:
                    continue
                rows = ", ".join(f"`{r}` {_pts(v['mean'])} ({v['questions']} x {v['runs']})"
                                 for r, v in c["rows"].items())  # fmt: skip
                paired = "; ".join(f"Δ `{r}` {_cell(v)}" for r, v in c["paired"].items() if v)
                lines.append(f"| {bench}, λ {entry['lambda']:g} | {label} | {c['pool']} | {rows}"
                             f"{'; ' + paired if paired else ''} |")  # fmt: skip
    return "\n".join(lines)


def write_decide_report(root: Path, plan: Sequence[Job], out: Path) -> dict[str, Any]:
    """Writes ``decide.json`` and ``decide.md`` (the decisive table, the other rows) under ``out``."""
    from lragent.provenance import provenance

    data = collect_decide(root, plan)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "decide.json", {"results": data, "provenance": provenance()})
    md = (
        "# The decisive study: paired gaps to `non_shared` with intervals that decide\n\n"
        "Paired by question and seed; per question the mean over runs; 95% percentile bootstrap over questions. "
        "Within 2 points (yes): the interval's lower end is at least -2; no: its upper end is below -2; else "
        "undecided. Half-width targets: ScienceQA ±2.5, HotpotQA ±2.0 points. A job still running is marked partial "
        "with the pairs it has.\n\n" + decide_table(data) + "\n\n## Other rows\n\n" + other_rows_table(data) + "\n"
    )
    write_text(out / "decide.md", md)
    return data
