"""``bench eval``: evaluation throughput in episodes per GPU-second, and where the rest of the time goes.

Runs ``cli.py eval`` jobs (each a string of eval options) as separate processes, ``--concurrent`` at a time on one
device, while a sampler reads the GPU's busy fraction (``nvidia-smi``'s utilization: the share of time a kernel ran)
every ``--sample_s`` seconds. The figure is episodes finished / wall seconds from the first job's start to the last
job's end, process starts and model loads included: what a study pays per GPU-second. Each job's own
``timing.json`` splits its time (process start, model load, the episode loop's decode calls, the wait for the device
inside them, graph captures, the episodes' host work between decode steps).

``--compare DIR`` reads another bench's jobs and counts, episode by episode (keyed by row, run and question), how
many records are the same (prediction, actions, tokens): speed work must not change the episodes where the protocol
says it cannot.

    python cli.py bench eval --jobs '["--benchmark hotpotqa --scheme base_lr_shared --runs 12 --batch 64"]' \\
        --out out/bench_eval
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lragent.report_io import write_json, write_text

ROOT = Path(__file__).resolve().parents[2]
SAME_FIELDS = ("prediction", "actions", "num_tokens", "seed")
"""What makes two episode records the same episode."""
TIMING_FIELDS = (
    "startup_s", "load_s", "episodes_s", "advance_s", "wait_s", "replay_s", "capture_s", "agent_s", "feed_rows",
    "feed_tokens",
)  # fmt: skip


class GpuSampler:
    """Reads ``nvidia-smi``'s GPU utilization, memory in use and the processes computing on it every ``period``
    seconds on a thread until :meth:`stop`. Without ``nvidia-smi`` it records nothing (the bench still runs; ``busy``
    is None)."""

    def __init__(self, period: float = 0.5) -> None:
        self.period = period
        self.samples: list[tuple[float, float, float]] = []  # (seconds since start, busy %, memory MiB)
        self.processes: list[int] = []  # processes computing on the GPU at each read (its compute apps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._t0 = time.perf_counter()

    def start(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def _loop(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        apps = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader", "-i", "0"]
        while not self._stop.is_set():
            try:
                line = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
                busy, mem = (float(x) for x in line.split(","))
                self.samples.append((time.perf_counter() - self._t0, busy, mem))
                listed = subprocess.run(apps, capture_output=True, text=True, timeout=10)
                if listed.returncode == 0:
                    self.processes.append(sum(1 for pid in listed.stdout.split() if pid.isdigit()))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(self.period)

    def stop(self) -> dict[str, Any]:
        """Stops sampling; returns the mean busy percentage, the share of samples at 0%, the peak memory and the most
        processes seen computing on the GPU at once (None: not read)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)
        peak = max(self.processes) if self.processes else None
        if not self.samples:
            return {"busy_pct": None, "idle_share": None, "peak_memory_mib": None, "samples": 0, "peak_processes": peak}
        busy = [b for _, b, _ in self.samples]
        return {
            "busy_pct": sum(busy) / len(busy),
            "idle_share": sum(b == 0 for b in busy) / len(busy),
            "peak_memory_mib": max(m for _, _, m in self.samples),
            "samples": len(busy),
            "peak_processes": peak,
        }


def _episodes(out: Path) -> list[dict]:
    path = out / "episodes.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_compared(path: Path) -> list[dict]:
    """The episode records of another bench: its folder (every ``job_*/episodes.jsonl``) or one JSON-lines file,
    plain or ``.xz`` (as ``results/eval_throughput/*_episodes.jsonl.xz`` keeps them)."""
    if path.is_dir():
        return [r for d in sorted(path.glob("job_*")) for r in _episodes(d)]
    if path.suffix == ".xz":
        import lzma

        text = lzma.decompress(path.read_bytes()).decode()
    else:
        text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def compare_records(a: list[dict], b: list[dict]) -> dict[str, int]:
    """Episodes of ``a`` and ``b`` keyed by (row, run, question): how many both ran, and how many of those are the
    same in :data:`SAME_FIELDS`."""
    key = lambda r: (r["row"], r["run"], r["qid"])  # noqa: E731
    left = {key(r): r for r in a}
    right = {key(r): r for r in b}
    both = left.keys() & right.keys()
    same = sum(all(left[k].get(f) == right[k].get(f) for f in SAME_FIELDS) for k in both)
    return {"left": len(left), "right": len(right), "both": len(both), "same": same}


def _job_summary(out: Path, wall: float, rc: int) -> dict[str, Any]:
    timing_path = out / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    return {
        "rc": rc,
        "wall_s": wall,
        "episodes": len(_episodes(out)),
        "batch": timing.get("batch"),
        "decode_steps": timing.get("decode_steps"),
        **{k: timing.get(k) for k in TIMING_FIELDS},
    }


def _unclean(others: int | None) -> list[str]:
    """The report's warning lines when other processes computed on the GPU during the run (none otherwise)."""
    if not others:
        return []
    return [f"**Not a clean measurement**: {others} more process(es) than its jobs computed on the GPU during the run "
            "(`nvidia-smi`'s compute apps): they shared its time.", ""]  # fmt: skip


def _fed_share(job: dict[str, Any]) -> str:
    """The share of the feeding steps' extra token rows that carried a fed token ("–" without feeding steps): the rest
    is padding to the steps' widths, device work that feeds nothing."""
    rows, tokens = job.get("feed_rows"), job.get("feed_tokens")
    return f"{100 * tokens / rows:.1f}% of {rows:,}" if rows and tokens is not None else "–"


def _markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    busy = "n/a" if s["busy_pct"] is None else f"{s['busy_pct']:.1f}%"
    lines = [
        f"# bench eval: {result['label'] or 'evaluation throughput'}",
        "",
        f"{s['episodes']} episodes in {s['wall_s']:.1f} s on one device ({result['concurrent']} process(es) at once): "
        f"**{s['episodes_per_gpu_s']:.3f} episodes per GPU-second**; GPU busy {busy} of the time.",
        "",
        *_unclean(s.get("other_processes")),
        "| job | episodes | wall s | start s | load s | loop s | decode calls s | of which wait s | captures s "
        "| host work s | steps | fed rows used | batch | rc |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v: "–" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    for j in result["jobs"]:
        lines.append(
            f"| `{j['options']}` | {j['episodes']} | {fmt(j['wall_s'])} | {fmt(j['startup_s'])} | {fmt(j['load_s'])} "
            f"| {fmt(j['episodes_s'])} | {fmt(j['advance_s'])} | {fmt(j['wait_s'])} | {fmt(j['capture_s'])} "
            f"| {fmt(j['agent_s'])} | {fmt(j['decode_steps'])} | {_fed_share(j)} | {fmt(j['batch'])} | {j['rc']} |"
        )
    if result.get("compare"):
        c = result["compare"]
        lines += ["", f"Against `{c['dir']}`: {c['same']} of {c['both']} episodes run by both are the same "
                  f"({', '.join(SAME_FIELDS)})."]  # fmt: skip
    prov = result["provenance"]
    lines += ["", f"Commit {prov.get('git_commit')}{' (dirty)' if prov.get('git_dirty') else ''}, "
              f"{(prov.get('device') or {}).get('name')}, {prov.get('utc')}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def bench_eval(
    jobs: list[str],
    out: str = "out/bench_eval",
    concurrent: int = 1,
    sample_s: float = 0.5,
    label: str = "",
    compare: str | None = None,
    python: str | None = None,
) -> int:
    """Evaluation throughput: episodes per GPU-second of ``cli.py eval`` jobs, the GPU's busy fraction, where the
    time goes.

    Args:
        jobs: each one eval job's options, as a string (e.g. "--benchmark hotpotqa --scheme non_shared --runs 4
            --batch 32 --model qwen2.5-coder-1.5b --dtype bfloat16"); --out and --quiet are set here (OUT/job_i).
        out: output folder: bench_eval.json (rewritten as each job ends), bench_eval.md, job_i/ (each eval's own
            output: its episodes resume if the bench is run again into the same folder, but then its timing is
            not a fresh measurement).
        concurrent: jobs running at once (several evaluations on one GPU); the rest wait in order.
        sample_s: seconds between GPU-utilisation samples.
        label: a title for the report.
        compare: another bench eval's folder, or a JSON-lines file of its episodes (plain or .xz): count the
            episodes (by row, run and question) that both ran and that are the same (prediction, actions, tokens,
            seed).
        python: the interpreter for the jobs (default: this one).

    Returns:
        0 when every job exited 0, else 1.
    """
    from lragent.provenance import provenance

    if not jobs:
        raise ValueError("--jobs is empty: give at least one eval job's options")
    if concurrent < 1:
        raise ValueError(f"--concurrent must be >= 1, got {concurrent}")
    if sample_s <= 0:
        raise ValueError(f"--sample_s must be > 0, got {sample_s}")
    for opts in jobs:
        bad = [o for o in shlex.split(opts) if o.split("=")[0] in ("--out", "--quiet", "--devices")]
        if bad:
            raise ValueError(f"--jobs {opts!r}: {bad[0]} is set by bench eval (each job runs into OUT/job_i)")
    if compare is not None and not Path(compare).exists():
        raise FileNotFoundError(f"--compare {compare}: no such folder or file")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    py = python or sys.executable
    prov = provenance()
    result: dict[str, Any] = {"label": label, "concurrent": concurrent, "jobs": [], "provenance": prov}
    queue = list(enumerate(jobs))
    running: dict[int, tuple[subprocess.Popen, float, Any]] = {}
    peak_running = 0  # the most jobs at once: any other process computing on the GPU is another's
    summaries: dict[int, dict[str, Any]] = {}
    sampler = GpuSampler(sample_s).start()
    started = time.perf_counter()
    try:
        while queue or running:
            while queue and len(running) < concurrent:
                i, opts = queue.pop(0)
                job_out = out_dir / f"job_{i}"
                cmd = [py, str(ROOT / "cli.py"), "eval", *shlex.split(opts), "--out", str(job_out), "--quiet", "true"]
                job_out.mkdir(parents=True, exist_ok=True)
                log = (job_out / "bench_log.txt").open("a")
                log.write(f"$ {shlex.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                running[i] = (proc, time.perf_counter(), log)
                peak_running = max(peak_running, len(running))
                print(f"bench eval: job {i} started: {opts}", file=sys.stderr, flush=True)
            time.sleep(0.2)
            for i, (proc, t0, log) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                log.close()
                del running[i]
                summaries[i] = {"options": jobs[i], **_job_summary(out_dir / f"job_{i}", time.perf_counter() - t0, rc)}
                print(f"bench eval: job {i} exit {rc}: {summaries[i]['episodes']} episodes in "
                      f"{summaries[i]['wall_s']:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
                result["jobs"] = [summaries[k] for k in sorted(summaries)]
                write_json(out_dir / "bench_eval.json", result)  # as each job ends: a killed bench keeps them
    finally:
        for proc, _, log in running.values():  # interrupted: the jobs stop too (their episodes stay in job_i)
            proc.terminate()
            log.close()
    wall = time.perf_counter() - started
    gpu = sampler.stop()
    episodes = sum(s["episodes"] for s in summaries.values())
    others = None if gpu["peak_processes"] is None else max(0, gpu["peak_processes"] - peak_running)
    result["summary"] = {"episodes": episodes, "wall_s": wall, "episodes_per_gpu_s": episodes / wall, **gpu,
                         "other_processes": others}  # fmt: skip
    if others:
        print(f"bench eval: warning: {others} more process(es) than its jobs computed on the GPU during the run: "
              "not a clean measurement", file=sys.stderr, flush=True)  # fmt: skip
    if compare is not None:
        ours = sorted(out_dir.glob("job_*"))
        counts = compare_records([r for d in ours for r in _episodes(d)], read_compared(Path(compare)))
        result["compare"] = {"dir": str(compare), **counts}
    write_json(out_dir / "bench_eval.json", result)
    write_text(out_dir / "bench_eval.md", _markdown(result))
    print(_markdown(result))
    return 0 if all(s["rc"] == 0 for s in summaries.values()) else 1
