"""Adapter export's checkpoint handling (lit_modules/export.py): a checkpoint lacking adapter weights is refused
naming it, a whole one lends its weights for the ``with`` block only, and the best checkpoint is taken only where its
file still exists."""

from __future__ import annotations

import json
import logging
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy

from datamodules import BYTE_VOCAB_SIZE
from lit_modules import MultiLoraModule
from lit_modules.export import (
    ExportAdapters,
    adapters_from_checkpoint,
    best_checkpoint,
    checkpoint_source,
    export_adapters,
)

TINY = {"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": 2}


def test_a_checkpoint_lacking_adapter_weights_is_refused_naming_it_and_the_module_is_left_as_it_was(
    tmp_path: Path,
) -> None:
    """Missing adapter tensors: one error naming the file, how many and the first; the module's weights untouched.
    A whole checkpoint's weights hold inside the block, the module's own come back after it."""
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY)
    m.configure_model()
    keys = sorted(m.adapter_state_keys())
    params = dict(m.named_parameters())
    own = {k: params[k].detach().clone() for k in keys}
    stored = {k: torch.full_like(v, 0.5) for k, v in own.items()}
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": stored, "epoch": 1, "global_step": 7}, whole)
    with adapters_from_checkpoint(m, whole) as source:
        assert source["checkpoint"] == str(whole) and source["global_step"] == 7
        assert all(torch.equal(params[k], stored[k]) for k in keys)
    assert all(torch.equal(params[k], own[k]) for k in keys)
    lacking = tmp_path / "lacking.ckpt"
    torch.save({"state_dict": {k: v for k, v in stored.items() if k not in keys[:3]}}, lacking)
    message = f"^{re.escape(str(lacking))}: no weights for 3 adapter tensors, e.g. {re.escape(keys[0])}$"
    with pytest.raises(ValueError, match=message):
        with adapters_from_checkpoint(m, lacking):
            pass
    assert all(torch.equal(params[k], own[k]) for k in keys)


def test_the_best_checkpoint_is_the_first_monitoring_callbacks_whose_file_still_exists(tmp_path: Path) -> None:
    """A monitoring callback whose best file was removed is passed over for the next one's existing file; none left:
    None. A callback that monitors nothing never counts."""
    gone, kept, unmonitored = tmp_path / "gone.ckpt", tmp_path / "kept.ckpt", tmp_path / "last.ckpt"
    kept.write_bytes(b"ckpt")
    unmonitored.write_bytes(b"ckpt")
    first = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss")
    second = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max")
    plain = ModelCheckpoint(dirpath=tmp_path)
    first.best_model_path, second.best_model_path, plain.best_model_path = str(gone), str(kept), str(unmonitored)
    trainer = Trainer(callbacks=[plain, first, second], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    assert best_checkpoint(trainer) == str(kept)
    kept.unlink()
    assert best_checkpoint(trainer) is None


# ------------------------------------------------------------------------------ export_adapters and ExportAdapters


@pytest.fixture(scope="module")
def tiny_module() -> MultiLoraModule:
    """A configured tiny MultiLoraModule with distinct random adapters (tests restore whatever they change)."""
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY)
    m.configure_model()
    m.lora_model.init_adapters("random", seed=3, b_std=0.5)
    return m


def _native(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of ``out``'s native adapter checkpoint."""
    from safetensors import safe_open

    with safe_open(str(out / "lragent_adapters.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118  (safe_open has no __iter__)


def _own_adapters(m: MultiLoraModule) -> dict[str, torch.Tensor]:
    """The module's adapter tensors under the native checkpoint's names."""
    own = {}
    for name, layer in m.lora_model.lora_modules().items():
        own.update({f"{name}.lora_A.{i}": a.detach().clone() for i, a in enumerate(layer.lora_A)})
        own.update({f"{name}.lora_B.{i}": b.detach().clone() for i, b in enumerate(layer.lora_B)})
    return own


def _config(out: Path) -> dict:
    """``train_config.json`` of an export, checked to be the 2-space-indented JSON text ending in a newline."""
    text = (out / "train_config.json").read_text()
    config = json.loads(text)
    assert text == json.dumps(config, indent=2) + "\n"
    return config


def test_export_adapters_writes_every_role_dir_the_native_file_and_a_train_config_of_json_safe_values(
    tiny_module: MultiLoraModule, tmp_path: Path
) -> None:
    """Data and source settings are stored JSON-safe (tuples as lists, keys as strings, other objects as their
    repr); the same config rides in the native file's metadata; bfloat16 is named without ``torch.`` and used for
    every stored tensor; the base model is recorded in each PEFT config."""
    from safetensors.torch import load_file

    out = tmp_path / "bf16"
    data = {"max_length": 96, "splits": ("train", "val"), "weights": {1: 0.5, "b": [True, None]}, "root": Path("/d")}
    source = {"checkpoint": "x.ckpt", "epoch": 3, "steps": (1, 2)}
    paths = export_adapters(tiny_module, out, data, dtype="bfloat16", source=source)
    assert paths == {role: out / role for role in ("plan", "action", "reflect")}
    config = _config(out)
    assert set(config) == {"model", "data", "lora_config", "exported_from", "dtype"}
    assert config["model"]["model_name"] == "tiny-llama" and config["model"]["model_overrides"] == TINY
    assert config["model"]["roles"] is None and config["model"]["lr"] == tiny_module.hparams.lr
    assert config["data"] == {
        "max_length": 96,
        "splits": ["train", "val"],
        "weights": {"1": 0.5, "b": [True, None]},
        "root": repr(Path("/d")),
    }
    assert config["exported_from"] == {"checkpoint": "x.ckpt", "epoch": 3, "steps": [1, 2]}
    assert config["lora_config"] == tiny_module.lora_config.to_dict()
    assert config["dtype"] == "bfloat16"
    tensors, meta = _native(out)
    assert json.loads(meta["meta"]) == config
    own = _own_adapters(tiny_module)
    assert tensors.keys() == own.keys()
    assert all(tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], own[k].bfloat16()) for k in own)
    for role in paths:
        peft = json.loads((out / role / "adapter_config.json").read_text())
        assert peft["base_model_name_or_path"] == "tiny-llama" and peft["r"] == 8
        assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / role / "adapter_model.safetensors")).values())


def test_export_adapters_without_data_source_or_dtype_stores_empty_settings_and_the_modules_float32(
    tiny_module: MultiLoraModule, tmp_path: Path
) -> None:
    export_adapters(tiny_module, tmp_path)
    config = _config(tmp_path)
    assert config["data"] == {} and config["exported_from"] == {} and config["dtype"] is None
    tensors, meta = _native(tmp_path)
    own = _own_adapters(tiny_module)
    assert all(tensors[k].dtype == torch.float32 and torch.equal(tensors[k], own[k]) for k in own)
    assert json.loads(meta["meta"]) == config


def test_export_adapters_of_a_module_without_a_model_name_records_no_base_model(
    tiny_module: MultiLoraModule, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(tiny_module.hparams, "model_name", "")
    export_adapters(tiny_module, tmp_path)
    assert json.loads((tmp_path / "plan" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert _config(tmp_path)["model"]["model_name"] == ""


def test_checkpoint_source_reads_epoch_step_and_the_first_monitoring_model_checkpoints_score() -> None:
    """Callbacks that are not a ModelCheckpoint, or one that monitors nothing, are passed over; the score is a
    float; a checkpoint without callbacks gives epoch and step only."""
    ckpt = {
        "epoch": 3,
        "global_step": 17,
        "callbacks": {
            "EarlyStopping{'monitor': 'val/acc'}": {"monitor": "val/acc", "current_score": torch.tensor(0.1)},
            "ModelCheckpoint{'monitor': None}": {"monitor": None, "current_score": None},
            "ModelCheckpoint{'monitor': 'val/loss'}": {"monitor": "val/loss", "current_score": torch.tensor(2.5)},
            "ModelCheckpoint{'monitor': 'val/f1'}": {"monitor": "val/f1", "current_score": torch.tensor(0.7)},
        },
    }
    source = checkpoint_source(ckpt, Path("/runs/best.ckpt"))
    assert source == {
        "checkpoint": "/runs/best.ckpt",
        "epoch": 3,
        "global_step": 17,
        "monitor": "val/loss",
        "score": 2.5,
    }
    assert type(source["score"]) is float
    unscored = {"callbacks": {"ModelCheckpoint{}": {"monitor": "val/loss", "current_score": None}}, "epoch": 0}
    assert checkpoint_source(unscored, "a.ckpt") == {
        "checkpoint": "a.ckpt",
        "epoch": 0,
        "global_step": None,
        "monitor": "val/loss",
        "score": None,
    }
    assert checkpoint_source({"epoch": 1, "global_step": 2, "callbacks": None}, "b.ckpt") == {
        "checkpoint": "b.ckpt",
        "epoch": 1,
        "global_step": 2,
    }


@pytest.fixture
def export_log(caplog: pytest.LogCaptureFixture):
    """The INFO lines of Lightning's rank-zero logger (its parent may not propagate them to the root logger)."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger=logger.name)
    yield caplog
    logger.removeHandler(caplog.handler)


def _trainer(tmp_path: Path, **kwargs) -> SimpleNamespace:
    """The parts of a Trainer that ExportAdapters reads, as a finished one-device fit would have them."""
    fields = dict(
        strategy=SingleDeviceStrategy(torch.device("cpu")),
        is_global_zero=True,
        log_dir=None,
        default_root_dir=str(tmp_path / "root"),
        datamodule=None,
        current_epoch=2,
        global_step=9,
        checkpoint_callbacks=[],
    )
    return SimpleNamespace(**{**fields, **kwargs})


def _best_checkpoint(m: MultiLoraModule, tmp_path: Path) -> tuple[Path, ModelCheckpoint]:
    """A best checkpoint (every adapter tensor 0.5, epoch 1, step 7, val/loss 2.0) and its monitoring callback."""
    stored = {k: torch.full_like(v, 0.5) for k, v in m.named_parameters() if k in m.adapter_state_keys()}
    path = tmp_path / "best.ckpt"
    callbacks = {"ModelCheckpoint{'monitor': 'val/loss'}": {"monitor": "val/loss", "current_score": torch.tensor(2.0)}}
    torch.save({"state_dict": stored, "epoch": 1, "global_step": 7, "callbacks": callbacks}, path)
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss")
    cb.best_model_path = str(path)
    return path, cb


def test_export_at_fit_end_with_best_off_writes_the_last_weights_with_the_trainers_epoch_step_and_data(
    tiny_module: MultiLoraModule, tmp_path: Path, export_log: pytest.LogCaptureFixture
) -> None:
    """best=False ignores an existing best checkpoint; a one-device fit exports nothing at on_train_end."""
    _, ckpt_cb = _best_checkpoint(tiny_module, tmp_path)
    dm = SimpleNamespace(hparams={"max_length": 96, "splits": ("train",)})
    trainer = _trainer(tmp_path, datamodule=dm, checkpoint_callbacks=[ckpt_cb])
    out = tmp_path / "out"
    export = ExportAdapters(str(out), best=False, dtype="bfloat16")
    export.on_fit_start(trainer, tiny_module)
    export.on_train_end(trainer, tiny_module)
    assert not out.exists()
    export.on_fit_end(trainer, tiny_module)
    config = _config(out)
    assert config["exported_from"] == {"checkpoint": None, "epoch": 2, "global_step": 9}
    assert config["data"] == {"max_length": 96, "splits": ["train"]} and config["dtype"] == "bfloat16"
    tensors, _ = _native(out)
    own = _own_adapters(tiny_module)
    assert all(tensors[k].dtype == torch.bfloat16 and torch.equal(tensors[k], own[k].bfloat16()) for k in own)
    assert set(export_log.messages) == {f"adapters (last weights) exported to {out} (plan, action, reflect)"}


def test_export_at_fit_end_writes_the_best_checkpoints_weights_and_source_and_restores_the_modules_own(
    tiny_module: MultiLoraModule, tmp_path: Path, export_log: pytest.LogCaptureFixture
) -> None:
    """best=True is the default: the best checkpoint's adapters (not the last weights) in the requested dtype, its
    epoch, step, monitor and score as the source, the data settings, and the module's weights back afterwards."""
    best, ckpt_cb = _best_checkpoint(tiny_module, tmp_path)
    dm = SimpleNamespace(hparams={"max_length": 64})
    trainer = _trainer(tmp_path, datamodule=dm, checkpoint_callbacks=[ckpt_cb])
    out = tmp_path / "out"
    own = _own_adapters(tiny_module)
    export = ExportAdapters(str(out), dtype="bfloat16")
    export.on_fit_start(trainer, tiny_module)
    export.on_fit_end(trainer, tiny_module)
    config = _config(out)
    assert config["exported_from"] == {
        "checkpoint": str(best),
        "epoch": 1,
        "global_step": 7,
        "monitor": "val/loss",
        "score": 2.0,
    }
    assert config["data"] == {"max_length": 64} and config["dtype"] == "bfloat16"
    tensors, _ = _native(out)
    assert tensors.keys() == own.keys()
    assert all(t.dtype == torch.bfloat16 and bool((t == 0.5).all()) for t in tensors.values())
    after = _own_adapters(tiny_module)
    assert all(torch.equal(after[k], own[k]) for k in own)
    assert set(export_log.messages) == {
        f"adapters of the best checkpoint {best} exported to {out} (plan, action, reflect)"
    }


def test_export_without_an_out_dir_goes_to_adapters_under_the_log_dir_else_under_the_default_root(
    tiny_module: MultiLoraModule, tmp_path: Path
) -> None:
    """No datamodule: empty data settings; no dtype: float32 and ``dtype`` null; no best checkpoint: last weights."""
    export = ExportAdapters()
    assert export.out_dir is None and export.best is True and export.dtype is None
    logged = _trainer(tmp_path, log_dir=str(tmp_path / "logs"))
    export.on_fit_start(logged, tiny_module)
    export.on_fit_end(logged, tiny_module)
    config = _config(tmp_path / "logs" / "adapters")
    assert config["data"] == {} and config["dtype"] is None
    assert config["exported_from"] == {"checkpoint": None, "epoch": 2, "global_step": 9}
    assert {p.name for p in (tmp_path / "logs" / "adapters").iterdir()} == {
        "plan",
        "action",
        "reflect",
        "lragent_adapters.safetensors",
        "train_config.json",
    }
    unlogged = _trainer(tmp_path)
    export.on_fit_start(unlogged, tiny_module)
    export.on_fit_end(unlogged, tiny_module)
    assert (tmp_path / "root" / "adapters" / "train_config.json").is_file()


def test_export_callback_refuses_an_unknown_dtype_when_built() -> None:
    with pytest.raises(ValueError, match="dtype 'float8' not supported"):
        ExportAdapters(dtype="float8")
    assert ExportAdapters(dtype="bf16").dtype == "bf16"


def test_only_rank_zero_exports_at_fit_end_and_a_fresh_callback_exports_without_on_fit_start(
    tiny_module: MultiLoraModule, tmp_path: Path
) -> None:
    other_rank = _trainer(tmp_path, is_global_zero=False)
    ExportAdapters(str(tmp_path / "rank1"), best=False).on_fit_end(other_rank, tiny_module)
    assert not (tmp_path / "rank1").exists()
    ExportAdapters(str(tmp_path / "rank0"), best=False).on_fit_end(_trainer(tmp_path), tiny_module)
    assert (tmp_path / "rank0" / "train_config.json").is_file()


def test_under_fsdp_the_export_happens_at_train_end_inside_one_non_recursive_read_only_gather(
    tiny_module: MultiLoraModule, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank gathers the root unit's parameters (recurse=False, writeback=False), rank 0 writes inside the
    gather, and fit end does not export a second time; a new fit (on_fit_start) exports at its end again."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    gathers: list[tuple] = []
    written_inside: list[bool] = []
    out = tmp_path / "out"

    @contextmanager
    def summon(module, recurse=True, writeback=True, **kwargs):
        gathers.append((module, recurse, writeback))
        yield
        written_inside.append((out / "train_config.json").is_file())

    monkeypatch.setattr(FSDP, "summon_full_params", summon)
    strategy = FSDPStrategy()
    strategy.model = torch.nn.Linear(2, 2)
    export = ExportAdapters(str(out), best=False)
    rank1 = _trainer(tmp_path, strategy=strategy, is_global_zero=False)
    export.on_fit_start(rank1, tiny_module)
    export.on_train_end(rank1, tiny_module)
    assert gathers == [(strategy.model, False, False)] and written_inside == [False] and not out.exists()
    rank0 = _trainer(tmp_path, strategy=strategy)
    export.on_fit_start(rank0, tiny_module)
    export.on_train_end(rank0, tiny_module)
    assert gathers[1] == (strategy.model, False, False) and written_inside[1] is True
    shutil.rmtree(out)
    export.on_fit_end(rank0, tiny_module)
    assert not out.exists()
    export.on_fit_start(rank0, tiny_module)
    export.on_fit_end(rank0, tiny_module)
    assert (out / "train_config.json").is_file()
