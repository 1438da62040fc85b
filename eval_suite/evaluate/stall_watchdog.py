"""Ends an eval process whose device work stopped coming back, in one line, keeping what finished.

A decode call that never returns (the host waits in a read-back while the GPU never completes the work it was
given) would otherwise hold the process, and the device lease around it, until something outside kills it, and
leave no trace of where it stood. The watchdog is a daemon thread: the episode loop calls :meth:`StallWatchdog.beat`
whenever an engine call returns or an episode ends; when no beat comes for ``seconds`` it writes every thread's
stack and the executor's state to ``OUT/stall.txt``, lets the caller record its timing, prints one line and ends
the process (the main thread is blocked inside the device call, so nothing short of ending the process frees it).
The episodes already written stay in the episode log, and the same command resumes from them.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

STALL_FILE = "stall.txt"
EXIT_STALLED = 3  # the exit status of a process the watchdog ended
GPU_DEFAULT_S = 300.0  # --stall_s unset on a GPU: far above any decode call or graph capture seen (seconds)


def stall_seconds(value: float | None, device: str) -> float:
    """``--stall_s`` resolved: unset means :data:`GPU_DEFAULT_S` on a CUDA device and off (0) elsewhere, where a slow
    CPU prefill could look like a stall; 0 turns the watchdog off.

    Raises:
        ValueError: a negative value, named with what is allowed.
    """
    if value is None:
        return GPU_DEFAULT_S if str(device).startswith("cuda") else 0.0
    if not value >= 0:  # also NaN
        raise ValueError(f"--stall_s {value}: give seconds >= 0 (0 turns the stall watchdog off)")
    return float(value)


class StallWatchdog:
    """A context manager: while inside, no :meth:`beat` for ``seconds`` ends the process (``seconds`` 0: never).

    Args:
        seconds: how long without a beat counts as a stall.
        out_dir: where ``stall.txt`` goes.
        describe: the executor's state in a few words (which engine call is waiting, the rows in flight).
        on_stall: called before the process ends (e.g. writes the loop's timing so far); its errors are reported
            in ``stall.txt``, not raised.
        end: what ends the process (None: ``os._exit``).
    """

    def __init__(
        self,
        seconds: float,
        out_dir: Path,
        describe: Callable[[], str],
        on_stall: Callable[[], None] | None = None,
        end: Callable[[int], None] | None = None,
    ) -> None:
        self.seconds = float(seconds)
        self.out_dir = Path(out_dir)
        self.describe = describe
        self.on_stall = on_stall
        self.end = end if end is not None else os._exit
        self.fired = False
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Progress: an engine call returned or an episode ended."""
        self._last = time.monotonic()

    def __enter__(self) -> StallWatchdog:
        self.beat()
        if self.seconds > 0:
            self._thread = threading.Thread(target=self._watch, name="eval-stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.seconds / 4)
        while not self._stop.wait(poll):
            if time.monotonic() - self._last >= self.seconds:
                self._fire()
                return

    def _fire(self) -> None:
        self.fired = True
        path = self.out_dir / STALL_FILE
        try:
            state = self.describe()
        except Exception as exc:  # the state is a help, not a requirement: the stacks are what matter
            state = f"(state unavailable: {type(exc).__name__}: {exc})"
        with open(path, "w") as f:
            f.write(f"no engine call returned and no episode ended for {self.seconds:g} s\nstate: {state}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            if self.on_stall is not None:
                try:
                    self.on_stall()
                except Exception as exc:
                    f.write(f"\non_stall failed: {type(exc).__name__}: {exc}\n")
        print(
            f"eval: stalled: nothing came back from the device for {self.seconds:g} s ({state}); the finished "
            f"episodes are kept, stacks in {path}; rerun the same command to resume",
            file=sys.stderr,
            flush=True,
        )
        self.end(EXIT_STALLED)
