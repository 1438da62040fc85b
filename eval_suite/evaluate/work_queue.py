"""The episodes of one ``eval --devices N`` run as a queue the shards share: each episode runs once, on whichever
shard has a free row first.

Why: a shard used to take every N-th question, all of its runs. Episode lengths vary a lot (HotpotQA on Qwen-1.5B:
mean 264 generated tokens, longest 1,985), so the shard that drew the long questions ran on while the others idled:
on four H100s (results/multi_gpu_h100x4, lease 6) the slowest HotpotQA shard took 6,968 decode steps against a mean
of 5,924. Taking episodes from one queue as rows free up gives every shard the same end, up to one episode.

How: a shard takes an episode by creating its claim file in the queue folder (``O_CREAT | O_EXCL``: exactly one
creator wins, also on a shared network filesystem that honours exclusive create). Episodes that a shard folder
beside this one already holds from an earlier, interrupted run are not run again. The records stay those of one
process: an episode's seed is a function of (seed, run, question) only, and with ``--batch_invariant true`` its
tokens do not depend on which episodes share its batch.

A queue folder belongs to one launch: ``eval --devices N`` empties ``OUT/queue`` before its shards start (claims of
a killed run name episodes that may never have finished). Stdlib only: the launcher imports it before torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

QUEUE_DIR = "queue"
"""The queue folder of ``eval --devices N`` inside its output folder."""


def claim_name(key: Sequence[object]) -> str:
    """The claim file name of an episode key ``(row, run, question id)``: a hash, so any question id is a safe name."""
    return hashlib.sha1(json.dumps([str(k) for k in key]).encode()).hexdigest()[:20]


class WorkQueue:
    """One shard's view of the shared queue.

    Args:
        folder: the queue folder (created if missing), shared by every shard of the run and empty at its launch.
        shard: this shard's name, written into its claims (who ran what, for a person reading the folder).
    """

    def __init__(self, folder: str | Path, shard: str = "") -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard = shard
        self.claimed = 0

    def claim(self, key: Sequence[object]) -> bool:
        """Takes the episode ``key`` for this shard: True if no shard had taken it, False if one had."""
        try:
            fd = os.open(self.folder / claim_name(key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise OSError(f"cannot write a claim in the work queue {self.folder}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as f:
            f.write(self.shard)
        self.claimed += 1
        return True


def clear_queue(out_dir: str | Path) -> Path:
    """Empties ``out_dir/queue`` for a new launch (claims of an earlier one may name episodes that never finished:
    the shards' episode logs say which did) and returns it."""
    folder = Path(out_dir) / QUEUE_DIR
    try:
        if folder.is_dir():  # a link to a folder elsewhere (a shared filesystem) stays a link: its claims go
            for entry in folder.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        elif folder.is_symlink() or folder.exists():
            raise OSError(f"{'a link to nothing' if folder.is_symlink() else 'not a folder'}")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OSError(f"cannot empty the work queue {folder}: {reason}; remove it and launch again") from None
    return folder


def sibling_logs(out_dir: str | Path, episodes_file: str) -> list[Path]:
    """The episode logs of the other shard folders beside ``out_dir`` (``OUT/shard_*`` of ``eval --devices N``)."""
    out = Path(out_dir).resolve()
    return sorted(p for p in out.parent.glob(f"shard_*/{episodes_file}") if p.parent != out)
