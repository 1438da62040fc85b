"""The similarity diagnostics (:mod:`eval_suite.diagnostics.similarity`) piece by piece: the record reader, the
context draw, the pairs, the cosine and NaN rules, the JSON-safe conversions, the labels, the summary's every field,
and one whole run's files and lines."""

from __future__ import annotations

import gzip
import json
import math
import random
import re
import time

import numpy as np
import pytest
import torch

from eval_suite.diagnostics.similarity import (
    PAIR_METRICS,
    Context,
    _default_label,
    _f,
    _flist,
    _fmt,
    _json_safe,
    _nanmean,
    _read_jsonl,
    _record_content,
    capture_projections,
    load_contexts,
    role_pairs,
    summarize,
    token_cosine,
)

NAN = float("nan")


class BosTokenizer:
    """One id per character; a BOS (255) only when special tokens are asked for."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([255] if add_special_tokens else []) + [ord(c) % 200 for c in text]}


# ---------------------------------------------------------------------------------------------------- records
def test_read_jsonl_numbers_lines_counting_blank_ones_plain_and_gzip(tmp_path):
    lines = [json.dumps({"text": "a"}), "", "  ", json.dumps({"ids": [1]})]
    plain = tmp_path / "c.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    packed = tmp_path / "c.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    assert _read_jsonl(plain) == [("c.jsonl:1", {"text": "a"}), ("c.jsonl:4", {"ids": [1]})]
    assert _read_jsonl(packed) == [("c.jsonl.gz:1", {"text": "a"}), ("c.jsonl.gz:4", {"ids": [1]})]


def test_record_content_prefers_text_then_input_then_ids():
    assert _record_content("s", {"text": "a", "input": "b", "ids": [1]}) == "a"
    assert _record_content("s", {"text": 5, "input": "b"}) == "b"
    assert _record_content("s", {"text": None, "input": 3, "ids": [4, 5]}) == [4, 5]
    assert _record_content("s", {"ids": [0]}) == [0]
    for bad in ({"ids": []}, {"ids": [1, True]}, {"ids": [1.0]}, {"ids": "12"}, {}):
        with pytest.raises(ValueError) as info:
            _record_content("f:2", bad)
        assert str(info.value) == "f:2 has no text, input (a string) or ids (a non-empty list of integers) field"


def _data(tmp_path, records):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_contexts_from_a_file_drop_duplicates_and_blanks_and_keep_source_order(tmp_path):
    records = [{"ids": [1, 2, 3]}, {"text": "hi"}, {"ids": [1, 2, 3]}, {"text": " \n"}, {"text": "hi"}, {"ids": [7]}]
    path = _data(tmp_path, records)
    every = load_contexts(BosTokenizer(), 10, 100, data=path)
    assert every == [Context("d.jsonl:1", (1, 2, 3)), Context("d.jsonl:2", (255, 104, 105)), Context("d.jsonl:6", (7,))]
    assert load_contexts(BosTokenizer(), 10, 2, data=str(path)) == [
        Context("d.jsonl:1", (1, 2)), Context("d.jsonl:2", (255, 104)), Context("d.jsonl:6", (7,))
    ]  # fmt: skip
    assert load_contexts(BosTokenizer(), 10, 1, data=path)[1].ids == (255,)
    # a text that reads like an id list is no duplicate of that list
    path = _data(tmp_path, [{"ids": [1, 2]}, {"text": "[1, 2]"}])
    assert [c.source for c in load_contexts(BosTokenizer(), 10, 100, data=path)] == ["d.jsonl:1", "d.jsonl:2"]


def test_contexts_draw_with_the_sample_seed(tmp_path):
    path = _data(tmp_path, [{"ids": [i]} for i in range(10)])
    for seed in (0, 3):
        want = sorted(random.Random(seed).sample(range(10), 4))
        got = load_contexts(None, 4, 5, sample_seed=seed, data=path)
        assert [c.ids for c in got] == [(i,) for i in want]
    assert load_contexts(None, 4, 5, data=path) == load_contexts(None, 4, 5, sample_seed=0, data=path)
    assert len(load_contexts(None, 10, 5, data=path)) == 10 == len(load_contexts(None, 11, 5, data=path))


def test_benchmark_contexts_read_only_inputs_of_every_role_file(tmp_path):
    folder = tmp_path / "trajectories" / "hotpotqa"
    folder.mkdir(parents=True)
    for role, recs in {"b_plan": [{"input": "p", "text": "ignored"}], "a_act": [{"input": "a", "ids": [9]}]}.items():
        with gzip.open(folder / f"{role}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    ctxs = load_contexts(BosTokenizer(), 5, 9, data_dir=tmp_path)
    assert ctxs == [Context("a_act.jsonl.gz:1", (255, 97)), Context("b_plan.jsonl.gz:1", (255, 112))]
    with pytest.raises(ValueError, match="^unknown benchmark 'HotpotQA': allowed hotpotqa, scienceqa$"):
        load_contexts(BosTokenizer(), 5, 9, benchmark="HotpotQA", data_dir=tmp_path)


def test_no_usable_context_names_the_benchmark(tmp_path):
    folder = tmp_path / "trajectories" / "scienceqa"
    folder.mkdir(parents=True)
    with gzip.open(folder / "plan.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"input": "   "}) + "\n")
    with pytest.raises(ValueError) as info:
        load_contexts(BosTokenizer(), 5, 9, benchmark="scienceqa", data_dir=tmp_path)
    assert str(info.value) == "no usable context in scienceqa"


# ---------------------------------------------------------------------------------------------------- measures
def test_role_pairs_in_order():
    assert role_pairs(3) == [(0, 1), (0, 2), (1, 2)]
    assert role_pairs(4) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert role_pairs(1) == [] and role_pairs(2) == [(0, 1)]


def test_token_cosine_in_float64():
    u = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1e-3, 0.0, 0.0]], dtype=torch.float32)
    v = torch.tensor([[3.0, -1.0, 0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float32)
    cos = token_cosine(u, v)
    assert cos.dtype == torch.float64 and cos.shape == (3,)
    a, b = [1.0, 2.0, 3.0], [3.0, -1.0, 0.5]
    want = sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))
    assert cos[0].item() == pytest.approx(want, rel=1e-14, abs=0)
    assert math.isnan(cos[1]) and math.isnan(cos[2])


def test_nanmean_leaves_out_nan_and_is_nan_when_all_are():
    assert _nanmean(torch.tensor([1.0, NAN, 3.0], dtype=torch.float64)) == 2.0
    assert math.isnan(_nanmean(torch.tensor([NAN, NAN], dtype=torch.float64)))
    assert _nanmean(torch.tensor([0.5], dtype=torch.float64)) == 0.5


def test_capture_keeps_one_input_and_output_per_layer_and_removes_its_hooks():
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    ids = torch.tensor([[1, 2, 3, 4]] * 3)
    roles = torch.arange(3)
    with capture_projections(model) as store:
        model.decoder.forward(ids, roles, last_only=True)
        assert sorted(store) == list(range(model.n_layers))
        assert all(sorted(v) == ["k", "x"] for v in store.values())
        assert store[0]["x"].shape == (3, 4, 64) and store[0]["k"].shape == (3, 4, 32)
        assert not store[0]["x"].requires_grad
        with pytest.raises(RuntimeError) as info:
            model.decoder.forward(ids, roles, last_only=True)
        assert str(info.value) == "v_proj of layer 0 ran twice in one forward; the capture expects one call"
    kept = {i: dict(v) for i, v in store.items()}
    model.decoder.forward(ids, roles, last_only=True)  # no hook left: nothing changes
    assert {i: dict(v) for i, v in store.items()} == kept


# --------------------------------------------------------------------------------------------------- JSON, text
def test_json_safe_values():
    assert _f(np.float64(0.25)) == 0.25 and _f(NAN) is None and _f(3) == 3.0 and isinstance(_f(3), float)
    assert _flist(np.array([[1.0, NAN], [2.0, 3.0]])) == [[1.0, None], [2.0, 3.0]]
    assert _flist(np.array([NAN, 0.5])) == [None, 0.5]
    assert _flist(np.zeros((2, 1, 2))) == [[[0.0, 0.0]], [[0.0, 0.0]]]
    safe = _json_safe({"a": (1.0, float("inf")), "b": [NAN, 2, {"c": -float("inf")}], "d": "x", "e": None})
    assert safe == {"a": [1.0, None], "b": [None, 2, {"c": None}], "d": "x", "e": None}


def test_labels_and_number_format(tmp_path):
    assert _default_label("hotpotqa", None, None, "zero", False) == "hotpotqa · init zero (shared A)"
    assert _default_label("hotpotqa", None, None, "random", True) == "hotpotqa · init random (independent A)"
    assert _default_label("hotpotqa", "/x/ctx.jsonl", "/a/b/run7", None, False) == "ctx.jsonl · run7"
    assert _default_label("scienceqa", None, "/a/b/run7", None, True) == "scienceqa · run7"
    assert _fmt(None) == "undefined" and _fmt(0.123456) == "0.1235" and _fmt(1.0) == "1.0000"


# ------------------------------------------------------------------------------------------------------ summary
def _sample(tokens, cos, cross, l1b, l1a):
    return {"tokens": tokens, "cos": {m: cos for m in PAIR_METRICS}, "cross": cross, "l1_base": l1b, "l1_adapter": l1a}


def test_summary_fields_by_hand():
    """2 samples, 2 layers, 2 roles (1 pair): every field of the summary against numbers worked out by hand."""
    roles = ["p", "a"]
    cross1 = [[[1.0, 0.0], [0.5, NAN]], [[0.0, 0.2], [0.4, 0.6]]]
    cross2 = [[[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]]
    s1 = _sample(3, [[0.2], [0.4]], cross1, [[1.0, 3.0], [2.0, 2.0]], [[0.5, 0.5], [1.0, 0.0]])
    s2 = _sample(5, [[0.6], [NAN]], cross2, [[4.0, 4.0], [4.0, 4.0]], [[1.0, 1.0], [1.0, 1.0]])
    out = summarize([s1, s2], roles)
    assert out["n_samples"] == 2 and out["tokens_total"] == 8 and out["pairs"] == ["p-a"]
    c = out["cos"]["k"]
    assert c["mean"] == pytest.approx(0.4)  # (0.2 + 0.4 + 0.6) / 3
    assert c["std"] == pytest.approx(0.15)  # layer means 0.3 and 0.6
    assert c["per_pair"] == {"p-a": {"mean": pytest.approx(0.45), "std": pytest.approx(0.15)}}
    assert c["per_layer"] == pytest.approx([0.4, 0.4]) and c["per_layer_std"] == pytest.approx([0.2, 0.0])
    assert c["per_layer_pair"] == [[pytest.approx(0.4)], [pytest.approx(0.4)]]
    cross = out["cross"]
    assert cross["mean"] == [[pytest.approx(0.5), pytest.approx(0.3)], [pytest.approx(0.475), pytest.approx(1.6 / 3)]]
    # per (sample, i, j) layer means: sample 1 [[0.5, 0.1], [0.45, 0.6]], sample 2 [[0.5, 0.5], [0.5, 0.5]]
    assert cross["std"] == [[pytest.approx(0.0), pytest.approx(0.2)], [pytest.approx(0.025), pytest.approx(0.05)]]
    assert cross["per_layer"] == [[[0.5, 0.0], [0.25, 0.0]], [[0.5, 0.6], [0.7, 0.8]]]
    l1 = out["l1"]
    assert l1["base"] == {"mean": 3.0, "per_layer": [3.0, 3.0], "per_role": {"p": 2.75, "a": 3.25},
                          "per_layer_role": [[2.5, 3.5], [3.0, 3.0]]}  # fmt: skip
    assert l1["adapter"] == {"mean": 0.75, "per_layer": [0.75, 0.75], "per_role": {"p": 0.875, "a": 0.625},
                             "per_layer_role": [[0.75, 0.75], [1.0, 0.5]]}  # fmt: skip
    assert l1["ratio"]["mean"] == 0.25
    assert l1["ratio"]["std"] == pytest.approx(float(np.std([2.0 / 8.0, 4.0 / 16.0])))
    assert l1["ratio"]["per_layer"] == [0.25, 0.25]
    assert l1["ratio"]["per_role"] == {"p": pytest.approx(0.875 / 2.75), "a": pytest.approx(0.625 / 3.25)}


def test_summary_of_all_undefined_values_is_none():
    roles = ["p", "a"]
    s = _sample(2, [[NAN], [NAN]], [[[NAN] * 2] * 2] * 2, [[1.0, 1.0]] * 2, [[0.0, 0.0]] * 2)
    out = summarize([s], roles)
    c = out["cos"]["adapter"]
    assert c["mean"] is None and c["std"] is None and c["per_layer"] == [None, None]
    assert c["per_pair"] == {"p-a": {"mean": None, "std": None}}
    assert out["cross"]["mean"] == [[None, None], [None, None]]
    assert out["l1"]["ratio"]["mean"] == 0.0 and out["l1"]["ratio"]["std"] == 0.0


# ------------------------------------------------------------------------------------------------------ one run
def _ids_data(folder):
    data = folder / "ids.jsonl"
    data.write_text("".join(json.dumps({"ids": list(range(i, i + n))}) + "\n" for i, n in ((0, 12), (5, 9), (241, 15))))
    return data


@pytest.fixture
def default_run(tmp_path_factory):
    """One run through the function with its defaults (16 samples, 2048 tokens, rank 8, alpha 16, seeds 0, float32,
    the CPU), on three id contexts of a tiny random model; run for each test that reads it (a module-scoped run would
    count, for mutmut's map of which tests reach the function, only for the first of them)."""
    from eval_suite.diagnostics.similarity import similarity

    folder = tmp_path_factory.mktemp("sim_default")
    data = _ids_data(folder)
    out = folder / "run"
    with pytest.MonkeyPatch.context() as mp:
        lines = []
        mp.setattr("sys.stdout", _Tee(lines, "out"))
        mp.setattr("sys.stderr", _Tee(lines, "err"))
        t0 = time.perf_counter()
        rc = similarity(data=str(data), model="tiny-llama", adapter_init="zero", out=str(out), quiet=True)
        lines.append(("elapsed", time.perf_counter() - t0))
    return rc, data, out, lines


class _Tee:
    def __init__(self, lines, name):
        self.lines, self.name = lines, name

    def write(self, text):
        self.lines.append((self.name, text))
        return len(text)

    def flush(self):
        pass


def test_default_run_config(default_run):
    rc, data, out, _ = default_run
    assert rc == 0
    doc = json.loads((out / "similarity.json").read_text())
    assert doc["config"] == {
        "label": "ids.jsonl · init zero (shared A)", "benchmark": None, "data": str(data), "adapters": None,
        "adapter_init": "zero", "seed": 0, "sample_seed": 0, "samples_requested": 16, "max_tokens": 2048,
        "model": "tiny-llama", "dtype": "float32", "device": "cpu", "roles": ["plan", "action", "reflect"],
        "rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj"], "shared_a": True, "n_layers": 4,
    }  # fmt: skip
    assert doc["pairs"] == ["plan-action", "plan-reflect", "action-reflect"] and doc["complete"] is True
    assert set(doc) == {"config", "pairs", "complete", "wall_s", "summary", "samples", "provenance"}
    elapsed = next(t for n, t in default_run[3] if n == "elapsed")
    assert 0 < doc["wall_s"] <= elapsed  # the whole run's time, reports included
    assert doc["wall_s"] > 0 and doc["provenance"]["dtype"] == "float32"


def test_default_run_writes_its_samples_and_summary(default_run):
    _, _, out, _ = default_run
    doc = json.loads((out / "similarity.json").read_text())
    assert [(s["source"], s["tokens"]) for s in doc["samples"]] == [("ids.jsonl:1", 12), ("ids.jsonl:2", 9),
                                                                   ("ids.jsonl:3", 15)]  # fmt: skip
    assert doc["summary"] == _json_safe(summarize(doc["samples"], ["plan", "action", "reflect"]))
    s = doc["summary"]
    assert s["tokens_total"] == 36 and s["cos"]["adapter"]["mean"] is None  # B = 0: the adapter output is zero
    assert s["cos"]["base"]["mean"] == pytest.approx(1.0) and s["l1"]["ratio"]["mean"] == 0.0
    assert all(n == 0 for m, n in doc["samples"][0]["undefined_tokens"].items() if m not in ("adapter", "cross"))
    assert doc["samples"][0]["undefined_tokens"]["adapter"] == 12 * 3 * 4  # every token, pair and layer


def test_default_run_prints_its_two_lines(default_run):
    _, data, out, lines = default_run
    err = "".join(t for n, t in lines if n == "err")
    std = "".join(t for n, t in lines if n == "out")
    head = ("ids.jsonl · init zero (shared A): 3 contexts, 36 tokens, full 1.0000  base 1.0000  adapter undefined  "
            "lr 1.0000  k 1.0000  hidden 1.0000, L1 ratio 0.0000; ")  # fmt: skip
    assert err.startswith(head) and re.fullmatch(r"\d+\.\d s\n", err[len(head) :]), err
    names = ["report.md", "fig1_base_vs_full.png", "fig6_l1_norms.png", "fig7_k_similarity.png", "report.html"]
    assert std == f"-> {out / 'similarity.json'}, {', '.join(str(out / n) for n in names)}\n"
    assert all((out / n).is_file() for n in names)


def test_chosen_options_reach_the_run(tmp_path, capsys):
    from eval_suite.diagnostics.similarity import similarity
    from lragent.command import run_command

    out = tmp_path / "run"
    argv = ["--model", "tiny-llama", "--data", str(_ids_data(tmp_path)), "--adapter_init", "random", "--seed", "3",
            "--rank", "2", "--alpha", "4.0", "--independent_a", "true", "--sample_seed", "1", "--samples", "2",
            "--max_tokens", "10", "--label", "mine", "--device", "cpu", "--out", str(out),
            "--quiet", "true"]  # fmt: skip
    assert run_command(similarity, argv, "s") == 0
    doc = json.loads((out / "similarity.json").read_text())
    cfg = doc["config"]
    assert (cfg["label"], cfg["seed"], cfg["sample_seed"], cfg["samples_requested"], cfg["max_tokens"]) == (
        "mine", 3, 1, 2, 10)  # fmt: skip
    assert (cfg["rank"], cfg["alpha"], cfg["shared_a"], cfg["adapter_init"]) == (2, 4.0, False, "random")
    picked = sorted(random.Random(1).sample(range(3), 2))
    assert [s["source"] for s in doc["samples"]] == [f"ids.jsonl:{i + 1}" for i in picked]
    assert [s["tokens"] for s in doc["samples"]] == [min(10, (12, 9, 15)[i]) for i in picked]
    assert capsys.readouterr().err.startswith(f"mine: 2 contexts, {sum(s['tokens'] for s in doc['samples'])} tokens")


def test_run_similarity_bar_and_incremental_calls(monkeypatch):
    """The bar (on a terminal, where tqdm would show one by default) only when asked: named, counted in contexts, with
    the current context's length; ``on_sample`` sees the finished samples after each one."""
    import io

    from eval_suite.diagnostics.similarity import run_similarity
    from tests.conftest import tiny_multi_lora

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    model = tiny_multi_lora()
    contexts = [Context("a:1", (1, 2, 3, 4, 5)), Context("a:2", (6, 7, 8))]
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    monkeypatch.setattr("tqdm.std.tqdm.monitor_interval", 0)  # no monitor thread left behind (a fork would inherit it)
    seen = []
    results = run_similarity(model, contexts, on_sample=lambda r: seen.append([s["source"] for s in r]))
    assert term.getvalue() == "" and seen == [["a:1"], ["a:1", "a:2"]]
    assert [(r["source"], r["tokens"]) for r in results] == [("a:1", 5), ("a:2", 3)]
    run_similarity(model, contexts, progress=True)
    bar = term.getvalue().split("\r")[-1]
    assert bar.startswith("similarity: 100%") and " 2/2 " in bar, bar
    assert re.search(r"\d(ctx/s|s/ctx), tokens=3\]$", bar.rstrip()), bar  # the rate counts contexts


def test_records_are_utf8_whatever_the_locale_and_specials_are_asked_for(tmp_path):
    import locale

    class DefaultOff(BosTokenizer):
        def __call__(self, text, add_special_tokens=False):
            return super().__call__(text, add_special_tokens)

    plain = tmp_path / "u.jsonl"
    plain.write_text(json.dumps({"text": "é"}, ensure_ascii=False) + "\n", encoding="utf-8")
    packed = tmp_path / "u.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"text": "ü"}, ensure_ascii=False) + "\n")
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # the locale's encoding is then ASCII
    try:
        assert _read_jsonl(plain) == [("u.jsonl:1", {"text": "é"})]
        assert _read_jsonl(packed) == [("u.jsonl.gz:1", {"text": "ü"})]
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    assert load_contexts(DefaultOff(), 1, 9, data=plain) == [Context("u.jsonl:1", (255, ord("é") % 200))]


def test_ids_just_outside_the_vocabulary_are_refused(tmp_path, capsys):
    from eval_suite.diagnostics.similarity import similarity
    from lragent.command import run_command

    for bad in ([0, 256], [-1, 3]):
        data = tmp_path / "bad.jsonl"
        data.write_text(json.dumps({"ids": bad}) + "\n")
        argv = ["--model", "tiny-llama", "--data", str(data), "--adapter_init", "zero", "--device", "cpu",
                "--out", str(tmp_path / "out")]  # fmt: skip
        assert run_command(similarity, argv, "s") == 2
        assert "bad.jsonl:1 has token ids outside the model's vocabulary 0..255" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_capture_reads_a_keyword_input_too():
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora()
    attn = model.model.model.layers[2].self_attn
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    roles = torch.tensor([0, 1])
    with capture_projections(model) as store, torch.no_grad():
        attn.v_proj(x=x, role_ids=roles)
        k = attn.k_proj(x)
    assert sorted(store) == [2] and torch.equal(store[2]["x"], x) and torch.equal(store[2]["k"], k)


def test_validate_accepts_the_smallest_values_and_names_a_random_model_in_any_case(tmp_path):
    from eval_suite.diagnostics.similarity import _validate

    _validate(None, "zero", "hotpotqa", None, 1, 1, "default", "float32", "cpu", str(tmp_path))
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    _validate(str(tmp_path), None, "scienceqa", str(data), 1, 1, "Tiny-Llama", "float32", "cpu", str(tmp_path / "n"))
    with pytest.raises(ValueError) as info:
        _validate(None, "random", "hotpotqa", None, 1, 1, "Tiny-Llama", "float32", "cpu", str(tmp_path))
    assert (
        str(info.value) == "--model 'Tiny-Llama' has random weights and no tokenizer: give --data FILE with ids fields"
    )


def test_build_model_passes_every_option():
    from eval_suite.diagnostics.similarity import _build_model

    m, tok = _build_model("tiny-llama", None, "random", 5, 1, 4.0, True, "float32", "cpu")
    cfg = m.lora_config
    assert tok is None and (cfg.rank, cfg.alpha, cfg.shared_a) == (1, 4.0, False)
    assert tuple(cfg.targets) == ("q_proj", "v_proj") and next(m.parameters()).dtype == torch.float32
    same, _ = _build_model("tiny-llama", None, "random", 5, 1, 4.0, True, "float32", "cpu")
    other, _ = _build_model("tiny-llama", None, "random", 6, 1, 4.0, True, "float32", "cpu")
    b = [p for n, p in m.named_parameters() if "lora_B" in n]
    same_b = [p for n, p in same.named_parameters() if "lora_B" in n]
    other_b = [p for n, p in other.named_parameters() if "lora_B" in n]
    assert all(torch.equal(x, y) for x, y in zip(b, same_b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(b, other_b, strict=True))
    shared, _ = _build_model("tiny-llama", None, "zero", 0, 2, 16.0, False, "float32", "cpu")
    assert (shared.lora_config.rank, shared.lora_config.shared_a) == (2, True)
    assert all(float(p.detach().abs().max()) == 0.0 for n, p in shared.named_parameters() if "lora_B" in n)


def test_build_model_reads_the_adapters_directory(tmp_path):
    from eval_suite.diagnostics.similarity import _build_model
    from lragent.adapters_io import NATIVE_FILE, save_native
    from tests.conftest import tiny_multi_lora

    saved = tiny_multi_lora(rank=4, targets=("k_proj", "v_proj"))
    save_native(saved, tmp_path / NATIVE_FILE)
    m, _ = _build_model("tiny-llama", str(tmp_path), None, 0, 8, 16.0, False, "float32", "cpu")
    assert m.lora_config.rank == 4 and tuple(m.lora_config.targets) == ("k_proj", "v_proj")
    want = {n: p for n, p in saved.named_parameters() if "lora_B" in n}
    got = {n: p for n, p in m.named_parameters() if "lora_B" in n}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_validate_without_adapters_says_both_ways_in_full(tmp_path):
    from eval_suite.diagnostics.similarity import _validate

    with pytest.raises(ValueError) as info:
        _validate(None, None, "hotpotqa", None, 1, 1, "default", "float32", "cpu", str(tmp_path))
    assert str(info.value) == (
        "give --adapters DIR (trained role adapters: a native checkpoint or PEFT role directories), "
        "or --adapter_init zero (untrained control) / --adapter_init random --seed S"
    )


def test_build_model_in_the_dtype_asked_for():
    from eval_suite.diagnostics.similarity import _build_model

    m, _ = _build_model("tiny-llama", None, "zero", 0, 2, 16.0, False, "bfloat16", "cpu")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}


def test_summary_refuses_samples_whose_pairs_do_not_match_the_roles():
    s = _sample(2, [[0.5], [0.5]], [[[0.0] * 2] * 2] * 2, [[1.0, 1.0]] * 2, [[0.5, 0.5]] * 2)  # 2 roles: 1 pair
    with pytest.raises(ValueError):
        summarize([s], ["p", "a", "r"])  # 3 roles name 3 pairs
    with pytest.raises(ValueError) as info:
        summarize([], ["p", "a"])
    assert str(info.value) == "no samples to summarize"


def test_summary_of_undefined_l1_values_from_json_is_none():
    """A sample read back from JSON carries None where a norm was not finite: the means are then undefined."""
    s = _sample(2, [[0.5], [0.5]], [[[0.0] * 2] * 2] * 2, [[1.0, None], [1.0, 1.0]], [[0.5, 0.5], [None, 0.5]])
    out = summarize([s], ["p", "a"])
    assert out["l1"]["base"]["mean"] is None and out["l1"]["adapter"]["mean"] is None
    assert out["l1"]["base"]["per_role"] == {"p": 1.0, "a": None}


def test_runs_name_their_adapters_or_init_and_write_into_a_new_nested_out_then_into_it_again(tmp_path):
    """A run on an adapters directory records it and names the run after it; the out directory is made with its
    parents, and a second run (an independent-A init) writes into the one that exists, named after its init."""
    from eval_suite.diagnostics.similarity import similarity
    from lragent import command
    from lragent.adapters_io import NATIVE_FILE, save_native
    from tests.conftest import tiny_multi_lora

    adapters = tmp_path / "ad_run"
    adapters.mkdir()
    save_native(tiny_multi_lora(rank=4, targets=("k_proj", "v_proj")), adapters / NATIVE_FILE)
    data, out = _ids_data(tmp_path), tmp_path / "a" / "b"
    runs = [
        ({"adapters": str(adapters)}, "ids.jsonl · ad_run", str(adapters.resolve())),
        ({"adapter_init": "random", "independent_a": True}, "ids.jsonl · init random (independent A)", None),
    ]
    for options, label, recorded in runs:
        rc = similarity(data=str(data), model="tiny-llama", samples=1, out=str(out), quiet=True, **options)
        cfg = json.loads((out / "similarity.json").read_text())["config"]
        assert rc == 0 and (cfg["label"], cfg["adapters"]) == (label, recorded)
        assert command._INTERRUPT_NOTE == [f"finished samples are in {out / 'similarity.json'} (complete: false); "
                                           "rerun to redo"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch shows where the run tried to use CUDA")
def test_where_cuda_is_available_the_default_device_is_cuda_and_an_explicit_cpu_stays_on_the_cpu(tmp_path, monkeypatch):
    from eval_suite.diagnostics.similarity import similarity

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    options = {"data": str(_ids_data(tmp_path)), "model": "tiny-llama", "adapter_init": "zero", "samples": 1}
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):  # past the checks, to the model's load
        similarity(out=str(tmp_path / "default"), quiet=True, **options)
    assert similarity(out=str(tmp_path / "cpu"), device="cpu", quiet=True, **options) == 0
    doc = json.loads((tmp_path / "cpu" / "similarity.json").read_text())
    assert doc["config"]["device"] == "cpu" and doc["provenance"]["device"]["type"] == "cpu"


def test_an_interrupted_run_keeps_its_finished_samples_marked_incomplete(tmp_path, monkeypatch):
    """similarity.json is rewritten after every sample: a run stopped during its second context leaves the first,
    with its summary, marked incomplete."""
    from eval_suite.diagnostics import similarity as sim

    real, calls = sim.measure_context, []

    def second_stops(model, ids):
        calls.append(len(ids))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(model, ids)

    monkeypatch.setattr(sim, "measure_context", second_stops)
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        sim.similarity(data=str(_ids_data(tmp_path)), model="tiny-llama", adapter_init="zero", out=str(out), quiet=True)
    elapsed = time.perf_counter() - t0
    doc = json.loads((out / "similarity.json").read_text())
    assert doc["complete"] is False and [s["source"] for s in doc["samples"]] == ["ids.jsonl:1"]
    assert doc["summary"]["n_samples"] == 1 and not (out / "report.md").exists()
    assert 0 < doc["wall_s"] <= elapsed  # the run's time until that sample
