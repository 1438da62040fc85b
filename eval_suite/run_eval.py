"""`python cli.py eval`: multi-agent accuracy of the sharing schemes on HotpotQA / ScienceQA (paper Tables 3 and 16).

For every (row, run, question) one AutoAct episode runs (:class:`~lragent.agents.AgentLoop`, plan → plan → action,
two-stage reflect, offline tools) and one JSON line is appended to ``OUT/episodes.jsonl`` as soon as it finishes. A
row is a scheme, or ``untrained`` for the base model (``--adapter-init zero``: B = 0, so every scheme is the base
model and one row is enough). An interrupted run resumes: finished entries are read back (a truncated last line is
dropped) and skipped. ``--shard i/n`` takes every n-th question, so several processes split the work;
``--merge DIR ...`` summarises several output directories together.

The summary (``summary.json``, ``report.md``) is computed from the JSONL only, records sorted by key first, so an
uninterrupted run, a resumed run and merged shards give the same numbers:

- accuracy per level and average, mean ± std over runs, and the average's difference to ``non_shared`` (Table 3;
  HotpotQA: exact match and F1, ScienceQA: choice accuracy);
- OOF rate per level, same layout (Table 16);
- mean sequence length, cycles per question, and per role prefill/decode tokens and seconds per question.

Usage::

    python cli.py eval --benchmark hotpotqa --scheme all --adapters runs/hotpotqa/adapters --runs 3 --out out/hp
    python cli.py eval --benchmark hotpotqa --adapter-init zero --out out/hp_untrained
    python cli.py eval ... --shard 0/4 --out out/hp_s0     # one process per shard, then:
    python cli.py eval --merge out/hp_s0 out/hp_s1 out/hp_s2 out/hp_s3 out/hp_untrained --out out/hp
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval_suite.metrics import (
    HOTPOTQA_LEVELS,
    SCIENCEQA_BANDS,
    GroupedMetric,
    HotpotQAExactMatch,
    HotpotQAF1,
    OOFRate,
    RunMeanStd,
    ScienceQAAccuracy,
    aggregate_runs,
    exact_match_score,
    f1_score,
    parse_choice,
)
from eval_suite.report import fmt_mean_std, fmt_signed, markdown_table, write_json, write_text
from lragent.agents import AgentConfig, AgentLoop, Policy, format_question, get_spec
from lragent.agents.loop import ROLES
from lragent.schemes import SCHEMES

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
EPISODES_FILE = "episodes.jsonl"
UNTRAINED = "untrained"
BENCHMARK_LEVELS: dict[str, tuple[str, ...]] = {"hotpotqa": HOTPOTQA_LEVELS, "scienceqa": SCIENCEQA_BANDS}
ROLE_FIELDS: tuple[str, ...] = (
    "calls", "prefill_tokens", "decode_tokens", "prefill_s", "decode_s", "recomputed_tokens",
)  # fmt: skip
# Settings that must not change when a run is resumed into the same directory.
IDENTITY_FIELDS: tuple[str, ...] = (
    "benchmark", "model", "adapters", "dtype", "temperature", "seed", "agent", "droidspeak_layers",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------------ questions
@dataclass(frozen=True)
class Question:
    """One benchmark question.

    Attributes:
        qid: the benchmark's id (HotpotQA ``id``, ScienceQA ``pid``).
        level: HotpotQA level (``easy``/``medium``/``hard``) or ScienceQA grade band (``1-4``/``5-8``/``9-12``).
        text: the question as the prompt shows it (:func:`~lragent.agents.format_question`).
        gold: the gold answer (HotpotQA) or gold choice index (ScienceQA).
        choices: ScienceQA options (empty for HotpotQA).
        caption: ScienceQA image caption (None for HotpotQA).
        ocr: ScienceQA OCR field (None for HotpotQA).
    """

    qid: str
    level: str
    text: str
    gold: str | int
    choices: tuple[str, ...] = ()
    caption: str | None = None
    ocr: str | None = None


def parse_level(benchmark: str, level: str) -> str:
    """Canonical level name: ``easy``... for HotpotQA; ``1-4``... for ScienceQA (``grade1_4``, ``1_4`` accepted)."""
    allowed = BENCHMARK_LEVELS[benchmark]
    key = level.lower().removeprefix("grade").replace("_", "-")
    if key not in allowed:
        raise ValueError(f"unknown {benchmark} level {level!r}: allowed {', '.join(allowed)}")
    return key


def level_file(benchmark: str, level: str, data_dir: Path = DATA_DIR) -> Path:
    """The benchmark JSONL of one level (``hotpotqa_easy.jsonl``, ``scienceqa_grade1_4.jsonl``)."""
    stem = level if benchmark == "hotpotqa" else "grade" + level.replace("-", "_")
    return data_dir / "benchmarks" / f"{benchmark}_{stem}.jsonl"


def load_questions(
    benchmark: str, levels: Sequence[str] | None = None, limit: int | None = None, data_dir: Path = DATA_DIR
) -> list[Question]:
    """Questions of the chosen levels, interleaved (first of each level, then second of each, ...).

    Args:
        benchmark: ``hotpotqa`` or ``scienceqa``.
        levels: level names (default all three).
        limit: keep the first ``limit`` questions of the interleaved order (so every level is represented early).
        data_dir: the ``data`` directory.
    """
    if benchmark not in BENCHMARK_LEVELS:
        raise ValueError(f"unknown benchmark {benchmark!r}: allowed {', '.join(BENCHMARK_LEVELS)}")
    levels = [parse_level(benchmark, lv) for lv in (levels or BENCHMARK_LEVELS[benchmark])]
    per_level: list[list[Question]] = []
    for level in levels:
        path = level_file(benchmark, level, data_dir)
        if not path.is_file():
            raise FileNotFoundError(f"benchmark file {path} is missing")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if benchmark == "hotpotqa":
            qs = [Question(str(r["id"]), level, format_question(r["question"]), str(r["answer"])) for r in rows]
        else:
            qs = [
                Question(
                    str(r["pid"]),
                    level,
                    format_question(r["question"], r["choices"]),
                    int(r["answer"]),
                    tuple(r["choices"]),
                    r.get("caption"),
                    r.get("ocr"),
                )
                for r in rows
            ]
        per_level.append(qs)
    out = [lv[i] for i in range(max(map(len, per_level), default=0)) for lv in per_level if i < len(lv)]
    return out[:limit] if limit is not None else out


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard {spec!r} must look like i/n (e.g. 0/4)") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {spec!r}: need 0 <= i < n")
    return i, n


def episode_seed(base: int, run: int, qid: str) -> int:
    """Seed of one episode: a function of (base seed, run, question) only, the same for every scheme (paired)."""
    digest = hashlib.sha256(f"{base}:{run}:{qid}".encode()).hexdigest()
    return int(digest[:8], 16)


def default_toolbox_factory(benchmark: str, data_dir: Path = DATA_DIR) -> Callable[[Question], Any]:
    """A fresh :class:`~lragent.agents.Toolbox` per episode over the HotpotQA paragraphs (index built once)."""
    from lragent.agents import Toolbox, WikiIndex

    spec = get_spec(benchmark)
    index = WikiIndex.from_benchmarks(sorted((data_dir / "benchmarks").glob("hotpotqa_*.jsonl")))

    def make(q: Question) -> Toolbox:
        return Toolbox(index, caption=q.caption, ocr=q.ocr, search_error=spec.search_error)

    return make


# --------------------------------------------------------------------------------------------------- episodes log
def record_key(rec: dict) -> tuple[str, int, str]:
    """The resume/merge key of a record: (row, run, question id)."""
    return rec["row"], int(rec["run"]), str(rec["qid"])


def read_episodes(path: Path, repair: bool = False) -> list[dict]:
    """Records of an episodes JSONL file.

    A last line without its newline (a killed writer) is kept if it parses, otherwise dropped; with ``repair`` the
    file is cut back to its last complete line. A broken line before the last raises ``ValueError``.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: broken JSON line ({exc.msg}); fix or remove it") from None
    if tail.strip():
        try:
            records.append(json.loads(tail))
            if repair:
                with path.open("ab") as f:
                    f.write(b"\n")
        except json.JSONDecodeError:
            if repair:
                with path.open("r+b") as f:
                    f.truncate(len(data) - len(tail))
    return records


def score(q: Question, benchmark: str, prediction: str | None) -> dict:
    """Per-episode scores: HotpotQA ``em``/``f1``, ScienceQA ``correct``."""
    if benchmark == "hotpotqa":
        return {"em": exact_match_score(prediction, q.gold), "f1": f1_score(prediction, q.gold)}
    return {"correct": float(parse_choice(prediction, q.choices) == q.gold)}


def run_episodes(
    questions: Sequence[Question],
    schemes: Sequence[str],
    runs: int,
    policy_factory: Callable[[str, int], Policy],
    out_dir: str | Path,
    *,
    benchmark: str,
    adapters: str,
    seed: int = 0,
    agent_config: AgentConfig | None = None,
    toolbox_factory: Callable[[Question], Any] | None = None,
    max_episodes: int | None = None,
    progress: bool = True,
) -> list[dict]:
    """Runs every missing (row, run, question) episode and appends its record to ``out_dir/episodes.jsonl``.

    Args:
        questions: the questions (already limited / sharded).
        schemes: sharing schemes to run.
        runs: repetitions per question.
        policy_factory: ``(scheme, episode seed) -> Policy``; called once per episode.
        out_dir: output directory (created).
        benchmark: ``hotpotqa`` or ``scienceqa``.
        adapters: where the adapters came from (``DIR``, ``init:random``; ``init:zero`` makes the row ``untrained``).
        seed: base seed.
        agent_config: loop budgets.
        toolbox_factory: a fresh tool executor per question; default :func:`default_toolbox_factory`.
        max_episodes: stop after this many new episodes (None: all); for tests of resuming.
        progress: show a tqdm bar.

    Returns:
        every record in the file after the run.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / EPISODES_FILE
    done = {record_key(r) for r in read_episodes(path, repair=True)}
    spec = get_spec(benchmark)
    loop_config = agent_config or AgentConfig()
    untrained = adapters == "init:zero"
    todo = [
        (scheme, run, q)
        for scheme in schemes
        for run in range(runs)
        for q in questions
        if ((UNTRAINED if untrained else scheme), run, q.qid) not in done
    ]
    if max_episodes is not None:
        todo = todo[:max_episodes]
    if todo and toolbox_factory is None:
        toolbox_factory = default_toolbox_factory(benchmark)
    with path.open("a", encoding="utf-8") as f:
        for scheme, run, q in tqdm(todo, desc=f"eval {benchmark}", disable=not progress or not todo, unit="ep"):
            ep_seed = episode_seed(seed, run, q.qid)
            policy = policy_factory(scheme, ep_seed)
            result = AgentLoop(policy, spec, loop_config).run(q.text, toolbox_factory(q))
            rec = {
                "benchmark": benchmark,
                "qid": q.qid,
                "level": q.level,
                "row": UNTRAINED if untrained else scheme,
                "scheme": scheme,
                "adapters": adapters,
                "run": run,
                "seed": ep_seed,
                "prediction": result.answer,
                "candidate": result.candidate,
                "gold": q.gold,
                **({"choices": list(q.choices)} if q.choices else {}),
                **score(q, benchmark, result.answer),
                "oof": bool(result.oof),
                "stop_reason": result.stop_reason,
                "steps": result.cycles,
                "actions": [f"{st.action_type}[{st.argument}]" for st in result.steps],
                "num_tokens": result.num_tokens,
                "wall_s": result.wall_s,
                "roles": {r: {k: getattr(s, k) for k in ROLE_FIELDS} for r, s in result.role_stats.items()},
            }
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
    return read_episodes(path)


# -------------------------------------------------------------------------------------------------------- summary
def row_order(rows: Iterable[str]) -> list[str]:
    """``untrained`` first, then the schemes in their canonical order, then anything else alphabetically."""
    order = {name: i for i, name in enumerate((UNTRAINED, *SCHEMES))}
    return sorted(set(rows), key=lambda r: (order.get(r, len(order)), r))


def dedupe(records: Iterable[dict]) -> tuple[list[dict], int]:
    """One record per key (the first one), sorted by (row, run, level, qid); returns also the duplicates dropped."""
    seen: dict[tuple, dict] = {}
    dups = 0
    for rec in records:
        k = record_key(rec)
        if k in seen:
            dups += 1
            continue
        seen[k] = rec
    rank = {r: i for i, r in enumerate(row_order(k[0] for k in seen))}
    ordered = sorted(seen.values(), key=lambda r: (rank[r["row"]], int(r["run"]), r["level"], str(r["qid"])))
    return ordered, dups


def _mean_std(values: Sequence[float]) -> dict[str, float]:
    m = RunMeanStd()
    for v in values:
        m.update(v)
    out = m.compute()
    return {"mean": float(out["mean"]), "std": float(out["std"]), "runs": int(out["runs"])}


def summarize(records: Iterable[dict]) -> dict:
    """The summary of episode records (any order, duplicates dropped); see the module docstring.

    Returns:
        ``{"benchmark", "levels", "rows", "metrics", "episodes", "accuracy", "oof", "efficiency", "duplicates"}``;
        ``accuracy[metric][row][level | "avg"] = {"mean", "std", "runs"}`` (fractions), plus
        ``accuracy[metric][row]["diff_vs_non_shared"]`` (difference of the mean average).
    """
    recs, dups = dedupe(records)
    if not recs:
        raise ValueError("no episode records to summarise")
    benchmarks = sorted({r["benchmark"] for r in recs})
    if len(benchmarks) != 1:
        raise ValueError(f"records of several benchmarks {benchmarks}: summarise them separately")
    benchmark = benchmarks[0]
    all_levels = BENCHMARK_LEVELS[benchmark]
    levels = [lv for lv in all_levels if any(r["level"] == lv for r in recs)]
    rows = row_order(r["row"] for r in recs)
    for row in rows:
        sources = sorted({r["adapters"] for r in recs if r["row"] == row})
        if len(sources) > 1:
            raise ValueError(f"row {row!r} mixes results of different adapters {sources}: merge them separately")
    metrics = ("em", "f1") if benchmark == "hotpotqa" else ("accuracy",)
    makers = {
        "em": lambda: GroupedMetric(HotpotQAExactMatch(), all_levels),
        "f1": lambda: GroupedMetric(HotpotQAF1(), all_levels),
        "accuracy": lambda: GroupedMetric(ScienceQAAccuracy(), all_levels),
    }
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
                gm = makers[m]()
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

    def over_runs(values: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
        keys = [*levels, "avg"]
        return {k: _mean_std([v[k] for _, v in sorted(values.items()) if k in v]) for k in keys}

    accuracy = {m: {row: over_runs(per_run[m][row]) for row in rows} for m in metrics}
    for m in metrics:
        ref = accuracy[m].get("non_shared", {}).get("avg", {}).get("mean")
        for row in rows:
            accuracy[m][row]["diff_vs_non_shared"] = None if ref is None else accuracy[m][row]["avg"]["mean"] - ref
    oof = {row: over_runs(per_run["oof"][row]) for row in rows}
    return {
        "benchmark": benchmark,
        "levels": levels,
        "rows": rows,
        "metrics": list(metrics),
        "adapters": {row: next(r["adapters"] for r in recs if r["row"] == row) for row in rows},
        "episodes": episodes,
        "duplicates": dups,
        "accuracy": accuracy,
        "oof": oof,
        "efficiency": efficiency,
    }


METRIC_TITLES = {"em": "exact match", "f1": "F1", "accuracy": "accuracy"}


def render_markdown(summary: dict) -> str:
    """Markdown report: accuracy tables (Table 3 layout), the OOF table (Table 16 layout), efficiency tables."""
    levels, rows = summary["levels"], summary["rows"]
    level_cols = [lv.capitalize() if summary["benchmark"] == "hotpotqa" else f"Grade {lv}" for lv in levels]
    parts = [f"# {summary['benchmark']} evaluation\n"]
    counts = ", ".join(f"{row}: {sum(n.values())} episodes / {len(n)} run(s)" for row, n in summary["episodes"].items())
    parts.append(f"Mean ± std over runs, in %. {counts}.\n")
    for m in summary["metrics"]:
        parts.append(f"\n## Accuracy ({METRIC_TITLES[m]}), Table 3 layout\n\n")
        body = []
        for row in rows:
            cell = summary["accuracy"][m][row]
            vals = [fmt_mean_std(cell[lv]["mean"], cell[lv]["std"]) for lv in [*levels, "avg"]]
            body.append([row, *vals, fmt_signed(cell["diff_vs_non_shared"])])
        parts.append(markdown_table(["Scheme", *level_cols, "Avg", "Δ vs non_shared"], body))
    parts.append("\n## Out-of-function rate, Table 16 layout\n\n")
    body = []
    for row in rows:
        cell = summary["oof"][row]
        body.append([row, *[fmt_mean_std(cell[lv]["mean"], cell[lv]["std"]) for lv in [*levels, "avg"]]])
    parts.append(markdown_table(["Scheme", *level_cols, "Avg"], body))
    parts.append("\n## Per question: sequence length and cycles\n\n")
    eff = summary["efficiency"]
    body = [
        [row, fmt_mean_std(eff[row]["num_tokens"]["mean"], eff[row]["num_tokens"]["std"], 1.0),
         fmt_mean_std(eff[row]["steps"]["mean"], eff[row]["steps"]["std"], 1.0, 2)]
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


def write_summary(records: Iterable[dict], out_dir: str | Path) -> dict:
    """Writes ``summary.json`` and ``report.md`` into ``out_dir``; returns the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    write_json(out / "summary.json", summary)
    write_text(out / "report.md", render_markdown(summary))
    return summary


def merge_dirs(dirs: Sequence[str | Path], out_dir: str | Path) -> dict:
    """Summarises the episodes of several output directories (shards, untrained row) into ``out_dir``."""
    records: list[dict] = []
    for d in dirs:
        path = Path(d) / EPISODES_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--merge {d}: no {EPISODES_FILE} there")
        records += read_episodes(path)
    return write_summary(records, out_dir)


# ------------------------------------------------------------------------------------------------------------ CLI
def load_droidspeak_config(path: str | Path) -> list[int]:
    """The ``droidspeak_layers`` list of a JSON or YAML config (as :mod:`eval_suite.droidspeak_select` writes)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--droidspeak-config {path}: no such file")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        cfg = yaml.safe_load(text)
    else:
        cfg = json.loads(text)
    layers = cfg.get("droidspeak_layers") if isinstance(cfg, dict) else None
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise ValueError(f"--droidspeak-config {path}: expected a non-empty integer list 'droidspeak_layers'")
    return layers


def make_parser() -> argparse.ArgumentParser:
    from eval_suite.session_runner import add_model_args

    p = argparse.ArgumentParser(prog="cli.py eval", description=__doc__.splitlines()[0])
    p.add_argument("--benchmark", default="hotpotqa", help="hotpotqa or scienceqa")
    p.add_argument("--levels", nargs="+", default=None, help="easy medium hard / 1-4 5-8 9-12 (default all three)")
    p.add_argument("--scheme", default="all", help=f"one of {', '.join(SCHEMES)}, a comma list, or all")
    add_model_args(p)
    p.add_argument("--runs", type=int, default=1, help="repetitions per question (mean ± std over runs)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="base seed (adapter init and per-episode sampling seeds)")
    p.add_argument("--limit", type=int, default=None, help="first K questions of the interleaved level order")
    p.add_argument("--out", default="eval_out", help="output directory")
    p.add_argument("--shard", default="0/1", help="i/n: this process takes every n-th question starting at i")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR", help="summarise these output dirs into --out")
    p.add_argument("--device", default=None, help="cpu or cuda (default cuda when available)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-kernel", action="store_true", help="use the PyTorch attention path even on CUDA")
    p.add_argument("--max-steps", type=int, default=15, help="agent cycles before an episode is out of function")
    p.add_argument("--thought-tokens", type=int, default=AgentConfig.thought_tokens)
    p.add_argument("--argument-tokens", type=int, default=AgentConfig.argument_tokens)
    p.add_argument("--max-context-tokens", type=int, default=None, help="episode is OOF past this many tokens")
    p.add_argument("--droidspeak-config", default=None, help="JSON/YAML with droidspeak_layers (droidspeak_select)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def parse_schemes(spec: str) -> list[str]:
    """``all`` or a comma list of scheme names (validated)."""
    names = list(SCHEMES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEMES]
    if bad or not names:
        raise ValueError(f"--scheme {spec!r}: unknown {bad or 'nothing'}; allowed {', '.join(SCHEMES)} or all")
    return names


def _adapters_label(args: argparse.Namespace) -> str:
    return str(Path(args.adapters).resolve()) if args.adapters else f"init:{args.adapter_init}"


def validate(args: argparse.Namespace) -> list[str]:
    """Checks the arguments; returns the schemes to run. Raises ValueError / FileNotFoundError (one line)."""
    from eval_suite.session_runner import validate_model_args

    if args.merge is not None:
        return []
    if args.benchmark not in BENCHMARK_LEVELS:
        raise ValueError(f"unknown benchmark {args.benchmark!r}: allowed {', '.join(BENCHMARK_LEVELS)}")
    for lv in args.levels or ():
        parse_level(args.benchmark, lv)
    schemes = parse_schemes(args.scheme)
    validate_model_args(args, exactly_one=True)
    if args.adapter_init == "zero":
        if args.scheme not in ("all", "non_shared"):
            raise ValueError("--adapter-init zero is the untrained row: B = 0 makes every scheme equal non_shared")
        schemes = ["non_shared"]
    for name in ("runs", "max_steps", "thought_tokens", "argument_tokens", "rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    parse_shard(args.shard)
    return schemes


def build_policy_factory(args: argparse.Namespace) -> Callable[[str, int], Policy]:
    """Loads the model and adapters once; returns ``(scheme, seed) -> SessionPolicy``."""
    from eval_suite.session_runner import model_from_args
    from lragent.agents import SessionPolicy

    model, tokenizer = model_from_args(args)
    layers = load_droidspeak_config(args.droidspeak_config) if args.droidspeak_config else None

    def factory(scheme: str, seed: int) -> Policy:
        kwargs: dict[str, Any] = {"use_kernel": not args.no_kernel}
        if scheme == "droidspeak" and layers is not None:
            kwargs["droidspeak_layers"] = layers
        return SessionPolicy(
            model, tokenizer, scheme=scheme, temperature=args.temperature, seed=seed, session_kwargs=kwargs
        )

    return factory


def check_run_config(out: Path, config: dict) -> None:
    """Writes ``run_config.json``, or checks that a resumed run keeps the settings the directory was run with."""
    path = out / "run_config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in IDENTITY_FIELDS if old.get(k) != config.get(k)]
        if diff:
            detail = ", ".join(f"{k}: {old.get(k)!r} -> {config.get(k)!r}" for k in diff)
            raise ValueError(f"{out} holds a run with other settings ({detail}); use another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, config)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        schemes = validate(args)
        out = Path(args.out)
        if args.merge is not None:
            summary = merge_dirs(args.merge, out)
        else:
            questions = load_questions(args.benchmark, args.levels, args.limit)
            i, n = parse_shard(args.shard)
            questions = questions[i::n]
            agent = AgentConfig(
                max_steps=args.max_steps,
                thought_tokens=args.thought_tokens,
                argument_tokens=args.argument_tokens,
                max_context_tokens=args.max_context_tokens,
            )
            layers = load_droidspeak_config(args.droidspeak_config) if args.droidspeak_config else None
            config = {
                "benchmark": args.benchmark, "model": args.model, "adapters": _adapters_label(args),
                "dtype": args.dtype, "temperature": args.temperature, "seed": args.seed,
                "agent": vars(agent), "droidspeak_layers": layers, "schemes": schemes, "runs": args.runs,
                "levels": args.levels, "limit": args.limit, "shard": args.shard, "questions": len(questions),
            }  # fmt: skip
            check_run_config(out, config)
            factory = build_policy_factory(args)
            records = run_episodes(
                questions, schemes, args.runs, factory, out, benchmark=args.benchmark, adapters=config["adapters"],
                seed=args.seed, agent_config=agent, progress=not args.quiet,
            )  # fmt: skip
            summary = write_summary(records, out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = summary["metrics"][0]
    for row in summary["rows"]:
        acc, oof = summary["accuracy"][m][row]["avg"], summary["oof"][row]["avg"]
        print(f"{row}: {m} {fmt_mean_std(acc['mean'], acc['std'])} OOF {fmt_mean_std(oof['mean'], oof['std'])}")
    print(f"-> {out / 'summary.json'}, {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
