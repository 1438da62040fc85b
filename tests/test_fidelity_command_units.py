"""``lragent fidelity`` (eval_suite/diagnostics/fidelity_command.py) end to end on a tiny local model directory (a
random 1-layer LLaMA with ByT5's byte tokenizer): its files, its printout, its config block, and its results against
the building blocks called by hand with the same options."""

from __future__ import annotations

import json

import pytest

from eval_suite.diagnostics.fidelity import load_role_examples, render_markdown, run_fidelity
from eval_suite.diagnostics.fidelity_command import fidelity
from lragent.loading import load_lora_model

TINY = {"vocab_size": 384, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the tiny models


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import ByT5Tokenizer

    from lragent.models import load_model

    folder = tmp_path_factory.mktemp("tiny_byte_llama")
    ByT5Tokenizer().save_pretrained(folder)
    model, _ = load_model("tiny-llama", overrides=TINY)
    model.save_pretrained(folder)
    return str(folder)


def bar_lines(err: str) -> list[str]:
    """stderr's lines less transformers' own weight-loading bar."""
    return [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "Loading weights" not in ln]


def by_hand(model_dir: str, schemes: list[str], *, benchmark="hotpotqa", rank=8, alpha=16.0, seed=0, holdout=100,
            limit=20, pool="heldout", max_context_tokens=None, producer="next", shared_split="last", layers=None,
            dtype="float32") -> dict:  # fmt: skip
    lm, tok = load_lora_model(model=model_dir, adapter_init="random", rank=rank, alpha=alpha, seed=seed, dtype=dtype,
                              device="cpu")  # fmt: skip
    examples = load_role_examples(benchmark, list(lm.router.roles), tok, holdout=holdout, limit=limit, seed=seed,
                                  max_context_tokens=max_context_tokens, pool=pool)  # fmt: skip
    return run_fidelity(lm, examples, schemes, producer=producer, shared_split=shared_split, droidspeak_layers=layers,
                        progress=False)  # fmt: skip


def test_fidelity_writes_what_the_building_blocks_measure(model_dir, tmp_path, capsys):
    out = tmp_path / "fid"
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"droidspeak_layers": [1]}))
    options = dict(benchmark="scienceqa", rank=4, alpha=8.0, seed=3, holdout=7, limit=2, pool="dev",
                   max_context_tokens=24, producer="plan", shared_split="piece")  # fmt: skip
    code = fidelity(model=model_dir, adapter_init="random", scheme="droidspeak,base_lr_shared",
                    droidspeak_config=str(ds), device="cpu", out=str(out), quiet=True, **options)  # fmt: skip
    assert code == 0
    got = json.loads((out / "fidelity.json").read_text())
    expected = by_hand(model_dir, ["non_shared", "droidspeak", "base_lr_shared"], layers=[1], **options)
    assert list(got["schemes"]) == ["non_shared", "droidspeak", "base_lr_shared"]
    assert got["schemes"] == json.loads(json.dumps(expected["schemes"]))
    assert got["examples"] == json.loads(json.dumps(expected["examples"]))
    assert got["config"] == {
        "benchmark": "scienceqa", "model": model_dir, "adapters": "init:random", "seed": 3, "pool": "dev",
        "holdout": 7, "limit": 2, "producer": "plan", "shared_split": "piece", "max_context_tokens": 24,
        "droidspeak_layers": [1], "dtype": "float32",
    }  # fmt: skip
    assert got["provenance"]["dtype"] == "float32" and got["provenance"]["device"]["type"] == "cpu"
    assert (out / "fidelity.md").read_text() == render_markdown(got)
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 4 and bar_lines(captured.err) == []  # quiet: no progress bar
    for line, (s, v) in zip(lines, got["schemes"].items(), strict=False):
        assert line == f"{s:15s} KL {v['overall']['kl']:.3e}  top-1 {100 * v['overall']['top1']:.2f}%"
    assert lines[0].startswith("non_shared      KL ")
    assert lines[-1] == f"-> {out / 'fidelity.json'}, {out / 'fidelity.md'}"


def test_fidelity_defaults_measure_every_scheme_with_a_bar(model_dir, tmp_path, capsys):
    out = tmp_path / "fid"
    assert fidelity(model=model_dir, adapter_init="random", limit=1, max_context_tokens=16, device="cpu",
                    out=str(out)) == 0  # fmt: skip
    got = json.loads((out / "fidelity.json").read_text())
    expected = by_hand(model_dir, ["non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared"],
                       limit=1, max_context_tokens=16)  # fmt: skip
    assert list(got["schemes"]) == list(expected["schemes"])
    assert got["schemes"] == json.loads(json.dumps(expected["schemes"]))
    assert got["config"]["droidspeak_layers"] is None and got["config"]["benchmark"] == "hotpotqa"
    assert got["config"]["pool"] == "heldout" and got["config"]["holdout"] == 100 and got["config"]["seed"] == 0
    assert bar_lines(capsys.readouterr().err) != []  # the progress bar


def test_fidelity_records_the_adapter_directory(model_dir, tmp_path, capsys):
    from lragent.adapters_io import NATIVE_FILE, save_native

    lm, _ = load_lora_model(model=model_dir, adapter_init="random", seed=5, device="cpu")
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    save_native(lm, adapters / NATIVE_FILE)
    out = tmp_path / "fid"
    assert fidelity(model=model_dir, adapters=str(adapters), limit=1, max_context_tokens=16, scheme="non_shared",
                    device="cpu", out=str(out), quiet=True) == 0  # fmt: skip
    got = json.loads((out / "fidelity.json").read_text())
    assert got["config"]["adapters"] == str(adapters.resolve())
    assert list(got["schemes"]) == ["non_shared"]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"pool": "train"}, ValueError, "--pool 'train' unknown: allowed heldout, dev, val"),
        ({"producer": "critic"}, ValueError, "--producer 'critic' unknown: allowed next or plan, action, reflect"),
        ({"scheme": "half_shared"}, ValueError, "unknown"),
        ({"holdout": 0}, ValueError, "--holdout must be >= 1, got 0"),
        ({"adapter_init": None}, ValueError, "give exactly one of --adapters DIR and --adapter_init {zero,random}"),
        ({"droidspeak_config": "/nonexistent/ds.json"}, FileNotFoundError, "droidspeak config /nonexistent/ds.json"),
    ],
)
def test_fidelity_refuses_bad_options_before_writing(model_dir, tmp_path, kwargs, error, message):
    out = tmp_path / "fid"
    args = dict(model=model_dir, adapter_init="random", device="cpu", out=str(out), quiet=True, limit=1)
    with pytest.raises(error) as err:
        fidelity(**{**args, **kwargs})
    assert message in str(err.value)
    assert not (out / "fidelity.json").exists()


def test_fidelity_refuses_a_text_less_model(tmp_path):
    with pytest.raises(ValueError, match="has random weights and no tokenizer: this command needs text"):
        fidelity(model="tiny-llama", adapter_init="random", device="cpu", out=str(tmp_path / "o"))


def test_fidelity_refuses_an_unwritable_out(model_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises((ValueError, FileExistsError, NotADirectoryError, OSError)):
        fidelity(model=model_dir, adapter_init="random", device="cpu", out=str(tmp_path / "file"), quiet=True)
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 0}, "--rank must be a positive integer, got 0"),
        ({"alpha": 0.0}, "--alpha must be a positive number, got 0.0"),
        ({"dtype": "int8"}, "int8"),
        ({"device": "tpu"}, "tpu"),
        ({"max_context_tokens": 1}, "--max_context_tokens must be >= 2, got 1"),
    ],
)
def test_fidelity_checks_the_options_before_creating_out(model_dir, tmp_path, kwargs, message):
    out = tmp_path / "fid"
    args = dict(model=model_dir, adapter_init="random", device="cpu", out=str(out), quiet=True, limit=1)
    with pytest.raises(ValueError) as err:
        fidelity(**{**args, **kwargs})
    assert message in str(err.value)
    assert not out.exists()  # refused before the output folder is made, let alone the model loaded


def test_fidelity_refuses_a_text_less_model_before_creating_out(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(ValueError) as err:
        fidelity(model="tiny-llama", adapter_init="random", device="cpu", out=str(out))
    assert str(err.value) == "--model 'tiny-llama' has random weights and no tokenizer: this command needs text"
    assert not out.exists()


def test_fidelity_in_bfloat16(model_dir, tmp_path, capsys):
    out = tmp_path / "fid"
    assert fidelity(model=model_dir, adapter_init="random", limit=1, max_context_tokens=16, scheme="base_shared",
                    dtype="bfloat16", device="cpu", out=str(out), quiet=True) == 0  # fmt: skip
    got = json.loads((out / "fidelity.json").read_text())
    expected = by_hand(model_dir, ["non_shared", "base_shared"], limit=1, max_context_tokens=16, dtype="bfloat16")
    assert got["schemes"] == json.loads(json.dumps(expected["schemes"]))
    assert got["config"]["dtype"] == "bfloat16" and got["provenance"]["dtype"] == "bfloat16"
    f32 = by_hand(model_dir, ["non_shared", "base_shared"], limit=1, max_context_tokens=16)
    assert got["schemes"] != json.loads(json.dumps(f32["schemes"]))  # the dtype reached the model


def test_fidelity_command_defaults(capsys):
    import yaml

    from lragent.cli_main import main

    with pytest.raises(SystemExit) as stop:
        main(["fidelity", "--print_config"])
    assert stop.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out) == {
        "benchmark": "hotpotqa", "model": "default", "adapters": None, "adapter_init": None, "rank": 8,
        "alpha": 16.0, "seed": 0, "holdout": 100, "limit": 20, "pool": "heldout", "max_context_tokens": None,
        "producer": "next", "shared_split": "last", "scheme": "all", "droidspeak_config": None, "dtype": "float32",
        "device": None, "use_kernel": True, "out": "fidelity_out", "quiet": False,
    }  # fmt: skip


def test_fidelity_default_limit_and_out(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert fidelity(model=model_dir, adapter_init="random", max_context_tokens=8, scheme="non_shared", device="cpu",
                    quiet=True) == 0  # fmt: skip
    got = json.loads((tmp_path / "fidelity_out" / "fidelity.json").read_text())  # the default --out
    assert got["config"]["limit"] == 20
    assert (tmp_path / "fidelity_out" / "fidelity.md").is_file()
