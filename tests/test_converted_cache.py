"""The embedded model's converted-weights cache under concurrent first use: a finished copy that another process may
be reading is never removed (12 GPU test workers once failed with "no file named model.safetensors" because a
later conversion deleted and replaced the directory under a reader)."""

from __future__ import annotations

from pathlib import Path

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
