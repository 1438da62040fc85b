"""An exclusive lock on an output directory, so that two evaluations never append to the same episode log.

The lock is ``flock`` on a file in the directory: the kernel releases it when its holder exits, however it exits,
so a killed run never leaves a stale lock behind. The file records who holds it (pid, host, start time) for the
message a refused run prints.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import os
import platform
from pathlib import Path
from types import TracebackType

LOCK_FILE = ".eval.lock"


class DirectoryBusyError(ValueError):
    """Another process holds the directory's lock (a user error: one line, exit status 2)."""


class DirectoryLock:
    """Holds ``directory/.eval.lock`` exclusively while in use (``with DirectoryLock(out): ...``).

    Args:
        directory: the output directory (created if missing).
        what: how the refusal message names the holder's work (``eval``).
    """

    def __init__(self, directory: str | Path, what: str = "eval") -> None:
        self.directory = Path(directory)
        self.what = what
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock or raises :class:`DirectoryBusyError` naming the holder."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown process"
            os.close(fd)
            raise DirectoryBusyError(
                f"{self.directory} is in use by another {self.what} ({holder}); wait for it to end or use another --out"
            ) from None
        started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {platform.node()} since {started}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Releases the lock (the file stays; an unlocked file means nothing)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
