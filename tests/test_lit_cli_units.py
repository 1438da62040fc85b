"""lit_modules/cli.py in this process on a tiny model: the CLI's defaults and links, the progress bar it adds, the
Lightning commands' one-line errors, and ``export``'s checks and files."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, TQDMProgressBar
from safetensors.torch import load_file

from datamodules.role_examples import RoleExampleDataModule
from lit_modules.cli import LRAgentCLI, _roles_or_default, _tokenizer_of, export, run_lightning_cli
from lit_modules.multi_lora_module import MultiLoraModule
from lit_modules.progress import RunProgressBar
from lragent.roles import DEFAULT_ROLES
from tests.test_training import REPO, tiny_data, tiny_module, tiny_trainer

DATA = "{plan: data/trajectories/hotpotqa/plan.jsonl.gz, action: data/trajectories/hotpotqa/action.jsonl.gz}"


def tiny_args(tmp_path: Path, *more: str) -> list[str]:
    return [
        "--model.model_name", "tiny-llama", "--model.roles", "[plan, action]", "--data.data_files", DATA,
        "--trainer.logger", "false", "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.enable_checkpointing", "false", *more,
    ]  # fmt: skip


def test_roles_or_default_and_tokenizer_of():
    assert _roles_or_default(None) == list(DEFAULT_ROLES) and isinstance(_roles_or_default(None), list)
    assert _roles_or_default(("action", "plan")) == ["action", "plan"]
    assert _roles_or_default([]) == []
    assert _tokenizer_of("tiny-llama", None) == "tiny-llama"
    assert _tokenizer_of("tiny-llama", "byte") == "byte"
    assert _tokenizer_of("tiny-llama", "") == ""


def test_the_cli_builds_the_module_and_data_with_its_defaults(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    cli = LRAgentCLI(run=False, args=tiny_args(tmp_path))
    assert type(cli.model) is MultiLoraModule and type(cli.datamodule) is RoleExampleDataModule
    assert cli.save_config_kwargs == {"overwrite": True}
    assert cli.auto_configure_optimizers is False
    # linked: the model's roles are the data's, the model name is the tokenizer when no tokenizer is named
    assert cli.datamodule.roles == ["plan", "action"] == list(cli.model.lora_config.roles)
    assert cli.datamodule.hparams.tokenizer == "tiny-llama"
    cli = LRAgentCLI(run=False, args=tiny_args(tmp_path, "--model.tokenizer_name", "byte"))
    assert cli.datamodule.hparams.tokenizer == "byte"


def test_the_cli_defaults_give_way_to_the_callers(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    cli = LRAgentCLI(run=False, args=tiny_args(tmp_path), save_config_kwargs={"overwrite": False})
    assert cli.save_config_kwargs == {"overwrite": False}


def test_the_cli_links_the_default_roles(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    args = [a if a != "[plan, action]" else "null" for a in tiny_args(tmp_path)]
    # the files in another order than the default roles: the data module would take their order if given no roles
    files = "{reflect: data/trajectories/hotpotqa/reflect.jsonl.gz, plan: data/trajectories/hotpotqa/plan.jsonl.gz, "
    files += "action: data/trajectories/hotpotqa/action.jsonl.gz}"
    args[args.index(DATA)] = files
    cli = LRAgentCLI(run=False, args=args)
    assert cli.datamodule.roles == list(DEFAULT_ROLES) == ["plan", "action", "reflect"]


def test_the_cli_passes_positional_arguments_on(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    # LightningCLI's first positional parameter is the model class, which the CLI already sets
    with pytest.raises(TypeError, match="multiple values for argument 'model_class'"):
        LRAgentCLI(MultiLoraModule, run=False, args=tiny_args(tmp_path))


@pytest.mark.parametrize(
    "more, bar",
    [
        ([], RunProgressBar),
        (["--trainer.callbacks", "[]"], RunProgressBar),
        (["--trainer.enable_progress_bar", "true"], RunProgressBar),
        (["--trainer.enable_progress_bar", "false"], None),
        (["--trainer.callbacks", "lightning.pytorch.callbacks.TQDMProgressBar"], TQDMProgressBar),
        (["--trainer.callbacks+", "LearningRateMonitor", "--trainer.callbacks+", "TQDMProgressBar"], TQDMProgressBar),
        (["--trainer.callbacks+", "LearningRateMonitor"], RunProgressBar),
    ],
)
def test_the_cli_adds_its_bar_only_where_none_is_named(monkeypatch, tmp_path, more, bar):
    monkeypatch.chdir(REPO)
    cli = LRAgentCLI(run=False, args=tiny_args(tmp_path, *more))
    if bar is None:
        assert cli.trainer.progress_bar_callback is None
    else:
        assert type(cli.trainer.progress_bar_callback) is bar
    bars = [c for c in cli.trainer.callbacks if isinstance(c, (RunProgressBar, TQDMProgressBar))]
    assert len(bars) == (bar is not None)
    if "LearningRateMonitor" in more:
        assert any(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks)


def test_a_single_configured_bar_is_kept(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  callbacks:\n    class_path: lightning.pytorch.callbacks.TQDMProgressBar\n")
    cli = LRAgentCLI(run=False, args=[*tiny_args(tmp_path), "--config", str(config)])
    assert type(cli.trainer.progress_bar_callback) is TQDMProgressBar
    assert not any(isinstance(c, RunProgressBar) for c in cli.trainer.callbacks)


def test_run_lightning_cli_prints_a_config_from_its_arguments(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stop:
        run_lightning_cli(["fit", *tiny_args(tmp_path, "--model.rank", "4"), "--print_config"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "rank: 4" in out and "model_name: tiny-llama" in out


def test_run_lightning_cli_reads_the_command_line_it_was_started_with(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(REPO)
    argv = ["fit", *tiny_args(tmp_path, "--model.rank", "5"), "--print_config"]
    monkeypatch.setattr(sys, "argv", ["cli.py", *argv])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SystemExit) as stop:
            run_lightning_cli(list(argv))
    assert stop.value.code == 0
    assert "rank: 5" in capsys.readouterr().out
    # Lightning reads them from sys.argv itself: not given twice, so it does not warn about that
    assert not [w for w in caught if "args parameter" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:  # arguments other than sys.argv's: passed, and warned about
        warnings.simplefilter("always")
        with pytest.raises(SystemExit):
            run_lightning_cli(argv[:-1] + ["--model.rank", "6", "--print_config"])
    assert "rank: 6" in capsys.readouterr().out
    assert [w for w in caught if "args parameter" in str(w.message)]


@pytest.mark.parametrize(
    "more, message",
    [
        (["--model.rank", "0"], "error: rank must be a positive integer, got 0"),
        (["--data.data_files.plan", "nope/plan.jsonl.gz"], "error: data file not found: nope/plan.jsonl.gz"),
    ],
)
def test_run_lightning_cli_bad_values_are_one_line_and_exit_2(monkeypatch, tmp_path, capsys, more, message):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stop:
        run_lightning_cli(["fit", *tiny_args(tmp_path, *more)])
    assert stop.value.code == 2
    err = capsys.readouterr().err  # (Lightning's log lines may come too, where its handler's stream is this one)
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(message), err


# ----------------------------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("lit_cli_ckpt")
    m, dm = tiny_module(), tiny_data(tmp)
    trainer = tiny_trainer(tmp, max_steps=1)
    trainer.fit(m, dm)
    m.lora_model.init_adapters("random", seed=5, b_std=0.5)
    trainer.save_checkpoint(tmp / "model.ckpt")
    return tmp / "model.ckpt"


@pytest.mark.parametrize(
    "dtype, stored", [(None, torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16),
                      ("float16", torch.float16)],
)  # fmt: skip
def test_export_writes_the_adapters_in_the_dtype(ckpt, tmp_path, capsys, dtype, stored):
    out = tmp_path / "out"
    assert export(str(ckpt), str(out), dtype=dtype) == 0
    assert capsys.readouterr().out == f"exported plan, action, reflect to {out}\n"
    tensors = load_file(out / "lragent_adapters.safetensors")
    assert tensors and all(t.dtype == stored for t in tensors.values())
    assert all((out / role / "adapter_config.json").is_file() for role in ("plan", "action", "reflect"))
    config = json.loads((out / "train_config.json").read_text())
    assert config["data"]["max_length"] == 96 and config["data"]["batch_size"] == 4  # the checkpoint's data settings
    assert config["exported_from"] == {"checkpoint": str(ckpt), "epoch": 1, "global_step": 1}


def test_export_default_device_is_cpu(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert export(str(ckpt), str(out), device="cpu") == 0 and (out / "lragent_adapters.safetensors").is_file()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"dtype": "int8"}, ValueError, "--dtype 'int8' not supported: allowed float32, bfloat16, float16"),
        ({"dtype": "Float32"}, ValueError, "--dtype 'Float32' not supported: allowed float32, bfloat16, float16"),
        ({"device": "gpu"}, ValueError, "--device 'gpu' not supported: allowed cpu, cuda, cuda:N"),
        ({"device": "cudax"}, ValueError, "--device 'cudax' not supported: allowed cpu, cuda, cuda:N"),
        ({"device": "CPU"}, ValueError, "--device 'CPU' not supported: allowed cpu, cuda, cuda:N"),
    ],
)
def test_export_refuses_a_dtype_and_a_device(ckpt, tmp_path, kwargs, error, message):
    with pytest.raises(error) as err:
        export(str(ckpt), str(tmp_path / "out"), **kwargs)
    assert str(err.value) == message
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CUDA device where there is none")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_export_refuses_cuda_without_a_gpu(ckpt, tmp_path, device):
    with pytest.raises(ValueError) as err:
        export(str(ckpt), str(tmp_path / "out"), device=device)
    assert str(err.value) == f"--device {device}: no CUDA device here"


def test_export_refuses_a_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        export(str(tmp_path / "missing.ckpt"), str(tmp_path / "out"))
    assert str(err.value) == f"checkpoint not found: {tmp_path / 'missing.ckpt'}"
    with pytest.raises(FileNotFoundError) as err:
        export(str(tmp_path), str(tmp_path / "out"))  # a folder is no checkpoint file
    assert str(err.value) == f"checkpoint not found: {tmp_path}"


@pytest.mark.parametrize(
    "content, what",
    [
        ([1, 2], "no state_dict and hyper_parameters"),
        ({"hyper_parameters": {}}, "no state_dict and hyper_parameters"),
        ({"state_dict": {}}, "no state_dict and hyper_parameters"),
    ],
)
def test_export_refuses_a_file_that_is_no_checkpoint(tmp_path, content, what):
    path = tmp_path / "x.ckpt"
    torch.save(content, path)
    with pytest.raises(ValueError) as err:
        export(str(path), str(tmp_path / "out"))
    assert str(err.value) == f"{path} is not a Lightning checkpoint written by fit ({what})"
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_export_names_why_a_file_does_not_load_in_200_characters(tmp_path):
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError) as err:
        export(str(path), str(tmp_path / "out"))
    assert str(err.value).startswith(f"{path} is not a Lightning checkpoint written by fit (")
    # an object whose class is gone: the loader's long message is cut at 200 characters
    name = "lragent_gone_" + "m" * 230
    (tmp_path / f"{name}.py").write_text("class Gone:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        torch.save({"state_dict": __import__(name).Gone(), "hyper_parameters": {}}, path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
    (tmp_path / f"{name}.py").unlink()
    with pytest.raises(ValueError) as err:
        export(str(path), str(tmp_path / "out"))
    text = str(err.value)
    prefix = f"{path} is not a Lightning checkpoint written by fit ("
    assert text.startswith(prefix) and text.endswith(")")
    assert len(text) == len(prefix) + 200 + 1 and name[:150] in text
