"""The README's speed table (eval_suite/bench/speed_table.py) from benchmark records: the default plan's figures only,
ranges over repeats, the trace's ratios, and whether every figure is from one commit."""

from __future__ import annotations

import json
from pathlib import Path

from eval_suite.bench import speed_table


def _prov(device: str, commit: str) -> dict:
    return {"device": {"type": "cuda", "name": device, "count": 1}, "git_commit": commit, "git_dirty": False}


def _decode(path: Path, device: str, commit: str) -> None:
    rows = [
        {"impl": "transformers eager", "scheme": "-", "batch": 1, "ms_per_token": 30.4},
        {"impl": "lragent graph", "scheme": "base_lr_shared", "batch": 1, "plan": "", "ms_per_token": 6.131,
         "vs_floor": 1.186},
        {"impl": "lragent graph", "scheme": "base_lr_shared", "batch": 1, "plan": "", "ms_per_token": 6.138,
         "vs_floor": 1.188},
        # an experiment's plan: not the product's figure
        {"impl": "lragent graph", "scheme": "base_lr_shared", "batch": 1, "plan": "qkv_rope=0", "ms_per_token": 9.9,
         "vs_floor": 1.9},
        {"impl": "lragent graph", "scheme": "full_shared", "batch": 32, "plan": "", "ms_per_token": 9.76,
         "vs_floor": 1.21},
    ]  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    body = {"model": "llama-3.1-8b", "context": 2048, "rows": rows, "provenance": _prov(device, commit)}
    (path / "bench_decode.json").write_text(json.dumps(body))


def _trace(path: Path, device: str, commit: str, schemes: dict[str, tuple[float, float]], ctx: int = 16384) -> None:
    runs = [{"scheme": s, "l_ctx": ctx, "kernel": True, "throughput_tok_s": tps, "prefill_mfu": mfu}
            for s, (tps, mfu) in schemes.items()]  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    body = {"model": "llama-3.1-8b", "runs": runs, "provenance": _prov(device, commit)}
    (path / "bench_trace.json").write_text(json.dumps(body))


def test_the_table_holds_the_default_plan_and_the_traces_ratios(tmp_path: Path) -> None:
    _decode(tmp_path / "h100" / "decode", "H100", "a" * 40)
    _trace(
        tmp_path / "h100" / "trace16",
        "H100",
        "a" * 40,
        {"non_shared": (37500.0, 0.47), "full_shared": (71500.0, 0.391), "base_lr_shared": (72800.0, 0.402)},
    )
    _trace(tmp_path / "h100" / "trace32", "H100", "a" * 40,
           {"full_shared": (58700.0, 0.375), "base_lr_shared": (59000.0, 0.377)}, ctx=32768)  # fmt: skip
    col = speed_table.collect(tmp_path / "h100")
    cells = col["cells"]
    assert cells["8B, decode at 2048 context, batch 1, `base_lr_shared` (ms/token; × the floor)"] == "6.13-6.14 (1.19×)"
    assert cells["8B, decode at 2048 context, batch 32, `full_shared` (ms/token; × the floor)"] == "9.76 (1.21×)"
    assert cells["8B, transformers' eager loop, batch 1 (ms/token)"] == "30.40"
    assert cells["8B, the trace at L_ctx 16k: `base_lr_shared` throughput vs `non_shared`"] == (
        "1.94× (72.8k tokens/s; `full_shared` 71.5k)"
    )
    no_base = cells["8B, the trace at L_ctx 32k: `base_lr_shared` throughput vs `non_shared`"]
    assert no_base.startswith("no `non_shared` run (59.0k")
    assert cells["8B, the trace's prefill MFU at L_ctx 32k, `base_lr_shared` (`full_shared`)"] == (
        "37.7% (37.5%; ratio 1.005)"
    )
    text = speed_table.render([col])
    assert "Every figure from commit aaaaaaa." in text and "| | H100 |" in text


def test_a_second_gpu_is_a_column_and_other_commits_are_named(tmp_path: Path) -> None:
    _decode(tmp_path / "h100", "H100", "a" * 40)
    _decode(tmp_path / "h200", "H200", "b" * 40)
    _trace(tmp_path / "h200", "H200", "b" * 40, {"full_shared": (77400.0, 0.3), "base_lr_shared": (77000.0, 0.31)})
    text = speed_table.render([speed_table.collect(tmp_path / "h100"), speed_table.collect(tmp_path / "h200")])
    assert "| | H100 | H200 |" in text
    assert "**Not one commit**: aaaaaaa, bbbbbbb." in text
    mfu_row = next(line for line in text.splitlines() if "prefill MFU at L_ctx 16k" in line)
    assert mfu_row.split(" | ")[1] == "–"  # the H100 has no trace here: nothing filled in


def test_the_runs_of_one_folder_are_one_range(tmp_path: Path) -> None:
    """Two decode runs in one GPU's folder (the readme bench's decode1 and decode2): each cell spans both runs'
    figures (a table once showed only the last run's, 1.16× where the first had 1.14×)."""
    _decode(tmp_path / "h100" / "decode1", "H100", "a" * 40)
    second = tmp_path / "h100" / "decode2"
    _decode(second, "H100", "a" * 40)
    body = json.loads((second / "bench_decode.json").read_text())
    for r in body["rows"]:
        if r.get("scheme") == "base_lr_shared" and not r.get("plan"):
            r["ms_per_token"], r["vs_floor"] = r["ms_per_token"] + 0.05, r["vs_floor"] - 0.04
    (second / "bench_decode.json").write_text(json.dumps(body))
    cells = speed_table.collect(tmp_path / "h100")["cells"]
    assert cells["8B, decode at 2048 context, batch 1, `base_lr_shared` (ms/token; × the floor)"] == (
        "6.13-6.19 (1.15-1.19×)"
    )


def test_a_folder_without_records_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert speed_table.main([str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no bench_decode.json or bench_trace.json" in err and err.count("\n") == 1


def test_out_gets_the_printed_table_in_a_new_folder(tmp_path: Path, capsys) -> None:
    _decode(tmp_path / "h100" / "decode", "H100", "a" * 40)
    out = tmp_path / "new" / "speed.md"
    assert speed_table.main([str(tmp_path / "h100"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed and out.read_text() == printed


def test_the_whole_table_text_of_two_gpus(tmp_path: Path) -> None:
    """The rendered Markdown exactly: the header of one column per GPU, a row per figure in first-seen order (a
    figure one GPU lacks is "–"), a blank line, the commits line, and one line per record naming its path and
    commit (a dirty tree marked)."""
    _decode(tmp_path / "h100", "H100", "a" * 40)
    _trace(tmp_path / "h200", "H200", "b" * 40, {"full_shared": (77400.0, 0.3), "base_lr_shared": (77000.0, 0.31)})
    _decode(tmp_path / "h200", "H200", "b" * 40)
    dirty = json.loads((tmp_path / "h200" / "bench_trace.json").read_text())
    dirty["provenance"]["git_dirty"] = True
    (tmp_path / "h200" / "bench_trace.json").write_text(json.dumps(dirty))
    text = speed_table.render([speed_table.collect(tmp_path / "h100"), speed_table.collect(tmp_path / "h200")])
    decode = "8B, decode at 2048 context, batch"
    assert text == (
        "| | H100 | H200 |\n"
        "|---|---:|---:|\n"
        f"| {decode} 1, `base_lr_shared` (ms/token; × the floor) | 6.13-6.14 (1.19×) | 6.13-6.14 (1.19×) |\n"
        "| 8B, transformers' eager loop, batch 1 (ms/token) | 30.40 | 30.40 |\n"
        f"| {decode} 32, `full_shared` (ms/token; × the floor) | 9.76 (1.21×) | 9.76 (1.21×) |\n"
        "| 8B, the trace at L_ctx 16k: `base_lr_shared` throughput vs `non_shared` | – | no `non_shared` run (77.0k "
        "tokens/s; `full_shared` 77.4k) |\n"
        "| 8B, the trace's prefill MFU at L_ctx 16k, `base_lr_shared` (`full_shared`) | – | 31.0% (30.0%; ratio "
        "1.033) |\n"
        "\n"
        "**Not one commit**: aaaaaaa, bbbbbbb, bbbbbbb (dirty).\n"
        f"- H100: `{tmp_path / 'h100' / 'bench_decode.json'}` at aaaaaaa\n"
        f"- H200: `{tmp_path / 'h200' / 'bench_decode.json'}` at bbbbbbb\n"
        f"- H200: `{tmp_path / 'h200' / 'bench_trace.json'}` at bbbbbbb (dirty)\n"
    )  # fmt: skip


def test_records_without_names_or_with_other_models_and_unusable_entries(tmp_path: Path) -> None:
    """An unreadable record is skipped (the next ones still read); a record without a model, context, device or
    commit shows "?" / "unknown"; Qwen2.5-Coder-1.5B has its short name and other models their own; trace runs
    without the kernel, entries that are not objects and a context with only ``base_lr_shared`` (no ratio to give)
    fill no cell (its MFU alone is given); several devices in one folder are named together."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bench_trace.json").write_text("{not json")
    rows = [{"impl": "lragent graph", "scheme": "base_lr_shared", "batch": 2, "ms_per_token": 3.0}, "junk"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench_decode.json").write_text(json.dumps({"rows": rows, "provenance": {}}))
    runs = [{"scheme": s, "l_ctx": 2048, "throughput_tok_s": 10.0, "prefill_mfu": None}
            for s in ("base_lr_shared", "non_shared")]  # fmt: skip
    runs += [{"scheme": "full_shared", "l_ctx": 4096, "kernel": False, "throughput_tok_s": 99.0}, "junk"]
    runs += [{"scheme": "base_lr_shared", "l_ctx": 8192, "kernel": True, "throughput_tok_s": 5.0, "prefill_mfu": 0.5}]
    runs += [{"scheme": "non_shared", "l_ctx": 8192, "kernel": False, "throughput_tok_s": 1.0}]
    trace = {"model": "qwen2.5-coder-1.5b", "runs": runs, "provenance": _prov("L40S", "c" * 40)}
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "bench_trace.json").write_text(json.dumps(trace))
    eager = [{"impl": "transformers eager", "batch": 1, "ms_per_token": 1.234}]
    other = {"model": "my-model", "context": 512, "rows": eager, "provenance": _prov("A100", "d" * 40)}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "bench_decode.json").write_text(json.dumps(other))
    (tmp_path / "e").mkdir()
    runs = [{"scheme": s, "l_ctx": 1024, "throughput_tok_s": 3e3} for s in ("base_lr_shared", "full_shared")]
    (tmp_path / "e" / "bench_trace.json").write_text(json.dumps({"runs": runs, "provenance": _prov("A100", "d" * 40)}))
    col = speed_table.collect(tmp_path)
    assert col["device"] == "?, A100, L40S"
    assert [sha for sha, _ in col["commits"]] == ["unknown", "ddddddd", "ccccccc", "ddddddd"]
    assert col["cells"] == {
        "?, decode at ? context, batch 2, `base_lr_shared` (ms/token; × the floor)": "3.00 (–×)",
        "my-model, transformers' eager loop, batch 1 (ms/token)": "1.23",
        "Qwen2.5-Coder-1.5B, the trace at L_ctx 2k: `base_lr_shared` throughput vs `non_shared`": (
            "1.00× (0.0k tokens/s)"
        ),
        "Qwen2.5-Coder-1.5B, the trace's prefill MFU at L_ctx 8k, `base_lr_shared` (`full_shared`)": "50.0%",
        "?, the trace at L_ctx 1k: `base_lr_shared` throughput vs `non_shared`": "no `non_shared` run (3.0k tokens/s; "
        "`full_shared` 3.0k)",
    }  # fmt: skip


def test_out_goes_into_an_existing_folder_too(tmp_path: Path, capsys) -> None:
    """``--out`` in a folder that exists already (and in a new folder two levels down) gets the printed table."""
    _decode(tmp_path / "h100", "H100", "a" * 40)
    for out in (tmp_path / "h100" / "speed.md", tmp_path / "x" / "y" / "speed.md"):
        assert speed_table.speed_table([str(tmp_path / "h100")], str(out)) == 0
        assert out.read_text() == capsys.readouterr().out
