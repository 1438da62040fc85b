"""The sweep table of ``scripts/sweep_embedded.py``, computed from each run's own logs.

A run directory holds ``run.json`` (the grid point, written by the driver), Lightning's CSV logs
(``csv/version_*/metrics.csv``, one version per ``fit`` call, in order), ``fit_status.jsonl`` (one record per
``fit`` call, :class:`~lit_modules.run_status.RunStatus`), ``launches.jsonl`` (start and end of every ``fit``
process, written by the driver), and, after the final validation of the chosen runs,
``final_val/csv/version_*/metrics.csv`` (the best checkpoint through the shared-cache schemes). Nothing in the table
comes from anywhere else: change a logged value and the table changes.

Per run: status, why it stopped (early stopping or not), epochs and optimizer steps done, wall time, training
throughput, and at the best validation (the lowest ``val/loss``, which is the checkpoint the adapters are exported
from): the loss and per role plain loss / token accuracy.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from eval_suite.report import markdown_table

ROLES: tuple[str, ...] = ("plan", "action", "reflect")
SCHEMES: tuple[str, ...] = ("base_lr_shared", "full_shared")
RUN_FILE = "run.json"
STATUS_FILE = "fit_status.jsonl"
LAUNCH_FILE = "launch.json"
LAUNCHES_FILE = "launches.jsonl"
FINAL_VAL_DIR = "final_val"


def _float(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    x = float(value)
    return None if math.isnan(x) else x


def metrics_files(run_dir: str | Path) -> list[Path]:
    """``csv/version_*/metrics.csv`` of a run (or of its ``final_val``), in version order."""
    files = list(Path(run_dir).glob("csv/version_*/metrics.csv"))
    return sorted(files, key=lambda p: int(p.parent.name.split("_")[-1]))


def read_metrics(run_dir: str | Path) -> list[dict[str, str]]:
    """Every logged row of every ``fit`` call of a run, in order."""
    rows: list[dict[str, str]] = []
    for path in metrics_files(run_dir):
        with path.open(newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def validation_rows(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows that carry a validation (``val/loss``)."""
    return [r for r in rows if _float(r.get("val/loss")) is not None]


def read_status(run_dir: str | Path) -> list[dict[str, Any]]:
    """The ``fit_status.jsonl`` records of a run (one per ``fit`` call)."""
    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def role_cells(row: dict[str, str], part: str = "plain") -> dict[str, dict[str, float | None]]:
    """``{role: {"loss", "acc"(, "kl")}}`` of one validation row, plain or through a scheme."""
    out = {}
    for role in ROLES:
        prefix = f"val/{role}/" if part == "plain" else f"val/{role}/{part}/"
        cell = {"loss": _float(row.get(prefix + "loss")), "acc": _float(row.get(prefix + "acc"))}
        if part != "plain":
            cell["kl"] = _float(row.get(prefix + "kl"))
        out[role] = cell
    return out


def _dir_mb(path: Path) -> float | None:
    if not path.is_dir():
        return None
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6, 2)


def run_summary(run_dir: str | Path) -> dict[str, Any]:
    """Everything the table shows about one run, from its logs.

    Returns:
        ``{"name", "spec", "status", "stop_reason", "early_stopped", "epochs", "steps", "wall_s" (process wall
        time of every ``fit`` call, from start-up to exit), "fit_wall_s" (inside ``fit``), "tokens_per_s",
        "devices", "best", "final_val", "adapters_mb"}``; ``status`` is ``done`` (finished: early stopping or the
        epoch cap), ``paused`` (stopped by the time budget or interrupted; resumable), ``failed``, ``running``
        or ``pending``.
    """
    run_dir = Path(run_dir)
    spec = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).is_file() else {}
    records = read_status(run_dir)
    rows = read_metrics(run_dir)
    vals = validation_rows(rows)
    last = records[-1] if records else None
    launch = run_dir / LAUNCH_FILE
    launched_after = launch.is_file() and (
        not records or launch.stat().st_mtime > (run_dir / STATUS_FILE).stat().st_mtime
    )
    final_rows = validation_rows(read_metrics(run_dir / FINAL_VAL_DIR))
    if spec.get("kind") == "validate":
        status = "done" if final_rows else ("running" if launched_after else "pending")
    elif launched_after:
        status = "running"
    elif last is None:
        status = "pending"
    elif last.get("finished"):
        status = "done"
    elif last.get("reason") in ("time_budget", "interrupted"):
        status = "paused"
    else:
        status = "failed"
    steps = [int(float(r["step"])) for r in rows if r.get("step") not in (None, "")]
    best = None
    if vals:
        row = min(vals, key=lambda r: float(r["val/loss"]))  # the first minimum, as ModelCheckpoint keeps it
        best = {
            "epoch": int(float(row["epoch"])) if row.get("epoch") else None,
            "step": int(float(row["step"])) if row.get("step") else None,
            "val_loss": float(row["val/loss"]),
            "roles": role_cells(row),
        }
    final_val = None
    if final_rows:
        row = final_rows[-1]
        final_val = {"val_loss": float(row["val/loss"])}
        for part in ("plain", *SCHEMES):
            final_val[part] = role_cells(row, part)
    train_s = sum(r.get("train_s") or 0 for r in records)
    launches = run_dir / LAUNCHES_FILE
    procs = [json.loads(x) for x in launches.read_text().splitlines() if x.strip()] if launches.is_file() else []
    tokens = sum(r.get("train_tokens") or 0 for r in records)
    return {
        "name": run_dir.name,
        "spec": spec,
        "status": status,
        "stop_reason": last.get("reason") if last else None,
        "early_stopped": bool(last and last.get("reason") == "early_stopping"),
        "epochs": max((int(float(r["epoch"])) for r in vals), default=-1) + 1,
        "steps": last["global_step"] if last and "global_step" in last else max(steps, default=0),
        "wall_s": round(sum(p["end"] - p["start"] for p in procs), 1),
        "fit_wall_s": round(sum(r.get("wall_s") or 0 for r in records), 1),
        "tokens_per_s": round(tokens / train_s) if train_s > 0 else None,
        "devices": sorted({r["device"] for r in records if r.get("device")}),
        "max_memory_gb": max((r["max_memory_gb"] for r in records if r.get("max_memory_gb")), default=None),
        "best": best,
        "final_val": final_val,
        "adapters_mb": _dir_mb(run_dir / "adapters"),
        "dev": dev_episodes(run_dir / DEV_DIR),
    }


DEV_DIR = "eval_dev"
"""A run's dev-episode evaluation (``--after-run``'s ``cli.py eval --out {run_dir}/eval_dev``)."""


def dev_episodes(out_dir: Path) -> dict[str, Any] | None:
    """Mean accuracy metrics and OOF of a dev evaluation's first row, from its ``summary.json``; None without one.

    Returns:
        ``{"row", "episodes", "metrics": {name: mean}, "oof"}``, fractions in [0, 1].
    """
    path = out_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    row = summary["rows"][0]
    return {
        "row": row,
        "episodes": sum(summary["episodes"][row].values()),
        "metrics": {m: summary["accuracy"][m][row]["avg"]["mean"] for m in summary["metrics"]},
        "oof": summary["oof"][row]["avg"]["mean"],
    }


def dev_table(runs: list[dict[str, Any]]) -> str:
    """One line per run with a dev evaluation: episodes, its metrics and OOF in %."""
    out = ["| run | row | episodes | metrics | OOF |", "| :--- | :--- | ---: | :--- | ---: |"]
    for s in runs:
        d = s["dev"]
        metrics = ", ".join(f"{m} {100 * v:.1f}" for m, v in d["metrics"].items())
        out.append(f"| {s['name']} | {d['row']} | {d['episodes']} | {metrics} | {100 * d['oof']:.1f} |")
    return "\n".join(out)


def _cell(cell: dict[str, float | None] | None) -> str:
    if not cell or cell.get("loss") is None:
        return "–"
    acc = cell.get("acc")
    return f"{cell['loss']:.3f} / {'–' if acc is None else f'{100 * acc:.1f}%'}"


def _spec_cells(spec: dict[str, Any]) -> list[str]:
    lr = spec.get("lr")
    return [
        spec.get("dataset", "?"),
        "shared" if spec.get("shared_a", True) else "indep.",
        "–" if lr is None else f"{lr:g}",
        spec.get("targets", "–"),
        str(spec.get("rank", "–")),
    ]


def fit_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per trained run; by dataset, then shared A first, then best validation first."""
    header = [
        "run", "data", "A", "lr", "targets", "r", "status", "stop", "epochs", "steps", "wall s", "tok/s", "GPU GB",
        "best ep", "val loss", *(f"{r} loss / acc" for r in ROLES), "adapters MB",
    ]  # fmt: skip
    rows = []

    def key(s: dict[str, Any]) -> tuple:
        spec = s["spec"]
        loss = s["best"]["val_loss"] if s["best"] else math.inf
        return (spec.get("dataset", ""), not spec.get("shared_a", True), loss, s["name"])

    order = sorted(runs, key=key)
    for s in order:
        best = s["best"] or {}
        rows.append(
            [
                s["name"],
                *_spec_cells(s["spec"]),
                s["status"],
                "early stop" if s["early_stopped"] else (s["stop_reason"] or "–").replace("_", " "),
                str(s["epochs"]),
                str(s["steps"]),
                f"{s['wall_s']:.0f}",
                "–" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,}",
                "–" if s["max_memory_gb"] is None else f"{s['max_memory_gb']:.1f}",
                "–" if best.get("epoch") is None else str(best["epoch"]),
                "–" if not best else f"{best['val_loss']:.4f}",
                *(_cell((best.get("roles") or {}).get(r)) for r in ROLES),
                "–" if s["adapters_mb"] is None else f"{s['adapters_mb']:.1f}",
            ]
        )
    return markdown_table(header, rows, align=["l"] * 8 + ["r"] * (len(header) - 8))


def final_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: the best checkpoint (or the untrained model) of each run through plain and shared-cache forwards."""
    header = ["run", *(f"{r} {p}" for r in ROLES for p in ("plain", *SCHEMES))]
    rows = []
    for s in sorted(runs, key=lambda s: s["name"]):
        fv = s["final_val"]
        if fv is None:
            continue
        rows.append([s["name"], *(_cell(fv[p][r]) for r in ROLES for p in ("plain", *SCHEMES))])
    return markdown_table(header, rows, align=["l"] + ["r"] * (len(header) - 1))


def collect(root: str | Path) -> list[dict[str, Any]]:
    """:func:`run_summary` of every run directory under ``root`` (those with a ``run.json``)."""
    return [run_summary(p.parent) for p in sorted(Path(root).glob(f"*/{RUN_FILE}"))]


def sweep_report(root: str | Path, provenance: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The sweep table as JSON (with ``provenance``) and Markdown (ending with the provenance footer).

    Args:
        root: the sweep's run root (``runs/sweep``).
        provenance: :func:`lragent.provenance.provenance` of the process making the table.

    Returns:
        ``(json_obj, markdown)``.
    """
    from lragent.provenance import provenance_footer

    runs = collect(root)
    fits = [s for s in runs if s["spec"].get("kind") == "fit"]
    devices = sorted({d for s in runs for d in s["devices"]})
    obj = {"runs": runs, "training_devices": devices, "provenance": provenance}
    lines = [
        "# Embedded-model training sweep",
        "",
        "From each run's own logs (`metrics.csv`, `fit_status.jsonl`, `launches.jsonl`) by "
        "`eval_suite/sweep_table.py`. Validation: the held-out split of every role (`data.val_fraction`), plain "
        "forward; `val loss` is the token-weighted mean over roles and the "
        "role cells are loss / token accuracy on the output tokens, all at the best validation (the checkpoint the "
        "adapters are exported from). `stop`: why the last `fit` call ended (`early stop`: val/loss did not "
        "improve for `patience` epochs; `max epochs`: the cap; `time budget`: paused, resumable). `wall s`: the "
        "fit processes' wall time, start-up included, all calls. `tok/s`: real training tokens per second of "
        f"training time, per process (several shared the GPU). `GPU GB`: peak memory allocated by the process. "
        f"Trained on: {', '.join(devices) or 'n/a'}.",
        "",
        fit_table(fits),
    ]
    finals = [s for s in runs if s["final_val"] is not None]
    if finals:
        lines += [
            "## Best checkpoints through the shared-cache schemes",
            "",
            "Each cell: val loss / token accuracy of the exported adapters (the best checkpoint's), plain and with "
            "the context encoded by another role into the shared cache (`cli.py validate --model.adapters_path "
            "<adapters> --model.val_schemes null`); `untrained_*`: B = 0.",
            "",
            final_table(finals),
        ]
    devs = [s for s in runs if s.get("dev")]
    if devs:
        lines += [
            "",
            "## Dev episodes of each run's exported adapters",
            "",
            "`--after-run`'s `cli.py eval` on the first dev questions of the run's benchmark (interleaved levels), "
            "`non_shared`, the evaluation protocol's sampling (T 0.9, top-p 0.75), one run; metrics and OOF in %. "
            "A small subset: a coarse check that the agents finish episodes, not a ranking.",
            "",
            dev_table(devs),
        ]
    return obj, "\n".join(lines) + provenance_footer(provenance)
