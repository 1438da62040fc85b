"""The output-directory lock of the eval commands (:mod:`eval_suite.evaluate.dir_lock`): ``flock`` on
``DIR/.eval.lock``, which records its holder (pid, host, UTC start time); a second holder is refused with one line
naming the folder and the holder; the kernel drops the lock of a holder that dies, so no stale lock remains.

``flock`` locks belong to an open file description, so a second ``os.open`` of the file in this same process
competes with the first exactly as another process would; one test uses a real child process for the death of a
holder."""

from __future__ import annotations

import datetime as dt
import fcntl
import os
import platform
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval_suite.evaluate.dir_lock import LOCK_FILE, DirectoryBusyError, DirectoryLock

LINE = re.compile(r"pid (\d+) on (.*) since (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)\n")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _hold(path: Path, content: bytes) -> int:
    """Takes ``path``'s flock through a raw descriptor (as another holder would) and writes ``content``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.pwrite(fd, content, 0)
    return fd


def _free(path: Path) -> bool:
    """Whether a fresh descriptor can take ``path``'s flock now (it is released again at once)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_lock_file_name_and_attributes(tmp_path: Path) -> None:
    """The lock lives in ``DIR/.eval.lock``; the constructor only records the folder, the work's name and the path
    (no file, no descriptor yet), accepting a str folder as well as a Path."""
    assert LOCK_FILE == ".eval.lock"
    lock = DirectoryLock(str(tmp_path / "out"), what="merge")
    assert lock.directory == tmp_path / "out" and isinstance(lock.directory, Path)
    assert lock.what == "merge"
    assert lock.path == tmp_path / "out" / ".eval.lock"
    assert lock._fd is None
    assert not (tmp_path / "out").exists()
    assert DirectoryLock(tmp_path).what == "eval"


def test_acquire_creates_missing_folders_and_writes_the_holder_line(tmp_path: Path, monkeypatch) -> None:
    """Acquiring creates the missing folder (parents included) and the lock file (mode 0644), and writes exactly one
    line ``pid PID on HOST since YYYY-MM-DDTHH:MM:SSZ`` at its start: this process, this host, the UTC time of the
    acquisition (whatever the local time zone)."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a local time would not fall in the UTC window below
    time.tzset()
    old_umask = os.umask(0)
    try:
        out = tmp_path / "a" / "b" / "c"
        lock = DirectoryLock(out)
        before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        lock.acquire()
        after = dt.datetime.now(dt.timezone.utc)
    finally:
        os.umask(old_umask)
        monkeypatch.delenv("TZ")
        time.tzset()
    try:
        path = out / ".eval.lock"
        assert path.is_file()
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        raw = path.read_bytes()
        m = LINE.fullmatch(raw.decode())
        assert m is not None, raw
        assert raw == f"pid {os.getpid()} on {platform.node()} since {m.group(3)}\n".encode()
        assert int(m.group(1)) == os.getpid() and m.group(2) == platform.node()
        started = dt.datetime.strptime(m.group(3), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        assert before <= started <= after
        assert not _free(path)
    finally:
        lock.release()


def test_acquire_in_an_existing_folder_keeps_its_files(tmp_path: Path) -> None:
    """An existing output folder is used as it is: its other files stay."""
    (tmp_path / "episodes.jsonl").write_text("{}\n")
    with DirectoryLock(tmp_path):
        assert (tmp_path / "episodes.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".eval.lock", "episodes.jsonl"]


def test_a_leftover_unlocked_file_is_overwritten(tmp_path: Path) -> None:
    """A lock file that nobody holds (left by a run that ended) means nothing: the next run takes the lock and the
    file holds only its own line (no tail of the old, longer content)."""
    (tmp_path / ".eval.lock").write_text("pid 1 on some-old-host-with-a-long-name since 2000-01-01T00:00:00Z\n" * 5)
    with DirectoryLock(tmp_path):
        raw = (tmp_path / ".eval.lock").read_text()
        assert LINE.fullmatch(raw) and raw.startswith(f"pid {os.getpid()} on ")


def test_second_holder_is_refused_naming_folder_and_holder(tmp_path: Path) -> None:
    """While one lock holds the folder, another is refused with a DirectoryBusyError (a ValueError: a user error)
    whose one-line message names the folder, the work and the holder's line; the first lock keeps the folder and the
    file keeps the holder's line."""
    first = DirectoryLock(tmp_path)
    first.acquire()
    try:
        line = (tmp_path / ".eval.lock").read_text().strip()
        second = DirectoryLock(tmp_path, what="merge")
        with pytest.raises(DirectoryBusyError) as info:
            second.acquire()
        assert isinstance(info.value, ValueError)
        assert str(info.value) == (
            f"{tmp_path} is in use by another merge ({line}); wait for it to end or use another --out"
        )
        assert info.value.__cause__ is None and info.value.__suppress_context__
        assert second._fd is None
        assert (tmp_path / ".eval.lock").read_text() == line + "\n"
        assert not _free(tmp_path / ".eval.lock")
        with pytest.raises(DirectoryBusyError, match=r"is in use by another eval \(pid "):
            DirectoryLock(tmp_path).acquire()
    finally:
        first.release()


def test_refusal_closes_its_descriptor(tmp_path: Path) -> None:
    """A refused acquisition leaves no descriptor open behind it."""
    fd = _hold(tmp_path / ".eval.lock", b"pid 7 on elsewhere since 2024-01-01T00:00:00Z\n")
    try:
        before = _open_fds()
        for _ in range(3):
            with pytest.raises(DirectoryBusyError):
                DirectoryLock(tmp_path).acquire()
        assert _open_fds() == before
    finally:
        os.close(fd)


def test_refusal_with_an_empty_lock_file_names_an_unknown_process(tmp_path: Path) -> None:
    """A holder that wrote nothing yet (or only blanks) is named ``unknown process``."""
    fd = _hold(tmp_path / ".eval.lock", b"  \n")
    try:
        with pytest.raises(DirectoryBusyError) as info:
            DirectoryLock(tmp_path).acquire()
        assert str(info.value) == (
            f"{tmp_path} is in use by another eval (unknown process); wait for it to end or use another --out"
        )
    finally:
        os.close(fd)


def test_refusal_reads_the_first_512_bytes_and_replaces_bad_utf8(tmp_path: Path) -> None:
    """The holder named is the file's first 512 bytes, from its start, decoded as UTF-8 with bad bytes replaced and
    surrounding blanks stripped."""
    content = b" \xffholder" + b"x" * 600
    fd = _hold(tmp_path / ".eval.lock", content)
    try:
        with pytest.raises(DirectoryBusyError) as info:
            DirectoryLock(tmp_path).acquire()
        holder = content[:512].decode("utf-8", "replace").strip()
        assert holder.startswith("\ufffdholderx") and len(holder) == 511
        assert str(info.value) == (
            f"{tmp_path} is in use by another eval ({holder}); wait for it to end or use another --out"
        )
    finally:
        os.close(fd)


def test_release_frees_the_lock_keeps_the_file_and_closes_the_descriptor(tmp_path: Path) -> None:
    """Releasing unlocks and closes the descriptor (no descriptor left open), keeps the file, and lets another lock
    take the folder; releasing again, or releasing a lock never acquired, does nothing."""
    DirectoryLock(tmp_path).release()  # never acquired: nothing to do
    before = _open_fds()
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    assert lock._fd is not None and str(lock._fd) in _open_fds()
    lock.release()
    assert lock._fd is None
    assert _open_fds() == before
    assert (tmp_path / ".eval.lock").is_file()
    assert _free(tmp_path / ".eval.lock")
    lock.release()
    assert lock._fd is None
    with DirectoryLock(tmp_path):
        pass


def test_the_same_object_can_be_acquired_again_after_release(tmp_path: Path) -> None:
    """A released lock can be taken again, and refuses others again while held."""
    lock = DirectoryLock(tmp_path)
    for _ in range(2):
        lock.acquire()
        with pytest.raises(DirectoryBusyError):
            DirectoryLock(tmp_path).acquire()
        lock.release()
        assert _free(tmp_path / ".eval.lock")


def test_context_manager_holds_inside_and_releases_after(tmp_path: Path) -> None:
    """``with DirectoryLock(out) as lock`` gives the lock itself, held inside the block and released after it."""
    before = _open_fds()
    with DirectoryLock(tmp_path / "out") as lock:
        assert isinstance(lock, DirectoryLock) and lock.directory == tmp_path / "out"
        assert lock._fd is not None
        with pytest.raises(DirectoryBusyError):
            DirectoryLock(tmp_path / "out").acquire()
    assert lock._fd is None
    assert _open_fds() == before
    assert _free(tmp_path / "out" / ".eval.lock")


def test_context_manager_releases_on_exception_and_lets_it_through(tmp_path: Path) -> None:
    """An exception inside the block releases the lock and propagates unchanged (the lock does not swallow it)."""
    with pytest.raises(KeyError, match="boom"):
        with DirectoryLock(tmp_path) as lock:
            raise KeyError("boom")
    assert lock._fd is None
    assert _free(tmp_path / ".eval.lock")


def test_a_refused_with_block_does_not_run(tmp_path: Path) -> None:
    """A refused ``with`` raises before its block runs, and leaves the holder's lock in place."""
    ran = []
    with DirectoryLock(tmp_path):
        with pytest.raises(DirectoryBusyError):
            with DirectoryLock(tmp_path):
                ran.append(1)
        assert not _free(tmp_path / ".eval.lock")
    assert ran == []


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    """Another process holding the lock refuses this one with its own pid in the message; once it is killed
    (SIGKILL: no clean-up of its own) the kernel has dropped its lock, and this process takes the folder, its line
    replacing the dead holder's."""
    child_code = (
        "import sys, time\n"
        "from eval_suite.evaluate.dir_lock import DirectoryLock\n"
        "DirectoryLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen(
        [sys.executable, "-c", child_code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout.readline() == "held\n"
        with pytest.raises(DirectoryBusyError, match=rf"\(pid {child.pid} on "):
            DirectoryLock(tmp_path).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        child.stdout.close()
    with DirectoryLock(tmp_path):
        assert (tmp_path / ".eval.lock").read_text().startswith(f"pid {os.getpid()} on ")
