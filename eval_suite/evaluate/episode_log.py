"""The episode log of an evaluation: one JSON line per finished episode, appended as soon as it finishes.

The log is the source of truth: summaries are computed from it alone, so an uninterrupted run, a resumed run and
merged shards give the same numbers. A record's key is ``(row, run, question id)``. Reading tolerates what a killed
writer leaves (a last line without its newline); :class:`EpisodeLog` repairs that before appending, so a resumed
run neither loses nor duplicates a finished episode; :func:`dedupe` keeps the first record of each key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from lragent.schemes import SCHEMES

ROLE_FIELDS: tuple[str, ...] = (
    "calls", "prefill_tokens", "decode_tokens", "prefill_s", "decode_s", "recomputed_tokens",
)  # fmt: skip
"""What a record keeps of each role's calls in an episode (``record["roles"][role]``)."""

EPISODES_FILE = "episodes.jsonl"
UNTRAINED = "untrained"
"""The row of the base model (adapters with B = 0: every scheme is the base model)."""


def record_key(rec: dict) -> tuple[str, int, str]:
    """The resume/merge key of a record: (row, run, question id)."""
    return rec["row"], int(rec["run"]), str(rec["qid"])


def read_episodes(path: Path, repair: bool = False) -> list[dict]:
    """Records of an episodes JSONL file.

    A last line without its newline (a killed writer) is kept if it parses, otherwise dropped; with ``repair`` the
    file is cut back to its last complete line (or the parsed line gets its newline). A broken line before the last
    raises ``ValueError``.
    """
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: broken JSON line ({exc.msg}); fix or remove it") from None
    if tail.strip():
        try:
            records.append(json.loads(tail))
            if repair:
                with path.open("ab") as f:
                    f.write(b"\n")
        except json.JSONDecodeError:
            if repair:
                with path.open("r+b") as f:
                    f.truncate(len(data) - len(tail))
    return records


class EpisodeLog:
    """Appends records to an episodes file, one flushed (and fsynced) line each.

    Opening repairs a torn last line first (:func:`read_episodes` with ``repair``); :attr:`records` holds what
    was in the file then.

    Args:
        path: the ``episodes.jsonl`` file (created if missing; its directory must exist).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records = read_episodes(self.path, repair=True)
        self._file = self.path.open("a", encoding="utf-8")

    def append(self, rec: dict) -> None:
        """Writes one record as a line and makes it durable before returning."""
        self._file.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Closes the file."""
        self._file.close()

    def __enter__(self) -> EpisodeLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def row_order(rows: Iterable[str]) -> list[str]:
    """``untrained`` first, then the schemes in their canonical order, each followed by its constrained variants
    (``scheme+constrained...``), then anything else alphabetically."""
    order = {name: i for i, name in enumerate((UNTRAINED, *SCHEMES))}

    def key(row: str) -> tuple[int, str, str]:
        base, _, variant = row.partition("+")
        return order.get(base, len(order)), variant, row

    return sorted(set(rows), key=key)


def dedupe(records: Iterable[dict]) -> tuple[list[dict], int]:
    """One record per key (the first one), sorted by (row, run, level, qid); returns also the duplicates dropped."""
    seen: dict[tuple, dict] = {}
    dups = 0
    for rec in records:
        k = record_key(rec)
        if k in seen:
            dups += 1
            continue
        seen[k] = rec
    rank = {r: i for i, r in enumerate(row_order(k[0] for k in seen))}
    ordered = sorted(seen.values(), key=lambda r: (rank[r["row"]], int(r["run"]), r["level"], str(r["qid"])))
    return ordered, dups
