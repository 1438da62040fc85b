"""The model and adapter options every model command checks before loading anything (lragent/loading.py), through
the commands a user types."""

from __future__ import annotations

import pytest

from lragent.cli_main import main


def error_line(capsys, argv: list[str]) -> str:
    """Runs ``lragent ARGV``, which must refuse it with status 2 and one ``error:`` line; returns that line."""
    assert main(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["fidelity"], "give exactly one of --adapters DIR and --adapter_init {zero,random}"),
        (["fidelity", "--adapters", "x", "--adapter_init", "zero"], "give exactly one of --adapters DIR"),
        (["session", "--adapters", "ad", "--adapter_init", "zero"], "give either --adapters ('ad') or --adapter_init"),
        (["fidelity", "--adapter_init", "zero", "--alpha", "0"], "--alpha must be a positive number, got 0"),
        (["fidelity", "--adapter_init", "zero", "--alpha", "-2"], "--alpha must be a positive number, got -2"),
        (
            ["fidelity", "--adapter_init", "zero", "--model", "tiny-llama"],
            "--model 'tiny-llama' has random weights and no tokenizer: this command needs text",
        ),
    ],
)
def test_model_options_are_refused_naming_the_value(capsys, argv, expected):
    assert expected in error_line(capsys, argv)


def test_a_droidspeak_config_that_is_missing_or_unreadable_is_named(capsys, tmp_path):
    base = ["fidelity", "--adapter_init", "zero", "--out", str(tmp_path / "out")]
    missing = tmp_path / "layers.json"
    argv = [*base, "--droidspeak_config", str(missing)]
    assert f"droidspeak config {missing}: no such file" in error_line(capsys, argv)
    missing.write_text("{droidspeak_layers: [1")
    assert f"droidspeak config {missing} is not readable" in error_line(capsys, argv)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_load_lora_model_needs_adapters_and_a_tokenizer_for_text():
    from lragent.loading import load_lora_model

    with pytest.raises(ValueError, match=r"give --adapters DIR or --adapter_init \{zero,random\}"):
        load_lora_model(model="tiny-llama")
    with pytest.raises(ValueError, match="model 'tiny-llama' has random weights and no tokenizer: this command needs"):
        load_lora_model(model="tiny-llama", adapter_init="zero", device="cpu")
    lm, tok = load_lora_model(model="tiny-llama", adapter_init="zero", device="cpu", needs_text=False)
    assert tok is None and lm.router.roles == ("plan", "action", "reflect")
