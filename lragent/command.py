"""One machinery for every command: a typed, documented function becomes a command line.

A command is a plain function whose parameters carry type hints and whose Google docstring documents each one
(``Args:``). :func:`run_command` builds its parser with jsonargparse (the library LightningCLI uses), so every
command gets ``--help`` from the docstring, ``--config FILE.yaml`` and ``--print_config``, and a config printed by
``--print_config`` runs unchanged. Errors in the arguments, and ``ValueError`` / ``FileNotFoundError`` raised by
the function's own checks, end as one ``error: ...`` line on stderr with exit status 2; Ctrl-C ends with a line
that says what was kept (the function may register it with :func:`on_interrupt`) and status 130.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

_INTERRUPT_NOTE: list[str] = []
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
    try:
        kwargs = parse_command(fn, argv, prog)
        result = fn(**kwargs)
    except USER_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        note = _INTERRUPT_NOTE[0] if _INTERRUPT_NOTE else "nothing was saved"
        print(f"interrupted: {note}", file=sys.stderr)
        return 130
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


# ---- the same --config / --print_config for the argparse commands (session, fidelity, droidspeak-select, export) ----
_NOT_OPTIONS = ("help", "config", "print_config")


def _add_config_args(parser: Any) -> None:
    """Adds ``--config FILE.yaml`` and ``--print_config`` to an ``argparse`` parser (see :func:`parse_with_config`)."""
    parser.add_argument("--config", default=None, help="YAML file of option values, as --print_config writes them")
    parser.add_argument("--print_config", action="store_true", help="print every option's value as YAML and exit")


def parse_with_config(parser: Any, argv: Sequence[str] | None) -> Any:
    """Adds ``--config`` / ``--print_config`` to ``parser`` and parses ``argv`` with the values of ``--config`` as
    defaults (the command line wins).

    Returns:
        the namespace; or the command's exit status when there is nothing left to run: 0 after printing the options
        as YAML (``--print_config``), 2 after one ``error:`` line (the config file is missing, not a YAML mapping,
        or names an option the command does not have).
    """
    _add_config_args(parser)
    try:
        return _parse_with_config(parser, argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _parse_with_config(parser: Any, argv: Sequence[str] | None) -> Any:
    """:func:`parse_with_config` without the error handling: 0 for ``--print_config``, else the namespace."""
    import argparse

    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    actions = {a.dest: a for a in parser._actions if a.dest not in _NOT_OPTIONS}
    if known.config:
        try:
            with open(known.config) as f:
                values = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--config {known.config}: {one_line(exc)}") from None
        if not isinstance(values, dict):
            raise ValueError(f"--config {known.config} is not a YAML mapping of option values")
        unknown = sorted(set(values) - set(actions))
        if unknown:
            raise ValueError(f"--config {known.config}: unknown option(s) {unknown}; allowed {sorted(actions)}")
        for dest in values:
            actions[dest].required = False  # given by the file
        parser.set_defaults(**values)
    args = parser.parse_args(argv)
    if args.print_config:
        print(yaml.safe_dump({d: getattr(args, d) for d in actions}, sort_keys=False), end="")
        return 0
    return args
