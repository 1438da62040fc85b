"""Cache-similarity diagnostics (`cli.py similarity`) on tiny random models: the measured quantities against
independent hand computations through plain transformers models, the averaging rules, the context draw, the CLI and
the reports."""

from __future__ import annotations

import gzip
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eval_suite.diagnostics.similarity import (
    PAIR_METRICS,
    load_contexts,
    measure_context,
    role_pairs,
    run_similarity,
    similarity,
    summarize,
    token_cosine,
)
from eval_suite.diagnostics.similarity_report import FIGURES
from lragent.command import build_parser, run_command
from tests.conftest import tiny_multi_lora

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("plan", "action", "reflect")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the tiny models


def _ids(n: int = 40, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _v_modules(model):
    return [m for name, m in model.lora_modules().items() if name.endswith("v_proj")]


@torch.no_grad()
def _set_b(model, module_suffix: str, fn) -> None:
    for name, m in model.lora_modules().items():
        if name.endswith(module_suffix):
            for b in m.lora_B:
                b.copy_(fn(b, m))


# ------------------------------------------------------------------------------------------- measured properties
def test_zero_b_on_v_gives_zero_adapter_output_and_base_equals_full():
    """B = 0 on v_proj (q_proj's adapters still differ, so the roles' hidden states differ): the adapter output is
    zero, its cosine is undefined (not 0 or 1), and the full value cache is the base cache."""
    model = tiny_multi_lora()
    _set_b(model, "v_proj", lambda b, m: torch.zeros_like(b))
    ids = _ids()
    res = measure_context(model, ids)
    n_layers, n_pairs = len(res["cos"]["base"]), len(role_pairs(3))
    assert np.all(np.array(res["l1_adapter"]) == 0.0)
    assert np.all(np.isnan(np.array(res["cos"]["adapter"])))
    assert res["undefined_tokens"]["adapter"] == n_layers * n_pairs * len(ids)
    assert res["cos"]["full"] == res["cos"]["base"]
    assert res["cos"]["base"][-1][0] < 1 - 1e-4  # not trivially 1: the roles' hidden states differ
    summary = summarize([res], ROLES)
    assert summary["cos"]["adapter"]["mean"] is None
    assert summary["l1"]["ratio"]["mean"] == 0.0
    assert summary["cos"]["full"]["mean"] == summary["cos"]["base"]["mean"]


@pytest.mark.parametrize("shared_a", [True, False])
def test_identical_adapters_give_similarity_one_everywhere(shared_a):
    model = tiny_multi_lora(shared_a=shared_a)
    with torch.no_grad():
        for m in model.lora_modules().values():
            for a in m.lora_A:
                a.copy_(m.lora_A[0])
            for b in m.lora_B:
                b.copy_(m.lora_B[0])
    res = measure_context(model, _ids())
    for metric in PAIR_METRICS:
        vals = np.array(res["cos"][metric])
        assert np.allclose(vals, 1.0, atol=1e-6), (metric, vals.min())
    cross = np.array(res["cross"])  # (L, R, R): every role's adapter output is the same, so rows are constant
    assert np.allclose(cross, cross[:, :, :1], atol=1e-6)
    l1a = np.array(res["l1_adapter"])
    assert np.allclose(l1a, l1a[:, :1], rtol=1e-6) and np.all(l1a > 0)


def test_shared_a_lr_cache_is_identical_when_hidden_states_are():
    """Layer 0 sees the same input for every role: with shared A, X·A is then identical (cos 1); with one A per role
    it is not. Deeper layers see different inputs (q_proj/v_proj adapters differ), so cos drops below 1."""
    shared = measure_context(tiny_multi_lora(shared_a=True), _ids())
    indep = measure_context(tiny_multi_lora(shared_a=False), _ids())
    for res in (shared, indep):
        assert np.allclose(res["cos"]["hidden"][0], 1.0, atol=1e-9)
    assert np.allclose(shared["cos"]["lr"][0], 1.0, atol=1e-9)
    assert max(indep["cos"]["lr"][0]) < 0.9
    assert min(shared["cos"]["hidden"][-1]) < 1 - 1e-4 and min(shared["cos"]["lr"][-1]) < 1 - 1e-4


@pytest.mark.parametrize("shared_a", [True, False])
def test_untrained_adapters_keep_hidden_states_equal_in_every_layer(shared_a):
    """B = 0 everywhere: every role computes the base model, so K, base, full and X agree at every layer; the LR cache
    agrees with shared A only."""
    model = tiny_multi_lora(shared_a=shared_a)
    model.init_adapters("zero", seed=3)
    res = measure_context(model, _ids())
    for metric in ("base", "full", "k", "hidden"):
        assert np.allclose(res["cos"][metric], 1.0, atol=1e-9), metric
    lr = np.array(res["cos"]["lr"])
    assert np.allclose(lr, 1.0, atol=1e-9) if shared_a else lr.max() < 0.9


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
@torch.no_grad()
def test_measurement_matches_a_hand_computation_on_merged_transformers_models(arch):
    """Independent route: each role's adapters merged into a plain transformers model, its own forward, the v_proj
    input and k_proj output taken there; V_base, ΔV, L1 norms, ratio, cosines and the post-RoPE K by hand."""
    model = tiny_multi_lora(arch=arch, shared_a=False, b_std=0.05)
    ids = _ids(33, seed=1)
    res = measure_context(model, ids)
    summary = summarize([res], ROLES)
    n_layers = model.n_layers
    xs, ks = {}, {}
    for rid, role in enumerate(ROLES):
        merged = model.merged_model(role)
        hooks = []
        for li, layer in enumerate(merged.model.layers):
            attn = layer.self_attn
            hooks.append(
                attn.v_proj.register_forward_hook(lambda m, a, o, li=li, r=rid: xs.__setitem__((r, li), a[0][0]))
            )
            hooks.append(attn.k_proj.register_forward_hook(lambda m, a, o, li=li, r=rid: ks.__setitem__((r, li), o[0])))
        merged(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        rotary = merged.model.rotary_emb
    vmods = _v_modules(model)
    for li in range(n_layers):
        m = vmods[li]
        base, delta = [], []
        for rid in range(3):
            x = xs[(rid, li)].double()
            w0 = m.base.weight.double()
            b0 = m.base.bias.double() if m.base.bias is not None else 0.0
            a, b = m.lora_A[rid].double(), m.lora_B[rid].double()
            base.append(x @ w0.T + b0)
            delta.append(m.scaling * (x @ a.T) @ b.T)
        l1_base = [float(v.abs().sum(-1).mean()) for v in base]
        l1_delta = [float(v.abs().sum(-1).mean()) for v in delta]
        np.testing.assert_allclose(res["l1_base"][li], l1_base, rtol=1e-5)
        np.testing.assert_allclose(res["l1_adapter"][li], l1_delta, rtol=1e-5)
        ratio = (sum(l1_delta) / 3) / (sum(l1_base) / 3)
        assert math.isclose(summary["l1"]["ratio"]["per_layer"][li], ratio, rel_tol=1e-5)
        pos = torch.arange(len(ids))[None]
        for p, (i, j) in enumerate(role_pairs(3)):

            def cos(u, v):
                return float((u * v).sum(-1).div(u.norm(dim=-1) * v.norm(dim=-1)).mean())

            assert math.isclose(res["cos"]["base"][li][p], cos(base[i], base[j]), rel_tol=1e-5, abs_tol=1e-6)
            assert math.isclose(
                res["cos"]["full"][li][p], cos(base[i] + delta[i], base[j] + delta[j]), rel_tol=1e-5, abs_tol=1e-6
            )
            assert math.isclose(res["cos"]["adapter"][li][p], cos(delta[i], delta[j]), rel_tol=1e-4, abs_tol=1e-6)
            # The K cache stores keys after RoPE: the cosine there equals the measured (pre-RoPE) one.
            rot = []
            for r in (i, j):
                k = ks[(r, li)].double()  # (T, H_kv * D)
                head_dim = model.decoder.head_dim
                k4 = k.view(1, len(ids), -1, head_dim).transpose(1, 2)  # (1, H_kv, T, D)
                c, s = rotary(k4.float(), pos)
                rot.append(
                    apply_rotary_pos_emb(k4, k4, c.double(), s.double())[1].transpose(1, 2).reshape(len(ids), -1)
                )
            assert math.isclose(res["cos"]["k"][li][p], cos(rot[0], rot[1]), rel_tol=1e-5, abs_tol=1e-6)
        cross = res["cross"][li]
        for i in range(3):
            for j in range(3):
                assert math.isclose(cross[i][j], cos(base[i], delta[j]), rel_tol=1e-4, abs_tol=1e-6)


def test_token_cosine_is_per_token_and_undefined_for_zero_vectors():
    u = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    v = torch.tensor([[2.0, 0.0], [1.0, -1.0], [1.0, 0.0]])
    cos = token_cosine(u, v)
    assert cos[:2].tolist() == [1.0, 0.0] and math.isnan(cos[2])


def test_summary_averages_samples_equally_and_spreads_over_samples_and_pairs():
    """Two samples of different length, 2 layers, 3 pairs; the ± is the std over (sample, pair) of layer means."""

    def sample(tokens, base, l1b, l1a):
        cos = {m: base for m in PAIR_METRICS}
        cross = [[[0.0] * 3 for _ in range(3)] for _ in range(2)]
        return {"tokens": tokens, "cos": cos, "cross": cross, "l1_base": l1b, "l1_adapter": l1a}

    s1 = sample(10, [[1.0, 0.8, 0.6], [0.8, 0.6, float("nan")]], [[1, 1, 1], [3, 3, 3]], [[0.1, 0.1, 0.1]] * 2)
    s2 = sample(1000, [[0.0, 0.2, 0.4], [0.2, 0.4, 0.6]], [[4, 4, 4], [4, 4, 4]], [[0.4, 0.4, 0.4]] * 2)
    out = summarize([s1, s2], ROLES)
    base = out["cos"]["base"]
    vals = [1.0, 0.8, 0.6, 0.8, 0.6, 0.0, 0.2, 0.4, 0.2, 0.4, 0.6]  # the NaN is left out
    assert math.isclose(base["mean"], sum(vals) / len(vals))
    layer_avg = [0.9, 0.7, 0.6, 0.1, 0.3, 0.5]  # per (sample, pair), over layers
    assert math.isclose(base["std"], float(np.std(layer_avg)))
    assert math.isclose(base["per_pair"]["plan-action"]["mean"], 0.5)
    assert base["per_layer"] == pytest.approx([0.5, 0.52])  # layer 1: (0.8 + 0.6 + 0.2 + 0.4 + 0.6) / 5
    assert out["tokens_total"] == 1010 and out["n_samples"] == 2
    # mean adapter L1 / mean base L1 = 0.25 / 3 (not the mean of the per-sample ratios 0.1/2 and 0.4/4)
    assert math.isclose(out["l1"]["ratio"]["mean"], 0.25 / 3)
    assert math.isclose(out["l1"]["ratio"]["std"], float(np.std([0.05, 0.1])))
    assert out["l1"]["ratio"]["per_layer"] == pytest.approx([0.25 / 2.5, 0.25 / 3.5])
    assert out["l1"]["ratio"]["per_role"]["action"] == pytest.approx(0.25 / 3)


def test_a_model_without_lora_on_v_proj_is_refused():
    model = tiny_multi_lora(targets=("q_proj",))
    with pytest.raises(ValueError, match="needs a LoRA on v_proj"):
        run_similarity(model, [])


# ------------------------------------------------------------------------------------------------------ contexts
class CharTokenizer:
    """One id per character (for the context loader)."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 256 for c in text]}


def _trajectories(tmp_path: Path) -> Path:
    d = tmp_path / "trajectories" / "hotpotqa"
    d.mkdir(parents=True)
    for role, texts in {"plan": [f"plan {i} " * 3 for i in range(8)] + ["same"], "action": ["same", "act"]}.items():
        with gzip.open(d / f"{role}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"input": t, "output": "o"}) + "\n" for t in texts)
    return tmp_path


def test_default_contexts_are_a_deterministic_draw_cut_to_their_head(tmp_path):
    data_dir = _trajectories(tmp_path)
    tok = CharTokenizer()
    a = load_contexts(tok, 4, 5, sample_seed=0, data_dir=data_dir)
    assert a == load_contexts(tok, 4, 5, sample_seed=0, data_dir=data_dir)
    assert a != load_contexts(tok, 4, 5, sample_seed=1, data_dir=data_dir)
    every = load_contexts(tok, 100, 1000, data_dir=data_dir)
    assert len(every) == 10  # 8 + 1 plan texts, "act"; the duplicate "same" once
    texts = {"".join(chr(i) for i in c.ids) for c in every}
    assert "same" in texts and "act" in texts
    for c in a:
        full = next(e for e in every if e.source == c.source)
        assert c.ids == full.ids[:5]


def test_data_file_with_text_or_ids_and_bad_lines(tmp_path):
    good = tmp_path / "ctx.jsonl"
    good.write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"ids": [1, 2, 3]}) + "\n")
    ctxs = load_contexts(CharTokenizer(), 5, 4, data=good)
    assert [c.ids for c in ctxs] == [tuple(ord(ch) for ch in "hell"), (1, 2, 3)]
    assert ctxs[1].source == "ctx.jsonl:3"
    with pytest.raises(ValueError, match="is text but the model has no tokenizer"):
        load_contexts(None, 5, 4, data=good)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has no text, input .* or ids"):
        load_contexts(CharTokenizer(), 5, 4, data=bad)


# ----------------------------------------------------------------------------------------------------- CLI/report
def _ids_file(tmp_path: Path) -> Path:
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"ids": _ids(20 + 7 * i, seed=i)}) + "\n" for i in range(3)))
    return path


def test_help_lists_the_arguments():
    proc = subprocess.run([sys.executable, "cli.py", "similarity", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for arg in ("--adapters", "--benchmark", "--data", "--samples", "--max_tokens", "--adapter_init", "--merge"):
        assert arg in proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --adapters DIR"),
        (["--adapter_init", "ones"], "--adapter_init 'ones' not supported: allowed zero, random"),
        (["--adapters", "/no/such/dir"], "--adapters '/no/such/dir': no such directory"),
        (
            ["--adapter_init", "zero", "--benchmark", "gsm8k"],
            "--benchmark 'gsm8k' unknown: allowed hotpotqa, scienceqa",
        ),
        (["--adapter_init", "zero", "--samples", "0"], "--samples must be >= 1"),
    ],
)
def test_bad_input_is_one_line_before_any_output(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    rc = run_command(similarity, [*argv, "--out", str(out)], "cli.py similarity")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def _referenced_files(page: str) -> list[str]:
    return re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)['"]""", page)


def test_printed_config_runs_unchanged_and_writes_every_report(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--model", "tiny-llama", "--data", str(_ids_file(tmp_path)), "--adapter_init", "random", "--samples", "2",
            "--out", str(out), "--quiet", "true"]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        build_parser(similarity, "cli.py similarity").parse_args([*argv, "--print_config"])
    assert exc.value.code in (0, None)
    config = tmp_path / "similarity.yaml"
    config.write_text(capsys.readouterr().out)
    assert run_command(similarity, ["--config", str(config)], "cli.py similarity") == 0
    doc = json.loads((out / "similarity.json").read_text())
    assert doc["complete"] and len(doc["samples"]) == 2 and doc["config"]["model"] == "tiny-llama"
    assert doc["provenance"]["device"]["type"] == "cpu"
    page = (out / "report.html").read_text()
    refs = _referenced_files(page)
    assert sorted(refs) == sorted(FIGURES)  # every figure shown, nothing else referenced
    assert all((out / r).is_file() for r in refs)
    md = (out / "report.md").read_text()
    assert "Table 1 layout" in md and "Table 2 layout" in md and "Table 6 layout" in md and "Produced on" in md
    assert run_command(similarity, ["--merge", f"[{out}, {out}]", "--out", str(tmp_path / "all")], "x") == 0
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert summary["runs"][0]["summary"] == doc["summary"]
    # a merge makes --out with its missing parents, and writes again into one that exists
    capsys.readouterr()
    for again in (tmp_path / "new" / "all", tmp_path / "all"):
        assert similarity(merge=[str(out)], out=str(again)) == 0
        assert json.loads((again / "summary.json").read_text())["runs"][0]["summary"] == doc["summary"]
        assert capsys.readouterr().out == f"-> {again / 'summary.md'}, {again / 'summary.json'}\n"


@pytest.mark.model
def test_embedded_model_untrained_control_on_bundled_contexts(tmp_path, monkeypatch, capsys):
    """The default path end to end, called with the function's own defaults (the CLI's come from its signature):
    the embedded model, bundled HotpotQA contexts and its tokenizer, B = 0, ``similarity_out`` in the working
    directory, a progress bar."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tqdm.std.tqdm.monitor_interval", 0)  # no monitor thread left behind (a fork would inherit it)
    assert similarity(adapter_init="zero", samples=2, max_tokens=24) == 0
    out = tmp_path / "similarity_out"
    doc = json.loads((out / "similarity.json").read_text())
    assert doc["config"]["model"] == "default" and doc["config"]["benchmark"] == "hotpotqa"
    assert doc["config"]["label"] == "hotpotqa · init zero (shared A)" and doc["config"]["data"] is None
    assert "similarity: 100%" in capsys.readouterr().err  # the bar, unless quiet
    s = doc["summary"]
    assert s["tokens_total"] == 48 and s["cos"]["adapter"]["mean"] is None
    for metric in ("base", "full", "lr", "k", "hidden"):
        assert s["cos"][metric]["mean"] == pytest.approx(1.0, abs=1e-6), metric


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--adapters", "ad", "--adapter_init", "zero"], "give either --adapters ('ad') or --adapter_init ('zero')"),
        (["--adapter_init", "zero", "--data", "/no/such.jsonl"], "--data '/no/such.jsonl': no such file"),
        (["--adapter_init", "zero", "--max_tokens", "0"], "--max_tokens must be >= 1, got 0"),
        (["--adapter_init", "zero", "--device", "cpu", "--dtype", "bfloat16"], "--dtype 'bfloat16' on CPU is slow"),
        (["--adapter_init", "zero", "--device", "mps"], "--device 'mps' unknown: allowed cpu, cuda, cuda:N"),
        (["--adapter_init", "zero", "--model", "tiny-llama"], "--model 'tiny-llama' has random weights and no tok"),
    ],
)
def test_more_bad_input_is_one_line_before_any_output(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    rc = run_command(similarity, [*argv, "--out", str(out)], "cli.py similarity")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_without_a_gpu_is_refused_naming_the_device(tmp_path, capsys):
    rc = run_command(similarity, ["--adapter_init", "zero", "--device", "cuda:0", "--out", str(tmp_path / "o")], "s")
    assert rc == 2 and "--device 'cuda:0' but CUDA is not available: allowed cpu" in capsys.readouterr().err


def test_a_cuda_device_by_index_passes_the_checks_where_cuda_is_available(tmp_path, monkeypatch):
    from eval_suite.diagnostics.similarity import _validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("cuda", "cuda:1"):
        _validate(None, "zero", "hotpotqa", None, 1, 1, "default", "float32", device, str(tmp_path))


def test_the_model_is_built_on_the_device_asked_for_even_where_cuda_is_the_default(monkeypatch):
    """``device="cpu"`` reaches the loader: where CUDA is available the loader's own default would be CUDA."""
    from eval_suite.diagnostics.similarity import _build_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    m, _ = _build_model("tiny-llama", None, "zero", 0, 2, 16.0, False, "float32", "cpu")
    assert {p.device.type for p in m.parameters()} == {"cpu"}


def test_an_out_file_a_zero_rank_and_out_of_vocabulary_ids_are_refused(tmp_path, capsys):
    ids = _ids_file(tmp_path)
    base = ["--adapter_init", "zero", "--model", "tiny-llama", "--data", str(ids), "--device", "cpu"]
    out_file = tmp_path / "report.md"
    out_file.write_text("keep me")
    assert run_command(similarity, [*base, "--out", str(out_file)], "s") == 2
    assert f"--out '{out_file}' is a file, not a directory" in capsys.readouterr().err
    assert out_file.read_text() == "keep me"
    out = tmp_path / "out"
    assert run_command(similarity, [*base, "--rank", "0", "--out", str(out)], "s") == 2
    assert "--rank must be >= 1, got 0" in capsys.readouterr().err
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"ids": [1, 2, 100000]}) + "\n")
    assert run_command(similarity, [*base[:-3], str(big), "--device", "cpu", "--out", str(out)], "s") == 2
    assert "big.jsonl:1 has token ids outside the model's vocabulary 0..255" in capsys.readouterr().err
    assert not out.exists()


def test_adapters_without_v_proj_are_refused_before_loading(tmp_path, capsys):
    from lragent.adapters_io import NATIVE_FILE, save_native

    ad = tmp_path / "ad"
    ad.mkdir()
    save_native(tiny_multi_lora(targets=("q_proj",)), ad / NATIVE_FILE)
    no_model = tmp_path / "no_model"  # the refusal comes first: the model is never looked for
    argv = ["--adapters", str(ad), "--model", str(no_model), "--data", str(_ids_file(tmp_path)), "--device", "cpu"]
    assert run_command(similarity, [*argv, "--out", str(tmp_path / "out")], "s") == 2
    assert "the adapters target ['q_proj']: the similarity report needs a LoRA on v_proj" in capsys.readouterr().err


def test_context_sources_and_models_that_cannot_serve_are_named(tmp_path):
    from eval_suite.diagnostics.similarity import check_model

    not_json = tmp_path / "a.jsonl"
    not_json.write_text('{"text": "x"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"a.jsonl:2 is not a JSON line \("):
        load_contexts(CharTokenizer(), 5, 4, data=not_json)
    a_list = tmp_path / "b.jsonl"
    a_list.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="b.jsonl:1 must be a JSON object with a text, input or ids field"):
        load_contexts(CharTokenizer(), 5, 4, data=a_list)
    with pytest.raises(FileNotFoundError, match="--data '/no/such.jsonl': no such file"):
        load_contexts(CharTokenizer(), 5, 4, data="/no/such.jsonl")
    with pytest.raises(ValueError, match="unknown benchmark 'gsm8k': allowed hotpotqa, scienceqa"):
        load_contexts(CharTokenizer(), 5, 4, benchmark="gsm8k", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no role example files in {tmp_path}/trajectories/scienceqa"):
        load_contexts(CharTokenizer(), 5, 4, benchmark="scienceqa", data_dir=tmp_path)
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(ValueError, match=f"no usable context in {blank}"):
        load_contexts(CharTokenizer(), 5, 4, data=blank)
    with pytest.raises(ValueError, match="no samples to summarize"):
        summarize([], ["plan", "action"])
    model = tiny_multi_lora()
    attn = model.model.model.layers[1].self_attn
    attn.v_proj = attn.v_proj.base
    with pytest.raises(ValueError, match="layer 1's v_proj has no multi-LoRA adapter"):
        check_model(model)


def test_merge_refuses_a_directory_without_a_complete_run(tmp_path, capsys):
    empty, partial = tmp_path / "empty", tmp_path / "partial"
    empty.mkdir()
    partial.mkdir()
    (partial / "similarity.json").write_text(json.dumps({"complete": False}))
    out = tmp_path / "merged"
    assert run_command(similarity, ["--merge", json.dumps([str(empty)]), "--out", str(out)], "s") == 2
    assert f"--merge '{empty}': no similarity.json in it" in capsys.readouterr().err
    assert run_command(similarity, ["--merge", json.dumps([str(partial)]), "--out", str(out)], "s") == 2
    assert f"--merge '{partial}': the run is incomplete (complete: false); rerun it first" in capsys.readouterr().err
    assert not out.exists()
