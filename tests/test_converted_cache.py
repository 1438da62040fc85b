"""The embedded model's converted-weights cache under concurrent first use: a finished copy that another process may
be reading is never removed (12 GPU test workers once failed with "no file named model.safetensors" because a
later conversion deleted and replaced the directory under a reader)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lragent.converted_cache import is_converted as _is_converted
from lragent.converted_cache import publish_converted as _publish_converted


def _conversion(root: Path, name: str, tag: str, complete: bool = True) -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(tag)
    if complete:
        (d / "model.safetensors").write_text(tag)
    return d


def test_a_finished_copy_is_kept_and_ours_discarded(tmp_path: Path) -> None:
    target = _conversion(tmp_path, "target", "first")
    inode = (target / "model.safetensors").stat().st_ino
    tmp = _conversion(tmp_path, ".tmp-1", "second")
    _publish_converted(tmp, target)
    assert (target / "model.safetensors").read_text() == "first"
    assert (target / "model.safetensors").stat().st_ino == inode  # the very file a reader may hold open
    assert not tmp.exists()


def test_an_incomplete_copy_is_replaced(tmp_path: Path) -> None:
    target = _conversion(tmp_path, "target", "crashed", complete=False)
    tmp = _conversion(tmp_path, ".tmp-1", "fresh")
    _publish_converted(tmp, target)
    assert _is_converted(target) and (target / "model.safetensors").read_text() == "fresh"
    assert not tmp.exists()


def test_no_copy_yet_takes_ours(tmp_path: Path) -> None:
    tmp = _conversion(tmp_path, ".tmp-1", "only")
    _publish_converted(tmp, tmp_path / "target")
    assert (tmp_path / "target" / "model.safetensors").read_text() == "only" and not tmp.exists()


def _racing_rename(monkeypatch, tmp: Path, target: Path, racer_finishes: bool) -> None:
    """Another process writes ``target`` just before our rename of ``tmp`` (a complete copy or only its config), so
    the rename onto that non-empty directory fails."""
    rename = Path.rename

    def racing(self: Path, dest):
        if self == tmp:
            target.mkdir(exist_ok=True)
            (target / "config.json").write_text("racer")
            if racer_finishes:
                (target / "model.safetensors").write_text("racer")
        return rename(self, dest)

    monkeypatch.setattr(Path, "rename", racing)


def test_a_rename_lost_to_a_racer_that_finished_keeps_its_copy(tmp_path: Path, monkeypatch) -> None:
    """The rename fails because another process published first: no error, its copy is kept and ours removed."""
    tmp, target = _conversion(tmp_path, ".tmp-1", "ours"), tmp_path / "target"
    _racing_rename(monkeypatch, tmp, target, racer_finishes=True)
    _publish_converted(tmp, target)
    assert (target / "model.safetensors").read_text() == "racer" and not tmp.exists()


def test_a_rename_that_fails_without_a_finished_copy_raises_and_removes_ours(tmp_path: Path, monkeypatch) -> None:
    """A failed rename with no finished copy at the target is an error; our temporary copy is removed all the same."""
    tmp, target = _conversion(tmp_path, ".tmp-1", "ours"), tmp_path / "target"
    _racing_rename(monkeypatch, tmp, target, racer_finishes=False)
    with pytest.raises(OSError):
        _publish_converted(tmp, target)
    assert not tmp.exists() and not _is_converted(target)


def test_convert_once_makes_the_folder_converts_under_the_lock_and_then_reuses(tmp_path: Path, monkeypatch) -> None:
    """A first conversion creates the cache folder, holds ``.<name>.lock`` beside the target while it converts, gives
    the tokenizer the model's EOS, leaves no temporary folder, and a second call converts nothing."""
    from conftest import flock_held

    from lragent import converted_cache as cc
    from lragent.models import load_model

    gguf = tmp_path / "gguf" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "nested" / "model"
    lock = target.parent / ".model.lock"
    loads = []

    class Auto:
        @staticmethod
        def from_pretrained(folder, gguf_file, dtype):
            loads.append((Path(folder), gguf_file, dtype, flock_held(lock)))
            return load_model("tiny-llama")[0]

    class Tok:
        eos_token_id, eos_token = 0, "<s>"

        def convert_ids_to_tokens(self, i: int) -> str:
            return f"<tok{i}>"

        def save_pretrained(self, d) -> None:
            (Path(d) / "tokenizer_config.json").write_text(json.dumps({"eos_token": self.eos_token}))

    monkeypatch.setattr(cc, "AutoModelForCausalLM", Auto)
    monkeypatch.setattr(cc, "tokenizer_from", lambda folder, gguf_file: Tok())
    assert cc.convert_gguf_once(gguf, target, torch.float32) == target
    assert loads == [(gguf.parent, "m.gguf", torch.float32, True)]
    assert _is_converted(target) and not flock_held(lock)
    assert json.loads((target / "tokenizer_config.json").read_text())["eos_token"] == "<tok2>"  # tiny-llama's EOS id
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", "model"]
    assert cc.convert_gguf_once(gguf, target) == target and len(loads) == 1
