"""How ``eval --devices N`` starts its shard processes: each one's device, environment and thread pool, and the early
launch that starts them before the launching process has imported torch.

Why early: every eval process spends seconds on its interpreter and imports (torch, transformers, torchmetrics) and
its argument checks before its first episode. ``eval --devices N`` used to pay that twice in a row: once in the
launching process, which checked the arguments and only then started the shards, and again in each shard. The
console entry (:func:`lragent.cli_main.main`) now calls :func:`start_early` on the raw command line first, so the
shards start at once while the launcher checks the arguments beside them; :func:`eval_suite.evaluate.run_eval.fan_out`
then
adopts them when what it would launch is the same (the output folder, the shard count, the GPUs), and stops them and
launches its own otherwise. Where the arguments turn out bad, the launcher stops the shards and says so in one line.

Stdlib only: this module is imported before torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from eval_suite.evaluate.work_queue import clear_queue
from lragent.host_threads import GPU_HOST_THREADS

BENCHMARK_FIELD = "{benchmark}"
"""Where a path option of an eval over several benchmarks (``--out``, ``--work_queue``, ``--adapters``) names the
benchmark: replaced by each benchmark's name in turn."""


def benchmark_list(value: str | Sequence[str]) -> list[str]:
    """The benchmark names of ``--benchmark``: ``hotpotqa``, ``hotpotqa,scienceqa``, ``[hotpotqa,scienceqa]`` or a
    list, in the order given (not checked: :func:`eval_suite.evaluate.run_eval.benchmark_names` does that)."""
    items = value.strip().strip("[]").split(",") if isinstance(value, str) else [str(v) for v in value]
    return [v.strip().strip("'\"") for v in items if v.strip().strip("'\"")]


def _argv_value(argv: Sequence[str], option: str) -> str | None:
    """The value of ``option`` in a raw command line (``--key value`` or ``--key=value``; the last one wins)."""
    found = None
    for i, token in enumerate(argv):
        key, eq, value = token.partition("=")
        if key == option:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere): what the interpreter, the imports and
    the argument checks took before an eval's own clock starts."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time, clock ticks
    except (OSError, ValueError, IndexError):
        return None


def shard_launch(i: int, n: int, gpus: int, device: str | None, env: dict[str, str], cpus: int) -> tuple[str, dict]:
    """The ``--device`` and the environment of shard ``i`` of ``n``.

    On GPUs the shard sees its own GPU only (``CUDA_VISIBLE_DEVICES``: the i-th of the GPUs this process sees) and
    runs on ``cuda``: nothing of it can land on, or make a context on, another shard's GPU. Each shard gets an equal
    share of the CPU cores for its thread pools (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``; a value the user set is
    kept): N processes with a pool as wide as the machine each oversubscribe the cores and slow one another down. A
    GPU shard takes at most :data:`~lragent.host_threads.GPU_HOST_THREADS` of its share (see there why).

    Args:
        i: the shard.
        n: shards.
        gpus: GPUs this process sees (0: CPU shards).
        device: the eval's ``--device`` (None: the default).
        env: this process's environment.
        cpus: the machine's CPU cores.

    Returns:
        ``(device, environment)`` of the shard's process.
    """
    out = dict(env)
    share = max(1, cpus // n)
    threads = str(min(share, GPU_HOST_THREADS) if gpus else share)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        out.setdefault(key, threads)
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not gpus:
        return device or "cpu", out
    visible = _visible_devices(env)
    out["CUDA_VISIBLE_DEVICES"] = visible[i] if len(visible) > i else str(i)
    return "cuda", out


def _visible_devices(env: Mapping[str, str]) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (empty where it is unset or empty)."""
    return [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def visible_gpus(env: Mapping[str, str]) -> int:
    """GPUs a process started with ``env`` would see, without importing torch: the entries of
    ``CUDA_VISIBLE_DEVICES`` where it is set, else the NVIDIA driver's GPUs (``/proc/driver/nvidia/gpus``; 0 without
    the driver). :func:`eval_suite.evaluate.run_eval.fan_out` checks it against ``torch.cuda.device_count()``."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return len(_visible_devices(env))
    try:
        return len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    except OSError:
        return 0


# options of one shard's command line that the launcher sets itself
_LAUNCHER_SETS = ("--devices", "--out", "--device", "--quiet")
# options after which the command line is not a plain --devices N run: the usual path handles them
_NOT_EARLY = ("--shard", "--work_queue", "--merge", "--config", "--print_config", "-h", "--help")


def _options(argv: Sequence[str]) -> tuple[dict[str, str], list[str]] | None:
    """``({option: value}, the other tokens in order)`` of ``argv`` for the launcher's options (``--key value`` or
    ``--key=value``); None where one of them lacks its value."""
    found: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        key, eq, value = token.partition("=")
        if key in _LAUNCHER_SETS:
            if not eq:
                if i + 1 >= len(argv):
                    return None
                value = argv[i + 1]
                i += 1
            found[key] = value
        else:
            rest.append(token)
        i += 1
    return found, rest


@dataclass
class EarlyShards:
    """Shard processes started by :func:`start_early`, not yet adopted by ``fan_out``."""

    n: int
    out_dir: Path
    gpus: int
    device: str | None
    benchmarks: list[str] = field(default_factory=list)  # the benchmarks each shard runs in turn ([]: one benchmark)
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[IO[str]] = field(default_factory=list)
    spawned_at: float = 0.0  # time.perf_counter() once every shard was started
    startup_s: float | None = None  # the launcher's age then
    lines: list[str] = field(default_factory=list)  # where each shard runs, said once they are adopted
    adopted: bool = False

    def stop(self) -> None:
        """Stops the shards (the arguments were bad, or fan_out launches its own) and closes their logs."""
        stop_processes(self.procs)
        for log in self.logs:
            log.close()


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float = 30.0) -> None:
    """Terminates the processes still running and waits for them (killed after ``timeout`` seconds)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_EARLY: list[EarlyShards] = []  # the launch of this process's command line (at most one)


def _shard_line(i: int, n: int, shard_out: Path, log: Path, gpus: int, dev: str, shard_env: Mapping[str, str]) -> str:
    """Where shard ``i`` runs, with how many CPU threads, into which folder and log (one line)."""
    where = f"GPU {shard_env['CUDA_VISIBLE_DEVICES']}" if gpus else dev
    return f"eval: shard {i}/{n} on {where} ({shard_env['OMP_NUM_THREADS']} CPU threads) -> {shard_out} (log {log})"


def spawn_shards(
    n: int,
    out_dir: Path,
    args: Sequence[str],
    gpus: int,
    device: str | None,
    env: Mapping[str, str],
    benchmarks: Sequence[str] = (),
) -> tuple[list[subprocess.Popen], list[IO[str]], list[str]]:
    """Starts ``n`` ``eval --shard i/n`` processes with ``args`` (the command's other options), each into
    ``out_dir/shard_i`` with its log in ``out_dir/shard_i.log``, all taking their episodes from one queue,
    ``out_dir/queue``, emptied first (:mod:`eval_suite.evaluate.work_queue`).

    With several ``benchmarks`` each shard runs them in turn in one process (its imports and start paid once), into
    ``out_dir/<benchmark>/shard_i`` from one queue per benchmark, ``out_dir/<benchmark>/queue``: a shard whose rows
    have emptied on one benchmark starts the next while the others still finish their last episodes.

    Returns:
        ``(processes, their open logs, one line per shard saying where it runs)``: the caller says the lines (an
        early launch once its shards are adopted).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    several = len(benchmarks) > 1
    if several:  # emptied first: this launch's claims only (the shards' logs say what an earlier one finished)
        for b in benchmarks:
            clear_queue(out_dir / b)
        queue = out_dir / BENCHMARK_FIELD / "queue"
    else:
        queue = clear_queue(out_dir)
    procs, logs, lines = [], [], []
    for i in range(n):
        dev, shard_env = shard_launch(i, n, gpus, device, dict(env), os.cpu_count() or 1)
        shard_out = out_dir / BENCHMARK_FIELD / f"shard_{i}" if several else out_dir / f"shard_{i}"
        cmd = [sys.executable, "-m", "lragent.cli_main", "eval", *args, "--shard", f"{i}/{n}", "--work_queue",
               str(queue), "--out", str(shard_out), "--device", dev, "--quiet", "true"]  # fmt: skip
        log_path = out_dir / f"shard_{i}.log"
        log = open(log_path, "w")  # noqa: SIM115 (closed once the process ends)
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=shard_env))
        logs.append(log)
        lines.append(_shard_line(i, n, shard_out, log_path, gpus, dev, shard_env))
    return procs, logs, lines


def start_early(argv: Sequence[str], env: Mapping[str, str] | None = None) -> EarlyShards | None:
    """Starts the shards of ``eval ARGV`` (the options after ``eval``) at once where it is a plain ``--devices N``
    run with ``--out``: N > 1, no ``--shard``, ``--merge``, ``--config`` or help, and on GPUs at least N visible
    (without torch: a run on the default device where no GPU is seen that way waits for torch's count).
    Anything else returns None and is launched, or refused, by the usual path after the arguments are checked."""
    env = os.environ if env is None else env
    if any(t.partition("=")[0] in _NOT_EARLY for t in argv):
        return None
    parsed = _options(argv)
    if parsed is None:
        return None
    found, rest = parsed
    try:
        n = int(found.get("--devices", "1"))
    except ValueError:
        return None
    if n < 2 or not found.get("--out") or BENCHMARK_FIELD in found["--out"]:  # a template: the usual path decides
        return None
    device = found.get("--device")
    if device in ("None", "null"):
        device = None
    gpus = visible_gpus(env) if device in (None, "cuda") else 0
    if 0 < gpus < n:
        return None  # the usual path says how many GPUs there are
    if device in (None, "cuda") and not gpus:  # none seen without torch (no driver listing, ROCm, ...): torch decides
        return None
    age = process_age_s()
    benchmarks = benchmark_list(_argv_value(rest, "--benchmark") or "")
    benchmarks = benchmarks if len(benchmarks) > 1 else []
    early = EarlyShards(n=n, out_dir=Path(found["--out"]), gpus=gpus, device=device, benchmarks=benchmarks,
                        startup_s=age)  # fmt: skip
    early.procs, early.logs, early.lines = spawn_shards(n, early.out_dir, rest, gpus, device, env, benchmarks)
    early.spawned_at = time.perf_counter()
    _EARLY[:] = [early]
    return early


def adopt_early(
    n: int, out_dir: Path, gpus: int, device: str | None, benchmarks: Sequence[str] = ()
) -> EarlyShards | None:
    """The early shards, if they are what ``fan_out`` would launch now (same count, folder, GPUs, device, and the
    same ``benchmarks`` run in turn by each shard, in this order: [] for one); else None, the early shards stopped."""
    if not _EARLY:
        return None
    early = _EARLY.pop()
    same = (early.n, early.gpus, early.device) == (n, gpus, device) and early.out_dir.resolve() == out_dir.resolve()
    same = same and early.benchmarks == list(benchmarks)
    if not same:
        early.stop()
        return None
    early.adopted = True
    for line in early.lines:
        print(line, file=sys.stderr)
    return early


def finish_early() -> None:
    """After the command: stops early shards nobody adopted (its arguments were refused before ``fan_out``)."""
    while _EARLY:
        early = _EARLY.pop()
        if not early.adopted:
            early.stop()
            print(
                f"eval: stopped the shards started early in {early.out_dir}: the command did not run", file=sys.stderr
            )
