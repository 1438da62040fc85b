"""``lragent serve``'s option checks, before any model is loaded (eval_suite/serve/serve_command.py)."""

from __future__ import annotations

import pytest

from lragent.cli_main import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capacity", "8"], "--capacity must be >= 16 positions, got 8"),
        (["--log_level", "loud"], "--log_level 'loud': allowed critical, error, warning, info, debug"),
    ],
)
def test_serve_options_are_refused_naming_the_value(capsys, argv, message):
    # a model without a tokenizer: were the option let through, the next check stops the command (no server)
    assert main(["serve", "--scheme", "base_lr_shared", "--model", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
