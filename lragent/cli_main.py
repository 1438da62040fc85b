"""lragent's entry point: the ``lragent`` console command (``python cli.py`` is an alias).

Every command but the Lightning ones is a typed, documented function that :func:`lragent.command.run_command` turns
into a command line; ``fit``/``validate``/``test`` are LightningCLI's. Commands are imported when they are used.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# command -> (module, typed function); lragent.command turns each function into a command line (--help from its
# docstring, --config, --print_config).
COMMANDS: dict[str, tuple[str, str]] = {
    "session": ("eval_suite.evaluate.session_runner", "session"),
    "export": ("lit_modules.cli", "export"),
    "eval": ("eval_suite.evaluate.run_eval", "evaluate"),
    "fidelity": ("eval_suite.diagnostics.fidelity_command", "fidelity"),
    "similarity": ("eval_suite.diagnostics.similarity", "similarity"),
    "droidspeak-select": ("eval_suite.diagnostics.droidspeak_select", "droidspeak_select"),
    "data-stats": ("eval_suite.diagnostics.data_stats", "data_stats"),
    "zero-shot": ("eval_suite.evaluate.zero_shot", "zero_shot"),
    "serve": ("eval_suite.serve.serve_command", "serve"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "kernel": ("eval_suite.bench.kernel", "bench_kernel"),
    "decode": ("eval_suite.bench.decode", "decode"),
    "trace": ("eval_suite.bench.trace", "trace"),
    "train": ("eval_suite.bench.train", "train"),
    "serve": ("eval_suite.serve.bench_serve", "bench_serve"),
    "eval": ("eval_suite.bench.eval_throughput", "bench_eval"),
}
LIGHTNING = ("fit", "validate", "test")


def _prog() -> str:
    """``lragent`` when run as the console command, else ``cli.py``: help and errors name what the user typed."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "lragent" if name == "lragent" else "cli.py"


USAGE = """usage: lragent COMMAND [options]    (lragent COMMAND --help for a command's options)

  fit | validate | test --config configs/NAME.yaml   train / check multi-LoRA role adapters (LightningCLI)
  export --ckpt CKPT --out DIR                       adapters out of a checkpoint (PEFT role dirs + native file)
  session --scheme S --out result.json               one multi-agent schedule under a sharing scheme
  eval --benchmark hotpotqa --scheme all             agent accuracy on HotpotQA / ScienceQA per sharing scheme
  fidelity --benchmark hotpotqa --adapters DIR       KL / top-1 agreement of each scheme against non_shared
  droidspeak-select --benchmark hotpotqa --adapters DIR   which layers DroidSpeak recomputes
  similarity --adapters DIR --benchmark hotpotqa     cache similarity across agents
  bench kernel | decode | trace | train | eval       kernel, decode, trace, training-step and eval-throughput benches
  data-stats --out DIR                               role data token lengths and batches
  zero-shot --benchmark scienceqa --model M          the base model without agents or adapters (reference row)
  serve --scheme base_lr_shared --port 8000          the role adapters behind an OpenAI-compatible server
"""


def _call(target: tuple[str, str], argv: list[str], prog: str) -> int:
    module_name, func = target
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"error: this checkout has no {module_name} yet", file=sys.stderr)
            return 2
        raise
    from lragent.command import run_command

    return run_command(getattr(module, func), argv, prog)


def _observed() -> bool:
    """True under a profiler, tracer or debugger (``python -m cProfile``, pdb, coverage): they write their results
    after the program returns, so the process must end the usual way."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+: cProfile and coverage may use sys.monitoring
    return monitoring is not None and any(monitoring.get_tool(i) is not None for i in range(6))


def _exit_now(code: int) -> None:
    """Ends the process with ``code`` once its exit handlers ran and its output is flushed, without the interpreter's
    teardown of every module and object: after an eval (whose files are all written and closed by then) that teardown
    took 1.2 s of a 12 s CPU eval, paid again by every ``--devices N`` shard. Under a profiler, tracer or debugger it
    returns instead (:func:`_observed`)."""
    import atexit
    import os

    if _observed():
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (0 ok, 2 bad input). From the console (``argv`` None) an ``eval`` ends
    the process itself once done (:func:`_exit_now`)."""
    from_console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = _prog()
    allowed = ", ".join([*LIGHTNING, *COMMANDS, "bench"])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(f"commands: {allowed}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in LIGHTNING:
        from lit_modules.cli import run_lightning_cli

        run_lightning_cli(argv)
        return 0
    if cmd == "eval":  # --devices N: the shards start now, beside this process's imports and argument checks
        from eval_suite.evaluate.shard_launch import finish_early, start_early

        start_early(rest)
        try:
            code = _call(COMMANDS[cmd], rest, f"{prog} {cmd}")
        finally:
            finish_early()
        if from_console:
            _exit_now(code)
        return code
    if cmd in COMMANDS:
        return _call(COMMANDS[cmd], rest, f"{prog} {cmd}")
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(
                f"usage: {prog} bench {{{','.join(BENCHES)}}} [options]    ({prog} bench NAME --help for its options)"
            )
            print(f"benches: {', '.join(BENCHES)}")
            return 0
        if not rest or rest[0] not in BENCHES:
            got = repr(rest[0]) if rest else "nothing"
            print(f"error: bench needs one of {', '.join(BENCHES)}, got {got}", file=sys.stderr)
            return 2
        return _call(BENCHES[rest[0]], rest[1:], f"{prog} bench {rest[0]}")
    print(f"error: unknown command {cmd!r}: allowed {allowed}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
