"""The stall watchdog: a device call that never returns ends the eval in one line, with the stacks and what finished.

The unit tests drive :class:`StallWatchdog` with a recorder in place of ``os._exit``; the end-to-end test hangs the
engine's decode call of a real CPU eval (tiny random model, batched executor) after two episodes and checks what
the user is left with: the line, ``stall.txt`` naming the waiting call and holding the stacks, the two episodes and
the loop's timing.
"""

from __future__ import annotations

import io
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from conftest import SetClock

from eval_suite.evaluate import run_eval, stall_watchdog
from eval_suite.evaluate.episode_log import EPISODES_FILE, read_episodes
from eval_suite.evaluate.stall_watchdog import EXIT_STALLED, GPU_DEFAULT_S, STALL_FILE, StallWatchdog, stall_seconds


def test_stall_seconds_defaults_to_the_gpu_only_and_refuses_negative_values():
    assert stall_seconds(None, "cuda") == stall_seconds(None, "cuda:1") == GPU_DEFAULT_S
    assert stall_seconds(None, "cpu") == 0.0  # off: a slow CPU prefill is not a stall
    assert stall_seconds(0, "cuda") == 0.0 and stall_seconds(2.5, "cpu") == 2.5
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match=r"--stall_s .*give seconds >= 0"):
            stall_seconds(bad, "cpu")


def _watch(tmp_path, seconds: float, beats_every: float | None, for_s: float):
    ended: list[int] = []
    stalled: list[bool] = []
    dog = StallWatchdog(seconds, tmp_path, describe=lambda: "in non_shared collect", end=ended.append,
                        on_stall=lambda: stalled.append(True))  # fmt: skip
    with dog:
        stop = time.monotonic() + for_s
        while time.monotonic() < stop and not ended:
            time.sleep(beats_every or 0.02)
            if beats_every:
                dog.beat()
    return dog, ended, stalled


def test_no_beat_for_the_limit_writes_the_stacks_and_ends_the_process_in_one_line(tmp_path, capsys):
    dog, ended, stalled = _watch(tmp_path, 0.3, None, for_s=5.0)
    assert ended == [EXIT_STALLED] and stalled == [True] and dog.fired
    text = (tmp_path / STALL_FILE).read_text()
    assert text.startswith("no engine call returned and no episode ended for 0.3 s\n")
    assert "state: in non_shared collect" in text
    assert "_watch" in text and "most recent call first" in text  # every thread's stack, the waiting one too
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eval: stalled: nothing came back from the device")
    assert "in non_shared collect" in err[0] and str(tmp_path / STALL_FILE) in err[0] and "resume" in err[0]


def test_beats_keep_it_quiet_and_zero_seconds_never_watches(tmp_path, capsys):
    dog, ended, _ = _watch(tmp_path, 0.4, 0.05, for_s=1.5)  # beats 8 times a limit: never fires
    assert not ended and not dog.fired and not (tmp_path / STALL_FILE).exists()
    dog, ended, _ = _watch(tmp_path, 0, None, for_s=0.3)
    assert not ended and dog._thread is None
    assert capsys.readouterr().err == ""


def test_a_failing_state_or_timing_hook_still_leaves_the_stacks(tmp_path):
    ended: list[int] = []

    def broken() -> str:
        raise RuntimeError("no lanes yet")

    def failing_timing() -> None:
        raise OSError("disk full")

    with StallWatchdog(0.2, tmp_path, describe=broken, on_stall=failing_timing, end=ended.append):
        time.sleep(1.5)
    text = (tmp_path / STALL_FILE).read_text()
    assert ended == [EXIT_STALLED]
    assert "state unavailable: RuntimeError: no lanes yet" in text and "on_stall failed: OSError: disk full" in text


@pytest.mark.model
def test_an_eval_whose_decode_call_hangs_ends_with_its_episodes_and_timing_kept(tmp_path, monkeypatch, capsys):
    """The batched executor's decode call blocks (as a GPU read-back that never returns) once two episodes are
    written: with --stall_s 5 (far above a real call of the tiny model, even under coverage on a busy machine) the
    watchdog ends the run (here: releases the call, which then raises) and leaves the two episodes, timing.json
    with the loop's time (complete false) and stall.txt naming the waiting call."""
    from lragent.engine import Engine
    from tests.test_eval_runner import _tiny_model_with_embedded_tokenizer

    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    out = tmp_path / "stalled"
    released = threading.Event()
    ended: list[int] = []

    class Recorded(StallWatchdog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, end=lambda code: (ended.append(code), released.set()))

    real_advance = Engine.advance

    def advance(self, *args, **kwargs):
        if (out / EPISODES_FILE).is_file() and len(read_episodes(out / EPISODES_FILE)) >= 2:
            released.wait(60)  # the hang: nothing returns until the watchdog fires
            raise RuntimeError("the device call was abandoned")
        return real_advance(self, *args, **kwargs)

    monkeypatch.setattr(run_eval, "StallWatchdog", Recorded)
    monkeypatch.setattr(Engine, "advance", advance)
    with pytest.raises(RuntimeError, match="abandoned"):
        run_eval.evaluate(
            benchmark="hotpotqa", scheme="non_shared", limit=6, runs=1, max_steps=2, thought_tokens=4,
            argument_tokens=3, model=str(tiny), adapter_init="random", device="cpu", batch=1, stall_s=5.0,
            quiet=True, out=str(out),
        )  # fmt: skip
    assert ended == [EXIT_STALLED]
    assert len(read_episodes(out / EPISODES_FILE)) == 2
    timing = json.loads((out / "timing.json").read_text())
    assert timing["complete"] is False and timing["episodes"] == 2 and timing["episodes_s"] >= 5.0
    text = (out / STALL_FILE).read_text()
    assert "state: in non_shared advance; " in text and "lanes: non_shared: 1 rows active" in text
    assert "in advance" in text  # the blocked main thread's stack
    assert "eval: stalled:" in capsys.readouterr().err


@pytest.mark.model
def test_slow_decode_calls_that_return_are_progress_not_a_stall(tmp_path, monkeypatch):
    """Each decode call takes 0.6 s and an episode needs about nine, so an episode takes longer than --stall_s 4.5:
    the executor's beat after every engine call keeps the watchdog quiet (the gap between two beats is one call plus
    the host's work, well under 4.5 s even on a loaded machine), and the run completes."""
    from lragent.engine import Engine
    from tests.test_eval_runner import _tiny_model_with_embedded_tokenizer

    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    out = tmp_path / "slow"
    ended: list[int] = []

    class Recorded(StallWatchdog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, end=ended.append)

    real_advance = Engine.advance

    def advance(self, *args, **kwargs):
        time.sleep(0.6)
        return real_advance(self, *args, **kwargs)

    monkeypatch.setattr(run_eval, "StallWatchdog", Recorded)
    monkeypatch.setattr(Engine, "advance", advance)
    assert run_eval.evaluate(
        benchmark="hotpotqa", scheme="non_shared", limit=2, runs=1, max_steps=3, thought_tokens=4, argument_tokens=3,
        model=str(tiny), adapter_init="random", device="cpu", batch=1, stall_s=4.5, quiet=True, out=str(out),
    ) == 0  # fmt: skip
    assert not ended and not (out / STALL_FILE).exists() and len(read_episodes(out / EPISODES_FILE)) == 2
    timing = json.loads((out / "timing.json").read_text())
    assert timing["episodes_s"] / timing["episodes"] > 4.5  # an episode outlasts --stall_s: the beats kept it quiet


def _until(done: Callable[[], object], for_s: float) -> None:
    stop = time.perf_counter() + for_s
    while not done() and time.perf_counter() < stop:
        time.sleep(0.005)


def test_the_watchdog_is_one_daemon_thread_named_eval_stall_watchdog_only_while_inside(tmp_path):
    """A daemon, so it never keeps a finished process alive; named, so tools that list threads by name (py-spy,
    threading.enumerate) tell it from the eval's own threads; gone once the block ends, without having fired."""
    ended: list[int] = []
    dog = StallWatchdog(30, tmp_path, describe=lambda: "idle", end=ended.append)
    assert dog.fired is False
    with dog:
        mine = [t for t in threading.enumerate() if t.name == "eval-stall-watchdog"]
        assert len(mine) == 1 and mine[0].daemon is True and mine[0].is_alive()
    assert not mine[0].is_alive() and not any(t.name == "eval-stall-watchdog" for t in threading.enumerate())
    assert dog.fired is False and ended == [] and not (tmp_path / STALL_FILE).exists()


def test_without_an_end_hook_a_stall_ends_the_process_with_os_exit_and_exit_stalled(tmp_path, monkeypatch):
    """The default ``end`` is ``os._exit`` (replaced here by a recorder, or it would end pytest)."""
    exits: list[int] = []
    monkeypatch.setattr(stall_watchdog.os, "_exit", exits.append)
    dog = StallWatchdog(0.2, tmp_path, describe=lambda: "in non_shared advance")
    with dog:
        _until(lambda: exits, 5.0)
    assert exits == [EXIT_STALLED] and dog.fired is True and (tmp_path / STALL_FILE).is_file()


def test_the_stall_line_reaches_stderr_before_the_process_ends_even_when_stderr_is_block_buffered(
    tmp_path, monkeypatch
):
    """os._exit drops whatever a stream still buffers: the line must be flushed before ``end`` runs."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", line_buffering=False))
    at_end: list[bytes] = []
    with StallWatchdog(0.2, tmp_path, describe=lambda: "in base_lr_shared collect",
                       end=lambda code: at_end.append(raw.getvalue())):  # fmt: skip
        _until(lambda: at_end, 5.0)
    assert len(at_end) == 1
    line = at_end[0].decode()
    assert line.startswith("eval: stalled: nothing came back from the device for 0.2 s (in base_lr_shared collect)")
    assert line.endswith("rerun the same command to resume\n") and line.count("\n") == 1


def test_a_gap_of_exactly_the_limit_since_the_last_beat_is_a_stall_and_a_shorter_one_is_not(tmp_path, monkeypatch):
    clock = SetClock()  # the watchdog's own polling still sleeps for real
    monkeypatch.setattr(stall_watchdog, "time", SimpleNamespace(monotonic=clock))
    ended: list[int] = []
    with StallWatchdog(0.5, tmp_path, describe=lambda: "waiting", end=ended.append) as dog:  # beat at 1000.0
        clock.now = 1000.25
        time.sleep(0.3)  # two polls of 0.125 s see half the limit: quiet
        assert ended == [] and dog.fired is False
        clock.now = 1000.5  # exactly the limit
        _until(lambda: ended, 3.0)
    assert ended == [EXIT_STALLED] and dog.fired is True


@pytest.mark.parametrize(("seconds", "within_s"), [(1.6, 0.75), (600.0, 1.6)])
def test_an_overdue_stall_is_noticed_within_a_quarter_of_a_short_limit_and_a_second_of_a_long_one(
    tmp_path, monkeypatch, seconds, within_s
):
    """The watchdog looks every min(1 s, limit / 4): 0.4 s for a 1.6 s limit, 1 s for a 600 s one."""
    clock = SetClock()
    monkeypatch.setattr(stall_watchdog, "time", SimpleNamespace(monotonic=clock))
    ended: list[float] = []
    start = time.perf_counter()
    with StallWatchdog(
        seconds, tmp_path, describe=lambda: "waiting", end=lambda code: ended.append(time.perf_counter())
    ):
        clock.now += 10 * seconds  # long past the limit from the first look on
        _until(lambda: ended, 4.0)
    assert len(ended) == 1 and ended[0] - start < within_s
