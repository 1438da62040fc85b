"""``lragent``'s dispatch (lragent/cli_main.py), in this process: the program name, help, routing, refusals, the
missing-module line and the console's early exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import eval_suite.evaluate.run_eval  # noqa: F401  (imported here, not inside a test's timing: the eval command's)
import lit_modules.cli  # noqa: F401  (the Lightning commands')
from lragent import cli_main
from lragent.cli_main import _call, _exit_now, _observed, _prog, main

ALLOWED = (
    "fit, validate, test, session, export, eval, fidelity, similarity, droidspeak-select, data-stats, zero-shot, "
    "serve, bench"
)


@pytest.mark.parametrize(
    "argv0, prog",
    [("/usr/local/bin/lragent", "lragent"), ("lragent", "lragent"), ("cli.py", "cli.py"), ("lragentx", "cli.py"),
     ("", "cli.py")],
)  # fmt: skip
def test_prog_is_what_the_user_typed(monkeypatch, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0, "eval"])
    assert _prog() == prog


def test_prog_without_argv_is_cli_py(monkeypatch):
    monkeypatch.setattr(sys, "argv", [])
    assert _prog() == "cli.py"


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"], ["--help", "eval"]])
def test_help_prints_the_usage_and_every_command(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out == cli_main.USAGE + "\n" + f"commands: {ALLOWED}\n"


def test_argv_none_reads_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lragent", "--help"])
    assert main() == 0
    assert capsys.readouterr().out.endswith(f"commands: {ALLOWED}\n")
    monkeypatch.setattr(sys, "argv", ["lragent", "nope"])
    assert main() == 2
    assert capsys.readouterr().err == f"error: unknown command 'nope': allowed {ALLOWED}\n"


def test_a_given_argv_wins_over_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lragent", "--help"])
    assert main(["nope"]) == 2
    assert capsys.readouterr().err == f"error: unknown command 'nope': allowed {ALLOWED}\n"


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_bench_help_lists_the_benches(capsys, flag):
    assert main(["bench", flag, "ignored"]) == 0
    assert capsys.readouterr().out == (
        "usage: cli.py bench {kernel,decode,trace,train,serve,eval} [options]    (cli.py bench NAME --help for its "
        "options)\nbenches: kernel, decode, trace, train, serve, eval\n"
    )


def test_bench_help_names_the_console_command(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lragent"])
    assert main(["bench", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: lragent bench {kernel,")


@pytest.mark.parametrize(
    "rest, got", [([], "nothing"), (["nope"], "'nope'"), (["Kernel"], "'Kernel'"), (["--kernel"], "'--kernel'")]
)
def test_bench_refuses_a_missing_or_unknown_bench(capsys, rest, got):
    assert main(["bench", *rest]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: bench needs one of kernel, decode, trace, train, serve, eval, got {got}\n"
    assert captured.out == ""


def test_bench_runs_the_named_bench_with_the_rest_of_the_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "kernel", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cli.py bench kernel ")
    # the bench's own options, not those of bench or of another bench
    assert main(["bench", "kernel", "--no_such_option", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no_such_option" in err and err.count("\n") == 1


@pytest.mark.parametrize("cmd", ["nope", "Eval", "benchx", "-x"])
def test_unknown_command_is_one_error_line(capsys, cmd):
    assert main([cmd, "--help"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: unknown command {cmd!r}: allowed {ALLOWED}\n" and captured.out == ""


def test_a_command_gets_its_prog_and_its_options(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["serve", "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: cli.py serve ")
    assert main(["serve", "--no_such_option", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no_such_option" in err and err.count("\n") == 1


@pytest.fixture
def tmp_modules(tmp_path, monkeypatch):
    (tmp_path / "lragent_cli_probe.py").write_text(
        textwrap.dedent(
            '''
            def probe(n: int = 1, word: str = "a") -> int:
                """A probe command.

                Args:
                    n: the status to return.
                    word: printed.
                """
                print(f"probe {word}")
                return n
            '''
        )
    )
    (tmp_path / "lragent_cli_broken.py").write_text("import lragent_no_such_dependency_xyz\n")
    (tmp_path / "lragent_cli_raises.py").write_text("raise ModuleNotFoundError('no name given')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("lragent_cli_probe", "lragent_cli_broken", "lragent_cli_raises"):
        sys.modules.pop(name, None)


def test_call_runs_the_function_as_a_command(tmp_modules, capsys):
    assert _call(("lragent_cli_probe", "probe"), ["--n", "7", "--word", "hi"], "cli.py probe") == 7
    assert capsys.readouterr().out == "probe hi\n"
    assert _call(("lragent_cli_probe", "probe"), [], "cli.py probe") == 1
    assert capsys.readouterr().out == "probe a\n"
    with pytest.raises(SystemExit):
        _call(("lragent_cli_probe", "probe"), ["--help"], "my-prog probe")
    assert capsys.readouterr().out.startswith("usage: my-prog probe ")


@pytest.mark.parametrize("module", ["lragent_no_such_module", "lragent.no_such_submodule", "eval_suite.nothing.here"])
def test_a_command_whose_module_is_missing_is_one_line(tmp_modules, capsys, module):
    assert _call((module, "f"), ["--x"], "cli.py x") == 2
    assert capsys.readouterr().err == f"error: this checkout has no {module} yet\n"


def test_a_missing_dependency_of_the_module_is_raised(tmp_modules):
    with pytest.raises(ModuleNotFoundError) as err:
        _call(("lragent_cli_broken", "f"), [], "cli.py x")
    assert err.value.name == "lragent_no_such_dependency_xyz"
    with pytest.raises(ModuleNotFoundError, match="no name given"):
        _call(("lragent_cli_raises", "f"), [], "cli.py x")


def test_observed_sees_a_profiler_and_a_tracer():
    old_profile, old_trace = sys.getprofile(), sys.gettrace()
    base = _observed()
    try:
        sys.setprofile(lambda *a: None)
        assert _observed() is True
        sys.setprofile(old_profile)
        sys.settrace(lambda *a: None)
        assert _observed() is True
    finally:
        sys.setprofile(old_profile)
        sys.settrace(old_trace)
    assert _observed() is base


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python 3.12+")
def test_observed_sees_a_monitoring_tool():  # pragma: no cover (3.12+)
    tool = next(i for i in range(6) if sys.monitoring.get_tool(i) is None)
    sys.monitoring.use_tool_id(tool, "probe")
    try:
        assert _observed() is True
    finally:
        sys.monitoring.free_tool_id(tool)


def test_exit_now_returns_under_a_profiler_and_ends_the_process_otherwise(tmp_path):
    old = sys.getprofile()
    sys.setprofile(lambda *a: None)
    try:
        assert _exit_now(3) is None  # under a profiler: returns, the process goes on
    finally:
        sys.setprofile(old)
    script = (
        "import atexit, sys\n"
        "from lragent.cli_main import _exit_now\n"
        "atexit.register(lambda: print('handler ran', flush=False))\n"
        "print('out', end='')\n"
        "sys.stderr.write('err')\n"
        "_exit_now(5)\n"
        "print('after')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5
    assert proc.stdout == "outhandler ran\n" and proc.stderr == "err"


def test_eval_returns_its_status_and_ends_the_process_only_from_the_console(monkeypatch, capsys):
    ended = []  # os._exit cannot run inside the tests: record the status the process would end with
    monkeypatch.setattr(cli_main, "_exit_now", ended.append)
    assert main(["eval", "--no_such_option", "1"]) == 2
    assert ended == []
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no_such_option" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert capsys.readouterr().out.startswith("usage: cli.py eval ")
    monkeypatch.setattr(sys, "argv", ["lragent", "eval", "--no_such_option", "1"])
    assert main() == 2
    assert ended == [2]


@pytest.mark.parametrize("cmd", ["fit", "validate", "test"])
def test_lightning_commands_go_to_lightning_cli(capsys, cmd):
    with pytest.raises(SystemExit) as stop:
        main([cmd, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and f" {cmd} " in out.splitlines()[0] and "--trainer" in out


def test_a_lightning_command_that_runs_returns_0(monkeypatch, tmp_path, capsys):
    from tests.test_training import write_data

    files = write_data(tmp_path, n=8)
    args = [
        "--model.model_name", "tiny-llama", "--model.tokenizer_name", "byte", "--model.model_overrides",
        "{num_hidden_layers: 1, vocab_size: 258}", "--data.data_files",
        "{" + ", ".join(f"{r}: {p}" for r, p in files.items()) + "}",
        "--data.max_length", "96", "--data.val_fraction", "0.25", "--trainer.logger", "false",
        "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_checkpointing",
        "false", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    assert main(["validate", *args]) == 0
    assert "val/loss" in capsys.readouterr().out  # Lightning's table of the validation it ran
