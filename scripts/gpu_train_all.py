"""Trains the training issue's eight adapter sets in parallel on one GPU, and validates the untrained model.

{hotpotqa, scienceqa} x {shared A, independent A} x {lambda_shared 0, 0.5}, each a ``cli.py fit`` process with a
config derived from ``configs/<dataset>.yaml``; ``--resume`` continues every run from its last checkpoint.
Writes ``runs/gpu/<name>/`` and packs adapters and metrics into ``--pack DIR``.

    python scripts/gpu_train_all.py --epochs 3 --max-time 00:00:07:30 --pack $OUT
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "gpu"


def variants() -> list[tuple[str, str, bool, float]]:
    return [
        (f"{ds}_{'sharedA' if shared else 'indepA'}_lam{lam:g}", ds, shared, lam)
        for ds in ("hotpotqa", "scienceqa")
        for shared in (True, False)
        for lam in (0.0, 0.5)
    ]


def make_config(name: str, ds: str, shared: bool, lam: float, epochs: int, max_time: str, max_length: int) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / f"{ds}.yaml").read_text())
    out = RUNS / name
    tr, model, data = cfg["trainer"], cfg["model"], cfg["data"]
    tr["default_root_dir"] = str(out)
    tr["max_epochs"] = epochs
    tr["max_time"] = max_time
    tr["val_check_interval"] = 0.5
    tr["callbacks"][-1]["init_args"]["out_dir"] = str(out / "adapters")
    for cb in tr["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["dirpath"] = str(out / "checkpoints")
        if cb["class_path"].endswith("ProgressBar"):
            cb["init_args"]["refresh_rate"] = 50
    for lg in tr["logger"]:
        lg["init_args"]["save_dir"] = str(out)
    model["shared_a"] = shared
    model["lambda_shared"] = lam
    if not shared:
        model["shared_a_lr"] = None
        model["shared_scheme"] = "full_shared"
        model["val_schemes"] = ["full_shared"]
    else:
        model["val_schemes"] = ["base_lr_shared", "full_shared"]
    data["max_length"] = max_length
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-time", default="00:00:07:30")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pack", default=None)
    p.add_argument("--only", default="", help="train only runs whose name contains this")
    args = p.parse_args()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    procs = []
    for name, ds, shared, lam in variants():
        if args.only not in name:
            continue
        cfg = make_config(name, ds, shared, lam, args.epochs, args.max_time, args.max_length)
        cmd = [sys.executable, "cli.py", "fit", "--config", str(cfg)]
        if args.resume and (RUNS / name / "checkpoints" / "last.ckpt").is_file():
            cmd += ["--ckpt_path", str(RUNS / name / "checkpoints" / "last.ckpt")]
        log = open(RUNS / name / ("fit_resume.log" if args.resume else "fit.log"), "w")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append((name, proc, time.time()))
    if not args.resume and not args.only:  # the untrained model (B = 0) through the same validation
        for ds in ("hotpotqa", "scienceqa"):
            cfg = RUNS / f"{ds}_sharedA_lam0" / "config.yaml"
            out = RUNS / f"{ds}_untrained"
            out.mkdir(parents=True, exist_ok=True)
            c = yaml.safe_load(cfg.read_text())
            for lg in c["trainer"]["logger"]:
                lg["init_args"]["save_dir"] = str(out)
            c["trainer"]["callbacks"] = [cb for cb in c["trainer"]["callbacks"] if "Export" not in cb["class_path"]]
            (out / "config.yaml").write_text(yaml.safe_dump(c, sort_keys=False))
            log = open(out / "validate.log", "w")
            cmd = [sys.executable, "cli.py", "validate", "--config", str(out / "config.yaml")]
            procs.append(
                (
                    f"{ds}_untrained",
                    subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env),
                    time.time(),
                )
            )
    for name, proc, t0 in procs:
        rc = proc.wait()
        print(f"{name}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
    if args.pack:
        pack = Path(args.pack)
        pack.mkdir(parents=True, exist_ok=True)
        with tarfile.open(pack / "metrics.tar.gz", "w:gz") as tar:
            for f in RUNS.glob("*/csv/*/metrics.csv"):
                tar.add(f, arcname=str(f.relative_to(RUNS)))
            for f in list(RUNS.glob("*/*.log")) + list(RUNS.glob("*/config.yaml")):
                tar.add(f, arcname=str(f.relative_to(RUNS)))
        for ds in ("hotpotqa", "scienceqa"):
            for shared in ("sharedA", "indepA"):
                with tarfile.open(pack / f"adapters_{ds}_{shared}.tar.gz", "w:gz") as tar:
                    for d in RUNS.glob(f"{ds}_{shared}_*/adapters"):
                        for f in d.glob("*"):
                            if f.is_file():
                                tar.add(f, arcname=str(f.relative_to(RUNS)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
