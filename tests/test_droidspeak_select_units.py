"""``droidspeak-select`` (:mod:`eval_suite.diagnostics.droidspeak_select`) piece by piece: the unit selection's
dynamic programme on hand-made gains, the profile's sums and candidates against a stand-in fidelity measure, and
the command's wiring (what it loads, what it selects with, the config it writes and the line it prints) with the
model and examples stubbed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval_suite.diagnostics import droidspeak_select as ds
from eval_suite.diagnostics.fidelity import FidelityExample
from tests.conftest import tiny_multi_lora

ROLES = ("plan", "action", "reflect")


@pytest.fixture(scope="module")
def model():
    return tiny_multi_lora(overrides={"num_hidden_layers": 6})


def test_layer_units_cut_the_layers_into_consecutive_groups() -> None:
    """Units of ``group_size`` consecutive layers, the last one shorter where the size does not divide."""
    assert ds.layer_units(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert ds.layer_units(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert ds.layer_units(2, 5) == [(0, 2)]
    with pytest.raises(ValueError, match=r"^group size must be >= 1, got 0$"):
        ds.layer_units(4, 0)


def test_unit_selection_maximises_the_gain_within_the_runs_allowed() -> None:
    """The k units with the largest summed gain in at most ``max_runs`` contiguous runs; the whole list when k is
    every unit; ties go to the earlier units; negative gains are taken when k requires them."""
    gains = [3.0, -1.0, 2.0, 2.0, -5.0, 4.0]
    assert ds.select_units(gains, 1, 1) == [5]
    assert ds.select_units(gains, 2, 1) == [2, 3]
    assert ds.select_units(gains, 2, 2) == [0, 5]
    assert ds.select_units(gains, 3, 2) == [2, 3, 5]
    assert ds.select_units(gains, 3, 3) == [0, 2, 5] != ds.select_units(gains, 3, 1)
    assert ds.select_units(gains, 3, 1) == [0, 1, 2]  # windows of three: 4, 3, -1, 1
    assert ds.select_units(gains, 4, 2) == [0, 1, 2, 5] and ds.select_units(gains, 4, 3) == [0, 2, 3, 5]
    assert ds.select_units(gains, 5, 1) == [1, 2, 3, 4, 5]
    assert ds.select_units(gains, 6, 1) == [0, 1, 2, 3, 4, 5]
    assert ds.select_units([1.0, 1.0, 1.0], 1, 1) == [0] and ds.select_units([1.0, 1.0, 1.0], 2, 1) == [0, 1]
    assert ds.select_units([-2.0, -1.0, -3.0], 2, 1) == [0, 1]
    with pytest.raises(ValueError, match=r"^k must be in 1\.\.2, got 3$"):
        ds.select_units([1.0, 2.0], 3, 1)
    with pytest.raises(ValueError, match=r"^max_runs must be >= 1, got 0$"):
        ds.select_units([1.0, 2.0], 1, 0)


W = [0.1, 0.5, 0.2, 0.9, 0.05, 0.3]  # what recomputing each layer of the stand-in model saves


def _examples() -> list[FidelityExample]:
    """Two examples with 2 and 4 scored tokens (the second counts twice as much per token in the stand-in)."""
    return [FidelityExample("reflect", "ex:a", tuple(range(6)), 4), FidelityExample("plan", "ex:b", tuple(range(9)), 5)]


@pytest.fixture
def stand_in(monkeypatch) -> list[tuple]:
    """A stand-in for the fidelity measure: every scored token's KL to non_shared is the example's weight (1, 2)
    times the summed ``W`` of the layers not recomputed (all for full_shared), plus 1 when the recomputed layers are
    not one contiguous run (so the additive profile can pick a worse set). Returns the calls made."""
    calls = []

    def scheme_logits(model, scheme, ex, producer, shared_split="last", droidspeak_layers=None, use_kernel=True):
        calls.append((scheme, ex.source, producer, shared_split, droidspeak_layers, use_kernel))
        n = len(ex.ids) - ex.context_len
        if scheme == "non_shared":
            return torch.zeros(n, 1)
        layers = list(droidspeak_layers or [])
        kl = sum(w for i, w in enumerate(W) if i not in layers)
        if layers and layers != list(range(layers[0], layers[-1] + 1)):
            kl += 1.0
        return torch.full((n, 1), kl * (1 if ex.source == "ex:a" else 2))

    monkeypatch.setattr(ds, "scheme_logits", scheme_logits)
    monkeypatch.setattr(ds, "compare", lambda ref, logits: ((logits - ref)[:, 0], None))
    return calls


def test_profile_sums_each_configurations_kl_per_token(model, stand_in) -> None:
    """``profile_units``: the token-mean KL of full_shared, of each unit recomputed alone and of each extra set, over
    all examples' scored tokens; each example scored against non_shared from its next role as producer, with the
    split and kernel asked for."""
    prof = ds.profile_units(model, _examples(), [(0, 2), (2, 3)], shared_split="piece", use_kernel=False,
                            extra={"odd": [1, 3], "mid": [2, 3]})  # fmt: skip
    per_token = (1 * 2 + 2 * 4) / 6  # the examples' weights over their 2 + 4 tokens
    total = sum(W)
    assert prof == {
        "full_shared": pytest.approx(total * per_token),
        "units": [pytest.approx((total - 0.6) * per_token), pytest.approx((total - 0.2) * per_token)],
        "extra": {"odd": pytest.approx((total - 1.4 + 1) * per_token), "mid": pytest.approx((total - 1.1) * per_token)},
        "tokens": 6,
    }
    assert stand_in[:6] == [
        ("non_shared", "ex:a", "plan", "piece", None, False),
        ("full_shared", "ex:a", "plan", "piece", None, False),
        ("droidspeak", "ex:a", "plan", "piece", [0, 1], False),
        ("droidspeak", "ex:a", "plan", "piece", [2], False),
        ("droidspeak", "ex:a", "plan", "piece", [1, 3], False),
        ("droidspeak", "ex:a", "plan", "piece", [2, 3], False),
    ]
    assert [c[:3] for c in stand_in[6:8]] == [("non_shared", "ex:b", "action"), ("full_shared", "ex:b", "action")]
    assert len(stand_in) == 12
    fixed = ds.profile_units(model, _examples(), [], producer="reflect")
    assert fixed == {"full_shared": pytest.approx(total * per_token), "units": [], "extra": {}, "tokens": 6}
    assert {c[2] for c in stand_in[12:]} == {"reflect"} and {c[3] for c in stand_in[12:]} == {"last"}
    assert {c[5] for c in stand_in[12:]} == {True}
    assert ds.profile_units(model, [], [(0, 1)]) == {"full_shared": 0.0, "units": [0.0], "extra": {}, "tokens": 0}


def test_the_selection_measures_its_candidates_and_keeps_the_lowest_kl(model, stand_in) -> None:
    """Units of one layer, a third of six layers (2) in at most two runs: the additive profile picks layers 1 and
    3, the best single window 2-3, the middle third is 2-3 as well; measured jointly, the split pair pays its
    non-contiguity and the window wins (the first of equal candidates)."""
    per_token = (1 * 2 + 2 * 4) / 6
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=1, max_runs=2, producer="reflect",
                                      shared_split="piece", use_kernel=False)  # fmt: skip
    assert cfg["droidspeak_layers"] == [2, 3] and cfg["groups"] == [[2, 4]]
    prof = cfg["profile"]
    kl = {name: c["kl"] for name, c in prof["candidates"].items()}
    assert {name: c["layers"] for name, c in prof["candidates"].items()} == {
        "profile_2run": [1, 3], "profile_1run": [2, 3], "middle_third": [2, 3]}  # fmt: skip
    assert list(prof["candidates"]) == ["profile_2run", "profile_1run", "middle_third"]
    assert kl == {"profile_2run": pytest.approx((sum(W) - 1.4 + 1) * per_token),
                  "profile_1run": pytest.approx((sum(W) - 1.1) * per_token),
                  "middle_third": pytest.approx((sum(W) - 1.1) * per_token)}  # fmt: skip
    assert prof["chosen"] == "profile_1run" and prof["kl_selected"] == kl["profile_1run"]
    assert prof["kl_full_shared"] == pytest.approx(sum(W) * per_token)
    assert [u["layers"] for u in prof["units"]] == [[i, i + 1] for i in range(6)]
    for u, w in zip(prof["units"], W, strict=True):
        assert u["kl"] == pytest.approx((sum(W) - w) * per_token) and u["gain"] == pytest.approx(w * per_token)
    assert {k: prof[k] for k in ("n_layers", "group_size", "fraction", "max_runs", "producer", "shared_split",
                                 "examples", "tokens")} == {
        "n_layers": 6, "group_size": 1, "fraction": 1 / 3, "max_runs": 2, "producer": "reflect",
        "shared_split": "piece", "examples": 2, "tokens": 6}  # fmt: skip
    assert {c[2] for c in stand_in} == {"reflect"} and {c[3] for c in stand_in} == {"piece"}
    assert {c[5] for c in stand_in} == {False}


def test_one_run_and_sizes_the_middle_third_does_not_fit_leave_it_out(model, stand_in) -> None:
    """With one run allowed only the one-run candidate is profiled; the middle third is a candidate only when its
    size is the selection's (k units of the group size, or the target layer count)."""
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=1, max_runs=1)
    assert list(cfg["profile"]["candidates"]) == ["profile_1run", "middle_third"]
    # four layers of six in units of 4: k = 1 unit of 4 layers; the middle third (2 layers) fits neither
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=4, fraction=4 / 6, max_runs=3)
    assert list(cfg["profile"]["candidates"]) == ["profile_3run", "profile_1run"]
    assert cfg["droidspeak_layers"] == [0, 1, 2, 3] and cfg["groups"] == [[0, 4]]
    # units of 2, a half of the layers: 3 target layers, k = round(1.5) = 2 units (4 layers) -- the middle third
    # (2 layers) is neither; with units of 2 and a third: k = 1 unit of 2 layers, the middle third's size
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=2, fraction=0.5, max_runs=1)
    assert list(cfg["profile"]["candidates"]) == ["profile_1run"] and len(cfg["droidspeak_layers"]) == 4
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=2, max_runs=1)
    assert list(cfg["profile"]["candidates"]) == ["profile_1run", "middle_third"]
    # the middle third is a candidate when either size matches: k units of 2 (one unit for a sixth) ...
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=2, fraction=1 / 6, max_runs=1)
    assert list(cfg["profile"]["candidates"]) == ["profile_1run", "middle_third"]
    # ... or the target layer count (2 layers, while one unit of 4 is chosen)
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=4, max_runs=1)
    assert list(cfg["profile"]["candidates"]) == ["profile_1run", "middle_third"]
    # a tiny fraction still recomputes one unit
    cfg = ds.select_droidspeak_layers(model, _examples(), group_size=1, fraction=0.01, max_runs=1)
    assert cfg["droidspeak_layers"] == [3]
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match=rf"^fraction must be in \(0, 1\], got {bad}$"):
            ds.select_droidspeak_layers(model, _examples(), fraction=bad)
    assert len(ds.select_droidspeak_layers(model, _examples(), group_size=1, fraction=1)["droidspeak_layers"]) == 6


def test_the_command_loads_selects_and_writes_the_config_it_prints(tmp_path: Path, monkeypatch, model, capsys) -> None:
    """``droidspeak_select``: the model loaded with the options given, the dev pool's examples of the model's roles,
    the selection with the options given (progress unless quiet), and the config written with the benchmark,
    model, adapters, seed and provenance added; one printed line names the layers, groups, KLs and the file."""
    loaded, drawn, selected = [], [], []
    fake = {"droidspeak_layers": [2, 3], "groups": [[2, 4]],
            "profile": {"kl_full_shared": 0.5, "chosen": "profile_1run", "kl_selected": 0.125,
                        "candidates": {"profile_2run": {"layers": [1, 3], "kl": 0.25},
                                       "profile_1run": {"layers": [2, 3], "kl": 0.125}}}}  # fmt: skip
    provenances = []
    monkeypatch.setattr(ds, "provenance", lambda **kw: provenances.append(kw) or {"recorded": len(provenances)})
    monkeypatch.setattr(ds, "check_model_args", lambda **kw: loaded.append(("check", kw)))
    monkeypatch.setattr(ds, "load_lora_model", lambda **kw: loaded.append(("load", kw)) or (model, "tok"))
    monkeypatch.setattr(ds, "load_role_examples", lambda *a, **kw: drawn.append((a, kw)) or _examples())
    monkeypatch.setattr(ds, "select_droidspeak_layers",
                        lambda *a, **kw: selected.append((a, kw)) or json.loads(json.dumps(fake)))  # fmt: skip
    out = tmp_path / "cfg" / "ds.json"
    (tmp_path / "ad").mkdir()
    rc = ds.droidspeak_select(benchmark="scienceqa", model="tiny-llama", adapters=str(tmp_path / "ad"), rank=4,
                              alpha=8.0, seed=5, holdout=30, limit=2, max_context_tokens=64, producer="action",
                              shared_split="piece", group_size=3, fraction=1.0, max_runs=1, dtype="bfloat16",
                              device="cpu", use_kernel=False, out=str(out), quiet=True)  # fmt: skip
    assert rc == 0
    args = dict(model="tiny-llama", adapters=str(tmp_path / "ad"), adapter_init=None, rank=4, alpha=8.0)
    assert loaded == [
        ("check", {**args, "dtype": "bfloat16", "device": "cpu", "exactly_one": True, "needs_text": True}),
        ("load", {**args, "seed": 5, "dtype": "bfloat16", "device": "cpu"}),
    ]
    assert drawn == [(("scienceqa", list(ROLES), "tok"), {"holdout": 30, "limit": 2, "seed": 5,
                                                          "max_context_tokens": 64, "pool": "dev"})]  # fmt: skip
    ((sel_args, sel_kw),) = selected
    assert sel_args[0] is model and [e.source for e in sel_args[1]] == ["ex:a", "ex:b"]
    assert sel_kw == {"group_size": 3, "fraction": 1.0, "max_runs": 1, "producer": "action", "shared_split": "piece",
                      "use_kernel": False, "progress": False}  # fmt: skip
    written = json.loads(out.read_text())
    assert written["droidspeak_layers"] == [2, 3] and written["groups"] == [[2, 4]]
    assert {k: written["profile"][k] for k in ("benchmark", "model", "adapters", "seed")} == {
        "benchmark": "scienceqa",
        "model": "tiny-llama",
        "adapters": str((tmp_path / "ad").resolve()),
        "seed": 5,
    }
    assert written["profile"]["chosen"] == "profile_1run"
    assert written["provenance"] == {"recorded": 1}
    assert provenances == [{"dtype": "bfloat16", "device": "cpu"}]  # the device the model's weights are on
    assert capsys.readouterr().out == (
        "droidspeak_layers [2, 3] (groups [[2, 4]]); KL full_shared 5.000e-01, chosen profile_1run 1.250e-01 "
        f"(candidates: profile_2run 2.500e-01, profile_1run 1.250e-01) -> {out}\n"
    )
    ds.droidspeak_select(adapter_init="random", out=str(tmp_path / "b.json"))  # the defaults, with progress
    assert loaded[-1] == ("load", {"model": "default", "adapters": None, "adapter_init": "random", "rank": 8,
                                   "alpha": 16.0, "seed": 0, "dtype": "float32", "device": None})  # fmt: skip
    assert drawn[-1] == (("hotpotqa", list(ROLES), "tok"), {"holdout": 100, "limit": 4, "seed": 0,
                                                            "max_context_tokens": None, "pool": "dev"})  # fmt: skip
    assert selected[-1][1] == {"group_size": 2, "fraction": 1 / 3, "max_runs": 2, "producer": "next",
                               "shared_split": "last", "use_kernel": True, "progress": True}  # fmt: skip
    assert json.loads((tmp_path / "b.json").read_text())["profile"]["adapters"] == "init:random"
    monkeypatch.chdir(tmp_path)
    ds.droidspeak_select(adapter_init="zero")  # the default file, in the working directory
    assert json.loads((tmp_path / "droidspeak.json").read_text())["droidspeak_layers"] == [2, 3]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"group_size": 0}, "--group_size and --max_runs must be >= 1, got 0, 2"),
        ({"max_runs": 0}, "--group_size and --max_runs must be >= 1, got 2, 0"),
        ({"group_size": 1, "max_runs": 1, "fraction": 0}, "--fraction must be in (0, 1], got 0"),
        ({"fraction": 1.01}, "--fraction must be in (0, 1], got 1.01"),
        ({"producer": "critic"}, "--producer 'critic' unknown: allowed next or plan, action, reflect"),
        ({"holdout": 0}, "--holdout must be >= 1, got 0"),
        ({"max_context_tokens": 1}, "--max_context_tokens must be >= 2, got 1"),
    ],
)
def test_the_command_refuses_bad_options_before_writing(tmp_path: Path, monkeypatch, model, kw, message) -> None:
    """Each bad option is one ``ValueError`` naming it, and no config is written; sizes of exactly 1 and a fraction
    of exactly 1 are accepted."""
    monkeypatch.setattr(ds, "load_lora_model", lambda **_: (model, "tok"))
    monkeypatch.setattr(ds, "load_role_examples", lambda *a, **k: _examples())
    out = tmp_path / "ds.json"
    with pytest.raises(ValueError) as err:
        ds.droidspeak_select(adapter_init="zero", out=str(out), **kw)
    assert str(err.value) == message and not out.exists()


def test_the_selections_defaults_and_its_progress_bar(model, stand_in, capsys) -> None:
    """By default: units of 2 layers, at most 2 runs, the fused kernel asked for, no progress bar; ``progress`` shows
    the profile's bar (on stderr)."""
    cfg = ds.select_droidspeak_layers(model, _examples())
    prof = cfg["profile"]
    assert (prof["group_size"], prof["max_runs"], prof["fraction"]) == (2, 2, 1 / 3)
    assert prof["producer"] == "next" and prof["shared_split"] == "last"
    assert [u["layers"] for u in prof["units"]] == [[0, 2], [2, 4], [4, 6]]
    assert list(prof["candidates"]) == ["profile_2run", "profile_1run", "middle_third"]
    assert {c[5] for c in stand_in} == {True} and {c[3] for c in stand_in} == {"last"}
    assert capsys.readouterr().err == ""
    ds.select_droidspeak_layers(model, _examples(), progress=True)
    assert "droidspeak profile" in capsys.readouterr().err
