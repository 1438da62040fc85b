"""Builds the training results table from Lightning CSV logs (``metrics.csv`` per run).

    python -m eval_suite.study.training_report results/training_h200 > results/training_h200/README.md

For every run directory: the last validation row (val every half epoch), per role: plain loss / token accuracy and
the same through each shared-cache scheme that was validated, plus the step and epoch it was taken at.
"""

from __future__ import annotations

import csv
from pathlib import Path

ROLES = ("plan", "action", "reflect")
PARTS = ("plain", "base_lr_shared", "full_shared")


def last_validation(path: Path) -> dict[str, str]:
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/loss")]
    if not rows:
        raise ValueError(f"{path} has no validation row")
    return rows[-1]


def cell(row: dict[str, str], role: str, part: str, source: Path | str) -> str:
    """``loss / accuracy`` of one role through one scheme in a validation row (``n/a`` without its loss).

    Raises:
        ValueError: a loss without its accuracy, or a value that is no number, naming ``source`` and the column.
    """
    prefix = f"val/{role}/" if part == "plain" else f"val/{role}/{part}/"
    loss, acc = row.get(prefix + "loss", ""), row.get(prefix + "acc", "")
    if not loss:
        return "n/a"
    values = []
    for column, value in ((prefix + "loss", loss), (prefix + "acc", acc)):
        try:
            values.append(float(value))
        except ValueError:
            what = "empty" if not value else f"{value!r}, not a number"
            raise ValueError(f"{source}: column {column} is {what} in the row of step {row.get('step')}") from None
    return f"{values[0]:.3f} / {100 * values[1]:.1f}%"


def table(root: Path) -> str:
    lines = []
    for ds in ("hotpotqa", "scienceqa"):
        lines += [
            f"### {ds}",
            "",
            "Each cell: val loss / token accuracy on the output tokens (held-out 5% per role).",
            "",
            "| run | step (epoch) | " + " | ".join(f"{r} {p}" for r in ROLES for p in PARTS) + " |",
            "|---|---|" + "---|" * (len(ROLES) * len(PARTS)),
        ]
        for run in sorted(root.glob(f"{ds}_*/metrics.csv"), key=lambda p: ("untrained" not in p.parent.name, p)):
            row = last_validation(run)
            cells = [cell(row, r, p, run) for r in ROLES for p in PARTS]
            lines.append(f"| {run.parent.name} | {row['step']} ({row['epoch']}) | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def training_report(root: str = "results/training_h200") -> int:
    """The validation losses of every training run under ``root``, one table per data set.

    Args:
        root: a folder of ``<set>_*/metrics.csv`` runs.

    Returns:
        the exit status.
    """
    print(table(Path(root)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eval_suite.study.training_report [ROOT]`` (:func:`training_report`)."""
    from lragent.command import run_command

    return run_command(training_report, argv, "python -m eval_suite.study.training_report", positional=["root"])


if __name__ == "__main__":
    raise SystemExit(main())
