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
