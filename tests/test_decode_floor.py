"""The decode floor's byte count (eval_suite/bench/decode.py): what one decode step must read.

A decode step gathers one input embedding row per sequence; the LM head reads its whole matrix. So an untied input
table counts only for the gathered rows, and a tied one (read whole by the LM head) counts once, whole.
"""

from __future__ import annotations

import pytest
import torch

from eval_suite.bench.decode import unread_embedding_bytes, weight_bytes
from lragent.models import load_model


@pytest.mark.parametrize("rows", [1, 32])
def test_an_untied_input_table_counts_only_its_gathered_rows(rows: int) -> None:
    hf, _ = load_model("tiny-llama", dtype=torch.float32, device="cpu")  # 256 x 64, not tied
    emb = hf.get_input_embeddings().weight
    assert emb.data_ptr() != hf.get_output_embeddings().weight.data_ptr()
    assert unread_embedding_bytes(hf, rows) == (256 - rows) * 64 * 4
    read = weight_bytes(hf) - unread_embedding_bytes(hf, rows)
    others = sum(p.numel() * 4 for n, p in hf.named_parameters() if "embed_tokens" not in n)
    assert read == others + rows * 64 * 4  # every other weight whole, plus the gathered rows


def test_a_tied_table_is_read_whole_by_the_head() -> None:
    hf, _ = load_model("tiny-llama", dtype=torch.float32, device="cpu", overrides={"tie_word_embeddings": True})
    hf.tie_weights()
    assert hf.get_input_embeddings().weight.data_ptr() == hf.get_output_embeddings().weight.data_ptr()
    assert unread_embedding_bytes(hf, 1) == 0
    assert unread_embedding_bytes(hf, 10_000) == 0


def test_more_rows_than_the_vocabulary_leave_nothing_unread() -> None:
    hf, _ = load_model("tiny-llama", dtype=torch.float32, device="cpu")
    assert unread_embedding_bytes(hf, 10_000) == 0


@pytest.mark.parametrize("rows", [1, 7])
def test_the_config_count_matches_the_loaded_models(rows: int) -> None:
    from eval_suite.bench.decode import config_unread_bytes

    hf, _ = load_model("tiny-llama", dtype=torch.bfloat16, device="cpu")
    assert config_unread_bytes("tiny-llama", "bfloat16")(rows) == unread_embedding_bytes(hf, rows) > 0
    assert config_unread_bytes("smollm2-135m", "bfloat16")(rows) == 0  # tied


def test_an_earlier_record_is_refloored_from_its_own_bytes(tmp_path) -> None:
    """A record that counted the table whole: each floor loses exactly the unread rows' bytes over the recorded
    bandwidth, the ratio follows, the markdown says so; a record already current is left as it is."""
    import json

    from eval_suite.bench.decode import EMBEDDING_FLOOR, config_unread_bytes, main

    bw = 2.0e12
    unread = config_unread_bytes("tiny-llama", "bfloat16")
    old_floor = {1: 1e3 * 1.0e9 / bw, 32: 1e3 * 1.5e9 / bw}
    rows = [{"impl": "transformers eager", "scheme": "-", "batch": 1, "ms_per_token": 9.0, "tokens_per_s": 111,
             "speedup_vs_transformers": 1.0}]  # fmt: skip
    rows += [{"impl": "lragent graph", "scheme": "base_lr_shared", "batch": b, "ms_per_token": 0.6 * b ** 0.1,
              "tokens_per_s": 1.0, "floor_ms": old_floor[b], "vs_floor": 0.6 * b ** 0.1 / old_floor[b],
              "speedup_vs_transformers": None} for b in (1, 32)]  # fmt: skip
    record = {"model": "tiny-llama", "context": 16, "new_tokens": 4, "rank": 8, "copy_bandwidth_bytes_per_s": bw,
              "weight_bytes": 10**9, "weight_bytes_with_adapters": 10**9, "rows": rows,
              "provenance": {"dtype": "torch.bfloat16", "device": {"name": "fake"}}}  # fmt: skip
    (tmp_path / "bench_decode.json").write_text(json.dumps(record))
    assert main(["--refloor", str(tmp_path)]) == 0
    new = json.loads((tmp_path / "bench_decode.json").read_text())
    assert new["embedding_floor"] == EMBEDDING_FLOOR and new["unread_embedding_bytes"] == unread(1)
    for r_old, r_new in zip(rows[1:], new["rows"][1:], strict=True):
        want = old_floor[r_old["batch"]] - 1e3 * unread(r_old["batch"]) / bw
        assert r_new["floor_ms"] == pytest.approx(want, rel=1e-12)
        assert r_new["vs_floor"] == pytest.approx(r_old["ms_per_token"] / want, rel=1e-12)
    assert new["rows"][0] == rows[0]  # no floor, untouched
    assert "Floors recomputed after the run" in (tmp_path / "bench_decode.md").read_text()
    assert main(["--refloor", str(tmp_path)]) == 0  # current now: unchanged by a second pass
    assert json.loads((tmp_path / "bench_decode.json").read_text()) == new
    assert main(["--refloor", str(tmp_path / "nothing")]) == 2


def test_decode_plans_are_checked_before_anything_loads_and_shown_per_row(monkeypatch) -> None:
    """bench decode --plans times decode-attention kernel plans side by side: a bad setting is named before the GPU
    check or any loading, and the report gains a plan column only when a plan other than the rule was timed."""
    from eval_suite.bench.decode import decode, render

    with pytest.raises(ValueError, match="unknown setting 'min_split'; allowed: programs_per_sm"):
        decode(plans=["", "min_split=4"], out="/nonexistent/never_written")
    with pytest.raises(ValueError, match="num_warps must be a positive integer, got '0'"):
        decode(plans=["num_warps=0"], out="/nonexistent/never_written")
    with pytest.raises(ValueError, match=r"LRAGENT_FUSED_GEMV='33': allowed 0 \(off\) to 32"):
        decode(plans=["fused_gemv=33"], out="/nonexistent/never_written")
    # fused_gemv is the engine's switch (LRAGENT_FUSED_GEMV), the rest the attention kernel's plan
    from eval_suite.bench.decode import split_plan

    assert split_plan("fused_gemv=1,min_split_tiles=4") == ("min_split_tiles=4", {"fused_gemv": 1})
    assert split_plan("min_split_tiles=4, fused_gemv=0") == ("min_split_tiles=4", {"fused_gemv": 0})
    assert split_plan("") == ("", {}) and split_plan("fused_gemv=4") == ("", {"fused_gemv": 4})  # {}: the environment's
    assert split_plan("num_warps=4,fused_gemv=1,block_n=32") == ("num_warps=4,block_n=32", {"fused_gemv": 1})
    with pytest.raises(ValueError, match="LRAGENT_FUSED_GEMV='x'"):
        split_plan("fused_gemv=")
    # the q/k/v launch's register cap is an engine switch too, checked by its own parser
    assert split_plan("qkv_maxnreg=80,qkv_rope=1") == ("", {"qkv_maxnreg": 80, "qkv_rope": 1})
    with pytest.raises(ValueError, match=r"LRAGENT_QKV_MAXNREG='300': allowed 0 \(the compiler's choice\)"):
        split_plan("qkv_maxnreg=300")
    # PDL too: both values, a bad one named
    assert split_plan("pdl=0") == ("", {"pdl": 0}) and split_plan("pdl=1,num_warps=4") == ("num_warps=4", {"pdl": 1})
    with pytest.raises(ValueError, match=r"LRAGENT_PDL='2': expected 1 .* or 0"):
        split_plan("pdl=2")
    # the GEMVs' measured launches by GPU model: on or off, a bad value named
    assert split_plan("gemv_table=0,pdl=1") == ("", {"gemv_table": 0, "pdl": 1})
    with pytest.raises(ValueError, match=r"LRAGENT_GEMV_TABLE='on': expected 1 .* or 0"):
        split_plan("gemv_table=on")
    # a wide one-row norm GEMV fused or left to cuBLAS
    assert split_plan("gemv_wide=0,gemv_table=1") == ("", {"gemv_wide": 0, "gemv_table": 1})
    with pytest.raises(ValueError, match=r"LRAGENT_GEMV_WIDE='-1': expected 1 \(fused\)"):
        split_plan("gemv_wide=-1")
    monkeypatch.setenv("LRAGENT_FUSED_GEMV", "all")  # a bad switch in the environment: named before anything loads
    with pytest.raises(ValueError, match=r"LRAGENT_FUSED_GEMV='all': allowed 0 \(off\) to 32"):
        decode(plans=["num_warps=4"], out="/nonexistent/never_written")

    def row(impl, plan, ms):
        r = {"impl": impl, "scheme": "base_lr_shared" if plan is not None else "-", "batch": 1, "ms_per_token": ms,
             "tokens_per_s": 1e3 / ms, "speedup_vs_transformers": None}  # fmt: skip
        if plan is not None:
            r.update(plan=plan, floor_ms=5.0, vs_floor=ms / 5.0)
        return r

    record = {"model": "tiny-llama", "context": 8, "new_tokens": 4, "rank": 8, "copy_bandwidth_bytes_per_s": 2e12,
              "weight_bytes": 1e9, "weight_bytes_with_adapters": 1e9, "unread_embedding_bytes": 0,
              "plans": ["", "min_split_tiles=4"],
              "rows": [row("transformers eager", None, 30.0), row("lragent graph", "", 6.5),
                       row("lragent graph", "min_split_tiles=4", 6.2)],
              "provenance": {"dtype": "torch.bfloat16", "device": {"name": "fake"}}}  # fmt: skip
    md = render(record, "bfloat16")
    assert "| impl | scheme | decode plan | batch |" in md
    assert "| lragent graph | base_lr_shared | rule | 1 | 6.500 |" in md
    assert "| lragent graph | base_lr_shared | min_split_tiles=4 | 1 | 6.200 |" in md
    assert "| transformers eager | - | – | 1 |" in md
    for older in ({k: v for k, v in record.items() if k != "plans"}, {**record, "plans": [""]}):
        assert "decode plan" not in render(older, "bfloat16")  # records without a plan sweep read as before
    assert "turn" not in md  # one turn: no column
    # --repeats 2: the plans timed in turns, each row with its turn; a repeat below 1 is refused before anything loads
    b = "fused_gemv=0"
    turns = [{**row("lragent graph", p, ms), "repeat": k} for k, p, ms in ((1, "", 6.5), (1, b, 6.3), (2, "", 6.6),
                                                                        (2, b, 6.2))]  # fmt: skip
    md = render({**record, "plans": ["", b], "rows": [row("transformers eager", None, 30.0), *turns]}, "bfloat16")
    assert "| impl | scheme | decode plan | turn | batch |" in md
    assert "| lragent graph | base_lr_shared | fused_gemv=0 | 2 | 1 | 6.200 |" in md and "| – | – | 1 | 30.000 |" in md
    from eval_suite.bench.decode import plan_turns

    assert plan_turns(["", b], 2) == [(0, ""), (0, b), (1, ""), (1, b)]  # in turns, not A A B B
    assert plan_turns(["x"], 1) == [(0, "x")]
    monkeypatch.delenv("LRAGENT_FUSED_GEMV")
    with pytest.raises(ValueError, match="repeats must be >= 1, got .* 0"):
        decode(repeats=0, out="/nonexistent/never_written")


def test_the_copy_rate_is_the_fastest_copys() -> None:
    """A copy slowed by anything else on the card says nothing about the memory: the rate is the fastest copy's
    (a median of these would be 20% lower and lower the floor's bound with it)."""
    from eval_suite.bench.decode import copy_rate

    n = 1 << 30
    assert copy_rate([1.25e-3, 1.0e-3, 1.3e-3, 1.25e-3, 1.2e-3], n) == pytest.approx(2 * n / 1.0e-3)
    with pytest.raises(ValueError, match="positive copy times"):
        copy_rate([], n)


def test_the_floor_takes_the_highest_bandwidth_the_run_measured() -> None:
    """Two measurements of one card 4% apart (3.97 and 4.14 TB/s, an H200 run of 13fad9a): the floor is the bytes
    over the higher, whichever came first, and each ratio follows from it; rows without bytes (transformers) get
    none."""
    from eval_suite.bench.decode import set_floors

    for measures in ([3.97e12, 4.14e12], [4.14e12, 3.97e12]):
        rows = [{"impl": "lragent graph", "ms_per_token": 4.716, "bytes_read_per_step": 15.285e9},
                {"impl": "transformers eager", "ms_per_token": 20.7}]  # fmt: skip
        assert set_floors(rows, measures) == 4.14e12
        assert rows[0]["floor_ms"] == pytest.approx(1e3 * 15.285e9 / 4.14e12)
        assert rows[0]["vs_floor"] == pytest.approx(4.716 / rows[0]["floor_ms"])
        assert rows[0]["vs_floor"] > 1.27  # the lower measure would have read 1.22
        assert "floor_ms" not in rows[1]


@pytest.mark.gpu
def test_a_decode_run_measures_the_bandwidth_twice_and_floors_on_the_higher(tmp_path) -> None:
    """``bench decode`` on the tiny model: two bandwidth measures (before and after the timed steps), the record's
    bandwidth is the higher, and every engine row's floor is its bytes over it."""
    import json

    from eval_suite.bench.decode import decode

    assert decode(model="tiny-llama", context=64, batches=[1], new_tokens=8, eager=False,
                  transformers_baseline=False, out=str(tmp_path)) == 0  # fmt: skip
    rec = json.loads((tmp_path / "bench_decode.json").read_text())
    measures = rec["copy_bandwidth_measures_bytes_per_s"]
    assert len(measures) == 2 and rec["copy_bandwidth_bytes_per_s"] == max(measures) > 1e11
    rows = [r for r in rec["rows"] if r["impl"].startswith("lragent")]
    assert rows
    for r in rows:
        assert r["floor_ms"] == pytest.approx(1e3 * r["bytes_read_per_step"] / max(measures))
        assert r["vs_floor"] == pytest.approx(r["ms_per_token"] / r["floor_ms"])


def test_bench_decode_without_a_gpu_is_refused_before_its_output_folder_is_made(tmp_path, monkeypatch) -> None:
    """Without CUDA, ``bench decode`` raises its one-line error and creates no output folder."""
    from eval_suite.bench.decode import decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LRAGENT_DECODE_PLAN", raising=False)
    out = tmp_path / "decode"
    with pytest.raises(ValueError, match="^bench decode needs a CUDA GPU$"):
        decode(model="tiny-llama", context=16, batches=[1], new_tokens=1, out=str(out))
    assert not out.exists()
