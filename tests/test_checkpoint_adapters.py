"""What a Lightning checkpoint of the module keeps (the adapters, not the frozen base) and a checkpoint that lacks some
adapter weights refused in one line (lit_modules/multi_lora_module.py), on the real module and its real state."""

from __future__ import annotations

import re

import pytest

from datamodules import BYTE_VOCAB_SIZE
from lit_modules import MultiLoraModule

TINY = {"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": 2}


def test_a_checkpoint_keeps_the_adapters_and_one_missing_some_is_refused_naming_how_many() -> None:
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY)
    m.configure_model()
    ckpt = {"state_dict": m.state_dict()}
    m.on_save_checkpoint(ckpt)
    keys = m.adapter_state_keys()
    kept = {k for k in ckpt["state_dict"] if k.startswith("lora_model.")}
    assert keys and kept == keys  # the adapters, and nothing of the frozen base
    assert ckpt["lora_config"] == m.lora_config.to_dict()
    m.on_load_checkpoint(ckpt)  # complete: taken
    drop = sorted(keys)[:2]
    for k in drop:
        del ckpt["state_dict"][k]
    message = f"^checkpoint has no weights for 2 adapter tensors, e.g. {re.escape(drop[0])}$"
    with pytest.raises(ValueError, match=message):
        m.on_load_checkpoint(ckpt)
