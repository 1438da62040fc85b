"""`python cli.py eval`: multi-agent accuracy of the sharing schemes on HotpotQA / ScienceQA (paper Tables 3, 15, 16).

For every (row, run, question) one AutoAct episode runs (:class:`~lragent.agents.AgentLoop`, plan → plan → action,
two-stage reflect, offline tools) through an :class:`~eval_suite.evaluate.executors.EpisodeExecutor`, and its record is
appended to ``OUT/episodes.jsonl`` as soon as it comes back (:mod:`eval_suite.evaluate.episode_log`). A row is a
scheme, or
``untrained`` for the base model (``--adapter_init zero``: B = 0, so every scheme is the base model and one row is
enough); with ``--constrain`` the rows are named ``scheme+constrained`` (``scheme+answer_text`` for the option-text
choice of ScienceQA's ``Finish``) and never mix with unconstrained ones.

**Protocol** (as LRAgent's evaluation): sampling at temperature 0.9 with nucleus top-p 0.75, three runs, one seed
per run: episode seeds are a function of (base seed, run, question), the same for every scheme (paired). Greedy
decoding is ``--temperature 0``. Constrained choices (``--constrain``) are an option, off by default.

An interrupted run resumes (finished records are read back, a torn last line is repaired, nothing is redone or
duplicated). The output directory is locked while a run writes to it. ``--shard i/n`` takes every n-th question
(one ``--out`` per shard), or with ``--work_queue DIR`` the next episode no shard has taken (``--devices N`` runs
its shards so, :mod:`eval_suite.evaluate.work_queue`); ``--merge [DIR,...]`` summarises several output directories
together (:mod:`eval_suite.evaluate.eval_report`).

Usage::

    python cli.py eval --benchmark hotpotqa --scheme all --runs 3 --out out/hp     # trained shared-A adapters
    python cli.py eval --benchmark hotpotqa --adapter_init zero --out out/hp_untrained
    python cli.py eval --benchmark scienceqa --constrain all --out out/sq_constrained
    python cli.py eval ... --shard 0/4 --out out/hp_s0     # one process per shard, then:
    python cli.py eval --merge [out/hp_s0,out/hp_s1,out/hp_s2,out/hp_s3,out/hp_untrained] --out out/hp
    python cli.py eval ... --devices 4 --out out/hp         # four GPUs, one queue of episodes, merged into out/hp
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eval_suite.evaluate.benchmarks import (
    DATA_DIR,
    SPLITS,
    Benchmark,
    Question,
    answer_score,
    get_benchmark,
    parse_constraints,
    row_name,
)
from eval_suite.evaluate.dir_lock import DirectoryLock
from eval_suite.evaluate.episode_log import EPISODES_FILE, ROLE_FIELDS, UNTRAINED, EpisodeLog, read_episodes, record_key
from eval_suite.evaluate.eval_timing import EvalTiming
from eval_suite.evaluate.executors import EpisodeExecutor, EpisodeTask, SequentialExecutor
from eval_suite.evaluate.shard_launch import (
    BENCHMARK_FIELD,
    adopt_early,
    benchmark_list,
    process_age_s,
    spawn_shards,
    stop_processes,
)
from eval_suite.evaluate.stall_watchdog import StallWatchdog, stall_seconds
from eval_suite.evaluate.work_queue import WorkQueue, sibling_logs
from eval_suite.report import fmt_over_runs, write_json
from lragent.agents import CYCLE_RESERVE_TOKENS, AgentConfig, AgentLoop, EpisodeResult, Policy, context_bound
from lragent.agents.policies import check_sampling
from lragent.device_share import allocation_lock, apply_memory_fraction, check_memory_fraction, is_oom, oom_line
from lragent.host_threads import host_threads
from lragent.loading import check_model_args, load_lora_model, resolve_device
from lragent.loading import read_droidspeak_config as load_droidspeak_config
from lragent.lora_model import MultiLoraModel
from lragent.memory_plan import MAX_AUTO_BATCH, choose_batch
from lragent.roles import DEFAULT_ROLES
from lragent.sampling import SAMPLER_VERSION, recorded_sampler
from lragent.schemes import Scheme, parse_schemes

# Settings that must not change when a run is resumed into the same directory.
IDENTITY_FIELDS: tuple[str, ...] = (
    "benchmark", "model", "adapters", "dtype", "temperature", "top_p", "constraints", "answer_score", "corpus_files",
    "seed", "agent", "droidspeak_layers", "sampler", "split",
)  # fmt: skip
UNRECORDED = {
    "sampler": recorded_sampler({}),
    "split": ["dev"],
}  # what a field not in an older run_config.json / record means
UPSTREAM_TEMPERATURE = 0.9
UPSTREAM_TOP_P = 0.75
# The scheme of ``eval --limit N`` without --scheme: a quick look runs LRAgent's own scheme, not all five.
DEFAULT_QUICK_SCHEME = "base_lr_shared"


def _cli_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


class _ShardProgress:
    """Episodes the shards of ``eval --devices N`` have finished, read from their episode logs as they grow (one line
    an episode, flushed as it ends), on one tqdm bar in the launching process."""

    def __init__(self, logs: list[Path], total: int, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.logs, self.offsets = logs, [0] * len(logs)
        self.done = self._read()
        self.bar = tqdm(total=total, initial=min(self.done, total), desc=desc, unit="ep", disable=not enabled)

    def _read(self) -> int:
        new = 0
        for i, path in enumerate(self.logs):
            try:
                with path.open("rb") as f:
                    f.seek(self.offsets[i])
                    chunk = f.read()
            except OSError:  # not written yet
                continue
            self.offsets[i] += len(chunk)
            new += chunk.count(b"\n")  # a line still being written counts once its newline is there
        return new

    def update(self) -> None:
        new = self._read()
        self.done += new
        self.bar.update(max(0, min(new, self.bar.total - self.bar.n)))

    def close(self) -> None:
        self.update()
        self.bar.close()


def _last_line(log: Path) -> str:
    """A shard log's last non-empty line (its one-line error), or a note that there is none."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "no output"


def fan_out(
    call: dict[str, Any], n: int, out_dir: Path, total: int | None = None, benchmarks: Sequence[str] = ()
) -> int:
    """``eval --devices N``: N ``eval --shard i/N`` processes at once (one per GPU, or N CPU processes), each into
    ``OUT/shard_i`` with its log in ``OUT/shard_i.log``, then ``--merge`` of the shards into ``OUT``. Re-running resumes
    every shard (their episode logs are resumable). Shards the console entry started early from the raw command line
    (:mod:`eval_suite.evaluate.shard_launch`) are adopted when they are these. ``OUT/launch.json`` records where the
    wall time
    went: this process's own start before the shards ran, each shard process's wall seconds, and the merge. Unless
    ``--quiet``, a progress bar counts the episodes the shards have finished, out of ``total``. When a shard fails, the
    others are stopped at once (the merge needs them all; every finished episode is kept) and the failure is named by
    its log's last line. With several ``benchmarks`` each shard process runs them all in turn, into
    ``OUT/<benchmark>/shard_i``, and each benchmark's shards are merged into ``OUT/<benchmark>``."""
    import inspect

    started, age = time.perf_counter(), process_age_s()
    import torch

    from lragent.command import on_interrupt
    from lragent.provenance import provenance

    gpus = torch.cuda.device_count() if call["device"] in (None, "cuda") else 0
    several = list(benchmarks) if len(benchmarks) > 1 else []
    early = adopt_early(n, out_dir, gpus, call["device"], several)
    if call["device"] in (None, "cuda") and 0 < gpus < n:
        raise ValueError(f"--devices {n} but this machine has {gpus} GPU(s): allowed at most {gpus}")
    if early is not None:
        procs, logs, spawned, age = early.procs, early.logs, early.spawned_at, early.startup_s
        started = spawned
    else:
        defaults = {k: p.default for k, p in inspect.signature(evaluate).parameters.items()}
        args: list[str] = []
        for key, value in call.items():
            if (
                key in ("devices", "shard", "work_queue", "out", "device", "merge", "quiet")
                or value is None
                or value == defaults[key]
            ):
                continue
            args += [f"--{key}", _cli_value(value)]
        procs, logs, lines = spawn_shards(n, out_dir, args, gpus, call["device"], os.environ, several)
        spawned = time.perf_counter()
        print("\n".join(lines), file=sys.stderr)
    # each benchmark's merged folder and its shards' folders (one benchmark: OUT and OUT/shard_i)
    merged = {b: out_dir / b for b in several} or {"": out_dir}
    shard_dirs = {b: [m / f"shard_{i}" for i in range(n)] for b, m in merged.items()}
    named = ",".join(several) or call["benchmark"]
    progress = _ShardProgress([d / EPISODES_FILE for ds in shard_dirs.values() for d in ds], total or 0,
                              f"eval {named} ({n} shards)", enabled=bool(total) and not call["quiet"])  # fmt: skip
    where = f"{out_dir}/*/shard_*" if several else f"{out_dir}/shard_*"
    on_interrupt(f"the shards' finished episodes are in {where}/{EPISODES_FILE}; rerun the same command to resume")
    walls: dict[int, float] = {}
    polls = 0
    stopped: list[int] = []
    try:
        while len(walls) < n:  # polled, so that each shard's own end time is known
            for i, proc in enumerate(procs):
                if i not in walls and proc.poll() is not None:
                    walls[i] = time.perf_counter() - spawned
                    logs[i].close()
                    if proc.returncode != 0 and not stopped:  # a shard failed: the merge cannot run, stop the rest
                        stopped = [j for j, other in enumerate(procs) if j not in walls and other.poll() is None]
                        for j in stopped:
                            procs[j].terminate()
            polls += 1
            if polls % 10 == 0:  # the bar about once a second
                progress.update()
            time.sleep(0.1)
    except KeyboardInterrupt:  # Ctrl-C reaches the shards too; a launcher stopped otherwise leaves none behind
        stop_processes(procs)
        raise
    finally:
        progress.close()
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0 and i not in stopped]
    if failed:
        for i in failed:
            log = out_dir / f"shard_{i}.log"
            print(f"error: shard {i}/{n} failed: {_last_line(log)} (log: {log})", file=sys.stderr)
        others = f"; stopped shard(s) {stopped}" if stopped else ""
        print(f"eval: finished episodes are kept{others}: rerun the same command to resume", file=sys.stderr)
        return 1
    from eval_suite.evaluate.eval_report import merge_dirs  # the summary's metrics: imported where a summary is written

    summaries = {}
    for b, folder in merged.items():
        with DirectoryLock(folder):
            summaries[b] = merge_dirs([str(d) for d in shard_dirs[b]], folder, provenance(dtype=call["dtype"]))
    write_json(out_dir / LAUNCH_FILE, {
        "devices": n, "early": early is not None, "startup_s": age, "launch_s": spawned - started,
        "shard_wall_s": [walls[i] for i in range(n)], "merge_s": time.perf_counter() - spawned - max(walls.values()),
        **({"benchmarks": several} if several else {}),
    })  # fmt: skip
    for b, summary in summaries.items():
        _print_summary(summary, merged[b], b)  # b is "" for one benchmark: its lines as before
    return 0


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


def check_run_config(out: Path, config: dict) -> None:
    """Writes ``run_config.json``, or checks that a resumed run keeps the settings the directory was run with."""
    path = out / "run_config.json"
    if path.is_file():
        old = json.loads(path.read_text())
        was = {k: old.get(k, UNRECORDED.get(k)) for k in IDENTITY_FIELDS}
        diff = [k for k in IDENTITY_FIELDS if was[k] != config.get(k, UNRECORDED.get(k))]
        if diff:
            detail = ", ".join(f"{k}: {was[k]!r} -> {config.get(k)!r}" for k in diff)
            raise ValueError(f"{out} holds a run with other settings ({detail}); use another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, config)


# ------------------------------------------------------------------------------------------------------ runner
def episode_record(
    task: EpisodeTask,
    result: EpisodeResult,
    bench: Benchmark,
    *,
    adapters: str,
    protocol: dict,
    provenance: dict | None,
) -> dict:
    """The episode-log record of one finished episode."""
    q = task.question
    row, run, _ = task.key
    return {
        "benchmark": bench.name,
        "qid": q.qid,
        "level": q.level,
        "split": q.split,
        "row": row,
        "scheme": str(task.scheme),
        "adapters": adapters,
        "run": run,
        "seed": task.seed,
        "protocol": protocol,
        "prediction": result.answer,
        "candidate": result.candidate,
        "gold": q.gold,
        **({"choices": list(q.choices)} if q.choices else {}),
        **bench.score(q, result.answer),
        "oof": bool(result.oof),
        "stop_reason": result.stop_reason,
        "steps": result.cycles,
        "constrained_calls": result.constrained_calls,
        "actions": [f"{st.action_type}[{st.argument}]" for st in result.steps],
        "thoughts": [st.thought.strip() for st in result.steps],  # what each cycle reasoned, to read why it acted
        "num_tokens": result.num_tokens,
        "wall_s": result.wall_s,
        "roles": {r: {k: getattr(s, k) for k in ROLE_FIELDS} for r, s in result.role_stats.items()},
        **({"provenance": provenance} if provenance is not None else {}),
    }


def run_episodes(
    questions: Sequence[Question],
    schemes: Sequence[Scheme],
    runs: int,
    executor: EpisodeExecutor,
    out_dir: str | Path,
    *,
    benchmark: str,
    adapters: str,
    seed: int = 0,
    agent_config: AgentConfig | None = None,
    toolbox_factory: Callable[[Question], Any] | None = None,
    constraints: Sequence[str] = (),
    temperature: float | None = None,
    top_p: float | None = None,
    max_episodes: int | None = None,
    progress: bool = True,
    provenance: dict | None = None,
    work_queue: WorkQueue | None = None,
    done_elsewhere: Collection[tuple[str, int, str]] = (),
    on_record: Callable[[], None] | None = None,
) -> list[dict]:
    """Runs every missing (row, run, question) episode and appends its record to ``out_dir/episodes.jsonl``.

    The caller holds the directory's lock (:class:`~eval_suite.evaluate.dir_lock.DirectoryLock`) when other processes
    could write there.

    Args:
        questions: the questions (already limited / sharded).
        schemes: sharing schemes to run.
        runs: repetitions per question.
        executor: runs the episodes (e.g. ``SequentialExecutor(build_policy_factory(...))``); results may come in any
            order.
        out_dir: output directory (created).
        benchmark: ``hotpotqa`` or ``scienceqa``.
        adapters: where the adapters came from (``DIR``, ``init:random``; ``init:zero`` makes the row ``untrained``).
        seed: base seed.
        agent_config: loop budgets.
        toolbox_factory: a fresh tool executor per question; default the benchmark's
            (:meth:`~eval_suite.evaluate.benchmarks.Benchmark.toolbox_factory`).
        constraints: constrained choices (:data:`~eval_suite.evaluate.benchmarks.CONSTRAINTS`); rows get a
        ``+constrained``
            suffix (``+answer_text`` with the option-text choice, whose ranking is recorded as the protocol's
            ``answer_score``).
        temperature: decoding temperature the executor's policies use (recorded in every record).
        top_p: nucleus mass they use (recorded).
        max_episodes: stop after this many new episodes (None: all); for tests of resuming.
        progress: show a tqdm bar (total: questions × runs × rows; OOF so far in the postfix).
        provenance: recorded in every record.
        work_queue: a queue shared with other processes (``eval --devices N``'s shards): an episode runs here only if
            this process claims it first, when a row is free for it (:mod:`eval_suite.evaluate.work_queue`).
        done_elsewhere: keys of episodes that another process of the queue already holds in its log (an earlier,
            interrupted launch): not run again.
        on_record: called after each appended record (``run_plan`` rewrites ``timing.json`` there).

    Returns:
        every record in the file after the run.
    """
    from tqdm.auto import tqdm

    bench = get_benchmark(benchmark)
    cons = parse_constraints(list(constraints))
    bench.check_constraints(cons)
    text_score = answer_score(cons)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / EPISODES_FILE
    loop = AgentLoop(None, bench.spec, agent_config or AgentConfig())
    base_row = UNTRAINED if adapters == "init:zero" else None
    protocol = {"temperature": temperature, "top_p": top_p, "constraints": list(cons), "sampler": SAMPLER_VERSION}
    if text_score is not None:  # recorded only where it applies: letter-constrained records stay as they were
        protocol["answer_score"] = text_score
    grid = [(row_name(base_row or str(s), cons), s, run, q) for s in schemes for run in range(runs) for q in questions]
    keys = {(row, run, q.qid) for row, _, run, q in grid}
    with EpisodeLog(path) as log:
        done = {record_key(r): bool(r["oof"]) for r in log.records if record_key(r) in keys}
        skip = done.keys() | set(done_elsewhere)  # finished here, or by another process of the queue
        todo = [g for g in grid if (g[0], g[2], g[3].qid) not in skip]
        if max_episodes is not None:
            todo = todo[:max_episodes]
        if todo and toolbox_factory is None:
            pool = [sp for sp in SPLITS if any(q.split == sp for q in questions)]  # the questions' own world
            toolbox_factory = bench.toolbox_factory(splits=pool)[0]

        def tasks() -> Iterator[EpisodeTask]:
            for row, scheme, run, q in todo:
                action_types, answer_options = bench.constraint_options(q, cons)
                episode = loop.episode(
                    q.text,
                    toolbox_factory(q),
                    action_types=action_types,
                    answer_options=answer_options,
                    answer_texts=bench.answer_texts(q, cons),
                    answer_score=text_score or "sum",
                )
                key = (row, run, q.qid)
                claim = (lambda key=key: work_queue.claim(key)) if work_queue is not None else None
                yield EpisodeTask(key, scheme, episode_seed(seed, run, q.qid), q, episode, claim)

        oof = sum(done.values())
        bar = tqdm(
            total=len(grid),
            initial=len(keys & skip),
            desc=f"eval {benchmark}",
            unit="ep",
            disable=not progress or not todo,
        )
        with bar:
            for task, result in executor.run(tasks()):
                rec = episode_record(task, result, bench, adapters=adapters, protocol=protocol, provenance=provenance)
                log.append(rec)
                done[task.key] = bool(result.oof)
                oof += bool(result.oof)
                bar.update(1)
                bar.set_postfix(oof=f"{oof}/{len(done)}")
                if on_record is not None:
                    on_record()
    return read_episodes(path)


# ----------------------------------------------------------------------------------------------------- command
def _as_list(value: Sequence[str] | str | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def default_adapters(benchmark: str, data_dir: Path | None = None, model: str = "default") -> Path:
    """The shipped trained shared-A adapters of a benchmark for ``model``: ``data/adapters/{benchmark}_sharedA`` (the
    embedded model) or ``data/adapters/qwen_{benchmark}_sharedA`` (the accuracy model)."""
    from lragent.accuracy_model import NAMES as ACCURACY_NAMES

    prefix = "qwen_" if model.lower() in ACCURACY_NAMES else ""
    return (data_dir or DATA_DIR) / "adapters" / f"{prefix}{benchmark}_sharedA"


def build_policy_factory(
    model: MultiLoraModel,
    tokenizer: Any,
    *,
    temperature: float,
    top_p: float,
    use_kernel: bool,
    droidspeak_layers: list[int] | None,
) -> Callable[[EpisodeTask], Policy]:
    """``task -> SessionPolicy`` over one model with its adapters (loaded once by the caller): each episode runs on a
    fresh :class:`~lragent.session.MultiAgentSession` under the task's scheme (the ``Scheme`` parsed from
    ``--scheme``), opened here, so the scheme goes from this command to the session directly."""
    from lragent.agents import SessionPolicy
    from lragent.session import MultiAgentSession

    def factory(task: EpisodeTask) -> Policy:
        scheme = task.scheme

        def new_session() -> MultiAgentSession:
            return MultiAgentSession(
                model, scheme, tokenizer=tokenizer, use_kernel=use_kernel, droidspeak_layers=droidspeak_layers
            )

        return SessionPolicy(new_session, temperature=temperature, top_p=top_p, seed=task.seed)

    return factory


def evaluate(
    benchmark: str | list[str] = "hotpotqa",
    scheme: str | None = None,
    levels: list[str] | str | None = None,
    split: str | list[str] = "dev",
    limit: int | None = None,
    runs: int = 3,
    temperature: float = UPSTREAM_TEMPERATURE,
    top_p: float = UPSTREAM_TOP_P,
    seed: int = 0,
    constrain: str = "none",
    corpus: list[str] | str | None = None,
    model: str = "default",
    adapters: str | None = None,
    adapter_init: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    dtype: str = "float32",
    device: str | None = None,
    use_kernel: bool = True,
    droidspeak_config: str | None = None,
    max_steps: int = 15,
    thought_tokens: int = AgentConfig.thought_tokens,
    argument_tokens: int = AgentConfig.argument_tokens,
    max_context_tokens: int | None = None,
    out: str = "eval_out",
    shard: str = "0/1",
    work_queue: str | None = None,
    merge: list[str] | str | None = None,
    batch: int | Literal["auto"] = 0,
    capacity: int = 8192,
    cuda_graphs: bool = True,
    prefill_in_decode: int | None = None,
    feed_budget: int | None = None,
    batch_invariant: bool = False,
    concurrent_schemes: bool = False,
    launch_ahead: bool = False,
    devices: int = 1,
    memory_fraction: float | None = None,
    stall_s: float | None = None,
    quiet: bool = False,
    server: str | None = None,
) -> int:
    """Multi-agent accuracy of the cache sharing schemes on HotpotQA or ScienceQA (paper Tables 3, 15 and 16).

    Runs one AutoAct episode per (row, run, question), appends each to OUT/episodes.jsonl as it finishes (an
    interrupted run resumes), then writes OUT/summary.json and OUT/report.md. Sampling as LRAgent's evaluation
    (temperature 0.9, top-p 0.75, 3 runs, one seed per run). Without --adapters or --adapter_init the benchmark's
    trained shared-A adapters in data/adapters/{benchmark}_sharedA are used (qwen_{benchmark}_sharedA for --model
    qwen2.5-coder-1.5b).

    Args:
        benchmark: hotpotqa or scienceqa, or several as a comma list or [a,b]: one process runs them in turn (its
            start paid once), each into OUT/<benchmark> (or where --out's {benchmark} says), each with its own
            adapters (--adapters DIR/{benchmark}_sharedA, or the defaults); with --devices N every shard runs them
            all in turn, so a shard whose rows empty on one benchmark starts the next while the others finish.
        scheme: a sharing scheme (non_shared, full_shared, droidspeak, base_shared, base_lr_shared), a comma list,
            or all. Default: all (the five rows of the paper's table); with --limit (a quick look) base_lr_shared
            only, LRAgent's scheme, so --limit N runs N x runs episodes, not five times that.
        levels: levels to run: easy, medium, hard (HotpotQA) or 1-4, 5-8, 9-12 (ScienceQA); a comma list or
            [a,b]; default all three.
        split: question split(s): dev (default; choose recipes and settings here), test (the rest of the paper's
            test sets: 300 HotpotQA / 360 ScienceQA questions with dev; report on it, choose nothing by it), extra
            (ScienceQA only: 1,412 more unseen questions, for statistical power), or a comma list run as one pool,
            split by split. The search tools' corpus is the pool's (HotpotQA: its questions' paragraphs). Every
            record and run_config.json name the split.
        limit: run only the first LIMIT questions of the pool (split by split, levels interleaved).
        runs: repetitions per question (mean ± std and a 95% interval over runs).
        temperature: sampling temperature (0: greedy decoding).
        top_p: nucleus sampling mass in (0, 1].
        seed: base seed: adapter init and the per-episode sampling seeds (a function of seed, run and question).
        constrain: constrained choices, off by default: none, all, or a comma list of action_type (choose the
            action type among the valid ones) and answer (choose the Finish argument among the option letters on
            ScienceQA, yes/no for HotpotQA judgement questions), or answer_text instead of answer (ScienceQA only:
            the Finish letter chosen by scoring each option's text, by mean token log-prob; the letter is the
            answer). Constrained rows are named scheme+constrained (all), scheme+constrained:LIST (some), or
            scheme+answer_text (scheme+action_type,answer_text with action_type).
        corpus: extra JSONL corpus file(s) of {"title", "text"} passages the search tools also index.
        model: base model: default (embedded SmolLM2-135M-Instruct), a hub name or a local directory.
        adapters: adapter directory (native checkpoint or PEFT role directories); default
            data/adapters/{benchmark}_sharedA (data/adapters/qwen_{benchmark}_sharedA for the accuracy model).
        adapter_init: instead of trained adapters: zero (the untrained row) or random (a demo).
        rank: LoRA rank for --adapter_init.
        alpha: LoRA alpha for --adapter_init.
        dtype: compute dtype (float32, bfloat16, float16).
        device: cpu or cuda (default cuda when available).
        use_kernel: use the fused Flash-LoRA-Attention kernel on CUDA (false: the PyTorch attention path).
        droidspeak_config: JSON/YAML with droidspeak_layers (as droidspeak-select writes).
        max_steps: agent cycles before an episode is out of function.
        thought_tokens: generation budget of a thought.
        argument_tokens: generation budget of an action argument.
        max_context_tokens: an episode is out of function past this many trajectory tokens (default: no limit; with
            --batch, capacity - 2048; with --server, the server's context + 1 - 2048, from its /v1/models).
        out: output directory (locked while this run writes to it).
        shard: i/n: this process takes every n-th question starting at i (give each shard its own --out).
        work_queue: with --shard, a folder shared by the shards (empty at their start; e.g. on a filesystem several
            machines see): instead of every n-th question each shard takes the next episode no shard has taken,
            when it has a free row, so all end together; --out must be a shard_i folder beside the others', whose
            finished episodes are not run again. --devices N does this itself (OUT/queue).
        merge: output directories to summarise together into --out (nothing is run).
        batch: episodes run at once on one engine (continuous refill; CUDA-graph decoding on a GPU); 0 runs them
            one after another through the session API; auto: the largest batch whose caches and workspace fit in
            what is free once the model is loaded (sized under a lock per GPU, so processes starting together size
            one after another; an explicit batch that does not fit is refused before the model loads). Out of
            memory during the run halves the batch and goes on, keeping every finished episode.
        capacity: cache positions per episode with --batch (episodes stop as out of function before they outgrow
            it: --max_context_tokens defaults to capacity - 2048 there).
        cuda_graphs: decode with CUDA graphs on a GPU (false: eager, for debugging).
        prefill_in_decode: with --batch, agent calls that append at most this many tokens feed them through the
            batched decode step (all rows together) instead of prefilling their row alone; default 2048 on a GPU
            (the prompts too), 0 (off) on the CPU.
        feed_budget: with --prefill_in_decode, extra token rows per decode step for the fed text, lent in row
            order to the rows that feed: a call's new text then goes through in a few steps instead of one per
            token; default 256 on a GPU (with the prompts fed, an H100's HotpotQA episode loop 1.95x shorter than
            at 128 and 0), 0 on the CPU (exact there at any value). In bf16 other records than 0's: --prefill_in_decode
            128 --feed_budget 0 gives the records of runs before 2026-11-27.
        batch_invariant: with --batch, decode every step at the full batch width (idle rows masked) and size the
            engine to --batch even for fewer episodes: an episode's tokens then depend on its own inputs only, not
            on how many others run beside it (GPU kernels sum in an order chosen by the batch width), so --devices
            N, a resumed run and another --limit give the same episodes at the same --batch. Costs idle rows'
            compute at the end of a run.
        concurrent_schemes: with --batch and several schemes, run every scheme's episodes at once, each scheme on
            its own engine of --batch rows (on a GPU its own CUDA stream): the host answers one scheme's finished
            calls while the device runs the others', and the process starts once. The episodes are those of one
            scheme at a time (each engine sees the same calls in the same order); the schemes' caches are held
            together, so --batch auto sizes for all of them. Off by default (on an H100 it gave about the throughput of
            one scheme at a time: results/eval_throughput/README.md).
        launch_ahead: with --batch, queue the next decode steps of the episodes still generating before answering
            those whose call ended, so the device decodes while the host runs their tools and starts their next
            calls (a call that starts meanwhile joins the steps after those). Every episode draws the same tokens
            from its seeds; on a GPU the decode widths an episode meets may differ, as with another --batch. Off
            by default until a GPU measures it (results/eval_throughput/README.md).
        devices: N > 1 runs N shard processes at once, one per GPU (cuda:0 … cuda:N-1; N CPU processes with
            --device cpu or without a GPU), each into OUT/shard_i, then merges them into OUT. The shards take their
            episodes from one queue (OUT/queue), each the next one when it has a free row, so they end together.
        memory_fraction: this process's share of the device's memory, in (0, 1]: --batch auto sizes within it
            and the CUDA allocator is capped there, so several evaluations can share one GPU (e.g. six at 0.15).
        stall_s: end the process in one line when no engine call returns and no episode ends for this many
            seconds (a device call that never comes back), with every thread's stack in OUT/stall.txt; the finished
            episodes stay and the same command resumes. Unset: 300 on a GPU, off on the CPU; 0: off.
        quiet: no progress bar.
        server: run the agents as HTTP clients of a running `lragent serve` at this URL (each role call one
            completions request carrying the trajectory so far) instead of loading the model here; --batch N: N
            episodes in flight; the server's key from $LRAGENT_API_KEY.

    Returns:
        0 on success.
    """
    call = dict(locals())  # the command's arguments, before any local variable: --devices re-issues them per shard
    names = benchmark_names(benchmark)
    if merge is not None:
        if len(names) > 1:
            raise ValueError("--merge summarises the folders of one benchmark: give one --benchmark")
        return merge_outputs(_as_list(merge), _check_out(out))
    calls = [benchmark_call(call, b, several=len(names) > 1) for b in names]
    plans = [check_eval_args(c, notes=i == 0) for i, c in enumerate(calls)]  # every check before anything runs
    if devices > 1:
        if len(names) > 1 and BENCHMARK_FIELD in out:
            raise ValueError(f"--devices {devices} with several benchmarks writes OUT/<benchmark>: give --out without "
                             f"{BENCHMARK_FIELD}, got {out}")  # fmt: skip
        total = sum(len(p.questions) * runs * len(p.schemes) for p in plans)
        top = _check_out(out if len(names) > 1 else calls[0]["out"])
        return fan_out(call if len(names) > 1 else calls[0], devices, top, total=total, benchmarks=names)
    for i, plan in enumerate(plans):
        code = run_plan(plan, first=i == 0, label=plan.bench.name if len(plans) > 1 else "")
        if code:
            return code
    return 0


def benchmark_names(value: str | Sequence[str]) -> list[str]:
    """``--benchmark``'s names (one, a comma list or a list), each checked, none twice."""
    names = benchmark_list(value)
    if not names:
        raise ValueError(f"--benchmark {value!r}: give hotpotqa, scienceqa, or a comma list of them")
    for name in names:
        get_benchmark(name)  # names the allowed ones
    if len(set(names)) < len(names):
        raise ValueError(f"--benchmark {value!r} names a benchmark twice: give each once")
    return names


def benchmark_call(call: dict[str, Any], name: str, several: bool) -> dict[str, Any]:
    """One benchmark's arguments of an eval: ``{benchmark}`` in ``--out``, ``--work_queue`` and ``--adapters``
    replaced by its name; with ``several`` benchmarks an ``--out`` without it becomes ``OUT/<name>``, and a queue
    (each benchmark has its own) must name the benchmark, as must ``--out`` beside it (the shard folders of one
    benchmark sit side by side)."""
    out = dict(call, benchmark=name)
    for key in ("out", "work_queue", "adapters"):
        value = call.get(key)
        if isinstance(value, str) and BENCHMARK_FIELD in value:
            out[key] = value.replace(BENCHMARK_FIELD, name)
    if several and call.get("work_queue"):
        for key in ("work_queue", "out"):
            if BENCHMARK_FIELD not in str(call[key]):
                raise ValueError(f"--{key} {call[key]} with several benchmarks and --work_queue: put {BENCHMARK_FIELD} "
                                 f"in it (e.g. Q/{BENCHMARK_FIELD}/queue, Q/{BENCHMARK_FIELD}/shard_0)")  # fmt: skip
    if several and BENCHMARK_FIELD not in call["out"]:
        out["out"] = str(_check_out(call["out"]) / name)
    _check_out(out["out"])
    return out


TIMING_FILE = "timing.json"  # the eval's setup and episode-loop seconds, per process and summed (eval_timing.py)
TIMING_EVERY_S = 5.0  # timing.json is rewritten at most this often while the episodes run
LAUNCH_FILE = "launch.json"  # eval --devices N: the launching process's seconds and each shard process's wall


# Lower bounds of the integer options (None: the option is unset), checked in one place by check_eval_args.
_AT_LEAST: dict[str, int] = {
    "runs": 1, "max_steps": 1, "thought_tokens": 1, "argument_tokens": 1, "limit": 1, "max_context_tokens": 1,
    "devices": 1, "prefill_in_decode": 0, "feed_budget": 0,
}  # fmt: skip


@dataclass
class EvalPlan:
    """What one eval process runs: the command's arguments after :func:`check_eval_args` (checked, resolved)."""

    bench: Benchmark
    questions: list[Question]
    schemes: list[Scheme]
    constraints: list[str]
    levels: list[str] | None
    splits: tuple[str, ...]
    agent: AgentConfig
    droidspeak_layers: list[int] | None
    corpus_files: list[str]
    adapters: str | None
    out_dir: Path
    temperature: float
    top_p: float
    max_context_tokens: int | None
    args: dict[str, Any]  # the command's other arguments, as given


def _check_out(out: str) -> Path:
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():  # checked before anything is written (the lock creates it)
        raise ValueError(f"--out {out_dir} is an existing file; give a directory")
    return out_dir


def check_eval_args(call: dict[str, Any], notes: bool = True) -> EvalPlan:
    """Every check of :func:`evaluate`'s arguments, before anything is loaded or written; returns the plan.

    Options whose values another module owns are checked there: schemes (:func:`~lragent.schemes.parse_schemes`),
    levels and constraints (:mod:`eval_suite.evaluate.benchmarks`), sampling
    (:func:`~lragent.agents.policies.check_sampling`),
    model, adapters, rank, dtype and device (:func:`~lragent.loading.check_model_args`). ``notes``: say what a default
    chose (false for the later benchmarks of one command: said once).
    """
    a = call
    check_memory_fraction(a.get("memory_fraction"))
    stall_seconds(a.get("stall_s"), "cpu")  # a negative value: one line now, before anything loads
    for name, low in _AT_LEAST.items():
        value = a[name]
        if value is not None and (isinstance(value, bool) or value < low):
            raise ValueError(f"--{name} must be >= {low}, got {value}")
    bench = get_benchmark(a["benchmark"])
    levels = [bench.parse_level(lv) for lv in _as_list(a["levels"])] or None
    splits = bench.parse_splits(a["split"])
    scheme = a["scheme"]
    if scheme is None:  # a quick look (--limit) runs one scheme; the whole benchmark (or the untrained row) all
        scheme = "all" if a["limit"] is None or a["adapter_init"] == "zero" else DEFAULT_QUICK_SCHEME
        if scheme != "all" and notes:
            print(
                f"eval: --limit without --scheme runs {scheme} only (--scheme all: the five schemes)", file=sys.stderr
            )
    schemes = parse_schemes(scheme)
    cons = parse_constraints(a["constrain"])
    bench.check_constraints(cons)  # answer_text on HotpotQA: refused here, before anything loads
    check_sampling(a["temperature"], a["top_p"])
    if a.get("server"):
        from eval_suite.evaluate.server_client import check_server_args

        check_server_args(a, cons)
    top_p = 1.0 if a["temperature"] == 0 else a["top_p"]  # greedy: nucleus mass means nothing; recorded as 1
    batch, capacity, max_context = a["batch"], a["capacity"], a["max_context_tokens"]
    if batch != "auto" and batch < 0:
        raise ValueError(f"--batch must be >= 0 (0: one episode at a time), got {batch}")
    if batch and capacity < 4096:
        raise ValueError(f"--capacity must be >= 4096 positions per episode, got {capacity}")
    if a["server"] is not None:  # the server's trajectories bound the episodes, not this process's --capacity
        if max_context is None:
            from eval_suite.evaluate.server_client import served_context_bound

            max_context = served_context_bound(a["server"], os.environ.get("LRAGENT_API_KEY") or None)
    elif batch and max_context is None:
        max_context = context_bound(capacity)
    elif batch and max_context > capacity - CYCLE_RESERVE_TOKENS:
        raise ValueError(f"--max_context_tokens {max_context} leaves no room for a cycle: allowed <= capacity - "
                         f"{CYCLE_RESERVE_TOKENS}")  # fmt: skip
    i, n = parse_shard(a["shard"])
    if a["work_queue"] and Path(a["work_queue"]).exists() and not Path(a["work_queue"]).is_dir():
        raise ValueError(f"--work_queue {a['work_queue']} is a file: give a folder that the shards share")
    if a["devices"] > 1 and (a["shard"] != "0/1" or a["work_queue"]):
        option = "--shard" if a["shard"] != "0/1" else "--work_queue"
        raise ValueError(f"--devices N runs its own shards and queue: give --devices or {option}, not both")
    adapters, adapter_init = a["adapters"], a["adapter_init"]
    if adapters is None and adapter_init is None:
        default = default_adapters(bench.name, model=a["model"])
        if not default.is_dir():
            raise FileNotFoundError(
                f"no --adapters given and the trained shared-A adapters {default} are missing: train and export "
                f"them (cli.py fit --config configs/{bench.name}.yaml; cli.py export), pass --adapters DIR, or "
                "--adapter_init zero for the untrained row"
            )
        adapters = str(default)
        print(f"eval: using the trained shared-A adapters {default} (no --adapters given)", file=sys.stderr)
    check_model_args(  # damaged or incomplete adapter sets fail here, not mid-run
        model=a["model"], adapters=adapters, adapter_init=adapter_init, rank=a["rank"], alpha=a["alpha"],
        dtype=a["dtype"], device=a["device"], roles=DEFAULT_ROLES, needs_text=True,
    )  # fmt: skip
    if adapter_init == "zero":
        if scheme not in ("all", "non_shared"):
            raise ValueError("--adapter_init zero is the untrained row: B = 0 makes every scheme equal non_shared")
        schemes = [Scheme.NON_SHARED]
    layers = load_droidspeak_config(a["droidspeak_config"]) if a["droidspeak_config"] else None
    corpus_files = _as_list(a["corpus"])
    for f in corpus_files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"--corpus {f}: no such file")
    agent = AgentConfig(
        max_steps=a["max_steps"], thought_tokens=a["thought_tokens"], argument_tokens=a["argument_tokens"],
        max_context_tokens=max_context,
    )  # fmt: skip
    questions = bench.load_questions(levels, a["limit"], splits=splits)
    parts = max(n, a["devices"])  # a shard of n, or the launcher of --devices N
    if len(questions) < parts:  # a shard without a question could never write its summary, nor the merge run
        option = f"--devices {a['devices']}" if a["devices"] > 1 else f"--shard {a['shard']}"
        raise ValueError(f"{option}: {len(questions)} question(s) to split over {parts} shards (--limit, --levels); "
                         f"allowed at most {len(questions)} shards")  # fmt: skip
    return EvalPlan(
        bench=bench, questions=questions if a["work_queue"] else questions[i::n], schemes=schemes, constraints=cons,
        levels=levels, splits=splits, agent=agent, droidspeak_layers=layers, corpus_files=corpus_files,
        adapters=adapters,
        out_dir=Path(a["out"]), temperature=a["temperature"], top_p=top_p, max_context_tokens=max_context, args=a,
    )  # fmt: skip


def merge_outputs(dirs: list[str], out_dir: Path) -> int:
    """``eval --merge``: summarises several output directories together into ``out_dir`` (nothing is run)."""
    from eval_suite.evaluate.eval_report import merge_dirs
    from lragent.provenance import provenance

    if not dirs:
        raise ValueError("--merge needs at least one output directory")
    for d in dirs:
        if not (Path(d) / EPISODES_FILE).is_file():
            raise FileNotFoundError(f"--merge {d}: no {EPISODES_FILE} there")
    with DirectoryLock(out_dir):
        summary = merge_dirs(dirs, out_dir, provenance())
    _print_summary(summary, out_dir)
    return 0


def shard_queue(folder: str | None, shard: str, out_dir: Path) -> tuple[WorkQueue | None, set[tuple[str, int, str]]]:
    """A shard's view of ``--work_queue`` (None without one) and the keys of the episodes that the shard folders
    beside ``out_dir`` already hold (an earlier launch's: not run again)."""
    if not folder:
        return None, set()
    elsewhere: set[tuple[str, int, str]] = set()
    for log in sibling_logs(out_dir, EPISODES_FILE):
        elsewhere |= {record_key(r) for r in read_episodes(log)}
    return WorkQueue(folder, shard=shard), elsewhere


def _stop_on_sigterm() -> Callable[[], None]:
    """Makes SIGTERM (``timeout``'s signal: a device call's limit, a scheduler) raise KeyboardInterrupt in this
    process, as Ctrl-C does, so the episode loop stops through the same path: the records written stay, the loop's
    time goes into ``timing.json`` and the command says so in one line. Returns what puts the old handler back (a
    no-op off the main thread, where no handler can be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, old)


def run_plan(plan: EvalPlan, first: bool = True, label: str = "") -> int:
    """One eval process: checks the batch before the model loads, sizes ``--batch auto`` once it is loaded (under the
    device's allocation lock), then runs every missing episode of the plan into its output directory and writes the
    summary. Out of memory during the run halves the batch and resumes from the episode log. ``first``: the first
    plan this process runs (a later benchmark's ``startup_s`` is 0: the process's start is counted once); ``label``
    prefixes the summary's lines (the benchmark's name, where one process runs several)."""
    from lragent.command import on_interrupt
    from lragent.provenance import provenance

    started, age = time.perf_counter(), process_age_s() if first else 0.0
    a, out_dir, bench = plan.args, plan.out_dir, plan.bench
    run_device = resolve_device(a["device"])
    import torch

    threads = host_threads(run_device, os.environ, torch.get_num_threads())
    if threads:
        torch.set_num_threads(threads)
    fraction = a.get("memory_fraction")
    adapters_label = str(Path(plan.adapters).resolve()) if plan.adapters else f"init:{a['adapter_init']}"
    batch = a["batch"]
    most = min(MAX_AUTO_BATCH, len(plan.questions) * a["runs"]) or 1
    concurrent = bool(a.get("concurrent_schemes") and batch and len(plan.schemes) > 1)
    size = dict(dtype=a["dtype"], device=run_device, rank=a["rank"], droidspeak_layers=plan.droidspeak_layers,
                memory_fraction=fraction, concurrent=concurrent)  # fmt: skip
    if batch and not a.get("server"):  # before the model loads: refuse a batch (auto: one episode) that cannot fit
        choose_batch(a["model"], plan.schemes, 1 if batch == "auto" else batch, a["capacity"], **size)
    apply_memory_fraction(run_device, fraction)

    with DirectoryLock(out_dir):
        toolbox_factory, corpus_desc = bench.toolbox_factory(plan.corpus_files, splits=plan.splits)
        print(f"eval: {bench.name} search corpus: {json.dumps(corpus_desc)}", file=sys.stderr)
        prov = provenance(dtype=a["dtype"], device=run_device)
        config = {
            "benchmark": bench.name, "model": a["model"], "adapters": adapters_label, "dtype": a["dtype"],
            "temperature": plan.temperature, "top_p": plan.top_p, "constraints": list(plan.constraints),
            "answer_score": answer_score(plan.constraints), "corpus_files": plan.corpus_files, "seed": a["seed"],
            "agent": vars(plan.agent), "droidspeak_layers": plan.droidspeak_layers, "sampler": SAMPLER_VERSION,
            "schemes": plan.schemes, "batch_invariant": a["batch_invariant"],
            "runs": a["runs"], "levels": plan.levels, "split": list(plan.splits), "limit": a["limit"],
            "shard": a["shard"],
            "work_queue": a["work_queue"],
            "questions": len(plan.questions), "corpus": corpus_desc, "provenance": prov,
        }  # fmt: skip
        check_run_config(out_dir, config)
        on_interrupt(f"finished episodes are in {out_dir / EPISODES_FILE}; rerun the same command to resume")
        load_started = time.perf_counter()
        lm, tokenizer = (None, None) if a.get("server") else load_lora_model(
            model=a["model"], adapters=plan.adapters, adapter_init=a["adapter_init"], rank=a["rank"],
            alpha=a["alpha"], seed=a["seed"], dtype=a["dtype"], device=run_device,
        )  # fmt: skip

        def executor_of(rows: int) -> EpisodeExecutor:
            if a.get("server"):  # the agents as clients of a running server: nothing loaded here
                from eval_suite.evaluate.server_client import server_executor

                return server_executor(a, plan.temperature, plan.top_p, rows)
            if not rows:
                factory = build_policy_factory(
                    lm, tokenizer, temperature=plan.temperature, top_p=plan.top_p, use_kernel=a["use_kernel"],
                    droidspeak_layers=plan.droidspeak_layers,
                )  # fmt: skip
                return SequentialExecutor(factory)
            from eval_suite.evaluate.batched_executor import BatchedExecutor

            return BatchedExecutor(
                lm, tokenizer, batch=rows, capacity=a["capacity"], temperature=plan.temperature, top_p=plan.top_p,
                use_kernel=a["use_kernel"], cuda_graphs=a["cuda_graphs"] if run_device.startswith("cuda") else False,
                droidspeak_layers=plan.droidspeak_layers, prefill_in_decode=a["prefill_in_decode"],
                batch_invariant=a["batch_invariant"], feed_budget=a["feed_budget"], concurrent_schemes=concurrent,
                launch_ahead=bool(a.get("launch_ahead")),
            )  # fmt: skip

        loaded = time.perf_counter()
        with allocation_lock(run_device):  # sized against what is free now, the caches allocated before the next
            if batch == "auto":
                batch = choose_batch(a["model"], plan.schemes, "auto", a["capacity"], max_batch=most,
                                     model_loaded=True, **size)  # fmt: skip
                print(f"eval: --batch auto: {batch} episodes at once (what fits now; at most {most})", file=sys.stderr)
            executor = executor_of(batch)
            if batch:
                for scheme in plan.schemes if concurrent else plan.schemes[:1]:
                    executor.reserve(scheme, len(plan.questions) * a["runs"])
        queue, elsewhere = shard_queue(a["work_queue"], a["shard"], out_dir)
        loop_started = time.perf_counter()
        before = len(read_episodes(out_dir / EPISODES_FILE))
        timing = EvalTiming(out_dir / TIMING_FILE)  # after the runs this one resumes, if any

        def timing_part(ran: int, loop_s: float, summary_s: float | None = None) -> dict[str, Any]:
            """This process's figures so far: setup, then the episode loop (the throughput of --devices N shards);
            what came before run_plan (interpreter, imports, argument checks), its parts before the loop and the
            summary after it: the fixed cost that --devices N pays once per shard."""
            return {
                "setup_s": loop_started - started, "episodes_s": loop_s,
                "startup_s": age, "prepare_s": load_started - started, "load_s": loaded - load_started,
                "size_s": loop_started - loaded, "summary_s": summary_s,
                "episodes": ran, "batch": batch, "device": run_device,
                # the decode settings that shape a GPU run's numbers (None: the sequential executor)
                "prefill_in_decode": getattr(executor, "prefill_in_decode", None),
                "feed_budget": getattr(executor, "feed_budget", None),
                "concurrent_schemes": getattr(executor, "concurrent_schemes", None),
                "launch_ahead": getattr(executor, "launch_ahead", None),
                "decode_steps": getattr(executor, "decode_steps", None),
                # where the loop's time went (None: the sequential executor): the engines' decode calls, the part of
                # them reading results back, the episodes' own work between them; and the host's torch threads
                "advance_s": getattr(executor, "advance_s", None), "sync_s": getattr(executor, "sync_s", None),
                "agent_s": getattr(executor, "agent_s", None), "torch_threads": torch.get_num_threads(),
                # of advance_s the graph-replay calls, of sync_s the wait for the device (host overhead = the rest)
                "replay_s": getattr(executor, "replay_s", None), "wait_s": getattr(executor, "wait_s", None),
                # of advance_s the graph captures (kernel compiles and loads included): once per graph, not per step
                "capture_s": getattr(executor, "capture_s", None),
                # opening tokens copied from a template row (LRAGENT_PROMPT_TEMPLATE=1) instead of computed
                "template_tokens": getattr(executor, "template_tokens", None),
                # the feeding steps' extra token rows computed, and of them those that carried a fed token
                "feed_rows": getattr(executor, "feed_rows", None),
                "feed_tokens": getattr(executor, "feed_tokens", None),
            }  # fmt: skip

        written = [time.perf_counter()]
        ran = 0  # episodes this process appended (over out-of-memory retries too)

        def on_record() -> None:  # timing.json as the episodes finish: a killed run keeps its time
            nonlocal ran
            ran += 1
            watchdog.beat()
            now = time.perf_counter()
            if now - written[0] >= TIMING_EVERY_S:
                timing.write(timing_part(ran, now - loop_started), complete=False)
                written[0] = now

        def write_partial_timing() -> None:  # the loop stopped early (interrupt, stall): its time so far
            # the log's count, not ``ran``: a signal between a record's append and on_record would leave ran one short
            appended = len(read_episodes(out_dir / EPISODES_FILE)) - before
            timing.write(timing_part(appended, time.perf_counter() - loop_started), complete=False)

        restore_sigterm = _stop_on_sigterm()  # a call's time limit (SIGTERM) stops the loop like Ctrl-C
        watchdog = StallWatchdog(
            stall_seconds(a.get("stall_s"), run_device), out_dir,
            describe=lambda: executor.describe() if hasattr(executor, "describe") else type(executor).__name__,
            on_stall=write_partial_timing,
        )  # fmt: skip
        try:
            with watchdog:  # no engine call back and no episode for --stall_s: one line, process ends
                while True:
                    if hasattr(executor, "heartbeat"):  # engine calls count as progress too
                        executor.heartbeat = watchdog.beat
                    try:
                        records = run_episodes(
                            plan.questions, plan.schemes, a["runs"], executor, out_dir, benchmark=bench.name,
                            adapters=adapters_label, seed=a["seed"], agent_config=plan.agent,
                            toolbox_factory=toolbox_factory, constraints=plan.constraints, temperature=plan.temperature,
                            top_p=plan.top_p, progress=not a["quiet"], provenance=prov, work_queue=queue,
                            done_elsewhere=elsewhere, on_record=on_record,
                        )  # fmt: skip
                        break
                    except KeyboardInterrupt:  # stopped: what ran is in the episode log, and its time in timing.json
                        write_partial_timing()
                        raise
                    except Exception as exc:  # out of memory: a smaller batch goes on from the episode log
                        if not is_oom(exc):
                            raise
                        fewer = "fewer processes on the device"
                        options = f"a smaller --capacity, a larger --memory_fraction, or {fewer}"
                        line = oom_line(exc, run_device, options if batch else f"--batch N, or {fewer}")
                        del executor
                        gc.collect()
                        if run_device.startswith("cuda"):
                            torch.cuda.empty_cache()
                        if not batch or batch == 1:
                            kept = f"finished episodes are kept in {out_dir / EPISODES_FILE}"
                            raise ValueError(f"{line} ({kept})") from None
                        batch = max(1, batch // 2)
                        print(f"eval: {line}; going on at --batch {batch} (finished episodes kept)", file=sys.stderr)
                        executor = executor_of(batch)
        finally:
            restore_sigterm()
        ended = time.perf_counter()
        # a shard of a queue holds whichever episodes it got: the launcher's merge is the summary, and the shard never
        # imports the summary's metrics (torchmetrics and what it pulls in: seconds of a shard's start on a GPU host)
        summary = None
        if queue is None:
            from eval_suite.evaluate.eval_report import write_summary

            summary = write_summary(records, out_dir, prov)
        if ran or not timing.earlier:  # a rerun that found nothing to do leaves the runs' timing as it was
            timing.write(timing_part(ran, ended - loop_started, time.perf_counter() - ended), complete=True)
    if summary is None:
        print(f"eval: shard {a['shard']} ran {len(records) - before} {bench.name} episode(s) from the queue "
              f"{a['work_queue']} -> {out_dir / EPISODES_FILE}")  # fmt: skip
    else:
        _print_summary(summary, out_dir, label)
    return 0


def _print_summary(summary: dict, out_dir: Path, benchmark: str = "") -> None:
    m = summary["metrics"][0]
    for row in summary["rows"]:
        acc, oof = summary["accuracy"][m][row]["avg"], summary["oof"][row]["avg"]
        print(f"{benchmark + ' ' if benchmark else ''}{row}: {m} {fmt_over_runs(acc)} OOF {fmt_over_runs(oof)}")
    print(f"-> {out_dir / 'summary.json'}, {out_dir / 'report.md'}")
