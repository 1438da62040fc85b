"""Small helpers shared by the evaluation reports: Markdown tables, ``mean ± std`` cells, atomic JSON writes."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lragent.report_io import markdown_table, write_json, write_text  # noqa: F401  (re-exported)


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
    if is_dir and p.exists() and not p.is_dir():
        raise ValueError(f"--out {p} is an existing file; give a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".lragent_write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"--out {p} cannot be written: {exc.strerror or exc}") from None
    return p
