"""Provenance of a result: which machine, dtype, library versions, commit and command produced it.

Every JSON or Markdown result the toolkit writes carries :func:`provenance` (as a ``"provenance"`` key) or its
:func:`provenance_footer`. On machines where the checkout has no ``.git`` (a copy of the working tree sent to a GPU
machine, or one whose ``.git`` is a stale snapshot), the commit comes from ``$LRAGENT_GIT_COMMIT`` (or
``$LRAGENT_COMMIT``, the name the GPU scripts take) / ``$LRAGENT_GIT_DIRTY``, set by whoever sent the copy. Since a
sender can hand over a wrong commit (or none), every record also names :func:`source_hash`, a hash of the code that
ran: ``bash scripts/gpu_tests.sh --hash`` at a commit prints the same value.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES: tuple[str, ...] = ("torch", "triton", "transformers", "peft", "lightning", "torchmetrics")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def _git() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout, or the values handed over in the environment."""
    env_commit = os.environ.get("LRAGENT_GIT_COMMIT") or os.environ.get("LRAGENT_COMMIT")
    if env_commit:
        return env_commit, os.environ.get("LRAGENT_GIT_DIRTY", "0") not in ("", "0", "false", "False")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, bool(status.strip())


SWITCHES: tuple[str, ...] = (
    "LRAGENT_PDL",
    "LRAGENT_QKV_ROPE",
    "LRAGENT_QKV_MAXNREG",
    "LRAGENT_FUSED_GEMV",
    "LRAGENT_GEMV_TABLE",
    "LRAGENT_GEMV_WIDE",
    "LRAGENT_DECODE_PLAN",
    "LRAGENT_FUSE_LORA",
    "LRAGENT_FEED_GROUP",
    "LRAGENT_FEED_WIDTHS",
    "LRAGENT_PROMPT_TEMPLATE",
    "LRAGENT_TWO_PIECE",
    "LRAGENT_WIDE_CUDNN",
    "LRAGENT_FLA_PREFILL_SDPA",
    "LRAGENT_FUSED_RMS_NORM",
    "LRAGENT_FROZEN_CAST",
    "LRAGENT_SIGTERM_EVERY",
    "LRAGENT_LIGHTNING_SIGTERM",
    "LRAGENT_PIN_CORES",
    "LRAGENT_SWITCH_INTERVAL_MS",
    "OMP_NUM_THREADS",
)
"""Environment variables that change which kernels or code paths run: a result records those that were set, since
two runs of one command line differ by them (``LRAGENT_PDL=0`` beside the default, say)."""


def switches(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The :data:`SWITCHES` set in ``env`` (default: this process's environment), by name."""
    env = os.environ if env is None else env
    return {name: env[name] for name in SWITCHES if env.get(name, "") != ""}


SOURCE_PATHS: tuple[str, ...] = (
    "cli.py",
    "lragent",
    "kernels",
    "eval_suite",
    "datamodules",
    "lit_modules",
    "tests",
    "scripts",
)
"""What :func:`source_hash` reads (its ``.py`` and ``.sh`` files): the code a result can depend on."""


@lru_cache(maxsize=1)
def source_hash(root: Path = ROOT) -> str | None:
    """The first 16 hex digits of the sha256 of the ``sha256sum`` listing of every ``.py`` / ``.sh`` file under
    :data:`SOURCE_PATHS`, in byte order of their paths: what ``bash scripts/gpu_tests.sh --hash`` prints for the
    same tree. None when no such file can be read."""
    files: list[str] = []
    for name in SOURCE_PATHS:
        top = root / name
        if top.is_file():
            files.append(name)
        elif top.is_dir():
            files += [
                p.relative_to(root).as_posix() for p in top.rglob("*") if p.suffix in (".py", ".sh") and p.is_file()
            ]
    if not files:
        return None
    try:
        listing = "".join(f"{hashlib.sha256((root / f).read_bytes()).hexdigest()}  {f}\n" for f in sorted(files))
    except OSError:
        return None
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: str | None = None) -> dict:
    """``{"type", "name", "count"}`` of the device the work ran on (the first GPU's name on CUDA)."""
    import torch

    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = str(kind).split(":")[0]
    if kind == "cuda" and torch.cuda.is_available():
        return {"type": "cuda", "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}
    return {"type": "cpu", "name": _cpu_name(), "count": os.cpu_count() or 1}


def provenance(
    *, dtype: object | None = None, device: str | None = None, command: Sequence[str] | str | None = None
) -> dict:
    """What produced a result.

    Args:
        dtype: compute dtype of the run (``torch.bfloat16`` or a name); recorded as a string.
        device: ``cpu`` / ``cuda`` (default: CUDA when available).
        command: the command line (default: the running command's, else this process's ``sys.argv``).

    Returns:
        ``{"command", "device", "dtype", "versions", "git_commit", "git_dirty", "source_hash", "switches", "host",
        "utc"}`` (``switches``: :func:`switches`).
    """
    if command is None:
        from lragent.command import command_line

        command = command_line()
    if command is None:
        command = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    cmd = command if isinstance(command, str) else shlex.join(str(c) for c in command)
    commit, dirty = _git()
    versions = {"python": platform.python_version(), **{p: _version(p) for p in _PACKAGES}}
    return {
        "command": cmd,
        "device": device_description(device),
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "versions": versions,
        "git_commit": commit,
        "git_dirty": dirty,
        "source_hash": source_hash(),
        "switches": switches(),
        "host": platform.node(),
        "utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def provenance_footer(prov: dict) -> str:
    """A Markdown footer (starts with a rule) that states :func:`provenance`'s record in two lines."""
    dev = prov.get("device") or {}
    vers = ", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items() if v)
    commit = prov.get("git_commit") or "unknown"
    if prov.get("git_dirty"):
        commit += " (dirty)"
    if prov.get("source_hash"):
        commit += f", source {prov['source_hash']}"
    set_ = " ".join(f"{k}={v}" for k, v in (prov.get("switches") or {}).items())
    return (
        "\n---\n"
        f"Produced on {dev.get('name', '?')} ({dev.get('type', '?')}), dtype {prov.get('dtype') or 'n/a'}, "
        f"commit {commit}, {prov.get('utc', '')}; {vers}.  \n"
        f"Command: `{(set_ + ' ') if set_ else ''}{prov.get('command', '')}`\n"
    )
