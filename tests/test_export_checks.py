"""Adapter export's checkpoint handling (lit_modules/export.py): a checkpoint lacking adapter weights is refused
naming it, a whole one lends its weights for the ``with`` block only, and the best checkpoint is taken only where its
file still exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import BYTE_VOCAB_SIZE
from lit_modules import MultiLoraModule
from lit_modules.export import adapters_from_checkpoint, best_checkpoint

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
