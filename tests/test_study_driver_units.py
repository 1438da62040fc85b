"""The study driver's small parts, each on its own: the GPU query, the plan's status lines, the pack's filter, a job's
prepared directory and config, the sweep's defaults and reference sets, process liveness and the attempt logs."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from eval_suite.study import driver, report
from eval_suite.study.driver import (
    Job,
    attempts,
    build_plan,
    build_sweep_plan,
    forget_failed_attempts,
    gpu_memory_gb,
    job_state,
    pack,
    prepare,
    status_lines,
    sweep_reference,
    train_config,
)


def _fake_nvidia_smi(bindir: Path, body: str) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)


def test_gpu_memory_is_gpu_zeros_total_in_gb_and_the_number_of_gpus(tmp_path: Path, monkeypatch) -> None:
    """nvidia-smi's memory.total (MiB, one line per GPU, asked exactly so) gives GPU 0's size in GB and the count."""
    _fake_nvidia_smi(
        tmp_path / "bin",
        '[ "$*" = "--query-gpu=memory.total --format=csv,noheader,nounits" ] || exit 1\necho 81559\necho 40960\n',
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert gpu_memory_gb() == (81559 / 1024, 2)


def test_gpu_memory_is_none_without_nvidia_smi_or_when_it_fails(tmp_path: Path, monkeypatch) -> None:
    """No nvidia-smi, one that exits non-zero (whatever it printed) or one that prints no number: (0.0, 0)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_memory_gb() == (0.0, 0)
    _fake_nvidia_smi(tmp_path / "bin", "echo 81559\nexit 9\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert gpu_memory_gb() == (0.0, 0)
    _fake_nvidia_smi(tmp_path / "bin", "echo 'NVIDIA-SMI has failed'\n")
    assert gpu_memory_gb() == (0.0, 0)


def test_the_gpu_query_is_bounded_in_time_and_quiet(monkeypatch) -> None:
    """A hung nvidia-smi cannot hang the driver (the query gives up after 20 s); its output is captured, not shown."""
    seen: list[dict] = []

    def spy(cmd: list[str], **kw) -> subprocess.CompletedProcess:
        seen.append(kw)
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout") or 0)

    monkeypatch.setattr(driver.subprocess, "run", spy)
    assert gpu_memory_gb() == (0.0, 0)
    assert seen[0]["timeout"] == 20 and seen[0]["capture_output"] is True


def _plan_of_two() -> list[Job]:
    return [Job("eval/a/x", "eval", [], "eval/a/x/summary.json"), Job("eval/b/x", "eval", [], "eval/b/x/summary.json")]


def _driver_json(root: Path, **info) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "driver.json").write_text(json.dumps(info))


def test_status_lines_show_a_live_drivers_children_as_running(tmp_path: Path) -> None:
    """A driver of this machine that still runs: its children are running; the others ready; attempts counted."""
    root = tmp_path / "study"
    _driver_json(root, pid=os.getpid(), host=platform.node(), running={"eval/a/x": 1})
    (root / "eval/b/x").mkdir(parents=True)
    (root / "eval/b/x/attempts.jsonl").write_text('{"rc": 0}\n\n{"rc": 0}\n')
    assert status_lines(root, _plan_of_two()) == ["running  0  eval/a/x", "ready    2  eval/b/x"]


@pytest.mark.parametrize(
    "info",
    [
        {"pid": "dead", "host": "this"},  # the driver has exited
        {"pid": "live", "host": "another-machine"},  # a packed copy of another machine's root
        {"host": "this"},  # no pid recorded: not pid 1's
    ],
)
def test_status_lines_ignore_a_gone_or_foreign_drivers_children(tmp_path: Path, info: dict) -> None:
    """A driver that no longer runs, or one of another machine, runs nothing here: its children are just ready."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pid = {"dead": dead.pid, "live": os.getpid()}.get(info.get("pid"))
    fields = {"host": platform.node() if info["host"] == "this" else info["host"], "running": ["eval/a/x"]}
    root = tmp_path / "study"
    _driver_json(root, **fields, **({"pid": pid} if pid is not None else {}))
    assert status_lines(root, _plan_of_two()) == ["ready    0  eval/a/x", "ready    0  eval/b/x"]


def test_status_lines_without_a_readable_driver_file(tmp_path: Path) -> None:
    """No driver.json, or a torn one: every job by its files alone."""
    root = tmp_path / "study"
    assert status_lines(root, _plan_of_two()) == ["ready    0  eval/a/x", "ready    0  eval/b/x"]
    root.mkdir()
    (root / "driver.json").write_text('{"pid": ')
    assert status_lines(root, _plan_of_two())[0] == "ready    0  eval/a/x"


def test_pack_leaves_out_locks_temporaries_checkpoints_and_its_own_output(tmp_path: Path) -> None:
    """Any ``.ckpt``, ``.tmp`` or ``.eval.lock`` file and any ``lightning_logs`` folder stay out, wherever they are;
    a pack written inside the root (into a folder not there yet) does not pack itself."""
    root = tmp_path / "study"
    for rel in ("eval/x/summary.json", "eval/x/model.ckpt", "eval/x/part.tmp", "eval/x/rows.eval.lock",
                "train/y/lightning_logs/v0/events", "train/y/log.txt"):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    out = root / "packs" / "today"
    parts = pack(root, out)
    names = tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))).getnames()
    files = sorted(n for n in names if "." in Path(n).name)
    assert files == ["study/eval/x/summary.json", "study/train/y/log.txt"]
    assert not any("lightning_logs" in n or n.startswith("study/packs/today/") for n in names)
    assert sorted(p.name for p in out.iterdir()) == ["study.tar.gz.part00"]


def _train_job(meta: dict) -> Job:
    return Job("train/s", "train", ["py", "cli.py", "fit", "--config", "{root}/train/s/config.yaml"],
               "train/s/adapters/lragent_adapters.safetensors", meta=meta)  # fmt: skip


BASE_META = {"benchmark": "scienceqa", "lambda": 0.5, "train_scheme": "base_lr_shared", "shared_a": True, "epochs": 2}


def test_a_training_is_prepared_with_its_recipe_in_the_recipes_own_key_order(tmp_path: Path) -> None:
    """The written config.yaml is train_config's, keys in the recipe's order (not sorted); the root is filled in;
    without ``config_prefix`` the embedded model's recipe is used."""
    cmd = prepare(_train_job(BASE_META), tmp_path)
    assert cmd == ["py", "cli.py", "fit", "--config", f"{tmp_path}/train/s/config.yaml"]
    text = (tmp_path / "train/s/config.yaml").read_text()
    want = train_config("scienceqa", 0.5, "base_lr_shared", True, tmp_path / "train/s", 2)
    assert json.dumps(yaml.safe_load(text)) == json.dumps(want)  # same keys, same order
    assert list(want) != sorted(want) or list(want["model"]) != sorted(want["model"])  # the order is not sorted's


def test_a_training_is_prepared_with_its_data_variant_and_recipe_point(tmp_path: Path) -> None:
    """A job's ``data`` overrides and sweep ``recipe`` reach its config.yaml, on its ``config_prefix``'s recipe."""
    meta = {**BASE_META, "data": {"answer_thoughts": True}, "config_prefix": "qwen",
            "recipe": {"lr": 7e-4, "rank": 16, "targets": "qv"}}  # fmt: skip
    prepare(_train_job(meta), tmp_path)
    cfg = yaml.safe_load((tmp_path / "train/s/config.yaml").read_text())
    assert cfg["data"]["answer_thoughts"] is True
    assert cfg["model"]["lr"] == 7e-4 and cfg["model"]["rank"] == 16
    assert cfg["model"]["model_name"] == "qwen2.5-coder-1.5b"


def test_a_trainings_directory_is_never_moved_aside_for_a_sampler(tmp_path: Path) -> None:
    """Only an eval's older-sampler episodes are moved aside: a training's directory (its checkpoint) stays, and
    resumes from ``last.ckpt``."""
    d = tmp_path / "train/s"
    (d / "checkpoints").mkdir(parents=True)
    (d / "checkpoints/last.ckpt").write_text("ckpt")
    (d / "run_config.json").write_text("{}")  # no sampler recorded: an eval's would be moved
    cmd = prepare(_train_job(BASE_META), tmp_path)
    assert cmd[-2:] == ["--ckpt_path", str(d / "checkpoints/last.ckpt")]
    assert sorted(p.name for p in tmp_path.joinpath("train").iterdir()) == ["s"]


def test_the_sweep_plans_defaults_are_one_run_and_python3() -> None:
    """Called without options, the sweep plan judges each point by one run, with ``python3``."""
    plan = build_sweep_plan(("scienceqa",), ({"lr": 1e-4, "epochs": 1, "targets": "qv", "rank": 8},))
    (ev,) = [j for j in plan if j.kind == "eval"]
    assert ev.cmd[ev.cmd.index("--runs") + 1] == "1" and {j.cmd[0] for j in plan} == {"python3"}
    with pytest.raises(ValueError) as info:
        build_sweep_plan(("scienceqa",), ({"lr": 1e-4, "epochs": 1, "targets": "all", "rank": 8},))
    assert str(info.value).endswith("targets must be one of qv, qvo_mlp")


def test_the_sweep_reference_is_the_first_point_at_each_benchmarks_best_lr() -> None:
    """Each benchmark with a best learning rate gets its shipped recipe's set name; others get none."""
    ref = {"scienceqa": "scienceqa_lr0.0003_ep2_qv_r8", "hotpotqa": "hotpotqa_lr0.0001_ep2_qv_r8"}
    assert sweep_reference() == ref
    assert sweep_reference(("hotpotqa", "other")) == {"hotpotqa": ref["hotpotqa"]}


def test_pid_runs_tells_a_live_process_a_gone_one_and_a_reused_pid(tmp_path: Path) -> None:
    """A live process runs (and, given a needle, only when its command line holds it: a stranger's path is not
    there); an exited one does not, nor a pid too large to exist. (A child, not this process: pytest-xdist rewrites
    its workers' command lines.)"""
    assert driver._pid_runs(os.getpid())
    code = "import time; print('up', flush=True); time.sleep(30)"
    live = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline() == "up\n"  # exec'd: its command line is its own, no longer the forked parent's
        assert driver._pid_runs(live.pid) and driver._pid_runs(live.pid, "time.sleep(30)")
        assert not driver._pid_runs(live.pid, str(tmp_path / "never-in-a-command-line"))
    finally:
        live.kill()
        live.wait()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not driver._pid_runs(dead.pid) and not driver._pid_runs(2**70)
    assert driver._Adopted(os.getpid()).poll() is None and driver._Adopted(dead.pid).poll() == driver.ADOPTED_ENDED


def test_orphans_are_a_gone_drivers_live_children_of_this_root_only(tmp_path: Path) -> None:
    """An earlier driver of this machine that is gone: its children that still run this root's job are adopted;
    an unknown job, a dead child, a live driver or another machine's driver adopt nothing."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "root"
    code = "import time; print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code, f"--out={root}/eval/a"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # running its own command line by now
        jobs = {"eval/a": Job("eval/a", "eval", [], "eval/a/summary.json")}
        running = {"eval/a": child.pid, "eval/unknown": child.pid, "eval/b": dead.pid}
        _driver_json(root, pid=dead.pid, host=platform.node(), running=running)
        assert driver._orphans(root, jobs) == {"eval/a": child.pid}
        _driver_json(root, pid=os.getpid(), host=platform.node(), running=running)
        assert driver._orphans(root, jobs) == {}
        _driver_json(root, pid=dead.pid, host="another-machine", running=running)
        assert driver._orphans(root, jobs) == {}
        _driver_json(root, pid=dead.pid, host=platform.node(), running=list(running))
        assert driver._orphans(root, jobs) == {}
        _driver_json(root, host=platform.node(), running=running)  # no pid: not pid 1's driver
        assert driver._orphans(root, jobs) == {"eval/a": child.pid}
        (root / "driver.json").write_text("{")
        assert driver._orphans(root, jobs) == {}
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_a_gone_drivers_child_that_ended_or_whose_pid_runs_another_command_is_no_orphan(tmp_path: Path) -> None:
    """A gone driver's child of a job of the plan is not adopted once it has ended, nor when its pid now belongs to a
    live process that runs no job of this root (the pid was reused)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "root"
    other = subprocess.Popen(["sleep", "30"])
    try:
        jobs = {n: Job(n, "eval", [], f"{n}/summary.json") for n in ("eval/a", "eval/b")}
        _driver_json(root, pid=dead.pid, host=platform.node(), running={"eval/a": other.pid, "eval/b": dead.pid})
        assert driver._orphans(root, jobs) == {}
    finally:
        other.kill()
        other.wait()


def test_attempts_and_the_failed_state_follow_the_last_attempt(tmp_path: Path) -> None:
    """Blank lines are no attempts; the last attempt's rc decides: non-zero failed, 0 or none recorded not."""
    job = Job("eval/a", "eval", [], "eval/a/summary.json", deps=("train/t",))
    dep = Job("train/t", "train", [], "train/t/done.json")
    jobs = {j.name: j for j in (job, dep)}
    log = tmp_path / "eval/a/attempts.jsonl"
    assert attempts(job, tmp_path) == 0 and job_state(job, tmp_path, set(), jobs) == "waiting"
    log.parent.mkdir(parents=True)
    for lines, state in (('{"rc": 1}\n\n{"rc": 0}\n', "waiting"), ('{"rc": 0}\n{"rc": 3}\n\n', "failed"),
                         ('{"rc": 1}\n{"seconds": 1}\n', "waiting"), ("\n", "waiting")):  # fmt: skip
        log.write_text(lines)
        assert job_state(job, tmp_path, set(), jobs) == state, lines
    assert attempts(job, tmp_path) == 0
    log.write_text('{"rc": 1}\n\n{"rc": 2}\n')
    assert attempts(job, tmp_path) == 2
    assert job_state(job, tmp_path, {"eval/a"}, jobs) == "running"
    (tmp_path / "train/t").mkdir(parents=True)
    (tmp_path / "train/t/done.json").write_text("{}")
    assert job_state(dep, tmp_path, set(), jobs) == "done" and job_state(job, tmp_path, set(), jobs) == "failed"


def test_forgetting_failures_removes_failed_and_empty_attempt_logs_only(tmp_path: Path) -> None:
    """A log whose last attempt failed, or one with no attempt at all, is removed; a success's is kept."""
    for name, text in (("a", '{"rc": 0}\n{"rc": 1}\n\n'), ("b", '{"rc": 1}\n{"rc": 0}\n'), ("c", "\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "attempts.jsonl").write_text(text)
    assert forget_failed_attempts(tmp_path) == ["a", "c"]
    assert sorted(p.parent.name for p in tmp_path.rglob("attempts.jsonl")) == ["b"]


def test_the_default_plan_is_both_benchmarks_at_every_lambda_with_three_runs() -> None:
    """``build_plan()`` alone: both benchmarks, λ 0, 0.5, 0.25, 1, three runs, two epochs, ``python3``."""
    plan = build_plan()
    sets = {j.meta["set"] for j in plan if j.kind == "train"}
    for bench in ("scienceqa", "hotpotqa"):
        assert {f"{bench}_lam0.25", f"{bench}_lam1", f"{bench}_lam1_full"} <= sets
    assert {j.cmd[j.cmd.index("--runs") + 1] for j in plan if j.kind == "eval"} == {"3"}
    assert {j.meta["epochs"] for j in plan if j.kind == "train"} == {2} and {j.cmd[0] for j in plan} == {"python3"}


def test_a_fit_config_is_the_recipe_made_equal_across_lambda(tmp_path: Path) -> None:
    """The recipe's trainer with no progress bar, ``epochs`` epochs and no step cap, a CSV logger in the run folder;
    no early stopping, time budget or progress bar; the last checkpoint only, the last weights exported, the run's
    status file; every other callback and setting as the recipe has it; the model's sharing settings and no
    validation schemes; unpacked data."""
    raw = yaml.safe_load((driver.ROOT / "configs" / "embedded_hotpotqa.yaml").read_text())
    cfg = train_config("hotpotqa", 0.25, "full_shared", False, tmp_path, 3)
    tr = cfg["trainer"]
    assert tr["enable_progress_bar"] is False and (tr["max_epochs"], tr["max_steps"]) == (3, -1)
    assert tr["default_root_dir"] == str(tmp_path)
    assert tr["logger"] == [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                             "init_args": {"save_dir": str(tmp_path), "name": "csv", "version": None}}]  # fmt: skip
    want = []
    for cb in raw["trainer"]["callbacks"]:
        kind, args = cb["class_path"].rsplit(".", 1)[-1], cb["init_args"]
        if kind == "ModelCheckpoint":
            args = {**args, "dirpath": str(tmp_path / "checkpoints"), "save_top_k": 0, "save_last": True,
                    "monitor": None}  # fmt: skip
        elif kind == "ExportAdapters":
            args = {**args, "out_dir": str(tmp_path / "adapters"), "best": False}
        elif kind == "RunStatus":
            args = {**args, "path": str(tmp_path / "fit_status.jsonl")}
        elif kind in ("EarlyStopping", "TimeBudget", "RunProgressBar"):
            continue
        want.append({"class_path": cb["class_path"], "init_args": args})
    assert tr["callbacks"] == want and len(want) == 4
    set_here = ("callbacks", "logger", "max_epochs", "max_steps", "enable_progress_bar", "default_root_dir")
    assert {k: v for k, v in tr.items() if k not in set_here} == {
        k: v for k, v in raw["trainer"].items() if k not in set_here
    }
    m = cfg["model"]
    assert (m["lambda_shared"], m["shared_scheme"], m["shared_a"], m["val_schemes"]) == (0.25, "full_shared", False, [])
    assert cfg["data"]["pack_prefixes"] is False


def test_a_recipes_callback_without_arguments_is_kept_or_set(tmp_path: Path, monkeypatch) -> None:
    """A callback the recipe lists by class path alone gets its arguments: an empty set when kept as is, the run's
    status file for RunStatus; one named without a module path is recognised by its class name."""
    (tmp_path / "configs").mkdir()
    recipe = {"trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.LearningRateMonitor"},
                                        {"class_path": "RunStatus"}, {"class_path": "TimeBudget"}]},
              "model": {"roles": ["plan"]}, "data": {}}  # fmt: skip
    (tmp_path / "configs" / "embedded_x.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(driver, "ROOT", tmp_path)
    cfg = train_config("x", 0.0, "base_lr_shared", True, tmp_path / "run", 1)
    assert cfg["trainer"]["callbacks"] == [
        {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {}},
        {"class_path": "RunStatus", "init_args": {"path": str(tmp_path / "run" / "fit_status.jsonl")}},
    ]


def _members(archive_bytes: bytes) -> list[tarfile.TarInfo]:
    return tarfile.open(fileobj=io.BytesIO(archive_bytes)).getmembers()


def test_archived_members_carry_no_owner_or_time_and_xz_is_at_its_strongest_preset(tmp_path: Path) -> None:
    """Every member has time 0, owner 0:0 and no owner names; the archive is the tar at xz preset 9, extreme; temporary,
    lock and checkpoint files and lightning logs stay out wherever they are."""
    import lzma

    root = tmp_path / "study"
    for rel in ("eval/a/x/summary.json", "eval/a/x/rows.eval.lock", "eval/a/x/part.tmp", "eval/a/x/old.ckpt",
                "train/a/lightning_logs/events", "train/a/log.txt"):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    (path,) = [p for p in driver.archive(root, tmp_path / "out") if p.name == "a.tar.xz"]
    data = path.read_bytes()
    assert data == lzma.compress(lzma.decompress(data), preset=9 | lzma.PRESET_EXTREME)
    members = _members(data)
    assert sorted(m.name for m in members) == ["study/eval/a/x/summary.json", "study/train/a/log.txt"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}


def test_an_archive_of_exactly_the_piece_size_is_one_file_and_one_byte_over_is_split(tmp_path: Path) -> None:
    """``piece_bytes`` is the largest single file: an archive of that size stays whole, one byte more is split into
    pieces of at most that size, named part00, part01, ... in order."""
    root = tmp_path / "study"
    (root / "eval/a/x").mkdir(parents=True)
    (root / "eval/a/x/summary.json").write_text("{}")
    driver.archive(root, tmp_path / "one")
    size = (tmp_path / "one" / "a.tar.xz").stat().st_size
    whole = [p.name for p in driver.archive(root, tmp_path / "two", piece_bytes=size) if p.name.startswith("a.")]
    assert whole == ["a.tar.xz"]
    split = [p for p in driver.archive(root, tmp_path / "three", piece_bytes=size - 1) if p.name.startswith("a.")]
    assert [p.name for p in split] == ["a.tar.xz.part00", "a.tar.xz.part01"]
    assert [p.stat().st_size for p in split] == [size - 1, 1]
    joined = b"".join(p.read_bytes() for p in split)
    assert joined == (tmp_path / "one" / "a.tar.xz").read_bytes()


def test_a_root_without_a_driver_log_still_gets_its_driver_archive_empty(tmp_path: Path) -> None:
    """No driver.log: driver.tar.xz holds nothing; the archives come back sorted by name."""
    root = tmp_path / "study"
    for rel in ("fidelity/b/fidelity.json", "train/a/log.txt"):
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text("{}")
    written = driver.archive(root, tmp_path / "out")
    assert [p.name for p in written] == ["a.tar.xz", "b.tar.xz", "driver.tar.xz"]
    assert _members(written[-1].read_bytes()) == []


def test_pieces_split_the_bytes_in_order_and_nothing_still_makes_one_piece(tmp_path: Path) -> None:
    """25 bytes at 10 a piece: 10, 10 and 5 in order; no bytes: one empty piece."""
    data = bytes(range(25))
    pieces = driver._write_pieces(data, tmp_path / "x.tar", 10)
    assert [p.name for p in pieces] == ["x.tar.part00", "x.tar.part01", "x.tar.part02"]
    assert [p.read_bytes() for p in pieces] == [data[:10], data[10:20], data[20:]]
    (empty,) = driver._write_pieces(b"", tmp_path / "e.tar", 10)
    assert empty.name == "e.tar.part00" and empty.read_bytes() == b""


def test_rounded_timings_reach_into_lists_and_keep_blank_lines_and_undecodable_bytes(tmp_path: Path) -> None:
    """Seconds inside lists of records are rounded too; an integer or a non-seconds float is kept; blank lines, the
    final newline and bytes that are not UTF-8 come back as they were; non-ASCII text stays unescaped."""
    body = b'{"steps": [{"wall_s": 1.23456, "n_s": 3}], "p": 0.12345, "t": "\xc3\xa9"}\n\n\xff{"torn\n'
    assert driver._round_timings(body) == (
        b'{"steps": [{"wall_s": 1.235, "n_s": 3}], "p": 0.12345, "t": "\xc3\xa9"}\n\n\xff{"torn\n'
    )


def _xz_archive(name: str, data: bytes) -> bytes:
    """An xz tar archive holding one member ``name`` with ``data``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:xz") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_read_archives_makes_its_folder_and_refuses_a_member_outside_it(tmp_path: Path) -> None:
    """The destination is made with its parents, and reading into it twice is fine; a member that would land outside
    the destination is refused and nothing is written there."""
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "x.tar.xz").write_bytes(_xz_archive("study/eval/x/summary.json", b"{}"))
    dest = tmp_path / "deep" / "er" / "back"
    assert driver.read_archives(folder, dest) == ["x"] and driver.read_archives(folder, dest) == ["x"]
    assert (dest / "study/eval/x/summary.json").read_text() == "{}"
    (folder / "y.tar.xz").write_bytes(_xz_archive("../escaped.txt", b"!"))
    with pytest.raises(tarfile.OutsideDestinationError):
        driver.read_archives(folder, dest)
    assert not (dest.parent / "escaped.txt").exists()


def test_the_run_command_fills_ninety_percent_of_gpu_zero_on_every_gpu_by_default(tmp_path: Path, monkeypatch, capsys):
    """``run``: 90% of GPU 0's memory per GPU on every GPU unless told; retries 2 and two trainings per GPU by
    default; ``--reset-failed`` first forgets failed attempts, naming each; the run's status is the command's."""
    calls: list = []
    monkeypatch.setattr(driver, "gpu_memory_gb", lambda: (80.0, 4))
    monkeypatch.setattr(driver, "run", lambda root, plan, gb, **kw: calls.append((root, len(plan), gb, kw)) or 7)
    root = tmp_path / "study"
    (root / "eval/a").mkdir(parents=True)
    (root / "eval/a/attempts.jsonl").write_text('{"rc": 1}\n')
    assert driver.main(["run", "--root", str(root), "--benchmarks", " hotpotqa ,", "--reset-failed", "true"]) == 7
    assert (
        capsys.readouterr().out == "reset failed attempts of eval/a\n"
        and not (root / "eval/a").joinpath("attempts.jsonl").exists()
    )
    n = len(build_plan(("hotpotqa",), runs=3))
    assert calls == [(root, n, 72.0, {"retries": 2, "gpus": 4, "max_train": 2})]
    assert driver.main(["run", "--root", str(root), "--gpu-gb", "30", "--gpus", "2", "--retries", "0",
                        "--max-train", "1"]) == 7  # fmt: skip
    assert calls[-1][2:] == (30.0, {"retries": 0, "gpus": 2, "max_train": 1})
    monkeypatch.setattr(driver, "gpu_memory_gb", lambda: (0.0, 0))
    assert driver.main(["run", "--root", str(root), "--gpu-gb", "30"]) == 7
    assert calls[-1][3]["gpus"] == 1  # no GPU seen: one


def test_the_plan_command_reads_lambdas_runs_and_stages(tmp_path: Path, monkeypatch, capsys) -> None:
    """``plan`` prints one status line per job of the plan its options make: λ values with blanks and empty items
    skipped, three runs by default (one for the sweep), the decisive study's own λ by default."""
    seen: list = []
    real = driver.build_plan
    monkeypatch.setattr(driver, "build_plan", lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw))
    assert driver.main(["plan", "--root", str(tmp_path), "--benchmarks", "scienceqa", "--lambdas", " 0.5,,1 "]) == 0
    (args, kw) = seen[-1]
    assert args == (("scienceqa",), (0.5, 1.0), 3, 2) and kw["python"] == sys.executable
    lines = capsys.readouterr().out.splitlines()
    assert lines == status_lines(tmp_path, real(*args, **kw))
    real_sweep = driver.build_sweep_plan
    monkeypatch.setattr(driver, "build_sweep_plan", lambda *a, **kw: seen.append((a, kw)) or real_sweep(*a, **kw))
    assert driver.main(["plan", "--root", str(tmp_path), "--stage", "sweep", "--benchmarks", "hotpotqa"]) == 0
    (args, kw) = seen[-1]
    assert args == (("hotpotqa",), driver.SWEEP_POINTS, 1) and kw["profile"] is driver.PROFILES["default"]
    assert capsys.readouterr().out.splitlines() == status_lines(tmp_path, real_sweep(*args, **kw))
    assert driver.main(["plan", "--root", str(tmp_path), "--model", "qwen2.5-coder-1.5b", "--runs", "2"]) == 0
    (args, kw) = seen[-1]
    assert args[1:] == ((0.0, 0.5, 0.25, 1.0), 2, 2) and kw["profile"] is driver.PROFILES["qwen2.5-coder-1.5b"]
    capsys.readouterr()
    assert driver.main(["plan", "--root", str(tmp_path), "--lambdas", "x"]) == 2
    assert capsys.readouterr().err == "error: --lambdas 'x': values in [0, 1]\n"
    assert driver.main(["plan", "--root", str(tmp_path), "--benchmarks", " , "]) == 2
    assert capsys.readouterr().err == "error: --benchmarks ' , ': allowed scienceqa, hotpotqa\n"
    assert driver.main(["plan", "--root", str(tmp_path), "--lambdas", "-0.1"]) == 2
    assert driver.main(["plan", "--root", str(tmp_path), "--gpus", "-1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --gpus -1: the number of GPUs to use (GPUs 0..N-1), at least 1"
    )


def test_the_pack_and_archive_commands_print_each_file_with_its_size(tmp_path: Path, capsys) -> None:
    """``pack --out`` and ``archive`` (default: ``<root>/archive``) print every file written with its size."""
    root = tmp_path / "study"
    (root / "eval/a/x").mkdir(parents=True)
    (root / "eval/a/x/summary.json").write_text("{}")
    assert driver.main(["pack", "--root", str(root), "--out", str(tmp_path / "p")]) == 0
    part = tmp_path / "p" / "study.tar.gz.part00"
    assert capsys.readouterr().out == f"{part} {part.stat().st_size}\n"
    assert driver.main(["archive", "--root", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{p} {p.stat().st_size}" for p in sorted((root / "archive").iterdir())] and len(out) == 2


def test_a_pack_is_cut_into_pieces_of_15_5_mb_by_default(tmp_path: Path, monkeypatch) -> None:
    """Without ``piece_bytes`` the pack is cut at 15,500,000 bytes a piece (under the device tool's file limit)."""
    cuts: list[int] = []
    real = driver._write_pieces
    monkeypatch.setattr(
        driver, "_write_pieces", lambda data, stem, piece: cuts.append(piece) or real(data, stem, piece)
    )
    (tmp_path / "study").mkdir()
    pack(tmp_path / "study", tmp_path / "out")
    assert cuts == [15_500_000]


def test_one_byte_at_one_byte_a_piece_is_one_piece(tmp_path: Path) -> None:
    """No empty trailing piece: one byte cut at one byte a piece is exactly one piece."""
    (piece,) = driver._write_pieces(b"x", tmp_path / "x.tar", 1)
    assert piece.read_bytes() == b"x"


def test_a_driver_file_inside_a_set_is_not_archived(tmp_path: Path) -> None:
    """A ``driver.json`` found in a set's folder names a lost machine's processes: it stays out of the archive."""
    root = tmp_path / "study"
    for rel in ("eval/a/x/summary.json", "eval/a/x/driver.json"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}")
    (path,) = [p for p in driver.archive(root, tmp_path / "out") if p.name == "a.tar.xz"]
    assert [m.name for m in _members(path.read_bytes())] == ["study/eval/a/x/summary.json"]


def test_a_sweep_points_jobs_train_a_shared_a_set_and_evaluate_its_adapters() -> None:
    """Per point and benchmark: a λ = 0 shared-A ``base_lr_shared`` training with the point's recipe, then its
    ``non_shared`` evaluation of that training's adapters on that benchmark, right after it (priority + 0.5)."""
    point = {"lr": 1e-4, "epochs": 1, "targets": "qv", "rank": 8}
    plan = build_sweep_plan(("scienceqa", "hotpotqa"), (point, point | {"rank": 16}))
    by = {j.name: j for j in plan}
    train = by["train/hotpotqa_lr0.0001_ep1_qv_r8"]
    assert train.meta == {"benchmark": "hotpotqa", "set": "hotpotqa_lr0.0001_ep1_qv_r8", "lambda": 0.0,
                          "train_scheme": "base_lr_shared", "shared_a": True, "data": {}, "recipe": point,
                          "epochs": 1, "config_prefix": "embedded"}  # fmt: skip
    ev = by["eval/hotpotqa_lr0.0001_ep1_qv_r8/non_shared"]
    assert ev.cmd[ev.cmd.index("--benchmark") + 1] == "hotpotqa"
    assert ev.cmd[ev.cmd.index("--adapters") + 1] == "{root}/train/hotpotqa_lr0.0001_ep1_qv_r8/adapters"
    assert [(j.name.split("/")[1], j.priority) for j in plan] == [
        ("scienceqa_lr0.0001_ep1_qv_r8", 0), ("scienceqa_lr0.0001_ep1_qv_r8", 0.5),
        ("hotpotqa_lr0.0001_ep1_qv_r8", 1), ("hotpotqa_lr0.0001_ep1_qv_r8", 1.5),
        ("scienceqa_lr0.0001_ep1_qv_r16", 10), ("scienceqa_lr0.0001_ep1_qv_r16", 10.5),
        ("hotpotqa_lr0.0001_ep1_qv_r16", 11), ("hotpotqa_lr0.0001_ep1_qv_r16", 11.5),
    ]  # fmt: skip
    with pytest.raises(ValueError) as info:
        build_sweep_plan(("other",), ({"lr": "best", "epochs": 2, "targets": "qv", "rank": 8},))
    assert str(info.value).endswith("no best learning rate for 'other' in SWEEP_BEST_LR (known: scienceqa, hotpotqa)")


def test_archive_returns_every_file_it_wrote_into_a_new_folder_a_split_set_after_a_whole_one_included(
    tmp_path: Path,
) -> None:
    """Into an output folder made with its parents: a small set written whole, then a large one in pieces; the list
    returned names every file written, the whole one too, sorted."""
    import random

    rng = random.Random(0)
    root = tmp_path / "study"
    for rel, text in (("eval/a/x/summary.json", "{}"),
                      ("eval/b/x/episodes.jsonl", "".join(f"{rng.random()}\n" for _ in range(3000)))):  # fmt: skip
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text(text)
    out = tmp_path / "new" / "deeper" / "out"
    written = driver.archive(root, out, piece_bytes=5000)
    assert [p.name for p in written] == sorted(p.name for p in out.iterdir())
    assert "a.tar.xz" in [p.name for p in written] and "b.tar.xz.part01" in [p.name for p in written]


def test_the_study_function_called_directly_has_the_commands_defaults(tmp_path: Path, monkeypatch) -> None:
    """Called as a function: the embedded model's plan of both benchmarks at every λ, 3 runs, 2 epochs; ``run``
    retries twice, two trainings per GPU, and keeps failed attempts; ``report`` is a full one."""
    seen: dict = {}
    real_plan = driver.build_plan

    def plan(*a, **kw):
        seen["plan"] = (a, kw)
        return real_plan(*a, **kw)

    monkeypatch.setattr(driver, "build_plan", plan)
    monkeypatch.setattr(driver, "gpu_memory_gb", lambda: (10.0, 1))
    monkeypatch.setattr(driver, "run", lambda root, plan, gb, **kw: seen.setdefault("run", kw) and 0)
    monkeypatch.setattr(report, "write_report", lambda root, plan, out, partial: seen.setdefault("partial", partial))
    root = tmp_path / "study"
    (root / "eval/a").mkdir(parents=True)
    (root / "eval/a/attempts.jsonl").write_text('{"rc": 1}\n')
    assert driver.study("run", root=str(root)) == 0
    assert seen["run"] == {"retries": 2, "gpus": 1, "max_train": 2}
    assert (root / "eval/a/attempts.jsonl").is_file()  # failed attempts are kept unless asked
    args, kw = seen["plan"]
    assert (
        args == (("scienceqa", "hotpotqa"), (0.0, 0.5, 0.25, 1.0), 3, 2) and kw["profile"] is driver.PROFILES["default"]
    )
    assert driver.study("report", root=str(root), out=str(tmp_path / "r")) == 0 and seen["partial"] is False


def test_the_smallest_allowed_values_pass_and_an_unknown_model_names_the_profiles(tmp_path: Path, monkeypatch, capsys):
    """One epoch, one GPU and any positive amount of GPU memory are allowed; an unknown model is refused naming the
    profiles; without arguments the command names itself and its subcommands."""
    monkeypatch.setattr(driver, "gpu_memory_gb", lambda: (0.0, 0))
    monkeypatch.setattr(driver, "run", lambda root, plan, gb, **kw: 0)
    root = str(tmp_path / "study")
    assert driver.main(["run", "--root", root, "--epochs", "1", "--gpus", "1", "--gpu-gb", "0.5"]) == 0
    assert driver.main(["plan", "--root", root, "--model", "x"]) == 2
    assert capsys.readouterr().err == "error: --model 'x': allowed default, qwen2.5-coder-1.5b\n"
    assert driver.main([]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m eval_suite.study {plan,run,pack,archive,report} ")


def test_the_decisive_stage_gets_its_own_lambdas_runs_per_benchmark_and_one_scheme_at_a_time(tmp_path, monkeypatch):
    """``--stage decide``: the decisive study's λ by default, ``--runs`` for every chosen benchmark (else its own),
    the epochs, this interpreter, lanes off unless asked; its report goes to ``<root>/report`` by default."""
    from eval_suite.study import decide

    seen: list = []
    monkeypatch.setattr(decide, "build_decide_plan", lambda *a, **kw: seen.append((a, kw)) or [])
    monkeypatch.setattr(decide, "write_decide_report", lambda *a: seen.append(a))
    root = tmp_path / "study"
    assert driver.study("plan", root=str(root), stage="decide", benchmarks="scienceqa") == 0
    assert seen[-1] == ((("scienceqa",), driver.PROFILES["default"], None, (0.0, 0.5), 2),
                        {"python": sys.executable, "lanes": False})  # fmt: skip
    assert driver.study("report", root=str(root), stage="decide", runs=4, epochs=3, lanes=True) == 0
    assert seen[-2] == ((("scienceqa", "hotpotqa"), driver.PROFILES["default"], {"scienceqa": 4, "hotpotqa": 4},
                         (0.0, 0.5), 3), {"python": sys.executable, "lanes": True})  # fmt: skip
    assert seen[-1] == (root, [], root / "report")


def test_the_sweep_report_gets_the_root_its_plan_and_each_benchmarks_reference(tmp_path: Path, monkeypatch) -> None:
    """``report --stage sweep``: the sweep plan (this interpreter), the root, the output folder and the reference
    points of the chosen benchmarks."""
    seen: list = []
    monkeypatch.setattr(report, "write_sweep_report", lambda *a: seen.append(a))
    root, out = tmp_path / "study", tmp_path / "out"
    assert driver.study("report", root=str(root), stage="sweep", benchmarks="hotpotqa", out=str(out)) == 0
    (args,) = seen
    assert args[0] == root and args[2] == out and args[3] == {"hotpotqa": "hotpotqa_lr0.0001_ep2_qv_r8"}
    assert args[1] == build_sweep_plan(("hotpotqa",), driver.SWEEP_POINTS, 1, python=sys.executable)


def test_pack_writes_into_study_pack_by_default(tmp_path: Path, monkeypatch, capsys) -> None:
    """``pack`` without ``--out`` writes ``study_pack/`` in the working folder."""
    (tmp_path / "study").mkdir()
    monkeypatch.chdir(tmp_path)
    assert driver.main(["pack", "--root", str(tmp_path / "study")]) == 0
    assert (tmp_path / "study_pack" / "study.tar.gz.part00").is_file()


def test_the_zero_shot_probe_jobs_are_the_reference_rows_command_at_the_profiles_memory() -> None:
    """A profile with a reference row plans, per benchmark, one ``cli.py zero-shot`` of the base model (no adapters,
    bf16, into ``probe/<bench>``), done by its summary, at the profile's probe memory, first in the plan, with the
    report's metadata of a zero-shot line."""
    qwen = driver.PROFILES["qwen2.5-coder-1.5b"]
    plan = build_plan(("scienceqa", "hotpotqa"), (0.0,), runs=1, epochs=1, python="py", profile=qwen)
    probes = [j for j in plan if j.kind == "probe"]
    assert probes == plan[:2]
    for job, bench, prio in zip(probes, ("scienceqa", "hotpotqa"), (-1.0, -0.9), strict=True):
        assert job == Job(
            f"probe/{bench}", "probe",
            ["py", "cli.py", "zero-shot", "--benchmark", bench, "--model", "qwen2.5-coder-1.5b", "--dtype", "bfloat16",
             "--out", f"{{root}}/probe/{bench}", "--quiet", "true"],
            f"probe/{bench}/summary.json", (), 8.0, pytest.approx(prio),
        )  # fmt: skip
        assert job.meta == {"benchmark": bench, "set": f"{bench}_zero_shot", "lambda": None, "train_scheme": "",
                            "shared_a": True}  # fmt: skip


def test_an_attempt_record_makes_its_folders_and_appends_one_json_line(tmp_path: Path) -> None:
    """An attempt of a job whose folder is not there yet (an adopted orphan's) still gets its record: the folders are
    made, and each record is one more JSON line."""
    path = tmp_path / "eval" / "set" / "scheme" / "attempts.jsonl"
    driver._append(path, {"rc": 1, "seconds": 0.5})
    driver._append(path, {"rc": 0})
    assert path.read_text() == '{"rc": 1, "seconds": 0.5}\n{"rc": 0}\n'


def _sh_job(name: str, kind: str, script: str, log: Path, priority: float = 0.0) -> Job:
    """A job of 1 GB whose command is a shell line: it notes its start and end in ``log`` around ``script``."""
    line = f'echo "start {name}" >> {log}; {script}; rc=$?; echo "end {name}" >> {log}; exit $rc'
    meta = BASE_META if kind == "train" else {}  # a training's config is written from it
    return Job(name, kind, ["sh", "-c", line], f"{name}/done", gb=1.0, priority=priority, meta=meta)


def test_run_by_default_retries_a_failing_job_twice_polls_every_5_s_and_says_so_live(
    tmp_path: Path, monkeypatch
) -> None:
    """Without options: a job that always fails is tried 3 times (2 retries), the driver looks at its processes
    every 5 s, and each message is a ``[study HH:MM:SS]`` line flushed as it is said; a root whose parent folders are
    not there yet is made."""
    import re
    import time as time_module

    naps: list[float] = []
    real_sleep = time_module.sleep
    monkeypatch.setattr(time_module, "sleep", lambda s: naps.append(s) or real_sleep(0.01))

    class Live(io.StringIO):
        flushed: list[int] = []

        def flush(self) -> None:
            self.flushed.append(len(self.getvalue()))

    out = Live()
    monkeypatch.setattr(sys, "stdout", out)
    root = tmp_path / "new" / "study"
    job = _sh_job("fidelity/f", "fidelity", "exit 3", tmp_path / "log")
    assert driver.run(root, [job], gpu_gb=4.0) == 1
    monkeypatch.undo()
    assert attempts(job, root) == 3 and naps and set(naps) == {5.0}
    lines = out.getvalue().splitlines()
    stamp = r"\[study \d\d:\d\d:\d\d\] "
    assert re.fullmatch(stamp + r"launched fidelity/f on GPU 0 \(1 GB est\., 1 of 4 in use there\)", lines[0])
    assert re.fullmatch(stamp + r"fidelity/f: exit 3 after [0-2] s", lines[1])
    assert re.fullmatch(stamp + r"finished: 0 of 1 jobs done or not needed", lines[-1]) and len(lines) == 7
    ends = {m.end() for m in re.finditer("\n", out.getvalue())}
    assert ends <= set(out.flushed)  # every line reached the log as soon as it was said


def _order(log: Path) -> list[str]:
    return log.read_text().splitlines()


@pytest.mark.parametrize("kind, cap", [("fidelity", 12), ("train", 2)])
def test_run_by_default_starts_at_most_its_cap_of_jobs_per_gpu(kind: str, cap: int, tmp_path: Path) -> None:
    """One job more than the default cap, all fitting the memory (at most 12 processes per GPU, of which at most two
    trainings): ``cap`` start at once, the last only once one has ended."""
    log = tmp_path / "log"
    plan = [_sh_job(f"{kind}/j{i:02d}", kind, f"sleep 0.6; mkdir -p {tmp_path}/r/{kind}/j{i:02d}; "
                    f"touch {tmp_path}/r/{kind}/j{i:02d}/done", log, priority=i) for i in range(cap + 1)]  # fmt: skip
    assert driver.run(tmp_path / "r", plan, gpu_gb=100.0, poll=0.02) == 0
    order = _order(log)
    last = order.index(f"start {kind}/j{cap:02d}")
    assert sum(x.startswith("start") for x in order[:last]) == cap and any(x.startswith("end") for x in order[:last])


@pytest.mark.parametrize("kind, caps", [("fidelity", {"max_procs": 2}), ("train", {"max_train": 2})])
def test_a_cap_of_two_starts_two_at_once_and_a_third_in_the_first_freed_place(
    kind: str, caps: dict, tmp_path: Path
) -> None:
    """Under a cap of two processes (or two trainings) per GPU, two jobs start together, and a third starts as soon as
    one of the two ends, while the other still runs: each running job takes one place, not more."""
    log = tmp_path / "log"
    root = tmp_path / "r"
    naps = (1.0, 2.0, 0.0)  # the first ends while the second runs on
    plan = [_sh_job(f"{kind}/j{i}", kind, f"sleep {nap}; mkdir -p {root}/{kind}/j{i}; touch {root}/{kind}/j{i}/done",
                    log, priority=i) for i, nap in enumerate(naps)]  # fmt: skip
    assert driver.run(root, plan, gpu_gb=100.0, poll=0.02, **caps) == 0
    order = _order(log)
    assert order.index(f"start {kind}/j1") < order.index(f"end {kind}/j0")  # the first two together
    assert order.index(f"end {kind}/j0") < order.index(f"start {kind}/j2")  # the third held back by the cap
    assert order.index(f"start {kind}/j2") < order.index(f"end {kind}/j1")  # then in the place j0 left


def test_jobs_up_to_the_process_cap_start_in_one_pass(tmp_path: Path) -> None:
    """Two jobs under a cap of two processes start in the same pass, not a poll apart: each launch takes one place."""
    log = tmp_path / "log"
    root = tmp_path / "r"
    plan = [_sh_job(f"fidelity/j{i}", "fidelity", f"sleep 1; mkdir -p {root}/fidelity/j{i}; "
                    f"touch {root}/fidelity/j{i}/done", log, priority=i) for i in range(2)]  # fmt: skip
    # a poll apart, j1 would start 3 s after j0, long after j0's 1 s ended; in one pass, well within it
    assert driver.run(root, plan, gpu_gb=100.0, poll=3.0, max_procs=2) == 0
    order = _order(log)
    assert order.index("start fidelity/j1") < order.index("end fidelity/j0")


def test_a_job_out_of_attempts_or_a_capped_training_holds_back_no_job_behind_it(tmp_path: Path) -> None:
    """A job that has failed all its attempts, and a training held back by the trainings cap, are passed over: the
    jobs behind them in priority order are still launched (here while the first training still runs)."""
    log = tmp_path / "log"
    root = tmp_path / "r"

    def job(n: str, kind: str, gb: float, script: str, prio: float) -> Job:
        done = f"mkdir -p {root}/{n}; touch {root}/{n}/done"
        return dataclasses.replace(_sh_job(n, kind, f"{script} && {done}", log, priority=prio), gb=gb)

    plan = [job("fidelity/fails", "fidelity", 1.0, "exit 3", 0), job("fidelity/whole", "fidelity", 10.0, "true", 1)]
    assert driver.run(root, plan, gpu_gb=10.0, poll=0.02, retries=0) == 1  # the whole GPU only once "fails" is out
    assert attempts(plan[0], root) == 1 and (root / "fidelity/whole/done").is_file()
    plan = [job("train/t1", "train", 1.0, "sleep 1.5", 0), job("train/t2", "train", 1.0, "true", 1),
            job("fidelity/f", "fidelity", 1.0, "true", 2)]  # fmt: skip
    assert driver.run(root, plan, gpu_gb=10.0, poll=0.02, max_train=1) == 0
    order = _order(log)
    assert order.index("start fidelity/f") < order.index("end train/t1") < order.index("start train/t2")


def test_jobs_that_fill_a_gpu_exactly_fit_it(tmp_path: Path) -> None:
    """Two jobs whose estimates add up to exactly the memory per GPU run side by side, and a job whose estimate is
    exactly that memory is launched (it is not too big)."""
    log = tmp_path / "log"
    root = tmp_path / "r"

    def job(n: str, gb: float, nap: float, prio: float) -> Job:
        script = f"sleep {nap}; mkdir -p {root}/fidelity/{n}; touch {root}/fidelity/{n}/done"
        return dataclasses.replace(_sh_job(f"fidelity/{n}", "fidelity", script, log, priority=prio), gb=gb)

    assert driver.run(root, [job("a", 4.0, 2.0, 0), job("b", 6.0, 0, 1)], gpu_gb=10.0, poll=0.02) == 0
    order = _order(log)
    assert order.index("start fidelity/b") < order.index("end fidelity/a")
    whole = job("whole", 10.0, 0, 2)
    assert driver.run(root, [whole], gpu_gb=10.0, poll=0.02) == 0 and attempts(whole, root) == 1


def test_a_fit_config_saves_the_last_checkpoint_and_validates_plainly_whatever_the_recipe_says(
    tmp_path: Path, monkeypatch
) -> None:
    """A recipe that would not save the last checkpoint and validates under a scheme: the study's fit saves
    ``last.ckpt`` (it resumes from it) and validates plainly (no scheme)."""
    (tmp_path / "configs").mkdir()
    recipe = {"trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                         "init_args": {"save_last": False, "monitor": "val/loss", "save_top_k": 2}}]},
              "model": {"roles": ["plan"], "val_schemes": ["non_shared", "full_shared"]}, "data": {}}  # fmt: skip
    (tmp_path / "configs" / "embedded_x.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(driver, "ROOT", tmp_path)
    cfg = train_config("x", 0.5, "base_lr_shared", True, tmp_path / "run", 1)
    (cb,) = cfg["trainer"]["callbacks"]
    assert cb["init_args"] == {"save_last": True, "monitor": None, "save_top_k": 0,
                               "dirpath": str(tmp_path / "run" / "checkpoints")}  # fmt: skip
    assert cfg["model"]["val_schemes"] == []


def test_a_report_goes_to_the_roots_report_folder_by_default(tmp_path: Path) -> None:
    """``report`` without ``--out``, of the λ study and of the sweep: the pages are written into ``<root>/report``."""
    root = tmp_path / "study"
    root.mkdir()
    assert driver.study("report", root=str(root), benchmarks="scienceqa") == 0
    assert (root / "report" / "study.md").is_file() and (root / "report" / "study.json").is_file()
    assert not (root / "report" / "sweep.md").exists()
    assert driver.study("report", root=str(root), stage="sweep", benchmarks="hotpotqa") == 0
    assert (root / "report" / "sweep.md").is_file() and (root / "report" / "sweep.json").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["report"]


def test_the_pack_command_prints_one_line_per_piece(tmp_path: Path, monkeypatch, capsys) -> None:
    """A pack cut into several pieces (here at 100 bytes a piece): one ``<path> <size>`` line per piece, in order."""
    import functools

    monkeypatch.setattr(driver, "pack", functools.partial(driver.pack, piece_bytes=100))
    root = tmp_path / "study"
    (root / "eval/a/x").mkdir(parents=True)
    (root / "eval/a/x/summary.json").write_text(json.dumps({"r": list(range(200))}))
    assert driver.main(["pack", "--root", str(root), "--out", str(tmp_path / "p")]) == 0
    pieces = sorted((tmp_path / "p").iterdir())
    assert len(pieces) >= 2
    assert capsys.readouterr().out == "".join(f"{p} {p.stat().st_size}\n" for p in pieces)


def test_a_launched_job_logs_its_command_and_output_runs_in_the_repository_with_its_threads_and_is_recorded(
    tmp_path: Path, monkeypatch
) -> None:
    """Each job's ``log.txt`` starts with ``$ <command>`` and then takes its stdout and stderr; it runs in the
    repository root with no input, expandable CUDA segments, 4 threads for a training and 1 otherwise, and (one GPU)
    no ``CUDA_VISIBLE_DEVICES``; while it runs ``driver.json`` names this driver, this host and the job's pid; its
    attempt records its exit status and its seconds to 0.1 s. The driver's environment reaches the job, and the job
    runs in the repository root whatever the driver's working folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LRAGENT_STUDY_TEST_VAR", "kept")
    root = tmp_path / "r"
    script = ('sleep 0.4; echo "pid $$"; echo "cwd $(pwd)"; echo "in $(readlink /proc/$$/fd/0)"; '
              'echo "env $OMP_NUM_THREADS $PYTORCH_CUDA_ALLOC_CONF ${CUDA_VISIBLE_DEVICES-none} '
              '$LRAGENT_STUDY_TEST_VAR"; '
              f'cat {root}/driver.json; echo; echo oops >&2; mkdir -p {root}/$J; touch {root}/$J/done')  # fmt: skip
    plan = [Job(name, kind, ["sh", "-c", f"J={name}; {script}"], f"{name}/done", gb=1.0, priority=i,
                meta=BASE_META if kind == "train" else {})
            for i, (name, kind) in enumerate((("train/t", "train"), ("fidelity/f", "fidelity")))]  # fmt: skip
    read_end, write_end = os.pipe()  # the driver's own input: a pipe, which a job must not inherit
    saved = os.dup(0)
    os.dup2(read_end, 0)
    try:
        assert driver.run(root, plan, gpu_gb=10.0, poll=0.05) == 0
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    for job, threads in zip(plan, ("4", "1"), strict=True):
        log = (root / job.name / "log.txt").read_text().splitlines()
        assert log[:2] == ["", f"$ {shlex.join(job.cmd)}"]
        pid = int(log[2].split()[1])
        assert log[3:6] == [f"cwd {driver.ROOT}", "in /dev/null", f"env {threads} expandable_segments:True none kept"]
        assert log[-1] == "oops"
        record = json.loads("\n".join(log[6:-1]))
        assert record["pid"] == os.getpid() and record["host"] == platform.node()
        assert record["running"][job.name] == pid
        (attempt,) = [json.loads(x) for x in (root / job.name / "attempts.jsonl").read_text().splitlines()]
        assert attempt["rc"] == 0 and 0.4 <= attempt["seconds"] <= 10
        assert isinstance(attempt["seconds"], float) and attempt["seconds"] == round(attempt["seconds"], 1)
    assert json.loads((root / "driver.json").read_text()) == {"pid": os.getpid(), "host": platform.node(),
                                                              "running": {}}  # fmt: skip


def test_a_job_larger_than_a_gpu_is_said_once_at_once_and_never_launched(tmp_path: Path, capsys) -> None:
    """A job whose estimate exceeds the memory per GPU is named once with both sizes, in the first pass even behind a
    job that waits for room, and never started (nor the job that needs it); the jobs that fit run in priority order,
    each launch naming the memory in use; the driver ends with status 1 (not every job is done)."""
    log = tmp_path / "log"
    root = tmp_path / "r"

    def job(n: str, gb: float, prio: float, deps: tuple = ()) -> Job:
        j = _sh_job(f"fidelity/{n}", "fidelity", f"sleep 0.2; mkdir -p {root}/fidelity/{n}; "
                    f"touch {root}/fidelity/{n}/done", log, priority=prio)  # fmt: skip
        return dataclasses.replace(j, gb=gb, deps=deps)

    plan = [job("s1", 60, 0), job("s2", 60, 1), job("s3", 10, 2), job("big", 150, 3), job("s4", 10, 4),
            job("dep", 10, 5, ("fidelity/big",))]  # fmt: skip
    assert driver.run(root, plan, gpu_gb=100.0, poll=0.02) == 1
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert said[:2] == ["launched fidelity/s1 on GPU 0 (60 GB est., 60 of 100 in use there)",
                        "fidelity/big needs 150 GB, more than the 100 GB per GPU: not launched"]  # fmt: skip
    assert said[2].startswith("fidelity/s1: exit 0 after ")
    assert said[3:6] == ["launched fidelity/s2 on GPU 0 (60 GB est., 60 of 100 in use there)",
                         "launched fidelity/s3 on GPU 0 (10 GB est., 70 of 100 in use there)",
                         "launched fidelity/s4 on GPU 0 (10 GB est., 80 of 100 in use there)"]  # fmt: skip
    assert sum("big" in x for x in said) == 1 and said[-1] == "finished: 4 of 6 jobs done or not needed"
    order = _order(log)
    assert order[:2] == ["start fidelity/s1", "end fidelity/s1"] and len(order) == 8  # the rest waited for its room


def test_the_plans_eval_fidelity_and_training_jobs_are_exactly_the_studys_commands() -> None:
    """Whole jobs of the λ plan, command by command: a trained set's rows (non_shared at 32 rows and 20 GB, droidspeak
    at 48, the others at 64 and 14 GB; bf16, quiet, into the job's folder), the untrained row (B = 0, named
    ``untrained``), the shipped set's rows (its bundled adapters, no training), a shared-A and an independent-A
    fidelity (every scheme that set can run, the whole validation pool), a training; each with its priority,
    dependencies and the report's metadata."""
    plan = {j.name: j for j in build_plan(("scienceqa", "hotpotqa"), (0.0, 0.5), runs=3, epochs=2, python="py")}

    def ev(set_: str, sch: str, adapters: list[str], batch: int, gb: float, deps: tuple, prio: float) -> Job:
        name = f"eval/{set_}/{sch}"
        return Job(name, "eval", ["py", "cli.py", "eval", "--benchmark", "hotpotqa", *adapters, "--scheme", sch,
                                  "--runs", "3", "--batch", str(batch), "--dtype", "bfloat16", "--out",
                                  f"{{root}}/{name}", "--quiet", "true"],
                   f"{name}/summary.json", deps, gb, prio)  # fmt: skip

    trained = ["--adapters", "{root}/train/hotpotqa_lam0/adapters"]
    shipped = ["--adapters", "data/adapters/hotpotqa_sharedA"]
    want = [
        ev("hotpotqa_lam0", "non_shared", trained, 32, 20.0, ("train/hotpotqa_lam0",), 2.1),
        ev("hotpotqa_lam0", "droidspeak", trained, 48, 14.0, ("train/hotpotqa_lam0",), 2.14),
        ev("hotpotqa_untrained", "non_shared", ["--adapter_init", "zero"], 32, 20.0, (), 52.1),
        ev("hotpotqa_shipped", "full_shared", shipped, 64, 14.0, (), 22.12),
    ]
    for job in want:
        assert plan[job.name] == job, job.name
    lam0 = {"benchmark": "hotpotqa", "set": "hotpotqa_lam0", "lambda": 0.0, "train_scheme": "base_lr_shared",
            "shared_a": True, "data": {}}  # fmt: skip
    assert plan["eval/hotpotqa_lam0/droidspeak"].meta == {**lam0, "scheme": "droidspeak", "runs": 3,
                                                          "row": "droidspeak"}  # fmt: skip
    assert plan["eval/hotpotqa_untrained/non_shared"].meta == {
        "benchmark": "hotpotqa", "set": "hotpotqa_untrained", "lambda": None, "train_scheme": "", "shared_a": True,
        "data": {}, "scheme": "non_shared", "runs": 3, "row": "untrained"}  # fmt: skip
    assert plan["eval/hotpotqa_shipped/full_shared"].meta == {
        **lam0, "set": "hotpotqa_shipped", "data": {"shipped": "data/adapters/hotpotqa_sharedA"},
        "scheme": "full_shared", "runs": 3, "row": "full_shared"}  # fmt: skip
    assert "train/hotpotqa_shipped" not in plan and "train/hotpotqa_untrained" not in plan

    def fid(set_: str, schemes: str, prio: float) -> Job:
        name = f"fidelity/{set_}"
        return Job(name, "fidelity", ["py", "cli.py", "fidelity", "--benchmark", "scienceqa", "--adapters",
                                      f"{{root}}/train/{set_}/adapters", "--pool", "val", "--scheme", schemes,
                                      "--limit", "100000", "--dtype", "bfloat16", "--out", f"{{root}}/{name}",
                                      "--quiet", "true"],
                   f"{name}/fidelity.json", (f"train/{set_}",), 10.0, prio)  # fmt: skip

    assert plan["fidelity/scienceqa_lam0.5"] == fid(
        "scienceqa_lam0.5", "non_shared,base_lr_shared,full_shared,base_shared,droidspeak", 210.0
    )
    assert plan["fidelity/scienceqa_indepA"] == fid("scienceqa_indepA", "non_shared,full_shared,base_shared,droidspeak",
                                                    230.0)  # fmt: skip
    assert plan["fidelity/scienceqa_indepA"].meta == {
        "benchmark": "scienceqa", "set": "scienceqa_indepA", "lambda": 0.0, "train_scheme": "base_lr_shared",
        "shared_a": False, "data": {}}  # fmt: skip
    assert "fidelity/hotpotqa_untrained" not in plan
    train = plan["train/hotpotqa_lam0.5"]
    assert train == Job("train/hotpotqa_lam0.5", "train",
                        ["py", "cli.py", "fit", "--config", "{root}/train/hotpotqa_lam0.5/config.yaml"],
                        "train/hotpotqa_lam0.5/adapters/lragent_adapters.safetensors", (), 55.0, 10.1)  # fmt: skip
    assert train.meta == {"benchmark": "hotpotqa", "set": "hotpotqa_lam0.5", "lambda": 0.5,
                          "train_scheme": "base_lr_shared", "shared_a": True, "data": {}, "epochs": 2,
                          "config_prefix": "embedded"}  # fmt: skip


def test_an_adopted_orphan_holds_its_memory_and_ending_without_its_result_is_recorded_and_retried(
    tmp_path: Path, capsys
) -> None:
    """A gone driver's job that still runs is waited for and counts against GPU 0's memory (a job that would not fit
    beside it waits); when it ends without its result its attempt is recorded as ADOPTED_ENDED and the job runs
    again, here, before the job behind it."""
    root = tmp_path / "r"
    log = tmp_path / "log"
    plan = [_sh_job(f"fidelity/{n}", "fidelity", f"sleep 0.2; mkdir -p {root}/fidelity/{n}; "
                    f"touch {root}/fidelity/{n}/done", log, priority=i)
            for i, n in enumerate(("orphan", "other"))]  # fmt: skip
    plan = [dataclasses.replace(j, gb=60.0) for j in plan]
    code = "import time; print('up', flush=True); time.sleep(0.8)"
    orphan = subprocess.Popen([sys.executable, "-c", code, f"--out={root}/fidelity/orphan"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert orphan.stdout.readline() == "up\n"
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        _driver_json(root, pid=dead.pid, host=platform.node(), running={"fidelity/orphan": orphan.pid})
        assert driver.run(root, plan, gpu_gb=100.0, poll=0.02) == 0
    finally:
        orphan.kill()
        orphan.wait()
        orphan.stdout.close()
    said = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert said[0] == f"fidelity/orphan: still running from an earlier driver (pid {orphan.pid}); waiting for it"
    assert said[1].startswith(f"fidelity/orphan: exit {driver.ADOPTED_ENDED} after ")
    assert _order(log) == ["start fidelity/orphan", "end fidelity/orphan", "start fidelity/other", "end fidelity/other"]
    rcs = [json.loads(x)["rc"] for x in (root / "fidelity/orphan/attempts.jsonl").read_text().splitlines()]
    assert rcs == [driver.ADOPTED_ENDED, 0]


def test_a_training_skips_the_least_used_gpu_when_it_already_has_its_trainings(tmp_path: Path) -> None:
    """Two GPUs, one training each at most: a big eval takes GPU 0, the first training the emptier GPU 1, and the
    second training GPU 0 (GPU 1, though still the emptier, has its training)."""
    root = tmp_path / "r"
    log = tmp_path / "log"
    plan = [_sh_job(n, k, f"echo gpu $CUDA_VISIBLE_DEVICES; sleep 0.5; mkdir -p {root}/{n}; touch {root}/{n}/done",
                    log, priority=i) for i, (n, k) in enumerate((("fidelity/big", "fidelity"), ("train/t1", "train"),
                                                                 ("train/t2", "train")))]  # fmt: skip
    plan[0] = dataclasses.replace(plan[0], gb=50.0)
    assert driver.run(root, plan, gpu_gb=100.0, poll=0.02, gpus=2, max_train=1) == 0
    gpu = {j.name: (root / j.name / "log.txt").read_text().splitlines()[2] for j in plan}
    assert gpu == {"fidelity/big": "gpu 0", "train/t1": "gpu 1", "train/t2": "gpu 0"}
    order = _order(log)
    assert order.index("start train/t2") < order.index("end train/t1")  # it did not wait for GPU 1's training


def test_pid_runs_reads_the_state_after_the_last_parenthesis_and_the_command_line_as_spaced_text(
    tmp_path: Path, monkeypatch
) -> None:
    """Asking does not signal the process (it still runs afterwards); a program whose name holds ``) Z (`` is read by
    the state after its name's last parenthesis (running, not a zombie); the needle is looked for in the arguments
    joined by single spaces, bytes that are not UTF-8 included; a process gone between the two reads does not run."""
    import shutil
    import time as time_module

    link = tmp_path / "s) Z (x"
    link.symlink_to(shutil.which("sh"))
    import signal

    hangup = lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL)  # noqa: E731  (a hang-up ends it, even under nohup)
    proc = subprocess.Popen([str(link), "-c", "sleep 30; :", "/tmp/x/a", "b", b"\xff"], preexec_fn=hangup)
    try:
        for _ in range(200):  # until the program is exec'd: its name is the link's
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "s) Z (x":
                break
            time_module.sleep(0.01)
        assert driver._pid_runs(proc.pid) and driver._pid_runs(proc.pid, "/tmp/x/a b \ufffd")
        assert not driver._pid_runs(proc.pid, "/tmp/x/a  b")
        time_module.sleep(0.2)
        assert proc.poll() is None  # not signalled by the question
        real = Path.read_bytes
        monkeypatch.setattr(
            Path,
            "read_bytes",
            lambda p: real(p) if p.name != "cmdline" else (_ for _ in ()).throw(FileNotFoundError(p)),
        )  # the process ended between reading its state and its command line
        assert not driver._pid_runs(proc.pid, "/tmp/x/a")
    finally:
        proc.kill()
        proc.wait()


def test_a_job_whose_last_attempt_succeeded_runs_again_whatever_its_failures_and_an_exit_with_its_result_is_kept(
    tmp_path: Path,
) -> None:
    """Only a failed last attempt counts against the retries: a job with three failures and then a success that is
    not done (its result since removed) runs again; a job that writes its result but exits non-zero is done, and its
    attempt keeps the exit status."""
    root = tmp_path / "r"
    log = tmp_path / "log"
    again, nonzero = (_sh_job(f"fidelity/{n}", "fidelity",
                              f"mkdir -p {root}/fidelity/{n}; touch {root}/fidelity/{n}/done"
                              + ("; exit 3" if n == "nonzero" else ""), log) for n in ("again", "nonzero"))  # fmt: skip
    (root / "fidelity/again").mkdir(parents=True)
    (root / "fidelity/again/attempts.jsonl").write_text('{"rc": 1}\n{"rc": 1}\n{"rc": 1}\n{"rc": 0}\n')
    assert driver.run(root, [again, nonzero], gpu_gb=10.0, poll=0.02) == 0
    assert "start fidelity/again" in _order(log) and attempts(again, root) == 5
    assert [json.loads(x)["rc"] for x in (root / "fidelity/nonzero/attempts.jsonl").read_text().splitlines()] == [3]


def test_a_ready_job_without_a_process_slot_keeps_the_driver_waiting(tmp_path: Path) -> None:
    """No process may start (``max_procs`` 0): the driver does not end while the job is ready; it ends, all done,
    once the job's result appears."""
    import threading
    import time as time_module

    root = tmp_path / "r"
    job = _sh_job("fidelity/f", "fidelity", "true", tmp_path / "log")
    out: list = []
    thread = threading.Thread(target=lambda: out.append(driver.run(root, [job], gpu_gb=10.0, poll=0.02, max_procs=0)))
    thread.start()
    time_module.sleep(0.3)
    alive = thread.is_alive()
    (root / "fidelity/f").mkdir(parents=True, exist_ok=True)
    (root / "fidelity/f/done").write_text("")
    thread.join(10)
    assert alive and out == [0] and not (tmp_path / "log").exists()


def test_only_trainings_count_against_the_trainings_cap(tmp_path: Path) -> None:
    """One training per GPU: a long evaluation running beside the first training does not hold back the second once
    the first has ended."""
    root = tmp_path / "r"
    log = tmp_path / "log"
    plan = [_sh_job(n, k, f"sleep {t}; mkdir -p {root}/{n}; touch {root}/{n}/done", log, priority=i)
            for i, (n, k, t) in enumerate((("fidelity/long", "fidelity", 1.0), ("train/t1", "train", 0.1),
                                           ("train/t2", "train", 0.1)))]  # fmt: skip
    assert driver.run(root, plan, gpu_gb=100.0, poll=0.02, max_train=1) == 0
    order = _order(log)
    assert order.index("end train/t1") < order.index("start train/t2") < order.index("end fidelity/long")


def test_one_failed_attempt_is_a_failed_job_and_the_state_reads_the_last_record_only(tmp_path: Path) -> None:
    """A single attempt that exited non-zero makes the job ``failed``; after a success it is ``ready`` again; an
    attempt record without an exit status fails nothing."""
    job = Job("eval/a", "eval", [], "eval/a/summary.json")
    jobs = {job.name: job}
    log = tmp_path / "eval/a/attempts.jsonl"
    log.parent.mkdir(parents=True)
    for text, state in (('{"rc": 2}\n', "failed"), ('{"rc": 2}\n{"rc": 0}\n', "ready"),
                        ('{"rc": 0}\n{"rc": 2}\n', "failed"), ('{"rc": 2}\n{"seconds": 1}\n', "ready")):  # fmt: skip
        log.write_text(text)
        assert job_state(job, tmp_path, set(), jobs) == state, text


def test_only_lambda_zero_and_the_shipped_study_set_get_every_scheme_and_the_full_shared_set_is_lambda_one() -> None:
    """Of the shared-A λ sets only λ = 0 and the bundled study set (ScienceQA λ 0.5) are evaluated under all five
    schemes, the others under the three λ schemes; the ``full_shared`` set trains at λ = 1 with that term."""
    plan = {j.name: j for j in build_plan(("scienceqa", "hotpotqa"), (0.0, 0.5, 0.25), runs=3)}

    def schemes(set_: str) -> set[str]:
        return {n.rsplit("/", 1)[1] for n in plan if n.startswith(f"eval/{set_}/")}

    for set_ in ("scienceqa_lam0", "hotpotqa_lam0", "scienceqa_lam0.5"):
        assert schemes(set_) == set(driver.FIVE), set_
    for set_ in ("hotpotqa_lam0.5", "scienceqa_lam0.25", "hotpotqa_lam0.25", "hotpotqa_lam1_full"):
        assert schemes(set_) == set(driver.LAMBDA_SCHEMES), set_
    full = plan["train/hotpotqa_lam1_full"].meta
    assert (full["lambda"], full["train_scheme"], full["shared_a"]) == (1.0, "full_shared", True)


def test_fidelity_jobs_take_the_profiles_memory_and_follow_every_row_benchmark_by_benchmark() -> None:
    """A fidelity job asks for its profile's fidelity memory (14 GB on the accuracy model) and comes after every
    evaluation row, its set's place then its benchmark's (+0.1 for the second) deciding among them."""
    qwen = build_plan(("scienceqa", "hotpotqa"), (0.0,), runs=1, profile=driver.PROFILES["qwen2.5-coder-1.5b"])
    fids = {j.name: j for j in qwen if j.kind == "fidelity"}
    assert {j.gb for j in fids.values()} == {14.0}
    assert fids["fidelity/scienceqa_lam0"].priority == 200.0
    assert fids["fidelity/hotpotqa_lam0"].priority == pytest.approx(200.1)
    assert fids["fidelity/hotpotqa_indepA"].priority == pytest.approx(220.1)  # λ 0, full, indepA: the third set
    assert max(j.priority for j in qwen if j.kind == "eval") < min(j.priority for j in fids.values())
