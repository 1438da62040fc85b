"""Reports of `cli.py similarity`: Markdown tables (layout of LRAgent Tables 1, 2, 6), PNG figures (Figures 1, 6,
7), one HTML page, and the cross-run summary of ``--merge``.

Every number comes from a ``similarity.json`` written by :mod:`eval_suite.diagnostics.similarity` (its docstring
defines each quantity); nothing here measures.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from eval_suite.report import markdown_table, write_json, write_text
from lragent.provenance import provenance, provenance_footer
from lragent.report_io import save_figure

FIGURES: dict[str, str] = {
    "fig1_base_vs_full.png": "Figure 1 (right) layout: per-layer cosine similarity between agents of the base cache "
    "X·W0 (solid) and of the full value cache (dashed), per role pair.",
    "fig6_l1_norms.png": "Figure 6 layout: per-layer L1 norm of the base cache and of each role's adapter output "
    "(left, mean per token), and their ratio (right).",
    "fig7_k_similarity.png": "Figure 7 layout: per-layer cosine similarity of the K cache between agents, per role "
    "pair; the band is ± one standard deviation over samples and pairs.",
}
DEFINITIONS = (
    "Every role processes the same context on its own (plain cache, nothing shared). For each layer, role pair "
    "(i < j) and token t, cos_t = <Z_i[t], Z_j[t]> / (‖Z_i[t]‖ ‖Z_j[t]‖) of the token's d-wide vector (all KV heads "
    "flattened; r-wide for the LR cache), in float64; tokens where a vector is exactly zero are undefined and left "
    "out. Values are token means per sample, then averaged over samples (each sample counts equally), layers and "
    "pairs; ± is the standard deviation over (sample, pair) of the layer-averaged value. L1 norms are per token "
    "vector (sum of |entries|), averaged over tokens, samples and roles; the ratio is mean adapter L1 / mean base L1 "
    "(± over samples of the per-sample ratio). The K cache is compared before RoPE, which rotates both roles' key of "
    "a token by the same orthogonal matrix and so leaves the per-token cosine unchanged."
)


# ---------------------------------------------------------------------------------------------------- formatting
def fmt_cos(mean: float | None, std: float | None = None) -> str:
    """``"0.9576 ± 0.0123"``; ``"undefined"`` when the mean is undefined (zero vectors)."""
    if mean is None:
        return "undefined"
    return f"{mean:.4f}" + ("" if std is None else f" ± {std:.4f}")


def fmt_l1(x: float | None) -> str:
    """An L1 norm with 4 significant digits."""
    return "–" if x is None else f"{x:.4g}"


class Table:
    """A titled table that renders to Markdown and to HTML.

    Args:
        title: heading.
        header: column titles.
        rows: cells (strings).
        note: a sentence under the heading.
    """

    def __init__(self, title: str, header: Sequence[str], rows: Sequence[Sequence[str]], note: str = "") -> None:
        self.title, self.header, self.rows, self.note = title, list(header), [list(r) for r in rows], note

    def markdown(self, level: int = 2) -> str:
        note = f"{self.note}\n\n" if self.note else ""
        return f"{'#' * level} {self.title}\n\n{note}{markdown_table(self.header, self.rows)}\n"

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>\n" for r in self.rows)
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return f"<h2>{html.escape(self.title)}</h2>{note}\n<table><tr>{head}</tr>\n{body}</table>\n"


# ------------------------------------------------------------------------------------------------ one run: tables
def run_tables(doc: dict) -> list[Table]:
    """The tables of one run (Tables 1, 2, 6 layouts; L1 norms; per layer)."""
    s, cfg = doc["summary"], doc["config"]
    pairs, roles = s["pairs"], cfg["roles"]
    cos = s["cos"]
    a_kind = "shared A" if cfg["shared_a"] else "independent A (one per role)"

    def pair_rows(metrics: Sequence[str]) -> list[list[str]]:
        rows = [[p] + [fmt_cos(**cos[m]["per_pair"][p]) for m in metrics] for p in pairs]
        return rows + [["all pairs"] + [fmt_cos(cos[m]["mean"], cos[m]["std"]) for m in metrics]]

    t1 = ("full", "base", "adapter")
    t2 = ("lr", "hidden", "k")
    tables = [
        Table(
            "Table 1 layout: value-cache similarity between agents",
            ["Role pair", "Full V", "Base V = X·W0", "Adapter output s·X·A·B"],
            pair_rows(t1),
            "Mean cosine similarity over tokens, samples and layers; ± over samples.",
        ),
        Table(
            f"Table 2 layout: LR-cache similarity between agents ({a_kind})",
            ["Role pair", "LR cache X·A", "Layer input X", "K cache"],
            pair_rows(t2),
            "With shared A the LR caches differ only through the layer inputs X; with one A per role they are "
            "different projections and need not be similar.",
        ),
    ]
    l1 = s["l1"]
    l1_rows = [[r, fmt_l1(l1["base"]["per_role"][r]), fmt_l1(l1["adapter"]["per_role"][r]),
                fmt_cos(l1["ratio"]["per_role"][r])] for r in roles]  # fmt: skip
    l1_rows.append(["all roles", fmt_l1(l1["base"]["mean"]), fmt_l1(l1["adapter"]["mean"]),
                    fmt_cos(l1["ratio"]["mean"], l1["ratio"]["std"])])  # fmt: skip
    tables.append(
        Table(
            "Figure 6 values: L1 norms of base cache and adapter output",
            ["Role", "L1 base ‖X·W0‖₁", "L1 adapter ‖s·X·A·B‖₁", "ratio adapter / base"],
            l1_rows,
            "Per token vector, mean over tokens, samples and layers.",
        )
    )
    cross_mean, cross_std = s["cross"]["mean"], s["cross"]["std"]
    tables.append(
        Table(
            "Table 6 layout: cross terms cos(base_i, adapter_j)",
            ["base of \\ adapter of", *roles],
            [
                [r] + [fmt_cos(cross_mean[i][j], cross_std[i][j]) for j in range(len(roles))]
                for i, r in enumerate(roles)
            ],
            "Cosine similarity between role i's base cache X_i·W0 and role j's adapter output s·X_j·A_j·B_j "
            "(same token), mean over tokens, samples and layers.",
        )
    )
    metrics = ("full", "base", "adapter", "lr", "k", "hidden")
    layer_rows = []
    for li in range(cfg["n_layers"]):
        cells = [str(li)] + [fmt_cos(cos[m]["per_layer"][li]) for m in metrics]
        cells += [fmt_l1(l1["base"]["per_layer"][li]), fmt_l1(l1["adapter"]["per_layer"][li])]
        layer_rows.append(cells + [fmt_cos(l1["ratio"]["per_layer"][li])])
    tables.append(
        Table(
            "Per layer (mean over samples and pairs)",
            ["Layer", "Full V", "Base V", "Adapter", "LR cache", "K", "X", "L1 base", "L1 adapter", "L1 ratio"],
            layer_rows,
        )
    )
    return tables


def _run_header(doc: dict) -> list[str]:
    cfg, s = doc["config"], doc["summary"]
    adapters = cfg["adapters"] or f"untrained init `{cfg['adapter_init']}` (seed {cfg['seed']})"
    source = f"`{cfg['data']}`" if cfg["data"] else f"role-example inputs of `{cfg['benchmark']}`"
    state = "" if doc.get("complete", True) else " **(incomplete run)**"
    return [
        f"Run **{cfg['label']}**{state}: model `{cfg['model']}` ({cfg['n_layers']} layers, {cfg['dtype']} on "
        f"{cfg['device']}); adapters {adapters}: roles {', '.join(cfg['roles'])}, rank {cfg['rank']}, alpha "
        f"{cfg['alpha']:g}, targets {', '.join(cfg['targets'])}, {'shared' if cfg['shared_a'] else 'independent'} A.",
        f"Contexts: {s['n_samples']} {source} (draw seed {cfg['sample_seed']}), each cut to at most its first "
        f"{cfg['max_tokens']} tokens, {s['tokens_total']} tokens in all; measured in {doc.get('wall_s', 0):.1f} s "
        "wall clock (model load included).",
    ]


# ----------------------------------------------------------------------------------------------- one run: figures
def _nan(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def write_figures(doc: dict, out_dir: Path) -> list[Path]:
    """Writes the three PNG figures of :data:`FIGURES` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s, cfg = doc["summary"], doc["config"]
    layers = np.arange(cfg["n_layers"])
    pairs, roles = s["pairs"], cfg["roles"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for p, name in enumerate(pairs):
        c = colors[p % len(colors)]
        base = _nan([row[p] for row in s["cos"]["base"]["per_layer_pair"]])
        full = _nan([row[p] for row in s["cos"]["full"]["per_layer_pair"]])
        ax.plot(layers, base, "-", color=c, marker="o", ms=3, label=f"{name} base X·W0")
        ax.plot(layers, full, "--", color=c, marker="x", ms=3, label=f"{name} full V")
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine similarity")
    ax.set_title(f"Base vs full value cache across agents\n{cfg['label']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "fig1_base_vs_full.png")
    save_figure(fig, paths[-1])
    plt.close(fig)

    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    base_l1 = np.array(_nan(s["l1"]["base"]["per_layer"]))
    ad_role = np.array([_nan(row) for row in s["l1"]["adapter"]["per_layer_role"]])  # (L, R)
    ax.plot(layers, base_l1, "-k", marker="o", ms=3, label="base X·W0 (mean of roles)")
    for r, role in enumerate(roles):
        ax.plot(layers, ad_role[:, r], "-", color=colors[r % len(colors)], marker="x", ms=3, label=f"adapter {role}")
    if np.all(ad_role > 0) and np.all(base_l1 > 0):
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("L1 norm per token")
    ax.set_title("L1 norms", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax_r.plot(layers, _nan(s["l1"]["ratio"]["per_layer"]), "-", color=colors[0], marker="o", ms=3)
    ax_r.set_xlabel("layer")
    ax_r.set_ylabel("adapter L1 / base L1")
    ax_r.set_title("ratio", fontsize=9)
    ax_r.grid(alpha=0.3)
    fig.suptitle(cfg["label"], fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "fig6_l1_norms.png")
    save_figure(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    k = s["cos"]["k"]
    mean, std = np.array(_nan(k["per_layer"])), np.array(_nan(k["per_layer_std"]))
    ax.fill_between(layers, mean - std, mean + std, color="0.85", label="mean ± std")
    for p, name in enumerate(pairs):
        ax.plot(layers, _nan([row[p] for row in k["per_layer_pair"]]), "-", color=colors[p % len(colors)],
                marker="o", ms=3, label=name)  # fmt: skip
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine similarity of K")
    ax.set_title(f"K cache across agents\n{cfg['label']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "fig7_k_similarity.png")
    save_figure(fig, paths[-1])
    plt.close(fig)
    return paths


# -------------------------------------------------------------------------------------------------- one run: pages
def render_markdown(doc: dict) -> str:
    """``report.md`` of one run."""
    parts = [
        f"# Cache similarity across agents: {doc['config']['label']}\n",
        *(f"{line}\n" for line in _run_header(doc)),
    ]
    parts.append(f"\n**Definitions.** {DEFINITIONS}\n\n")
    parts += [t.markdown() for t in run_tables(doc)]
    parts.append("## Figures\n\n")
    parts += [f"![{name}]({name})\n\n{caption}\n\n" for name, caption in FIGURES.items()]
    return "".join(parts) + provenance_footer(doc["provenance"])


_CSS = (
    "body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #bbb;padding:.2em .6em;"
    "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#eee}"
    "img{max-width:100%}figure{margin:1em 0 2em}figcaption{font-size:.9em;color:#555}"
    ".prov{font-size:.8em;color:#666;border-top:1px solid #ccc;margin-top:2em;padding-top:.5em}"
)


def render_html(doc: dict, figures: Sequence[str]) -> str:
    """``report.html``: the tables and the figures (PNG files beside it, by relative name); no external resources."""
    cfg, prov = doc["config"], doc["provenance"]
    title = f"Cache similarity across agents: {cfg['label']}"
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"]  # fmt: skip
    parts += [f"<p>{html.escape(line.replace('**', '').replace('`', ''))}</p>\n" for line in _run_header(doc)]
    parts.append(f"<p><b>Definitions.</b> {html.escape(DEFINITIONS)}</p>\n")
    parts += [t.html() for t in run_tables(doc)[:-1]]
    for name in figures:
        caption = html.escape(FIGURES.get(name, name))
        parts.append(f"<figure><img src='{html.escape(name)}' alt='{caption}'><figcaption>{caption}</figcaption>"
                     "</figure>\n")  # fmt: skip
    parts.append(run_tables(doc)[-1].html())
    dev = prov.get("device") or {}
    parts.append(
        f"<div class='prov'>Produced on {html.escape(str(dev.get('name', '?')))} ({html.escape(str(dev.get('type')))})"
        f", commit {html.escape(str(prov.get('git_commit')))}{' (dirty)' if prov.get('git_dirty') else ''}, "
        f"{html.escape(str(prov.get('utc', '')))}. Command: <code>{html.escape(str(prov.get('command', '')))}</code>"
        "</div>\n</body></html>\n"
    )
    return "".join(parts)


def write_report(doc: dict, out_dir: str | Path) -> list[Path]:
    """Writes ``report.md``, the PNG figures and ``report.html`` of one run; returns their paths."""
    out_dir = Path(out_dir)
    figures = write_figures(doc, out_dir)
    write_text(out_dir / "report.md", render_markdown(doc))
    write_text(out_dir / "report.html", render_html(doc, [p.name for p in figures]))
    return [out_dir / "report.md", *figures, out_dir / "report.html"]


# ------------------------------------------------------------------------------------------------ several runs
def load_runs(dirs: Sequence[str | Path]) -> list[dict]:
    """The ``similarity.json`` of each run directory (each must be complete)."""
    runs = []
    for d in dirs:
        path = Path(d) / "similarity.json"
        if not path.is_file():
            raise FileNotFoundError(f"--merge {str(d)!r}: no similarity.json in it")
        doc = json.loads(path.read_text())
        if not doc.get("complete"):
            raise ValueError(f"--merge {str(d)!r}: the run is incomplete (complete: false); rerun it first")
        doc["dir"] = str(d)
        runs.append(doc)
    return runs


def summary_tables(runs: Sequence[dict]) -> list[Table]:
    """One row per run: Table 1, Table 2 and Table 6 layouts and the L1 ratio."""
    t1, t2, t6 = [], [], []
    for doc in runs:
        cfg, s = doc["config"], doc["summary"]
        cos = s["cos"]
        a = "shared" if cfg["shared_a"] else "independent"
        head = [cfg["label"], a]
        t1.append(head + [str(s["n_samples"]), str(s["tokens_total"])]
                  + [fmt_cos(cos[m]["mean"], cos[m]["std"]) for m in ("full", "base", "adapter")])  # fmt: skip
        t2.append(head + [fmt_cos(cos[m]["mean"], cos[m]["std"]) for m in ("lr", "hidden", "k")])
        cross = s["cross"]["mean"]
        n = len(cross)
        diag = [cross[i][i] for i in range(n)]
        off = [cross[i][j] for i in range(n) for j in range(n) if i != j]
        l1 = s["l1"]
        t6.append(head + [fmt_cos(_mean(diag)), fmt_cos(_mean(off)), fmt_cos(_max_abs(diag + off)),
                          fmt_l1(l1["base"]["mean"]), fmt_l1(l1["adapter"]["mean"]),
                          fmt_cos(l1["ratio"]["mean"], l1["ratio"]["std"])])  # fmt: skip
    return [
        Table(
            "Table 1 layout: value-cache similarity between agents",
            ["Run", "A", "contexts", "tokens", "Full V", "Base V = X·W0", "Adapter output s·X·A·B"],
            t1,
            "Mean cosine similarity over tokens, samples, layers and role pairs; ± over samples and pairs.",
        ),
        Table(
            "Table 2 layout: LR-cache similarity between agents",
            ["Run", "A", "LR cache X·A", "Layer input X", "K cache"],
            t2,
        ),
        Table(
            "Table 6 layout and Figure 6 values: cross terms and L1 norms",
            ["Run", "A", "cos(base_i, adapter_i)", "cos(base_i, adapter_j), i≠j", "max abs cross", "L1 base",
             "L1 adapter", "L1 adapter / base"],
            t6,
            "Cross terms averaged over the diagonal (same role) and the off-diagonal entries of each run's "
            "Table 6; max abs cross is the largest magnitude among them. L1 per token vector, mean over layers.",
        ),
    ]  # fmt: skip


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _max_abs(values: Sequence[float | None]) -> float | None:
    vals = [abs(v) for v in values if v is not None]
    return max(vals) if vals else None


def write_summary(runs: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """Writes ``summary.md`` and ``summary.json`` (each run's config and summary) into ``out_dir``."""
    out_dir = Path(out_dir)
    prov = provenance()
    md = ["# Cache similarity across agents: summary of runs\n\n", f"**Definitions.** {DEFINITIONS}\n\n"]
    md += [t.markdown() for t in summary_tables(runs)]
    md.append("Runs: " + "; ".join(f"{d['config']['label']} → `{d['dir']}`" for d in runs) + ".\n")
    write_text(out_dir / "summary.md", "".join(md) + provenance_footer(prov))
    body = {"runs": [{"dir": d["dir"], "config": d["config"], "summary": d["summary"],
                      "wall_s": d.get("wall_s")} for d in runs], "provenance": prov}  # fmt: skip
    write_json(out_dir / "summary.json", body)
    return [out_dir / "summary.md", out_dir / "summary.json"]
