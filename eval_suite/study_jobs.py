"""A job of the sharing study (:mod:`eval_suite.study`) and whether it is done: what the driver and the report
(:mod:`eval_suite.study_report`) both read, in its own module so that neither imports the other."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lragent.sampling import SAMPLER_VERSION, recorded_sampler


@dataclass(frozen=True)
class Job:
    """One command of the study.

    Attributes:
        name: unique name, also its directory under the root (``train/<set>``, ``eval/<set>/<scheme>``, ...).
        kind: ``train``, ``eval`` or ``fidelity``.
        cmd: the command line (run from the repository root).
        done_file: the file whose existence marks the job done (relative to the root).
        deps: names of the jobs that must be done first.
        gb: estimated GPU memory.
        priority: launch order among ready jobs (lower first).
        meta: what the report needs (benchmark, adapter set, λ, scheme, ...).
    """

    name: str
    kind: str
    cmd: list[str]
    done_file: str
    deps: tuple[str, ...] = ()
    gb: float = 10.0
    priority: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def is_done(job: Job, root: Path) -> bool:
    """Whether the job's result exists (an eval must also have every run of every question in its summary)."""
    path = root / job.done_file
    if not path.is_file():
        return False
    if job.kind == "eval":
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        # the eval names a row by its scheme, except the untrained row (--adapter_init zero); a job of several
        # schemes names its rows
        rows = job.meta.get("rows") or [job.meta.get("row", job.meta.get("scheme"))]
        for row in rows:
            runs = summary.get("episodes", {}).get(row, {})
            sampler = recorded_sampler(summary.get("protocol", {}).get(row, {}))
            if len(runs) < job.meta["runs"] or sampler != SAMPLER_VERSION:  # an older sampler's row runs again
                return False
        return True
    return True
