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
