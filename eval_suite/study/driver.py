"""The sharing study: train-for-sharing (λ) adapters and every evaluation row at 3 runs, resumable.

One **plan** of jobs, each a shipped command in its own process:

* ``train``: ``cli.py fit`` of one adapter set on ``configs/embedded_<benchmark>.yaml`` with the study's recipe
  (equal optimiser steps and data for every λ: no prefix packing, since the shared term needs one example per
  sequence; a fixed number of epochs, no early stopping; the last weights exported): shared A at
  λ ∈ ``--lambdas`` with the shared term emulating ``base_lr_shared``, λ = 1 emulating ``full_shared``
  (ICaRus-like), and independent A at λ = 0;
* ``eval``: ``cli.py eval`` of one adapter set under one scheme, ``--runs`` runs of the 90 dev questions (the
  evaluation protocol: T 0.9, top-p 0.75, seeds paired across schemes); λ = 0 shared A under all five schemes,
  the other λ under ``non_shared``, ``base_lr_shared`` and ``full_shared``, independent A under the four schemes it
  allows, the untrained model (B = 0) under ``non_shared``;
* ``fidelity``: ``cli.py fidelity --pool val`` of one adapter set (every scheme against ``non_shared`` on all the
  validation examples that training never saw);
* ``probe`` (models with a reference row): ``cli.py zero-shot`` of the base model, no agents or adapters.

``--model`` picks the base model's profile (:data:`PROFILES`): ``default`` (the embedded SmolLM2-135M, recipe
``configs/embedded_<benchmark>.yaml``) or ``qwen2.5-coder-1.5b`` (the accuracy model, ``configs/qwen_<benchmark>.yaml``,
its memory estimates and batch sizes, the zero-shot reference row). ``--stage sweep`` plans the recipe sweep instead:
one shared-A λ = 0 set per recipe point (:data:`SWEEP_POINTS`: learning rate, epochs, targets, rank), each judged by
its dev episodes under ``non_shared`` (``--runs``, default 1), reported as ``sweep.md``.

A job is done when its result file exists (``adapters/lragent_adapters.safetensors``, ``summary.json`` with every
run, ``fidelity.json``); ``run`` launches what is not done, dependencies first, as many processes at once as the GPU
memory allows (an estimate per job kind against ``--gpu-gb``), and retries a failed job up to ``--retries`` times.
Everything resumes: a killed ``fit`` continues from its ``last.ckpt``, a killed ``eval`` from its episode log. A
finished job is never launched again (``tests/test_study.py``).

    python -m eval_suite.study plan   --root runs/study                      # the jobs and their state
    python -m eval_suite.study run    --root runs/study --reset-failed      # until every job is done
    python -m eval_suite.study pack   --root runs/study --out OUT            # <= 8 files for the device tool
    python -m eval_suite.study archive --root runs/study --out DIR            # one <set>.tar.xz per set, no weights
    python -m eval_suite.study report --root runs/study --out results/study
    python -m eval_suite.study run --model qwen2.5-coder-1.5b --stage sweep --root runs/sweep_qwen --runs 1

``scripts/gpu_study.sh`` is the device driver: it starts ``run`` in the background once per machine and packs
while it works; a new machine starts from a carried pack of the committed root (``results/study_qwen/root.tar.gz``
is one: the study's pack format; ``scripts/device_carry.sh prepare-accuracy`` makes the carry).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from eval_suite.study.jobs import Job, _train_job, _with_python, is_done, set_name
from lragent.report_io import write_json
from lragent.sampling import SAMPLER_VERSION, recorded_sampler

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS: tuple[str, ...] = ("scienceqa", "hotpotqa")
LAMBDAS: tuple[float, ...] = (0.0, 0.5, 0.25, 1.0)
"""Shared-A λ values, in launch order (the most informative first)."""
FIVE = ("non_shared", "base_lr_shared", "full_shared", "base_shared", "droidspeak")
LAMBDA_SCHEMES = ("non_shared", "base_lr_shared", "full_shared")
INDEP_SCHEMES = ("non_shared", "full_shared", "base_shared", "droidspeak")
GB = {"train": 55.0, "eval": 14.0, "eval_non_shared": 20.0, "fidelity": 10.0}
"""GPU memory per job as seen on an H200 (bf16, embedded model; a fit of 16k-token unpacked batches peaks near 50 GB;
eval at the batch sizes below, capacity 8192)."""
EVAL_BATCH = {"non_shared": 32, "droidspeak": 48}
"""Rows per eval process (``--batch``); other schemes: :data:`DEFAULT_BATCH`. non_shared keeps 3 caches per row."""
DEFAULT_BATCH = 64
ANSWER_THOUGHT_LAMBDAS: tuple[float, ...] = (0.0, 0.5)
SHIPPED_STUDY_SET: dict[str, float] = {"scienceqa": 0.5}
"""Benchmarks whose bundled shared-A set (``data/adapters/<bench>_sharedA``) is a study set, and its λ; the others'
bundled sets are evaluated as shipped (set ``<bench>_shipped``)."""
SWEEP_TARGETS: dict[str, tuple[str, ...]] = {
    "qv": ("q_proj", "v_proj"),
    "qvo_mlp": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
SWEEP_POINTS: tuple[dict, ...] = (
    {"lr": 3e-4, "epochs": 2, "targets": "qv", "rank": 8},
    {"lr": 1e-4, "epochs": 2, "targets": "qv", "rank": 8},
    {"lr": 1e-3, "epochs": 2, "targets": "qv", "rank": 8},
    {"lr": "best", "epochs": 4, "targets": "qv", "rank": 8},
    {"lr": "best", "epochs": 2, "targets": "qv", "rank": 16},
    {"lr": "best", "epochs": 2, "targets": "qvo_mlp", "rank": 8},
)
"""The recipe sweep, in launch order: the learning rate three ways (2 epochs, q/v, rank 8), then one change at a time
(epochs, rank, targets) at each benchmark's best learning rate of those three (:data:`SWEEP_BEST_LR`)."""
SWEEP_BEST_LR: dict[str, float] = {"scienceqa": 3e-4, "hotpotqa": 1e-4}
"""Each benchmark's best learning rate of the sweep's first three points on the accuracy model, by dev episodes
under ``non_shared``, as chosen from their first draw (ScienceQA 60.0% at 3e-4, 54.4% at 1e-4, 51.1% at 1e-3;
HotpotQA EM 30.0 at 1e-4, 26.7 at 3e-4, 24.4 at 1e-3); the recipes ``configs/qwen_<benchmark>.yaml`` use them. The
second draw of those points (retrained, newer sampler; ``results/study_qwen/sweep.md``) moved by up to 6.7 points and
ranks HotpotQA's 3e-4 first (31.1 against 28.9): within one draw's noise, so the choice stands."""


@dataclass(frozen=True)
class ModelProfile:
    """What the study needs to know of its base model.

    Attributes:
        model: the ``--model`` value every command gets (``default``: the embedded model, left off the commands).
        config_prefix: the recipe is ``configs/<prefix>_<benchmark>.yaml``.
        gb: GPU memory per job kind (``train``, ``eval``, ``eval_non_shared``, ``fidelity``, ``probe``).
        eval_batch: rows per eval process by scheme; other schemes ``default_batch``.
        default_batch: rows per eval process of the other schemes.
        shipped_study_set: benchmarks whose bundled shared-A set is one of this study's sets, and its λ.
        evaluate_shipped: evaluate the bundled sets that are not study sets as a row of their own.
        answer_thought_lambdas: λ of the ScienceQA answer-thought recipe variant sets.
        probe: plan the zero-shot reference row (``cli.py zero-shot``).
    """

    model: str
    config_prefix: str
    gb: dict[str, float] = field(default_factory=dict)
    eval_batch: dict[str, int] = field(default_factory=dict)
    default_batch: int = 64
    shipped_study_set: dict[str, float] = field(default_factory=dict)
    evaluate_shipped: bool = False
    answer_thought_lambdas: tuple[float, ...] = ()
    probe: bool = False

    def model_args(self) -> list[str]:
        return [] if self.model == "default" else ["--model", self.model]


PROFILES: dict[str, ModelProfile] = {
    "default": ModelProfile(
        "default", "embedded", GB, EVAL_BATCH, DEFAULT_BATCH, SHIPPED_STUDY_SET, True, ANSWER_THOUGHT_LAMBDAS
    ),
    # Qwen2.5-Coder-1.5B (bf16): a fit of 16k-token batches with checkpointing peaked at 7.8 GB (H100, the sweep's
    # fit_status.jsonl); an eval's plan at capacity 8192 is
    # 27 GiB for non_shared at 32 rows and 21-22 GiB for the others at 64 (lragent.memory_plan), plus the model.
    "qwen2.5-coder-1.5b": ModelProfile(
        "qwen2.5-coder-1.5b",
        "qwen",
        {"train": 12.0, "eval": 24.0, "eval_non_shared": 30.0, "fidelity": 14.0, "probe": 8.0},
        {"non_shared": 32},
        64,
        probe=True,
    ),  # fmt: skip
}
"""Study profiles by ``--model``."""


def train_config(
    benchmark: str,
    lam: float,
    scheme: str,
    shared_a: bool,
    run_dir: Path,
    epochs: int,
    data_overrides: dict | None = None,
    config_prefix: str = "embedded",
    recipe: dict | None = None,
) -> dict:
    """The ``cli.py fit`` config of one study set: the model's recipe (``configs/<config_prefix>_<benchmark>.yaml``),
    unpacked, ``epochs`` epochs, last weights; ``data_overrides`` overrides data settings (a recipe variant such as
    ``answer_thoughts``); ``recipe`` overrides ``lr`` (every role and the shared A), ``rank`` (alpha = 2 x rank) and
    ``targets``."""
    base = yaml.safe_load((ROOT / "configs" / f"{config_prefix}_{benchmark}.yaml").read_text())
    cfg = json.loads(json.dumps(base))
    tr, model, data = cfg["trainer"], cfg["model"], cfg["data"]
    tr["default_root_dir"] = str(run_dir)
    tr["enable_progress_bar"] = False
    tr["max_epochs"], tr["max_steps"] = epochs, -1
    tr["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                     "init_args": {"save_dir": str(run_dir), "name": "csv", "version": None}}]  # fmt: skip
    callbacks = []
    for cb in tr.get("callbacks") or []:
        kind = cb["class_path"].rsplit(".", 1)[-1]
        args = cb.setdefault("init_args", {})
        if kind in ("EarlyStopping", "TimeBudget") or kind.endswith("ProgressBar"):
            continue  # equal optimiser steps for every λ
        if kind == "ModelCheckpoint":
            args.update(dirpath=str(run_dir / "checkpoints"), save_top_k=0, save_last=True, monitor=None)
        elif kind == "ExportAdapters":
            args.update(out_dir=str(run_dir / "adapters"), best=False)
        elif kind == "RunStatus":
            args["path"] = str(run_dir / "fit_status.jsonl")
        callbacks.append(cb)
    tr["callbacks"] = callbacks
    model.update(lambda_shared=float(lam), shared_scheme=scheme, shared_a=shared_a, val_schemes=[])
    recipe = recipe or {}
    if "lr" in recipe:
        lr = float(recipe["lr"])
        model.update(lr=lr, shared_a_lr=lr, role_lr={role: lr for role in model["roles"]})
    if "rank" in recipe:
        model.update(rank=int(recipe["rank"]), alpha=2.0 * int(recipe["rank"]))
    if "targets" in recipe:
        model["targets"] = list(SWEEP_TARGETS[recipe["targets"]])
    data["pack_prefixes"] = False
    data.update(data_overrides or {})
    return cfg


def _eval_job(profile: ModelProfile, bench: str, name: str, adapters: list[str], sch: str, runs: int,
              deps: tuple[str, ...], priority: float, meta: dict) -> Job:  # fmt: skip
    ename = f"eval/{name}/{sch}"
    return Job(
        name=ename, kind="eval",
        cmd=["{python}", "cli.py", "eval", "--benchmark", bench, *profile.model_args(), *adapters, "--scheme", sch,
             "--runs", str(runs), "--batch", str(profile.eval_batch.get(sch, profile.default_batch)),
             "--dtype", "bfloat16", "--out", f"{{root}}/{ename}", "--quiet", "true"],
        done_file=f"{ename}/summary.json", deps=deps,
        gb=profile.gb["eval_non_shared" if sch == "non_shared" else "eval"], priority=priority,
        meta={**meta, "scheme": sch, "runs": runs, "row": "untrained" if meta.get("lambda") is None else sch},
    )  # fmt: skip


def _probe_job(profile: ModelProfile, bench: str, priority: float) -> Job:
    """The zero-shot reference row of ``bench`` (``cli.py zero-shot``: no agents, no adapters)."""
    return Job(
        name=f"probe/{bench}", kind="probe",
        cmd=["{python}", "cli.py", "zero-shot", "--benchmark", bench, *profile.model_args(),
             "--dtype", "bfloat16", "--out", f"{{root}}/probe/{bench}", "--quiet", "true"],
        done_file=f"probe/{bench}/summary.json", gb=profile.gb["probe"], priority=priority,
        meta={"benchmark": bench, "set": f"{bench}_zero_shot", "lambda": None, "train_scheme": "", "shared_a": True},
    )  # fmt: skip


def build_plan(
    benchmarks: tuple[str, ...] = BENCHMARKS,
    lambdas: tuple[float, ...] = LAMBDAS,
    runs: int = 3,
    epochs: int = 2,
    python: str = "python3",
    answer_thought_lambdas: tuple[float, ...] | None = None,
    profile: ModelProfile | None = None,
) -> list[Job]:
    """Every job of the study, in priority order (see the module docstring).

    Args:
        benchmarks: benchmarks to study.
        lambdas: shared-A λ values (the ``base_lr_shared`` term).
        runs: runs of every evaluation row.
        epochs: training epochs of every set.
        python: the interpreter of the jobs.
        answer_thought_lambdas: ScienceQA sets trained with ``data.answer_thoughts`` at these λ (named
            ``scienceqa_at_lam<λ>``); default: the profile's.
        profile: the base model's profile (default: the embedded model's).
    """
    profile = profile or PROFILES["default"]
    if answer_thought_lambdas is None:
        answer_thought_lambdas = profile.answer_thought_lambdas
    jobs: list[Job] = []
    for bi, bench in enumerate(benchmarks):
        sets: list[tuple[str, float | None, str, bool, tuple[str, ...], dict]] = []
        for lam in lambdas:
            every = lam == 0 or profile.shipped_study_set.get(bench) == lam  # the shipped set gets all five schemes
            sets.append((set_name(bench, lam), lam, "base_lr_shared", True, FIVE if every else LAMBDA_SCHEMES, {}))
        if profile.evaluate_shipped and bench not in profile.shipped_study_set:  # a bundled set that is no study set
            sets.append((f"{bench}_shipped", 0.0, "base_lr_shared", True, FIVE,
                         {"shipped": f"data/adapters/{bench}_sharedA"}))  # fmt: skip
        sets.append((set_name(bench, 1.0, "full_shared"), 1.0, "full_shared", True, LAMBDA_SCHEMES, {}))
        sets.append((set_name(bench, 0.0, shared_a=False), 0.0, "base_lr_shared", False, INDEP_SCHEMES, {}))
        sets.append((set_name(bench, None), None, "", True, ("non_shared",), {}))
        if bench == "scienceqa":  # a recipe variant: the thought before Finish names the option's text
            for lam in answer_thought_lambdas:
                sets.append((f"{bench}_at_lam{lam:g}", lam, "base_lr_shared", True, LAMBDA_SCHEMES,
                             {"answer_thoughts": True}))  # fmt: skip
        if profile.probe:
            jobs.append(_probe_job(profile, bench, -1 + bi * 0.1))
        for si, (name, lam, scheme, shared_a, schemes, data_over) in enumerate(sets):
            meta = {"benchmark": bench, "set": name, "lambda": lam, "train_scheme": scheme, "shared_a": shared_a,
                    "data": data_over}  # fmt: skip
            deps: tuple[str, ...] = ()
            adapters: list[str]
            if lam is None:
                adapters = ["--adapter_init", "zero"]
            elif "shipped" in data_over:
                adapters = ["--adapters", data_over["shipped"]]  # jobs run in the repository root
            else:
                train = _train_job(profile, name, si * 10 + bi * 0.1, {**meta, "epochs": epochs})
                jobs.append(train)
                deps = (train.name,)
                adapters = ["--adapters", f"{{root}}/{train.name}/adapters"]
            for ci, sch in enumerate(schemes):
                # a set's rows right after its training (before later sets train): a lease that ends early leaves
                # whole sets, the most informative first (λ = 0 with every scheme), not many half-evaluated ones
                prio = si * 10 + 2 + bi * 0.1 + ci * 0.01
                jobs.append(_eval_job(profile, bench, name, adapters, sch, runs, deps, prio, meta))
            if lam is not None:
                fname = f"fidelity/{name}"
                jobs.append(Job(
                    name=fname, kind="fidelity",
                    cmd=["{python}", "cli.py", "fidelity", "--benchmark", bench, *profile.model_args(), *adapters,
                         "--pool", "val", "--scheme", ",".join(FIVE if shared_a else INDEP_SCHEMES),
                         "--limit", "100000", "--dtype", "bfloat16", "--out", f"{{root}}/{fname}", "--quiet", "true"],
                    done_file=f"{fname}/fidelity.json", deps=deps, gb=profile.gb["fidelity"],
                    priority=200 + si * 10 + bi * 0.1, meta=meta,
                ))  # fmt: skip
    return _with_python(jobs, python)


def sweep_name(benchmark: str, point: dict) -> str:
    """``hotpotqa_lr0.0003_ep2_qv_r8``: the set name of one recipe point."""
    return f"{benchmark}_lr{point['lr']:g}_ep{point['epochs']}_{point['targets']}_r{point['rank']}"


def sweep_reference(benchmarks: tuple[str, ...] = BENCHMARKS) -> dict[str, str]:
    """Each benchmark's sweep point of the recipe that ships (``configs/qwen_<benchmark>.yaml``): the first point's
    epochs, targets and rank at :data:`SWEEP_BEST_LR`. The sweep report pairs every other point with it."""
    return {b: sweep_name(b, {**SWEEP_POINTS[0], "lr": SWEEP_BEST_LR[b]}) for b in benchmarks if b in SWEEP_BEST_LR}


def build_sweep_plan(
    benchmarks: tuple[str, ...] = BENCHMARKS,
    points: tuple[dict, ...] = SWEEP_POINTS,
    runs: int = 1,
    python: str = "python3",
    profile: ModelProfile | None = None,
) -> list[Job]:
    """The recipe sweep: per benchmark and point, a shared-A λ = 0 set and its dev episodes under ``non_shared``.

    Args:
        benchmarks: benchmarks to sweep.
        points: recipe points (``lr``, ``epochs``, ``targets`` a key of :data:`SWEEP_TARGETS`, ``rank``).
        runs: runs of the dev questions per point.
        python: the interpreter of the jobs.
        profile: the base model's profile.
    """
    profile = profile or PROFILES["default"]
    jobs: list[Job] = []
    for pi, point_in in enumerate(points):
        if point_in.get("targets") not in SWEEP_TARGETS:
            raise ValueError(f"sweep point {point_in}: targets must be one of {', '.join(SWEEP_TARGETS)}")
        for bi, bench in enumerate(benchmarks):
            point = dict(point_in)
            if point["lr"] == "best":  # the benchmark's best learning rate of the first points
                if bench not in SWEEP_BEST_LR:
                    raise ValueError(f"sweep point {point_in}: no best learning rate for {bench!r} in SWEEP_BEST_LR "
                                     f"(known: {', '.join(SWEEP_BEST_LR)})")  # fmt: skip
                point["lr"] = SWEEP_BEST_LR[bench]
            name = sweep_name(bench, point)
            meta = {"benchmark": bench, "set": name, "lambda": 0.0, "train_scheme": "base_lr_shared",
                    "shared_a": True, "data": {}, "recipe": dict(point)}  # fmt: skip
            train = _train_job(profile, name, pi * 10 + bi, {**meta, "epochs": int(point["epochs"])})
            jobs.append(train)
            adapters = ["--adapters", f"{{root}}/{train.name}/adapters"]
            # each point's eval right after its training: a finished point is judged before later points train
            jobs.append(_eval_job(profile, bench, name, adapters, "non_shared", runs, (train.name,),
                                  pi * 10 + bi + 0.5, meta))  # fmt: skip
    if profile.probe:
        jobs += [_probe_job(profile, bench, -1.0) for bench in benchmarks]
    return _with_python(jobs, python)


# ------------------------------------------------------------------------------------------------------------ state
def job_state(job: Job, root: Path, running: set[str], jobs: dict[str, Job]) -> str:
    """``done``, ``running``, ``unneeded``, ``failed`` (the last attempt exited non-zero), ``ready`` or ``waiting``.

    ``unneeded``: not done, but every job that depends on it is (a training whose evaluations and fidelity were kept
    from an earlier machine without its adapters: it is not run again).

    Args:
        job: the job.
        root: the study root.
        running: names of the jobs running now.
        jobs: every job of the plan by name (for the dependencies).
    """
    if is_done(job, root):
        return "done"
    if job.name in running:
        return "running"
    dependents = [j for j in jobs.values() if job.name in j.deps]
    if dependents and all(is_done(j, root) for j in dependents):
        return "unneeded"
    status = root / job.name / "attempts.jsonl"
    if status.is_file():
        last = [json.loads(line) for line in status.read_text().splitlines() if line.strip()][-1:]
        if last and last[0].get("rc") not in (0, None):
            return "failed"
    return "ready" if all(is_done(jobs[d], root) for d in job.deps) else "waiting"


def attempts(job: Job, root: Path) -> int:
    path = root / job.name / "attempts.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def _append(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def prepare(job: Job, root: Path) -> list[str]:
    """Writes what the job needs (the fit config) and returns its command with the root filled in."""
    d = root / job.name
    config = d / "run_config.json"
    if job.kind == "eval" and config.is_file():
        old = recorded_sampler(json.loads(config.read_text()))
        if old != SAMPLER_VERSION:  # episodes of an older sampler: kept beside, as evidence; the row runs again
            d.rename(d.with_name(f"{d.name}.sampler{old}"))
    d.mkdir(parents=True, exist_ok=True)
    cmd = [c.replace("{root}", str(root)) for c in job.cmd]
    if job.kind == "train":
        m = job.meta
        cfg = train_config(m["benchmark"], m["lambda"], m["train_scheme"], m["shared_a"], d, m["epochs"], m.get("data"),
                           m.get("config_prefix", "embedded"), m.get("recipe"))  # fmt: skip
        (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        if (d / "checkpoints" / "last.ckpt").is_file():
            cmd += ["--ckpt_path", str(d / "checkpoints" / "last.ckpt")]
    return cmd


def gpu_memory_gb() -> tuple[float, int]:
    """``(total memory of GPU 0 in GB, number of GPUs)``; ``(0, 0)`` without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        values = [float(x) for x in out.stdout.split()]
        return values[0] / 1024, len(values)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0.0, 0


NO_RESULT = 97
"""Attempt code of a job that exited 0 without writing its result file."""


def forget_failed_attempts(root: Path) -> list[str]:
    """Forgets the failed attempts of every job (a new machine: earlier failures may have been memory contention).

    Returns:
        the names of the jobs whose attempt logs were removed.
    """
    names = []
    for path in sorted(root.rglob("attempts.jsonl")):
        last = [line for line in path.read_text().splitlines() if line.strip()][-1:]
        if not last or json.loads(last[0]).get("rc") != 0:
            path.unlink()
            names.append(str(path.parent.relative_to(root)))
    return names


class _Adopted:
    """A job process that an earlier driver on this machine started and that still runs (its driver was killed): the
    new driver waits for it instead of starting the job a second time."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        """None while the process lives, then :data:`ADOPTED_ENDED` (its exit status is its lost parent's to know)."""
        return None if _pid_runs(self.pid) else ADOPTED_ENDED


ADOPTED_ENDED = 98
"""Attempt code of an adopted job that ended without its result (its exit status is unknown)."""


def _pid_runs(pid: int, needle: str | None = None) -> bool:
    """Whether process ``pid`` lives (and, with ``needle``, whether its command line contains it: a reused pid is
    another process)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (ProcessLookupError, PermissionError, OverflowError, OSError, IndexError):
        return False
    if state == "Z":  # exited, not yet reaped by its parent
        return False
    if needle is None:
        return True
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False


def _orphans(root: Path, jobs: dict[str, Job]) -> dict[str, int]:
    """Jobs of an earlier driver of this root, on this machine, whose processes still run: ``{name: pid}``."""
    path = root / "driver.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    children = info.get("running")
    if info.get("host") != platform.node() or not isinstance(children, dict) or _pid_runs(int(info.get("pid", -1))):
        return {}
    return {n: int(pid) for n, pid in children.items() if n in jobs and _pid_runs(int(pid), str(root / n))}


def run(
    root: Path,
    plan: list[Job],
    gpu_gb: float,
    retries: int = 2,
    poll: float = 5.0,
    max_procs: int = 12,
    gpus: int = 1,
    max_train: int = 2,
) -> int:
    """Launches the jobs that are not done until every one is done or has failed ``retries + 1`` times.

    Jobs start in priority order, and strictly: when the next ready job does not fit (memory or ``max_procs``), no
    job behind it starts before it does (a smaller, later job would otherwise take the room it waits for, and a lease
    that ends early would leave many half-done sets instead of whole ones). Trainings are also capped at
    ``max_train`` per GPU (a capped training does not hold back the jobs behind it): several trainings on one GPU
    only share its compute, and the rows of a finished set should not wait for them. Each job goes to the GPU with
    the least estimated memory in use (``CUDA_VISIBLE_DEVICES``), if its estimate fits that GPU's ``gpu_gb``. Jobs
    that a killed driver of the same root left running on this machine are waited for, not started again.

    Returns:
        0 when every job is done (or not needed), 1 otherwise.
    """
    jobs = {j.name: j for j in plan}
    root.mkdir(parents=True, exist_ok=True)
    procs: dict[str, tuple[Any, float, Any]] = {}
    on_gpu: dict[str, int] = {}
    too_big: set[str] = set()
    say = lambda msg: print(f"[study {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    for name, pid in _orphans(root, jobs).items():
        procs[name] = (_Adopted(pid), time.time(), None)
        on_gpu[name] = 0
        say(f"{name}: still running from an earlier driver (pid {pid}); waiting for it")
    while True:
        for name, (proc, t0, log) in list(procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            if log is not None:
                log.close()
            if rc in (0, ADOPTED_ENDED) and is_done(jobs[name], root):
                rc = 0
            elif rc == 0:  # a success without its result is a failure, or it loops
                rc = NO_RESULT
            _append(root / name / "attempts.jsonl", {"rc": rc, "seconds": round(time.time() - t0, 1)})
            say(f"{name}: exit {rc} after {time.time() - t0:.0f} s")
            del procs[name]
            on_gpu.pop(name, None)
        running = set(procs)
        used = [sum(jobs[n].gb for n in running if on_gpu.get(n) == g) for g in range(gpus)]
        count = [sum(1 for n in running if on_gpu.get(n) == g) for g in range(gpus)]
        trains = [sum(1 for n in running if on_gpu.get(n) == g and jobs[n].kind == "train") for g in range(gpus)]
        pending = []
        blocked = False
        for job in plan:
            state = job_state(job, root, running, jobs)
            if state in ("done", "running", "waiting", "unneeded"):
                if state in ("running", "waiting"):
                    pending.append(job)
                continue
            if state == "failed" and attempts(job, root) > retries:
                continue
            if job.gb > gpu_gb:  # can never fit: say so once and leave it
                if job.name not in too_big:
                    too_big.add(job.name)
                    say(f"{job.name} needs {job.gb:g} GB, more than the {gpu_gb:g} GB per GPU: not launched")
                continue
            pending.append(job)
            if blocked:  # a job ahead of this one waits for room
                continue
            g = min(range(gpus), key=lambda i: used[i])
            if job.kind == "train" and min(trains) >= max_train:
                continue
            if job.kind == "train":
                g = min((i for i in range(gpus) if trains[i] < max_train), key=lambda i: used[i])
            if count[g] >= max_procs or used[g] + job.gb > gpu_gb:
                blocked = True
                continue
            cmd = prepare(job, root)
            (root / job.name).mkdir(parents=True, exist_ok=True)
            log = (root / job.name / "log.txt").open("a")
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            # One intra-op thread per eval/fidelity process (up to a dozen share the host's cores), a few per fit.
            threads = "4" if job.kind == "train" else "1"
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "OMP_NUM_THREADS": threads}
            if gpus > 1:
                env["CUDA_VISIBLE_DEVICES"] = str(g)
            procs[job.name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env), time.time(), log)  # fmt: skip
            on_gpu[job.name] = g
            used[g] += job.gb
            count[g] += 1
            trains[g] += job.kind == "train"
            say(f"launched {job.name} on GPU {g} ({job.gb:g} GB est., {used[g]:g} of {gpu_gb:g} in use there)")
        children = {n: p.pid for n, (p, _, _) in procs.items()}
        write_json(root / "driver.json", {"pid": os.getpid(), "host": platform.node(), "running": children})
        if not procs and not any(job_state(j, root, set(), jobs) == "ready" for j in pending):
            done = sum(job_state(j, root, set(), jobs) in ("done", "unneeded") for j in plan)
            say(f"finished: {done} of {len(plan)} jobs done or not needed")
            return 0 if done == len(plan) else 1
        time.sleep(poll)


def status_lines(root: Path, plan: list[Job]) -> list[str]:
    """One line per job: state, attempts, name."""
    jobs = {j.name: j for j in plan}
    running: set[str] = set()
    try:
        info = json.loads((root / "driver.json").read_text())
    except (OSError, json.JSONDecodeError):
        info = {}
    # a driver of this machine that still runs: its children are the running jobs (a packed copy's are not)
    if info.get("host") == platform.node() and _pid_runs(int(info.get("pid", -1))):
        running = set(info.get("running") or ())
    return [f"{job_state(j, root, running, jobs):8s} {attempts(j, root)}  {j.name}" for j in plan]


# ------------------------------------------------------------------------------------------------------------- pack
PACK_EXCLUDE = ("checkpoints", "lightning_logs")


def pack(root: Path, out: Path, piece_bytes: int = 15_500_000) -> list[Path]:
    """Everything of the study but checkpoints, as ``study.tar.gz`` split into pieces the device tool returns."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "study.tar.gz.tmp"

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if any(p in PACK_EXCLUDE for p in parts) or info.name.endswith((".ckpt", ".tmp", ".eval.lock")):
            return None
        if "csv" in parts and info.isfile() and parts[-1] != "metrics.csv":
            return None  # the training logs' metrics (val/loss per epoch) travel, not their hparams
        if "adapters" in parts and len(parts) > parts.index("adapters") + 2:
            return None  # the native checkpoint only; the PEFT directories are re-made by `lragent export`
        return info

    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(root, arcname="study", filter=keep)
    data = tmp.read_bytes()
    tmp.unlink()
    for old in out.glob("study.tar.gz.part*"):
        old.unlink()
    return _write_pieces(data, out / "study.tar.gz", piece_bytes)


def _write_pieces(data: bytes, stem: Path, piece_bytes: int) -> list[Path]:
    """``data`` as ``<stem>.part00``, ``part01``, ... of at most ``piece_bytes`` each (at least one), in order."""
    paths = []
    for i in range(0, max(1, len(data)), piece_bytes):
        p = stem.with_name(f"{stem.name}.part{i // piece_bytes:02d}")
        p.write_bytes(data[i : i + piece_bytes])
        paths.append(p)
    return paths


def _pack_member(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """What :func:`archive` keeps of one file: :func:`pack`'s choice, less every adapter weight, with fixed metadata."""
    parts = Path(info.name).parts
    if "adapters" in parts or "driver.json" in parts:  # weights are kept apart; driver.json names a lost machine
        return None
    if any(p in PACK_EXCLUDE for p in parts) or info.name.endswith((".ckpt", ".tmp", ".eval.lock")):
        return None
    if "csv" in parts and info.isfile() and parts[-1] != "metrics.csv":
        return None
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # same files, same bytes
    return info


def _round_timings(jsonl: bytes) -> bytes:
    """An episode log with every float under a key ending in ``_s`` (seconds: ``wall_s``, a role's ``decode_s``)
    rounded to 1 ms; every other value as written. A line that is not JSON (a killed run's torn last line) is kept."""
    import json

    def rounded(value: object) -> object:
        if isinstance(value, dict):
            return {
                k: round(v, 3) if k.endswith("_s") and isinstance(v, float) else rounded(v) for k, v in value.items()
            }
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return value

    lines = []
    for line in jsonl.decode("utf-8", errors="surrogateescape").split("\n"):
        try:
            lines.append(json.dumps(rounded(json.loads(line)), ensure_ascii=False) if line.strip() else line)
        except json.JSONDecodeError:
            lines.append(line)
    return "\n".join(lines).encode("utf-8", errors="surrogateescape")


ARCHIVE_PIECE_BYTES = 1_000_000
"""The largest archive file: the repository keeps no file over 1 MB outside data/ (a larger archive is split)."""


def read_archives(folder: Path, dest: Path) -> list[str]:
    """Extracts every archive of ``folder`` into ``dest``: ``<set>.tar.xz`` files, ``<set>.tar.xz.partNN`` pieces
    (joined in order) and older ``<set>.tar.gz`` files. Returns the sets extracted, sorted."""
    import io

    dest.mkdir(parents=True, exist_ok=True)
    found = [(p.name[: -len(".tar.xz")], p.read_bytes()) for p in sorted(folder.glob("*.tar.[gx]z"))]
    for first in sorted(folder.glob("*.tar.xz.part00")):  # a split archive: its pieces joined in order
        stem = first.name[: -len(".part00")]
        pieces = sorted(folder.glob(f"{stem}.part[0-9][0-9]"))
        found.append((stem[: -len(".tar.xz")], b"".join(p.read_bytes() for p in pieces)))
    for _, data in found:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # gzip or xz, as the bytes say
            tar.extractall(dest, filter="data")
    return sorted(name for name, _ in found)


def archive(root: Path, out: Path, piece_bytes: int = ARCHIVE_PIECE_BYTES) -> list[Path]:
    """The study root as compact evidence: one ``<set>.tar.xz`` per adapter set, plus ``probe`` and ``driver``.

    Each set's archive holds ``study/train/<set>/``, ``study/eval/<set>/`` and ``study/fidelity/<set>/`` without
    adapter weights; ``probe.tar.xz`` the zero-shot rows, ``driver.tar.xz`` the driver's log. xz at its strongest
    preset: the episode records repeat their long fields line after line, which xz's large window finds (less than
    half gzip's size); their timings are kept to the millisecond (:func:`_round_timings`). The bytes depend only on
    the files (sorted members, zero times), so a set whose files did not change is rewritten byte-identical and a
    commit carries only the sets that moved; an older ``<set>.tar.gz`` of the same set is removed. An archive over
    ``piece_bytes`` is written as ``<set>.tar.xz.part00``, ``part01``, ... (joined in order they are the one file).
    :func:`read_archives` extracts them all into one folder: a root that ``report`` and ``run`` read (``run``
    retrains a set only if its weights are missing from ``train/<set>/adapters/``).

    Returns:
        The archives written, sorted.
    """
    import io
    import lzma

    groups: dict[str, list[Path]] = {}
    for kind in ("train", "eval", "fidelity"):
        for d in sorted((root / kind).glob("*")) if (root / kind).is_dir() else ():
            if d.is_dir():
                groups.setdefault(d.name, []).append(d)
    if (root / "probe").is_dir():
        groups["probe"] = [root / "probe"]
    groups["driver"] = [f for f in (root / "driver.log",) if f.exists()]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, tops in sorted(groups.items()):
        files = sorted(f for t in tops for f in ([t] if t.is_file() else t.rglob("*")) if f.is_file())
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for f in files:
                info = _pack_member(tar.gettarinfo(str(f), arcname=str(Path("study") / f.relative_to(root))))
                if info is None:
                    continue
                if f.name == "episodes.jsonl":  # timings to the millisecond: a quarter less archive, nothing lost
                    body = _round_timings(f.read_bytes())
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
                else:
                    with f.open("rb") as fh:
                        tar.addfile(info, fh)
        data = lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME)
        for old in [out / f"{name}.tar.gz", out / f"{name}.tar.xz", *out.glob(f"{name}.tar.xz.part[0-9][0-9]")]:
            old.unlink(missing_ok=True)
        if len(data) <= piece_bytes:
            (out / f"{name}.tar.xz").write_bytes(data)
            written.append(out / f"{name}.tar.xz")
        else:
            written += _write_pieces(data, out / f"{name}.tar.xz", piece_bytes)
    return written


def study(
    command: Literal["plan", "run", "pack", "archive", "report"],
    root: str = str(ROOT / "runs" / "study"),
    model: str = "default",
    stage: Literal["study", "sweep", "decide"] = "study",
    benchmarks: str = ",".join(BENCHMARKS),
    lambdas: str | None = None,
    runs: int | None = None,
    epochs: int = 2,
    gpu_gb: float | None = None,
    retries: int = 2,
    max_train: int = 2,
    gpus: int | None = None,
    reset_failed: bool = False,
    partial: bool = False,
    lanes: bool = False,
    out: str | None = None,
) -> int:
    """The sharing study's jobs: plan them, run them, pack or archive their root, report on them.

    Args:
        command: plan (the jobs and their state), run (until every job is done), pack (<= 8 files for the device
            tool), archive (one <set>.tar.xz per adapter set, no weights) or report.
        root: directory of the jobs.
        model: base model's profile (``default`` or ``qwen2.5-coder-1.5b``).
        stage: the λ study, the recipe sweep, or the decisive study (:mod:`eval_suite.study.decide`).
        benchmarks: comma list of hotpotqa, scienceqa.
        lambdas: shared-A λ values, comma list (default 0,0.5,0.25,1; decide: 0,0.5).
        runs: runs of every evaluation row (default 3; sweep: 1; decide: its own per benchmark).
        epochs: training epochs of every set (equal steps for every λ).
        gpu_gb: run: GPU memory to fill (default: 90% of GPU 0's).
        retries: run: relaunches of a failed job.
        max_train: run: trainings at once per GPU (they share its compute).
        gpus: run: how many GPUs to spread the jobs over, GPUs 0..N-1 (default: all).
        reset_failed: run: forget earlier failed attempts first.
        partial: report: include unfinished evaluations (an interim page).
        lanes: decide: run a job's schemes together (``eval --concurrent_schemes true``); false (default): one
            scheme at a time in the same process, the model loaded once.
        out: pack / archive / report: output directory.

    Returns:
        the exit status.
    """
    chosen = tuple(b.strip() for b in benchmarks.split(",") if b.strip())
    bad = [b for b in chosen if b not in BENCHMARKS]
    if bad or not chosen:
        raise ValueError(f"--benchmarks {benchmarks!r}: allowed {', '.join(BENCHMARKS)}")
    from eval_suite.study import decide as study_decide

    default_lambdas = study_decide.LAMBDAS if stage == "decide" else LAMBDAS
    lambdas_arg = lambdas if lambdas is not None else ",".join(f"{x:g}" for x in default_lambdas)
    try:
        lams = tuple(float(x) for x in lambdas_arg.split(",") if x.strip())
    except ValueError:
        lams = ()
    if not lams or any(not 0 <= x <= 1 for x in lams):
        raise ValueError(f"--lambdas {lambdas!r}: values in [0, 1]")
    if model not in PROFILES:
        raise ValueError(f"--model {model!r}: allowed {', '.join(PROFILES)}")
    n_runs = runs if runs is not None else (1 if stage == "sweep" else 3)
    if n_runs < 1 or epochs < 1:
        raise ValueError(f"--runs and --epochs must be >= 1, got {n_runs}, {epochs}")
    if max_train < 1:
        raise ValueError(f"--max-train {max_train}: at least 1 training per GPU")
    if gpus is not None and gpus < 1:  # a count, not an index: 0 once meant "all" silently
        raise ValueError(f"--gpus {gpus}: the number of GPUs to use (GPUs 0..N-1), at least 1")
    root_dir = Path(root).resolve()
    profile = PROFILES[model]
    if stage == "sweep":
        plan = build_sweep_plan(chosen, SWEEP_POINTS, n_runs, python=sys.executable, profile=profile)
    elif stage == "decide":
        plan = study_decide.build_decide_plan(
            chosen,
            profile,
            {b: runs for b in chosen} if runs is not None else None,
            lams,
            epochs,
            python=sys.executable,
            lanes=lanes,
        )
    else:
        plan = build_plan(chosen, lams, n_runs, epochs, python=sys.executable, profile=profile)
    if command == "plan":
        print("\n".join(status_lines(root_dir, plan)))
        return 0
    if command == "run":
        total, n_gpus = gpu_memory_gb()
        gpu = gpu_gb if gpu_gb is not None else 0.9 * total
        if gpu <= 0:
            raise ValueError("no GPU memory to fill: give --gpu-gb (the study is meant for a GPU)")
        if reset_failed:
            for name in forget_failed_attempts(root_dir):
                print(f"reset failed attempts of {name}")
        return run(root_dir, plan, gpu, retries=retries, gpus=max(1, gpus or n_gpus), max_train=max_train)
    if command == "pack":
        paths = pack(root_dir, Path(out or "study_pack"))
        print("\n".join(f"{p} {p.stat().st_size}" for p in paths))
        return 0
    if command == "archive":
        if not root_dir.is_dir():
            raise FileNotFoundError(f"--root {root_dir}: no such study root")
        for path in archive(root_dir, Path(out or root_dir / "archive")):
            print(f"{path} {path.stat().st_size}")
        return 0
    from eval_suite.study.report import write_report, write_sweep_report

    if stage == "sweep":
        write_sweep_report(root_dir, plan, Path(out or root_dir / "report"), sweep_reference(chosen))
    elif stage == "decide":
        study_decide.write_decide_report(root_dir, plan, Path(out or root_dir / "report"))
    else:
        write_report(root_dir, plan, Path(out or root_dir / "report"), partial=partial)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eval_suite.study COMMAND [options]`` (:func:`study`)."""
    from lragent.command import run_subcommands

    return run_subcommands(study, argv, "python -m eval_suite.study")


if __name__ == "__main__":
    sys.exit(main())
