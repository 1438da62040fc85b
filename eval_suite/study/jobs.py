"""A job of the sharing study (:mod:`eval_suite.study.driver`) and whether it is done: what the driver and the report
(:mod:`eval_suite.study.report`) both read, in its own module so that neither imports the other."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lragent.sampling import SAMPLER_VERSION, recorded_sampler

ADAPTER_FILE = "lragent_adapters.safetensors"
"""The native adapter file whose existence marks a training job done."""


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


def set_name(benchmark: str, lam: float | None, scheme: str = "base_lr_shared", shared_a: bool = True) -> str:
    """Adapter-set name: ``scienceqa_lam0.5`` (base_lr_shared term), ``scienceqa_lam1_full``, ``scienceqa_indepA``,
    ``scienceqa_untrained`` (``lam`` None)."""
    if lam is None:
        return f"{benchmark}_untrained"
    if not shared_a:
        return f"{benchmark}_indepA"
    suffix = "_full" if scheme == "full_shared" and lam > 0 else ""
    return f"{benchmark}_lam{lam:g}{suffix}"


def _train_job(profile: Any, name: str, priority: float, meta: dict) -> Job:
    tname = f"train/{name}"
    return Job(
        name=tname, kind="train", cmd=["{python}", "cli.py", "fit", "--config", f"{{root}}/{tname}/config.yaml"],
        done_file=f"{tname}/adapters/{ADAPTER_FILE}", gb=profile.gb["train"], priority=priority,
        meta={**meta, "config_prefix": profile.config_prefix},
    )  # fmt: skip


def _with_python(jobs: list[Job], python: str) -> list[Job]:
    return sorted(
        (replace(j, cmd=[python if c == "{python}" else c for c in j.cmd]) for j in jobs),
        key=lambda j: j.priority,
    )
