"""The model and adapter options every model command checks before loading anything (lragent/loading.py), through
the commands a user types."""

from __future__ import annotations

import json

import pytest
import torch

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


# ---- lragent/loading.py called directly: the exact line each refusal prints, and what a load returns ----------


@pytest.fixture(scope="module")
def adapter_set(tmp_path_factory):
    """A stored adapter set of a layout unlike the defaults (two roles, rank 4, alpha 6, q/v only, shared A), and
    the model it was written from."""
    from lragent.adapters_io import export_peft
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    cfg = MultiLoraConfig(roles=("plan", "action"), rank=4, alpha=6.0, dropout=0.1, targets=("q_proj", "v_proj"))
    source = MultiLoraModel(load_model("tiny-llama")[0], cfg)
    source.init_adapters("random", seed=5, b_std=0.3)
    out = tmp_path_factory.mktemp("adapters")
    export_peft(source, out)
    return out, source


def lora_tensors(lm) -> list:
    return [p.detach().clone() for p in lm.lora_parameters()]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"exactly_one": True}, "give exactly one of --adapters DIR and --adapter_init {zero,random}"),
        ({"adapter_init": "ones"}, "--adapter_init 'ones' not supported: allowed zero, random"),
        ({"adapter_init": "zero", "rank": 0}, "--rank must be a positive integer, got 0"),
        ({"adapter_init": "zero", "rank": 2.5}, "--rank must be a positive integer, got 2.5"),
        ({"adapter_init": "zero", "rank": True}, "--rank must be a positive integer, got True"),
        ({"adapter_init": "zero", "alpha": float("nan")}, "--alpha must be a positive number, got nan"),
        ({"adapter_init": "zero", "alpha": 0.0}, "--alpha must be a positive number, got 0.0"),
        ({"device": "gpu7"}, "device 'gpu7' is not a device: allowed cpu, cuda, cuda:N, mps"),
        ({"dtype": "float64"}, "dtype 'float64' not supported: allowed float32, fp32, bfloat16, bf16, float16, fp16"),
        (
            {"model": "TINY-LLAMA", "needs_text": True},
            "--model 'TINY-LLAMA' has random weights and no tokenizer: this command needs text",
        ),
    ],
)
def test_check_model_args_refuses_with_one_line_naming_the_value(kwargs, message):
    from lragent.loading import check_model_args

    with pytest.raises(ValueError) as info:
        check_model_args(**kwargs)
    assert str(info.value) == message


def test_check_model_args_accepts_the_defaults_and_the_smallest_valid_values():
    from lragent.loading import check_model_args

    assert check_model_args() is None  # default dtype float32, device resolved to this machine's
    assert check_model_args(model="tiny-llama") is None  # needs_text defaults to False
    assert check_model_args(adapter_init="random", rank=1, alpha=0.5, dtype="bf16", device="cpu") is None
    assert check_model_args(adapter_init="zero", exactly_one=True) is None


def test_check_model_args_reads_the_stored_layout_and_the_roles_it_lacks(adapter_set, tmp_path):
    from lragent.adapters_io import NATIVE_FILE
    from lragent.loading import check_model_args

    out, source = adapter_set
    cfg = check_model_args(adapters=str(out), roles=("plan", "action"))
    assert (cfg.roles, cfg.rank, cfg.alpha, cfg.targets, cfg.shared_a) == (
        ("plan", "action"),
        4,
        6.0,
        source.lora_config.targets,
        True,
    )
    with pytest.raises(FileNotFoundError) as info:
        check_model_args(adapters=str(out), roles=("plan", "reflect"))
    assert str(info.value) == f"adapter checkpoint {out / NATIVE_FILE} has no adapter for roles ['reflect']"
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        check_model_args(adapters=str(missing))
    assert str(info.value) == f"--adapters {str(missing)!r}: no such directory"


def test_load_lora_model_takes_the_stored_layout_and_weights(adapter_set):
    from lragent.loading import load_lora_model

    out, source = adapter_set
    lm, tok = load_lora_model(model="tiny-llama", adapters=str(out), device="cpu", needs_text=False, rank=2, alpha=3.0)
    cfg = lm.lora_config
    assert tok is None and not lm.training
    assert (cfg.roles, cfg.rank, cfg.alpha, cfg.dropout, cfg.targets, cfg.shared_a) == (
        ("plan", "action"),
        4,
        6.0,
        0.0,  # no dropout at inference, whatever the training used
        source.lora_config.targets,
        True,
    )
    assert sorted(lm.lora_modules()) == sorted(source.lora_modules())
    for got, want in zip(lora_tensors(lm), lora_tensors(source), strict=True):
        assert torch.equal(got, want)


def test_load_lora_model_keeps_one_a_per_role_when_the_set_has_them(tmp_path):
    from conftest import tiny_multi_lora

    from lragent.adapters_io import export_peft
    from lragent.loading import load_lora_model

    source = tiny_multi_lora("tiny-llama", rank=2, shared_a=False)
    export_peft(source, tmp_path)
    lm, _ = load_lora_model(model="tiny-llama", adapters=str(tmp_path), device="cpu", needs_text=False)
    assert lm.lora_config.shared_a is False
    assert all(len(m.lora_A) == 3 for m in lm.lora_modules().values())
    for got, want in zip(lora_tensors(lm), lora_tensors(source), strict=True):
        assert torch.equal(got, want)


def test_load_lora_model_initialises_adapters_as_asked():
    from lragent.loading import load_lora_model
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    kw = dict(model="tiny-llama", device="cpu", needs_text=False)
    with pytest.raises(ValueError, match=r"^give --adapters DIR or --adapter_init \{zero,random\}$"):
        load_lora_model(adapters="", adapter_init="", **kw)
    lm, _ = load_lora_model(adapter_init="random", rank=2, alpha=5.0, shared_a=False, seed=3, dtype="bf16", **kw)
    cfg = lm.lora_config
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.shared_a) == (2, 5.0, 0.0, False)
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    want = MultiLoraModel(
        load_model("tiny-llama", dtype=torch.bfloat16)[0], MultiLoraConfig(rank=2, alpha=5.0, shared_a=False)
    )
    want.init_adapters("random", seed=3)
    for got, expected in zip(lora_tensors(lm), lora_tensors(want), strict=True):
        assert torch.equal(got, expected)
    assert all(len(m.lora_A) == 3 and m.lora_B[0].abs().sum() > 0 for m in lm.lora_modules().values())

    default, _ = load_lora_model(adapter_init="random", **kw)  # rank 8, alpha 16, shared A, seed 0, float32
    explicit, _ = load_lora_model(adapter_init="random", rank=8, alpha=16.0, shared_a=True, seed=0, **kw)
    assert default.lora_config == explicit.lora_config and default.lora_config.shared_a
    assert (default.lora_config.rank, default.lora_config.alpha) == (8, 16.0)
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    for got, expected in zip(lora_tensors(default), lora_tensors(explicit), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.model
def test_load_lora_model_defaults_to_the_embedded_model_with_its_tokenizer():
    from lragent.loading import load_lora_model

    lm, tok = load_lora_model(adapter_init="zero", device="cpu")
    assert tok is not None and tok("Hello").input_ids
    assert lm.n_layers == 30  # SmolLM2-135M


def test_a_gpu_index_picks_that_gpu_before_loading(monkeypatch):
    """CUDA cannot be real here: the machine says it has GPUs, set_device records its argument, and the model is
    built on the CPU while load_model is told the device it was asked for."""
    from lragent import loading
    from lragent.models import load_model

    picked, asked = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)

    def load_on_cpu(name, dtype, device):
        asked.append((name, dtype, device))
        return load_model(name, dtype=dtype, device="cpu")

    monkeypatch.setattr(loading, "load_model", load_on_cpu)
    assert loading.resolve_device(None) == "cuda"
    assert loading.resolve_device("cpu") == "cpu"
    loading.load_lora_model(model="tiny-llama", adapter_init="zero", device="cuda:1", needs_text=False)
    assert picked == [torch.device("cuda:1")] and asked == [("tiny-llama", torch.float32, "cuda:1")]
    loading.load_lora_model(model="tiny-llama", adapter_init="zero", device="cuda", needs_text=False)
    assert picked == [torch.device("cuda:1")] and asked[-1][2] == "cuda"  # no index: the current GPU stays


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_read_droidspeak_config_reads_yaml_and_json(tmp_path, suffix):
    from lragent.loading import read_droidspeak_config

    (tmp_path / f"layers{suffix}").write_text("# written by droidspeak-select\ndroidspeak_layers: [0, 3, 5]\n")
    assert read_droidspeak_config(tmp_path / f"layers{suffix}") == [0, 3, 5]
    (tmp_path / "layers.json").write_text(json.dumps({"droidspeak_layers": [2], "scores": [0.5]}))
    assert read_droidspeak_config(str(tmp_path / "layers.json")) == [2]


def test_read_droidspeak_config_refuses_what_is_not_a_non_empty_integer_list(tmp_path):
    from lragent.loading import read_droidspeak_config

    path = tmp_path / "layers.json"
    path.write_text("{droidspeak_layers: [1, 2]}")  # YAML, but a .json file is read as JSON
    with pytest.raises(ValueError) as info:
        read_droidspeak_config(path)
    assert str(info.value) == (
        f"droidspeak config {path} is not readable (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))"
    )
    for cfg in (
        [1, 2],
        {"layers": [1]},
        {"droidspeak_layers": []},
        {"droidspeak_layers": [1, "2"]},
        {"droidspeak_layers": 7},
    ):
        path.write_text(json.dumps(cfg))
        with pytest.raises(ValueError) as info:
            read_droidspeak_config(path)
        assert str(info.value) == f"droidspeak config {path}: expected a non-empty integer list 'droidspeak_layers'"
    yml = tmp_path / "layers.yaml"
    yml.write_text("droidspeak_layers: {1: 2}\n")  # a mapping with integer keys is not a list
    with pytest.raises(ValueError, match="expected a non-empty integer list 'droidspeak_layers'$"):
        read_droidspeak_config(yml)


def test_an_unreadable_droidspeak_config_is_named_in_one_bounded_line(tmp_path):
    import yaml

    from lragent.loading import read_droidspeak_config

    path = tmp_path / "layers.yaml"
    path.write_text("droidspeak_layers: [" + "10, " * 30 + "\nnote: " + "y " * 40 + ": z\n")
    with pytest.raises(yaml.YAMLError) as parsed:
        yaml.safe_load(path.read_text())
    one_line = " ".join(str(parsed.value).split())
    assert len(one_line) > 200
    with pytest.raises(ValueError) as info:
        read_droidspeak_config(path)
    assert str(info.value) == f"droidspeak config {path} is not readable ({one_line[:200]})"
