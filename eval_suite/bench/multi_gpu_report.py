"""Collects the results of ``scripts/gpu_multi.sh`` into ``OUT/multi_gpu.json`` and ``OUT/multi_gpu.md``.

python -m eval_suite.bench.multi_gpu_report --out OUT [--command "the command that produced OUT"]

Figures, for each GPU count N of ``--sizes``: validation loss of the embedded model (and of the accuracy model, when
its phases ran) on one GPU (two adapter seeds: the run-to-run noise) and with DDP on N GPUs at the same global batch,
tokens/s and the speed-up; FSDP at 8B shapes: peak memory per GPU against one GPU's, tokens/s, the resume and the
export format against the one-GPU export; ``eval --devices N`` against ``--devices 1``: the same episodes and the
wall-clock speed-up. A missing input is reported as missing (``null``), never filled in.
"""

from __future__ import annotations

import csv
import heapq
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lragent.provenance import provenance
from lragent.report_io import save_figure


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def timings(out: Path) -> dict[str, dict[str, int]]:
    """``{phase: {"rc", "seconds"}}`` from ``timings.txt`` (``rc`` an exit status or ``"skipped"``). A phase run again
    in a later call (an eval stopped at one call's limit resumes from its log in the next, APPEND=1) counts as one:
    its runs' seconds summed, the last run's status, ``calls`` how many ran."""
    rows: dict[str, dict[str, int]] = {}
    path = out / "timings.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        parts = line.split()
        if len(parts) == 3 and parts[1].startswith("rc=") and parts[2].startswith("seconds="):
            rc = parts[1][3:]  # an exit status, or "skipped" (past gpu_multi.sh's BUDGET_S)
            row = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(parts[2][8:])}
            before = rows.get(parts[0])
            if before is not None and row["rc"] == "skipped":  # a later call that skipped it: what ran stands
                continue
            if before is not None and before["rc"] != "skipped":
                row = {**row, "seconds": before["seconds"] + row["seconds"], "calls": before.get("calls", 1) + 1}
            rows[parts[0]] = row
    return _joined_eval_parts(rows)


def _joined_eval_parts(rows: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Adds ``evN`` from its per-benchmark phases ``evN-<benchmark>`` (gpu_multi.sh runs one benchmark per call where
    the whole is too long for one), where no plain ``evN`` ran: the parts' seconds summed, the first failing part's
    status (0 when every part finished)."""
    parts: dict[str, list[dict[str, int]]] = {}
    for name, row in rows.items():
        head, sep, _ = name.partition("-")
        if sep and head.startswith("ev") and head[2:].isdigit():
            parts.setdefault(head, []).append(row)
    for head, got in parts.items():
        if head not in rows:
            failed = [r["rc"] for r in got if r["rc"] != 0]
            rows[head] = {"rc": failed[0] if failed else 0, "seconds": sum(r["seconds"] for r in got)}
    return rows


def val_losses(metrics_csv: Path) -> list[float] | None:
    """``val/loss`` of every validation in a Lightning ``metrics.csv``, in order."""
    if not metrics_csv.is_file():
        return None
    with metrics_csv.open() as f:
        return [float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")]


def speed(out: Path, name: str) -> dict[str, Any] | None:
    """The FitSpeed figures of a run: tokens/s (global over ranks when distributed) and peak memory per rank."""
    s = _json(out / f"{name}_speed.json")
    if s is None:
        return None
    ranks = s.get("ranks") or [
        {"rank": 0, "tokens": s.get("tokens"), "seconds": s.get("seconds"), "tokens_per_s": s.get("tokens_per_s"),
         "peak_memory_gib": s.get("peak_memory_gib"), "steps": s.get("steps")}
    ]  # fmt: skip
    return {
        "world_size": s.get("world_size", 1),
        "global_step": s.get("global_step"),
        "tokens_per_s": s.get("global_tokens_per_s", s.get("tokens_per_s")),
        "ms_per_micro_batch": s.get("ms_per_step"),
        "peak_memory_gib_per_rank": [r.get("peak_memory_gib") for r in ranks],
        "peak_reserved_gib_rank0": s.get("peak_reserved_gib"),
        "timed_micro_batches_per_rank": [r.get("steps") for r in ranks],
        "ranks": ranks,
    }


def export_layout(directory: Path) -> dict[str, Any] | None:
    """Files of an adapter export and, per safetensors file, its tensor names and shapes; plus the PEFT configs."""
    if not directory.is_dir():
        return None
    from safetensors import safe_open

    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    tensors = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), "pt") as f:
                tensors[name] = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    configs = {}
    for name in files:
        if name.endswith("adapter_config.json"):
            cfg = json.loads((directory / name).read_text())
            configs[name] = {k: cfg.get(k) for k in ("r", "lora_alpha", "peft_type")}
            # peft keeps target_modules as a set: the saved order follows the process's string hashing
            configs[name]["target_modules"] = sorted(cfg.get("target_modules") or [])
    return {"files": files, "tensors": tensors, "peft_configs": configs}


def max_abs_diff(a: Path, b: Path) -> float | None:
    """Largest absolute difference between the native adapter files of two exports (same keys required)."""
    from safetensors.torch import load_file

    fa, fb = a / "lragent_adapters.safetensors", b / "lragent_adapters.safetensors"
    if not (fa.is_file() and fb.is_file()):
        return None
    ta, tb = load_file(str(fa)), load_file(str(fb))
    if sorted(ta) != sorted(tb):
        return None
    return max(float((ta[k].float() - tb[k].float()).abs().max()) for k in ta)


def episodes(directory: Path) -> list[tuple] | None:
    """(qid, seed, prediction, num_tokens, steps) of every episode under ``directory`` (shards included), sorted."""
    files = sorted(directory.rglob("episodes.jsonl")) if directory.is_dir() else []
    if not files:
        return None
    rows = []
    for f in files:
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows.append((r["qid"], r.get("seed"), r.get("prediction"), r.get("num_tokens"), r.get("steps")))
    return sorted(rows, key=repr)


def list_schedule_s(durations: list[float], rows: int) -> float:
    """Seconds until the last of ``durations`` (in queue order) ends when ``rows`` rows each take the next one as
    they free up: the shared queue of ``eval --devices N`` with ``rows`` rows over all its processes."""
    free = [0.0] * max(1, rows)  # a heap of the times the rows free up
    end = 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def stage_schedule_s(stages: list[list[float]], procs: int, rows: int) -> float:
    """Seconds until the last episode ends when ``procs`` processes of ``rows`` rows run ``stages`` in turn (a stage:
    the episode times of one benchmark's scheme, in queue order, one engine at a time): a free row takes the stage's
    next episode; a process whose stage has none left waits until its rows have emptied, then starts the next stage,
    while the other processes may still be finishing the last one (one ``eval`` over several benchmarks and schemes,
    its shards sharing one queue per stage). One stage on ``procs`` processes is :func:`list_schedule_s` on
    ``procs * rows`` rows."""
    procs, rows = max(1, procs), max(1, rows)
    queues = [list(reversed(s)) for s in stages]  # popped from the end: queue order
    stage, busy, idle = [0] * procs, [0] * procs, [[] for _ in range(procs)]
    events = [(0.0, p, False) for p in range(procs) for _ in range(rows)]  # (time a row frees, process, ran one)
    heapq.heapify(events)
    end = 0.0
    while events:
        t, p, ran = heapq.heappop(events)
        busy[p] -= ran
        end = max(end, t)
        while stage[p] < len(queues) and not queues[stage[p]] and not busy[p]:
            stage[p] += 1  # this process's rows have emptied: on to the next stage, the rows that waited with it
            events.extend((t, p, False) for _ in idle[p])
            heapq.heapify(events)
            idle[p] = []
        if stage[p] < len(queues) and queues[stage[p]]:
            busy[p] += 1
            heapq.heappush(events, (t + queues[stage[p]].pop(), p, True))
        else:
            idle[p].append(t)
    return end


def queue_bound(directory: Path, n: int, combined: bool = False) -> dict[str, float] | None:
    """What the episodes' lengths allow ``eval --devices n`` against one device, from one device's run
    ``directory/<b>/`` (its ``episodes.jsonl`` and ``timing.json``): each benchmark's episode times (``wall_s``) in
    the order one device finished them, scheme by scheme (one engine at a time), scheduled on one process of
    ``batch`` rows and on ``n`` of them (:func:`stage_schedule_s`): one launch per benchmark, summed, or with
    ``combined`` one launch over every benchmark in turn (``eval --benchmark a,b``). The steps cost what one device's
    did and nothing is fixed: the gap between the two is the queue's tail alone (the last episodes' rows emptying one
    by one while one runs on). None where a figure is missing (a run without rows)."""
    procs = _process_timings(directory)
    if not procs:
        return None
    launches: list[tuple[list[list[float]], int]] = []  # (stages, rows) of each launch
    for bench, rows in procs.items():
        batch = rows[0].get("batch") if len(rows) == 1 else None
        path = directory / bench / "episodes.jsonl"
        if not isinstance(batch, int) or batch < 1 or not path.is_file():
            return None
        groups: dict[str, list[float]] = {}  # by scheme, in the order the schemes ran
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("wall_s") is None:
                    return None
                groups.setdefault(str(r.get("row", r.get("scheme"))), []).append(float(r["wall_s"]))
        launches.append((list(groups.values()), batch))
    if combined:  # one process runs every benchmark: one row count for all (else no bound)
        if len({batch for _, batch in launches}) != 1:
            return None
        launches = [([stage for stages, _ in launches for stage in stages], launches[0][1])]
    one = sum(stage_schedule_s(stages, 1, batch) for stages, batch in launches)
    many = sum(stage_schedule_s(stages, n, batch) for stages, batch in launches)
    return {"loop_s_1": one, f"loop_s_{n}": many, "bound": one / many if many else None}


def combined_launch(directory: Path) -> bool:
    """Whether an ``eval --devices N`` output ran every benchmark in one launch (``eval --benchmark a,b``: its
    ``launch.json`` at the top names them), each shard process running them in turn."""
    launch = _json(directory / "launch.json") or {}
    return len(launch.get("benchmarks") or []) > 1


def _process_timings(directory: Path) -> dict[str, list[dict[str, Any]]] | None:
    """Each benchmark folder ``directory/<b>``'s processes' ``timing.json`` (a ``--devices N`` output's shards', else
    its own; none where it has none), by benchmark. None without the folder."""
    if not directory.is_dir():
        return None
    out: dict[str, list[dict[str, Any]]] = {}
    for b in sorted(d for d in directory.iterdir() if d.is_dir()):
        own = [b / "timing.json"] if (b / "timing.json").is_file() else []
        out[b.name] = [_json(f) or {} for f in sorted(b.glob("shard_*/timing.json")) or own]
    return out


def busiest_process(directory: Path, key: str | Callable[[dict[str, Any]], float | None]) -> float | None:
    """One figure of an ``eval`` output's ``timing.json`` (``episodes_s``: the episode loop's seconds;
    ``decode_steps``; ``advance_s``, ``agent_s``), per benchmark folder ``directory/<b>`` summed over benchmarks; a
    ``--devices N`` output counts its shard with the largest (``shard_i/timing.json``), or where one launch ran every
    benchmark (:func:`combined_launch`) the shard whose benchmarks sum to the largest. ``key`` may be a function of a
    ``timing.json`` instead. None when a benchmark folder has no such figure."""
    procs = _process_timings(directory)
    if not procs:
        return None
    figure = key if callable(key) else (lambda r: r.get(key))
    columns = [[figure(r) for r in rows] for rows in procs.values()]
    if any(not times or any(x is None for x in times) for times in columns):
        return None
    if combined_launch(directory):  # each shard process ran every benchmark: its own sum, the largest of them
        if len({len(times) for times in columns}) != 1:
            return None
        return max(sum(shard) for shard in zip(*columns, strict=True))
    return sum(max(times) for times in columns)


def shard_balance(directory: Path) -> dict[str, dict[str, Any]] | None:
    """How evenly ``eval --devices N``'s shards shared the work, per benchmark folder ``directory/<b>``: each shard's
    episodes and decode steps, and its slowest episode loop over their mean (1.0: all ended together). None when a
    shard lacks those figures (older runs)."""
    if not directory.is_dir():
        return None
    out: dict[str, dict[str, Any]] = {}
    for b in sorted(d for d in directory.iterdir() if d.is_dir()):
        rows = [_json(f) or {} for f in sorted(b.glob("shard_*/timing.json"))]
        if not rows or any(r.get(k) is None for r in rows for k in ("episodes", "decode_steps", "episodes_s")):
            return None
        loops = [r["episodes_s"] for r in rows]
        out[b.name] = {
            "episodes": [r["episodes"] for r in rows],
            "decode_steps": [r["decode_steps"] for r in rows],
            "slowest_over_mean": max(loops) / (sum(loops) / len(loops)) if sum(loops) else None,
        }
    return out or None


def per_step_ms(directory: Path) -> tuple[float, float, float, float] | None:
    """An ``eval`` output's loop per decode step, in ms, over every process together (all shards' ``timing.json``
    summed): the wait for the GPU (``wait_s``), the graph replay calls (``replay_s``), the engine's other host work
    (``advance_s`` less both and less the graph captures, ``capture_s``: a fixed cost of each process, not a step's;
    counted as 0 in records from before it was kept) and the episodes' own work (``agent_s``). None where another
    figure is missing (records from before ``replay_s`` and ``wait_s`` were kept)."""
    procs = _process_timings(directory) or {}
    rows = [r for rs in procs.values() for r in rs]
    keys = ("decode_steps", "wait_s", "replay_s", "advance_s", "agent_s")
    if not rows or any(not rs for rs in procs.values()) or any(r.get(k) is None for r in rows for k in keys):
        return None
    total = {k: sum(r[k] for r in rows) for k in keys}
    if not total["decode_steps"]:
        return None
    steps, wait, replay, advance, agent = (total[k] for k in keys)
    capture = sum(r.get("capture_s") or 0.0 for r in rows)
    return tuple(1000 * x / steps for x in (wait, replay, advance - wait - replay - capture, agent))


EV_PARTS = ("advance_s", "agent_s", "startup_s", "setup_s", "capture_s")  # timing.json figures summed per process
RESTART_KEYS = ("startup_s", "setup_s", "capture_s")  # what a process resumed in a later call pays again


def _restart_s(timing: dict[str, Any]) -> float:
    """One process's ``timing.json``: its resumed parts' (``parts`` after the first) start, setup and captures."""
    return sum((p.get(k) or 0.0 for p in (timing.get("parts") or [])[1:] for k in RESTART_KEYS), 0.0)


def restart_seconds(directory: Path) -> float | None:
    """The seconds an ``eval`` output's wall holds because a run was stopped (a call's limit) and resumed in a later
    call: each resumed part's start, setup and graph captures, which the run in one go would not have paid, counted
    over processes as :func:`busiest_process` counts a figure. 0.0 for a run in one go; None without timing."""
    return busiest_process(directory, _restart_s)


def launch_seconds(directory: Path) -> float | None:
    """The seconds ``eval --devices N``'s launching process spent before its shards ran (its own start and the
    launch), summed over the benchmark folders ``directory/<b>/launch.json``; None when one lacks it (older runs)."""
    if not directory.is_dir():
        return None
    if combined_launch(directory):  # one launch for every benchmark
        launch = _json(directory / "launch.json") or {}
        return None if launch.get("startup_s") is None else launch["startup_s"] + launch["launch_s"]
    total = 0.0
    for b in sorted(d for d in directory.iterdir() if d.is_dir()):
        launch = _json(b / "launch.json")
        if not launch or launch.get("startup_s") is None:
            return None
        total += launch["startup_s"] + launch["launch_s"]
    return total


REPEATS = range(2, 10)
"""K of a fit's repeats ``<fit>rK`` (``emb1r2``, ``ddp4r2``, ...): the same fit again, with the same seeds."""


def host_split(out: Path, name: str) -> list[dict[str, float]] | None:
    """Where each rank's micro-batch went: ``step_ms`` (CUDA events from one micro-batch's start to the next),
    ``host_ms`` (the host's time between Lightning's hooks, every phase's mean times its count, per micro-batch) and
    ``rest_ms`` (the difference: the host waiting, in a collective or for its GPU, or outside the hooks). One entry
    per rank (``<name>_speed.rank<r>.json``), or the one-process file; None when FitSpeed wrote no phases."""
    files = sorted(out.glob(f"{name}_speed.rank*.json")) or [out / f"{name}_speed.json"]
    rows = []
    for f in files:
        s = _json(f)
        phases = (s or {}).get("phases_ms") or {}
        host, count, steps = phases.get("host"), phases.get("count"), (s or {}).get("steps")
        if not (host and count and steps and s.get("ms_per_step")):
            return None
        host_ms = sum(ms * count.get(k, 0) for k, ms in host.items()) / steps
        rows.append({"rank": s.get("rank", 0), "step_ms": s["ms_per_step"], "host_ms": host_ms,
                     "rest_ms": s["ms_per_step"] - host_ms})  # fmt: skip
    return rows


def _minus(base: list[float] | None, other: list[float] | None) -> list[float] | None:
    """``other - base`` at every validation; None unless both ran and validated as often."""
    return [b - a for a, b in zip(base, other, strict=True)] if base and other and len(base) == len(other) else None


def _ddp_block(out: Path, one: str, noise: str, prefix: str, sizes: list[int]) -> dict[str, Any]:
    """Val loss and tokens/s of a one-GPU fit, its other-seed twin and its DDP twins ``<prefix><N>``."""
    v1, v1s = val_losses(out / f"{one}_metrics.csv"), val_losses(out / f"{noise}_metrics.csv")
    s1 = speed(out, one)
    res: dict[str, Any] = {"val_loss_1gpu": v1, "val_loss_1gpu_adapter_seed1": v1s, "speed_1gpu": s1,
                           "host_split_1gpu": host_split(out, one)}  # fmt: skip
    if seed_noise := _minus(v1, v1s):
        res["seed_noise"] = seed_noise
    # every other adapter seed run (<noise> is seed 1, <noise>K seed K): the spread of one GPU's final loss
    others = {1: v1s, **{k: val_losses(out / f"{noise}{k}_metrics.csv") for k in range(2, 10)}}
    finals = {k: v[-1] for k, v in others.items() if v and v1 and len(v) == len(v1)}
    if finals:
        res["seed_final_losses"] = {0: v1[-1], **finals}
        res["seed_spread_last"] = max(abs(x - v1[-1]) for x in finals.values())  # largest |seed k - seed 0|
    # the one-GPU fit's repeats, read once for every size: tokens/s (with the fit's own first) and val losses
    ones = repeat_rates(out, one)
    ones_losses = {k: val_losses(out / f"{one}r{k}_metrics.csv") for k in REPEATS}
    for n in sizes:
        vn, sn = val_losses(out / f"{prefix}{n}_metrics.csv"), speed(out, f"{prefix}{n}")
        res[f"val_loss_ddp{n}"], res[f"speed_ddp{n}"] = vn, sn
        res[f"host_split_ddp{n}"] = host_split(out, f"{prefix}{n}")
        if minus := _minus(v1, vn):
            res[f"ddp{n}_minus_1gpu"] = minus
            if "seed_spread_last" in res:  # the last validation: DDP's difference against the seeds' spread
                res[f"ddp{n}_within_noise"] = abs(minus[-1]) <= res["seed_spread_last"]
        # each repeat pair (the same seeds): DDP's repeat k against one GPU's repeat k, and whether it is in the noise
        pairs = {
            k: d for k in REPEATS if (d := _minus(ones_losses[k], val_losses(out / f"{prefix}{n}r{k}_metrics.csv")))
        }
        if pairs:
            res[f"ddp{n}_minus_1gpu_repeats"] = pairs
            if "seed_spread_last" in res:
                res[f"ddp{n}_repeats_within_noise"] = all(abs(d[-1]) <= res["seed_spread_last"] for d in pairs.values())
        ddps = repeat_rates(out, f"{prefix}{n}")
        if ones and ddps:  # the speed-up of the pooled rates: with one fit each, that fit's ratio
            res[f"ddp{n}_speedup_tokens_per_s"] = (sum(ddps) / len(ddps)) / (sum(ones) / len(ones))
            if max(len(ones), len(ddps)) > 1:
                res[f"ddp{n}_repeats"] = {
                    "tokens_per_s_1gpu": ones,
                    f"tokens_per_s_ddp{n}": ddps,
                    "speedup_paired": [b / a for a, b in zip(ones, ddps, strict=False)],
                }
    return res


def repeat_rates(out: Path, name: str) -> list[float]:
    """Tokens/s of a fit and of each of its repeats ``<name>r2`` ... ``<name>r9`` that ran, in that order."""
    rates = []
    for run in [name, *(f"{name}r{k}" for k in REPEATS)]:
        s = speed(out, run)
        if s and s["tokens_per_s"]:
            rates.append(s["tokens_per_s"])
    return rates


def collect(out: Path, command: str | None, sizes: list[int] | None = None) -> dict[str, Any]:
    """Every figure of a ``gpu_multi.sh`` output directory, for the GPU counts ``sizes`` (default ``[2]``)."""
    sizes = sizes or [2]
    t = timings(out)
    speeds = [_json(f) or {} for f in sorted(out.glob("*_speed.json"))]  # the device any run reported
    cpu = any(s.get("provenance", {}).get("device", {}).get("type") == "cpu" for s in speeds)
    res: dict[str, Any] = {"sizes": sizes, "phases": t}

    # DDP vs one GPU at the same global batch, and the noise between two adapter seeds: embedded and accuracy model
    res["ddp_embedded"] = _ddp_block(out, "emb1", "emb1s", "ddp", sizes)
    res["ddp_accuracy_model"] = _ddp_block(out, "q1", "q1s", "qddp", sizes)

    # 8B shapes: FSDP memory and speed, resume, export format
    ref = export_layout(out / "b1_export")
    one = speed(out, "b1")
    fsdp: dict[str, Any] = {"speed_1gpu": one, "export_layout_1gpu": ref}
    for n in sizes:
        for key, name in ((f"speed_fsdp{n}", f"fsdp{n}"), (f"speed_fsdp{n}_resumed", f"fsdp{n}r"),
                          (f"speed_ddp{n}", f"ddp8b{n}")):  # fmt: skip
            fsdp[key] = sn = speed(out, name)
            if one and sn and one["tokens_per_s"] and sn["tokens_per_s"]:
                fsdp[f"{key}_speedup_tokens_per_s"] = sn["tokens_per_s"] / one["tokens_per_s"]
        f1, peak1 = fsdp[f"speed_fsdp{n}"], (one or {}).get("peak_memory_gib_per_rank") or [None]
        if f1 and peak1[0] and all(f1["peak_memory_gib_per_rank"]):
            fsdp[f"fsdp{n}_peak_memory_over_1gpu"] = max(f1["peak_memory_gib_per_rank"]) / peak1[0]
        resumed = fsdp[f"speed_fsdp{n}_resumed"]
        fsdp[f"fsdp{n}_resumed_to_step"] = resumed["global_step"] if resumed else None
        log = out / f"fsdp{n}r.log"
        fsdp[f"fsdp{n}_resume_log_line"] = next(
            (ln.strip() for ln in log.read_text().splitlines() if "Restoring states" in ln), None
        ) if log.is_file() else None  # fmt: skip
        for name in (f"fsdp{n}r", f"fx{n}"):
            layout = export_layout(out / f"{name}_export")
            fsdp[f"export_{name}_same_format_as_1gpu"] = None if ref is None or layout is None else layout == ref
        fsdp[f"fsdp{n}_export_fit_vs_export_command_max_abs_diff"] = max_abs_diff(
            out / f"fsdp{n}r_export", out / f"fx{n}_export"
        )
        fsdp[f"fsdp{n}_export_in_peft"] = _json(out / f"peft{n}.json")  # eval_suite/diagnostics/peft_check.py
    res["fsdp_8b"] = fsdp

    # eval --devices N vs 1: the same records, and the wall-clock speed-up
    e1 = episodes(out / "ev1")
    ev: dict[str, Any] = {"episodes_1": None if e1 is None else len(e1)}
    # the episode loops alone (model loading and sizing left out): one process against its slowest shard
    loop1 = ev["episode_loop_seconds_1"] = busiest_process(out / "ev1", "episodes_s")
    ev["decode_steps_1"] = busiest_process(out / "ev1", "decode_steps")
    # where the loop went: the engine's decode calls, the episodes' own work; and the fixed cost of a process before
    # its loop: its start (interpreter, imports, checks) and setup (corpus, model, sizing)
    for key in EV_PARTS:
        ev[f"{key}_1"] = busiest_process(out / "ev1", key)
    ev["per_step_ms_1"] = per_step_ms(out / "ev1")
    ev["restart_s_1"] = restart_seconds(out / "ev1")  # a reference resumed in a later call: its second start
    for n in sizes:
        en = episodes(out / f"ev{n}")
        ev[f"episodes_{n}"] = None if en is None else len(en)
        rc = t.get(f"ev{n}", {}).get("rc")
        if rc not in (0, None):  # stopped (the call's budget, a failure): compare what it finished, time nothing
            ev[f"stopped_{n}"] = rc
            if e1 is not None and en is not None:
                ev[f"finished_equal_{n}"] = set(en) <= set(e1)  # each finished episode is one of one GPU's
            continue
        if e1 is not None and en is not None:
            ev[f"same_episodes_{n}"] = e1 == en
            ev[f"differing_episodes_{n}"] = len(set(e1) ^ set(en))
        if t.get("ev1", {}).get("rc") == 0 and t.get(f"ev{n}", {}).get("rc") == 0 and t["ev1"]["seconds"]:
            ev["wall_seconds_1"], ev[f"wall_seconds_{n}"] = t["ev1"]["seconds"], t[f"ev{n}"]["seconds"]
            ev[f"speedup_{n}"] = t["ev1"]["seconds"] / max(t[f"ev{n}"]["seconds"], 1)
            ev[f"restart_s_{n}"] = restart_seconds(out / f"ev{n}")
            if ev["restart_s_1"] or ev[f"restart_s_{n}"]:  # the same runs as if each had run in one go
                one = t["ev1"]["seconds"] - (ev["restart_s_1"] or 0.0)
                ev[f"speedup_{n}_less_restarts"] = one / max(t[f"ev{n}"]["seconds"] - (ev[f"restart_s_{n}"] or 0.0), 1)
        loop_n = ev[f"episode_loop_seconds_{n}"] = busiest_process(out / f"ev{n}", "episodes_s")
        ev[f"decode_steps_{n}"] = busiest_process(out / f"ev{n}", "decode_steps")
        for key in EV_PARTS:
            ev[f"{key}_{n}"] = busiest_process(out / f"ev{n}", key)
        ev[f"per_step_ms_{n}"] = per_step_ms(out / f"ev{n}")
        ev[f"launch_s_{n}"] = launch_seconds(out / f"ev{n}")
        ev[f"balance_{n}"] = shard_balance(out / f"ev{n}")
        if loop1 and loop_n:
            ev[f"loop_speedup_{n}"] = loop1 / loop_n
        ev[f"combined_{n}"] = combined_launch(out / f"ev{n}")  # one launch ran every benchmark in turn
        ev[f"queue_bound_{n}"] = queue_bound(out / "ev1", n, combined=ev[f"combined_{n}"])
    res["eval_devices"] = ev

    prov = provenance(device="cpu" if cpu else "cuda", dtype="float32" if cpu else "bfloat16", command=command)
    try:
        import torch

        prov["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - provenance must not fail the report
        prov["gpus"] = []
    # The runs' own provenance: a report rebuilt on another machine (merging calls) names the runs' GPUs and versions,
    # not its own: the fits' speed files and the evals' run configs (a call that ran only `ev` phases has no fit)
    configs = [_json(f) or {} for f in sorted(out.glob("ev*/**/run_config.json"))]
    runs = [s["provenance"] for s in speeds + configs if isinstance(s.get("provenance"), dict)]
    if not prov["gpus"] and runs:
        widest = max(runs, key=lambda r: (r.get("device") or {}).get("count") or 0)["device"]
        prov["gpus"] = [widest.get("name") or "?"] * int(widest.get("count") or 1)
    prov["run_commits"] = sorted({r.get("git_commit") for r in runs if r.get("git_commit")})
    versions = {", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items() if v) for r in runs}
    prov["run_versions"] = sorted(versions - {""})  # a run that recorded no versions adds no empty entry
    prov["run_dates"] = sorted({(r.get("utc") or "")[:10] for r in runs if r.get("utc")})
    prov["cpu_check"] = cpu
    label = out / "emb_model.txt"
    res["ddp_model"] = label.read_text().strip() if label.is_file() else "embedded SmolLM2-135M-Instruct"
    res["provenance"] = prov
    return res


def _peft_detail(peft: dict) -> str:
    """`` (largest relative diff X against tolerance T; the adapters' effect resolved: yes/no)`` from a
    peft_check result (the last part only where it records ``resolved``), or nothing where there is none."""
    roles = list((peft.get("roles") or {}).values())
    if not roles:
        return ""
    worst = max(r.get("rel_diff", 0.0) for r in roles)
    text = f" (largest relative diff {worst:.2e} against {peft.get('rel_tol')}"
    if all("resolved" in r for r in roles):  # records before the key have no say
        text += f"; the adapters' effect resolved: {'yes' if all(r['resolved'] for r in roles) else 'no'}"
    return text + ")"


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "missing"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v, digits) for v in x) + "]"
    return str(x)


def _ddp_lines(d: dict[str, Any], title: str, sizes: list[int]) -> list[str]:
    lines = [f"## {title}, same global batch", "", "| run | val/loss per validation | tokens/s | speed-up |",
             "|---|---|---|---|",
             f"| 1 device | {_fmt(d['val_loss_1gpu'])} | {_fmt((d['speed_1gpu'] or {}).get('tokens_per_s'), 0)} | 1 |",
             f"| 1 device, adapter seed 1 (noise) | {_fmt(d['val_loss_1gpu_adapter_seed1'])} | | |"]  # fmt: skip
    for n in sizes:
        lines.append(f"| DDP, {n} devices | {_fmt(d[f'val_loss_ddp{n}'])} | "
                     f"{_fmt((d[f'speed_ddp{n}'] or {}).get('tokens_per_s'), 0)} | "
                     f"{_fmt(d.get(f'ddp{n}_speedup_tokens_per_s'), 2)}x |")  # fmt: skip
    for n in sizes:
        rep = d.get(f"ddp{n}_repeats")
        if rep:  # the speed-up above is then the pooled one
            lines.append(f"| DDP, {n} devices: every repeat pooled | | one device "
                         f"{', '.join(_fmt(x, 0) for x in rep['tokens_per_s_1gpu'])}; DDP "
                         f"{', '.join(_fmt(x, 0) for x in rep[f'tokens_per_s_ddp{n}'])} | repeat by repeat "
                         f"{', '.join(_fmt(x, 2) + 'x' for x in rep['speedup_paired'])} |")  # fmt: skip
    splits = [("1 device", d.get("host_split_1gpu"))]
    splits += [(f"DDP, {n} devices", d.get(f"host_split_ddp{n}")) for n in sizes]
    if any(rows for _, rows in splits):
        lines += ["", "Where a micro-batch went (ms, first fit of each; per rank: micro-batch / host time between "
                  "Lightning's hooks / the rest, waiting):"]  # fmt: skip
        for label, rows in splits:
            if rows:
                each = (f"rank {r['rank']} {r['step_ms']:.1f} / {r['host_ms']:.1f} / {r['rest_ms']:.1f}" for r in rows)
                lines.append(f"- {label}: " + "; ".join(each))
    seeds = d.get("seed_final_losses") or {}
    lines += ["", f"Seed noise (seed 1 - seed 0): {_fmt(d.get('seed_noise'), 6)}; final loss by adapter seed: "
              + (", ".join(f"{k}: {_fmt(v, 5)}" for k, v in seeds.items()) or "missing")
              + f"; spread (largest |seed k - seed 0|): {_fmt(d.get('seed_spread_last'), 6)}."]  # fmt: skip
    for n in sizes:
        lines.append(f"DDP on {n} - 1 device: {_fmt(d.get(f'ddp{n}_minus_1gpu'), 6)}; within the seed noise at the "
                     f"last validation: {_fmt(d.get(f'ddp{n}_within_noise'))}.")  # fmt: skip
        for k, diffs in (d.get(f"ddp{n}_minus_1gpu_repeats") or {}).items():
            lines.append(f"DDP on {n} - 1 device, repeat {k}: {_fmt(diffs, 6)}.")
        if f"ddp{n}_repeats_within_noise" in d:
            lines.append(f"Every repeat within the seed noise at the last validation: "
                         f"{_fmt(d[f'ddp{n}_repeats_within_noise'])}.")  # fmt: skip
    return lines + [""]


def _fsdp_ran(f: dict[str, Any], sizes: list[int]) -> bool:
    """Whether any FSDP-block phase left a figure (the one-GPU reference, a strategy's run, an export check)."""
    per_size = ("speed_fsdp{}", "speed_fsdp{}_resumed", "speed_ddp{}", "fsdp{}_export_in_peft")
    keys = ["speed_1gpu"] + [k.format(n) for n in sizes for k in per_size]
    return any(f.get(k) for k in keys)


def _ddp_ran(d: dict[str, Any], sizes: list[int]) -> bool:
    """Whether any DDP phase of this block left a figure."""
    keys = ["speed_1gpu", "val_loss_1gpu"] + [k.format(n) for n in sizes for k in ("speed_ddp{}", "val_loss_ddp{}")]
    return any(d.get(k) for k in keys)


def _eval_ran(e: dict[str, Any]) -> bool:
    """Whether any ``ev`` phase left a figure: episodes, timings or a stop."""
    return any(v not in (None, False, {}, []) for v in e.values())


def _fsdp_lines(f: dict[str, Any], tiny: str, sizes: list[int]) -> list[str]:
    lines = [
        f"## FSDP, {tiny or 'LLaMA-3.1-8B shapes'}",
        "",
        "| run | tokens/s | speed-up | peak memory per device (GiB) | steps |",
        "|---|---|---|---|---|",
        f"| 1 device | {_fmt((f['speed_1gpu'] or {}).get('tokens_per_s'), 0)} | 1 | "
        f"{_fmt((f['speed_1gpu'] or {}).get('peak_memory_gib_per_rank'), 2)} | "
        f"{_fmt((f['speed_1gpu'] or {}).get('global_step'))} |",
    ]
    for n in sizes:
        for label, key in ((f"FSDP, {n} devices", f"speed_fsdp{n}"),
                           (f"FSDP, {n} devices, resumed (--ckpt_path last)", f"speed_fsdp{n}_resumed"),
                           (f"DDP, {n} devices (the whole base on each)", f"speed_ddp{n}")):  # fmt: skip
            s = f.get(key) or {}
            lines.append(f"| {label} | {_fmt(s.get('tokens_per_s'), 0)} | "
                         f"{_fmt(f.get(f'{key}_speedup_tokens_per_s'), 2)}x | "
                         f"{_fmt(s.get('peak_memory_gib_per_rank'), 2)} | {_fmt(s.get('global_step'))} |")  # fmt: skip
    lines.append("")
    for n in sizes:
        peft = f.get(f"fsdp{n}_export_in_peft") or {}
        lines.append(
            f"FSDP on {n}: peak memory per device {_fmt(f.get(f'fsdp{n}_peak_memory_over_1gpu'), 3)}x one device's; "
            f"resumed to step {_fmt(f.get(f'fsdp{n}_resumed_to_step'))} ({_fmt(f.get(f'fsdp{n}_resume_log_line'))}); "
            f"export format equal to the 1-device export: fit's {_fmt(f.get(f'export_fsdp{n}r_same_format_as_1gpu'))},"
            f" `export` command's {_fmt(f.get(f'export_fx{n}_same_format_as_1gpu'))}; fit's export vs the export "
            f"command: max |diff| {_fmt(f.get(f'fsdp{n}_export_fit_vs_export_command_max_abs_diff'), 8)}; loads in "
            f"PEFT with lragent's logits: {_fmt(peft.get('ok'))}{_peft_detail(peft)}."
        )
    return lines + [""]


def _eval_lines(e: dict[str, Any], sizes: list[int]) -> list[str]:
    lines = ["## eval --devices N vs --devices 1", ""]
    for n in sizes:
        if f"stopped_{n}" in e:
            lines.append(
                f"{n} devices: stopped (exit {e[f'stopped_{n}']}) after {_fmt(e.get(f'episodes_{n}'))} episodes; each "
                f"of them equal to one device's: {_fmt(e.get(f'finished_equal_{n}'))}; no speed-up (not finished)."
            )
            continue
        lines.append(
            f"{n} devices: episodes {_fmt(e.get('episodes_1'))} vs {_fmt(e.get(f'episodes_{n}'))}; same predictions "
            f"and lengths: {_fmt(e.get(f'same_episodes_{n}'))} ({_fmt(e.get(f'differing_episodes_{n}'))} differ); "
            f"wall seconds {_fmt(e.get('wall_seconds_1'))} vs {_fmt(e.get(f'wall_seconds_{n}'))}, "
            f"speed-up {_fmt(e.get(f'speedup_{n}'), 2)}x; episode loops alone (the slowest shard) "
            f"{_fmt(e.get('episode_loop_seconds_1'), 1)} vs {_fmt(e.get(f'episode_loop_seconds_{n}'), 1)} s, "
            f"{_fmt(e.get(f'loop_speedup_{n}'), 2)}x; decode steps of the busiest process "
            f"{_fmt(e.get('decode_steps_1'), 0)} vs {_fmt(e.get(f'decode_steps_{n}'), 0)}; its seconds in the "
            f"engine's decode calls {_fmt(e.get('advance_s_1'), 1)} vs {_fmt(e.get(f'advance_s_{n}'), 1)} and in the "
            f"episodes' own work {_fmt(e.get('agent_s_1'), 1)} vs {_fmt(e.get(f'agent_s_{n}'), 1)}; before its loop, "
            f"its start (interpreter, imports) {_fmt(e.get('startup_s_1'), 1)} vs {_fmt(e.get(f'startup_s_{n}'), 1)} "
            f"and setup (corpus, model, sizing) {_fmt(e.get('setup_s_1'), 1)} vs {_fmt(e.get(f'setup_s_{n}'), 1)}; "
            f"in its loop, the graph captures (kernel compiles included) {_fmt(e.get('capture_s_1'), 1)} vs "
            f"{_fmt(e.get(f'capture_s_{n}'), 1)}; the launcher's own start {_fmt(e.get(f'launch_s_{n}'), 1)} s."
        )
        if e.get(f"speedup_{n}_less_restarts") is not None:
            lines.append(
                f"  - a run resumed in a later call paid its start again ({_fmt(e.get('restart_s_1'), 1)} vs "
                f"{_fmt(e.get(f'restart_s_{n}'), 1)} s of start, setup and captures): without it the speed-up is "
                f"**{_fmt(e.get(f'speedup_{n}_less_restarts'), 2)}x**."
            )
        per_step = [e.get("per_step_ms_1"), e.get(f"per_step_ms_{n}")]
        if all(per_step):
            parts = ("waiting for the GPU", "graph replay calls", "the engine's other host work", "the episodes' work")
            lines.append("  - per decode step, all processes together, 1 vs " + f"{n} devices (ms): " + "; ".join(
                f"{name} {a:.2f} vs {b:.2f}" for name, a, b in zip(parts, *per_step, strict=True)) + ".")  # fmt: skip
        bound = e.get(f"queue_bound_{n}")
        if bound and bound.get("bound"):
            lines.append(
                f"  - what the episodes' lengths allow: one device's episode times, scheduled scheme by scheme on one "
                f"process of its rows and on {n} of them, {bound['loop_s_1']:.1f} vs {bound[f'loop_s_{n}']:.1f} s, "
                f"at most "
                f"**{bound['bound']:.2f}x** for the loops (the queue's tail alone: steps as fast as one device's, no "
                f"fixed cost)."
            )
        for bench, bal in (e.get(f"balance_{n}") or {}).items():
            lines.append(
                f"  - {bench} shards: episodes {bal['episodes']}, decode steps {bal['decode_steps']}; slowest loop "
                f"{_fmt(bal['slowest_over_mean'], 2)}x the mean."
            )
    return lines + [""]


def markdown(res: dict[str, Any]) -> str:
    prov = res["provenance"]
    sizes = res.get("sizes") or [2]
    f, e = res["fsdp_8b"], res["eval_devices"]
    tiny = "tiny random LLaMA (CPU check)" if prov["cpu_check"] else ""
    ddp_model = res.get("ddp_model") or tiny or "embedded SmolLM2-135M-Instruct"
    where = "CPU check (gloo processes, tiny random models; no GPU figure)" if prov["cpu_check"] else ", ".join(
        prov.get("gpus") or ["?"]
    )  # fmt: skip
    lines = ["# Several GPUs: scripts/gpu_multi.sh", "", f"Devices: {where}.", ""]
    # a call that ran only some phases (the eval alone, say) shows their sections, not tables of "missing"
    absent = [name for name, ran in (("DDP", _ddp_ran(res["ddp_embedded"], sizes)), ("FSDP", _fsdp_ran(f, sizes)),
                                     ("eval --devices N", _eval_ran(e))) if not ran]  # fmt: skip
    if absent:
        lines += [f"Not in this output (none of their phases ran): {', '.join(absent)}.", ""]
    if "DDP" not in absent:
        lines += _ddp_lines(res["ddp_embedded"], f"DDP, {ddp_model}", sizes)
    if res.get("ddp_accuracy_model", {}).get("speed_1gpu"):
        lines += _ddp_lines(res["ddp_accuracy_model"], "DDP, the accuracy model (Qwen2.5-Coder-1.5B-Instruct)", sizes)
    if "FSDP" not in absent:
        lines += _fsdp_lines(f, tiny, sizes)
    if "eval --devices N" not in absent:
        lines += _eval_lines(e, sizes)
    lines += [
        "## Phases",
        "",
        "| phase | exit | seconds |",
        "|---|---|---|",
        *(f"| {k} | {v['rc']} | {v['seconds']} |" for k, v in res["phases"].items()),
        "",
        "---",
        f"Commit {prov.get('git_commit')}{' (dirty)' if prov.get('git_dirty') else ''}, {prov.get('utc')}; "
        + ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v)
        + f"; dtype {prov.get('dtype')}.  ",
        *(
            [
                f"Runs: commits {', '.join(c[:7] for c in prov['run_commits'])}; dates {', '.join(prov['run_dates'])}; "
                + "; ".join(prov["run_versions"])
                + ".  "
            ]
            if prov.get("run_commits")
            else []
        ),
        f"Command: `{prov.get('command')}`",
        "",
    ]
    return "\n".join(lines)


def scaling_curves(res: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """``{run: [(GPUs, speed-up over one GPU), ...]}`` of every measured run (one GPU is 1 by definition)."""
    sizes = res.get("sizes") or [2]
    curves: dict[str, list[tuple[int, float]]] = {}
    sources = (("DDP, embedded model", res["ddp_embedded"], "ddp{}_speedup_tokens_per_s"),
               ("DDP, accuracy model", res.get("ddp_accuracy_model") or {}, "ddp{}_speedup_tokens_per_s"),
               ("FSDP, 8B shapes", res["fsdp_8b"], "speed_fsdp{}_speedup_tokens_per_s"),
               ("eval --devices N (wall)", res["eval_devices"], "speedup_{}"))  # fmt: skip
    for label, block, key in sources:
        points = [(n, block[key.format(n)]) for n in sizes if block.get(key.format(n))]
        if points:
            curves[label] = [(1, 1.0), *points]
    return curves


def plot(res: dict[str, Any], path: Path) -> bool:
    """Speed-up over one GPU against GPUs, one line per run, with the ideal line; False when nothing was measured."""
    curves = scaling_curves(res)
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(n for pts in curves.values() for n, _ in pts)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot([1, top], [1, top], color="0.7", linestyle="--", label="ideal")
    for label, pts in curves.items():
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s (eval: 1 / wall time) over one GPU's")
    ax.set_xticks(sorted({n for pts in curves.values() for n, _ in pts}))
    gpus = res["provenance"].get("gpus") or ["?"]
    ax.set_title(f"{len(gpus)} × {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


def multi_gpu_report(out: str, command: str | None = None, sizes: str = "2") -> int:
    """The several-GPU report of a ``gpu_multi.sh`` output directory: ``multi_gpu.json``, ``.md`` and the plot.

    Args:
        out: the directory gpu_multi.sh wrote.
        command: the command that produced it (provenance).
        sizes: the GPU counts compared with one GPU (gpu_multi.sh's SIZES), e.g. "2 4".

    Returns:
        the exit status.
    """
    try:
        counts = [int(x) for x in sizes.replace(",", " ").split()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise ValueError(f"--sizes {sizes!r}: GPU counts of at least 2 (e.g. '2 4')")
    folder = Path(out)
    if not folder.is_dir():
        raise NotADirectoryError(f"--out {folder} is not a directory")
    res = collect(folder, command, counts)
    (folder / "multi_gpu.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    if plot(res, folder / "multi_gpu.png"):
        md += "\n![speed-up against GPUs](multi_gpu.png)\n"
    (folder / "multi_gpu.md").write_text(md)
    print((folder / "multi_gpu.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eval_suite.bench.multi_gpu_report --out DIR`` (:func:`multi_gpu_report`)."""
    from lragent.command import run_command

    return run_command(multi_gpu_report, argv, "python -m eval_suite.bench.multi_gpu_report")


if __name__ == "__main__":
    raise SystemExit(main())
