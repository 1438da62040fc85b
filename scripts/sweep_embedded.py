"""Training-recipe sweep for the embedded model on one GPU: K ``cli.py fit`` processes at a time, resumable.

Stage 1 (HotpotQA, shared A): every point of lr x targets x rank (default 4 x 2 x 2 = 16 runs), plus the untrained
model's validation. Stage 2: the chosen point (default: the lowest best val/loss of stage 1) for
{hotpotqa, scienceqa} x {shared A, independent A}; the HotpotQA shared-A run is stage 1's own run (same name, not
retrained). Every stage-2 run's exported adapters (its best checkpoint's) are then validated through the
shared-cache schemes, and the untrained model of each dataset too.

One learning rate for every role and the shared A (the paper's per-role ratio, 5:6, is within the noise of a 2.5x lr
grid); alpha = 2 x rank (the paper's scaling alpha / r = 2); every other setting comes from
``configs/embedded_<dataset>.yaml``. A run is a directory ``<root>/<name>/`` (``run.json``, ``config.yaml``, CSV logs,
``fit_status.jsonl``, ``checkpoints/``, ``adapters/`` = the best checkpoint's, ``fit.log``).

    python scripts/sweep_embedded.py run --stage 1 --parallel 6 --budget 540     # rerun to continue (resumes)
    python scripts/sweep_embedded.py run --stage 2 --parallel 4 --budget 540     # --pick NAME to choose
    python scripts/sweep_embedded.py status                                      # one line per run
    python scripts/sweep_embedded.py table --out results/sweep_embedded
    python scripts/sweep_embedded.py pack OUT                                    # <= 8 files of <= 15.5 MB
    python scripts/sweep_embedded.py install --to data/adapters                  # stage 2 -> {ds}_{sharedA,indepA}

A call respects ``--budget`` seconds of wall clock: runs are launched while at least ``--min-launch`` seconds are
left, each run stops itself at an epoch end before the deadline (``TimeBudget``), and what is still running
``--grace`` seconds after the deadline gets SIGTERM. Rerunning the same command continues every unfinished run from
its ``last.ckpt``; finished runs (early stopping or the epoch cap) are not touched, except that a run which ended at
an epoch cap lower than this call's is continued.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from eval_suite.sweep_table import (  # noqa: E402
    FINAL_VAL_DIR,
    LAUNCH_FILE,
    LAUNCHES_FILE,
    RUN_FILE,
    collect,
    run_summary,
    sweep_report,
)

TARGETS: dict[str, list[str]] = {
    "qv": ["q_proj", "v_proj"],
    "qvo_mlp": ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
"""Target sets of the grid (``k_proj`` stays out: K is shared across agents by every scheme)."""
DATASETS: tuple[str, ...] = ("hotpotqa", "scienceqa")
STAGE2_FILE = "stage2.json"
PIECE_BYTES = 15_500_000
"""Largest file ``pack`` writes (the device tool returns files of at most 16 MB)."""


@dataclass(frozen=True)
class RunSpec:
    """One grid point (``kind == "fit"``) or the untrained model's validation (``kind == "validate"``)."""

    dataset: str
    shared_a: bool = True
    lr: float | None = None
    targets: str | None = None
    rank: int | None = None
    kind: str = "fit"

    @property
    def name(self) -> str:
        if self.kind == "validate":
            return f"untrained_{self.dataset}"
        a = "sharedA" if self.shared_a else "indepA"
        return f"{self.dataset}_{a}_lr{self.lr:g}_{self.targets}_r{self.rank}"

    @property
    def alpha(self) -> float:
        return 2.0 * self.rank


# ------------------------------------------------------------------------------------------------------------- grid


def stage1_grid(lrs: list[float], targets: list[str], ranks: list[int]) -> list[RunSpec]:
    """Stage 1: HotpotQA, shared A, every lr x targets x rank."""
    return [RunSpec("hotpotqa", True, lr, t, r) for lr in lrs for t in targets for r in ranks]


def stage2_grid(chosen: RunSpec) -> list[RunSpec]:
    """Stage 2: the chosen point on both datasets, shared and independent A."""
    return [RunSpec(ds, shared, chosen.lr, chosen.targets, chosen.rank) for ds in DATASETS for shared in (True, False)]


def pick_stage2(
    root: Path, pick: str, lrs: list[float], targets: list[str], ranks: list[int], max_mb: float = 0.0
) -> RunSpec:
    """The stage-2 point: ``auto`` or a stage-1 run's name.

    ``auto``: the lowest best val/loss among finished stage-1 runs whose exported adapter set (PEFT directories and
    native checkpoint, as ``install`` ships it) is at most ``max_mb`` MB (``0``: any size). The repository carries
    the shipped sets, so their size matters: q/v rank 8 is about 4.4 MB per set in bf16, q/v/o+MLP rank 16 about 46.

    Raises:
        ValueError: no finished stage-1 run within the size (``auto``), or ``pick`` is no stage-1 run name.
    """
    grid = {s.name: s for s in stage1_grid(lrs, targets, ranks)}
    if pick != "auto":
        if pick not in grid:
            raise ValueError(f"--pick {pick!r} is no stage-1 run: one of {', '.join(grid)}")
        return grid[pick]
    done = [run_summary(root / n) for n in grid if (root / n / RUN_FILE).is_file()]
    done = [s for s in done if s["status"] == "done" and s["best"]]
    if max_mb > 0:
        done = [s for s in done if s["adapters_mb"] is not None and s["adapters_mb"] <= max_mb]
    if not done:
        size = f" with adapters of at most {max_mb:g} MB" if max_mb > 0 else ""
        raise ValueError(f"no finished stage-1 run{size} under {root}: run stage 1 first, or give --pick NAME")
    return grid[min(done, key=lambda s: s["best"]["val_loss"])["name"]]


# ---------------------------------------------------------------------------------------------------------- configs


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = cfg
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def parse_sets(items: list[str]) -> list[tuple[str, Any]]:
    """``KEY=VALUE`` overrides (dotted keys into the config, YAML values)."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. data.max_tokens=32768")
        out.append((key, yaml.safe_load(value)))
    return out


def base_config(configs: Path, dataset: str) -> dict[str, Any]:
    path = configs / f"embedded_{dataset}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"base config not found: {path}")
    return yaml.safe_load(path.read_text())


def _callbacks(cfg: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from cfg["trainer"].get("callbacks") or []


def fit_config(
    spec: RunSpec, base: dict[str, Any], run_dir: Path, deadline: float | None, sets: list[tuple[str, Any]]
) -> dict[str, Any]:
    """The ``cli.py fit`` config of a grid point: the base config with the point's values and the run's paths."""
    cfg = json.loads(json.dumps(base))  # deep copy
    tr, model = cfg["trainer"], cfg["model"]
    tr["default_root_dir"] = str(run_dir)
    tr["enable_progress_bar"] = False
    tr["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {
        "save_dir": str(run_dir), "name": "csv", "version": None, "flush_logs_every_n_steps": 50}}]  # fmt: skip
    callbacks = []
    for cb in _callbacks(cfg):
        kind = cb["class_path"].rsplit(".", 1)[-1]
        args = cb.setdefault("init_args", {})
        if kind.endswith("ProgressBar"):  # no bar in a sweep process (enable_progress_bar is off)
            continue
        if kind == "ModelCheckpoint":
            args["dirpath"] = str(run_dir / "checkpoints")
        elif kind == "ExportAdapters":
            args["out_dir"] = str(run_dir / "adapters")
        elif kind == "RunStatus":
            args["path"] = str(run_dir / "fit_status.jsonl")
        elif kind == "TimeBudget":
            args["deadline"] = deadline
            args["seconds"] = None
        callbacks.append(cb)
    kinds = {cb["class_path"].rsplit(".", 1)[-1] for cb in callbacks}
    for needed in ("ModelCheckpoint", "ExportAdapters", "RunStatus", "TimeBudget"):
        if needed not in kinds:
            raise ValueError(f"the base config has no {needed} callback, which the sweep needs")
    tr["callbacks"] = callbacks
    model.update(
        lr=spec.lr,
        role_lr=dict.fromkeys(model.get("roles") or ["plan", "action", "reflect"], spec.lr),
        shared_a_lr=spec.lr,
        targets=TARGETS[spec.targets],
        rank=spec.rank,
        alpha=spec.alpha,
        shared_a=spec.shared_a,
        val_schemes=[],
    )
    for key, value in sets:
        _set(cfg, key, value)
    return cfg


def validate_config(cfg: dict[str, Any], out_dir: Path, adapters: Path | None) -> dict[str, Any]:
    """A ``cli.py validate`` config from a fit config: the exported ``adapters`` (``None``: untrained, B = 0)
    through every shared-cache scheme, logs under ``out_dir``."""
    cfg = json.loads(json.dumps(cfg))
    cfg["model"]["adapters_path"] = None if adapters is None else str(adapters)
    tr = cfg["trainer"]
    tr["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {
        "save_dir": str(out_dir), "name": "csv", "version": None}}]  # fmt: skip
    tr["callbacks"] = []
    tr["enable_progress_bar"] = False
    tr["default_root_dir"] = str(out_dir)
    cfg["model"]["val_schemes"] = None
    return cfg


# ------------------------------------------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """A launched process."""

    kind: str
    """``fit``, ``final_val``, ``untrained`` or ``after_run``."""
    spec: RunSpec
    proc: subprocess.Popen
    started: float
    log: Any


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class Sweep:
    """Launches and tracks the runs of one stage.

    Args:
        args: the parsed command line of ``run``.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(args.root).resolve()
        self.configs = Path(args.configs).resolve()
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget
        self.sets = parse_sets(args.set)
        self.jobs: list[Job] = []
        self.stop = False
        threads = max(1, (os.cpu_count() or 1) // max(1, args.parallel))
        self.env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }
        self.log_file = None

    def say(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.0f} s] {msg}"
        print(line, flush=True)
        if self.log_file is not None:
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def left(self) -> float:
        return self.deadline - time.time()

    def need(self, kind: str) -> float:
        """Seconds that must be left to launch a job of ``kind``."""
        return self.args.min_launch if kind == "fit" else self.args.min_launch_validate

    # ---- run directories ----------------------------------------------------------------------------------------
    def run_dir(self, spec: RunSpec) -> Path:
        return self.root / spec.name

    def prepare(self, spec: RunSpec) -> Path:
        """Creates the run directory and its ``run.json``; refuses a directory of another grid point."""
        d = self.run_dir(spec)
        d.mkdir(parents=True, exist_ok=True)
        record = {**asdict(spec), "name": spec.name, "alpha": spec.alpha if spec.rank else None}
        if spec.kind == "fit":
            record["targets_modules"] = TARGETS[spec.targets]
        path = d / RUN_FILE
        if path.is_file():
            old = json.loads(path.read_text())
            if {k: old.get(k) for k in record} != record:
                raise ValueError(f"{d} belongs to another run ({old}); use another --root")
        else:
            _write_json(path, record)
        return d

    def max_epochs(self, spec: RunSpec) -> int:
        """The epoch cap of this call for ``spec`` (``--max-epochs``, else the base config's after ``--set``)."""
        if self.args.max_epochs is not None:
            return self.args.max_epochs
        cfg = base_config(self.configs, spec.dataset)
        for key, value in self.sets:
            _set(cfg, key, value)
        return int(cfg["trainer"].get("max_epochs") or 0)

    def capped_below(self, spec: RunSpec) -> bool:
        """Whether a finished run ended at the epoch cap and this call's cap is higher."""
        s = run_summary(self.run_dir(spec))
        return s["stop_reason"] == "max_epochs" and s["epochs"] < self.max_epochs(spec)

    def status(self, spec: RunSpec) -> str:
        return run_summary(self.run_dir(spec))["status"] if (self.run_dir(spec) / RUN_FILE).is_file() else "pending"

    # ---- launching ------------------------------------------------------------------------------------------------
    def _popen(self, kind: str, spec: RunSpec, cmd: list[str] | str, log_path: Path, marker: Path | None) -> None:
        log = log_path.open("a")
        log.write(
            f"\n=== {kind} {time.strftime('%Y-%m-%d %H:%M:%S')}: {cmd if isinstance(cmd, str) else shlex.join(cmd)}\n"
        )
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env, shell=isinstance(cmd, str)
        )
        if marker is not None:
            _write_json(
                marker, {"pid": proc.pid, "kind": kind, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            )
        self.jobs.append(Job(kind, spec, proc, time.time(), log))
        self.say(f"launched {kind} {spec.name} (pid {proc.pid})")

    def launch_fit(self, spec: RunSpec) -> None:
        d = self.prepare(spec)
        cfg = fit_config(
            spec, base_config(self.configs, spec.dataset), d, self.deadline - self.args.exit_margin, self.sets
        )
        if self.args.max_epochs is not None:
            cfg["trainer"]["max_epochs"] = self.args.max_epochs
        (d / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = [sys.executable, "cli.py", "fit", "--config", str(d / "config.yaml")]
        last = d / "checkpoints" / "last.ckpt"
        if last.is_file():
            cmd += ["--ckpt_path", str(last)]
        self._popen("fit", spec, cmd, d / "fit.log", d / LAUNCH_FILE)

    def launch_validate(self, spec: RunSpec) -> None:
        """The untrained model (``kind == "validate"``) or a finished run's best checkpoint, every scheme."""
        d = self.prepare(spec)
        out = d / FINAL_VAL_DIR
        out.mkdir(parents=True, exist_ok=True)
        if spec.kind == "validate":
            base = base_config(self.configs, spec.dataset)
            for key, value in self.sets:
                _set(base, key, value)
            cfg = validate_config(base, out, None)
        else:
            if not (d / "adapters" / "lragent_adapters.safetensors").is_file():
                self.say(f"{spec.name}: no exported adapters to validate")
                return
            cfg = validate_config(yaml.safe_load((d / "config.yaml").read_text()), out, d / "adapters")
        (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        cmd = [sys.executable, "cli.py", "validate", "--config", str(out / "config.yaml")]
        kind = "untrained" if spec.kind == "validate" else "final_val"
        self._popen(kind, spec, cmd, out / "validate.log", out / LAUNCH_FILE)

    def launch_after_run(self, spec: RunSpec) -> None:
        d = self.run_dir(spec)
        values = {
            "adapters": str(d / "adapters"), "run_dir": str(d), "name": spec.name, "dataset": spec.dataset,
            "ckpt": _best_checkpoint(d) or "", "shared_a": str(spec.shared_a).lower(),
        }  # fmt: skip
        cmd = self.args.after_run.format(**values)
        self._popen("after_run", spec, cmd, d / "after_run.log", None)

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def reap(self) -> list[Job]:
        done = [j for j in self.jobs if j.proc.poll() is not None]
        for j in done:
            self.jobs.remove(j)
            j.log.close()
            if j.kind == "after_run":
                _write_json(self.run_dir(j.spec) / "after_run.json", {"rc": j.proc.returncode})
            if j.kind == "fit":
                record = {"start": round(j.started, 2), "end": round(time.time(), 2), "rc": j.proc.returncode}
                with (self.run_dir(j.spec) / LAUNCHES_FILE).open("a") as f:
                    f.write(json.dumps(record) + "\n")
            status = self.status(j.spec) if j.kind == "fit" else ""
            self.say(f"{j.kind} {j.spec.name}: exit {j.proc.returncode} after {time.time() - j.started:.0f} s {status}")
        return done

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        for j in self.jobs:
            if j.proc.poll() is None:
                j.proc.send_signal(sig)

    def run(self, fits: list[RunSpec], validations: list[RunSpec], final_val: bool) -> int:
        """Runs the stage's jobs until all are done or the budget is spent.

        Returns:
            0 when every run is done, 3 when some are paused or pending (rerun to continue), 1 on failures.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_file = (self.root / "driver.log").open("a")
        pid_file = self.root / "driver.pid"  # while it exists and the pid lives, a driver works on this root
        pid_file.write_text(f"{os.getpid()}\n")
        self.say(
            f"stage with {len(fits)} fits, {len(validations)} untrained validations; "
            f"budget {self.args.budget:.0f} s, {self.args.parallel} in parallel"
        )
        warm_model_cache(self.configs, fits + validations, self.sets)
        queue: list[tuple[str, RunSpec]] = [("untrained", v) for v in validations if self.status(v) != "done"]
        for spec in fits:
            st = self.status(spec)
            if st == "done" and self.capped_below(spec):
                st = "paused"  # finished at a lower epoch cap than this call's: continue it
                self.say(f"{spec.name}: stopped at a lower epoch cap; continuing to {self.max_epochs(spec)} epochs")
            if st == "done":
                if final_val and not (self.run_dir(spec) / FINAL_VAL_DIR / "csv").is_dir():
                    queue.append(("final_val", spec))
                if self.args.after_run and not (self.run_dir(spec) / "after_run.json").is_file():
                    queue.append(("after_run", spec))
            else:
                queue.append(("fit", spec))
        failed = False

        def on_signal(signum: int, frame: Any) -> None:
            self.stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        sigterm_sent = False
        while (queue or self.jobs) and not self.stop:
            for j in self.reap():
                if j.kind == "fit":
                    st = self.status(j.spec)
                    if st == "done":
                        if final_val:
                            queue.insert(0, ("final_val", j.spec))
                        if self.args.after_run:
                            queue.insert(0, ("after_run", j.spec))
                    elif st == "failed":
                        failed = True
                elif j.proc.returncode != 0:
                    failed = failed or j.kind != "after_run"
            i = 0
            while i < len(queue) and len(self.jobs) < self.args.parallel:
                kind, spec = queue[i]
                if self.left() < self.need(kind):
                    i += 1
                    continue
                queue.pop(i)
                if kind == "fit":
                    self.launch_fit(spec)
                elif kind in ("final_val", "untrained"):
                    self.launch_validate(spec)
                else:
                    self.launch_after_run(spec)
            if not self.jobs and all(self.left() < self.need(kind) for kind, _ in queue):
                break  # nothing runs and nothing left fits the budget
            if self.left() < -self.args.grace and not sigterm_sent:
                self.say("deadline passed: SIGTERM to the remaining processes")
                self.terminate()
                sigterm_sent = True
            if self.left() < -2 * self.args.grace:
                self.terminate(signal.SIGKILL)
            time.sleep(self.args.poll)
        if self.stop:
            self.say("stopping: SIGTERM to the running processes")
            self.terminate()
        for j in list(self.jobs):
            try:
                j.proc.wait(timeout=max(5.0, self.args.grace))
            except subprocess.TimeoutExpired:
                j.proc.kill()
        self.reap()
        statuses = {s.name: self.status(s) for s in fits + validations}
        left = [n for n, st in statuses.items() if st != "done"]
        self.say(
            f"end: {len(statuses) - len(left)} of {len(statuses)} done"
            + (f"; not done: {', '.join(left)}" if left else "")
        )
        write_tables(self.root, self.root)
        self.log_file.close()
        pid_file.unlink(missing_ok=True)
        if failed or any(st == "failed" for st in statuses.values()):
            return 1
        return 3 if left else 0


def _best_checkpoint(run_dir: Path) -> str | None:
    """The best checkpoint recorded by the run's last ``fit`` call (RunStatus), if it still exists."""
    from eval_suite.sweep_table import read_status

    for record in reversed(read_status(run_dir)):
        path = record.get("best_checkpoint")
        if path and Path(path).is_file():
            return path
    return None


def warm_model_cache(configs: Path, specs: list[RunSpec], sets: list[tuple[str, Any]]) -> None:
    """Converts a registered model (embedded or accuracy) once before the parallel runs start (they would all
    convert it at once)."""
    names = set()
    for ds in {s.dataset for s in specs}:
        cfg = base_config(configs, ds)
        for key, value in sets:
            _set(cfg, key, value)
        names.add(cfg["model"].get("model_name", "default"))
    from lragent.models import registered_source

    for name in names:
        registered_source(str(name))


def write_tables(root: Path, out: Path) -> tuple[Path, Path]:
    """Writes ``sweep_table.md`` and ``sweep_table.json`` (with provenance) from the runs' logs."""
    from eval_suite.report import write_json, write_text
    from lragent.provenance import provenance

    obj, md = sweep_report(root, provenance(dtype="bf16-mixed"))
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep_table.json", obj)
    write_text(out / "sweep_table.md", md)
    return out / "sweep_table.md", out / "sweep_table.json"


# ------------------------------------------------------------------------------------------------------------- pack


def _tar(path: Path, members: list[tuple[Path, str]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for src, arc in members:
            tar.add(src, arcname=arc)
    return path


def _pieces(path: Path, limit: int) -> list[Path]:
    """``path`` itself when small enough, else ``path.partNN`` pieces of at most ``limit`` bytes (``cat`` joins)."""
    if path.stat().st_size <= limit:
        return [path]
    pieces = []
    with path.open("rb") as f:
        i = 0
        while chunk := f.read(limit):
            piece = path.with_name(f"{path.name}.part{i:02d}")
            piece.write_bytes(chunk)
            pieces.append(piece)
            i += 1
    path.unlink()
    return pieces


def pack(
    root: Path, out: Path, stage1_adapters: int, max_files: int, skip: int, limit: int = PIECE_BYTES
) -> list[Path]:
    """Packs the sweep into at most ``max_files`` files of at most ``limit`` bytes in ``out``.

    Order: ``sweep_table.md``, ``sweep_logs.tar.gz`` (tables, every run's config, logs, metrics, status), then the
    stage-2 runs' adapters (``adapters_stage2.tar.gz``), then the native adapter checkpoints of the best
    ``stage1_adapters`` stage-1 runs (``adapters_stage1.tar.gz``); a file over ``limit`` is cut into ``.partNN``
    pieces (``cat FILE* | tar xz`` joins and unpacks). Paths inside are relative to the repository root, so
    unpacking in the repository puts them back under ``runs/...``. ``skip`` leaves out the first files (to fetch the
    rest in a later call).

    Returns:
        the files written to ``out``.
    """
    write_tables(root, root)
    work = root / "_pack"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rel = root.relative_to(ROOT) if root.is_relative_to(ROOT) else Path(root.name)
    logs = [
        (root / f, str(rel / f))
        for f in ("sweep_table.md", "sweep_table.json", "driver.log", STAGE2_FILE)
        if (root / f).is_file()
    ]
    for d in sorted(p.parent for p in root.glob(f"*/{RUN_FILE}")):
        for f in sorted(d.rglob("*")):
            if (
                f.is_file()
                and f.suffix in (".json", ".jsonl", ".csv", ".yaml", ".log")
                and "checkpoints" not in f.parts
                and "adapters" not in f.relative_to(d).parts
            ):
                logs.append((f, str(rel / f.relative_to(root))))
            elif f.is_file() and f.name == "train_config.json":
                logs.append((f, str(rel / f.relative_to(root))))
    shutil.copy2(root / "sweep_table.md", work / "sweep_table.md")  # readable at once
    files = [work / "sweep_table.md", *_pieces(_tar(work / "sweep_logs.tar.gz", logs), limit)]
    stage2 = json.loads((root / STAGE2_FILE).read_text())["runs"] if (root / STAGE2_FILE).is_file() else []
    members = []
    for name in stage2:
        ad = root / name / "adapters"
        if ad.is_dir():
            members += [(f, str(rel / f.relative_to(root))) for f in sorted(ad.rglob("*")) if f.is_file()]
    if members:
        files += _pieces(_tar(work / "adapters_stage2.tar.gz", members), limit)
    ranked = [s for s in collect(root) if s["spec"].get("kind") == "fit" and s["name"] not in stage2 and s["best"]]
    ranked.sort(key=lambda s: s["best"]["val_loss"])
    members = []
    for s in ranked[:stage1_adapters]:
        for f in (
            root / s["name"] / "adapters" / "lragent_adapters.safetensors",
            root / s["name"] / "adapters" / "train_config.json",
        ):
            if f.is_file():
                members.append((f, str(rel / f.relative_to(root))))
    if members:
        files += _pieces(_tar(work / "adapters_stage1.tar.gz", members), limit)
    out.mkdir(parents=True, exist_ok=True)
    chosen = files[skip : skip + max_files]
    for f in chosen:
        shutil.copy2(f, out / f.name)
    left = files[skip + max_files :]
    print(
        f"packed {len(chosen)} of {len(files)} files into {out}: "
        + ", ".join(f"{f.name} ({f.stat().st_size / 1e6:.1f} MB)" for f in chosen)
    )
    if left:
        print(f"not in this pack: {', '.join(f.name for f in left)}; fetch them with --skip {skip + max_files}")
    return [out / f.name for f in chosen]


# ---------------------------------------------------------------------------------------------------------- install


def install(root: Path, to: Path, force: bool, native_only: bool = False, max_mb: float = 12.0) -> list[Path]:
    """Copies the stage-2 runs' exported (best-checkpoint) adapters to ``to/{dataset}_{sharedA,indepA}/``.

    Args:
        root: the sweep's run root.
        to: the adapters directory (``data/adapters``).
        force: also runs that are not finished, and sets over ``max_mb``.
        native_only: copy the native checkpoint (and ``train_config.json``) without the PEFT directories
            (``load_adapter_dir`` reads either; the PEFT form repeats A per role).
        max_mb: refuse a set larger than this (the repository carries them).

    Raises:
        ValueError: stage 2 was not run under ``root``, a run is not finished, or a set is too large (without
            ``force``).
    """
    path = root / STAGE2_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found: run stage 2 first (or unpack its logs and adapters here)")
    written = []
    for name in json.loads(path.read_text())["runs"]:
        s = run_summary(root / name)
        src = root / name / "adapters"
        if not (src / "lragent_adapters.safetensors").is_file():
            raise ValueError(f"{src} has no exported adapters")
        if s["status"] != "done" and not force:
            raise ValueError(f"{name} is {s['status']}, not done: finish it, or pass --force")
        spec = s["spec"]
        dst = to / f"{spec['dataset']}_{'sharedA' if spec['shared_a'] else 'indepA'}"
        files = [f for f in src.rglob("*") if f.is_file()]
        if native_only:
            files = [f for f in files if f.parent == src]
        size = sum(f.stat().st_size for f in files) / 1e6
        if size > max_mb and not force:
            raise ValueError(f"{name}: the set is {size:.1f} MB > --max-mb {max_mb:g}: try --native-only, or --force")
        if dst.exists():
            shutil.rmtree(dst)
        for f in files:
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / f.relative_to(src))
        written.append(dst)
        print(f"{name} -> {dst} ({sum(f.stat().st_size for f in dst.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
    return written


# ---------------------------------------------------------------------------------------------------------- command


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sweep_embedded.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=str(ROOT / "runs" / "sweep"), help="directory of the run directories")
    r = sub.add_parser("run", parents=[common], help="run (or continue) a stage")
    r.add_argument("--stage", type=int, choices=[1, 2], required=True)
    r.add_argument("--parallel", type=int, default=None, help="processes at a time (default: 6 in stage 1, 4 in 2)")
    r.add_argument("--budget", type=float, default=540.0, help="wall-clock seconds for this call")
    r.add_argument("--min-launch", type=float, default=120.0, help="launch a fit only with this many seconds left")
    r.add_argument("--min-launch-validate", type=float, default=45.0, help="the same for a validation")
    r.add_argument("--exit-margin", type=float, default=25.0, help="runs stop this long before the deadline")
    r.add_argument("--grace", type=float, default=20.0, help="SIGTERM this long after the deadline")
    r.add_argument("--poll", type=float, default=2.0, help="seconds between checks")
    r.add_argument("--configs", default=str(ROOT / "configs"), help="directory with embedded_<dataset>.yaml")
    r.add_argument("--lrs", default="2e-3,1e-3,5e-4,2e-4", help="stage-1 learning rates, launched in this order "
                   "(largest first: they early-stop soonest, and a budget cut hits the slow small ones)")  # fmt: skip
    r.add_argument("--targets", default="qv,qvo_mlp", help=f"stage-1 target sets, of {', '.join(TARGETS)}")
    r.add_argument("--ranks", default="8,16", help="stage-1 ranks")
    r.add_argument("--max-epochs", type=int, default=None, help="epoch cap (default: the base config's)")
    r.add_argument("--pick", default="auto", help="stage 2: a stage-1 run name, or auto (lowest best val/loss)")
    r.add_argument("--pick-max-mb", type=float, default=12.0, help="auto picks among runs whose adapter set is at "
                   "most this many MB (0: any size)")  # fmt: skip
    r.add_argument("--only", default="", help="launch only runs whose name contains this")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (dotted key)")
    r.add_argument("--after-run", default="", help="shell command per finished fit; {adapters} {run_dir} {name} "
                   "{dataset} {ckpt} {shared_a} are filled in")  # fmt: skip
    r.add_argument("--no-final-val", action="store_true", help="stage 2: skip the shared-cache validations")
    r.add_argument("--dry-run", action="store_true", help="print the runs and their configs' paths, launch nothing")
    r.add_argument("--pack", default=None, metavar="DIR", help="pack into DIR at the end (as the pack command)")
    sub.add_parser("status", parents=[common], help="one line per run")
    t = sub.add_parser("table", parents=[common], help="write sweep_table.md/json from the logs")
    t.add_argument("--out", default=None, help="directory of the tables (default: --root)")
    k = sub.add_parser("pack", parents=[common], help="tables, logs and adapters into <= 8 files of <= 15.5 MB")
    k.add_argument("out")
    k.add_argument("--stage1-adapters", type=int, default=3, help="native adapters of the best N stage-1 runs")
    k.add_argument("--max-files", type=int, default=8)
    k.add_argument("--skip", type=int, default=0, help="leave out the first files (fetched before)")
    i = sub.add_parser("install", parents=[common], help="stage-2 adapters into data/adapters/{ds}_{A}/")
    i.add_argument("--to", default=str(ROOT / "data" / "adapters"))
    i.add_argument("--force", action="store_true", help="also runs that are not finished, and sets over --max-mb")
    i.add_argument("--native-only", action="store_true", help="the native checkpoint only (no PEFT directories)")
    i.add_argument("--max-mb", type=float, default=12.0, help="refuse larger sets (the repository carries them)")
    args = p.parse_args(argv)
    root = Path(args.root).resolve()
    try:
        if args.command == "status":
            for s in collect(root):
                best = s["best"]
                print(f"{s['name']:<44} {s['status']:<8} epochs {s['epochs']:>2} steps {s['steps']:>5} "
                      f"best {best['val_loss'] if best else float('nan'):.4f} {s['stop_reason'] or ''}")  # fmt: skip
            return 0
        if args.command == "table":
            md, js = write_tables(root, Path(args.out) if args.out else root)
            print(md.read_text())
            return 0
        if args.command == "pack":
            pack(root, Path(args.out), args.stage1_adapters, args.max_files, args.skip)
            return 0
        if args.command == "install":
            install(root, Path(args.to), args.force, args.native_only, args.max_mb)
            return 0
        lrs, ranks = _floats(args.lrs), [int(x) for x in args.ranks.split(",") if x]
        targets = [t for t in args.targets.split(",") if t]
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets:
            raise ValueError(f"--targets {args.targets!r}: allowed {', '.join(TARGETS)}")
        if not lrs or any(not lr > 0 for lr in lrs) or not ranks or any(r <= 0 for r in ranks):
            raise ValueError(f"--lrs {args.lrs!r} / --ranks {args.ranks!r}: positive values needed")
        if args.budget <= 0:
            raise ValueError(f"--budget must be > 0, got {args.budget}")
        if args.parallel is None:
            args.parallel = 6 if args.stage == 1 else 4
        if args.parallel <= 0:
            raise ValueError(f"--parallel must be > 0, got {args.parallel}")
        parse_sets(args.set)
        for ds in DATASETS if args.stage == 2 else ("hotpotqa",):
            base_config(Path(args.configs), ds)
        if args.stage == 1:
            fits, vals = stage1_grid(lrs, targets, ranks), [RunSpec("hotpotqa", kind="validate")]
        else:
            chosen = pick_stage2(root, args.pick, lrs, targets, ranks, args.pick_max_mb)
            fits, vals = stage2_grid(chosen), [RunSpec(ds, kind="validate") for ds in DATASETS]
            root.mkdir(parents=True, exist_ok=True)
            _write_json(root / STAGE2_FILE, {"chosen": chosen.name, "runs": [s.name for s in fits]})
        fits = [s for s in fits if args.only in s.name]
        vals = [v for v in vals if args.only in v.name or not args.only]
        if args.dry_run:
            for s in vals + fits:
                print(f"{s.name:<44} {'would run' if run_summary(root / s.name)['status'] != 'done' else 'done'}")
            return 0
        rc = Sweep(args).run(fits, vals, final_val=args.stage == 2 and not args.no_final_val)
        if args.pack:
            pack(root, Path(args.pack), 3, 8, 0)
        return rc
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
