"""The served model (lragent/serving/model.py): the adapter set's roles plus the base model as one more role, loaded
from a native checkpoint or from PEFT role directories alike; a role named like the base model, a model without a
tokenizer and adapters of other shapes are refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_multi_lora

from lragent.adapters_io import NATIVE_FILE, export_peft
from lragent.serving import model as served

TOKENIZER = object()  # stands in for a tokenizer: the tiny architectures have none


@pytest.fixture(scope="module")
def source():
    return tiny_multi_lora("tiny-llama", rank=4, b_std=0.3)


@pytest.fixture(scope="module")
def export(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    export_peft(source, out)
    return out


@pytest.fixture
def with_tokenizer(monkeypatch):
    """The real model loader, with a tokenizer given to the tiny architectures."""
    load = served.load_model
    monkeypatch.setattr(served, "load_model", lambda name, **kw: (load(name, **kw)[0], TOKENIZER))


def test_a_role_named_like_the_base_model_is_refused(export: Path) -> None:
    """A stored role with the base model's role name is refused (two roles would share one name)."""
    with pytest.raises(ValueError) as info:
        served.load_served_model(model="tiny-llama", adapters=str(export), base_name="action", device="cpu")
    assert str(info.value) == f"--adapters {export}: a role is named 'action', the base model's name; rename it"


def test_a_model_without_a_tokenizer_cannot_be_served(export: Path) -> None:
    """A random-weights architecture (no tokenizer) is refused: a server turns text into tokens."""
    with pytest.raises(ValueError, match="^--model 'tiny-llama' has random weights and no tokenizer: a server needs"):
        served.load_served_model(model="tiny-llama", adapters=str(export), device="cpu")


def test_adapters_of_other_shapes_are_refused_naming_the_tensor(export: Path, with_tokenizer) -> None:
    """tiny-mistral's v_proj is 16 wide (1 KV head), the tiny-llama set's B is 32."""
    path = export / NATIVE_FILE
    with pytest.raises(ValueError) as info:
        served.load_served_model(model="tiny-mistral", adapters=str(export), device="cpu")
    assert str(info.value) == (
        f"{path}: model.layers.0.self_attn.v_proj.lora_B.0 has shape (32, 4), the model expects (16, 4)"
    )


@pytest.mark.parametrize("layout", ["native", "peft"])
def test_every_stored_role_is_loaded_and_the_base_role_is_the_base_model(
    source, export: Path, tmp_path: Path, with_tokenizer, layout: str
) -> None:
    """From the native checkpoint or (without it) the PEFT role directories: each stored role's A and B as saved, the
    base-model role last with B = 0."""
    adapters = export
    if layout == "peft":
        adapters = Path(shutil.copytree(export, tmp_path / "peft"))
        (adapters / NATIVE_FILE).unlink()
    lm, tok = served.load_served_model(model="tiny-llama", adapters=str(adapters), device="cpu")
    assert tok is TOKENIZER and lm.lora_config.roles == ("plan", "action", "reflect", "tiny-llama")
    mods, want = lm.lora_modules(), source.lora_modules()
    assert mods.keys() == want.keys()
    for name, module in mods.items():
        assert torch.equal(module.lora_A[0], want[name].lora_A[0]), name
        for i in range(3):
            assert torch.equal(module.lora_B[i], want[name].lora_B[i]), (name, i)
        assert not module.lora_B[3].any(), name
