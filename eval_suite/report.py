"""Small helpers shared by the evaluation reports: Markdown tables, ``mean ± std`` cells, atomic JSON writes."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table.

    Args:
        header: column titles.
        rows: cells, one list per row, each as long as ``header``.
        align: ``l`` or ``r`` per column (default: first column left, the others right).

    Returns:
        the table, one line per row, ending with a newline.
    """
    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"every row needs {len(header)} cells, got {sorted({len(r) for r in rows})}")
    align = list(align or ["l"] + ["r"] * (len(header) - 1))
    rule = [":---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def fmt_mean_std(mean: float | None, std: float | None, scale: float = 100.0, digits: int = 1) -> str:
    """``"45.3 ± 1.2"`` (values times ``scale``); ``"–"`` for a missing or NaN mean."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    s = f"{mean * scale:.{digits}f}"
    if std is not None and not math.isnan(std):
        s += f" ± {std * scale:.{digits}f}"
    return s


def fmt_over_runs(cell: Mapping[str, Any], scale: float = 100.0, digits: int = 1) -> str:
    """A ``{"mean", "std", "runs"}`` cell: ``"45.3 ± 1.2"`` over several runs, the value alone (``"45.3"``) for one
    run, where a spread would mean nothing; ``"–"`` for a missing or NaN mean."""
    std = cell.get("std") if (cell.get("runs") or 0) > 1 else None
    return fmt_mean_std(cell.get("mean"), std, scale, digits)


def fmt_signed(value: float | None, scale: float = 100.0, digits: int = 1) -> str:
    """``"+1.2"`` / ``"-0.4"`` (times ``scale``); ``"–"`` when missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value * scale:+.{digits}f}"


def write_json(path: str | Path, obj: object) -> None:
    """Writes ``obj`` as indented JSON through a temporary file (never a half-written file)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_text(path: str | Path, text: str) -> None:
    """Writes ``text`` through a temporary file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_writable(path: str | Path, is_dir: bool) -> Path:
    """Makes sure an output can be written **before** any expensive work: creates the directory (``is_dir``) or the
    file's parent directory and writes and removes a probe file there.

    Raises:
        ValueError: one line naming the path and why it cannot be written.
    """
    p = Path(path)
    d = p if is_dir else p.parent
    if not is_dir and p.is_dir():
        raise ValueError(f"--out {p} is a directory; give a file path")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".lragent_write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {p} cannot be written: {exc.strerror or exc}") from None
    return p
