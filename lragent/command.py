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
    """The command line of the command :func:`run_command` is running (``["lragent", "eval", ...]``), else None (after
    it returns: the outer command's line, or None)."""
    return list(_COMMAND_LINE[0]) if _COMMAND_LINE else None


def one_line(exc: BaseException) -> str:
    """The exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def first_line(exc: BaseException) -> str:
    """The first line of the exception's message (a library's multi-line error, cut to what names the fault), or its
    type's name when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip() if text else type(exc).__name__


def build_parser(fn: Callable[..., Any], prog: str, fixed: Sequence[str] = ()) -> Any:
    """The jsonargparse parser of ``fn``: its parameters but ``fixed`` (given by the caller), ``--config`` and
    ``--print_config``."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    doc = inspect.getdoc(fn) or ""
    parser = ArgumentParser(prog=prog, description=doc.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config (as --print_config writes it)")
    parser.add_function_arguments(fn, as_group=False, skip=set(fixed) or None)
    return parser


def underscored(fn: Callable[..., Any], argv: Sequence[str]) -> list[str]:
    """``argv`` with each option of ``fn`` spelt with dashes (``--gpu-gb 40``) in its parameter's spelling
    (``--gpu_gb``), and a yes/no option given alone (``--reset-failed``, before another option or at the end) as
    ``--reset_failed true``; values and other tokens unchanged."""
    params = inspect.signature(fn).parameters
    flags = {name for name, p in params.items() if isinstance(p.default, bool)}
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            if name.replace("-", "_") in params:
                name = name.replace("-", "_")
                arg = f"--{name}{eq}{value}"
            if name in flags and not eq and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                out += [arg, "true"]
                continue
        out.append(arg)
    return out


def with_positionals(fn: Callable[..., Any], argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """``argv`` with its leading words (those before the first option) given as the options ``names`` in order: one
    word each, or every word left when the parameter is a list (``dirs A B`` -> ``--dirs ["A", "B"]``). More words
    than names raise ``ValueError``."""
    import json
    import typing

    rest = list(argv)
    words: list[str] = []
    while rest and not rest[0].startswith("-"):
        words.append(rest.pop(0))
    hints = typing.get_type_hints(fn)
    out: list[str] = []
    for name in names:
        if not words:
            break
        hint = hints.get(name)
        if typing.get_origin(hint) is list or any(typing.get_origin(h) is list for h in typing.get_args(hint)):
            out += [f"--{name}", json.dumps(words)]
            words = []
        else:
            out += [f"--{name}", words.pop(0)]
    if words:
        raise ValueError(f"unexpected argument(s) {' '.join(words)}: allowed before the options: {', '.join(names)}")
    return out + rest


def parse_command(fn: Callable[..., Any], argv: Sequence[str], prog: str, fixed: Sequence[str] = ()) -> dict:
    """Parses ``argv`` for ``fn`` (an option may be spelt with dashes: :func:`underscored`); returns its keyword
    arguments. Raises ``ValueError`` (one line) on bad input."""
    import argparse

    parser = build_parser(fn, prog, fixed)
    try:
        ns = parser.parse_args(underscored(fn, argv))
    except argparse.ArgumentError as exc:
        raise ValueError(one_line(exc)) from None
    kwargs = ns.as_dict()
    kwargs.pop("config", None)
    kwargs.pop("__path__", None)
    return kwargs


def run_command(
    fn: Callable[..., Any],
    argv: Sequence[str] | None,
    prog: str,
    fixed: dict[str, Any] | None = None,
    positional: Sequence[str] = (),
) -> int:
    """Parses ``argv`` (``sys.argv[1:]`` when None; its leading words as the options ``positional`` names:
    :func:`with_positionals`), calls ``fn``
    (with ``fixed``, keyword arguments the caller chose, e.g. a subcommand's name, on top), maps user errors to exit
    status 2 and Ctrl-C to 130.

    Returns:
        the exit status: ``fn``'s integer result, else 0.
    """
    argv = sys.argv[1:] if argv is None else argv
    _INTERRUPT_NOTE.clear()
    outer = list(_COMMAND_LINE)  # a command run inside another (a driver's) gives the line back when it returns
    _COMMAND_LINE[:] = [[*prog.split(), *argv]]
    try:
        if positional:
            argv = with_positionals(fn, argv, positional)
        kwargs = parse_command(fn, argv, prog, tuple(fixed or ()))
        result = fn(**kwargs, **(fixed or {}))
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
    finally:
        _COMMAND_LINE[:] = outer
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_subcommands(fn: Callable[..., Any], argv: Sequence[str] | None, prog: str, param: str = "command") -> int:
    """``PROG NAME [options]`` (``argv``: ``sys.argv[1:]`` when None): the first word is ``fn``'s parameter ``param``
    (its choices are the ``Literal`` the parameter is annotated with), the rest :func:`run_command`'s options. A missing
    or unknown name is one ``error:`` line and status 2; ``--help`` alone lists the names.

    Returns:
        the exit status.
    """
    import typing

    argv = sys.argv[1:] if argv is None else argv
    choices = typing.get_args(typing.get_type_hints(fn)[param])
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} {{{','.join(choices)}}} [options]    ({prog} NAME --help for the options)")
        return 0
    if argv[0] not in choices:
        print(f"error: {prog}: {argv[0]!r} is not a command: allowed {', '.join(choices)}", file=sys.stderr)
        return 2
    return run_command(fn, argv[1:], f"{prog} {argv[0]}", fixed={param: argv[0]})
