"""The similarity reports (:mod:`eval_suite.diagnostics.similarity_report`) cell by cell, from hand-written
``similarity.json`` documents: each table of one run, its Markdown and HTML pages and figures, and the summary of
several runs (``--merge``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_suite.diagnostics import similarity_report as sr

ROLES = ["plan", "action", "reflect"]
PAIRS = ["plan-action", "plan-reflect", "action-reflect"]
METRICS = ("full", "base", "adapter", "lr", "hidden", "k")


def _doc(label: str = "run A", shared_a: bool = True, complete: bool | None = True, offset: float = 0.0) -> dict:
    """A two-layer, three-role run whose every number tells where it belongs: metric k's cosines are 0.k..., pair p
    adds 0.0p, layer l adds 0.00l; the K cache's layer 1 and the hidden states' pair 2 are undefined (None)."""
    cos = {}
    for k, m in enumerate(METRICS, 1):
        base = k / 10 + offset
        cos[m] = {
            "mean": base, "std": base / 100,
            "per_pair": {p: {"mean": base + (i + 1) / 100, "std": (i + 1) / 1000} for i, p in enumerate(PAIRS)},
            "per_layer": [base + 0.001, base + 0.002], "per_layer_std": [0.01, 0.02],
            "per_layer_pair": [[base + 0.001 + p / 100 for p in range(3)], [base + 0.002 + p / 100 for p in range(3)]],
        }  # fmt: skip
    cos["k"]["per_layer"][1] = None
    cos["hidden"]["per_pair"]["action-reflect"] = {"mean": None, "std": None}
    cross_mean = [[0.5, -0.25, 0.125], [0.0625, 0.75, -0.875], [None, 0.3, 0.9]]
    l1 = {
        "base": {"mean": 12.345678, "per_layer": [10.0, 14.69],
                 "per_role": dict(zip(ROLES, [11.0, 12.0, 13.0], strict=True)),
                 "per_layer_role": [[9.0, 10.0, 11.0], [13.0, 14.0, 15.0]]},
        "adapter": {"mean": 0.123456, "per_layer": [0.1, 0.2],
                    "per_role": dict(zip(ROLES, [0.11, 0.12, 0.13], strict=True)),
                    "per_layer_role": [[0.09, 0.1, 0.11], [0.13, 0.14, 0.15]]},
        "ratio": {"mean": 0.01, "std": 0.002, "per_layer": [0.01, 0.0136],
                  "per_role": dict(zip(ROLES, [0.0101, 0.0102, 0.0103], strict=True))},
    }  # fmt: skip
    doc = {
        "config": {"label": label, "benchmark": "hotpotqa", "data": None, "adapters": None, "adapter_init": "random",
                   "seed": 7, "sample_seed": 3, "samples_requested": 2, "max_tokens": 64, "model": "tiny-llama",
                   "dtype": "float32", "device": "cpu", "roles": ROLES, "rank": 4, "alpha": 8.0,
                   "targets": ["q_proj", "v_proj"], "shared_a": shared_a, "n_layers": 2},
        "summary": {"n_samples": 2, "tokens_total": 100, "pairs": PAIRS, "cos": cos,
                    "cross": {"mean": cross_mean, "std": [[0.01, 0.02, 0.03], [0.04, 0.05, 0.06], [None, 0.08, 0.09]]},
                    "l1": l1},
        "wall_s": 3.21,
        "provenance": {"device": {"name": "Test CPU", "type": "cpu"}, "git_commit": "abc123", "git_dirty": True,
                       "utc": "2026-01-02T03:04:05Z", "command": "cli.py similarity --x <1>"},
    }  # fmt: skip
    if complete is not None:
        doc["complete"] = complete
    return doc


@pytest.fixture(autouse=True)
def figures_not_drawn(monkeypatch) -> dict:
    """Figures are built but neither laid out nor rendered to PNG (the slow part; test_similarity writes them):
    ``{path: figure}`` of each one that would be saved."""
    import matplotlib.figure

    figs: dict = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout", lambda self: None)
    monkeypatch.setattr(sr, "save_figure", lambda fig, path: figs.setdefault(path, fig))
    return figs


def _in_order(text: str, parts: list[str]) -> None:
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, (part, text[at : at + 300])
        at = found + len(part)


def test_one_runs_markdown_page_has_every_table_cell() -> None:
    """``report.md``: the title, the run's two header lines, the definitions, Tables 1, 2, 6 (per pair, all pairs),
    the L1 table (per role, all roles), the per-layer table ("undefined" where a cosine is undefined), the figures
    with their captions and the provenance footer."""
    md = sr.render_markdown(_doc())
    lines = md.splitlines()
    assert lines[:3] == [
        "# Cache similarity across agents: run A",
        "Run **run A**: model `tiny-llama` (2 layers, float32 on cpu); adapters untrained init `random` (seed 7): "
        "roles plan, action, reflect, rank 4, alpha 8, targets q_proj, v_proj, shared A.",
        "Contexts: 2 role-example inputs of `hotpotqa` (draw seed 3), each cut to at most its first 64 tokens, 100 "
        "tokens in all; measured in 3.2 s wall clock (model load included).",
    ]
    assert lines[3:6] == ["", f"**Definitions.** {sr.DEFINITIONS}", ""]
    assert [x for x in lines if x.startswith(("## ", "| ", "![", "Mean", "With", "Per token", "Cosine"))] == [
        "## Table 1 layout: value-cache similarity between agents",
        "Mean cosine similarity over tokens, samples and layers; ± over samples.",
        "| Role pair | Full V | Base V = X·W0 | Adapter output s·X·A·B |",
        "| :--- | ---: | ---: | ---: |",
        "| plan-action | 0.1100 ± 0.0010 | 0.2100 ± 0.0010 | 0.3100 ± 0.0010 |",
        "| plan-reflect | 0.1200 ± 0.0020 | 0.2200 ± 0.0020 | 0.3200 ± 0.0020 |",
        "| action-reflect | 0.1300 ± 0.0030 | 0.2300 ± 0.0030 | 0.3300 ± 0.0030 |",
        "| all pairs | 0.1000 ± 0.0010 | 0.2000 ± 0.0020 | 0.3000 ± 0.0030 |",
        "## Table 2 layout: LR-cache similarity between agents (shared A)",
        "With shared A the LR caches differ only through the layer inputs X; with one A per role they are different "
        "projections and need not be similar.",
        "| Role pair | LR cache X·A | Layer input X | K cache |",
        "| :--- | ---: | ---: | ---: |",
        "| plan-action | 0.4100 ± 0.0010 | 0.5100 ± 0.0010 | 0.6100 ± 0.0010 |",
        "| plan-reflect | 0.4200 ± 0.0020 | 0.5200 ± 0.0020 | 0.6200 ± 0.0020 |",
        "| action-reflect | 0.4300 ± 0.0030 | undefined | 0.6300 ± 0.0030 |",
        "| all pairs | 0.4000 ± 0.0040 | 0.5000 ± 0.0050 | 0.6000 ± 0.0060 |",
        "## Figure 6 values: L1 norms of base cache and adapter output",
        "Per token vector, mean over tokens, samples and layers.",
        "| Role | L1 base ‖X·W0‖₁ | L1 adapter ‖s·X·A·B‖₁ | ratio adapter / base |",
        "| :--- | ---: | ---: | ---: |",
        "| plan | 11 | 0.11 | 0.0101 |",
        "| action | 12 | 0.12 | 0.0102 |",
        "| reflect | 13 | 0.13 | 0.0103 |",
        "| all roles | 12.35 | 0.1235 | 0.0100 ± 0.0020 |",
        "## Table 6 layout: cross terms cos(base_i, adapter_j)",
        "Cosine similarity between role i's base cache X_i·W0 and role j's adapter output s·X_j·A_j·B_j (same token), "
        "mean over tokens, samples and layers.",
        "| base of \\ adapter of | plan | action | reflect |",
        "| :--- | ---: | ---: | ---: |",
        "| plan | 0.5000 ± 0.0100 | -0.2500 ± 0.0200 | 0.1250 ± 0.0300 |",
        "| action | 0.0625 ± 0.0400 | 0.7500 ± 0.0500 | -0.8750 ± 0.0600 |",
        "| reflect | undefined | 0.3000 ± 0.0800 | 0.9000 ± 0.0900 |",
        "## Per layer (mean over samples and pairs)",
        "| Layer | Full V | Base V | Adapter | LR cache | K | X | L1 base | L1 adapter | L1 ratio |",
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| 0 | 0.1010 | 0.2010 | 0.3010 | 0.4010 | 0.6010 | 0.5010 | 10 | 0.1 | 0.0100 |",
        "| 1 | 0.1020 | 0.2020 | 0.3020 | 0.4020 | undefined | 0.5020 | 14.69 | 0.2 | 0.0136 |",
        "## Figures",
        "![fig1_base_vs_full.png](fig1_base_vs_full.png)",
        "![fig6_l1_norms.png](fig6_l1_norms.png)",
        "![fig7_k_similarity.png](fig7_k_similarity.png)",
    ]
    _in_order(md, [f"![{name}]({name})\n\n{caption}\n\n" for name, caption in sr.FIGURES.items()])
    footer = "Produced on Test CPU (cpu), dtype n/a, commit abc123 (dirty), 2026-01-02T03:04:05Z; .  \n"
    assert md.endswith(f"\n---\n{footer}Command: `cli.py similarity --x <1>`\n")


def test_the_run_header_names_a_data_file_adapters_independent_a_and_an_incomplete_run() -> None:
    """Contexts from a data file are named by it, trained adapters by their path; independent A is said in the header
    and Table 2's title; an incomplete run is marked; a run without ``complete`` is complete; no time is 0.0 s."""
    doc = _doc("run C", shared_a=False, complete=False)
    doc["config"].update(data="/d/ctx.jsonl", adapters="/ad/x")
    del doc["wall_s"]
    assert sr._run_header(doc) == [
        "Run **run C** **(incomplete run)**: model `tiny-llama` (2 layers, float32 on cpu); adapters /ad/x: roles "
        "plan, action, reflect, rank 4, alpha 8, targets q_proj, v_proj, independent A.",
        "Contexts: 2 `/d/ctx.jsonl` (draw seed 3), each cut to at most its first 64 tokens, 100 tokens in all; "
        "measured in 0.0 s wall clock (model load included).",
    ]
    assert (
        sr.run_tables(doc)[1].title
        == "Table 2 layout: LR-cache similarity between agents (independent A (one per role))"
    )
    assert "**(incomplete run)**" not in sr._run_header(_doc(complete=None))[0]


def test_one_runs_html_page_shows_tables_then_figures_then_the_layer_table() -> None:
    """``report.html``: escaped title and header lines (without Markdown marks), the definitions, every table but the
    per-layer one, each figure with its caption (a figure not in FIGURES captioned by its name), the per-layer table,
    the provenance line."""
    page = sr.render_html(_doc(), ["fig1_base_vs_full.png", "extra<1>.png"])
    cap = sr.FIGURES["fig1_base_vs_full.png"]
    _in_order(page, [
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>Cache similarity across agents: run A</title>"
        f"<style>{sr._CSS}</style></head><body>\n<h1>Cache similarity across agents: run A</h1>\n",
        "<p>Run run A: model tiny-llama (2 layers, float32 on cpu); adapters untrained init random (seed 7): roles "
        "plan, action, reflect, rank 4, alpha 8, targets q_proj, v_proj, shared A.</p>\n<p>Contexts: 2 role-example "
        "inputs of hotpotqa (draw seed 3), ",
        "<p><b>Definitions.</b> Every role processes the same context on its own (plain cache, nothing shared). For "
        "each layer, role pair (i &lt; j)",
        "<h2>Table 1 layout: value-cache similarity between agents</h2><p>Mean cosine similarity over tokens, samples "
        "and layers; ± over samples.</p>\n<table><tr><th>Role pair</th><th>Full V</th><th>Base V = X·W0</th>"
        "<th>Adapter output s·X·A·B</th></tr>\n<tr><td>plan-action</td><td>0.1100 ± 0.0010</td>",
        "<h2>Table 2 layout",
        "<h2>Figure 6 values",
        "<h2>Table 6 layout: cross terms cos(base_i, adapter_j)</h2><p>Cosine similarity between role i&#x27;s base",
        "<tr><td>reflect</td><td>undefined</td><td>0.3000 ± 0.0800</td><td>0.9000 ± 0.0900</td></tr>\n</table>\n",
        f"<figure><img src='fig1_base_vs_full.png' alt='{cap}'><figcaption>{cap}</figcaption></figure>\n",
        "<figure><img src='extra&lt;1&gt;.png' alt='extra&lt;1&gt;.png'><figcaption>extra&lt;1&gt;.png</figcaption>"
        "</figure>\n<h2>Per layer (mean over samples and pairs)</h2>\n<table><tr><th>Layer</th>",
        "<tr><td>1</td><td>0.1020</td><td>0.2020</td><td>0.3020</td><td>0.4020</td><td>undefined</td><td>0.5020</td>"
        "<td>14.69</td><td>0.2</td><td>0.0136</td></tr>\n</table>\n",
        "<div class='prov'>Produced on Test CPU (cpu), commit abc123 (dirty), 2026-01-02T03:04:05Z. Command: "
        "<code>cli.py similarity --x &lt;1&gt;</code></div>\n</body></html>\n",
    ])  # fmt: skip
    assert page.endswith("</body></html>\n") and page.count("<table>") == 5 and page.count("<figure>") == 2
    clean = _doc()
    clean["provenance"] = {}
    tail = sr.render_html(clean, [])
    assert tail.endswith("<div class='prov'>Produced on ? (None), commit None, . Command: <code></code></div>\n"
                         "</body></html>\n")  # fmt: skip


def test_a_table_renders_markdown_at_any_level_and_html_without_an_empty_note() -> None:
    """A table without a note has no note paragraph; the heading level is the one asked for; cells are escaped."""
    t = sr.Table("T <x>", ["a", "b&"], [["1", "<2>"]])
    assert t.markdown(3) == "### T <x>\n\n| a | b& |\n| :--- | ---: |\n| 1 | <2> |\n\n"
    assert t.markdown() == "## T <x>\n\n| a | b& |\n| :--- | ---: |\n| 1 | <2> |\n\n"
    assert t.html() == ("<h2>T &lt;x&gt;</h2>\n<table><tr><th>a</th><th>b&amp;</th></tr>\n"
                        "<tr><td>1</td><td>&lt;2&gt;</td></tr>\n</table>\n")  # fmt: skip
    two = sr.Table("U", ["a"], [["1"], ["2"]])
    assert two.html() == "<h2>U</h2>\n<table><tr><th>a</th></tr>\n<tr><td>1</td></tr>\n<tr><td>2</td></tr>\n</table>\n"
    noted = sr.Table("T", ["a"], [], note="n & m")
    assert noted.markdown() == "## T\n\nn & m\n\n| a |\n| :--- |\n\n" and "<p>n &amp; m</p>\n<table>" in noted.html()
    assert (sr.fmt_cos(None, 0.5), sr.fmt_cos(0.12345), sr.fmt_l1(None), sr.fmt_l1(1234.5)) == (
        "undefined", "0.1235", "–", "1234")  # fmt: skip


def _curves(ax) -> dict:
    from matplotlib.colors import to_hex

    return {line.get_label(): ([float(x) for x in line.get_xdata()], [round(float(y), 6) for y in line.get_ydata()],
                               line.get_linestyle(), line.get_marker(), to_hex(line.get_color()), line.get_markersize())
            for line in ax.lines}  # fmt: skip


def test_the_three_figures_plot_each_pair_role_and_layer(tmp_path: Path, figures_not_drawn) -> None:
    """Figure 1: base (solid, o) and full (dashed, x) cosine per pair and layer in the pair's colour; Figure 6: the
    base L1 (black) and each role's adapter L1 on a log scale when all are positive, and the ratio per layer;
    Figure 7: the K cosine per pair with the mean ± std band (undefined layers left out)."""
    paths = sr.write_figures(_doc(), tmp_path)
    assert paths == [tmp_path / name for name in sr.FIGURES] == list(figures_not_drawn)
    c0, c1, c2 = "#1f77b4", "#ff7f0e", "#2ca02c"
    fig1, fig6, fig7 = figures_not_drawn.values()
    assert [tuple(f.get_size_inches()) for f in (fig1, fig6, fig7)] == [(6.4, 4.0), (9.6, 4.0), (6.4, 4.0)]
    for ax in (*fig1.axes, *fig6.axes, *fig7.axes):  # small titles and legends, light grids
        grid = ax.xaxis.get_gridlines()[0]
        assert ax.title.get_fontsize() == 9 and grid.get_visible() and grid.get_alpha() == 0.3
        if ax.get_legend() is not None:
            assert {t.get_fontsize() for t in ax.get_legend().get_texts()} == {7}
    assert fig1.axes[0].get_legend()._ncols == 2 and fig6._suptitle.get_fontsize() == 9
    left, right = (a.get_position() for a in fig6.axes)
    assert left.x1 < right.x0 and left.y0 == right.y0  # L1 norms beside the ratio, not above it
    (ax,) = fig1.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
        "Base vs full value cache across agents\nrun A", "layer", "cosine similarity")  # fmt: skip
    assert _curves(ax) == {
        "plan-action base X·W0": ([0, 1], [0.201, 0.202], "-", "o", c0, 3.0),
        "plan-action full V": ([0, 1], [0.101, 0.102], "--", "x", c0, 3.0),
        "plan-reflect base X·W0": ([0, 1], [0.211, 0.212], "-", "o", c1, 3.0),
        "plan-reflect full V": ([0, 1], [0.111, 0.112], "--", "x", c1, 3.0),
        "action-reflect base X·W0": ([0, 1], [0.221, 0.222], "-", "o", c2, 3.0),
        "action-reflect full V": ([0, 1], [0.121, 0.122], "--", "x", c2, 3.0),
    }
    assert ax.get_legend() is not None and len(ax.get_legend().get_texts()) == 6
    ax, ax_r = fig6.axes
    assert fig6._suptitle.get_text() == "run A" and ax.get_yscale() == "log" and ax_r.get_yscale() == "linear"
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("L1 norms", "layer", "L1 norm per token")
    assert _curves(ax) == {
        "base X·W0 (mean of roles)": ([0, 1], [10.0, 14.69], "-", "o", "#000000", 3.0),
        "adapter plan": ([0, 1], [0.09, 0.13], "-", "x", c0, 3.0),
        "adapter action": ([0, 1], [0.1, 0.14], "-", "x", c1, 3.0),
        "adapter reflect": ([0, 1], [0.11, 0.15], "-", "x", c2, 3.0),
    }
    assert (ax_r.get_title(), ax_r.get_xlabel(), ax_r.get_ylabel()) == ("ratio", "layer", "adapter L1 / base L1")
    assert list(_curves(ax_r).values()) == [([0, 1], [0.01, 0.0136], "-", "o", c0, 3.0)]
    (ax,) = fig7.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
        "K cache across agents\nrun A", "layer", "cosine similarity of K")  # fmt: skip
    assert _curves(ax) == {
        "plan-action": ([0, 1], [0.601, 0.602], "-", "o", c0, 3.0),
        "plan-reflect": ([0, 1], [0.611, 0.612], "-", "o", c1, 3.0),
        "action-reflect": ([0, 1], [0.621, 0.622], "-", "o", c2, 3.0),
    }
    (band,) = ax.collections
    ys = sorted({round(float(y), 6) for _, y in band.get_paths()[0].vertices})
    assert band.get_label() == "mean ± std" and ys == [0.591, 0.611]  # layer 0: 0.601 ± 0.01; layer 1 undefined
    assert tuple(band.get_facecolor()[0]) == (0.85, 0.85, 0.85, 1.0)  # a light grey band
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["mean ± std", *PAIRS]


def test_l1_figure_is_linear_when_a_norm_is_zero(tmp_path: Path, figures_not_drawn) -> None:
    """A zero L1 norm (base or adapter: zero B) keeps the L1 axis linear, where a log scale could not show it; norms
    below 1 but positive are on a log scale."""
    small = _doc()
    small["summary"]["l1"]["base"]["per_layer"] = [0.5, 0.25]
    sr.write_figures(small, tmp_path)
    assert list(figures_not_drawn.values())[1].axes[0].get_yscale() == "log"
    for part in ("adapter", "base"):
        doc = _doc()
        if part == "adapter":
            doc["summary"]["l1"]["adapter"]["per_layer_role"][0][1] = 0.0
        else:
            doc["summary"]["l1"]["base"]["per_layer"][1] = 0.0
        figures_not_drawn.clear()
        sr.write_figures(doc, tmp_path)
        assert list(figures_not_drawn.values())[1].axes[0].get_yscale() == "linear", part


def test_one_runs_report_files_are_the_rendered_pages_and_figures(tmp_path: Path, figures_not_drawn) -> None:
    """``write_report``: ``report.md`` and ``report.html`` (showing the three figures) beside the figures, their
    paths in that order."""
    doc = _doc()
    out = tmp_path / "run"
    out.mkdir()
    paths = sr.write_report(doc, str(out))
    assert paths == [out / "report.md", *(out / name for name in sr.FIGURES), out / "report.html"]
    assert list(figures_not_drawn) == [out / name for name in sr.FIGURES]
    assert (out / "report.md").read_text() == sr.render_markdown(doc)
    assert (out / "report.html").read_text() == sr.render_html(doc, list(sr.FIGURES))


def _runs() -> list[dict]:
    """Three runs: A (shared A), B (independent A, another offset and L1, a 2×2 cross table with an undefined
    diagonal entry), C (a 1×1 cross table left undefined)."""
    a, b, c = _doc(), _doc("run B", shared_a=False, offset=0.5), _doc("run C")
    a["dir"], b["dir"], c["dir"] = "/r/a", "/r/b", "/r/c"
    b["summary"]["cross"]["mean"] = [[None, 0.2], [-0.95, 0.4]]
    b["summary"]["l1"]["base"]["mean"] = 99.5
    b["summary"]["l1"]["adapter"]["mean"] = 0.5
    b["summary"]["l1"]["ratio"].update(mean=0.005, std=None)
    b["summary"]["n_samples"], b["summary"]["tokens_total"] = 3, 150
    c["summary"]["cross"]["mean"] = [[None]]
    return [a, b, c]


def test_the_summary_of_runs_has_one_row_per_run_in_each_table() -> None:
    """``--merge``: Table 1 (contexts, tokens, V cosines), Table 2 (LR, X, K) and Table 6 (the mean of the
    cross-term diagonal and of the off-diagonal, the largest magnitude, L1 norms and ratio), one row per run;
    undefined entries are left out of the averages, and a table of nothing defined is "undefined"."""
    t1, t2, t6 = sr.summary_tables(_runs())
    assert [t.title for t in (t1, t2, t6)] == [
        "Table 1 layout: value-cache similarity between agents", "Table 2 layout: LR-cache similarity between agents",
        "Table 6 layout and Figure 6 values: cross terms and L1 norms",
    ]  # fmt: skip
    assert t1.header == ["Run", "A", "contexts", "tokens", "Full V", "Base V = X·W0", "Adapter output s·X·A·B"]
    assert t1.rows == [
        ["run A", "shared", "2", "100", "0.1000 ± 0.0010", "0.2000 ± 0.0020", "0.3000 ± 0.0030"],
        ["run B", "independent", "3", "150", "0.6000 ± 0.0060", "0.7000 ± 0.0070", "0.8000 ± 0.0080"],
        ["run C", "shared", "2", "100", "0.1000 ± 0.0010", "0.2000 ± 0.0020", "0.3000 ± 0.0030"],
    ]
    assert t1.note == "Mean cosine similarity over tokens, samples, layers and role pairs; ± over samples and pairs."
    assert t2.header == ["Run", "A", "LR cache X·A", "Layer input X", "K cache"] and t2.note == ""
    assert t2.rows[:2] == [
        ["run A", "shared", "0.4000 ± 0.0040", "0.5000 ± 0.0050", "0.6000 ± 0.0060"],
        ["run B", "independent", "0.9000 ± 0.0090", "1.0000 ± 0.0100", "1.1000 ± 0.0110"],
    ]
    assert t6.header == ["Run", "A", "cos(base_i, adapter_i)", "cos(base_i, adapter_j), i≠j", "max abs cross",
                         "L1 base", "L1 adapter", "L1 adapter / base"]  # fmt: skip
    # A: diagonal 0.5, 0.75, 0.9; off-diagonal -0.25, 0.125, 0.0625, -0.875, 0.3 (one undefined); largest |x| 0.9
    # B: diagonal 0.4 (one undefined); off-diagonal 0.2, -0.95; largest |x| 0.95 (a negative one)
    assert t6.rows == [
        ["run A", "shared", "0.7167", "-0.1275", "0.9000", "12.35", "0.1235", "0.0100 ± 0.0020"],
        ["run B", "independent", "0.4000", "-0.3750", "0.9500", "99.5", "0.5", "0.0050"],
        ["run C", "shared", "undefined", "undefined", "undefined", "12.35", "0.1235", "0.0100 ± 0.0020"],
    ]
    assert t6.note == (
        "Cross terms averaged over the diagonal (same role) and the off-diagonal entries of each run's Table 6; max "
        "abs cross is the largest magnitude among them. L1 per token vector, mean over layers."
    )
    assert (sr._mean([None, 1.0, 2.0]), sr._mean([None]), sr._max_abs([None, -3.0, 2.0]), sr._max_abs([])) == (
        1.5, None, 3.0, None)  # fmt: skip


def test_the_summary_files_hold_every_run(tmp_path: Path) -> None:
    """``summary.md``: the title, definitions, the three tables and each run's label with its directory;
    ``summary.json``: per run its directory, config, summary and time, with the provenance."""
    runs = _runs()
    del runs[2]["wall_s"]
    paths = sr.write_summary(runs, str(tmp_path))
    assert paths == [tmp_path / "summary.md", tmp_path / "summary.json"]
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith(f"# Cache similarity across agents: summary of runs\n\n**Definitions.** {sr.DEFINITIONS}\n\n"
                         "## Table 1 layout: value-cache similarity between agents\n\n")  # fmt: skip
    _in_order(md, ["| run A | shared | 2 | 100 |", "## Table 2 layout", "| run B | independent | 0.9000 ± 0.0090 |",
                   "## Table 6 layout", "| run C | shared | undefined |",
                   "\nRuns: run A → `/r/a`; run B → `/r/b`; run C → `/r/c`.\n\n---\nProduced on "])  # fmt: skip
    body = json.loads((tmp_path / "summary.json").read_text())
    assert [r["dir"] for r in body["runs"]] == ["/r/a", "/r/b", "/r/c"]
    assert [r["wall_s"] for r in body["runs"]] == [3.21, 3.21, None]
    assert body["runs"][1]["config"] == runs[1]["config"] and body["runs"][1]["summary"] == runs[1]["summary"]
    assert set(body["runs"][0]) == {"dir", "config", "summary", "wall_s"} and "git_commit" in body["provenance"]


def test_load_runs_reads_each_complete_run_and_names_its_directory(tmp_path: Path) -> None:
    """Each directory's ``similarity.json`` in the order given, with ``dir`` set to the directory as given; a run
    without ``complete`` is refused like an incomplete one."""
    for name, doc in (("a", _doc("A")), ("b", _doc("B")), ("c", _doc("C", complete=None))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "similarity.json").write_text(json.dumps(doc))
    runs = sr.load_runs([tmp_path / "b", str(tmp_path / "a")])
    assert [(r["config"]["label"], r["dir"]) for r in runs] == [("B", str(tmp_path / "b")), ("A", str(tmp_path / "a"))]
    with pytest.raises(
        ValueError, match=r"^--merge '.*/c': the run is incomplete \(complete: false\); rerun it first$"
    ):
        sr.load_runs([tmp_path / "c"])
    with pytest.raises(FileNotFoundError, match=r"^--merge '.*/d': no similarity.json in it$"):
        sr.load_runs([tmp_path / "a", tmp_path / "d"])
