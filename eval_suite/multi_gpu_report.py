"""Collects the results of ``scripts/gpu_multi.sh`` into ``OUT/multi_gpu.json`` and ``OUT/multi_gpu.md``.

python -m eval_suite.multi_gpu_report --out OUT [--command "the command that produced OUT"]

Figures: validation loss of the embedded model on one GPU (two adapter seeds: the run-to-run noise) and with DDP on two
GPUs at the same global batch, tokens/s and the speed-up; FSDP at 8B shapes: peak memory per GPU, tokens/s, the resume
and the export format against the one-GPU export; ``eval --devices 2`` against ``--devices 1``: the same episodes and
the wall-clock ratio. A missing input is reported as missing (``null``), never filled in.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from lragent.provenance import provenance


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def timings(out: Path) -> dict[str, dict[str, int]]:
    """``{phase: {"rc", "seconds"}}`` from ``timings.txt`` (``rc`` an exit status or ``"skipped"``)."""
    rows: dict[str, dict[str, int]] = {}
    path = out / "timings.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        parts = line.split()
        if len(parts) == 3 and parts[1].startswith("rc=") and parts[2].startswith("seconds="):
            rc = parts[1][3:]  # an exit status, or "skipped" (past gpu_multi.sh's BUDGET_S)
            rows[parts[0]] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(parts[2][8:])}
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


def collect(out: Path, command: str | None) -> dict[str, Any]:
    t = timings(out)
    speeds = [_json(f) or {} for f in sorted(out.glob("*_speed.json"))]  # the device any run reported
    cpu = any(s.get("provenance", {}).get("device", {}).get("type") == "cpu" for s in speeds)
    res: dict[str, Any] = {"phases": t}

    # embedded model: DDP vs one GPU at the same global batch, and the noise between two adapter seeds
    v1, v1s, v2 = (val_losses(out / f"{n}_metrics.csv") for n in ("emb1", "emb1s", "emb2"))
    s1, s2 = speed(out, "emb1"), speed(out, "emb2")
    ddp: dict[str, Any] = {"val_loss_1gpu": v1, "val_loss_1gpu_adapter_seed1": v1s, "val_loss_ddp2": v2}
    if v1 and v2 and len(v1) == len(v2):
        ddp["ddp_minus_1gpu"] = [b - a for a, b in zip(v1, v2, strict=True)]
    if v1 and v1s and len(v1) == len(v1s):
        ddp["seed_noise"] = [b - a for a, b in zip(v1, v1s, strict=True)]
    if "ddp_minus_1gpu" in ddp and "seed_noise" in ddp:
        ddp["within_noise"] = abs(ddp["ddp_minus_1gpu"][-1]) <= abs(ddp["seed_noise"][-1])
    ddp["speed_1gpu"], ddp["speed_ddp2"] = s1, s2
    if s1 and s2 and s1["tokens_per_s"] and s2["tokens_per_s"]:
        ddp["speedup_tokens_per_s"] = s2["tokens_per_s"] / s1["tokens_per_s"]
    res["ddp_embedded"] = ddp

    # 8B shapes: FSDP memory and speed, resume, export format
    layouts = {n: export_layout(out / f"{n}_export") for n in ("b1", "f1", "f2", "fx")}
    ref = layouts["b1"]
    fsdp: dict[str, Any] = {"speed_1gpu": speed(out, "b1"), "speed_fsdp2": speed(out, "f1"),
                            "speed_fsdp2_resumed": speed(out, "f2"), "speed_ddp2": speed(out, "d8")}  # fmt: skip
    for key in ("speed_fsdp2", "speed_ddp2"):
        one, two = fsdp["speed_1gpu"], fsdp[key]
        if one and two and one["tokens_per_s"] and two["tokens_per_s"]:
            fsdp[f"{key}_speedup_tokens_per_s"] = two["tokens_per_s"] / one["tokens_per_s"]
    f2 = fsdp["speed_fsdp2_resumed"]
    fsdp["resumed_to_step"] = f2["global_step"] if f2 else None
    fsdp["resume_log_line"] = next(
        (ln.strip() for ln in (out / "f2.log").read_text().splitlines() if "Restoring states" in ln), None
    ) if (out / "f2.log").is_file() else None  # fmt: skip
    fsdp["export_layout_1gpu"] = ref
    for n in ("f2", "fx"):
        fsdp[f"export_{n}_same_format_as_1gpu"] = None if ref is None or layouts[n] is None else layouts[n] == ref
    fsdp["export_fit_vs_export_command_max_abs_diff"] = max_abs_diff(out / "f2_export", out / "fx_export")
    res["fsdp_8b"] = fsdp

    # eval --devices 2 vs 1
    e1, e2 = episodes(out / "ev1"), episodes(out / "ev2")
    ev: dict[str, Any] = {"episodes_1": None if e1 is None else len(e1), "episodes_2": None if e2 is None else len(e2)}
    if e1 is not None and e2 is not None:
        ev["same_episodes"] = e1 == e2
        ev["differing_episodes"] = len(set(e1) ^ set(e2))
    if "ev1" in t and "ev2" in t and t["ev1"]["seconds"]:
        ev["wall_seconds_1"], ev["wall_seconds_2"] = t["ev1"]["seconds"], t["ev2"]["seconds"]
        ev["wall_ratio_2_over_1"] = t["ev2"]["seconds"] / t["ev1"]["seconds"]
    res["eval_devices"] = ev

    prov = provenance(device="cpu" if cpu else "cuda", dtype="float32" if cpu else "bfloat16", command=command)
    try:
        import torch

        prov["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - provenance must not fail the report
        prov["gpus"] = []
    prov["cpu_check"] = cpu
    label = out / "emb_model.txt"
    res["ddp_model"] = label.read_text().strip() if label.is_file() else "embedded SmolLM2-135M-Instruct"
    res["provenance"] = prov
    return res


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "missing"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(v, digits) for v in x) + "]"
    return str(x)


def markdown(res: dict[str, Any]) -> str:
    prov = res["provenance"]
    d, f, e = res["ddp_embedded"], res["fsdp_8b"], res["eval_devices"]
    tiny = "tiny random LLaMA (CPU check)" if prov["cpu_check"] else ""
    ddp_model = res.get("ddp_model") or tiny or "embedded SmolLM2-135M-Instruct"
    tps1, tps2 = (_fmt((d[k] or {}).get("tokens_per_s"), 0) for k in ("speed_1gpu", "speed_ddp2"))
    where = "CPU check (2 gloo processes, tiny random models; no GPU figure)" if prov["cpu_check"] else ", ".join(
        prov.get("gpus") or ["?"]
    )  # fmt: skip
    lines = [
        "# Several GPUs (issue 21): scripts/gpu_multi.sh",
        "",
        f"Devices: {where}.",
        "",
        f"## DDP, {ddp_model}, same global batch",
        "",
        "| run | val/loss per epoch | tokens/s |",
        "|---|---|---|",
        f"| 1 device, accumulate 2 | {_fmt(d['val_loss_1gpu'])} | {tps1} |",
        f"| 1 device, adapter seed 1 (noise) | {_fmt(d['val_loss_1gpu_adapter_seed1'])} | |",
        f"| DDP, 2 devices | {_fmt(d['val_loss_ddp2'])} | {tps2} |",
        "",
        f"DDP - 1 device: {_fmt(d.get('ddp_minus_1gpu'), 6)}; seed noise: {_fmt(d.get('seed_noise'), 6)}; "
        f"within noise: {_fmt(d.get('within_noise'))}; speed-up: {_fmt(d.get('speedup_tokens_per_s'), 2)}x.",
        "",
        f"## FSDP, {tiny or 'LLaMA-3.1-8B shapes'}",
        "",
        "| run | tokens/s | peak memory per device (GiB) | steps |",
        "|---|---|---|---|",
    ]
    for label, key in (("1 device, accumulate 2", "speed_1gpu"), ("FSDP, 2 devices", "speed_fsdp2"),
                       ("FSDP resumed (--ckpt_path last)", "speed_fsdp2_resumed"),
                       ("DDP, 2 devices (the whole base on each)", "speed_ddp2")):  # fmt: skip
        s = f[key] or {}
        lines.append(
            f"| {label} | {_fmt(s.get('tokens_per_s'), 0)} | {_fmt(s.get('peak_memory_gib_per_rank'), 2)} | "
            f"{_fmt(s.get('global_step'))} |"
        )
    lines += [
        "",
        f"Speed-up over one device: FSDP {_fmt(f.get('speed_fsdp2_speedup_tokens_per_s'), 2)}x, DDP "
        f"{_fmt(f.get('speed_ddp2_speedup_tokens_per_s'), 2)}x.",
        "",
        f"Resumed to step {_fmt(f['resumed_to_step'])} ({_fmt(f['resume_log_line'])}). Export format equal to the "
        f"1-device export: fit's export {_fmt(f['export_f2_same_format_as_1gpu'])}, `export --device` "
        f"{_fmt(f['export_fx_same_format_as_1gpu'])}; fit's export vs the export command: max |diff| "
        f"{_fmt(f['export_fit_vs_export_command_max_abs_diff'], 8)}.",
        "",
        "## eval --devices 2 vs --devices 1",
        "",
        f"Episodes {_fmt(e.get('episodes_1'))} vs {_fmt(e.get('episodes_2'))}; same predictions and lengths: "
        f"{_fmt(e.get('same_episodes'))} ({_fmt(e.get('differing_episodes'))} differ); wall seconds "
        f"{_fmt(e.get('wall_seconds_1'))} vs {_fmt(e.get('wall_seconds_2'))}, "
        f"ratio {_fmt(e.get('wall_ratio_2_over_1'), 2)}.",
        "",
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
        f"Command: `{prov.get('command')}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the directory gpu_multi.sh wrote")
    ap.add_argument("--command", default=None, help="the command that produced it (provenance)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not out.is_dir():
        print(f"error: {out} is not a directory", file=sys.stderr)
        return 2
    res = collect(out, args.command)
    (out / "multi_gpu.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "multi_gpu.md").write_text(markdown(res))
    print((out / "multi_gpu.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
