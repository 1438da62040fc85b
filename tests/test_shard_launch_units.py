"""The pieces of ``eval --devices N``'s shard launch (:mod:`eval_suite.evaluate.shard_launch`) one by one, in process
and fast: the command-line readers, the process age, each shard's device, environment, command line, log and queue,
the early launch's decisions and its adoption or stop. Each shard's process is a recorded stand-in (a real one would
be a whole eval); stopping processes is checked on real ones. The end-to-end runs are in test_shard_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval_suite.evaluate import shard_launch
from eval_suite.evaluate.shard_launch import (
    EarlyShards,
    _argv_value,
    _options,
    _shard_line,
    adopt_early,
    benchmark_list,
    finish_early,
    process_age_s,
    spawn_shards,
    start_early,
    stop_processes,
    visible_gpus,
)
from lragent.host_threads import GPU_HOST_THREADS


class StandInProcess:
    """What spawn_shards starts, recorded: the command, its output and environment; it runs until terminated."""

    def __init__(self, cmd, stdout=None, stderr=None, env=None) -> None:
        self.cmd, self.stdout, self.stderr, self.env = cmd, stdout, stderr, env
        self.returncode = None

    def poll(self):
        return self.returncode

    def terminate(self) -> None:
        self.returncode = -signal.SIGTERM

    def wait(self, timeout=None):
        return self.returncode

    def kill(self) -> None:  # pragma: no cover - terminate always ends a stand-in
        self.returncode = -signal.SIGKILL


@pytest.fixture
def stand_ins(monkeypatch):
    started: list[StandInProcess] = []

    def popen(cmd, **kwargs):
        started.append(StandInProcess(cmd, **kwargs))
        return started[-1]

    monkeypatch.setattr(shard_launch.subprocess, "Popen", popen)
    monkeypatch.setattr(shard_launch.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(shard_launch, "_EARLY", [])
    yield started
    for p in started:
        if not p.stdout.closed:
            p.stdout.close()


@pytest.mark.parametrize(
    "value, names",
    [
        ("hotpotqa", ["hotpotqa"]),
        ("hotpotqa,scienceqa", ["hotpotqa", "scienceqa"]),
        (" [hotpotqa, scienceqa] ", ["hotpotqa", "scienceqa"]),
        ("['hotpotqa', \"scienceqa\"]", ["hotpotqa", "scienceqa"]),
        ("a,, b,", ["a", "b"]),
        ("", []),
        ("[]", []),
        (["x", " 'y' ", ""], ["x", "y"]),
        ((1, "z"), ["1", "z"]),
        ("X,'',b,'TAX'", ["X", "b", "TAX"]),  # a name of X's; a quoted empty name is none
    ],
)
def test_benchmark_list_reads_every_spelling_in_order(value, names) -> None:
    assert benchmark_list(value) == names


@pytest.mark.parametrize(
    "argv, value",
    [
        (["--benchmark", "a", "--limit", "3"], "a"),
        (["--limit", "3", "--benchmark=a,b"], "a,b"),
        (["--benchmark", "a", "--benchmark=b"], "b"),  # the last one wins
        (["--benchmark=b", "--benchmark", "c"], "c"),
        (["--benchmark=x=y"], "x=y"),
        (["--benchmark="], ""),
        (["--limit", "3", "--benchmark"], None),  # no value after it
        (["--benchmarks", "a", "-benchmark", "b"], None),
        ([], None),
    ],
)
def test_argv_value_reads_the_last_value_of_the_option(argv, value) -> None:
    assert _argv_value(argv, "--benchmark") == value


@pytest.mark.parametrize(
    "argv, parsed",
    [
        (["--devices", "2", "--out", "o", "--limit", "4"], ({"--devices": "2", "--out": "o"}, ["--limit", "4"])),
        (
            ["--devices=3", "--device=cpu", "x", "--quiet", "false"],
            ({"--devices": "3", "--device": "cpu", "--quiet": "false"}, ["x"]),
        ),  # fmt: skip
        (["--out", "a", "--out=b"], ({"--out": "b"}, [])),
        (["--out="], ({"--out": ""}, [])),
        (["--limit=4", "--scheme", "all"], ({}, ["--limit=4", "--scheme", "all"])),
        (["--devices", "2", "--out"], None),  # the last one lacks its value
        ([], ({}, [])),
    ],
)
def test_options_splits_the_launchers_options_from_the_shards(argv, parsed) -> None:
    assert _options(argv) == parsed


def _fake_proc(monkeypatch, tmp_path: Path, stat: str | None, uptime: str | None) -> None:
    """/proc/self/stat and /proc/uptime as given (None: missing) for process_age_s."""
    files = {"/proc/self/stat": stat, "/proc/uptime": uptime}
    for name, text in files.items():
        if text is not None:
            (tmp_path / name.replace("/", "_")).write_text(text)
    monkeypatch.setattr(shard_launch, "Path", lambda p: tmp_path / str(p).replace("/", "_"))


def test_process_age_is_the_uptime_less_the_start_time_of_this_process(monkeypatch, tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["S"] + [str(k) for k in range(1, 19)] + [str(250 * ticks), "7", "8"]  # field 22: started at 250 s
    _fake_proc(monkeypatch, tmp_path, f"1234 (a) b) {' '.join(fields)}\n", "1000.5 3999.0\n")
    assert process_age_s() == pytest.approx(750.5)


@pytest.mark.parametrize(
    "stat, uptime",
    [
        (None, "100.0 1.0"),
        ("1 (a) S 1 2 3", "100.0 1.0"),  # too few fields
        ("1 (a) " + " ".join(["S"] + ["x"] * 21), "100.0 1.0"),  # not a number
        ("1 (a) " + " ".join(["S"] + ["1"] * 21), None),
        ("1 (a) " + " ".join(["S"] + ["1"] * 21), "up"),
    ],
)
def test_process_age_is_none_where_proc_cannot_say(monkeypatch, tmp_path: Path, stat, uptime) -> None:
    _fake_proc(monkeypatch, tmp_path, stat, uptime)
    assert process_age_s() is None


def test_process_age_of_a_real_process_counts_from_its_start() -> None:
    code = "import time; time.sleep(0.6); from eval_suite.evaluate.shard_launch import process_age_s as a; print(a())"
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    age = float(out.stdout)
    assert 0.6 <= age <= time.perf_counter() - t0 + 0.05


def test_a_cpu_shard_gets_its_device_and_a_share_of_the_cores() -> None:
    env = {"PATH": "/bin"}
    assert shard_launch.shard_launch(1, 3, 0, None, env, 16) == (
        "cpu",
        {"PATH": "/bin", "OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "5", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert env == {"PATH": "/bin"}  # the caller's environment is not changed
    dev, out = shard_launch.shard_launch(0, 4, 0, "cpu:1", {"MKL_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "x"}, 3)
    assert (dev, out) == ("cpu:1", {"MKL_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "x", "OMP_NUM_THREADS": "1"})


def test_a_gpu_shard_sees_its_own_gpu_and_at_most_the_gpu_host_threads() -> None:
    wide = 8 * GPU_HOST_THREADS
    dev, env = shard_launch.shard_launch(1, 2, 2, None, {"CUDA_VISIBLE_DEVICES": "6, 3"}, 2 * wide)
    assert dev == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(GPU_HOST_THREADS)
    dev, env = shard_launch.shard_launch(2, 3, 3, "cuda", {"CUDA_VISIBLE_DEVICES": "5"}, 3 * (GPU_HOST_THREADS - 1))
    assert dev == "cuda" and env["CUDA_VISIBLE_DEVICES"] == "2"  # fewer listed than shards: by number
    assert env["OMP_NUM_THREADS"] == str(GPU_HOST_THREADS - 1)  # a share under the cap stays
    assert shard_launch.shard_launch(0, 2, 2, None, {}, 1)[1]["OMP_NUM_THREADS"] == "1"  # never 0 threads
    # no CUDA_VISIBLE_DEVICES: shard i gets GPU i
    assert [shard_launch.shard_launch(i, 2, 2, None, {}, 8)[1]["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0", "1"]


def test_visible_gpus_are_the_listed_ones_else_the_drivers(monkeypatch, tmp_path: Path) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5,"}) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " , "}) == 0
    driver = tmp_path / "gpus"
    driver.mkdir()
    for name in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (driver / name).mkdir()
    monkeypatch.setattr(shard_launch, "Path", lambda p: driver if p == "/proc/driver/nvidia/gpus" else Path(p))
    assert visible_gpus({}) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0  # set but empty: none, whatever the driver has
    monkeypatch.setattr(shard_launch, "Path", lambda p: tmp_path / "no_driver")
    assert visible_gpus({"PATH": "/bin"}) == 0


def test_shard_line_says_where_with_how_many_threads_into_which_folder() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "7", "OMP_NUM_THREADS": "4"}
    assert _shard_line(1, 2, Path("o/shard_1"), Path("o/shard_1.log"), 1, "cuda", env) == (
        "eval: shard 1/2 on GPU 7 (4 CPU threads) -> o/shard_1 (log o/shard_1.log)"
    )
    assert (
        _shard_line(0, 3, Path("s"), Path("l"), 0, "cpu", env) == "eval: shard 0/3 on cpu (4 CPU threads) -> s (log l)"
    )


def test_spawn_shards_starts_each_shard_into_its_folder_log_and_the_emptied_queue(stand_ins, tmp_path: Path) -> None:
    out = tmp_path / "a" / "o"
    (out / "queue").mkdir(parents=True)
    (out / "queue" / "stale_claim").write_text("0/2")
    procs, logs, lines = spawn_shards(2, out, ["--limit", "4"], 0, None, {"PATH": "/bin"})
    assert procs == stand_ins and not (out / "queue" / "stale_claim").exists() and (out / "queue").is_dir()
    for i, p in enumerate(procs):
        assert p.cmd == [sys.executable, "-m", "lragent.cli_main", "eval", "--limit", "4", "--shard", f"{i}/2",
                         "--work_queue", str(out / "queue"), "--out", str(out / f"shard_{i}"), "--device", "cpu",
                         "--quiet", "true"]  # fmt: skip
        assert p.stdout is logs[i] and p.stderr == subprocess.STDOUT and p.stdout.name == str(out / f"shard_{i}.log")
        assert p.env == {
            "PATH": "/bin",
            "OMP_NUM_THREADS": "4",
            "MKL_NUM_THREADS": "4",
            "TOKENIZERS_PARALLELISM": "false",
        }
        assert (out / f"shard_{i}.log").is_file() and not logs[i].closed
        assert (
            lines[i]
            == f"eval: shard {i}/2 on cpu (4 CPU threads) -> {out / f'shard_{i}'} (log {out / f'shard_{i}.log'})"
        )


def test_spawn_shards_over_several_benchmarks_gives_one_folder_and_queue_per_benchmark(stand_ins, tmp_path) -> None:
    out = tmp_path / "o"
    for b in ("hotpotqa", "scienceqa"):
        (out / b / "queue").mkdir(parents=True)
        (out / b / "queue" / "stale").write_text("")
    procs, _, lines = spawn_shards(3, out, [], 3, "cuda", {"CUDA_VISIBLE_DEVICES": "1,2,3"}, ["hotpotqa", "scienceqa"])
    assert not (out / "hotpotqa" / "queue" / "stale").exists() and not (out / "scienceqa" / "queue" / "stale").exists()
    assert not (out / "queue").exists()
    for i, p in enumerate(procs):
        at = p.cmd.index("--work_queue")
        assert p.cmd[at : at + 6] == ["--work_queue", str(out / "{benchmark}" / "queue"), "--out",
                                      str(out / "{benchmark}" / f"shard_{i}"), "--device", "cuda"]  # fmt: skip
        assert p.env["CUDA_VISIBLE_DEVICES"] == str(i + 1) and p.stdout.name == str(out / f"shard_{i}.log")
    assert (
        lines[2]
        == f"eval: shard 2/3 on GPU 3 (2 CPU threads) -> {out / '{benchmark}' / 'shard_2'} (log {out / 'shard_2.log'})"
    )
    procs, _, _ = spawn_shards(1, tmp_path / "p", [], 0, "cpu", {}, ["hotpotqa"])  # one benchmark: the plain layout
    assert procs[0].cmd[-5] == str(tmp_path / "p" / "shard_0") and (tmp_path / "p" / "queue").is_dir()


def test_a_shard_with_no_cpu_count_gets_one_thread(stand_ins, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(shard_launch.os, "cpu_count", lambda: None)
    procs, _, _ = spawn_shards(1, tmp_path / "a" / "b" / "o", [], 0, "mps", {})  # the folder's parents are made too
    assert procs[0].env["OMP_NUM_THREADS"] == "1" and procs[0].cmd[-3] == "mps"
    assert (tmp_path / "a" / "b" / "o" / "shard_0.log").is_file()


def test_start_early_launches_a_plain_devices_run_and_keeps_it(stand_ins, tmp_path: Path) -> None:
    out = tmp_path / "o"
    argv = ["--benchmark", "[hotpotqa,scienceqa]", "--devices=2", "--out", str(out), "--device", "null", "--x", "1"]
    t0 = time.perf_counter()
    early = start_early(argv, env={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert early is not None and shard_launch._EARLY == [early] and early.procs == stand_ins
    assert (early.n, early.out_dir, early.gpus, early.device) == (2, out, 3, None)
    assert early.benchmarks == ["hotpotqa", "scienceqa"] and not early.adopted
    assert t0 <= early.spawned_at <= time.perf_counter()
    assert early.startup_s == pytest.approx(process_age_s(), abs=5.0)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in early.procs] == ["4", "5"]
    assert early.procs[0].cmd[4:8] == ["--benchmark", "[hotpotqa,scienceqa]", "--x", "1"]
    assert early.procs[0].cmd[-5] == str(out / "{benchmark}" / "shard_0") and len(early.lines) == 2
    assert [log.name for log in early.logs] == [str(out / "shard_0.log"), str(out / "shard_1.log")]
    early.stop()
    assert all(p.returncode == -signal.SIGTERM for p in early.procs) and all(log.closed for log in early.logs)


def test_start_early_reads_the_process_environment_by_default(stand_ins, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    early = start_early(["--devices", "2", "--out", str(tmp_path / "o"), "--benchmark", "hotpotqa"])
    assert early is not None and early.gpus == 2 and early.device is None and early.benchmarks == []
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in stand_ins] == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU seen without torch: left to the usual path
    assert start_early(["--devices", "2", "--out", str(tmp_path / "p")]) is None


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--devices", "2", "--out", "O", "--device", "cpu", "--shard=0/2"], {}),
        (["--devices", "2", "--out", "O", "--device", "cpu", "--config=c.yaml"], {}),
        (["--devices", "2", "--out", "O", "--device", "cpu", "--work_queue", "q"], {}),
        (["--devices", "2", "--out", "O", "--device", "cpu", "--print_config"], {}),
        (["--devices", "2", "--out", "O", "--device", "cpu", "-h"], {}),
        (["--out", "O", "--device", "cpu"], {}),  # one device
        (["--devices", "1", "--out", "O", "--device", "cpu"], {}),
        (["--devices", "-3", "--out", "O", "--device", "cpu"], {}),
        (["--devices", "2.0", "--out", "O", "--device", "cpu"], {}),
        (["--devices", "2", "--out=", "--device", "cpu"], {}),  # an empty --out
        (["--devices", "2", "--out", "O/{benchmark}", "--device", "cpu"], {}),  # a template: the usual path
        (["--devices", "2", "--out", "O", "--device", "None"], {"CUDA_VISIBLE_DEVICES": "0"}),  # 1 GPU for 2 shards
        (["--devices", "2", "--out", "O", "--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}),
        (["--devices", "2", "--out", "O", "--device"], {}),
    ],
)
def test_start_early_leaves_the_rest_to_the_usual_path(stand_ins, tmp_path: Path, argv, env) -> None:
    argv = [a.replace("O", str(tmp_path / "o")) for a in argv]
    assert start_early(argv, env=env) is None
    assert stand_ins == [] and shard_launch._EARLY == [] and not (tmp_path / "o").exists()


def test_start_early_on_a_named_device_runs_cpu_shards_there(stand_ins, tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}  # GPUs seen, but the shards are to run on the CPU
    early = start_early(["--devices", "3", "--out", str(tmp_path / "o"), "--device", "cpu"], env=env)
    assert early is not None and (early.n, early.gpus, early.device) == (3, 0, "cpu")
    assert [p.cmd[-3] for p in stand_ins] == ["cpu"] * 3 and all(
        p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2" for p in stand_ins
    )
    early.stop()
    early = start_early(["--devices", "2", "--out", str(tmp_path / "m"), "--device", "mps"], env=env)
    assert early is not None and (early.gpus, early.device) == (0, "mps") and stand_ins[-1].cmd[-3] == "mps"
    early.stop()
    early = start_early(
        ["--devices", "2", "--out", str(tmp_path / "g"), "--device", "cuda"], env={"CUDA_VISIBLE_DEVICES": "0,1"}
    )
    assert early is not None and early.gpus == 2 and early.device == "cuda"


def test_adopt_early_takes_only_the_shards_fan_out_would_launch(stand_ins, tmp_path: Path, capsys) -> None:
    assert adopt_early(2, tmp_path / "o", 0, "cpu") is None  # nothing started early
    out = tmp_path / "o"
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    argv = ["--devices", "2", "--out", str(out), "--benchmark", "a,b"]
    for n, folder, gpus, device, benchmarks in [
        (2, out, 1, None, ["a", "b"]),  # other GPUs
        (2, out, 2, "cuda", ["a", "b"]),  # another device
        (2, out, 2, None, ["b", "a"]),  # other benchmarks, or another order
        (2, out, 2, None, []),
        (3, out, 2, None, ["a", "b"]),
        (2, tmp_path / "p", 2, None, ["a", "b"]),
    ]:
        early = start_early(argv, env=env)
        assert adopt_early(n, folder, gpus, device, benchmarks) is None and shard_launch._EARLY == []
        assert all(p.returncode == -signal.SIGTERM for p in early.procs) and all(log.closed for log in early.logs)
        assert not early.adopted
    assert capsys.readouterr().err == ""
    early = start_early(argv, env=env)
    assert adopt_early(2, out / ".." / "o", 2, None, ("a", "b")) is early
    assert early.adopted and shard_launch._EARLY == [] and all(p.returncode is None for p in early.procs)
    assert capsys.readouterr().err == "".join(line + "\n" for line in early.lines) and len(early.lines) == 2
    early.stop()


def test_finish_early_stops_what_nobody_adopted_and_says_so(stand_ins, tmp_path: Path, capsys) -> None:
    finish_early()  # nothing started: nothing said
    assert capsys.readouterr().err == ""
    early = start_early(["--devices", "2", "--out", str(tmp_path / "o"), "--device", "cpu"], env={})
    finish_early()
    assert shard_launch._EARLY == [] and all(p.returncode == -signal.SIGTERM for p in early.procs)
    assert (
        capsys.readouterr().err
        == f"eval: stopped the shards started early in {tmp_path / 'o'}: the command did not run\n"
    )
    kept = EarlyShards(n=2, out_dir=tmp_path / "k", gpus=0, device="cpu", adopted=True)
    kept.procs = [StandInProcess(["k"])]
    left = EarlyShards(n=2, out_dir=tmp_path / "l", gpus=0, device="cpu")
    left.procs = [StandInProcess(["l"])]
    shard_launch._EARLY[:] = [kept, left]
    finish_early()
    assert (
        shard_launch._EARLY == [] and kept.procs[0].returncode is None and left.procs[0].returncode == -signal.SIGTERM
    )
    assert (
        capsys.readouterr().err
        == f"eval: stopped the shards started early in {tmp_path / 'l'}: the command did not run\n"
    )


def _sleeper(ignore_term: bool = False) -> subprocess.Popen:
    code = (
        "import signal, time\nif IGNORE: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code.replace("IGNORE", str(ignore_term))], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_stop_processes_terminates_the_running_and_kills_what_ignores_it() -> None:
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    done.wait(timeout=60)
    running, stubborn = _sleeper(), _sleeper(ignore_term=True)
    t0 = time.perf_counter()
    stop_processes([done, running, stubborn], timeout=1.0)
    assert done.returncode == 3 and running.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL
    assert 1.0 <= time.perf_counter() - t0 < 10
    for p in (running, stubborn):
        p.stdout.close()


def test_stop_processes_waits_for_a_terminated_process_by_default() -> None:
    proc = _sleeper()
    stop_processes([proc])
    assert proc.returncode == -signal.SIGTERM
    proc.stdout.close()
