"""The sharing-study driver: a resumed study never re-runs finished jobs, dependencies and memory are respected,
failures are retried a bounded number of times, the training recipe is equal across λ, and the report is built from
the job outputs alone."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from eval_suite.study.driver import (
    PROFILES,
    SWEEP_POINTS,
    Job,
    archive,
    build_plan,
    build_sweep_plan,
    is_done,
    job_state,
    main,
    pack,
    run,
    train_config,
)
from eval_suite.study.report import chance_gap, write_report, write_sweep_report

SAMPLED = {"protocol": {"untrained": {"sampler": 2}}}
SWEEP_SAMPLED = {"protocol": {"non_shared": {"sampler": 2}}}  # rows drawn by today's sampler (2)
FAKE = r"""
import json, os, sys, time
root, name, done, log = sys.argv[1:5]
with open(log, "a") as f:
    f.write(json.dumps({"job": name, "start": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
time.sleep(0.3)
if os.environ.get("FAIL_JOB") == name:
    with open(log, "a") as f:
        f.write(json.dumps({"job": name, "end": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
    sys.exit(3)
path = os.path.join(root, done)
os.makedirs(os.path.dirname(path), exist_ok=True)
row = "untrained" if "_untrained/" in name else name.rsplit("/", 1)[-1]  # as the eval names its rows
body = {"episodes": {row: {"0": 1, "1": 1, "2": 1}}, "protocol": {row: {"sampler": 2}}}
body = body if done.endswith("summary.json") else {}
open(path, "w").write(json.dumps(body))
with open(log, "a") as f:
    f.write(json.dumps({"job": name, "end": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
"""


def _fake_plan(tmp_path: Path, **kw) -> list[Job]:
    plan = build_plan(("scienceqa",), (0.0, 0.5), runs=3, epochs=1, **kw)
    log = tmp_path / "launches.jsonl"
    return [
        dataclasses.replace(j, cmd=[sys.executable, "-c", FAKE, "{root}", j.name, j.done_file, str(log)]) for j in plan
    ]


def _launches(tmp_path: Path) -> list[dict]:
    path = tmp_path / "launches.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def test_resumed_study_does_not_rerun_finished_jobs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    root = tmp_path / "study"
    plan = _fake_plan(tmp_path)
    finished = [j for j in plan if j.name in ("train/scienceqa_lam0", "eval/scienceqa_lam0/non_shared")]
    for j in finished:  # finished before this call (a previous session)
        (root / j.done_file).parent.mkdir(parents=True, exist_ok=True)
        body = {"episodes": {"non_shared": {"0": 90, "1": 90, "2": 90}}, "protocol": {"non_shared": {"sampler": 2}}}
        body = body if j.kind == "eval" else {}
        (root / j.done_file).write_text(json.dumps(body))
    # an eval whose summary lacks a run is not done (it resumes from its episode log)
    partial = next(j for j in plan if j.name == "eval/scienceqa_lam0/base_lr_shared")
    (root / partial.done_file).parent.mkdir(parents=True, exist_ok=True)
    (root / partial.done_file).write_text(json.dumps({"episodes": {"base_lr_shared": {"0": 90}}}))
    assert not is_done(partial, root)
    assert run(root, plan, gpu_gb=1000, poll=0.05) == 0
    starts = [x for x in _launches(tmp_path) if "start" in x]
    launched = [x["job"] for x in starts]
    assert sorted(launched) == sorted(j.name for j in plan if j not in finished)
    # dependencies first: every eval of a set starts after its training ended
    ends = {x["job"]: x["end"] for x in _launches(tmp_path) if "end" in x}
    for x in starts:
        job = next(j for j in plan if j.name == x["job"])
        for dep in job.deps:
            assert dep not in ends or ends[dep] <= x["start"], (job.name, dep)
    # a second call finds everything done and launches nothing
    n = len(starts)
    assert run(root, plan, gpu_gb=1000, poll=0.05) == 0
    assert len([x for x in _launches(tmp_path) if "start" in x]) == n


def test_memory_budget_and_bounded_retries(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    monkeypatch.setenv("FAIL_JOB", "fidelity/scienceqa_lam0.5")
    root = tmp_path / "study"
    plan = [j for j in _fake_plan(tmp_path) if "indepA" not in j.name and "untrained" not in j.name][:6]
    plan += [j for j in _fake_plan(tmp_path) if j.name in ("train/scienceqa_lam0.5", "fidelity/scienceqa_lam0.5")]
    budget = max(j.gb for j in plan)  # room for one big job at a time
    assert run(root, plan, gpu_gb=budget, retries=1, poll=0.05) == 1  # the failing job never finishes
    events = _launches(tmp_path)
    starts = sorted(x["start"] for x in events if "start" in x)
    # at no moment do the running jobs' memory estimates add up to more than the budget
    gb = {j.name: j.gb for j in plan}
    level = peak = 0.0
    timeline = [(x["start"], gb[x["job"]]) for x in events if "start" in x]
    timeline += [(x["end"], -gb[x["job"]]) for x in events if "end" in x]
    for _, delta in sorted(timeline, key=lambda t: (t[0], t[1])):
        level += delta
        peak = max(peak, level)
    assert peak <= budget
    fails = [x for x in events if x["job"] == "fidelity/scienceqa_lam0.5" and "start" in x]
    assert len(fails) == 2  # first try + 1 retry
    assert len(starts) == len(plan) - 1 + 2


def test_training_recipe_is_equal_across_lambda(tmp_path: Path) -> None:
    cfgs = {lam: train_config("scienceqa", lam, "base_lr_shared", True, tmp_path, epochs=2) for lam in (0.0, 0.5)}
    full = train_config("scienceqa", 1.0, "full_shared", True, tmp_path, epochs=2)
    for cfg in (*cfgs.values(), full):
        kinds = [cb["class_path"].rsplit(".", 1)[-1] for cb in cfg["trainer"]["callbacks"]]
        assert "EarlyStopping" not in kinds and "ExportAdapters" in kinds
        assert not any(k.endswith("ProgressBar") for k in kinds)  # the fit runs with enable_progress_bar off
        export = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("ExportAdapters"))
        assert export["init_args"]["best"] is False
        assert cfg["data"]["pack_prefixes"] is False and cfg["trainer"]["max_epochs"] == 2
        assert cfg["data"]["option_variants"] == [2, 3]
    strip = lambda c: {
        **c,
        "model": {k: v for k, v in c["model"].items() if k not in ("lambda_shared", "shared_scheme")},
    }  # noqa: E731
    assert strip(cfgs[0.0]) == strip(cfgs[0.5]) == strip(full)
    assert (cfgs[0.5]["model"]["lambda_shared"], full["model"]["shared_scheme"]) == (0.5, "full_shared")


def test_plan_rows_and_cli_errors(capsys) -> None:
    plan = build_plan(("scienceqa", "hotpotqa"), (0.0, 0.25, 0.5, 1.0), runs=3)
    evals = {j.name for j in plan if j.kind == "eval"}
    for bench in ("scienceqa", "hotpotqa"):
        for s in ("non_shared", "base_lr_shared", "full_shared", "base_shared", "droidspeak"):
            assert f"eval/{bench}_lam0/{s}" in evals
        for lam in ("0.25", "0.5", "1", "1_full"):
            assert {f"eval/{bench}_lam{lam}/{s}" for s in ("non_shared", "base_lr_shared", "full_shared")} <= evals
        assert f"eval/{bench}_indepA/base_lr_shared" not in evals  # needs shared A
        assert f"eval/{bench}_untrained/non_shared" in evals
    assert all("--runs" in j.cmd and j.cmd[j.cmd.index("--runs") + 1] == "3" for j in plan if j.kind == "eval")
    assert main(["plan", "--lambdas", "0,2"]) == 2
    assert "--lambdas" in capsys.readouterr().err
    assert main(["plan", "--benchmarks", "mmlu"]) == 2
    assert main(["run", "--gpus", "0"]) == 2  # a count: 0 must not mean "all GPUs"
    assert "--gpus 0" in capsys.readouterr().err


def _episode(row: str, qid: str, run: int, correct: bool, n: int) -> dict:
    return {
        "benchmark": "scienceqa", "qid": qid, "level": "1-4", "row": row, "scheme": row, "adapters": "a", "run": run,
        "protocol": {"temperature": 0.9, "top_p": 0.75, "constraints": []}, "prediction": "A" if correct else "B",
        "gold": 0, "choices": [f"c{i}" for i in range(n)], "correct": float(correct), "oof": False, "steps": 3,
        "num_tokens": 100, "roles": {},
    }  # fmt: skip


def test_chance_gap_by_hand() -> None:
    # q0 (2 options): correct in both runs -> 1 - 1/2; q1 (4 options): wrong, then right -> 0.5 - 1/4
    recs = [_episode("non_shared", "q0", r, True, 2) for r in range(2)]
    recs += [_episode("non_shared", "q1", 0, False, 4), _episode("non_shared", "q1", 1, True, 4)]
    recs += [_episode("base_lr_shared", "q0", 0, False, 2)]
    c = chance_gap(recs)
    assert c["mean"] == pytest.approx((0.5 + 0.25) / 2) and c["chance"] == pytest.approx((0.5 + 0.25) / 2)
    assert c["ci95"] == [pytest.approx(0.25), pytest.approx(0.5)]  # two questions: the extremes


def test_report_from_job_outputs(tmp_path: Path) -> None:
    root = tmp_path / "study"
    plan = build_plan(("scienceqa",), (0.0, 0.5), runs=2)
    for j in plan:
        if j.kind != "eval" or ("lam" not in j.name and "untrained" not in j.name):
            continue
        row = j.meta["row"]  # the untrained set's eval names its row "untrained"
        d = root / j.name
        d.mkdir(parents=True)
        if row == "untrained":  # right on q0 and q3 only: 1/3 against a chance rate of 1/2
            recs = [_episode(row, f"q{q}", r, q % 3 == 0, 2) for q in range(6) for r in range(2)]
        else:
            recs = [_episode(row, f"q{q}", r, q % 2 == 0 or row == "non_shared", 2) for q in range(6) for r in range(2)]
        (d / "episodes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
        (d / "summary.json").write_text(
            json.dumps({"episodes": {row: {"0": 6, "1": 6}}, "protocol": {row: {"sampler": 2}}})
        )
    fid = next(j for j in plan if j.name == "fidelity/scienceqa_lam0")  # one set's fidelity done, the others not
    (root / fid.done_file).parent.mkdir(parents=True, exist_ok=True)
    overall = {"base_lr_shared": (0.1, 0.9), "full_shared": (0.3, 0.8)}
    schemes = {k: {"overall": {"kl": kl, "top1": t1, "examples": 5, "tokens": 50}} for k, (kl, t1) in overall.items()}
    (root / fid.done_file).write_text(json.dumps({"schemes": schemes, "examples": [{"kl": 0.1}]}))
    data = write_report(root, plan, tmp_path / "out")
    md = (tmp_path / "out" / "study.md").read_text()
    s = data["scienceqa_lam0.5"]["summary"]
    page = json.loads((tmp_path / "out" / "study.json").read_text())["sets"]
    assert page["scienceqa_lam0"]["fidelity"] == {"schemes": schemes}  # examples stay in the job
    # every measured scheme in the fidelity table, "–" where none was measured; sets without fidelity left out
    assert "| scienceqa_lam0 | 0.100 | 0.300 | – | – | 90.0 | 80.0 | – | – | 5 (50) |" in md
    assert "| scienceqa_lam0.5 | 0" not in md.split("teacher-forced fidelity")[1].split("##")[0]
    assert "- scienceqa_lam0.5: " in md and "fidelity" in md.split("- scienceqa_lam0.5: ")[1].split("\n")[0]
    assert "- scienceqa_lam0: " not in md  # its rows and its fidelity are done
    assert s["paired_vs_non_shared"]["accuracy"]["base_lr_shared"]["mean"] == pytest.approx(-0.5)
    assert "-50.0 [" in md and "λ study" in md and "above chance" in md
    assert "| scienceqa_untrained | untrained | 33.3 ± 0.0 |" in md  # the untrained row is a row of the tables
    assert data["scienceqa_untrained"]["chance"]["mean"] == pytest.approx(1 / 3 - 1 / 2)
    assert (tmp_path / "out" / "study.html").read_text().count("<table>") >= 3
    assert (tmp_path / "out" / "lambda_scienceqa.png").stat().st_size > 1000
    assert "missing" in md  # the independent-A rows never ran


def test_pack_leaves_checkpoints_out(tmp_path: Path) -> None:
    root = tmp_path / "study"
    (root / "train/x/checkpoints").mkdir(parents=True)
    (root / "train/x/checkpoints/last.ckpt").write_bytes(b"0" * 1000)
    (root / "train/x/adapters/plan").mkdir(parents=True)
    (root / "train/x/adapters/lragent_adapters.safetensors").write_bytes(b"1")
    (root / "train/x/adapters/plan/adapter_model.safetensors").write_bytes(b"2")
    (root / "train/x/csv/version_0").mkdir(parents=True)
    (root / "train/x/csv/version_0/metrics.csv").write_text("epoch,step,val/loss\n0,5,1.5\n")
    (root / "train/x/csv/version_0/hparams.yaml").write_text("lr: 1\n")
    parts = pack(root, tmp_path / "out", piece_bytes=50)
    import io
    import tarfile

    data = b"".join(p.read_bytes() for p in parts)
    names = tarfile.open(fileobj=io.BytesIO(data)).getnames()
    assert "study/train/x/adapters/lragent_adapters.safetensors" in names
    assert not any(n.endswith(".ckpt") or "plan/adapter_model" in n for n in names)
    assert "study/train/x/csv/version_0/metrics.csv" in names  # the sweep's val/loss per epoch
    assert not any(n.endswith("hparams.yaml") for n in names)
    assert len(parts) > 1


def test_archive_is_one_file_per_set_without_weights_and_byte_stable(tmp_path: Path) -> None:
    """Per set: its train / eval / fidelity files and nothing of another set; no adapter weights, checkpoints or
    driver.json; the same files give the same bytes (a commit carries only the sets that moved); extracting every
    archive gives back the root's files."""
    import io
    import tarfile
    import time

    root = tmp_path / "study"
    files = {
        "train/a_lam0/log.txt": "fit a", "train/a_lam0/csv/version_0/metrics.csv": "epoch\n0\n",
        "train/a_lam0/csv/version_0/hparams.yaml": "lr: 1", "train/a_lam0/checkpoints/last.ckpt": "ckpt",
        "train/a_lam0/adapters/lragent_adapters.safetensors": "weights", "eval/a_lam0/non_shared/summary.json": "{}",
        "eval/a_lam0/base_lr_shared/episodes.jsonl": "{}\n", "fidelity/a_lam0/fidelity.json": "{}",
        "eval/a_untrained/non_shared/summary.json": "{}", "probe/a/summary.json": "{}", "driver.log": "log",
        "driver.json": "{}",
    }  # fmt: skip
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "a1").mkdir()
    (tmp_path / "a1" / "a_lam0.tar.gz").write_bytes(b"an older archive of the set")
    first = {p.name: p.read_bytes() for p in archive(root, tmp_path / "a1")}
    assert sorted(p.name for p in (tmp_path / "a1").iterdir()) == sorted(first)  # the older .tar.gz is gone
    time.sleep(1.1)
    (root / "driver.log").touch()  # a new time, the same bytes
    second = {p.name: p.read_bytes() for p in archive(root, tmp_path / "a2")}
    assert first == second
    assert sorted(first) == ["a_lam0.tar.xz", "a_untrained.tar.xz", "driver.tar.xz", "probe.tar.xz"]
    names = {k: tarfile.open(fileobj=io.BytesIO(v)).getnames() for k, v in first.items()}
    assert sorted(names["a_lam0.tar.xz"]) == [
        "study/eval/a_lam0/base_lr_shared/episodes.jsonl", "study/eval/a_lam0/non_shared/summary.json",
        "study/fidelity/a_lam0/fidelity.json", "study/train/a_lam0/csv/version_0/metrics.csv",
        "study/train/a_lam0/log.txt",
    ]  # fmt: skip
    out = tmp_path / "back"
    for v in first.values():
        tarfile.open(fileobj=io.BytesIO(v)).extractall(out, filter="data")
    back = {str(f.relative_to(out / "study")) for f in out.rglob("*") if f.is_file()}
    dropped = {"train/a_lam0/csv/version_0/hparams.yaml", "train/a_lam0/checkpoints/last.ckpt", "driver.json",
               "train/a_lam0/adapters/lragent_adapters.safetensors"}  # fmt: skip
    assert back == set(files) - dropped
    assert all((out / "study" / r).read_text() == files[r] for r in back)
    assert main(["archive", "--root", str(tmp_path / "nowhere")]) == 2


def test_an_archive_over_the_piece_size_is_split_and_read_back_whole(tmp_path: Path) -> None:
    """A set whose archive outgrows the largest file the repository keeps is written in pieces that join into the one
    archive; reading the folder extracts pieces, whole archives and older gzip ones alike; archiving again at a size
    that fits replaces the pieces by one file (no stale piece left)."""
    import random

    from eval_suite.study.driver import read_archives

    root = tmp_path / "root"
    rng = random.Random(0)
    files = {"eval/big_lam0/decide/episodes.jsonl": "".join(f"{rng.random()}\n" for _ in range(4000)),
             "eval/small_lam0/decide/summary.json": "{}", "driver.log": "log"}  # fmt: skip
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    out = tmp_path / "a"
    written = archive(root, out, piece_bytes=20_000)
    names = sorted(p.name for p in out.iterdir())
    pieces = [n for n in names if n.startswith("big_lam0.tar.xz.part")]
    assert len(pieces) >= 2 and names == sorted([*pieces, "driver.tar.xz", "small_lam0.tar.xz"])
    assert sorted(p.name for p in written) == names and all(p.stat().st_size <= 20_000 for p in written)
    assert archive(root, tmp_path / "b", piece_bytes=20_000) and all(
        (tmp_path / "b" / n).read_bytes() == (out / n).read_bytes() for n in names
    )  # byte-stable, pieces too
    (out / "old_lam1.tar.gz").write_bytes(_gzip_tar({"study/eval/old_lam1/x/summary.json": "{}"}))
    assert read_archives(out, tmp_path / "back") == ["big_lam0", "driver", "old_lam1", "small_lam0"]
    back = tmp_path / "back" / "study"
    assert all((back / rel).read_text() == text for rel, text in files.items())
    assert (back / "eval/old_lam1/x/summary.json").read_text() == "{}"
    archive(root, out, piece_bytes=10_000_000)
    assert not list(out.glob("big_lam0.tar.xz.part*")) and (out / "big_lam0.tar.xz").is_file()


def test_archived_episode_timings_are_kept_to_the_millisecond_and_nothing_else_changes(tmp_path: Path) -> None:
    """An episode log's seconds (``wall_s``, a role's ``decode_s``) come back rounded to 1 ms; every other value, a
    float under another key included, comes back as written, and a torn last line is kept as it was."""
    import json

    from eval_suite.study.driver import read_archives

    record = {"qid": "7", "correct": 0.5, "wall_s": 2.5586348009999256, "seed": 3,
              "roles": {"plan": {"decode_s": 1.4119887909998852, "prefill_s": 0.0, "decode_tokens": 27}},
              "protocol": {"top_p": 0.7512345}, "thoughts": ["naïve é"]}  # fmt: skip
    root = tmp_path / "root"
    (root / "eval/s_lam0/decide").mkdir(parents=True)
    (root / "eval/s_lam0/decide/episodes.jsonl").write_text(json.dumps(record) + '\n{"qid": "8", "wall')
    (root / "eval/s_lam0/decide/timing.json").write_text('{"loop_s": 1.23456789}')
    archive(root, tmp_path / "a")
    read_archives(tmp_path / "a", tmp_path / "back")
    first, torn = (tmp_path / "back/study/eval/s_lam0/decide/episodes.jsonl").read_text().split("\n")
    back = json.loads(first)
    assert back["wall_s"] == 2.559 and back["roles"]["plan"]["decode_s"] == 1.412
    assert back["roles"]["plan"]["prefill_s"] == 0.0 and back["roles"]["plan"]["decode_tokens"] == 27
    assert {k: back[k] for k in ("qid", "correct", "seed", "protocol", "thoughts")} == {
        k: record[k] for k in ("qid", "correct", "seed", "protocol", "thoughts")
    }
    assert torn == '{"qid": "8", "wall'
    assert (tmp_path / "back/study/eval/s_lam0/decide/timing.json").read_text() == '{"loop_s": 1.23456789}'


def _gzip_tar(members: dict[str, str]) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_jobs_spread_over_gpus_within_each_budget(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    plan = [j for j in _fake_plan(tmp_path) if j.kind == "eval" and "untrained" in j.name]
    log = str(tmp_path / "launches.jsonl")
    fids = [p for p in _fake_plan(tmp_path) if p.kind == "fidelity"]
    plan += [
        dataclasses.replace(j, name=f"{j.name}_{i}", done_file=f"x{i}/fidelity.json", deps=(),
                            cmd=[sys.executable, "-c", FAKE, "{root}", f"{j.name}_{i}", f"x{i}/fidelity.json", log])
        for i, j in enumerate(fids)
    ]  # fmt: skip
    # a job that exits 0 without its result counts as failed (relaunching it would never end)
    plan += [dataclasses.replace(fids[0], name="fidelity/no_result", done_file="never/written.json", deps=())]
    budget = 10.0  # one fidelity job (8 GB) per GPU at a time
    assert run(tmp_path / "study", plan, gpu_gb=budget, poll=0.05, gpus=2, retries=1) == 1  # 20-GB eval never fits
    attempts_log = tmp_path / "study" / "fidelity/no_result" / "attempts.jsonl"
    assert [json.loads(x)["rc"] for x in attempts_log.read_text().splitlines()] == [97, 97]
    events = [x for x in _launches(tmp_path)]
    assert {x["gpu"] for x in events if "start" in x} == {"0", "1"}
    for gpu in ("0", "1"):
        # by GPU, not by job name: the no-result job runs under another job's name, on either GPU per attempt
        here = [x for x in events if x.get("gpu") == gpu]
        timeline = sorted([(x["start"], 1) for x in here if "start" in x]
                          + [(x["end"], -1) for x in here if "end" in x])  # fmt: skip
        level = peak = 0
        for _, d in timeline:
            level += d
            peak = max(peak, level)
        assert peak == 1


def test_reset_failed_keeps_successes(tmp_path: Path) -> None:
    from eval_suite.study.driver import forget_failed_attempts

    for name, rcs in (("eval/a/non_shared", [1, 1, 1]), ("train/b", [1, 0]), ("eval/c/full_shared", [0])):
        d = tmp_path / name
        d.mkdir(parents=True)
        (d / "attempts.jsonl").write_text("".join(json.dumps({"rc": rc}) + "\n" for rc in rcs))
    assert forget_failed_attempts(tmp_path) == ["eval/a/non_shared"]
    assert not (tmp_path / "eval/a/non_shared/attempts.jsonl").exists()
    assert (tmp_path / "train/b/attempts.jsonl").exists()


def test_every_planned_scheme_is_valid_for_its_adapter_set() -> None:
    """Each eval and fidelity job names only schemes its adapters can run: one A per role (the independent-A set)
    cannot serve base_lr_shared (the fidelity job of that set failed on the GPU for asking it)."""
    from lragent.schemes import parse_schemes
    from lragent.sharing import make_scheme

    for job in build_plan(("scienceqa", "hotpotqa"), (0.0, 0.5), runs=3):
        if job.kind == "train":
            continue
        schemes = parse_schemes(job.cmd[job.cmd.index("--scheme") + 1])
        for s in schemes:
            make_scheme(s, 3, 1, shared_a=job.meta["shared_a"], n_layers=4)  # raises on an impossible pair
        if job.kind == "fidelity":
            assert len(schemes) == (5 if job.meta["shared_a"] else 4), job.name


def test_untrained_eval_counts_as_done_under_its_row_name(tmp_path: Path) -> None:
    """The eval names the --adapter_init zero row "untrained", not by its scheme: its finished summary is done (the
    job was relaunched three times on the GPU and recorded as failed)."""
    job = next(j for j in build_plan(("hotpotqa",), (0.0,), runs=3) if j.name == "eval/hotpotqa_untrained/non_shared")
    path = tmp_path / job.done_file
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rows": ["untrained"], "episodes": {"untrained": {"0": 1, "1": 1}}, **SAMPLED}))
    assert not is_done(job, tmp_path)  # two of three runs
    path.write_text(json.dumps({"rows": ["untrained"], "episodes": {"untrained": {"0": 1, "1": 1, "2": 1}}, **SAMPLED}))
    assert is_done(job, tmp_path)


def test_answer_thought_sets_train_with_the_recipe_variant(tmp_path: Path) -> None:
    """The ScienceQA answer-thought sets differ from their λ's plain set in data.answer_thoughts only."""
    plan = {j.name: j for j in build_plan(("scienceqa",), (0.0, 0.5), runs=3)}
    for lam in ("0", "0.5"):
        at, plain = plan[f"train/scienceqa_at_lam{lam}"].meta, plan[f"train/scienceqa_lam{lam}"].meta
        cfgs = [train_config(m["benchmark"], m["lambda"], m["train_scheme"], m["shared_a"], tmp_path, 2, m["data"])
                for m in (at, plain)]  # fmt: skip
        assert cfgs[0]["data"].pop("answer_thoughts") is True and cfgs[1]["data"].pop("answer_thoughts") is False
        assert cfgs[0] == cfgs[1]
    assert not any("_at_" in j.name for j in build_plan(("hotpotqa",), (0.0,)))


def test_shipped_sets_have_every_scheme() -> None:
    """The bundled shared-A sets get all five schemes at 3 runs: ScienceQA's is the study's λ = 0.5 set, HotpotQA's
    is evaluated as shipped (no training job; its adapters from data/adapters)."""
    plan = {j.name: j for j in build_plan(("scienceqa", "hotpotqa"), (0.0, 0.5), runs=3)}
    for s in ("non_shared", "base_lr_shared", "full_shared", "base_shared", "droidspeak"):
        assert f"eval/scienceqa_lam0.5/{s}" in plan
        job = plan[f"eval/hotpotqa_shipped/{s}"]
        assert job.cmd[job.cmd.index("--adapters") + 1] == "data/adapters/hotpotqa_sharedA" and not job.deps
    assert "train/hotpotqa_shipped" not in plan and "eval/scienceqa_shipped/non_shared" not in plan


QWEN = PROFILES["qwen2.5-coder-1.5b"]


def test_accuracy_model_plan_names_its_model_everywhere(tmp_path: Path) -> None:
    plan = build_plan(("scienceqa", "hotpotqa"), (0.0, 0.5), runs=3, profile=QWEN)
    for job in plan:
        if job.kind in ("eval", "fidelity", "probe"):
            assert job.cmd[job.cmd.index("--model") + 1] == "qwen2.5-coder-1.5b", job.name
        if job.kind == "eval":  # non_shared keeps three caches: fewer rows
            batch = int(job.cmd[job.cmd.index("--batch") + 1])
            assert batch == (32 if job.meta["scheme"] == "non_shared" else 64)
            assert job.gb == (30.0 if job.meta["scheme"] == "non_shared" else 24.0)
    names = {j.name for j in plan}
    assert {"probe/scienceqa", "probe/hotpotqa"} <= names  # the zero-shot reference rows
    assert not any("shipped" in n or "_at_lam" in n for n in names)  # the 135M model's bundled sets and variants
    default = build_plan(("scienceqa",), (0.0,), runs=3)
    assert not any("--model" in j.cmd for j in default) and not any(j.kind == "probe" for j in default)
    train = next(j for j in plan if j.name == "train/hotpotqa_lam0.5")
    cfg = train_config(**{k: train.meta[k] for k in ("benchmark",)}, lam=0.5, scheme="base_lr_shared", shared_a=True,
                       run_dir=tmp_path, epochs=2, config_prefix=train.meta["config_prefix"])  # fmt: skip
    assert cfg["model"]["model_name"] == "qwen2.5-coder-1.5b" and cfg["model"]["model_dtype"] == "bfloat16"
    assert cfg["data"]["data_files"]["plan"].endswith("hotpotqa/plan.jsonl.gz") and cfg["model"]["lambda_shared"] == 0.5


def test_sweep_recipe_overrides_reach_the_fit_config(tmp_path: Path) -> None:
    point = {"lr": 7e-4, "epochs": 3, "targets": "qvo_mlp", "rank": 16}
    cfg = train_config("scienceqa", 0.0, "base_lr_shared", True, tmp_path, epochs=3, config_prefix="qwen", recipe=point)
    m = cfg["model"]
    assert m["lr"] == m["shared_a_lr"] == 7e-4 and set(m["role_lr"].values()) == {7e-4}
    assert set(m["role_lr"]) == {"plan", "action", "reflect"}
    assert (m["rank"], m["alpha"]) == (16, 32.0) and "down_proj" in m["targets"] and cfg["trainer"]["max_epochs"] == 3
    plain = train_config("scienceqa", 0.0, "base_lr_shared", True, tmp_path, epochs=3, config_prefix="qwen")
    assert plain["model"]["rank"] == 8 and plain["model"]["targets"] == ["q_proj", "v_proj"]


def test_sweep_plan_judges_each_point_right_after_its_training() -> None:
    plan = build_sweep_plan(("scienceqa", "hotpotqa"), SWEEP_POINTS, runs=1, profile=QWEN)
    trains = [j for j in plan if j.kind == "train"]
    evals = [j for j in plan if j.kind == "eval"]
    assert len(trains) == len(evals) == 2 * len(SWEEP_POINTS) and len({j.meta["set"] for j in trains}) == len(trains)
    for e in evals:
        assert e.meta["scheme"] == "non_shared" and e.cmd[e.cmd.index("--runs") + 1] == "1"
        (dep,) = e.deps
        train = next(t for t in trains if t.name == dep)
        assert train.meta["set"] == e.meta["set"] and train.meta["recipe"] == e.meta["recipe"]
        assert train.meta["epochs"] == e.meta["recipe"]["epochs"] and train.meta["lambda"] == 0.0
        # ranked before every later point's training, so a finished point is judged first
        later = [t for t in trains if t.priority > train.priority]
        assert all(e.priority < t.priority for t in later)
    assert [j.name for j in plan[:2]] == ["probe/scienceqa", "probe/hotpotqa"]
    with pytest.raises(ValueError, match="targets"):
        build_sweep_plan(("scienceqa",), ({"lr": 1e-4, "epochs": 1, "targets": "all", "rank": 8},))


def test_sweep_report_from_job_outputs(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    points = (
        {"lr": 1e-4, "epochs": 2, "targets": "qv", "rank": 8},
        {"lr": 1e-3, "epochs": 2, "targets": "qv", "rank": 8},
    )
    plan = build_sweep_plan(("scienceqa",), points, runs=1, profile=QWEN)
    for k, job in enumerate(j for j in plan if j.kind == "eval"):
        d = root / job.name
        d.mkdir(parents=True)
        # point 0: right on 3 of 4 questions (one answer invalid); point 1: right on 1 of 4, one episode OOF
        recs = [_episode("non_shared", f"q{q}", 0, q < (3 if k == 0 else 1), 3) for q in range(4)]
        if k == 0:
            recs[3]["prediction"] = "Z"
        else:
            recs[3].update(oof=True, prediction=None)
        (d / "episodes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
        (d / "summary.json").write_text(json.dumps({"episodes": {"non_shared": {"0": 4}}, **SWEEP_SAMPLED}))
        train = root / "train" / job.meta["set"]
        (train / "csv" / "version_0").mkdir(parents=True)
        (train / "csv" / "version_0" / "metrics.csv").write_text(
            f"epoch,step,val/loss\n0,5,{1.5 - k}\n1,10,{1.25 - k}\n"
        )
        # two trainings of the set (a retraining starts over at step 0), the second's weights evaluated
        (train / "fit_status.jsonl").write_text(
            "".join(json.dumps({"start_step": st, "train_s": t}) + "\n" for st, t in ((0, 100.0), (0, 40.0), (7, 2.0)))
        )
    # point 1's row ran once before (its older copy): right on 2 of 4
    old_copy = root / plan[-1].name
    old_copy = old_copy.with_name(old_copy.name + ".sampler1")
    old_copy.mkdir(parents=True)
    old_recs = [_episode("non_shared", f"q{q}", 0, q < 2, 3) for q in range(4)]
    (old_copy / "episodes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in old_recs))
    (root / "probe" / "scienceqa").mkdir(parents=True)
    probe = {"correct": {"mean": 61.1, "low": 51.1, "high": 71.1}, "chance": 41.1, "questions": 90}
    (root / "probe" / "scienceqa" / "summary.json").write_text(json.dumps(probe))
    reference = {"scienceqa": plan[[j.kind for j in plan].index("eval")].meta["set"]}  # point 0 ships
    entries = write_sweep_report(root, plan, tmp_path / "out", reference)
    md = (tmp_path / "out" / "sweep.md").read_text()
    first, second = entries
    assert first["accuracy"][0] == pytest.approx(0.75) and second["accuracy"][0] == pytest.approx(0.25)
    assert first["valid"] == pytest.approx(3 / 4) and second["valid"] == pytest.approx(1.0)  # of the answered
    assert second["oof"] == pytest.approx(0.25) and first["oof"] == 0.0
    assert (first["val_loss"], second["val_loss"]) == (pytest.approx(1.25), pytest.approx(0.25))  # the last epoch
    assert "| scienceqa_lr0.0001_ep2_qv_r8 | 0.0001 | 2 | qv | 8 | 1.250 | 75.0 [" in md
    assert "accuracy 61.1% [51.1, 71.1], chance 41.1%" in md
    # paired to the shipped point on the same questions: 0, -1, -1, 0; the shipped point itself has no difference
    assert first["vs_reference"] is None and second["vs_reference"]["mean"] == pytest.approx(-0.5)
    assert second["vs_reference"]["questions"] == 4
    assert first["earlier"] == [] and second["earlier"] == [{"copy": "non_shared.sampler1", "episodes": 4, "mean": 0.5}]
    assert first["train_s"] == pytest.approx(42.0)  # the last training and its resume, not the discarded one
    assert "| 25.0 [" in md and "| -50.0 [" in md and "| 50.0 |" in md


def test_a_sets_rows_come_before_later_sets_train() -> None:
    """A lease that ends early leaves whole sets: λ = 0 (both benchmarks) trains, then all five of its rows run, and
    only then do the next sets train; the fidelity jobs come last."""
    plan = build_plan(("scienceqa", "hotpotqa"), (0.0, 0.5), runs=3, profile=QWEN)
    order = [j.name for j in plan]
    first_other_train = min(i for i, n in enumerate(order) if n.startswith("train/") and "_lam0/" not in n + "/")
    lam0_rows = [i for i, n in enumerate(order) if n.startswith("eval/") and "_lam0/" in n]
    assert len(lam0_rows) == 10 and max(lam0_rows) < first_other_train
    assert order[:2] == ["probe/scienceqa", "probe/hotpotqa"]
    assert all(n.startswith("fidelity/") for n in order[-len([n for n in order if n.startswith("fidelity/")]) :])


def test_a_training_whose_rows_are_all_kept_is_not_run_again(tmp_path: Path, monkeypatch) -> None:
    """Results kept without their adapters (the repository keeps episodes, not adapter sets) resume without training
    again; a set with one row missing trains again for it."""
    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    root = tmp_path / "study"
    plan = [j for j in _fake_plan(tmp_path) if j.meta.get("set") in ("scienceqa_lam0", "scienceqa_lam0.5")]
    for j in plan:  # every row and fidelity of lam0 kept; lam0.5 lacks its full_shared row
        if j.kind == "train" or j.name == "eval/scienceqa_lam0.5/full_shared":
            continue
        (root / j.done_file).parent.mkdir(parents=True, exist_ok=True)
        row = j.meta.get("row")
        body = {"episodes": {row: {"0": 90, "1": 90, "2": 90}}, "protocol": {row: {"sampler": 2}}}
        body = body if j.kind == "eval" else {}
        (root / j.done_file).write_text(json.dumps(body))
    jobs = {j.name: j for j in plan}
    assert job_state(jobs["train/scienceqa_lam0"], root, set(), jobs) == "unneeded"
    assert job_state(jobs["train/scienceqa_lam0.5"], root, set(), jobs) == "ready"
    assert run(root, plan, gpu_gb=1000, poll=0.05) == 0
    launched = sorted(x["job"] for x in _launches(tmp_path) if "start" in x)
    assert launched == ["eval/scienceqa_lam0.5/full_shared", "train/scienceqa_lam0.5"]


def _job(name: str, kind: str, gb: float, priority: float, log: Path, deps: tuple[str, ...] = ()) -> Job:
    done = f"{name}/summary.json" if kind == "eval" else f"{name}/out.json"
    meta = {"scheme": "non_shared", "runs": 3, "row": name.rsplit("/", 1)[-1]}  # the row FAKE writes
    return Job(name, kind, [sys.executable, "-c", FAKE, "{root}", name, done, str(log)], done, deps, gb, priority, meta)


def _intervals(tmp_path: Path) -> dict[str, tuple[float, float]]:
    ev = _launches(tmp_path)
    return {x["job"]: (x["start"], next(y["end"] for y in ev if y["job"] == x["job"] and "end" in y))
            for x in ev if "start" in x}  # fmt: skip


def test_strict_priority_a_later_job_does_not_take_the_room_a_big_one_waits_for(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    log = tmp_path / "launches.jsonl"
    plan = [_job("a/first", "eval", 10, 0, log), _job("b/big", "eval", 50, 1, log), _job("c/small", "eval", 10, 2, log)]
    assert run(tmp_path / "root", plan, gpu_gb=55, poll=0.02) == 0
    t = _intervals(tmp_path)
    assert t["b/big"][0] >= t["a/first"][1]  # it waited for the room
    assert t["c/small"][0] >= t["b/big"][0]  # and nothing behind it jumped the queue meanwhile


def test_trainings_are_capped_per_gpu_without_holding_back_evaluations(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    log = tmp_path / "launches.jsonl"
    plan = [_job(f"train/s{i}", "train", 5, i, log) for i in range(4)] + [_job("eval/e", "eval", 5, 10, log)]
    assert run(tmp_path / "root", plan, gpu_gb=1000, poll=0.02, max_train=2) == 0
    t = _intervals(tmp_path)
    trains = [v for k, v in t.items() if k.startswith("train/")]
    for start, _ in trains:  # never more than two trainings at one moment
        assert sum(s <= start < e for s, e in trains) <= 2
    assert t["eval/e"][0] < max(s for s, _ in trains)  # the evaluation started while trainings still queued


def test_a_killed_drivers_running_job_is_waited_for_not_started_again(tmp_path: Path, monkeypatch) -> None:
    import platform
    import subprocess

    monkeypatch.setattr(
        "eval_suite.study.driver.prepare", lambda job, root: [c.replace("{root}", str(root)) for c in job.cmd]
    )
    root = tmp_path / "root"
    log = tmp_path / "launches.jsonl"
    plan = [_job("eval/orphan", "eval", 10, 0, log), _job("eval/other", "eval", 10, 1, log)]
    # the orphan: started by a driver that is gone (its pid: a process that has exited), still running
    orphan = subprocess.Popen(
        [
            sys.executable,
            "-c",
            FAKE.replace("0.3", "1.0"),
            str(root),
            "eval/orphan",
            plan[0].done_file,
            str(tmp_path / "orphan.jsonl"),
            f"--out={root}/eval/orphan",
        ]
    )  # fmt: skip  (as a job's command names its directory)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root.mkdir()
    (root / "driver.json").write_text(json.dumps({"pid": dead.pid, "host": platform.node(),
                                                  "running": {"eval/orphan": orphan.pid}}))  # fmt: skip
    import signal

    def _hang(*_: object) -> None:
        raise TimeoutError("the driver waits for an orphan that has ended (a zombie counted as running)")

    signal.signal(signal.SIGALRM, _hang)
    signal.alarm(60)
    try:
        assert run(root, plan, gpu_gb=100, poll=0.02) == 0
    finally:
        signal.alarm(0)
    orphan.wait()
    assert [x["job"] for x in _launches(tmp_path) if "start" in x] == ["eval/other"]  # the orphan was not relaunched
    assert is_done(plan[0], root)
    attempts = [json.loads(x) for x in (root / "eval/orphan/attempts.jsonl").read_text().splitlines()]
    assert attempts[-1]["rc"] == 0  # ended with its result: counted as a success


def test_study_page_carries_the_zero_shot_reference(tmp_path: Path) -> None:
    root = tmp_path / "study"
    plan = build_plan(("hotpotqa",), (0.0,), runs=3, profile=QWEN)
    (root / "probe" / "hotpotqa").mkdir(parents=True)
    probe = {"em": {"mean": 46.7, "low": 36.7, "high": 56.7}, "f1": {"mean": 51.8}, "questions": 90}
    (root / "probe" / "hotpotqa" / "summary.json").write_text(json.dumps(probe))
    data = write_report(root, plan, tmp_path / "out", partial=True)
    md = (tmp_path / "out" / "study.md").read_text()
    assert "EM 46.7 [36.7, 56.7], F1 51.8, 90 questions" in md
    assert "hotpotqa_zero_shot" not in data  # a reference line, not an adapter set


def test_a_row_of_the_old_sampler_runs_again_and_its_episodes_are_kept_beside(tmp_path: Path) -> None:
    """Sampler 1 (u could round to 1.0: a uniformly random token in 0.9% of draws on Qwen's vocabulary) rows are not
    done: the job runs again in a fresh directory, the old episodes moved to ``<scheme>.sampler1`` as evidence."""
    from eval_suite.study.driver import prepare

    root = tmp_path / "study"
    (job,) = [j for j in build_plan(("scienceqa",), (0.0,), runs=1) if j.name == "eval/scienceqa_lam0/non_shared"]
    d = root / job.name
    d.mkdir(parents=True)
    (d / "run_config.json").write_text(json.dumps({"benchmark": "scienceqa"}))  # no sampler: sampler 1
    (d / "episodes.jsonl").write_text("{}\n")
    (d / "summary.json").write_text(json.dumps({"episodes": {"non_shared": {"0": 90}}}))
    assert not is_done(job, root)
    prepare(job, root)
    assert (root / "eval/scienceqa_lam0/non_shared.sampler1/episodes.jsonl").read_text() == "{}\n"
    assert d.is_dir() and not any(d.iterdir())
    (d / "run_config.json").write_text(json.dumps({"benchmark": "scienceqa", "sampler": 2}))
    (d / "summary.json").write_text(json.dumps({"episodes": {"non_shared": {"0": 90}}, **SWEEP_SAMPLED}))
    assert is_done(job, root)
    prepare(job, root)  # today's sampler: left where it is
    assert (d / "summary.json").is_file()


def test_sweep_changes_one_thing_at_a_time_around_each_benchmarks_best_lr() -> None:
    """After the three learning-rate points, each benchmark's epoch, rank and target points use its own best
    learning rate (HotpotQA 1e-4, ScienceQA 3e-4), the one its shipped recipe uses."""
    from eval_suite.study.driver import SWEEP_BEST_LR

    plan = build_sweep_plan(("scienceqa", "hotpotqa"), SWEEP_POINTS, runs=1, profile=QWEN)
    trains = {j.meta["set"]: j.meta["recipe"] for j in plan if j.kind == "train"}
    for bench, lr in SWEEP_BEST_LR.items():
        later = {n: r for n, r in trains.items() if n.startswith(bench) and (r["epochs"] != 2 or r["rank"] != 8
                 or r["targets"] != "qv")}  # fmt: skip
        assert len(later) == 3 and {r["lr"] for r in later.values()} == {lr}, (bench, later)
        cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / f"qwen_{bench}.yaml").read_text())
        assert cfg["model"]["lr"] == lr  # the shipped recipe's learning rate
    assert "hotpotqa_lr0.0001_ep4_qv_r8" in trains and "scienceqa_lr0.0003_ep4_qv_r8" in trains
    with pytest.raises(ValueError, match="no best learning rate for 'other'"):
        build_sweep_plan(("other",), ({"lr": "best", "epochs": 2, "targets": "qv", "rank": 8},), profile=QWEN)


def test_sampler_reruns_compare_each_older_copy_with_its_rerun(tmp_path: Path) -> None:
    """A row kept as <row>.sampler1 beside its rerun: episodes in both (question, run, seed), how many agree on
    prediction, token count and actions, and which differ; a rerun's extra episode is not counted as shared."""
    from eval_suite.study.report import sampler_reruns, sampler_reruns_line

    def write(d: Path, recs: list[dict]) -> None:
        d.mkdir(parents=True)
        (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    def ep(q: str, pred: str, tokens: int = 5) -> dict:
        return {"qid": q, "run": 0, "seed": 1, "prediction": pred, "num_tokens": tokens, "actions": ["Finish[x]"]}

    write(tmp_path / "eval" / "s" / "non_shared.sampler1", [ep("a", "x"), ep("b", "y"), ep("c", "z", 6)])
    write(tmp_path / "eval" / "s" / "non_shared", [ep("a", "x"), ep("b", "y"), ep("c", "z", 7), ep("d", "w")])
    got = sampler_reruns(tmp_path)
    row = got["s/non_shared.sampler1"]
    assert (row["old_episodes"], row["rerun_episodes"], row["shared"], row["identical"]) == (3, 4, 3, 2)
    assert row["differing"] == [["c", 0, 1]] and len(row["old_sha256"]) == 64
    assert "1 rows, 3 episodes in both, **2 with the same prediction" in sampler_reruns_line(got)
    assert sampler_reruns(tmp_path / "none") == {} and sampler_reruns_line({}) == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "llama-70b"], "--model 'llama-70b': allowed "),
        (["plan", "--runs", "0"], "--runs and --epochs must be >= 1, got 0, "),
        (["plan", "--epochs", "0"], "--runs and --epochs must be >= 1, got 3, 0"),
        (["plan", "--max-train", "0"], "--max-train 0: at least 1 training per GPU"),
        (["run", "--gpu-gb", "0"], "no GPU memory to fill: give --gpu-gb (the study is meant for a GPU)"),
    ],
)
def test_study_options_are_refused_naming_the_value(argv, message, capsys, tmp_path) -> None:
    root = tmp_path / "study"  # a file: were the option let through, the run could not start in it
    root.write_text("not a study root")
    assert main([*argv, "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert root.read_text() == "not a study root"


def test_archive_of_a_missing_root_is_refused(capsys, tmp_path) -> None:
    assert main(["archive", "--root", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --root {tmp_path / 'none'}: no such study root")


def test_a_metrics_file_without_a_validation_row_is_named(tmp_path) -> None:
    from eval_suite.study.training_report import last_validation

    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss,val/loss\n1,2.0,\n2,1.5,\n")
    with pytest.raises(ValueError, match=f"^{path} has no validation row$"):
        last_validation(path)
    path.write_text("step,train/loss,val/loss\n1,2.0,\n2,1.5,1.25\n3,1.4,\n")
    assert last_validation(path)["val/loss"] == "1.25"


@pytest.mark.parametrize(("acc", "what"), [("", "empty"), ("high", "'high', not a number")])
def test_a_loss_without_a_readable_accuracy_names_its_file_and_column(tmp_path, acc, what) -> None:
    from eval_suite.study.training_report import cell

    row = {"step": "40", "val/plan/loss": "1.5", "val/plan/acc": acc}
    path = tmp_path / "hotpotqa_x" / "metrics.csv"
    with pytest.raises(ValueError) as err:
        cell(row, "plan", "plain", path)
    assert str(err.value) == f"{path}: column val/plan/acc is {what} in the row of step 40"
    assert cell({"val/plan/loss": "1.5", "val/plan/acc": "0.25"}, "plan", "plain", path) == "1.500 / 25.0%"


def test_the_training_report_names_the_file_and_column_of_a_value_it_cannot_read(tmp_path, capsys) -> None:
    """Through the command: an accuracy column absent where its loss is present, and a loss that is no number, each
    one ``error:`` line naming the run's metrics.csv and the column."""
    from eval_suite.study import training_report

    path = tmp_path / "hotpotqa_a" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("step,epoch,val/loss,val/plan/loss\n7,0,1.0,1.5\n")
    assert training_report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path}: column val/plan/acc is empty in the row of step 7"
    path.write_text("step,epoch,val/loss,val/plan/loss,val/plan/acc\n7,0,1.0,n.a.,0.5\n")
    assert training_report.main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {path}: column val/plan/loss is 'n.a.', not a number in the row of step 7"
    )


def test_reading_a_metrics_file_leaves_no_file_open(tmp_path) -> None:
    import gc
    import warnings

    from eval_suite.study.training_report import last_validation

    path = tmp_path / "metrics.csv"
    path.write_text("step,val/loss\n1,1.25\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        assert last_validation(path)["val/loss"] == "1.25"
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


def test_an_eval_is_done_only_with_every_run_of_every_row_at_this_sampler(tmp_path: Path) -> None:
    """is_done on an eval job's summary: fewer runs than asked, a row missing, or an older sampler's row is not done
    (the study runs it again, resuming its episodes); every run of every row at this sampler is."""
    from eval_suite.study.jobs import Job, is_done
    from lragent.sampling import SAMPLER_VERSION

    job = Job("eval/s/x", "eval", [], "eval/s/x/summary.json", [], 1.0, 0, {"rows": ["a", "b"], "runs": 3})
    path = tmp_path / job.done_file
    assert not is_done(job, tmp_path)  # no summary yet
    path.parent.mkdir(parents=True)

    def summary(runs: dict[str, int], sampler: int = SAMPLER_VERSION) -> None:
        episodes = {row: {str(i): {} for i in range(n)} for row, n in runs.items()}
        protocol = {row: {"sampler": sampler} for row in runs}
        path.write_text(json.dumps({"episodes": episodes, "protocol": protocol}))

    summary({"a": 3, "b": 3})
    assert is_done(job, tmp_path)
    summary({"a": 3, "b": 2})  # a run short
    assert not is_done(job, tmp_path)
    summary({"a": 3})  # a row missing
    assert not is_done(job, tmp_path)
    summary({"a": 3, "b": 3}, sampler=SAMPLER_VERSION - 1)  # an older sampler's rows run again
    assert not is_done(job, tmp_path)
    path.write_text("{not json")
    assert not is_done(job, tmp_path)


def test_pack_replaces_the_pieces_of_an_earlier_pack(tmp_path: Path) -> None:
    """Packing again into the same folder removes every older piece first: only the new pieces remain, and they
    join into the new archive."""
    import io
    import tarfile

    root = tmp_path / "study"
    (root / "eval/x").mkdir(parents=True)
    (root / "eval/x/summary.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    stale = [out / f"study.tar.gz.part{i:02d}" for i in range(5)]
    for p in stale:
        p.write_bytes(b"an earlier, longer pack")
    (out / "notes.txt").write_text("not a piece")
    parts = pack(root, out, piece_bytes=10_000_000)
    assert [p.name for p in parts] == ["study.tar.gz.part00"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "study.tar.gz.part00"]
    names = tarfile.open(fileobj=io.BytesIO(parts[0].read_bytes())).getnames()
    assert "study/eval/x/summary.json" in names


def test_the_archive_command_archives_an_existing_root_and_skips_loose_files_beside_the_sets(
    tmp_path: Path, capsys
) -> None:
    """``archive --root R --out O`` on an existing root: one archive per set folder, each path printed with its
    size; a file lying directly in ``train/`` (no set folder) starts no archive of its own; no probe folder, no
    probe archive."""
    import io
    import tarfile

    root = tmp_path / "study"
    for rel in ("train/a_lam0/log.txt", "eval/a_lam0/non_shared/summary.json", "train/notes.txt", "driver.log"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    out = tmp_path / "arch"
    assert main(["archive", "--root", str(root), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["a_lam0.tar.xz", "driver.tar.xz"]
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{out / n} {(out / n).stat().st_size}" for n in ("a_lam0.tar.xz", "driver.tar.xz")]
    names = tarfile.open(fileobj=io.BytesIO((out / "a_lam0.tar.xz").read_bytes())).getnames()
    assert sorted(names) == ["study/eval/a_lam0/non_shared/summary.json", "study/train/a_lam0/log.txt"]
    assert not (root / "archive").exists()  # --out given: nothing inside the root


def _write_episodes(d: Path, recs: list[dict]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_a_partial_report_takes_an_unfinished_rows_episodes_and_a_full_one_calls_it_missing(tmp_path: Path) -> None:
    """``partial``: an unfinished row with episodes adds them and its count; an empty episode file is still missing.
    Without ``partial`` both are missing and no episode counts."""
    from eval_suite.study.report import collect

    root = tmp_path / "study"
    plan = [j for j in build_plan(("scienceqa",), (0.0,), runs=2) if j.name.startswith("eval/scienceqa_lam0/")]
    recs = [dict(_episode("non_shared", f"q{q}", 0, q % 2 == 0, 2), seed=q) for q in range(3)]
    _write_episodes(root / "eval/scienceqa_lam0/non_shared", recs)  # no summary: unfinished
    (root / "eval/scienceqa_lam0/base_lr_shared").mkdir(parents=True)
    (root / "eval/scienceqa_lam0/base_lr_shared/episodes.jsonl").write_text("")  # started, nothing yet
    part = collect(root, plan, partial=True)["scienceqa_lam0"]
    assert part["partial"] == {"non_shared": 3} and part["summary"]["episodes"] == {"non_shared": {"0": 3}}
    assert "non_shared" not in part["missing"] and "base_lr_shared" in part["missing"]
    whole = collect(root, plan)["scienceqa_lam0"]
    assert whole["partial"] == {} and whole["summary"] is None
    assert {"non_shared", "base_lr_shared"} <= set(whole["missing"])


def test_a_finished_trainings_last_fit_status_is_reported_and_without_one_it_is_just_done(tmp_path: Path) -> None:
    """A done training: the last ``fit_status.jsonl`` record; with no status file, ``{"done": True}``."""
    from eval_suite.study.report import collect

    root = tmp_path / "study"
    plan = [j for j in build_plan(("scienceqa",), (0.0,), runs=2) if j.name == "train/scienceqa_lam0"]
    done = root / plan[0].done_file
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text("{}")
    assert collect(root, plan)["scienceqa_lam0"]["train"] == {"done": True}
    status = [{"start_step": 0, "train_s": 10.0}, {"start_step": 50, "train_s": 5.0, "stopped": "max_epochs"}]
    (root / "train/scienceqa_lam0/fit_status.jsonl").write_text("".join(json.dumps(s) + "\n" for s in status))
    assert collect(root, plan)["scienceqa_lam0"]["train"] == status[-1]


def test_an_older_sampler_copy_without_episodes_is_not_compared(tmp_path: Path) -> None:
    """A ``<row>.samplerN`` folder lacking its episode file is skipped; the copies that have one are compared."""
    from eval_suite.study.report import sampler_reruns

    ep = {"qid": "a", "run": 0, "seed": 1, "prediction": "x", "num_tokens": 5, "actions": []}
    _write_episodes(tmp_path / "eval/s/non_shared", [ep])
    _write_episodes(tmp_path / "eval/s/non_shared.sampler1", [ep])
    (tmp_path / "eval/s/base_lr_shared.sampler1").mkdir(parents=True)  # the copy's episodes were never kept
    _write_episodes(tmp_path / "eval/s/base_lr_shared", [ep])
    got = sampler_reruns(tmp_path)
    assert list(got) == ["s/non_shared.sampler1"] and got["s/non_shared.sampler1"]["identical"] == 1


def test_the_sampler_comparison_outlives_the_copies_it_was_made_from(tmp_path: Path) -> None:
    """Once written, ``sampler_reruns.json`` is kept and its line stays on the page when a later report (from a root
    without the older copies) has nothing to compare; with neither, no line."""
    import shutil

    from eval_suite.study.report import SAMPLER_RERUNS_FILE

    root = tmp_path / "study"
    plan = build_plan(("scienceqa",), (0.0,), runs=1)
    ep = {"qid": "a", "run": 0, "seed": 1, "prediction": "x", "num_tokens": 5, "actions": []}
    _write_episodes(root / "eval/scienceqa_lam0/non_shared", [ep])
    _write_episodes(root / "eval/scienceqa_lam0/non_shared.sampler1", [dict(ep, prediction="y")])
    out = tmp_path / "report"
    write_report(root, plan, out)
    kept = (out / SAMPLER_RERUNS_FILE).read_text()
    assert json.loads(kept)["scienceqa_lam0/non_shared.sampler1"]["differing"] == [["a", 0, 1]]
    first = (out / "study.md").read_text()
    assert "Rows rerun with the current sampler" in first
    shutil.rmtree(root / "eval/scienceqa_lam0/non_shared.sampler1")
    write_report(root, plan, out)
    assert (out / SAMPLER_RERUNS_FILE).read_text() == kept
    assert "Rows rerun with the current sampler" in (out / "study.md").read_text()
    write_report(root, plan, tmp_path / "fresh")
    assert not (tmp_path / "fresh" / SAMPLER_RERUNS_FILE).exists()
    assert "Rows rerun with the current sampler" not in (tmp_path / "fresh" / "study.md").read_text()


def test_a_run_without_a_status_file_has_no_status_records(tmp_path: Path) -> None:
    """``read_status``: no ``fit_status.jsonl`` gives no records; one gives each non-blank line, in order."""
    from eval_suite.study.training_logs import STATUS_FILE, read_status

    assert read_status(tmp_path / "never_trained") == []
    assert read_status(tmp_path) == []
    (tmp_path / STATUS_FILE).write_text('{"train_s": 1.0}\n\n{"train_s": 2.0}\n')
    assert read_status(tmp_path) == [{"train_s": 1.0}, {"train_s": 2.0}]


def test_metrics_files_come_in_numeric_version_order_and_read_metrics_joins_every_fit_in_that_order(
    tmp_path: Path,
) -> None:
    """``version_10`` is the eleventh ``fit`` call, after ``version_2`` (not between 1 and 2 as a name sort puts it);
    every version's rows are kept, each under its own header, in that order; other files are not metrics."""
    from eval_suite.study.training_logs import metrics_files, read_metrics

    for v in (10, 2, 0, 11, 1, 3):  # made out of order
        d = tmp_path / "csv" / f"version_{v}"
        d.mkdir(parents=True)
        (d / "metrics.csv").write_text(f"step,v{v}/loss\n{v},{v}.5\n{v + 100},\n")
    (tmp_path / "csv" / "version_3" / "hparams.yaml").write_text("lr: 1\n")
    (tmp_path / "metrics.csv").write_text("step\n99\n")  # not a fit's version folder
    assert [p.parent.name for p in metrics_files(tmp_path)] == [f"version_{v}" for v in (0, 1, 2, 3, 10, 11)]
    assert all(p.name == "metrics.csv" for p in metrics_files(tmp_path))
    fit = {v: [{"step": str(v), f"v{v}/loss": f"{v}.5"}, {"step": str(v + 100), f"v{v}/loss": ""}] for v in range(12)}
    assert read_metrics(tmp_path) == [row for v in (0, 1, 2, 3, 10, 11) for row in fit[v]]
    assert metrics_files(tmp_path / "never_trained") == [] and read_metrics(tmp_path / "never_trained") == []


def test_read_metrics_gives_each_cell_as_the_csv_writer_wrote_it_a_quoted_line_break_included(tmp_path: Path) -> None:
    """A quoted cell holding ``\\r\\n`` comes back with both characters (the file is read as csv asks, newline='')."""
    import csv

    from eval_suite.study.training_logs import read_metrics

    d = tmp_path / "csv" / "version_0"
    d.mkdir(parents=True)
    with (d / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerows([["step", "note"], ["1", "first\r\nsecond"], ["2", "plain"]])
    assert read_metrics(tmp_path) == [{"step": "1", "note": "first\r\nsecond"}, {"step": "2", "note": "plain"}]


def test_validation_rows_are_the_rows_with_a_number_in_val_loss_zero_included_nan_and_blank_left_out() -> None:
    """A training row (``val/loss`` blank or absent) and a NaN validation are not validation rows; ``0`` is one."""
    from eval_suite.study.training_logs import validation_rows

    rows = [
        {"step": "1", "val/loss": ""},
        {"step": "2"},
        {"step": "3", "val/loss": "nan"},
        {"step": "4", "val/loss": "1.25"},
        {"step": "5", "val/loss": "NaN"},
        {"step": "6", "val/loss": "0"},
        {"step": "7", "val/loss": None},  # csv.DictReader's value for a short row
    ]
    assert [r["step"] for r in validation_rows(rows)] == ["4", "6"]
    assert validation_rows([]) == []


def test_a_train_job_asks_for_its_profiles_training_memory() -> None:
    """Every training job's ``gb`` is its profile's ``gb["train"]`` (55 GB for the embedded model, 12 for Qwen)."""
    for profile, gb in ((PROFILES["default"], 55.0), (QWEN, 12.0)):
        trains = [j for j in build_plan(("scienceqa",), (0.0, 0.5), runs=1, profile=profile) if j.kind == "train"]
        assert trains and {j.gb for j in trains} == {gb} == {profile.gb["train"]}
        assert all(j.done_file == f"{j.name}/adapters/lragent_adapters.safetensors" for j in trains)


def test_an_eval_job_without_a_row_name_is_judged_by_its_schemes_row(tmp_path: Path) -> None:
    """``is_done`` of an eval job whose meta names no ``row``/``rows``: its scheme is the row it looks for."""
    from eval_suite.study.jobs import Job, is_done
    from lragent.sampling import SAMPLER_VERSION

    meta = {"scheme": "full_shared", "runs": 2}
    job = Job("eval/s/full_shared", "eval", [], "eval/s/full_shared/summary.json", meta=meta)
    path = tmp_path / job.done_file
    path.parent.mkdir(parents=True)

    def summary(row: str) -> None:
        body = {"episodes": {row: {"0": {}, "1": {}}}, "protocol": {row: {"sampler": SAMPLER_VERSION}}}
        path.write_text(json.dumps(body))

    summary("full_shared")
    assert is_done(job, tmp_path)
    summary("non_shared")  # another scheme's row only
    assert not is_done(job, tmp_path)
    named = dataclasses.replace(job, meta={"scheme": "non_shared", "row": "untrained", "runs": 2})
    summary("untrained")  # a row name, when given, wins over the scheme
    assert is_done(named, tmp_path)


def test_a_summary_without_episodes_or_protocol_is_not_done_and_raises_nothing(tmp_path: Path) -> None:
    """An eval summary lacking ``episodes`` (or ``protocol``, which means sampler 1) is a job to run, not an error."""
    from eval_suite.study.jobs import Job, is_done
    from lragent.sampling import SAMPLER_VERSION

    job = Job("eval/s/x", "eval", [], "eval/s/x/summary.json", meta={"row": "x", "runs": 1})
    path = tmp_path / job.done_file
    path.parent.mkdir(parents=True)
    for body in ({}, {"protocol": {"x": {"sampler": SAMPLER_VERSION}}}, {"episodes": {"x": {"0": {}}}}):
        path.write_text(json.dumps(body))
        assert not is_done(job, tmp_path), body
    path.write_text(json.dumps({"episodes": {"x": {"0": {}}}, "protocol": {"x": {"sampler": SAMPLER_VERSION}}}))
    assert is_done(job, tmp_path)


def test_set_names_and_a_lambda_zero_set_is_one_set_whatever_its_schemes_term() -> None:
    """With λ = 0 the shared term is off, so ``full_shared`` adds no ``_full``: the same set as base_lr_shared's."""
    from eval_suite.study.jobs import set_name

    assert set_name("scienceqa", 0.0, "full_shared") == set_name("scienceqa", 0.0) == "scienceqa_lam0"
    assert set_name("scienceqa", 1.0, "full_shared") == "scienceqa_lam1_full"
    assert set_name("hotpotqa", 0.5) == set_name("hotpotqa", 0.5, "base_lr_shared") == "hotpotqa_lam0.5"
    assert set_name("hotpotqa", 0.25, "full_shared", shared_a=False) == "hotpotqa_indepA"
    assert set_name("scienceqa", None, "full_shared") == "scienceqa_untrained"


def _training_csv(path: Path, rows: list[dict[str, str]]) -> None:
    """A Lightning-like metrics.csv: the union of the rows' columns in first-seen order, blanks where a row has none."""
    import csv

    header = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, header, restval="")
        w.writeheader()
        w.writerows(rows)


def _validation(step: int, epoch: int, first: int, parts=("plain", "base_lr_shared", "full_shared")) -> dict:
    """A validation row: role i, scheme j has loss ``<first + i>.<j>254`` and accuracy ``0.<first><i><j>6``."""
    row = {"epoch": str(epoch), "step": str(step), "val/loss": "9.0"}
    for i, role in enumerate(("plan", "action", "reflect")):
        for j, part in enumerate(("plain", "base_lr_shared", "full_shared")):
            if part in parts:
                prefix = f"val/{role}/" if part == "plain" else f"val/{role}/{part}/"
                row[prefix + "loss"], row[prefix + "acc"] = f"{first + i}.{j}254", f"0.{first}{i}{j}6"
    return row


TRAINING_TABLE = """### hotpotqa

Each cell: val loss / token accuracy on the output tokens (held-out 5% per role).

| run | step (epoch) | plan plain | plan base_lr_shared | plan full_shared | action plain | action base_lr_shared \
| action full_shared | reflect plain | reflect base_lr_shared | reflect full_shared |
|---|---|---|---|---|---|---|---|---|---|---|
| hotpotqa_untrained | 0 (0) | 5.025 / 50.1% | 5.125 / 50.2% | 5.225 / 50.3% | 6.025 / 51.1% | 6.125 / 51.2% \
| 6.225 / 51.3% | 7.025 / 52.1% | 7.125 / 52.2% | 7.225 / 52.3% |
| hotpotqa_indepA_lam0 | 20 (1) | 2.025 / 20.1% | n/a | 2.225 / 20.3% | 3.025 / 21.1% | n/a | 3.225 / 21.3% \
| 4.025 / 22.1% | n/a | 4.225 / 22.3% |
| hotpotqa_indepA_lam0.5 | 20 (1) | 2.025 / 20.1% | n/a | 2.225 / 20.3% | 3.025 / 21.1% | n/a | 3.225 / 21.3% \
| 4.025 / 22.1% | n/a | 4.225 / 22.3% |
| hotpotqa_sharedA_lam0 | 30 (2) | 1.025 / 10.1% | 1.125 / 10.2% | 1.225 / 10.3% | 2.025 / 11.1% \
| 2.125 / 11.2% | 2.225 / 11.3% | 3.025 / 12.1% | 3.125 / 12.2% | n/a |
| hotpotqa_sharedA_lam0.5 | 30 (2) | 1.025 / 10.1% | 1.125 / 10.2% | 1.225 / 10.3% | 2.025 / 11.1% \
| 2.125 / 11.2% | 2.225 / 11.3% | 3.025 / 12.1% | 3.125 / 12.2% | n/a |

### scienceqa

Each cell: val loss / token accuracy on the output tokens (held-out 5% per role).

| run | step (epoch) | plan plain | plan base_lr_shared | plan full_shared | action plain | action base_lr_shared \
| action full_shared | reflect plain | reflect base_lr_shared | reflect full_shared |
|---|---|---|---|---|---|---|---|---|---|---|
| scienceqa_untrained | 0 (0) | 5.025 / 50.1% | 5.125 / 50.2% | 5.225 / 50.3% | 6.025 / 51.1% | 6.125 / 51.2% \
| 6.225 / 51.3% | 7.025 / 52.1% | 7.125 / 52.2% | 7.225 / 52.3% |
| scienceqa_sharedA_lam0 | 30 (2) | 1.025 / 10.1% | 1.125 / 10.2% | 1.225 / 10.3% | 2.025 / 11.1% \
| 2.125 / 11.2% | 2.225 / 11.3% | 3.025 / 12.1% | 3.125 / 12.2% | n/a |
"""


def _training_root(root: Path) -> None:
    untrained = [_validation(0, 0, 5)]
    indep = [  # no base_lr_shared columns at all (refused for independent A); the last row is a training row
        {"epoch": "0", "step": "5", "train/loss": "3.0"},
        _validation(10, 0, 8, parts=("plain", "full_shared")),
        _validation(20, 1, 2, parts=("plain", "full_shared")),
        {"epoch": "1", "step": "25", "train/loss": "2.0"},
    ]
    last = _validation(30, 2, 1)
    last["val/reflect/full_shared/loss"] = last["val/reflect/full_shared/acc"] = ""  # logged, but not this time
    shared = [_validation(15, 1, 6), {"epoch": "1", "step": "20", "train/loss": "2.5"}, last]
    for name, rows in (
        ("hotpotqa_sharedA_lam0.5", shared),
        ("hotpotqa_indepA_lam0", indep),
        ("hotpotqa_untrained", untrained),
        ("hotpotqa_sharedA_lam0", shared),
        ("hotpotqa_indepA_lam0.5", indep),
        ("scienceqa_sharedA_lam0", shared),
        ("scienceqa_untrained", untrained),
        ("gsm8k_untrained", untrained),  # no table of its own
        ("hotpotqa", untrained),  # not a <set>_* run folder
    ):
        _training_csv(root / name / "metrics.csv", rows)
    (root / "scienceqa_notes").mkdir()  # no metrics.csv: no row


def test_the_training_table_has_one_section_per_set_untrained_first_then_by_name_with_each_runs_last_validation(
    tmp_path: Path, capsys
) -> None:
    """``python -m eval_suite.study.training_report ROOT``: per data set (hotpotqa, then scienceqa) a heading, the
    legend and a 9-column table; the untrained run first, the others by name; each row is the run's last validation
    row (step and epoch), each cell loss to 3 decimals / accuracy in percent to 1; ``n/a`` where the scheme's loss
    column is absent or blank in that row."""
    from eval_suite.study import training_report

    _training_root(tmp_path)
    assert training_report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out == TRAINING_TABLE + "\n"
    assert training_report.main(["--root", str(tmp_path)]) == 0 and capsys.readouterr().out == out


def test_the_training_report_reads_results_training_h200_by_default_and_its_help_names_the_command(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Without a root the report reads ``results/training_h200`` (from the working directory); ``--help`` shows the
    command as it is typed; a root without runs prints the two sections with their headers only."""
    from eval_suite.study import training_report

    monkeypatch.chdir(tmp_path)
    _training_csv(tmp_path / "results/training_h200/scienceqa_untrained/metrics.csv", [_validation(0, 0, 5)])
    assert training_report.main([]) == 0
    out = capsys.readouterr().out
    keep = [
        x
        for x in TRAINING_TABLE.splitlines()
        if not x.startswith("| ") or x.startswith(("| run ", "| scienceqa_untrained "))
    ]
    assert out == "\n".join(keep) + "\n\n"
    assert training_report.training_report() == 0 and capsys.readouterr().out == out  # the function's own default
    with pytest.raises(SystemExit) as exc:
        training_report.main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: python -m eval_suite.study.training_report ")
    assert "default: results/training_h200" in help_text
    assert training_report.main([str(tmp_path / "empty")]) == 0
    empty = capsys.readouterr().out
    assert empty == "\n".join(x for x in keep if not x.startswith("| scienceqa_untrained ")) + "\n\n"


def test_a_training_log_the_table_cannot_read_is_a_one_line_error_with_status_2(tmp_path: Path, capsys) -> None:
    """A run with no validation row is refused naming its file; a validation row with a loss but no accuracy for a
    role is refused as a user error too (status 2, one ``error:`` line), not a traceback."""
    from eval_suite.study import training_report

    no_val = tmp_path / "a" / "scienceqa_x" / "metrics.csv"
    _training_csv(no_val, [{"epoch": "0", "step": "5", "train/loss": "3.0", "val/loss": ""}])
    assert training_report.main([str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == f"error: {no_val} has no validation row\n"
    row = _validation(10, 0, 2)
    del row["val/action/full_shared/acc"]  # the loss was logged, its accuracy was not
    _training_csv(tmp_path / "b" / "hotpotqa_x" / "metrics.csv", [row])
    assert training_report.main([str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_the_chance_verdict_reads_the_whole_interval() -> None:
    """Above chance only when the interval's lower end is above 0, below only when its upper end is below 0, else
    not distinguishable (an interval holding 0 is no verdict either way)."""
    from eval_suite.study.report import chance_table

    def verdicts(*intervals):
        sets = {
            f"s{i}": {"meta": {"benchmark": "scienceqa", "set": f"s{i}"},
                      "chance": {"ci95": ci, "chance": 0.3, "mean": sum(ci) / 2, "questions": 90}}
            for i, ci in enumerate(intervals)
        }  # fmt: skip
        rows = [line.split("|") for line in chance_table(sets).splitlines()[2:]]
        return [r[4].strip() for r in rows]

    assert verdicts((0.01, 0.2), (-0.05, 0.1), (-0.2, -0.01), (0.0, 0.1), (-0.1, 0.0)) == [
        "above chance",
        "not distinguishable from chance",
        "below chance",
        "not distinguishable from chance",
        "not distinguishable from chance",
    ]
