"""Plants each bug a test guards against in a scratch copy of the repo and runs the tests that must catch it.

python scripts/plant_bugs.py [NAME_SUBSTRING ...]      # results: results/planted_bugs.json
                                                        # (or $LRAGENT_PLANTED_RESULTS)

The entries are in tests/planted_bugs.yaml, each a name holding file, old, new and tests: the file to change, the
text to replace (exactly once in that file), its replacement, and the pytest arguments whose tests must catch it. old
and new may be lists of strings replaced pairwise (a bug planted in several places). Entries whose tests are GPU-marked
catch their bug only on a GPU (without one they skip: exit 0).
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRATCH = os.environ.get("LRAGENT_PLANT_SCRATCH", "/tmp/lragent_plant_copy")
RESULTS = os.environ.get("LRAGENT_PLANTED_RESULTS") or os.path.join(ROOT, "results", "planted_bugs.json")
CATALOGUE = os.path.join(ROOT, "tests", "planted_bugs.yaml")


def load(path: str = CATALOGUE) -> dict[str, tuple]:
    """The entries of ``path`` in its order, each as (file, old, new, tests); old and new lists become tuples."""
    with open(path) as f:
        entries = yaml.safe_load(f)
    as_tuple = lambda v: tuple(v) if isinstance(v, list) else v
    return {name: (e["file"], as_tuple(e["old"]), as_tuple(e["new"]), e["tests"]) for name, e in entries.items()}


BUGS = load()


def run_one(name: str, results: dict) -> None:
    """Plants entry ``name`` in a fresh scratch copy, runs its tests there and records the outcome in ``results``."""
    path, old, new, tests = BUGS[name]
    scratch = SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(
        ROOT, scratch, ignore=shutil.ignore_patterns(".git", ".gguf*", ".whl", "data", "__pycache__", ".hypothesis")
    )
    os.symlink(f"{ROOT}/data", f"{scratch}/data")
    src = open(f"{scratch}/{path}").read()
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,))), strict=True):
        assert src.count(o) == 1, (name, src.count(o))
        src = src.replace(o, n)
    open(f"{scratch}/{path}", "w").write(src)
    r = subprocess.run(
        f"cd {scratch} && OMP_NUM_THREADS=1 timeout 1500 {sys.executable} -m pytest -q -x -n 0 -p no:cacheprovider "
        f"{tests}",  # -n 0: one process (the default run's workers would only slow a -x run)
        shell=True,
        capture_output=True,
        text=True,
    )
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
    failed = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    results[name] = {"exit": r.returncode, "summary": tail, "failed": failed}
    print(name, "->", r.returncode, tail, failed, flush=True)


def save(results: dict) -> None:
    """Merges the entries run so far into RESULTS (through a temporary file: a kill mid-write leaves the old file)."""
    merged = json.load(open(RESULTS)) if os.path.exists(RESULTS) else {}
    merged.update(results)
    text = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731
    lines = [f"{text(name)}: {text(r)}" for name, r in merged.items()]
    with open(RESULTS + ".part", "w") as f:  # one entry a line: small, and a rerun's diff is its own lines
        f.write("{\n" + ",\n".join(lines) + "\n}\n")
    os.replace(RESULTS + ".part", RESULTS)


def chosen(only: list[str]) -> list[str]:
    """The entries whose names hold one of ``only`` (all of them for none), in their order."""
    return [name for name in BUGS if not only or any(o in name for o in only)]


def plant(names: list[str] | None = None) -> int:
    """Plants each chosen bug in a scratch copy and runs the tests that must catch it; results to RESULTS.

    Args:
        names: substrings of entry names: an entry runs when its name holds one of them (none: every entry).

    Returns:
        0, or 130 when interrupted (what finished is kept).
    """
    # an interrupt stops the run even where this process started with SIGINT ignored (a background job of a
    # non-interactive shell, as `cmd &` in a script): without a handler Python would never raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    only = list(names or [])
    names, results, current = chosen(only), {}, None
    try:
        for current in names:
            run_one(current, results)
            save(results)  # after every entry: a call cut short keeps what finished
    except KeyboardInterrupt:  # a device call's `timeout -s INT`, or ^C: one line, what finished kept
        print(
            f"plant_bugs: interrupted during {current!r}: {len(results)} of {len(names)} run, kept in {RESULTS}",
            file=sys.stderr,
            flush=True,
        )
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python scripts/plant_bugs.py [NAME_SUBSTRING ...]`` (:func:`plant`); ``--help`` also lists the entries."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        print("\nentries:\n  " + "\n  ".join(BUGS))
        return 0
    sys.path.insert(0, ROOT)  # this checkout's lragent (its command machinery), whatever is installed
    from lragent.command import run_command

    return run_command(plant, argv, "scripts/plant_bugs.py", positional=["names"])


if __name__ == "__main__":  # importable: BUGS and chosen() for the GPU suite's record
    sys.exit(main())
