"""The episode queue that the shards of ``eval --devices N`` share (:mod:`eval_suite.evaluate.work_queue`): every
episode runs
exactly once across the shards, the merge equals one process's run, and a relaunch after a kill runs exactly what
no shard finished. With the fake policy of ``test_eval_runner`` (no model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cli
from eval_suite.evaluate import shard_launch
from eval_suite.evaluate.benchmarks import load_questions
from eval_suite.evaluate.episode_log import EPISODES_FILE, read_episodes, record_key
from eval_suite.evaluate.eval_report import merge_dirs, write_summary
from eval_suite.evaluate.run_eval import shard_queue
from eval_suite.evaluate.work_queue import QUEUE_DIR, WorkQueue, claim_name, clear_queue
from tests.test_eval_runner import _run

RUNS, SCHEMES = 2, ("non_shared", "base_lr_shared")


@pytest.fixture(scope="module")
def questions():
    return load_questions("hotpotqa", limit=9)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, questions):
    """One process's summary of the same episodes."""
    out = tmp_path_factory.mktemp("one")
    records, _ = _run(out, questions)
    return write_summary(records, out)


def _keys(*dirs: Path) -> list[tuple]:
    return [record_key(r) for d in dirs for r in read_episodes(d / EPISODES_FILE)]


def test_shards_of_one_queue_run_each_episode_once_and_merge_to_one_run(tmp_path, questions, reference):
    """Shard 0 takes 10 episodes, shard 1 then everything left, shard 0 again finds nothing: each of the 36 episodes
    ran once, on one shard, and the merge is the one-process summary. Every shard gets all the questions."""
    queue = tmp_path / QUEUE_DIR
    s0, s1 = tmp_path / "shard_0", tmp_path / "shard_1"
    _, first = _run(s0, questions, work_queue=WorkQueue(queue, "0/2"), max_episodes=10)
    _, second = _run(s1, questions, work_queue=WorkQueue(queue, "1/2"))
    _, third = _run(s0, questions, work_queue=WorkQueue(queue, "0/2"))
    assert (first.calls, second.calls, third.calls) == (10, 26, 0)
    keys = _keys(s0, s1)
    assert len(keys) == len(set(keys)) == 2 * RUNS * 9
    assert len(list(queue.iterdir())) == 36 and (queue / claim_name(keys[0])).read_text() == "0/2"
    assert merge_dirs([s0, s1], tmp_path / "merged") == reference


def test_a_relaunch_runs_exactly_what_no_shard_finished(tmp_path, questions, reference):
    """A killed launch left shard 0 with 10 finished episodes and shard 1 with 5 claimed but unfinished. The next
    launch empties the queue (the launcher does, before its shards start) and each shard skips what the other's log
    holds: the 26 missing episodes run, none twice."""
    s0, s1 = tmp_path / "shard_0", tmp_path / "shard_1"
    queue = clear_queue(tmp_path)
    _run(s0, questions, work_queue=WorkQueue(queue, "0/2"), max_episodes=10)
    finished = set(_keys(s0))
    unfinished = [k for k in [(s, r, q.qid) for s in SCHEMES for r in range(RUNS) for q in questions]
                  if k not in finished][:5]  # fmt: skip
    for key in unfinished:  # claimed by shard 1, which was killed before their records were written
        assert WorkQueue(queue, "1/2").claim(key)
    queue = clear_queue(tmp_path)
    assert list(queue.iterdir()) == []
    calls = 0
    for shard in (s1, s0):  # shard 1 comes up first: it must not redo shard 0's ten
        q, elsewhere = shard_queue(str(queue), shard.name, shard)
        _, factory = _run(shard, questions, work_queue=q, done_elsewhere=elsewhere)
        calls += factory.calls
    assert calls == 36 - 10
    keys = _keys(s0, s1)
    assert len(keys) == len(set(keys)) == 36 and set(unfinished) <= set(keys)
    assert merge_dirs([s0, s1], tmp_path / "merged") == reference


def test_a_claim_is_taken_once_among_racing_processes(tmp_path):
    """Four processes claim the same 300 episodes at once: each episode is claimed exactly once (exclusive create)."""
    code = (
        "import sys; from eval_suite.evaluate.work_queue import WorkQueue\n"
        "q = WorkQueue(sys.argv[1], sys.argv[2])\n"
        "print(sum(q.claim(('non_shared', r, str(i))) for r in range(3) for i in range(100)))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "q"), str(i)], stdout=subprocess.PIPE,
                              text=True) for i in range(4)]  # fmt: skip
    won = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(won) == 300 and len(list((tmp_path / "q").iterdir())) == 300


def test_the_launcher_gives_every_shard_the_emptied_queue(tmp_path, monkeypatch):
    """spawn_shards empties OUT/queue (a killed launch's claims) and passes it to each shard as --work_queue."""
    started: list[list[str]] = []

    class Proc:
        def __init__(self, cmd, **kw):
            started.append(cmd)

    monkeypatch.setattr(shard_launch.subprocess, "Popen", Proc)
    stale = tmp_path / "o" / QUEUE_DIR / claim_name(("non_shared", 0, "q1"))
    stale.parent.mkdir(parents=True)
    stale.write_text("0/2")
    _, logs, _ = shard_launch.spawn_shards(2, tmp_path / "o", ["--limit", "4"], 0, "cpu", {})
    for log in logs:
        log.close()
    assert not stale.exists()
    for i, cmd in enumerate(started):
        at = cmd.index("--work_queue")
        assert cmd[at + 1] == str(tmp_path / "o" / QUEUE_DIR) and cmd[cmd.index("--shard") + 1] == f"{i}/2"


@pytest.mark.parametrize("extra", [["--work_queue", "q"], ["--shard", "0/2"]])
def test_devices_with_its_own_shard_options_is_refused_in_one_line(extra, tmp_path, capsys):
    argv = ["eval", "--benchmark", "hotpotqa", "--limit", "4", "--adapter_init", "random", "--device", "cpu",
            "--devices", "2", *extra, "--out", str(tmp_path / "o")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: --devices N runs its own shards and queue: give --devices or {extra[0]}, not both"


def test_a_queue_that_is_a_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "q").write_text("")
    argv = ["eval", "--benchmark", "hotpotqa", "--limit", "4", "--adapter_init", "random", "--device", "cpu",
            "--shard", "0/2", "--work_queue", str(tmp_path / "q"), "--out", str(tmp_path / "o")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: --work_queue {tmp_path / 'q'} is a file: give a folder that the shards share"
