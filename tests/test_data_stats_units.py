"""``cli.py data-stats`` (eval_suite/diagnostics/data_stats.py) on tiny role files in place of the bundled ones (fast;
tests/test_prefix_packing.py runs it on the bundled ScienceQA files): the length figures of each role, the two data
paths' epoch figures and how they relate, and the Markdown and JSON written."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import eval_suite.diagnostics.data_stats as ds

ROLES = ("plan", "action", "reflect")


def _role_files(root: Path, bench: str, trajectories: int) -> dict[str, list[int]]:
    """Writes ``bench``'s three role files (steps cut from whole trajectories, so prefixes pack) under ``root``;
    returns each role's full example lengths in bytes (input + output + EOS)."""
    lengths: dict[str, list[int]] = {}
    for r, role in enumerate(ROLES):
        rows = []
        for i in range(trajectories):
            history = f"Q{i}{r}\n"
            for k in range(2):
                prompt = history + f"{role[0]}:"
                out = f"s{k}{i}" + "x" * (r + k)
                rows.append({"input": prompt, "output": out})
                history = prompt + out + "\n"
        path = root / "trajectories" / bench / f"{role}.jsonl.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            f.write("".join(json.dumps(x) + "\n" for x in rows))
        lengths[role] = [len(x["input"]) + len(x["output"]) + 1 for x in rows]
    return lengths


@pytest.fixture
def data(tmp_path: Path, monkeypatch) -> dict[str, dict[str, list[int]]]:
    root = tmp_path / "data"
    monkeypatch.setattr(ds, "DATA_DIR", root)
    return {"hotpotqa": _role_files(root, "hotpotqa", 3), "scienceqa": _role_files(root, "scienceqa", 2)}


def _run(tmp_path: Path, **kw) -> tuple[dict, str]:
    args = dict(tokenizer="byte", max_length=20, max_tokens=48, batch_size=2, pool_batches=1, accumulate=2,
                baseline_accumulate=3, val_fraction=0.0)  # fmt: skip
    assert ds.data_stats(str(tmp_path / "out"), **{**args, **kw}) == 0
    out = tmp_path / "out"
    return json.loads((out / "data_stats.json").read_text()), (out / "data_stats.md").read_text()


def test_every_bundled_benchmark_by_default_with_each_roles_lengths(tmp_path: Path, data, capsys) -> None:
    """Without ``benchmarks`` both bundled sets, in order; per role the count, percentiles and max of the whole
    examples' lengths, the output tokens' share (output + EOS) and the share within ``max_length`` (inclusive);
    the settings are recorded with provenance and the Markdown is printed too."""
    stats, md = _run(tmp_path)
    assert list(stats["benchmarks"]) == ["hotpotqa", "scienceqa"]
    assert stats["settings"] == {"tokenizer": "byte", "max_length": 20, "max_tokens": 48, "pack_prefixes": True,
                                 "accumulate": 2, "batch_size": 2, "baseline_accumulate": 3}  # fmt: skip
    assert stats["provenance"]["device"]["type"] == "cpu" and "git_commit" in stats["provenance"]
    for bench, roles in data.items():
        for role, lengths in roles.items():
            got = stats["benchmarks"][bench]["roles"][role]
            x = np.asarray(lengths)
            outputs = sum(len(f"s{k}{i}") + ROLES.index(role) + k + 1 for i in range(len(x) // 2) for k in range(2))
            assert got == {"n": len(x), "p50": float(np.percentile(x, 50)), "p95": float(np.percentile(x, 95)),
                           "p99": float(np.percentile(x, 99)), "max": int(x.max()),
                           "output_share": outputs / x.sum(), "fit_share": float((x <= 20).mean())}  # fmt: skip
    plan = stats["benchmarks"]["scienceqa"]["roles"]["plan"]
    assert plan["n"] == 4 and plan["max"] == 17 and plan["fit_share"] == 1.0
    assert stats["benchmarks"]["scienceqa"]["roles"]["reflect"]["fit_share"] == 0.5  # 21 > 20, 20 fits
    assert md.startswith("# Role data: token lengths and batches\n\n## hotpotqa\n\n")
    assert md.index("## hotpotqa") < md.index("## scienceqa")
    assert "Token lengths of whole examples (input + output + EOS), `max_length` 20:" in md
    assert "| role | examples | p50 | p95 | p99 | max | output tokens | fit 20 |" in md
    for role in ROLES:  # scienceqa's rows, from the lengths written
        x, got = data["scienceqa"][role], stats["benchmarks"]["scienceqa"]["roles"][role]
        assert (f"| {role} | 4 | {np.percentile(x, 50):.0f} | {np.percentile(x, 95):.0f} | {np.percentile(x, 99):.0f} "
                f"| {max(x)} | {100 * got['output_share']:.1f}% | {100 * got['fit_share']:.1f}% |") in md  # fmt: skip
    assert "| reflect | 4 | 16 | 21 | 21 | 21 | 39.4% | 50.0% |" in md
    assert capsys.readouterr().out == md + "\n"


def test_the_configured_and_baseline_paths_epoch_figures(tmp_path: Path, data) -> None:
    """The configured path packs prefixes into fewer sequences under a padded-token budget, the baseline has one
    example per sequence in batches of ``batch_size``; each path's padding, optimizer steps (batches / its
    accumulation) and per-step figures follow from its tokens, padded tokens and batches; the table shows them."""
    stats, md = _run(tmp_path, benchmarks=["hotpotqa"])
    assert list(stats["benchmarks"]) == ["hotpotqa"]
    conf, base = (stats["benchmarks"]["hotpotqa"]["batching"][k] for k in ("configured", "baseline"))
    examples = sum(len(v) for v in data["hotpotqa"].values())
    assert conf["examples"] == base["examples"] == base["sequences"] == examples == 18
    assert conf["sequences"] == 12  # packed; the baseline's tokens: each example cut to max_length 20
    assert base["tokens"] == sum(min(n, 20) for v in data["hotpotqa"].values() for n in v) == 267
    assert conf["tokens"] < base["tokens"] and base["max_rows"] == 2 and conf["max_rows"] >= 2
    for p, accumulate in ((conf, 2), (base, 3)):
        assert p["padding"] == pytest.approx(1 - p["tokens"] / p["padded_tokens"]) and p["padded_tokens"] > p["tokens"]
        assert p["optimizer_steps"] == p["batches"] / accumulate
        assert p["tokens_per_step"] == p["tokens"] / p["optimizer_steps"]
        assert p["padded_tokens_per_step"] == p["padded_tokens"] / p["optimizer_steps"]
        assert p["examples_per_step"] == examples / p["optimizer_steps"]
    assert base["batches"] == 9 and conf["batches"] == 6
    assert "Training split (100% of each role), one epoch:" in md
    assert "| data path | examples | sequences | tokens | padding | batches | optimizer steps | tokens / step |" in md
    row = (f"| configured: prefix-packed, batches of <= 48 padded tokens, accumulate 2 | 18 | 12 | {conf['tokens']} | "
           f"{100 * conf['padding']:.1f}% | 6 | 3 | {conf['tokens_per_step']:,.0f} | 6.0 |")  # fmt: skip
    assert row in md
    assert ("| baseline: one example per sequence, batches of 2, accumulate 3 | 18 | 18 | 267 | "
            f"{100 * base['padding']:.1f}% | 9 | 3 | 89 | 6.0 |") in md  # fmt: skip
    _, plain = _run(tmp_path, benchmarks=["scienceqa"], pack_prefixes=False, max_tokens=None, val_fraction=0.5)
    assert "| configured: one example per sequence, batches of 2, accumulate 2 |" in plain
    assert "Training split (50% of each role), one epoch:" in plain


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(benchmarks=["scienceqa", "gsm8k"]), "benchmark 'gsm8k' not bundled: allowed hotpotqa, scienceqa"),
        (dict(max_length=1), "need max_length >= 2 and max_tokens >= max_length, got 1, 48"),
        (dict(max_length=49), "need max_length >= 2 and max_tokens >= max_length, got 49, 48"),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path: Path, data, kw, message) -> None:
    """An unbundled benchmark, ``max_length`` below 2 or a token budget below ``max_length``: an error naming the
    values, no output folder."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        _run(tmp_path, **kw)
    assert not (tmp_path / "out").exists()


def test_a_budget_equal_to_max_length_is_allowed(tmp_path: Path, data) -> None:
    """``max_tokens == max_length`` is the smallest budget allowed."""
    stats, _ = _run(tmp_path, benchmarks=["scienceqa"], max_length=24, max_tokens=24)
    assert stats["settings"]["max_tokens"] == 24


def test_the_defaults_and_a_wider_token_budget(tmp_path: Path, data) -> None:
    """The defaults are the paper's data settings (max_length 4096, max_tokens 16384, prefix packing, accumulate 1,
    batches of 4, the baseline accumulating 8, 5% held out); a token budget wider than ``batch_size`` examples puts
    more rows in a configured batch than the baseline's fixed batches hold."""
    assert ds.data_stats(str(tmp_path / "out"), ["scienceqa"], tokenizer="byte") == 0
    stats = json.loads((tmp_path / "out" / "data_stats.json").read_text())
    assert stats["settings"] == {"tokenizer": "byte", "max_length": 4096, "max_tokens": 16384, "pack_prefixes": True,
                                 "accumulate": 1, "batch_size": 4, "baseline_accumulate": 8}  # fmt: skip
    md = (tmp_path / "out" / "data_stats.md").read_text()
    assert "Training split (95% of each role), one epoch:" in md and "fit 4096 |" in md
    wide, _ = _run(tmp_path, benchmarks=["hotpotqa"], max_tokens=100)
    conf, base = (wide["benchmarks"]["hotpotqa"]["batching"][k] for k in ("configured", "baseline"))
    assert conf["max_rows"] > base["max_rows"] == 2 and conf["batches"] < base["batches"]


def test_length_stats_percentiles_and_the_share_that_fits() -> None:
    """p50 / p95 / p99 are numpy's linear percentiles of the lengths, an example of exactly ``max_length`` fits."""
    s = ds.length_stats(list(range(1, 102)), [1] * 101, max_length=51)
    assert (s["p50"], s["p95"], s["p99"], s["max"]) == (51.0, 96.0, 100.0, 101)
    assert s["fit_share"] == 51 / 101 and s["output_share"] == 101 / sum(range(1, 102))


def test_the_markdown_layout(tmp_path: Path, data) -> None:
    """Blank lines around each heading, sentence and table; the batching table's header and alignment row (the
    data path left, eight figures right); ``max_length`` 2 passes the option check (the examples then do not fit)."""
    _, md = _run(tmp_path, benchmarks=["scienceqa", "hotpotqa"])
    assert md.startswith("# Role data: token lengths and batches\n\n## scienceqa\n\nToken lengths of whole examples "
                         "(input + output + EOS), `max_length` 20:\n\n| role |")  # fmt: skip
    assert ("|\n\n\nTraining split (100% of each role), one epoch:\n\n| data path | examples | sequences | tokens | "
            "padding | batches | optimizer steps | tokens / step | examples / step |\n"
            "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n| configured: ") in md  # fmt: skip
    assert " |\n\n\n## hotpotqa\n\n" in md
    with pytest.raises(ValueError, match="leaves no room for context in max_length=2"):
        _run(tmp_path, benchmarks=["scienceqa"], max_length=2, max_tokens=None)


def test_examples_are_measured_whole_however_long(tmp_path: Path, monkeypatch) -> None:
    """A role example longer than anything ``max_length`` allows is counted at its full length (nothing cut)."""
    root = tmp_path / "data"
    monkeypatch.setattr(ds, "DATA_DIR", root)
    for role in ROLES:
        path = root / "trajectories" / "hotpotqa" / f"{role}.jsonl.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"input": "q" * 300 + str(i), "output": "a" * 20} for i in range(2)]
        with gzip.open(path, "wt") as f:
            f.write("".join(json.dumps(x) + "\n" for x in rows))
    stats, _ = _run(tmp_path, benchmarks=["hotpotqa"], max_length=64, max_tokens=128)
    plan = stats["benchmarks"]["hotpotqa"]["roles"]["plan"]
    assert plan["max"] == 322 and plan["fit_share"] == 0.0
