"""Adapter sets that cannot be loaded, each refused with one line naming the file and what is wrong
(lragent/adapters_io.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_multi_lora
from safetensors.torch import load_file, save_file

from lragent.adapters_io import (
    NATIVE_FILE,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_config_of,
    export_peft,
    load_adapter_dir,
    load_native,
    load_peft_role,
    read_peft_config,
)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    export_peft(tiny_multi_lora("tiny-llama", rank=4, b_std=0.3), out)
    return out


def _peft_only(export: Path, dst: Path) -> Path:
    shutil.copytree(export, dst)
    (dst / NATIVE_FILE).unlink()
    return dst


def test_a_peft_config_that_is_not_usable_is_named(tmp_path: Path) -> None:
    path = tmp_path / PEFT_CONFIG
    path.write_text("{r: 4")
    with pytest.raises(ValueError, match=f"^{path} is not a readable PEFT adapter config"):
        read_peft_config(path)
    for field, value, message in (
        ("lora_alpha", 0, "lora_alpha must be a positive number, got 0"),
        ("lora_alpha", True, "lora_alpha must be a positive number, got True"),
        ("target_modules", [], "target_modules must be a non-empty list of module names, got []"),
    ):
        path.write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], field: value}))
        with pytest.raises(ValueError, match=f"^{path}: " + message.replace("[", r"\[").replace("]", r"\]")):
            read_peft_config(path)


def test_a_native_checkpoint_missing_or_of_another_layout_is_refused(export: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"^adapter checkpoint {tmp_path / 'none'} does not exist$"):
        load_native(tiny_multi_lora(rank=4), tmp_path / "none")
    with pytest.raises(ValueError, match=f"^adapter checkpoint {export / NATIVE_FILE} has rank=4, the model has 8$"):
        load_native(tiny_multi_lora(rank=8), export / NATIVE_FILE)
    with pytest.raises(FileNotFoundError, match="has no adapter for roles \\['critic'\\]$"):
        adapter_config_of(export, roles=["plan", "critic"])


def test_peft_role_directories_that_do_not_fit_the_model_are_refused(export: Path, tmp_path: Path) -> None:
    model = tiny_multi_lora(rank=4)
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path} is not a PEFT adapter directory \\(no {PEFT_CONFIG}\\)$"):
        load_peft_role(model, tmp_path, "plan")
    with pytest.raises(ValueError, match=f"^{export / 'plan'}: r=4, lora_alpha=.* differ from the model's r=8"):
        load_peft_role(tiny_multi_lora(rank=8), export / "plan", "plan")
    partial = _peft_only(export, tmp_path / "partial")
    weights = load_file(str(partial / "plan" / PEFT_WEIGHTS))
    dropped = sorted(weights)[0]
    save_file({k: v for k, v in weights.items() if k != dropped}, str(partial / "plan" / PEFT_WEIGHTS))
    name = dropped.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    with pytest.raises(ValueError, match=f"^{partial / 'plan'} has no adapter for {name}$"):
        load_peft_role(model, partial / "plan", "plan")
    other = tmp_path / "other"
    export_peft(tiny_multi_lora("tiny-llama", rank=4, b_std=0.3, seed=5), other)  # another shared A
    load_peft_role(model, export / "plan", "plan")  # the first role sets the shared A
    with pytest.raises(ValueError, match=f"^{other / 'action'}: lora_A of .* differs from the shared A"):
        load_peft_role(model, other / "action", "action")


def test_adapter_directories_without_every_piece_are_named(export: Path, tmp_path: Path) -> None:
    model = tiny_multi_lora(rank=4)
    with pytest.raises(FileNotFoundError, match=f"^adapter directory {tmp_path / 'none'} does not exist$"):
        load_adapter_dir(model, tmp_path / "none")
    no_action = _peft_only(export, tmp_path / "no_action")
    shutil.rmtree(no_action / "action")
    with pytest.raises(FileNotFoundError, match=f"no {NATIVE_FILE} and no PEFT directory for \\['action'\\]$"):
        load_adapter_dir(model, no_action)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"^adapter directory {empty} has neither {NATIVE_FILE} nor PEFT"):
        adapter_config_of(empty)
    differ = _peft_only(export, tmp_path / "differ")
    cfg = json.loads((differ / "reflect" / PEFT_CONFIG).read_text())
    (differ / "reflect" / PEFT_CONFIG).write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 2}))
    with pytest.raises(ValueError, match=f"^{differ / 'reflect' / PEFT_CONFIG}: r, lora_alpha or target_modules"):
        adapter_config_of(differ)
    no_weights = _peft_only(export, tmp_path / "no_weights")
    (no_weights / "action" / PEFT_WEIGHTS).unlink()
    with pytest.raises(
        FileNotFoundError, match=f"^PEFT adapter directory {no_weights / 'action'} has no {PEFT_WEIGHTS}"
    ):
        adapter_config_of(no_weights)


def test_adapters_of_another_architectures_shapes_are_refused_naming_the_tensor(export: Path) -> None:
    """Same roles, rank and targets, but v_proj is narrower (tiny-mistral: 1 KV head, tiny-llama's set: 2)."""
    narrow = tiny_multi_lora("tiny-mistral", rank=4)
    shapes = r"has shape \(32, 4\), the model expects \(16, 4\)$"
    path = export / NATIVE_FILE
    with pytest.raises(ValueError, match=rf"^{path}: model\.layers\.0\.self_attn\.v_proj\.lora_B\.0 {shapes}"):
        load_native(narrow, path)
    with pytest.raises(ValueError, match=rf"^{export / 'plan'}: model\.layers\.0\.self_attn\.v_proj lora_B {shapes}"):
        load_peft_role(narrow, export / "plan", "plan")
