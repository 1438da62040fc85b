"""Which tests run each listed branch or line: the coverage report's per-item list.

python tests/coverage_items.py ITEMS.txt[.xz] COVERAGE_DB OUT.md [ROOT]   # ROOT: the checkout measured

``ITEMS`` is a list of branches and lines by file, as ``results/coverage/uncovered_before.txt.xz`` holds them::

    path/to/module.py
      105->106: <text of line 105> || <text of line 106>
      line 106: <text of line 106>

The line numbers are those of the commit the list was made at; each item is found again in today's source by its
text (the first 80 characters of the stripped line; a branch's target must lie within 40 lines of its source), so
moved code still matches. ``COVERAGE_DB`` is a ``.coverage`` file written with test contexts
(``pytest --cov-branch --cov-context=test``). An item counts as covered when its line ran, or its branch's arc was
taken, under some test; the report names up to two of those tests. An item whose text is no longer in the file is
listed as not found (code removed or rewritten).
"""

from __future__ import annotations

import lzma
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = 80


def read_items(path: Path) -> list[tuple[str, str, str, str]]:
    """``(file, kind, source text, target text)``: kind ``branch`` or ``line`` (target empty for a line)."""
    text = lzma.open(path, "rt").read() if path.suffix == ".xz" else path.read_text()
    items, current = [], None
    for raw in text.splitlines():
        if raw and not raw.startswith(" "):
            current = raw.strip()
        elif raw.strip().startswith("line "):
            items.append((current, "line", raw.split(": ", 1)[1].strip(), ""))
        elif "->" in raw.split(":", 1)[0]:
            src, _, dst = raw.split(": ", 1)[1].partition(" || ")
            items.append((current, "branch", src.strip(), dst.strip()))
    return items


def _find(lines: list[str], text: str, start: int = 0, stop: int | None = None) -> list[int]:
    key = text[:KEY]  # the list cut long lines: a line matches when it starts with the item's text
    stop = min(stop or len(lines), len(lines))
    return [i + 1 for i in range(max(start, 0), stop) if lines[i].strip().startswith(key)]


def coverage_by_test(db: Path, root: Path) -> tuple[dict, dict]:
    """Per file (relative to ``root``, the checkout the run measured): line -> tests, and (from, to) arc -> tests."""
    con = sqlite3.connect(db)
    files = {fid: str(Path(p).relative_to(root)) if Path(p).is_relative_to(root) else p
             for fid, p in con.execute("select id, path from file")}  # fmt: skip
    ctx = dict(con.execute("select id, context from context"))
    lines: dict = defaultdict(lambda: defaultdict(set))
    arcs: dict = defaultdict(lambda: defaultdict(set))
    for fid, cid, a, b in con.execute("select file_id, context_id, fromno, tono from arc"):
        arcs[files[fid]][(a, b)].add(ctx[cid])
        for n in (a, b):
            if n > 0:
                lines[files[fid]][n].add(ctx[cid])
    return lines, arcs


def _test_name(context: str) -> str:
    return context.rsplit("|", 1)[0]  # pytest-cov's "nodeid|run" (setup/teardown too)


def report(items_path: Path, db: Path, out: Path, root: Path = ROOT) -> dict[str, int]:
    """Writes the per-item table to ``out``; returns the counts (covered, not covered, not found). ``root``: the
    checkout the coverage run measured (its source is where the items are found)."""
    lines, arcs = coverage_by_test(db, root)
    rows, counts = [], {"covered": 0, "not covered": 0, "not found": 0}
    for file, kind, src, dst in read_items(items_path):
        path = root / file
        source = path.read_text().splitlines() if path.is_file() else []
        tests: set[str] = set()
        found = False
        for a in _find(source, src):
            if kind == "line":
                found = True
                tests |= lines[file].get(a, set())
                continue
            for b in _find(source, dst, a - 40, a + 40) if dst else []:  # a loop's branch jumps back
                found = True
                tests |= arcs[file].get((a, b), set())
        state = "not found" if not found else "covered" if tests else "not covered"
        counts[state] += 1
        names = sorted({_test_name(t) for t in tests if t})[:2]
        what = f"{src[:60]} → {dst[:40]}" if kind == "branch" else src[:100]
        rows.append(f"| `{file}` | {kind} | `{what.replace('|', '¦')}` | {state} | {'<br>'.join(names)} |")
    head = ["| file | kind | text | state | tests that run it (up to two) |", "|---|---|---|---|---|"]
    out.write_text("\n".join(head + rows) + "\n")
    return counts


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[1] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1])
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    root = Path(sys.argv[4]).resolve() if len(sys.argv) == 5 else ROOT
    print(report(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), root))
