"""Reading a training run's own logs: Lightning's CSV metrics (``csv/version_*/metrics.csv``, one version per ``fit``
call, in order) and ``fit_status.jsonl`` (one record per ``fit`` call, :class:`~lit_modules.run_status.RunStatus`).
The recipe sweep's table (:func:`eval_suite.study.report.write_sweep_report`) is built from these alone.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

STATUS_FILE = "fit_status.jsonl"


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
