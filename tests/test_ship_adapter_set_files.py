"""scripts/ship_adapter_set.py's files: a source without its native checkpoint is refused before the target is
touched; the target set is replaced whole (nothing of an older set left), or created where it did not exist, with the
PEFT role directories, the native checkpoint in the set's dtype and train_config.json naming where it was shipped
from."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import load_script, tiny_multi_lora
from safetensors import safe_open
from safetensors.torch import load_file

from lragent.adapters_io import NATIVE_FILE, PEFT_CONFIG, export_peft

ROLES = ("plan", "action", "reflect")
TRAIN_CONFIG = {"model": {"model_name": "tiny-llama"}, "dtype": "bfloat16", "lam": 0.5}


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("ship_adapter_set")


def _study_set(path: Path) -> Path:
    """A study set's adapters directory as the study packs it: the native checkpoint and train_config.json."""
    export_peft(tiny_multi_lora("tiny-llama", rank=4, b_std=0.3), path)
    for role in ROLES:  # the study keeps only the native checkpoint
        for f in (path / role).iterdir():
            f.unlink()
        (path / role).rmdir()
    (path / "train_config.json").write_text(json.dumps(TRAIN_CONFIG))
    return path


def test_a_source_without_its_native_checkpoint_is_refused_and_the_target_kept(
    script: ModuleType, tmp_path: Path
) -> None:
    """No lragent_adapters.safetensors in the source: one line naming it, and the existing target set untouched."""
    src, dst = tmp_path / "study", tmp_path / "shipped"
    src.mkdir()
    (src / "train_config.json").write_text(json.dumps(TRAIN_CONFIG))
    dst.mkdir()
    (dst / "train_config.json").write_text("the shipped set")
    with pytest.raises(FileNotFoundError, match=f"^{src / NATIVE_FILE} not found$"):
        script.ship(str(src), str(dst))
    assert [p.name for p in dst.iterdir()] == ["train_config.json"]
    assert (dst / "train_config.json").read_text() == "the shipped set"


def test_shipping_replaces_the_target_set_whole(script: ModuleType, tmp_path: Path) -> None:
    """An existing target is deleted first: a file and a role of the older set are gone; the new set has every
    role's PEFT directory, the native checkpoint stored in the set's dtype with the source's weights, and
    train_config.json with shipped_from added."""
    src, dst = _study_set(tmp_path / "study"), tmp_path / "shipped"
    (dst / "critic").mkdir(parents=True)
    (dst / "critic" / PEFT_CONFIG).write_text("{}")
    (dst / "notes.txt").write_text("stale")
    assert script.ship(str(src), str(dst)) == 0
    assert sorted(p.name for p in dst.iterdir()) == sorted([*ROLES, NATIVE_FILE, "train_config.json"])
    assert all((dst / role / PEFT_CONFIG).is_file() for role in ROLES)
    assert json.loads((dst / "train_config.json").read_text()) == {**TRAIN_CONFIG, "shipped_from": str(src)}
    before, after = load_file(str(src / NATIVE_FILE)), load_file(str(dst / NATIVE_FILE))
    assert sorted(after) == sorted(before)
    for name, t in after.items():
        assert t.dtype == torch.bfloat16, name
        torch.testing.assert_close(t, before[name].to(torch.bfloat16), rtol=0, atol=0)


def test_shipping_creates_a_target_that_does_not_exist(script: ModuleType, tmp_path: Path) -> None:
    """A target directory that does not exist yet (its parents neither) is created with the whole set."""
    src, dst = _study_set(tmp_path / "study"), tmp_path / "data" / "adapters" / "new_set"
    assert script.ship(str(src), str(dst)) == 0
    assert sorted(p.name for p in dst.iterdir()) == sorted([*ROLES, NATIVE_FILE, "train_config.json"])
    assert json.loads((dst / "train_config.json").read_text())["shipped_from"] == str(src)


def test_the_command_line_ships_and_says_what_it_wrote(script: ModuleType, tmp_path: Path, capsys) -> None:
    """SOURCE TARGET as positionals; one line naming both and the set's entries; train_config.json written as
    `lragent export` writes it (indented by 2, a final newline); the PEFT configs name the set's base model."""
    src, dst = _study_set(tmp_path / "study"), tmp_path / "shipped"
    assert script.main([str(src), str(dst)]) == 0
    entries = sorted([*ROLES, NATIVE_FILE, "train_config.json"])
    assert capsys.readouterr().out == f"{src} -> {dst}: {entries}\n"
    config = {**TRAIN_CONFIG, "shipped_from": str(src)}
    assert (dst / "train_config.json").read_text() == json.dumps(config, indent=2) + "\n"
    for role in ROLES:
        assert json.loads((dst / role / PEFT_CONFIG).read_text())["base_model_name_or_path"] == "tiny-llama"
    with safe_open(str(dst / NATIVE_FILE), "pt") as native:  # the native checkpoint carries the config too
        assert json.loads(native.metadata()["meta"]) == config


def test_the_command_line_names_itself_and_refuses_a_bad_source_in_one_line(
    script: ModuleType, tmp_path: Path, capsys
) -> None:
    with pytest.raises(SystemExit) as exc:
        script.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: scripts/ship_adapter_set.py") and "source" in out and "target" in out
    missing = tmp_path / "nothing"
    assert script.main([str(missing), str(tmp_path / "shipped")]) == 2
    assert capsys.readouterr().err == f"error: {missing / NATIVE_FILE} not found\n"
    assert not (tmp_path / "shipped").exists()


def test_a_set_without_a_dtype_ships_in_float32(script: ModuleType, tmp_path: Path) -> None:
    src, dst = _study_set(tmp_path / "study"), tmp_path / "shipped"
    (src / "train_config.json").write_text(json.dumps({"model": {"model_name": "tiny-llama"}}))
    assert script.ship(str(src), str(dst)) == 0
    before, after = load_file(str(src / NATIVE_FILE)), load_file(str(dst / NATIVE_FILE))
    for name, t in after.items():
        assert t.dtype == torch.float32, name
        torch.testing.assert_close(t, before[name].float(), rtol=0, atol=0)
