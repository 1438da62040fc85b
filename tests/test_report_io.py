"""Report files: palette PNGs that keep the plot (lragent/report_io.py)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def _figure():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.linspace(0, 10, 200)
    for k in range(4):
        ax.plot(x, np.sin(x + k), label=f"line {k}")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def test_save_figure_is_a_smaller_palette_png_of_the_same_picture(tmp_path: Path) -> None:
    from PIL import Image

    from lragent.report_io import save_figure

    fig = _figure()
    plain = io.BytesIO()
    fig.savefig(plain, format="png", dpi=120)
    save_figure(fig, tmp_path / "f.png", dpi=120)
    out = tmp_path / "f.png"
    assert not (tmp_path / "f.png.tmp").exists()
    with Image.open(out) as small, Image.open(io.BytesIO(plain.getvalue())) as full:
        assert small.mode == "P" and small.size == full.size
        a = np.asarray(small.convert("RGB"), dtype=np.int16)
        b = np.asarray(full.convert("RGB"), dtype=np.int16)
    assert out.stat().st_size < 0.6 * len(plain.getvalue())
    # the same picture: every pixel within a few levels on average, and the plot's pixels where they were
    assert np.abs(a - b).mean() < 2.0
    assert ((a.sum(-1) < 600) == (b.sum(-1) < 600)).mean() > 0.995


def test_a_table_row_of_the_wrong_length_is_refused_naming_the_lengths() -> None:
    from lragent.report_io import markdown_table

    with pytest.raises(ValueError, match=r"every row needs 2 cells, got \[1, 2\]"):
        markdown_table(["a", "b"], [["x", 1], ["y"]])
    assert markdown_table(["a", "b"], [["x", 1]]).splitlines()[2] == "| x | 1 |"


def test_a_table_has_one_rule_cell_per_column_first_left_the_rest_right_unless_told() -> None:
    from lragent.report_io import markdown_table

    lines = markdown_table(["row", "a", "b"], [["x", 1, 2]]).splitlines()
    assert lines == ["| row | a | b |", "| :--- | ---: | ---: |", "| x | 1 | 2 |"]
    assert markdown_table(["a", "b"], [], align=["r", "l"]).splitlines()[1] == "| ---: | :--- |"


def test_json_and_text_are_written_whole_in_their_format_over_an_older_file(tmp_path: Path) -> None:
    """write_json: indent 1, keys in the caller's order, one trailing newline; write_text: the text as given; both
    replace an older file and leave no temporary file beside it."""
    import json

    from lragent.report_io import write_json, write_text

    out = tmp_path / "r.json"
    out.write_text("old")
    write_json(str(out), {"b": 1, "a": [1, 2]})
    assert out.read_text() == '{\n "b": 1,\n "a": [\n  1,\n  2\n ]\n}\n'
    assert json.loads(out.read_text()) == {"b": 1, "a": [1, 2]} and sorted(tmp_path.iterdir()) == [out]
    txt = tmp_path / "r.md"
    write_text(str(txt), "| a |\n")
    write_text(txt, "| b |\n")
    assert txt.read_text() == "| b |\n" and sorted(tmp_path.iterdir()) == [out, txt]
    with pytest.raises(TypeError):
        write_json(out, {"x": object()})  # not JSON: the older file stays as it was
    assert json.loads(out.read_text()) == {"b": 1, "a": [1, 2]}


def test_a_palette_png_is_the_undithered_median_cut_of_the_image_optimized(tmp_path: Path) -> None:
    """A smooth gradient (far more than 256 colours) comes back as flat bands (no dither noise), and the file is
    exactly the 256-colour median cut saved optimized, written through no temporary file left behind."""
    from PIL import Image

    from lragent.report_io import write_palette_png

    x = np.linspace(0, 255, 600)
    rgb = np.stack([np.tile(x, (40, 1)), np.tile(x[::-1], (40, 1)), np.full((40, 600), 128.0)], -1).astype(np.uint8)
    src = tmp_path / "src.png"
    Image.fromarray(rgb).save(src)
    write_palette_png(src, tmp_path / "p.png")
    with Image.open(tmp_path / "p.png") as im:
        assert im.mode == "P"
        idx = np.asarray(im)
    assert (idx == idx[0]).all()  # every row the same: undithered
    assert (np.diff(idx[0].astype(int)) != 0).sum() <= 256  # monotone bands, not pixel noise
    with Image.open(src) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    ref = io.BytesIO()
    small.save(ref, format="PNG", optimize=True)
    assert (tmp_path / "p.png").read_bytes() == ref.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "src.png"]


def test_save_figure_defaults_to_120_dpi() -> None:
    import tempfile

    from PIL import Image

    from lragent.report_io import save_figure

    fig = _figure()  # 6 x 4 inches
    with tempfile.TemporaryDirectory() as d:
        save_figure(fig, Path(d) / "f.png")
        with Image.open(Path(d) / "f.png") as im:
            assert im.size == (720, 480)


@pytest.mark.parametrize("writer", ["json", "text", "png"])
def test_a_write_cut_short_keeps_the_older_file_and_leaves_its_part_as_name_tmp(tmp_path: Path, monkeypatch, writer):
    """The final rename failing (a crash between write and rename) leaves the older file whole and the new bytes in
    ``<name>.tmp``, the suffix the study's packs skip."""
    import os

    from PIL import Image

    from lragent import report_io

    name = {"json": "r.json", "text": "r.md", "png": "p.png"}[writer]
    out = tmp_path / name
    out.write_bytes(b"older")
    src = tmp_path / "src.bmp"
    Image.new("RGB", (4, 4), (10, 20, 30)).save(src)

    def cut(a, b):
        raise OSError("cut")

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(OSError, match="cut"):
        {"json": lambda: report_io.write_json(out, [1]), "text": lambda: report_io.write_text(out, "new"),
         "png": lambda: report_io.write_palette_png(src, out)}[writer]()  # fmt: skip
    assert out.read_bytes() == b"older"
    assert sorted(p.name for p in tmp_path.iterdir() if p != src) == sorted([name, name + ".tmp"])
