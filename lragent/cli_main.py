"""lragent's single entry point: the ``lragent`` console command, and ``python cli.py`` (a thin alias).

    python cli.py fit|validate|test --config configs/<name>.yaml   # training (LightningCLI)
    python cli.py export --ckpt CKPT --out DIR                     # adapters out of a checkpoint
    python cli.py session --scheme S --out result.json             # one multi-agent schedule under a scheme
    python cli.py eval --benchmark hotpotqa --scheme all --runs 3         # agents on HotpotQA / ScienceQA
    python cli.py fidelity --benchmark hotpotqa --adapters DIR            # KL / top-1 agreement vs non_shared
    python cli.py droidspeak-select --benchmark hotpotqa --adapters DIR   # DroidSpeak recompute layers
    python cli.py similarity --adapters DIR --benchmark hotpotqa           # cache similarity across agents
    python cli.py bench kernel                                      # Flash-LoRA-Attention micro-benchmark
    python cli.py bench train --model llama-3.1-8b                  # training steps: lragent vs a PEFT loop
    python cli.py data-stats --out DIR                              # role data token lengths and batches

This file only wires: each command lives in its own module and is imported when it is used.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# command -> (module, function). A function named ``main`` takes argv and returns an exit code (older commands);
# any other name is a typed, documented function that lragent.command turns into a command line (--config,
# --print_config, --help from its docstring).
COMMANDS: dict[str, tuple[str, str]] = {
    "session": ("eval_suite.session_runner", "main"),
    "export": ("lit_modules.cli", "export_main"),
    "eval": ("eval_suite.run_eval", "evaluate"),
    "fidelity": ("eval_suite.fidelity", "main"),
    "similarity": ("eval_suite.similarity", "similarity"),
    "droidspeak-select": ("eval_suite.droidspeak_select", "main"),
    "data-stats": ("eval_suite.data_stats", "data_stats"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "kernel": ("kernels.bench", "bench_kernel"),
    "decode": ("eval_suite.bench_decode", "decode"),
    "trace": ("eval_suite.bench_trace", "trace"),
    "train": ("eval_suite.bench_train", "train"),
}
LIGHTNING = ("fit", "validate", "test")


def _prog() -> str:
    """``lragent`` when run as the console command, else ``cli.py``: help and errors name what the user typed."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "lragent" if name == "lragent" else "cli.py"


def _call(target: tuple[str, str], argv: list[str], prog: str = "cli.py") -> int:
    module_name, func = target
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"error: this checkout has no {module_name} yet", file=sys.stderr)
            return 2
        raise
    fn = getattr(module, func)
    if func in ("main", "export_main"):
        return int(fn(argv) or 0)
    from lragent.command import run_command

    return run_command(fn, argv, prog)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = _prog()
    allowed = ", ".join([*LIGHTNING, *COMMANDS, "bench"])
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print(f"commands: {allowed}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in LIGHTNING:
        from lit_modules.cli import run_lightning_cli

        run_lightning_cli(argv)
        return 0
    if cmd in COMMANDS:
        return _call(COMMANDS[cmd], rest, f"{prog} {cmd}")
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            got = rest[0] if rest else "nothing"
            print(f"error: bench needs one of {', '.join(BENCHES)}, got {got}", file=sys.stderr)
            return 2
        return _call(BENCHES[rest[0]], rest[1:], f"{prog} bench {rest[0]}")
    print(f"error: unknown command {cmd!r}: allowed {allowed}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
