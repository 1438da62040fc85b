"""Turns the JUnit XML of GPU-suite runs (``scripts/gpu_tests.sh``) into one record with provenance.

python3 scripts/gpu_tests_record.py OUT_DIR COMMAND [--planted FILE.json [--planted_filter S]] [--collected FILE.txt]

Reads ``OUT_DIR/run*.xml`` (and ``run*.seconds`` / ``run*.rc``), writes ``OUT_DIR/gpu_tests_<device>_<date>.json``
and ``.md`` (the files to copy into ``results/gpu_tests/``) and prints the markdown. With ``--collected`` (the node ids
``pytest -m gpu --collect-only -q`` printed before the runs), each run also says which collected tests it never
reached: a run stopped by its time budget then names what is left unproven instead of only its counts. With
``--planted_filter`` (the name filter ``scripts/plant_bugs.py`` ran with, ``GPU:``) the planted bugs the run never
reached are named the same way.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's lragent


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def parse_junit(path: str) -> dict:
    """Counts and the failed / errored test ids of one pytest JUnit file."""
    root = ET.parse(path).getroot()
    counts: Counter = Counter()
    failed, errors, skip_reasons = [], [], Counter()
    for case in root.iter("testcase"):
        if not case.get("name"):  # an interrupted xdist run leaves nameless entries (<testcase time=".." />): no test
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            errors.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skip_reasons[(case.find("skipped").get("message") or "")[:160]] += 1
        else:
            counts["passed"] += 1
    return {
        "passed": counts["passed"],
        "failed": counts["failed"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failed_tests": failed,
        "error_tests": errors,
        "skip_reasons": dict(skip_reasons),
    }


def junit_key(node_id: str) -> tuple[str, str]:
    """``(classname, name)`` as pytest's JUnit XML spells a node id: ``tests/test_a.py::TestB::test_c[x]`` ->
    ``("tests.test_a.TestB", "test_c[x]")``."""
    head, bracket, params = node_id.partition("[")  # a parameter id may itself hold "::"
    path, *parts = head.split("::")
    parts[-1:] = [parts[-1] + bracket + params] if parts else []
    module = path[: -len(".py")] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *parts[:-1]]), parts[-1] if parts else ""


def read_collected(path: str) -> list[str]:
    """The node ids of ``pytest --collect-only -q`` output (its summary and blank lines dropped)."""
    with open(path) as f:
        return [line.strip() for line in f if "::" in line and not line.startswith(("=", " "))]


def junit_cases(path: str) -> set[tuple[str, str]]:
    """``(classname, name)`` of every test case one JUnit file reports (run, failed, errored or skipped)."""
    return {(c.get("classname", ""), c.get("name", "")) for c in ET.parse(path).getroot().iter("testcase")}


def _run(argv: list[str]) -> str | None:
    """stdout of a command, or None when it fails or is not installed."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _embedded_model() -> str:
    from lragent.models import embedded_gguf_path, embedded_model_missing

    missing = embedded_model_missing()
    return f"available ({embedded_gguf_path()})" if missing is None else f"missing, model tests skip ({missing})"


def provenance(command: str) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = os.environ.get("LRAGENT_COMMIT") or _run(["git", "rev-parse", "HEAD"])
    commit = commit or "unknown (no .git on the device; set LRAGENT_COMMIT)"
    return {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit,
        "source_sha256": _read(os.path.join(os.environ.get("GPU_TESTS_OUT", "."), "source.sha256")) or None,
        "embedded_model": _embedded_model(),
        "command": command,
    }


def planted_names(name_filter: str) -> list[str]:
    """The planted-bug entries ``scripts/plant_bugs.py NAME_FILTER`` runs, in its order."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plant_bugs.py")
    spec = importlib.util.spec_from_file_location("plant_bugs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chosen([name_filter])


def record_runs(
    out_dir: str,
    command: str,
    planted: str | None = None,
    planted_filter: str | None = None,
    collected: str | None = None,
) -> int:
    """One record with provenance of the GPU-suite runs in ``out_dir``.

    Args:
        out_dir: the folder of the runs (run*.xml, run*.seconds, run*.rc).
        command: the command that ran them (provenance).
        planted: plant_bugs.py's results of the run (JSON).
        planted_filter: the name filter plant_bugs.py ran with: name those not run.
        collected: pytest --collect-only -q output: name the tests not reached.

    Returns:
        the exit status.
    """
    collected_ids = read_collected(collected) if collected and os.path.exists(collected) else None
    os.environ["GPU_TESTS_OUT"] = out_dir
    runs = []
    for xml in sorted(glob.glob(os.path.join(out_dir, "run*.xml"))):
        stem = xml[: -len(".xml")]
        rec = {"run": os.path.basename(stem), **parse_junit(xml)}
        rec["seconds"] = float(_read(stem + ".seconds", "nan"))
        rc = _read(stem + ".rc", "")
        rec["exit_code"] = int(rc) if rc.lstrip("-").isdigit() else None
        tail = _read(stem + ".log")[-4000:]  # timeout's SIGINT: exit 124, pytest's summary says KeyboardInterrupt
        rec["interrupted"] = rec["exit_code"] in (2, 124, 137) or "KeyboardInterrupt" in tail or "Interrupted" in tail
        if collected_ids is not None:
            seen = junit_cases(xml)
            rec["collected"] = len(collected_ids)
            rec["not_reached"] = [t for t in collected_ids if junit_key(t) not in seen]
        runs.append(rec)
    prov = provenance(command)
    record = {"provenance": prov, "runs": runs}
    if planted and os.path.exists(planted):
        record["planted_bugs"] = json.load(open(planted))
    if planted and planted_filter:  # a call cut short: the entries it never ran, named
        done = record.get("planted_bugs", {})
        record["planted_not_reached"] = [n for n in planted_names(planted_filter) if n not in done]
    dev = re.sub(r"[^A-Za-z0-9]+", "_", prov["device"]).strip("_").lower()
    stem = os.path.join(out_dir, f"gpu_tests_{dev}_{prov['date_utc'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    lines = [
        f"# GPU test suite: {prov['device']}, {prov['date_utc']}",
        "",
        f"torch {prov['torch']} (CUDA {prov['cuda']}), triton {prov['triton']}, python {prov['python']}; "
        f"commit {prov['commit']}; source sha256 {prov['source_sha256']}; embedded model: {prov['embedded_model']}",
        f"command: `{prov['command']}`",
        "",
        "| run | collected | passed | failed | errors | skipped | not reached | seconds | interrupted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['run']} | {r.get('collected', '?')} | {r['passed']} | {r['failed']} | {r['errors']} | "
            f"{r['skipped']} | {len(r['not_reached']) if 'not_reached' in r else '?'} | {r['seconds']:.0f} | "
            f"{r['interrupted']} |"
        )
    for r in runs:
        for t in r["failed_tests"] + r["error_tests"]:
            lines.append(f"- {r['run']} failed: `{t}`")
        for t in r.get("not_reached", []):
            lines.append(f"- {r['run']} did not reach: `{t}`")
    if "planted_bugs" in record or record.get("planted_not_reached"):
        lines += ["", "Planted bugs (exit != 0: the tests caught it):", ""]
        for name, res in record.get("planted_bugs", {}).items():
            lines.append(f"- {name}: exit {res['exit']}, {res['summary']}")
        for name in record.get("planted_not_reached", []):
            lines.append(f"- {name}: not reached")
    text = "\n".join(lines) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"record: {stem}.json / .md")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python3 scripts/gpu_tests_record.py OUT_DIR COMMAND [options]`` (:func:`record_runs`)."""
    from lragent.command import run_command

    return run_command(record_runs, argv, "scripts/gpu_tests_record.py", positional=["out_dir", "command"])


if __name__ == "__main__":
    sys.exit(main())
