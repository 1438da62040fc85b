"""An eval output's ``timing.json`` across the processes that ran its episodes: written as the episodes finish, so a
killed run keeps the time it spent, and summed over the runs that resumed it.

Why: ``timing.json`` used to be written once, when the episode loop ended. A run stopped before that (a call's time
limit, a kill) left no timing at all, and the run that resumed it wrote only its own part: an eval that needs two
10-minute calls could not be timed whole. Now each process is one *part*; the file holds every part (``parts``) and,
at its top level, their totals, which is what readers of a single run already read (``episodes_s``, ``decode_steps``,
``advance_s``, ...). ``complete`` says whether the last part reached its end.

Stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ADDITIVE = (
    "setup_s", "episodes_s", "startup_s", "prepare_s", "load_s", "size_s", "summary_s", "episodes", "decode_steps",
    "advance_s", "sync_s", "agent_s", "replay_s", "wait_s", "capture_s", "template_tokens", "feed_rows", "feed_tokens",
)  # fmt: skip
"""Figures that add up over the parts (seconds and counts); the others (rows, device, settings) are the last part's."""


def totals(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The top level of ``timing.json`` for ``parts``: the last part's figures, with each of :data:`ADDITIVE` summed
    over the parts that have it (None where none has)."""
    out = dict(parts[-1])
    for key in ADDITIVE:
        if any(key in p for p in parts):
            values = [p[key] for p in parts if p.get(key) is not None]
            out[key] = sum(values) if values else None
    return out


class EvalTiming:
    """One process's part of an output's ``timing.json``, after the parts of the runs before it.

    Args:
        path: the output's ``timing.json``; what an earlier run left there (a file from before parts were kept counts
            as one part) comes first.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            earlier = json.loads(self.path.read_text())
        except (OSError, ValueError):
            earlier = None
        if not isinstance(earlier, dict):
            self.earlier: list[dict[str, Any]] = []
        else:
            parts = earlier.get("parts")
            self.earlier = list(parts) if isinstance(parts, list) else [earlier]

    def write(self, part: dict[str, Any], complete: bool) -> None:
        """Writes the earlier parts and ``part`` (this process's figures so far), atomically: a reader, or a kill
        mid-write, sees the previous file or this one."""
        parts = [*self.earlier, {**part, "complete": complete}]
        body = {**totals(parts), "runs_resumed": len(parts) - 1, "parts": parts}  # "complete": the last part's
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, self.path)
