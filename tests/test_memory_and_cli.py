"""Cache-memory ratios on the session job's schedule, and the `cli.py session` job end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_multi_lora

from eval_suite.evaluate.session_runner import _load_question, build_schedule
from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tokenizer(load_embedded):
    return load_embedded()[1]


def test_memory_ratios_on_roles_schedule(tokenizer):
    """3 roles, the `roles` schedule (~1.3k tokens of a real HotpotQA question), SmolLM2's layer shapes."""
    model = tiny_multi_lora("smollm2-135m", rank=8, b_std=0.02, overrides={"num_hidden_layers": 2})
    peak = {}
    for scheme in SCHEMES:
        s = MultiAgentSession(model, scheme, tokenizer=tokenizer, eos_token_ids=[])
        for role, text in build_schedule("roles", _load_question(0)):
            s.append_text(text)
            s.step(role, max_new_tokens=3)
        peak[scheme] = s.peak_cache_bytes
    full = peak["full_shared"]
    ratios = {k: v / full for k, v in peak.items()}
    print("peak cache bytes / full_shared:", {k: round(v, 4) for k, v in ratios.items()})
    assert abs(ratios["non_shared"] - 3) <= 0.05 * 3
    assert ratios["base_lr_shared"] <= 1.05
    assert ratios["base_shared"] <= 1.10


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python cli.py ARGS`` in a fresh process (tests that pin what a real process does: its exit status, a run)."""
    return subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _cli_here(*args: str, timeout: int | None = None) -> subprocess.CompletedProcess:
    """``cli.py``'s ``main(ARGS)`` in this process, stdout and stderr captured, an escaping exception printed as the
    traceback a process would print (exit 1): the same code path as ``python cli.py ARGS`` without a Python start-up
    per case (~7 s of CPU each, most of the suite's time when every bad input started one). ``timeout`` is unused."""
    import contextlib
    import io
    import os
    import traceback

    import cli

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--scheme", "shared"], "unknown scheme 'shared': allowed non_shared, full_shared, droidspeak, base_shared"),
        (["--adapters", "/no/such/dir"], "--adapters '/no/such/dir': no such directory"),
        (["--rank", "0"], "--rank must be a positive integer, got 0"),
        (["--rank", "-2"], "--rank must be a positive integer, got -2"),
        (["--schedule", "long"], "unknown schedule 'long': allowed agent, short, roles"),
        (["--adapter_init", "ones"], "--adapter_init 'ones' not supported: allowed zero, random"),
    ],
)
def test_session_cli_bad_input(args, needle, tmp_path):
    proc = _cli_here("session", *args, "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_unknown_command():
    proc = _cli_here("train")
    assert proc.returncode == 2 and "unknown command 'train'" in proc.stderr


@pytest.mark.model
def test_session_cli_writes_result(tmp_path):
    out = tmp_path / "r.json"
    proc = _cli(
        "session",
        "--scheme",
        "base_lr_shared",
        "--adapter_init",
        "random",
        "--seed",
        "0",
        "--schedule",
        "short",
        "--max_new_tokens",
        "4",
        "--quiet",
        "true",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["scheme"] == "base_lr_shared"
    assert [s["role"] for s in result["steps"]] == ["plan", "action", "reflect"]
    for step in result["steps"]:
        assert set(step) >= {"role", "prefill_tokens", "generated_ids", "prefill_s", "decode_s"}
        assert 1 <= len(step["generated_ids"]) <= 4 and step["prefill_s"] > 0
    assert set(result["cache_bytes"]) == {"k", "v_base", "v_lr"}
    assert result["peak_cache_bytes"] >= sum(result["cache_bytes"].values())


def test_console_command_is_installed_and_is_cli_py():
    """`lragent` (the installed console command) and `python cli.py` are the same entry point."""
    import shutil

    exe = shutil.which("lragent")
    assert exe, "the lragent console command is not installed (pip install -e .)"
    a = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    b = _cli("--help")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and "commands: fit, validate, test" in a.stdout
    bad = subprocess.run([exe, "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: unknown command 'nope'")


@pytest.mark.parametrize(
    "command",
    [
        ["session", "--scheme", "base_lr_shared", "--adapter_init", "random"],
        ["fidelity", "--adapter_init", "random"],
        ["droidspeak-select", "--adapter_init", "random"],
    ],
)
def test_unwritable_out_is_refused_before_any_work(tmp_path, command):
    """An --out that cannot be written is a one-line error, exit 2, before the model is loaded (the run does not
    spend minutes and then lose its result)."""
    import time

    blocker = tmp_path / "file"  # a path under a regular file can never be created (read-only dirs do not stop root)
    blocker.write_text("x")
    out = blocker / "sub" / "out.json"
    t0 = time.time()
    r = _cli_here(*command, "--out", str(out), timeout=120)
    assert r.returncode == 2, r.stderr[-500:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out ") and "cannot be written" in lines[0], lines
    assert "Loading weights" not in r.stderr and time.time() - t0 < 60
    assert not (tmp_path / "file" / "sub").exists()


def _damaged_adapters(tmp_path, kind: str):
    """A copy of a shipped adapter set, damaged: ``truncated`` weights files, or ``rank`` (PEFT config r=8, tensors
    of rank 4, no native checkpoint); the ``peft-*`` kinds drop the native checkpoint and damage the PEFT role
    directories: ``peft-no-r`` (plan's adapter_config.json lacks ``r``), ``peft-list`` (every adapter_config.json is
    a JSON list), ``peft-truncated`` (every adapter_model.safetensors cut in half), ``peft-no-reflect`` (no reflect
    directory)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / kind
    shutil.copytree(ROOT / "data" / "adapters" / "hotpotqa_sharedA", d)
    roles = ("plan", "action", "reflect")
    if kind == "truncated":
        for f in d.rglob("*.safetensors"):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return d
    if kind == "rank":
        for role in roles:
            f = d / role / "adapter_model.safetensors"
            w = load_file(str(f))
            save_file({k: (v[:4] if "lora_A" in k else v[:, :4]).contiguous() for k, v in w.items()}, str(f))
    elif kind == "peft-no-r":
        cfg = json.loads((d / "plan" / "adapter_config.json").read_text())
        del cfg["r"]
        (d / "plan" / "adapter_config.json").write_text(json.dumps(cfg))
    elif kind == "peft-list":
        for role in roles:
            (d / role / "adapter_config.json").write_text("[1, 2]")
    elif kind == "peft-truncated":
        for role in roles:
            f = d / role / "adapter_model.safetensors"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "peft-no-reflect":
        shutil.rmtree(d / "reflect")
    else:
        raise AssertionError(kind)
    return d


def _adapter_case(tmp_path, kind: str, cmd: str) -> tuple[list[str], str]:
    d = _damaged_adapters(tmp_path, kind)
    if cmd == "session":
        out = str(tmp_path / "r.json")
        return ["session", "--scheme", "base_lr_shared", "--adapters", str(d), "--out", out], str(d)
    return ["eval", "--adapters", str(d), "--limit", "1", "--out", str(tmp_path / "out")], str(d)


def _bad_input_case(tmp_path, case: str) -> tuple[list[str], str]:
    """The command line of a bad-input case and a string its one error line must contain."""
    out = tmp_path / "out"
    kind, _, cmd = case.partition(":")
    if kind in ("truncated", "rank", "peft-no-r", "peft-list", "peft-truncated"):
        return _adapter_case(tmp_path, kind, cmd)
    if kind == "peft-no-reflect":
        args, _ = _adapter_case(tmp_path, kind, cmd)
        return args, "'reflect'"
    if kind == "missing-model":
        missing = str(tmp_path / "no" / "such" / "dir")
        return [cmd, "--model", missing, "--adapter_init", "zero", "--out", str(out)], "does not exist"
    if kind == "out-is-file":
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        extra = ["--adapter_init", "zero", "--limit", "1"] if cmd == "eval" else []
        return [cmd, *extra, "--out", str(blocker)], str(blocker)
    if case == "bogus-device":
        return ["session", "--adapter_init", "random", "--device", "bogus", "--out", str(out / "r.json")], "'bogus'"
    if case == "mps-device":
        return ["session", "--adapter_init", "random", "--device", "mps", "--out", str(out / "r.json")], "'mps'"
    if case == "answer-text-hotpotqa":  # option texts to score: ScienceQA only
        return ["eval", "--benchmark", "hotpotqa", "--constrain", "answer_text", "--adapter_init", "zero",
                "--limit", "1", "--out", str(out)], "'answer_text'"  # fmt: skip
    if case == "zero-new-tokens":
        return ["session", "--adapter_init", "random", "--max_new_tokens", "0", "--out", str(out / "r.json")], "got 0"
    assert case == "not-a-checkpoint", case
    ckpt = tmp_path / "x.ckpt"
    ckpt.write_text("not a checkpoint")
    return ["export", "--ckpt", str(ckpt), "--out", str(out)], "is not a Lightning checkpoint"


BAD_INPUT_CASES = [  # kind:command
    "truncated:session", "truncated:eval", "rank:session", "missing-model:eval", "missing-model:fidelity",
    "bogus-device", "not-a-checkpoint",
    # seven tracebacks and two wrong acceptances, each now one line
    "out-is-file:eval", "out-is-file:data-stats", "peft-no-r:eval", "peft-no-r:session", "peft-list:eval",
    "peft-list:session", "peft-truncated:eval", "mps-device", "peft-no-reflect:eval", "zero-new-tokens",
    "answer-text-hotpotqa",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input_table_one_line_exit_2(tmp_path, case):
    """Inputs a new user gave that once ended in tracebacks or ran on regardless: one stderr line naming the bad
    value, exit 2, before the model is loaded."""
    args, want = _bad_input_case(tmp_path, case)
    r = _cli_here(*args, timeout=180)
    errors = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:") or "Traceback" in ln]
    assert r.returncode == 2, r.stderr[-800:]
    assert len(errors) == 1 and errors[0].startswith("error:") and want in errors[0], r.stderr[-800:]
    assert "Traceback" not in r.stderr
    assert "Loading weights" not in r.stderr, "the error came after the model was loaded"


@pytest.mark.parametrize(
    "command",
    [
        ["session", "--adapter_init", "random", "--schedule", "short", "--max_new_tokens", "2"],
        ["fidelity", "--adapter_init", "random", "--limit", "1"],
        ["droidspeak-select", "--adapter_init", "random", "--limit", "1"],
        ["export", "--ckpt", "some.ckpt", "--out", "adapters_out"],
    ],
)
def test_commands_print_a_config_that_round_trips(tmp_path, command):
    """--print_config of session/fidelity/droidspeak-select/export prints every option; --config with that file
    gives the same options (and the command line still overrides it); a bad key is one line, exit 2."""
    import yaml

    first = _cli_here(*command, "--print_config", timeout=120)
    assert first.returncode == 0, first.stderr[-500:]
    values = yaml.safe_load(first.stdout)
    assert values["out"] and all(k not in values for k in ("config", "print_config", "help"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(first.stdout)
    again = _cli_here(command[0], "--config", str(cfg), "--print_config", timeout=120)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr[-500:]
    override = yaml.safe_load(
        _cli_here(command[0], "--config", str(cfg), "--out", "elsewhere", "--print_config").stdout
    )
    assert override == {**values, "out": "elsewhere"}
    cfg.write_text(first.stdout + "no_such_option: 1\n")
    bad = _cli_here(command[0], "--config", str(cfg), timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no_such_option" in bad.stderr


@pytest.mark.model
def test_session_runs_unchanged_from_its_printed_config(tmp_path):
    out = tmp_path / "r.json"
    args = ["session", "--adapter_init", "random", "--schedule", "short", "--max_new_tokens", "2", "--out", str(out)]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(_cli_here(*args, "--print_config").stdout)
    r = _cli_here("session", "--config", str(cfg))  # in this process: the config's round trip needs no start-up
    assert r.returncode == 0, r.stderr[-800:]
    import json

    result = json.loads(out.read_text())
    assert result["scheme"] == "base_lr_shared" and result["steps"]


def test_help_is_about_lragent_and_bench_has_help(capsys):
    """`lragent --help` shows the commands as the user types them (no `python cli.py`, no notes on the code);
    `lragent bench --help` prints help, exit 0."""
    from lragent.cli_main import BENCHES, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "lragent COMMAND" in out and "python cli.py" not in out and "only wires" not in out
    for flag in ("--help", "-h"):
        assert main(["bench", flag]) == 0
        out = capsys.readouterr().out
        assert all(name in out for name in BENCHES) and "usage:" in out
    assert main(["bench"]) == 2 and "error: bench needs one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--scheme", "base_lr_shared", "--independent_a"],
            "--scheme base_lr_shared needs shared A: drop --independent_a or use base_shared",
        ),
        (["--question", "100000"], "--question 100000 out of range: allowed 0.."),
        (["--question", "-1"], "--question -1 out of range: allowed 0.."),
    ],
)
def test_session_cli_refuses_a_scheme_its_adapters_cannot_serve_and_a_question_past_the_file(args, needle, tmp_path):
    proc = _cli_here("session", *args, "--out", str(tmp_path / "r.json"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_an_unknown_schedule_is_named():
    roles = [role for role, _ in build_schedule("roles", _load_question(0))]
    assert roles == ["plan", "action", "reflect"] * 2
    with pytest.raises(ValueError, match="unknown schedule 'long': allowed agent, short, roles"):
        build_schedule("long", _load_question(0))
