"""The episode queue that the shards of ``eval --devices N`` share (:mod:`eval_suite.evaluate.work_queue`): every
episode runs
exactly once across the shards, the merge equals one process's run, and a relaunch after a kill runs exactly what
no shard finished. With the fake policy of ``test_eval_runner`` (no model)."""

from __future__ import annotations

import json
import locale
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from eval_suite.evaluate import shard_launch
from eval_suite.evaluate.benchmarks import load_questions
from eval_suite.evaluate.episode_log import EPISODES_FILE, EpisodeLog, dedupe, read_episodes, record_key, row_order
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


# ------------------------------------------------------------------------------- the queue's own files, one by one
def test_a_claim_file_is_named_by_a_fixed_20_character_hash_of_the_key_whatever_the_question_id():
    """The name is the queue's on-disk format: the same for every shard, and a plain file name for any question id
    (slashes, spaces, non-ASCII); the run number names the same episode as an int or a string."""
    assert claim_name(("non_shared", 0, "q1")) == "344ff5c4a9175b0b41ff"
    assert claim_name(("base_lr_shared", 1, "dir/q é 2")) == "71ab3fc48e059a0c68a5"
    assert claim_name(("non_shared", "0", "q1")) == claim_name(("non_shared", 0, "q1"))


def test_a_claim_file_holds_the_shard_name_and_an_unnamed_shard_leaves_it_empty(tmp_path):
    named, unnamed = WorkQueue(tmp_path / "q", "1/4"), WorkQueue(tmp_path / "q")
    assert named.claim(("non_shared", 0, "a")) and unnamed.claim(("non_shared", 0, "b"))
    assert (tmp_path / "q" / claim_name(("non_shared", 0, "a"))).read_text() == "1/4"
    assert (tmp_path / "q" / claim_name(("non_shared", 0, "b"))).read_text() == ""


def test_claimed_counts_only_the_episodes_this_shard_won(tmp_path):
    mine, other = WorkQueue(tmp_path / "q", "0/2"), WorkQueue(tmp_path / "q", "1/2")
    assert mine.claimed == 0
    assert other.claim(("non_shared", 0, "taken"))
    assert [mine.claim(("non_shared", 0, q)) for q in ("a", "taken", "b", "a", "c")] == [True, False, True, False, True]
    assert (mine.claimed, other.claimed) == (3, 1)


def test_a_claim_file_is_a_plain_readable_file_not_an_executable_one(tmp_path):
    """Under the usual 022 umask a claim is rw-r--r-- (mode 0o644): readable by whoever inspects the queue."""
    old = os.umask(0o022)
    try:
        assert WorkQueue(tmp_path / "q", "0/2").claim(("non_shared", 0, "q1"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "q" / claim_name(("non_shared", 0, "q1"))).stat().st_mode) == 0o644


def test_a_work_queue_creates_its_folder_with_any_missing_parents(tmp_path):
    q = WorkQueue(tmp_path / "out" / "nested" / QUEUE_DIR, "0/2")
    assert q.folder.is_dir() and q.claim(("non_shared", 0, "q1"))


def test_a_claim_that_cannot_be_written_raises_naming_the_queue_folder(tmp_path):
    """Not a silent False (that would drop the episode from every shard): an OSError naming the folder and why."""
    q = WorkQueue(tmp_path / "q", "0/2")
    shutil.rmtree(tmp_path / "q")  # the shared folder vanished under the running shard
    with pytest.raises(OSError) as err:
        q.claim(("non_shared", 0, "q1"))
    assert str(err.value) == f"cannot write a claim in the work queue {tmp_path / 'q'}: No such file or directory"


def test_clear_queue_creates_the_output_folder_and_its_queue_when_neither_exists(tmp_path):
    out = tmp_path / "runs" / "new_eval"
    assert clear_queue(out) == out / QUEUE_DIR
    assert (out / QUEUE_DIR).is_dir() and list((out / QUEUE_DIR).iterdir()) == []


def test_clear_queue_returns_a_usable_queue_when_the_folder_cannot_be_removed(tmp_path):
    """``OUT/queue`` a link to a folder elsewhere (rmtree refuses links): clear_queue does not fail on the folder
    that is still there but returns it, and the shards can claim in it."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / QUEUE_DIR).symlink_to(tmp_path / "shared", target_is_directory=True)
    stale = tmp_path / "shared" / claim_name(("non_shared", 0, "q1"))
    stale.write_text("1/2")  # an earlier launch's claim of an episode that may never have finished
    (tmp_path / "shared" / "leftover").mkdir()
    folder = clear_queue(tmp_path / "out")
    assert folder == tmp_path / "out" / QUEUE_DIR and folder.is_dir() and folder.is_symlink()
    assert list(folder.iterdir()) == []  # the link kept, the earlier launch's claims gone
    assert WorkQueue(folder, "0/2").claim(("non_shared", 0, "q1"))
    assert stale.read_text() == "0/2"


@pytest.mark.parametrize("kind", ["file", "dangling link"])
def test_clear_queue_names_a_queue_that_is_no_folder(tmp_path, kind):
    (tmp_path / "out").mkdir()
    queue = tmp_path / "out" / QUEUE_DIR
    if kind == "file":
        queue.write_text("x")
    else:
        queue.symlink_to(tmp_path / "gone", target_is_directory=True)
    with pytest.raises(OSError) as err:
        clear_queue(tmp_path / "out")
    why = "not a folder" if kind == "file" else "a link to nothing"
    assert str(err.value) == f"cannot empty the work queue {queue}: {why}; remove it and launch again"


# -------------------------------------------------- the episode logs that the shards resume from and are merged from
def _rec(row: str, run: int | str, qid: int | str, level: str = "easy", **extra) -> dict:
    return {"row": row, "run": run, "level": level, "qid": qid, **extra}


def _line(rec: dict) -> bytes:
    return (json.dumps(rec, ensure_ascii=False) + "\n").encode()


def test_dedupe_keeps_the_first_record_of_each_key_counts_every_duplicate_and_sorts_by_row_run_level_qid():
    """Question ids sort as strings ("10" < "5" < "9"); an int and a str run or qid are the same key."""
    records = [
        _rec("non_shared", 0, "9", v="first"),
        _rec("non_shared", 0, "9", v="second"),
        _rec("non_shared", 0, "10"),
        _rec("non_shared", "0", "9", v="third"),
        _rec("untrained", 1, "1", level="hard"),
        _rec("non_shared", "1", "2"),
        _rec("non_shared", 0, 5),
        _rec("non_shared", 0, "5", v="dup of the int qid"),
        _rec("non_shared", 0, "1", level="medium"),
    ]
    kept, dups = dedupe(records)
    assert dups == 3
    assert [(r["row"], r["run"], r["level"], r["qid"], r.get("v")) for r in kept] == [
        ("untrained", 1, "hard", "1", None),
        ("non_shared", 0, "easy", "10", None),
        ("non_shared", 0, "easy", 5, None),
        ("non_shared", 0, "easy", "9", "first"),
        ("non_shared", 0, "medium", "1", None),
        ("non_shared", "1", "easy", "2", None),
    ]
    assert dedupe([]) == ([], 0)


def test_row_order_puts_untrained_then_the_schemes_in_canonical_order_each_before_its_variants_then_the_rest():
    """A variant is everything after the scheme's first "+" (it may hold another "+"); unknown rows come last,
    alphabetically; each row once."""
    rows = ["zeta", "base_lr_shared+constrained", "non_shared+constrained:answer", "alpha", "non_shared",
            "untrained", "base_lr_shared", "non_shared+constrained", "non_shared+constrained+retry", "full_shared",
            "non_shared", "droidspeak+answer_text"]  # fmt: skip
    assert row_order(rows) == [
        "untrained",
        "non_shared",
        "non_shared+constrained",
        "non_shared+constrained+retry",
        "non_shared+constrained:answer",
        "full_shared",
        "droidspeak+answer_text",
        "base_lr_shared",
        "base_lr_shared+constrained",
        "alpha",
        "zeta",
    ]


def test_reading_a_log_keeps_a_parseable_unterminated_last_line_skips_blank_lines_and_leaves_the_file_as_it_was(
    tmp_path,
):
    r1, r2, r3 = _rec("non_shared", 0, "a"), _rec("non_shared", 0, "b"), _rec("non_shared", 0, "c")
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(_line(r1) + b"\n  \n" + _line(r2) + _line(r3).rstrip(b"\n"))
    before = whole.read_bytes()
    assert read_episodes(whole) == [r1, r2, r3]
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(_line(r1) + _line(r2) + b'{"row": "non_sh')
    torn_before = torn.read_bytes()
    assert read_episodes(torn) == [r1, r2]
    assert (whole.read_bytes(), torn.read_bytes()) == (before, torn_before)  # no repair unless asked
    assert read_episodes(tmp_path / "missing.jsonl") == []


def test_a_broken_line_before_the_last_raises_naming_the_file_and_its_line_number(tmp_path):
    """Line numbers count every line of the file, blank ones too (here the third)."""
    path = tmp_path / EPISODES_FILE
    path.write_bytes(_line(_rec("non_shared", 0, "a")) + b"\n" + b"{broken\n" + _line(_rec("non_shared", 0, "b")))
    with pytest.raises(ValueError) as err:
        read_episodes(path)
    assert str(err.value) == (
        f"{path}:3: broken JSON line (Expecting property name enclosed in double quotes); fix or remove it"
    )


def test_repair_cuts_a_torn_last_line_back_to_the_last_complete_record(tmp_path):
    r1, r2 = _rec("non_shared", 0, "a"), _rec("non_shared", 0, "b", answer="Zürich")
    path = tmp_path / EPISODES_FILE
    path.write_bytes(_line(r1) + _line(r2) + b'{"row": "non_shared", "ru')
    assert read_episodes(path, repair=True) == [r1, r2]
    assert path.read_bytes() == _line(r1) + _line(r2)


def test_repair_ends_a_parseable_last_line_with_its_newline(tmp_path):
    r1, r2 = _rec("non_shared", 0, "a"), _rec("non_shared", 0, "b")
    path = tmp_path / EPISODES_FILE
    path.write_bytes(_line(r1) + _line(r2).rstrip(b"\n"))
    assert read_episodes(path, repair=True) == [r1, r2]
    assert path.read_bytes() == _line(r1) + _line(r2)


@pytest.mark.parametrize("tail", [b'{"row": "non_sh', b'{"row": "non_shared", "run": 0, "level": "easy", "qid": "t"}'])
def test_an_episode_log_opened_after_a_killed_writer_appends_each_record_on_its_own_line(tmp_path, tail):
    """A torn last line is cut (or, when it parses, kept and ended) before the first append: no record is lost,
    glued to another or duplicated."""
    r1, new = _rec("non_shared", 0, "a"), _rec("non_shared", 1, "a")
    path = tmp_path / EPISODES_FILE
    path.write_bytes(_line(r1) + tail)
    kept = [r1] if tail.endswith(b"non_sh") else [r1, json.loads(tail)]
    with EpisodeLog(path) as log:
        assert log.records == kept
        log.append(new)
    assert read_episodes(path) == [*kept, new]
    assert path.read_bytes() == b"".join(_line(r) for r in [*kept, new])


def test_the_episode_log_writes_non_ascii_text_as_itself_in_utf8_whatever_the_locale(tmp_path):
    """Under the C locale (ASCII, as on many servers) an answer "Zürich – 東京" is written as those UTF-8 bytes,
    not \\u escapes, and reads back equal."""
    rec = _rec("non_shared", 0, "q1", answer="Zürich – 東京")
    path = tmp_path / EPISODES_FILE
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        with EpisodeLog(path) as log:
            log.append(rec)
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)
    assert "Zürich – 東京".encode() in path.read_bytes()
    assert path.read_bytes() == (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
    assert read_episodes(path) == [rec]
