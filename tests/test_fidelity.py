"""Teacher-forced fidelity of the sharing schemes against ``non_shared``, and DroidSpeak layer selection, on tiny
random models (vocab 256)."""

from __future__ import annotations

import json

import pytest
import torch

from eval_suite.diagnostics import fidelity
from eval_suite.diagnostics.droidspeak_select import layer_units, select_droidspeak_layers, select_units
from eval_suite.diagnostics.fidelity import (
    FidelityExample,
    compare,
    heldout_indices,
    load_role_examples,
    render_markdown,
    run_fidelity,
    scheme_logits,
)
from eval_suite.report import write_json
from lragent.loading import read_droidspeak_config as load_droidspeak_config
from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession
from tests.conftest import tiny_multi_lora

ROLES = ("plan", "action", "reflect")
SHARED = ("full_shared", "droidspeak", "base_shared", "base_lr_shared")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the tiny models


def _examples(roles=ROLES, per_role=2, length=36, context=24, seed=0) -> list[FidelityExample]:
    g = torch.Generator().manual_seed(seed)
    return [
        FidelityExample(role, f"rand:{role}:{i}", tuple(torch.randint(0, 256, (length,), generator=g).tolist()),
                        context, prefix_len=context // 2)
        for role in roles
        for i in range(per_role)
    ]  # fmt: skip


def test_non_shared_against_itself_is_exact():
    model = tiny_multi_lora()
    ex = _examples(per_role=1)[1]
    a = scheme_logits(model, "non_shared", ex, "plan")
    b = scheme_logits(model, "non_shared", ex, "plan")
    assert a.shape == (len(ex.ids) - ex.context_len, 256)
    kl, agree = compare(a, b)
    assert float(kl.max()) == 0.0 and bool(agree.all())
    res = run_fidelity(model, _examples(per_role=1), ["non_shared"])
    assert res["schemes"]["non_shared"]["overall"]["kl"] == 0.0
    assert res["schemes"]["non_shared"]["overall"]["top1"] == 1.0


def test_scored_logits_are_the_plain_model_for_non_shared():
    """The reference equals a plain forward of the consumer over the whole example, at the scored positions."""
    model = tiny_multi_lora()
    ex = _examples(per_role=1)[0]
    with torch.no_grad():
        plain = model(torch.tensor([ex.ids]), [ex.role])[0]
    ref = scheme_logits(model, "non_shared", ex, "action")
    torch.testing.assert_close(ref, plain[ex.context_len - 1 : -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", ["last", "piece"])
def test_one_role_every_scheme_equals_non_shared(split):
    model = tiny_multi_lora(roles=("plan",))
    res = run_fidelity(model, _examples(roles=("plan",), per_role=3), SCHEMES, shared_split=split)
    for s in SCHEMES:
        assert res["schemes"][s]["overall"]["kl"] < 1e-6, s
        assert res["schemes"][s]["overall"]["top1"] == 1.0, s


def test_zero_b_every_scheme_equals_non_shared():
    model = tiny_multi_lora()
    model.init_adapters("zero", seed=3)
    res = run_fidelity(model, _examples(), SCHEMES)
    for s in SCHEMES:
        assert res["schemes"][s]["overall"]["kl"] < 1e-6, s
        assert res["schemes"][s]["overall"]["top1"] == 1.0, s


def test_distinct_adapters_make_sharing_inexact():
    model = tiny_multi_lora()
    res = run_fidelity(model, _examples(), SCHEMES)
    assert res["schemes"]["non_shared"]["overall"]["kl"] == 0.0
    for s in SHARED:
        v = res["schemes"][s]
        assert v["overall"]["kl"] > 1e-4, s
        assert set(v) == {*ROLES, "overall"}
        assert v["overall"]["tokens"] == sum(v[r]["tokens"] for r in ROLES) == 6 * 12
        weighted = sum(v[r]["kl"] * v[r]["tokens"] for r in ROLES) / v["overall"]["tokens"]
        assert v["overall"]["kl"] == pytest.approx(weighted)
    assert [e["producer"] for e in res["examples"][::2]] == ["action", "reflect", "plan"]  # next role, wrapping
    md = render_markdown(res)
    lines = [line for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["Scheme"] + [f"{c} {m}" for c in (*ROLES, "overall") for m in ("KL", "top-1 %")]
    assert [line.split("|")[1].strip() for line in lines[2:]] == list(SCHEMES)
    fs = [c.strip() for c in lines[3].strip("|").split("|")]
    assert fs[-2] == f"{res['schemes']['full_shared']['overall']['kl']:.3e}"


def test_fixed_producer_equal_to_consumer_is_exact():
    """A consumer whose context was produced by itself shares nothing foreign: KL 0 for that role only."""
    model = tiny_multi_lora()
    res = run_fidelity(model, _examples(), ["non_shared", "base_lr_shared"], producer="plan")
    assert res["schemes"]["base_lr_shared"]["plan"]["kl"] < 1e-6
    assert res["schemes"]["base_lr_shared"]["action"]["kl"] > 1e-4


def test_droidspeak_recomputing_all_layers_is_exact():
    model = tiny_multi_lora()
    ex = _examples(per_role=1)[0]
    ref = scheme_logits(model, "non_shared", ex, "action")
    every = scheme_logits(model, "droidspeak", ex, "action", droidspeak_layers=range(model.n_layers))
    assert float(compare(ref, every)[0].max()) < 1e-6


class CharTokenizer:
    """A stand-in tokenizer: one id per character (mod 250), a BOS (id 251) in front, EOS id 252."""

    eos_token_id = 252

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [ord(c) % 250 for c in text]
        return {"input_ids": ([251] if add_special_tokens else []) + ids}


def test_heldout_examples_from_the_role_files():
    tok = CharTokenizer()
    exs = load_role_examples("hotpotqa", ROLES, tok, holdout=30, limit=4, seed=1, max_context_tokens=300)
    assert [e.role for e in exs] == ["plan"] * 4 + ["action"] * 4 + ["reflect"] * 4
    for e in exs:
        assert e.context_len <= 300 and e.ids[0] == 251 and e.ids[-1] == 252
        assert 0 <= e.prefix_len < e.context_len
    again = load_role_examples("hotpotqa", ROLES, tok, holdout=30, limit=4, seed=1, max_context_tokens=300)
    assert again == exs
    idx = heldout_indices(1000, 30, 4, seed=1, role="plan")
    assert len(idx) == 4 and all(970 <= i < 1000 for i in idx)
    assert heldout_indices(1000, 30, 4, seed=2, role="plan") != idx
    assert all(940 <= i < 970 for i in heldout_indices(1000, 30, None, 0, "plan", pool="dev"))
    # the piece split: the consumer's own prefill starts at the last prompt piece ("\nAction: ..." etc.)
    text = "sys\n### Response:\nprev output\nAction: \n### Response:\n"
    assert text[fidelity.last_piece_start(text) :] == "\nAction: \n### Response:\n"


def test_unit_selection_is_exact_and_contiguous():
    gains = [0.0, 5.0, 1.0, 0.0, 4.0, 4.0]
    assert select_units(gains, 3, max_runs=1) == [3, 4, 5]
    assert select_units(gains, 3, max_runs=2) == [1, 4, 5]
    assert layer_units(30, 2)[-1] == (28, 30) and len(layer_units(30, 2)) == 15
    assert layer_units(5, 2) == [(0, 2), (2, 4), (4, 5)]


@pytest.mark.parametrize(("n_layers", "group_size", "max_runs"), [(6, 1, 2), (6, 2, 1), (9, 1, 1)])
def test_droidspeak_selection_covers_a_third_in_contiguous_groups(tmp_path, n_layers, group_size, max_runs):
    model = tiny_multi_lora(overrides={"num_hidden_layers": n_layers})
    cfg = select_droidspeak_layers(model, _examples(per_role=1), group_size=group_size, max_runs=max_runs)
    layers, groups = cfg["droidspeak_layers"], cfg["groups"]
    assert len(layers) == round(n_layers / 3)
    assert 1 <= len(groups) <= max_runs
    assert sorted(i for a, b in groups for i in range(a, b)) == layers
    prof = cfg["profile"]
    assert layers == prof["candidates"][prof["chosen"]]["layers"]
    assert prof["kl_selected"] == min(c["kl"] for c in prof["candidates"].values())
    best_window = prof["candidates"]["profile_1run"]["layers"]
    assert best_window == list(range(best_window[0], best_window[-1] + 1))  # one contiguous run
    assert best_window[0] % group_size == 0
    assert len(prof["units"]) == len(layer_units(n_layers, group_size))
    # the chosen units have the largest gains the constraint allows; a gain is KL(full_shared) - KL(unit)
    for u in prof["units"]:
        assert u["gain"] == pytest.approx(prof["kl_full_shared"] - u["kl"])
    assert prof["kl_selected"] >= 0 and prof["kl_full_shared"] > 0
    # the config is what the droidspeak scheme reads
    write_json(tmp_path / "ds.json", cfg)
    loaded = load_droidspeak_config(tmp_path / "ds.json")
    assert loaded == layers and json.loads((tmp_path / "ds.json").read_text())["profile"]["n_layers"] == n_layers
    s = MultiAgentSession(model, "droidspeak", droidspeak_layers=loaded)
    assert [list(g) for g in s.engine.scheme.groups] == groups


def _fidelity(argv: list[str]) -> int:
    from lragent.cli_main import main

    return main(["fidelity", *argv])


def test_cli_errors(capsys):
    assert _fidelity(["--adapter_init", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --adapter_init 'bogus'") and err.count("\n") == 1
    assert _fidelity(["--adapter_init", "random", "--shared_split", "middle"]) == 2
    assert _fidelity(["--adapter_init", "random", "--scheme", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err


@pytest.mark.model
def test_cli_writes_results_with_provenance(tmp_path):
    """A fresh run's fidelity.json and fidelity.md say what produced them (command, device, versions, commit)."""
    import json

    out = tmp_path / "fid"
    argv = ["--adapter_init", "random", "--limit", "1", "--max_context_tokens", "48",
            "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert _fidelity(argv) == 0
    prov = json.loads((out / "fidelity.json").read_text())["provenance"]
    assert {"command", "device", "dtype", "versions", "git_commit", "utc"} <= set(prov)
    assert "--limit 1" in prov["command"]
    md = (out / "fidelity.md").read_text()
    assert "Produced on" in md and "Command:" in md


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["fidelity", "--benchmark", "gsm8k"], "unknown benchmark 'gsm8k': allowed hotpotqa, scienceqa"),
        (["fidelity", "--holdout", "0"], "--holdout must be >= 1, got 0"),
        (["fidelity", "--limit", "-2"], "--limit must be >= 1, got -2"),
        (["fidelity", "--max_context_tokens", "1"], "--max_context_tokens must be >= 2, got 1"),
        (["fidelity", "--pool", "train"], "--pool 'train' unknown: allowed heldout, dev, val"),
        (["droidspeak-select", "--group_size", "0"], "--group_size and --max_runs must be >= 1, got 0, 2"),
        (["droidspeak-select", "--max_runs", "0"], "--group_size and --max_runs must be >= 1, got 2, 0"),
        (["droidspeak-select", "--fraction", "1.5"], "--fraction must be in (0, 1], got 1.5"),
        (["droidspeak-select", "--fraction", "0"], "--fraction must be in (0, 1], got 0"),
    ],
)
def test_example_and_selection_options_are_refused_naming_the_value(capsys, tmp_path, argv, expected):
    from lragent.cli_main import main

    out = tmp_path / "out.json"
    assert main([*argv, "--adapter_init", "zero", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert not out.exists()


def test_fidelity_building_blocks_refuse_bad_values_naming_them(tmp_path):
    from eval_suite.diagnostics.droidspeak_select import select_droidspeak_layers
    from eval_suite.diagnostics.fidelity import check_producer, producer_for, tokenize_example

    ids = (1, 2, 3, 4)
    with pytest.raises(ValueError, match="ex:1: context_len 4 must be in 1..3"):
        FidelityExample("plan", "ex:1", ids, context_len=4)
    with pytest.raises(ValueError, match="ex:1: context_len 0 must be in 1..3"):
        FidelityExample("plan", "ex:1", ids, context_len=0)
    with pytest.raises(ValueError, match="ex:1: prefix_len 2 must be in 0..1"):
        FidelityExample("plan", "ex:1", ids, context_len=2, prefix_len=2)
    with pytest.raises(ValueError, match="shared split 'middle' unknown: allowed last, piece"):
        FidelityExample("plan", "ex:1", ids, context_len=2).split("middle")
    with pytest.raises(ValueError, match="holdout must be >= 1, got 0"):
        heldout_indices(10, 0, None, 0, "plan")
    with pytest.raises(ValueError, match="pool 'train' unknown: allowed heldout, dev, val"):
        heldout_indices(10, 2, None, 0, "plan", "train")
    with pytest.raises(ValueError, match="producer 'critic' unknown: allowed next or one of plan, action"):
        producer_for(["plan", "action"], "plan", "critic")
    with pytest.raises(ValueError, match=r"logit shapes differ: \(2, 5\) vs \(3, 5\)"):
        compare(torch.zeros(2, 5), torch.zeros(3, 5))
    model = tiny_multi_lora()
    with pytest.raises(ValueError, match=r"--producer 'critic' unknown: allowed next or plan, action, reflect"):
        check_producer(model, "critic")
    with pytest.raises(ValueError, match=r"unknown schemes \['half_shared'\]: allowed"):
        run_fidelity(model, [], ["half_shared"])
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0"):
        select_droidspeak_layers(model, [], fraction=0)
    with pytest.raises(FileNotFoundError, match=f"role examples {tmp_path}/trajectories/hotpotqa/plan.jsonl.gz are"):
        load_role_examples("hotpotqa", ["plan"], None, data_dir=tmp_path)

    class NoEos:
        eos_token_id = None

    with pytest.raises(ValueError, match="the tokenizer has no eos_token_id; one is needed to end every output"):
        tokenize_example(NoEos(), "plan", "ex:1", "in", "out")


def test_layer_units_and_selection_refuse_bad_sizes():
    with pytest.raises(ValueError, match="group size must be >= 1, got 0"):
        layer_units(6, 0)
    with pytest.raises(ValueError, match="k must be in 1..3, got 4"):
        select_units([1.0, 2.0, 3.0], 4, 1)
    with pytest.raises(ValueError, match="k must be in 1..3, got 0"):
        select_units([1.0, 2.0, 3.0], 0, 1)
    with pytest.raises(ValueError, match="max_runs must be >= 1, got 0"):
        select_units([1.0, 2.0, 3.0], 2, 0)
