"""``LoraFSDPStrategy``'s own checks and its adapter-only state, in one process (lit_modules/strategies.py): the
settings it refuses, the dtype rule of its root unit, parameter names without FSDP's wrappers, and a checkpoint
lacking adapter weights refused. The two-process FSDP fits are in tests/test_multi_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from datamodules import BYTE_VOCAB_SIZE
from lit_modules import MultiLoraModule
from lit_modules.strategies import LoraFSDPStrategy, clean_name


def test_the_wrappers_components_are_dropped_from_a_name_wherever_they_are() -> None:
    wrapped = "_fsdp_wrapped_module.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.lora_A.0"
    assert clean_name(wrapped) == "model.layers.0.mlp.lora_A.0"
    assert clean_name("model.layers.0.mlp.lora_A.0") == "model.layers.0.mlp.lora_A.0"


def test_settings_the_strategy_makes_itself_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="^LoraFSDPStrategy sets the auto_wrap_policy itself"):
        LoraFSDPStrategy(auto_wrap_policy={nn.Linear})
    with pytest.raises(ValueError, match="state_dict_type must be full, got 'sharded'$"):
        LoraFSDPStrategy(state_dict_type="sharded")
    assert LoraFSDPStrategy(state_dict_type="full") is not None


def test_a_root_unit_of_two_dtypes_is_refused_before_wrapping() -> None:
    """Tied embeddings in bf16 beside fp32 adapters cannot share FSDP's flat root unit: refused naming both, with
    what to run instead."""
    model = nn.Module()
    model.embed = nn.Embedding(8, 4).to(torch.bfloat16)
    model.head = nn.Linear(4, 8, bias=False).to(torch.bfloat16)
    model.head.weight = model.embed.weight  # tied: owned by two modules
    model.embed.weight.requires_grad_(False)
    model.adapter = nn.Linear(4, 4)  # trainable, fp32
    with pytest.raises(ValueError, match=re.escape("FSDP: the tied embedding weights (bfloat16, float32)")):
        LoraFSDPStrategy()._setup_model(model)


def test_a_checkpoint_lacking_adapter_weights_is_refused_and_a_whole_one_is_copied_in() -> None:
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte",
                        model_overrides={"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": 2})  # fmt: skip
    m.configure_model()
    strategy = LoraFSDPStrategy()
    strategy._lightning_module = m
    state = strategy.lightning_module_state_dict()
    assert set(state) == m.adapter_state_keys()
    stored = {k: torch.full_like(v, 0.5) for k, v in state.items()}
    strategy.load_model_state_dict({"state_dict": stored})
    assert all(torch.equal(p, stored[k]) for k, p in strategy._adapter_params().items())
    drop = sorted(stored)[0]
    del stored[drop]
    with pytest.raises(ValueError, match=f"^checkpoint has no weights for 1 adapter tensors, e.g. {re.escape(drop)}$"):
        strategy.load_model_state_dict({"state_dict": stored})
