"""The study driver's small parts, each on its own: the GPU query, the plan's status lines, the pack's filter, a job's
prepared directory and config, the sweep's defaults and reference sets, process liveness and the attempt logs."""

from __future__ import annotations

import io
import json
import os
import platform
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
