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


def test_cache_dir_is_lragent_cache_when_set_else_dot_cache_lragent_under_home(tmp_path: Path, monkeypatch) -> None:
    from lragent.converted_cache import cache_dir

    monkeypatch.setenv("LRAGENT_CACHE", str(tmp_path / "shared"))
    assert cache_dir() == tmp_path / "shared"
    monkeypatch.delenv("LRAGENT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "lragent"


def _saved_tokenizer(folder: Path, kind: str) -> Path:
    """A tokenizer saved with ``clean_up_tokenization_spaces=True``: a fast BPE or WordLevel one, or ByT5's slow
    (pure-Python) one, which has no ``backend_tokenizer``."""
    from tokenizers import Tokenizer, models
    from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

    if kind == "byt5":
        ByT5Tokenizer(clean_up_tokenization_spaces=True).save_pretrained(folder)
        return folder
    if kind == "bpe":
        backend = models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "<unk>": 3}, merges=[("a", "b")], unk_token="<unk>")
    else:
        backend = models.WordLevel(vocab={"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(backend), clean_up_tokenization_spaces=True, unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return folder


def test_tokenizer_from_switches_the_space_clean_up_off_for_a_bpe_tokenizer_only(tmp_path: Path) -> None:
    """A BPE tokenizer saved with the clean-up on loads with it off (exactly False); a WordLevel one and a slow
    tokenizer without a backend keep theirs (True)."""
    from lragent.converted_cache import tokenizer_from

    bpe = tokenizer_from(_saved_tokenizer(tmp_path / "bpe", "bpe"))
    assert type(bpe.backend_tokenizer.model).__name__ == "BPE"
    assert bpe.clean_up_tokenization_spaces is False
    assert bpe.convert_ids_to_tokens(bpe("ab")["input_ids"]) == ["ab"]  # the tokenizer saved there, merges and all
    word_level = tokenizer_from(_saved_tokenizer(tmp_path / "wl", "wordlevel"))
    assert word_level.clean_up_tokenization_spaces is True
    slow = tokenizer_from(_saved_tokenizer(tmp_path / "byt5", "byt5"))
    assert not hasattr(slow, "backend_tokenizer") and slow.clean_up_tokenization_spaces is True


def test_tokenizer_from_passes_its_keyword_arguments_to_from_pretrained(tmp_path: Path) -> None:
    from lragent.converted_cache import tokenizer_from

    tok = tokenizer_from(_saved_tokenizer(tmp_path / "bpe", "bpe"), model_max_length=7, padding_side="left")
    assert (tok.model_max_length, tok.padding_side) == (7, "left")


def _fake_gguf_loading(monkeypatch, tmp_path: Path, eos_ids=None, quantized=False, save=None) -> tuple[Path, dict]:
    """``convert_gguf_once``'s transformers loaders replaced by a tiny random LLaMA (its generation EOS ``eos_ids``
    when given; a GGUF ``quantization_config`` when ``quantized``) and a tokenizer whose EOS id is 0 (``save``, if
    given, replaces its ``save_pretrained``). Returns the GGUF path and what the fakes saw."""
    from lragent import converted_cache as cc
    from lragent.models import load_model

    gguf = tmp_path / "gguf" / "m.gguf"
    gguf.parent.mkdir(exist_ok=True)
    gguf.write_bytes(b"GGUF")
    seen: dict = {"tokenizer_from": [], "published": []}

    class Auto:
        @staticmethod
        def from_pretrained(folder, gguf_file, dtype):
            model = load_model("tiny-llama")[0]
            if eos_ids is not None:
                model.generation_config.eos_token_id = eos_ids
            if quantized:
                model.config.quantization_config = {"quant_method": "gguf"}
            return model

    class Tok:
        eos_token_id, eos_token = 0, "<s>"

        def convert_ids_to_tokens(self, i) -> str:
            return f"<tok{i}>"

        def save_pretrained(self, d) -> None:
            if save is not None:
                save(Path(d))
            (Path(d) / "tokenizer_config.json").write_text(json.dumps({"eos_token": self.eos_token}))

    def tokenizer_from(source, **kwargs):
        seen["tokenizer_from"].append((source, kwargs))
        return Tok()

    publish = cc.publish_converted

    def publish_spy(tmp: Path, target: Path) -> None:
        seen["published"].append((tmp, sorted(p.name for p in tmp.iterdir())))
        publish(tmp, target)

    monkeypatch.setattr(cc, "AutoModelForCausalLM", Auto)
    monkeypatch.setattr(cc, "tokenizer_from", tokenizer_from)
    monkeypatch.setattr(cc, "publish_converted", publish_spy)
    return gguf, seen


def test_convert_once_reads_the_tokenizer_from_the_gguf_beside_it(tmp_path: Path, monkeypatch) -> None:
    from lragent.converted_cache import convert_gguf_once

    gguf, seen = _fake_gguf_loading(monkeypatch, tmp_path)
    convert_gguf_once(gguf, tmp_path / "cache" / "model")
    assert seen["tokenizer_from"] == [(gguf.parent, {"gguf_file": "m.gguf"})]


def test_convert_once_writes_into_a_hidden_tmp_folder_beside_the_target_then_publishes_it(
    tmp_path: Path, monkeypatch
) -> None:
    """The whole conversion is written into ``.tmp-*`` in the target's own folder (same file system: the rename that
    publishes it is atomic; hidden: never mistaken for a model), and only then published."""
    from lragent.converted_cache import convert_gguf_once

    gguf, seen = _fake_gguf_loading(monkeypatch, tmp_path)
    target = tmp_path / "cache" / "model"
    convert_gguf_once(gguf, target)
    [(tmp, files)] = seen["published"]
    assert tmp.parent == target.parent and tmp.name.startswith(".tmp-")
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(files)
    assert not tmp.exists() and _is_converted(target)


def test_convert_once_into_a_cache_folder_that_already_holds_another_model(tmp_path: Path, monkeypatch) -> None:
    from lragent.converted_cache import convert_gguf_once

    gguf, _ = _fake_gguf_loading(monkeypatch, tmp_path)
    first, second = tmp_path / "cache" / "first", tmp_path / "cache" / "second"
    assert convert_gguf_once(gguf, first) == first and convert_gguf_once(gguf, second) == second
    assert _is_converted(first) and _is_converted(second)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".first.lock", ".second.lock", "first", "second"]


def test_convert_once_keeps_the_tokenizer_eos_when_the_model_has_several_eos_ids(tmp_path: Path, monkeypatch) -> None:
    """Only a single int EOS id of the model replaces the tokenizer's EOS; a list of them leaves it as it is."""
    from lragent.converted_cache import convert_gguf_once

    gguf, _ = _fake_gguf_loading(monkeypatch, tmp_path, eos_ids=[2, 7])
    target = convert_gguf_once(gguf, tmp_path / "cache" / "model")
    assert json.loads((target / "tokenizer_config.json").read_text())["eos_token"] == "<s>"


def test_convert_once_saves_the_dequantised_model_without_the_gguf_quantization_config(
    tmp_path: Path, monkeypatch
) -> None:
    from lragent.converted_cache import convert_gguf_once

    gguf, _ = _fake_gguf_loading(monkeypatch, tmp_path, quantized=True)
    target = convert_gguf_once(gguf, tmp_path / "cache" / "model")
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config


def test_convert_once_logs_which_gguf_it_converts_into_which_folder(tmp_path: Path, monkeypatch, caplog) -> None:
    """The first use announces the slow conversion at INFO, naming the GGUF and the target folder."""
    import logging

    from lragent.converted_cache import convert_gguf_once

    gguf, _ = _fake_gguf_loading(monkeypatch, tmp_path)
    target = tmp_path / "cache" / "model"
    with caplog.at_level(logging.INFO, logger="lragent.converted_cache"):
        convert_gguf_once(gguf, target)
    named = [r for r in caplog.records if str(gguf) in r.getMessage() and str(target) in r.getMessage()]
    assert [r.levelno for r in named] == [logging.INFO]


def _disk_full(folder: Path) -> None:
    raise RuntimeError("disk full")


def _vanished(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder)
    raise RuntimeError("folder vanished")


@pytest.mark.parametrize("save, error", [(_disk_full, "disk full"), (_vanished, "folder vanished")])
def test_a_failed_save_raises_its_error_and_leaves_no_temporary_folder(
    tmp_path: Path, monkeypatch, save, error
) -> None:
    """The save's own error reaches the caller and no temporary folder is left; the clean-up never masks that error,
    even when the folder is already gone (``_vanished``)."""
    from lragent.converted_cache import convert_gguf_once

    gguf, _ = _fake_gguf_loading(monkeypatch, tmp_path, save=save)
    target = tmp_path / "cache" / "model"
    with pytest.raises(RuntimeError, match=error):
        convert_gguf_once(gguf, target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock"]


def test_an_incomplete_copy_removed_by_a_racer_meanwhile_is_still_replaced_by_ours(tmp_path: Path, monkeypatch) -> None:
    """Two processes find the same crashed copy and both remove it: the one whose removal finds it already gone
    publishes its conversion all the same, without an error."""
    import shutil

    target = _conversion(tmp_path, "target", "crashed", complete=False)
    tmp = _conversion(tmp_path, ".tmp-1", "fresh")
    exists = Path.exists

    def racer_removes_it_after_our_check(self: Path, *args, **kwargs) -> bool:
        found = exists(self, *args, **kwargs)
        if self == target and found:
            shutil.rmtree(target)
        return found

    monkeypatch.setattr(Path, "exists", racer_removes_it_after_our_check)
    _publish_converted(tmp, target)
    assert _is_converted(target) and (target / "model.safetensors").read_text() == "fresh"


def test_a_temporary_copy_that_cannot_be_fully_removed_does_not_fail_the_publish(tmp_path: Path, monkeypatch) -> None:
    """Removing our discarded copy can fail (a busy NFS folder, EBUSY): the racer's finished copy stands, no error."""
    import errno
    import os

    target = _conversion(tmp_path, "target", "first")
    tmp = _conversion(tmp_path, ".tmp-1", "second")
    rmdir = os.rmdir

    def busy(path, *args, **kwargs):
        if Path(path).name == tmp.name:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", busy)
    _publish_converted(tmp, target)
    assert (target / "model.safetensors").read_text() == "first"
    assert not (tmp / "model.safetensors").exists()  # its files went; only the busy folder itself is left
