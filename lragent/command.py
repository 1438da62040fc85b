"""One machinery for every command: a typed, documented function becomes a command line.

A command is a plain function whose parameters carry type hints and whose Google docstring documents each one
(``Args:``). :func:`run_command` builds its parser with jsonargparse (the library LightningCLI uses), so every
command gets ``--help`` from the docstring, ``--config FILE.yaml`` and ``--print_config``, and a config printed by
``--print_config`` runs unchanged. Errors in the arguments, and ``ValueError`` / ``FileNotFoundError`` raised by
the function's own checks, end as one ``error: ...`` line on stderr with exit status 2, and so does running out of
device memory (what was asked and what is free, :func:`lragent.device_share.oom_line`); Ctrl-C ends with a line
that says what was kept (the function may register it with :func:`on_interrupt`) and status 130.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

_INTERRUPT_NOTE: list[str] = []
_OOM_OPTIONS = (
    "smaller batch, capacity or context options (--help lists them), a larger --memory_fraction where the command "
    "has one, or fewer processes on the device"
)
_COMMAND_LINE: list[list[str]] = []
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


def on_interrupt(note: str) -> None:
    """Sets what Ctrl-C reports (e.g. ``"finished episodes are in out/episodes.jsonl; rerun to resume"``)."""
    _INTERRUPT_NOTE[:] = [note]


def command_line() -> list[str] | None:
    """The command line of the command :func:`run_command` is running (``["lragent", "eval", ...]``), else None."""
    return list(_COMMAND_LINE[0]) if _COMMAND_LINE else None


def one_line(exc: BaseException) -> str:
    """The exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def build_parser(fn: Callable[..., Any], prog: str) -> Any:
    """The jsonargparse parser of ``fn``: its parameters, ``--config`` and ``--print_config``."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    doc = inspect.getdoc(fn) or ""
    parser = ArgumentParser(prog=prog, description=doc.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (as --print_config writes it)")
    parser.add_function_arguments(fn, as_group=False)
    return parser


def parse_command(fn: Callable[..., Any], argv: Sequence[str], prog: str) -> dict:
    """Parses ``argv`` for ``fn``; returns its keyword arguments. Raises ``ValueError`` (one line) on bad input."""
    import argparse

    parser = build_parser(fn, prog)
    try:
        ns = parser.parse_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(one_line(exc)) from None
    kwargs = ns.as_dict()
    kwargs.pop("config", None)
    kwargs.pop("__path__", None)
    return kwargs


def run_command(fn: Callable[..., Any], argv: Sequence[str], prog: str) -> int:
    """Parses ``argv``, calls ``fn``, maps user errors to exit status 2 and Ctrl-C to 130.

    Returns:
        the exit status: ``fn``'s integer result, else 0.
    """
    _INTERRUPT_NOTE.clear()
    _COMMAND_LINE[:] = [[*prog.split(), *argv]]
    try:
        kwargs = parse_command(fn, argv, prog)
        result = fn(**kwargs)
    except USER_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # torch's out-of-memory (a RuntimeError): one line, not a traceback
        from lragent.device_share import is_oom, oom_line

        if not is_oom(exc):
            raise
        note = f"; {_INTERRUPT_NOTE[0]}" if _INTERRUPT_NOTE else ""
        print(f"error: {oom_line(exc, None, _OOM_OPTIONS)}{note}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        note = _INTERRUPT_NOTE[0] if _INTERRUPT_NOTE else "nothing was saved"
        print(f"interrupted: {note}", file=sys.stderr)
        return 130
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
