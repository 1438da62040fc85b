"""The one parser machinery (:mod:`lragent.command`): options spelt with dashes, a yes/no option given alone, leading
words as options, subcommands, and every user error as one ``error:`` line with exit status 2."""

from __future__ import annotations

from typing import Literal

import pytest

from lragent.command import run_command, run_subcommands, underscored, with_positionals

SEEN: list[dict] = []


def job(
    command: Literal["plan", "run"],
    dirs: list[str] | None = None,
    root: str = "runs",
    gpu_gb: float | None = None,
    reset_failed: bool = False,
    count: int = 1,
) -> int:
    """A job.

    Args:
        command: what to do.
        dirs: folders.
        root: the root.
        gpu_gb: GPU memory.
        reset_failed: forget failures.
        count: how many.
    """
    if count < 1:
        raise ValueError(f"--count {count}: at least 1")
    SEEN.append(dict(command=command, dirs=dirs, root=root, gpu_gb=gpu_gb, reset_failed=reset_failed, count=count))
    return 0


def test_dashes_become_the_parameters_spelling_and_a_lone_yes_no_option_means_true() -> None:
    argv = ["--gpu-gb", "40", "--reset-failed", "--root=x-y", "--scheme", "non-shared", "--count-x", "1"]
    assert underscored(job, argv) == [
        "--gpu_gb", "40", "--reset_failed", "true", "--root=x-y", "--scheme", "non-shared", "--count-x", "1"
    ]  # fmt: skip
    assert underscored(job, ["--reset_failed"]) == ["--reset_failed", "true"]  # at the end
    assert underscored(job, ["--reset-failed", "false"]) == ["--reset_failed", "false"]  # a value given: kept
    assert underscored(job, ["--reset-failed=false"]) == ["--reset_failed=false"]


def test_leading_words_fill_the_named_options_a_list_takes_the_rest() -> None:
    assert with_positionals(job, ["a", "b", "--root", "r"], ["dirs"]) == ["--dirs", '["a", "b"]', "--root", "r"]
    assert with_positionals(job, ["r1", "--count", "2"], ["root"]) == ["--root", "r1", "--count", "2"]
    assert with_positionals(job, ["--count", "2"], ["root"]) == ["--count", "2"]
    with pytest.raises(ValueError, match="unexpected argument"):
        with_positionals(job, ["r1", "r2"], ["root"])


def test_subcommands_parse_like_one_command(capsys) -> None:
    SEEN.clear()
    assert run_subcommands(job, ["run", "--gpu-gb", "3", "--reset-failed", "--root", "R"], "prog") == 0
    assert SEEN == [dict(command="run", dirs=None, root="R", gpu_gb=3.0, reset_failed=True, count=1)]
    assert run_subcommands(job, ["plan"], "prog") == 0 and SEEN[-1]["command"] == "plan"
    assert run_command(job, ["a", "b"], "prog", fixed={"command": "plan"}, positional=["dirs"]) == 0
    assert SEEN[-1]["dirs"] == ["a", "b"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bogus"], ["'bogus' is not a command", "plan, run"]),
        (["run", "--count", "0"], ["--count 0: at least 1"]),  # the function's own check
        (["run", "--count", "x"], ["count"]),  # the parser's
        (["run", "--no_such", "1"], ["no_such"]),
    ],
)
def test_every_user_error_is_one_line_and_status_2(argv, words, capsys) -> None:
    assert run_subcommands(job, argv, "prog") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err


def test_no_subcommand_or_help_lists_them(capsys) -> None:
    assert run_subcommands(job, [], "prog") == 0
    assert "{plan,run}" in capsys.readouterr().out


def test_no_argv_means_the_process_command_line(monkeypatch) -> None:
    SEEN.clear()
    monkeypatch.setattr("sys.argv", ["prog", "run", "--count", "2"])
    assert run_subcommands(job, None, "prog") == 0 and SEEN[-1]["count"] == 2
    monkeypatch.setattr("sys.argv", ["prog", "--count", "3"])
    assert run_command(job, None, "prog", fixed={"command": "plan"}) == 0 and SEEN[-1]["count"] == 3


def test_help_shows_the_prog_the_docstrings_first_paragraph_and_every_option_in_one_list(monkeypatch, capsys) -> None:
    """``PROG NAME --help`` prints the usage under the command's own name, the docstring's first paragraph (not its
    ``Args:``), and one ``options:`` list with ``--config`` beside the function's own options, then exits 0."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as stop:
        run_subcommands(job, ["run", "--help"], "prog")
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: prog run [--config CONFIG] "), out
    sections = out.split("\n\n")
    assert sections[1] == "A job." and "Args:" not in out, out
    assert len(sections) == 3 and sections[2].startswith("options:\n"), out
    options = " ".join(sections[2].split())
    assert "--config CONFIG YAML config (as --print_config writes it)" in options, out
    assert all(f"--{name}" in options for name in ("dirs", "root", "gpu_gb", "reset_failed", "count")), out


def test_a_function_without_a_docstring_gets_no_description_in_its_help(monkeypatch) -> None:
    from lragent.command import build_parser

    def bare(n: int = 1) -> None:
        pass

    monkeypatch.setenv("COLUMNS", "200")
    sections = build_parser(bare, "bare").format_help().split("\n\n")
    assert sections[0].startswith("usage: bare ") and sections[1].startswith("options:\n"), sections


def test_a_config_printed_by_print_config_runs_unchanged(tmp_path, capsys) -> None:
    """``--print_config`` prints the options as YAML and exits 0; that file given to ``--config`` reruns them."""
    with pytest.raises(SystemExit) as stop:
        run_subcommands(job, ["run", "--count", "4", "--root", "R", "--reset-failed", "--print_config"], "prog")
    assert stop.value.code == 0
    config = tmp_path / "job.yaml"
    config.write_text(capsys.readouterr().out)
    SEEN.clear()
    assert run_subcommands(job, ["plan", "--config", str(config)], "prog") == 0
    assert SEEN == [dict(command="plan", dirs=None, root="R", gpu_gb=None, reset_failed=True, count=4)]
    assert run_subcommands(job, ["plan", "--config", str(config), "--count", "7"], "prog") == 0  # later options win
    assert SEEN[-1]["count"] == 7 and SEEN[-1]["root"] == "R"


def test_dash_h_and_dash_dash_help_alone_list_the_subcommands(capsys) -> None:
    for flag in ("-h", "--help"):
        assert run_subcommands(job, [flag], "prog") == 0
        assert capsys.readouterr().out == "usage: prog {plan,run} [options]    (prog NAME --help for the options)\n"


def test_a_value_that_ends_in_an_option_name_is_not_taken_for_an_option() -> None:
    """Only tokens that start with ``--`` are options: ``--root myroot`` keeps ``myroot``, ``--root x-count`` keeps
    ``x-count``."""
    assert underscored(job, ["--root", "myroot", "--count", "2"]) == ["--root", "myroot", "--count", "2"]
    assert underscored(job, ["--root", "x-count"]) == ["--root", "x-count"]
    assert underscored(job, ["--", "--reset-failed"]) == ["--", "--reset_failed", "true"]


def test_a_one_letter_yes_no_option_given_alone_means_true() -> None:
    def short(q: bool = False, n: int = 1) -> None:
        pass

    assert underscored(short, ["--q"]) == ["--q", "true"]
    assert underscored(short, ["--q", "--n", "2"]) == ["--q", "true", "--n", "2"]


def test_leading_words_fill_several_named_options_in_order() -> None:
    """One word per plain option (an optional ``float | None`` one included), every word left for a list option."""
    assert with_positionals(job, ["r1", "40", "--count", "2"], ["root", "gpu_gb"]) == [
        "--root", "r1", "--gpu_gb", "40", "--count", "2"
    ]  # fmt: skip
    assert with_positionals(job, ["r1", "a", "b"], ["root", "dirs"]) == ["--root", "r1", "--dirs", '["a", "b"]']
    assert with_positionals(job, ["a", "b"], ["dirs", "root"]) == ["--dirs", '["a", "b"]']


def test_a_plain_list_parameter_takes_every_leading_word() -> None:
    def listing(names: list[str], depth: int = 1) -> None:
        pass

    assert with_positionals(listing, ["a", "b", "--depth", "2"], ["names"]) == [
        "--names", '["a", "b"]', "--depth", "2"
    ]  # fmt: skip


def test_too_many_leading_words_name_the_extra_words_and_the_allowed_options() -> None:
    with pytest.raises(ValueError) as err:
        with_positionals(job, ["r1", "40", "x", "y"], ["root", "gpu_gb"])
    assert str(err.value) == "unexpected argument(s) x y: allowed before the options: root, gpu_gb"


def test_an_error_without_a_message_is_named_by_its_type(capsys) -> None:
    from lragent.command import one_line

    assert one_line(ValueError("a\n   b\tc ")) == "a b c"
    assert one_line(FileNotFoundError()) == "FileNotFoundError"
    # first_line: a library's multi-line message cut to its first line (leading blanks dropped), else the type
    from lragent.command import first_line

    assert first_line(ValueError("  first  \nsecond\nthird")) == "first"
    assert first_line(OSError(" \n ")) == "OSError"

    def missing(path: str = "x") -> None:
        """Fails.

        Args:
            path: a path.
        """
        raise FileNotFoundError()

    assert run_command(missing, [], "prog") == 2
    assert capsys.readouterr().err == "error: FileNotFoundError\n"


def status(value: str = "none") -> object:
    """Returns what ``value`` names.

    Args:
        value: none, 3, true or text.
    """
    return {"none": None, "3": 3, "true": True, "text": "done"}[value]


@pytest.mark.parametrize("value, code", [("none", 0), ("3", 3), ("true", 0), ("text", 0)])
def test_the_exit_status_is_the_functions_integer_result_else_0(value: str, code: int) -> None:
    """An int (not a bool) the function returns is the status; anything else (None, True, a string) is 0."""
    assert run_command(status, ["--value", value], "prog") == code


def interrupted(note: str = "") -> None:
    """Stops as Ctrl-C would.

    Args:
        note: what it registers as kept before stopping (empty: nothing).
    """
    from lragent.command import on_interrupt

    if note:
        on_interrupt(note)
    raise KeyboardInterrupt


def test_ctrl_c_says_what_was_kept_and_ends_with_status_130(capsys) -> None:
    """The note the function registered is the line; the next run, which registers none, says nothing was saved."""
    assert run_command(interrupted, ["--note", "finished episodes are in out/e.jsonl"], "prog") == 130
    assert capsys.readouterr() == ("", "interrupted: finished episodes are in out/e.jsonl\n")
    assert run_command(interrupted, [], "prog") == 130
    assert capsys.readouterr() == ("", "interrupted: nothing was saved\n")


def out_of_memory(message: str = "", note: str = "") -> None:
    """Raises a RuntimeError, as torch does when the device runs out of memory.

    Args:
        message: the error's text.
        note: what it registers as kept before failing (empty: nothing).
    """
    from lragent.command import on_interrupt

    if note:
        on_interrupt(note)
    raise RuntimeError(message)


OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"
OOM_LINE = (
    "error: out of memory on cpu allocating 2.00 GiB; try smaller batch, capacity or context options (--help lists "
    "them), a larger --memory_fraction where the command has one, or fewer processes on the device"
)


def test_running_out_of_device_memory_is_one_error_line_with_what_was_asked_and_status_2(monkeypatch, capsys) -> None:
    """The line names the allocation, what to change, and (when the function registered one) what was kept."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_command(out_of_memory, ["--message", OOM], "prog") == 2
    assert capsys.readouterr() == ("", OOM_LINE + "\n")
    assert run_command(out_of_memory, ["--message", OOM, "--note", "results kept in out/"], "prog") == 2
    assert capsys.readouterr() == ("", OOM_LINE + "; results kept in out/\n")


def test_a_runtime_error_that_is_not_out_of_memory_propagates(capsys) -> None:
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_command(out_of_memory, ["--message", "shape mismatch"], "prog")
    assert capsys.readouterr().err == ""


def test_command_line_names_the_running_command_and_is_none_before_any(monkeypatch) -> None:
    """:func:`command_line` is what :func:`lragent.provenance.provenance` records: the program's words and argv."""
    from lragent import command
    from lragent.command import command_line

    monkeypatch.setattr(command, "_COMMAND_LINE", [])
    assert command.command_line() is None
    lines: list = []

    def record(command: Literal["eval"], count: int = 1) -> None:
        """Records the command line.

        Args:
            command: the subcommand.
            count: how many.
        """
        lines.append(command_line())

    assert run_subcommands(record, ["eval", "--count", "2"], "lragent") == 0
    assert lines == [["lragent", "eval", "--count", "2"]]


def test_a_finished_command_gives_the_line_back_to_the_command_around_it(monkeypatch) -> None:
    """After run_command returns (or fails), command_line() is again the outer command's line, or None: a record
    made later in the same process never names a command that already ended."""
    from lragent import command

    monkeypatch.setattr(command, "_COMMAND_LINE", [])
    seen: list = []

    def inner(count: int = 1) -> None:
        """Inner.

        Args:
            count: how many.
        """
        seen.append(command.command_line())

    def outer(count: int = 1) -> None:
        """Outer.

        Args:
            count: how many.
        """
        assert command.run_command(inner, ["--count", "2"], "lragent inner") == 0
        seen.append(command.command_line())
        assert command.run_command(fail, [], "lragent fail") == 2
        seen.append(command.command_line())

    def fail() -> None:
        """Fails."""
        raise ValueError("bad")

    assert command.run_command(outer, ["--count", "1"], "lragent outer") == 0
    assert seen == [["lragent", "inner", "--count", "2"], ["lragent", "outer", "--count", "1"],
                    ["lragent", "outer", "--count", "1"]]  # fmt: skip
    assert command.command_line() is None
