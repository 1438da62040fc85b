"""eval --devices N starts its shards from the raw command line before the launcher's own imports and checks
(:mod:`eval_suite.evaluate.shard_launch`): which command lines qualify, what each shard is given, and that shards of a
command whose arguments are then refused, or that ``fan_out`` would launch differently, are stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import cli
from eval_suite.evaluate import shard_launch


@pytest.fixture
def fake_spawn(monkeypatch):
    """spawn_shards replaced by long sleeps that record what each shard would have been given."""
    calls: list[dict] = []

    def spawn(n, out_dir, args, gpus, device, env, benchmarks=()):
        procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(n)]
        calls.append(
            {
                "n": n,
                "out_dir": out_dir,
                "args": list(args),
                "gpus": gpus,
                "device": device,
                "procs": procs,
                "benchmarks": list(benchmarks),
            }
        )
        return procs, [open(Path(out_dir).parent / f"log_{len(calls)}_{i}", "w") for i in range(n)], []  # noqa: SIM115

    monkeypatch.setattr(shard_launch, "spawn_shards", spawn)
    monkeypatch.setattr(shard_launch, "_EARLY", [])
    return calls


@pytest.mark.parametrize(
    "argv",
    [
        ["--benchmark", "hotpotqa", "--devices", "1", "--out", "o"],  # one device: no shards
        ["--benchmark", "hotpotqa", "--devices", "2"],  # no --out: the usual path refuses it
        ["--devices", "2", "--out", "o", "--shard", "0/2"],  # a shard itself
        ["--devices", "2", "--out", "o", "--merge", "a", "b"],
        ["--config", "c.yaml", "--devices", "2", "--out", "o"],  # --devices may come from the file: the usual path
        ["--devices=2", "--out", "o", "--help"],
        ["--devices", "two", "--out", "o"],  # not a number: the usual path says so
        ["--devices", "3", "--out", "o", "--device", "cuda"],  # 2 GPUs visible below: fewer than asked
        ["--out", "o", "--devices"],  # an option without its value
        ["--devices", "2", "--out", "o", "--device", "cuda", "NO GPU SEEN"],  # torch may see GPUs that /proc does not
        ["--devices", "2", "--out", "o", "NO GPU SEEN"],  # the default device: the same
    ],
)
def test_what_is_not_a_plain_devices_run_is_left_to_the_usual_path(argv, fake_spawn, tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "" if "NO GPU SEEN" in argv else "0,1"}
    argv = [str(tmp_path / a) if a == "o" else a for a in argv if a != "NO GPU SEEN"]
    assert shard_launch.start_early(argv, env=env) is None
    assert fake_spawn == [] and shard_launch._EARLY == []


def test_each_shard_gets_the_command_without_the_launchers_options(fake_spawn, tmp_path):
    argv = ["--benchmark", "hotpotqa", f"--out={tmp_path / 'o'}", "--devices", "2", "--limit", "4", "--quiet", "false",
            "--device", "cpu", "--scheme", "all"]  # fmt: skip
    early = shard_launch.start_early(argv, env={})
    try:
        assert early is not None and early.n == 2 and early.device == "cpu" and early.gpus == 0
        assert fake_spawn[0]["args"] == ["--benchmark", "hotpotqa", "--limit", "4", "--scheme", "all"]
        assert early.out_dir == tmp_path / "o" and shard_launch._EARLY == [early]
        # GPUs as CUDA_VISIBLE_DEVICES lists them; the default device counts them too
        assert shard_launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5,"}) == 2
        assert shard_launch.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    finally:
        shard_launch.finish_early()
    assert all(p.returncode is not None for p in early.procs)  # not adopted: stopped


def test_fan_out_adopts_only_the_shards_it_would_launch(fake_spawn, tmp_path):
    early = shard_launch.start_early(["--devices", "2", "--out", str(tmp_path / "o"), "--device", "cpu"], env={})
    assert shard_launch.adopt_early(2, tmp_path / "elsewhere", 0, "cpu") is None  # another folder: stopped
    assert all(p.returncode is not None for p in early.procs) and shard_launch._EARLY == []
    early = shard_launch.start_early(["--devices", "2", "--out", str(tmp_path / "o"), "--device", "cpu"], env={})
    assert shard_launch.adopt_early(4, tmp_path / "o", 0, "cpu") is None  # another count
    early = shard_launch.start_early(["--devices", "2", "--out", str(tmp_path / "o"), "--device", "cpu"], env={})
    got = shard_launch.adopt_early(2, tmp_path / "o" / ".." / "o", 0, "cpu")  # the same folder, spelled otherwise
    assert got is early and early.adopted and all(p.poll() is None for p in early.procs)
    shard_launch.finish_early()  # adopted: left to fan_out
    assert all(p.poll() is None for p in early.procs)
    early.stop()


def test_a_refused_command_stops_its_early_shards_and_says_so_in_one_line(fake_spawn, tmp_path, capsys):
    out = str(tmp_path / "o")
    code = cli.main(["eval", "--benchmark", "nosuch", "--devices", "2", "--out", out, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "nosuch" in err and "Traceback" not in err
    assert "stopped the shards started early" in err
    assert len(fake_spawn) == 1 and shard_launch._EARLY == []
    assert all(p.returncode is not None for p in fake_spawn[0]["procs"])  # none left running


def test_a_console_eval_exits_with_its_status(tmp_path):
    """The console entry ends an eval with os._exit after its exit handlers: the status still says what happened."""
    bad = subprocess.run([sys.executable, "-m", "lragent.cli_main", "eval", "--benchmark", "nosuch", "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "error:" in bad.stderr and "nosuch" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_profiled_console_eval_still_writes_its_profile(tmp_path):
    """Under ``python -m cProfile`` (or a tracer, a debugger, coverage) the console eval ends the usual way, so the
    profiler can write its results after the program returns."""
    prof = tmp_path / "eval.prof"
    run = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "lragent.cli_main", "eval",
                          "--benchmark", "nosuch", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "unknown benchmark 'nosuch'" in run.stderr
    assert prof.is_file() and prof.stat().st_size > 0


def test_the_launchers_bar_counts_finished_lines_of_every_shard_log(tmp_path):
    """The progress of eval --devices N: whole lines of every shard's episode log, read as they grow; a line still
    being written counts once it ends; a log not yet created counts nothing; the bar never passes its total."""
    from eval_suite.evaluate.run_eval import _ShardProgress

    logs = [tmp_path / "s0.jsonl", tmp_path / "s1.jsonl"]
    logs[0].write_text('{"a": 1}\n{"a": 2}\n')  # resumed: two finished before
    bar = _ShardProgress(logs, total=5, desc="eval", enabled=True)
    assert bar.done == 2 and bar.bar.n == 2
    with logs[1].open("a") as f:
        f.write('{"b": 1}\n{"b": ')
    bar.update()
    assert bar.done == 3
    with logs[1].open("a") as f:
        f.write("2}\n")
    with logs[0].open("a") as f:
        f.write('{"a": 3}\n{"a": 4}\n')
    bar.update()
    assert bar.done == 6 and bar.bar.n == 5  # past the total (a duplicate line): the bar stops at it
    bar.close()


@pytest.mark.parametrize("status", [2, 1])  # a refusal in one line; an uncaught exception
def test_a_failed_shard_stops_the_others_and_is_named_by_its_error(status, tmp_path, monkeypatch, capsys):
    """eval --devices N: when one shard fails, whatever its exit status, the merge cannot run, so the launcher stops
    the others at once (their finished episodes stay in their logs) and names the failure by the last line of the
    shard's log."""
    import inspect
    import time

    from eval_suite.evaluate import run_eval

    started: list[subprocess.Popen] = []

    def spawn(n, out_dir, args, gpus, device, env, benchmarks=()):
        out_dir.mkdir(parents=True, exist_ok=True)
        logs = [open(out_dir / f"shard_{i}.log", "w") for i in range(n)]  # noqa: SIM115
        fail = f"import sys, time; time.sleep(0.5); print('error: out of memory on the GPU'); sys.exit({status})"
        codes = [fail] + ["import time; time.sleep(120)"] * (n - 1)
        started.extend(subprocess.Popen([sys.executable, "-c", c], stdout=logs[i]) for i, c in enumerate(codes))
        return list(started), logs, []

    real_sleep, polls = run_eval.time.sleep, []

    def poll_wait(seconds):  # the failure ends after 0.5 s: a launcher still polling after 10 s did not stop the rest
        polls.append(seconds)
        if len(polls) > 100:
            for proc in started:
                proc.kill()
            raise AssertionError("fan_out kept waiting for the shards it should have stopped")
        real_sleep(seconds)

    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    monkeypatch.setattr(run_eval.time, "sleep", poll_wait)
    call = {k: p.default for k, p in inspect.signature(run_eval.evaluate).parameters.items()}
    call.update(device="cpu", quiet=True, out=str(tmp_path / "o"))
    t0 = time.perf_counter()
    assert run_eval.fan_out(call, 3, tmp_path / "o", total=6) == 1
    assert time.perf_counter() - t0 < 60  # not the sleepers' 120 s
    assert all(p.returncode is not None for p in started)
    err = capsys.readouterr().err
    assert "error: shard 0/3 failed: error: out of memory on the GPU (log: " in err
    assert "stopped shard(s) [1, 2]: rerun the same command to resume" in err
    assert "shard 1/3 failed" not in err  # the stopped ones are not reported as failures


def test_ctrl_c_in_the_launcher_stops_every_shard_and_says_where_the_episodes_are(tmp_path, monkeypatch):
    """Ctrl-C while eval --devices N waits: every shard is stopped (none left running on its GPU) and the interrupt
    note names where the finished episodes are, not "nothing was saved"."""
    import inspect
    import time

    from eval_suite.evaluate import run_eval
    from lragent import command

    started: list[subprocess.Popen] = []

    def spawn(n, out_dir, args, gpus, device, env, benchmarks=()):
        out_dir.mkdir(parents=True, exist_ok=True)
        logs = [open(out_dir / f"shard_{i}.log", "w") for i in range(n)]  # noqa: SIM115
        started.extend(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(n))
        return list(started), logs, []

    real_sleep, pressed = time.sleep, []

    def ctrl_c(seconds):  # the launcher's first wait is interrupted; later waits (the shards' shutdown) are real
        if not pressed:
            pressed.append(True)
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    monkeypatch.setattr(run_eval.time, "sleep", ctrl_c)
    call = {k: p.default for k, p in inspect.signature(run_eval.evaluate).parameters.items()}
    call.update(device="cpu", quiet=True, out=str(tmp_path / "o"))
    with pytest.raises(KeyboardInterrupt):
        run_eval.fan_out(call, 2, tmp_path / "o", total=4)
    assert len(started) == 2 and all(p.returncode is not None for p in started)
    assert command._INTERRUPT_NOTE and "shard_*/episodes.jsonl; rerun the same command" in command._INTERRUPT_NOTE[0]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--devices", "3"], "--devices 3: 2 question(s) to split over 3 shards"),
        (["--shard", "2/3"], "--shard 2/3: 2 question(s) to split over 3 shards"),
    ],
)
def test_more_shards_than_questions_is_refused_in_one_line(option, message, fake_spawn, tmp_path, capsys):
    """A shard without a question could never write its summary (and the merge would never run): refused before
    anything loads, naming the count and what is allowed; early shards are stopped."""
    code = cli.main(["eval", "--benchmark", "hotpotqa", "--limit", "2", "--adapter_init", "random", "--device", "cpu",
                     "--out", str(tmp_path / "o"), *option])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and message in err and "allowed at most 2 shards" in err and "Traceback" not in err
    assert all(p.returncode is not None for call in fake_spawn for p in call["procs"])


def test_the_console_entry_starts_without_torch():
    """The shards of eval --devices N start before the launcher imports torch: the entry point and the shard launcher
    import no torch (lragent's package names load on first use), and those names still resolve."""
    code = ("import sys; import lragent.cli_main, eval_suite.evaluate.shard_launch; print('torch' in sys.modules); "
            "import lragent; print(lragent.Scheme.BASE_LR_SHARED.value, lragent.RoleRouter.__name__)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "base_lr_shared", "RoleRouter"]


def test_an_eval_process_imports_the_summary_metrics_only_to_write_a_summary():
    """What runs and scores episodes (the eval command's module, the benchmarks' per-answer scores) imports no
    torchmetrics: a shard of eval --devices N never writes a summary, so it never pays for torchmetrics and what it
    pulls in (pandas, matplotlib, scipy.signal and, where installed, torchvision: 649 modules on the 2-core CPU machine,
    whose import of eval_suite.evaluate.run_eval went from 5.0 to 4.1 s); the summary still gets the metrics when
    written."""
    code = (
        "import sys; import eval_suite.evaluate.run_eval, eval_suite.evaluate.benchmarks; "
        "print('torchmetrics' in sys.modules); "
        "from eval_suite.evaluate.eval_report import write_summary; print('torchmetrics' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_more_shards_than_the_gpus_is_refused_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    """``eval --devices 3`` on a machine with 2 GPUs (as torch reports them) is one ``error:`` line naming both
    counts, exit 2, before any shard starts or any folder is made."""
    import torch

    from lragent.cli_main import main  # the command itself, without the console entry's early shard start

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    from eval_suite.evaluate import run_eval

    def spawned(*args, **kwargs):  # were the check let through, no shard must start (it would run the whole eval)
        raise AssertionError("shards started")

    monkeypatch.setattr(run_eval, "spawn_shards", spawned)
    capsys.readouterr()
    assert main(["eval", "--devices", "3", "--adapter_init", "zero", "--out", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["error: --devices 3 but this machine has 2 GPU(s): allowed at most 2"], lines
    assert not (tmp_path / "o").exists()
