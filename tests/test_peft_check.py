"""eval_suite/diagnostics/peft_check.py: an export's PEFT directories load in peft and match lragent's logits per role;
a directory whose role weights were swapped, or that is not an export, is caught."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from eval_suite.diagnostics.peft_check import check_export, main, peft_check
from lragent.adapters_io import NATIVE_FILE, adapter_config_of, export_peft, load_adapter_dir
from lragent.lora_model import MultiLoraModel
from lragent.models import load_model
from tests.conftest import tiny_multi_lora


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    export_peft(tiny_multi_lora("tiny-llama", rank=4, b_std=0.3), out)
    return out


def test_every_role_loads_in_peft_and_matches(export: Path) -> None:
    res = check_export(export, "tiny-llama")
    assert res["ok"] and set(res["roles"]) == {"plan", "action", "reflect"}
    assert all(r["loaded"] and r["rel_diff"] <= 1e-5 for r in res["roles"].values())
    assert all(r["adapter_effect"] > 100 * r["max_abs_diff"] + 1e-3 for r in res["roles"].values())  # a real test


def test_swapped_role_weights_are_caught(export: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(export, bad)
    for name in ("adapter_model.safetensors",):  # plan's PEFT weights carry action's B
        shutil.copy(bad / "action" / name, bad / "plan" / name)
    res = check_export(bad, "tiny-llama")  # lragent reads the native file: plan keeps its own B
    assert (bad / NATIVE_FILE).is_file()
    assert not res["ok"] and res["roles"]["plan"]["rel_diff"] > 1e-3 and res["roles"]["action"]["rel_diff"] <= 1e-5


def test_not_an_export_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["--export", str(tmp_path / "nothing"), "--model", "tiny-llama"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_resolved_says_whether_the_tolerance_can_see_the_adapters(export: Path) -> None:
    """Resolved where the adapters' effect (relative to the largest logit) is at least 10x the tolerance: at the CPU
    float32 default, and at a tolerance of a twentieth of the effect; not at a fifth of it, though the logits still
    agree (a coarse tolerance passes whatever the adapters are)."""
    res = check_export(export, "tiny-llama")
    assert res["rel_tol"] == 1e-5 and all(r["resolved"] for r in res["roles"].values())
    share = min(r["adapter_effect"] / r["max_abs_logit"] for r in res["roles"].values())
    assert share > 1e-3, share
    assert all(r["resolved"] for r in check_export(export, "tiny-llama", rel_tol=share / 20)["roles"].values())
    coarse = check_export(export, "tiny-llama", rel_tol=share / 5)
    assert coarse["ok"] and not all(r["resolved"] for r in coarse["roles"].values())


def test_a_native_file_without_role_directories_is_named(export: Path, tmp_path: Path, capsys) -> None:
    native_only = tmp_path / "native"
    shutil.copytree(export, native_only)
    shutil.rmtree(native_only / "action")
    assert main(["--export", str(native_only), "--model", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {native_only} has no PEFT directory for role(s) ['action']: not an export")


def test_out_gets_the_printed_result(export: Path, tmp_path: Path, capsys) -> None:
    import json

    out = tmp_path / "peft_check.json"
    assert main(["--export", str(export), "--model", "tiny-llama", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed and printed["ok"]


@pytest.fixture(scope="module")
def default_result(export: Path) -> dict:
    return check_export(export, "tiny-llama")


def test_the_numbers_are_those_of_sixteen_seeded_tokens(export: Path, default_result: dict) -> None:
    """Recomputed by hand: lragent's model with the export's adapters and the plain base on 16 tokens drawn from
    0..vocab-1 with seed 0; effect = max |lragent − base|, scale = max |logit|, rel_diff = diff / scale."""
    hf, _ = load_model("tiny-llama")
    lm = MultiLoraModel(hf, adapter_config_of(export))
    load_adapter_dir(lm, export)
    plain, _ = load_model("tiny-llama")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    keys = {"loaded", "max_abs_diff", "max_abs_logit", "rel_diff", "adapter_effect", "resolved"}
    with torch.no_grad():
        base = plain(ids).logits
        for role, r in default_result["roles"].items():
            got = lm.eval()(ids, [role])
            assert set(r) == keys and r["loaded"] is True
            assert r["adapter_effect"] == pytest.approx(float((got - base).abs().max()), rel=1e-6), role
            assert r["max_abs_logit"] == pytest.approx(float(got.abs().max()), rel=1e-5), role
            assert r["rel_diff"] == r["max_abs_diff"] / r["max_abs_logit"]
            assert 0 <= r["max_abs_diff"] <= 1e-5 * r["max_abs_logit"]


def test_ok_holds_at_a_tolerance_equal_to_the_worst_difference(export: Path, default_result: dict) -> None:
    worst = max(r["rel_diff"] for r in default_result["roles"].values())
    at = check_export(export, "tiny-llama", rel_tol=worst)
    assert at["ok"] and at["rel_tol"] == worst
    assert {k: r["rel_diff"] for k, r in at["roles"].items()} == {
        k: r["rel_diff"] for k, r in default_result["roles"].items()
    }  # the same numbers on every run


def test_ok_fails_just_below_the_worst_difference(export: Path, default_result: dict) -> None:
    worst = max(r["rel_diff"] for r in default_result["roles"].values())
    below = check_export(export, "tiny-llama", rel_tol=math.nextafter(worst, -1.0))
    assert not below["ok"]


def test_resolved_holds_at_exactly_ten_times_the_tolerance(export: Path, default_result: dict) -> None:
    role, r = next(iter(default_result["roles"].items()))
    share = r["adapter_effect"] / r["max_abs_logit"]
    tol = share / 10
    while 10 * tol > share:  # the largest tolerance whose tenfold is still within the share
        tol = math.nextafter(tol, 0.0)
    while 10 * math.nextafter(tol, 1.0) <= share:
        tol = math.nextafter(tol, 1.0)
    res = check_export(export, "tiny-llama", rel_tol=tol)
    assert res["roles"][role]["resolved"]
    assert 10 * math.nextafter(tol, 1.0) > share  # one step more and it would not be


def test_sixteen_bit_default_tolerance_and_both_models_in_that_dtype(export: Path) -> None:
    """In bfloat16 the tolerance is 3e-2, and the adapters' effect is that of two bfloat16 models (lragent's and the
    plain base), recomputed here."""
    res = check_export(export, "tiny-llama", dtype="bfloat16")
    assert res["rel_tol"] == 3e-2 and res["ok"]
    assert all(0 <= r["rel_diff"] <= 3e-2 for r in res["roles"].values())
    hf, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    lm = MultiLoraModel(hf, adapter_config_of(export))
    load_adapter_dir(lm, export)
    plain, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = plain(ids).logits.float()
        for role, r in res["roles"].items():
            got = lm.eval()(ids, [role]).float()
            assert r["adapter_effect"] == pytest.approx(float((got - base).abs().max()), rel=1e-6), role


def test_the_function_writes_what_it_prints_with_overrides(
    export: Path, default_result: dict, tmp_path: Path, capsys
) -> None:
    """peft_check's own defaults (float32 on the CPU) and its JSON overrides reach the models: a larger RMSNorm
    epsilon changes every logit."""
    out = tmp_path / "o.json"
    assert peft_check(str(export), "tiny-llama", overrides=json.dumps({"rms_norm_eps": 0.5}), out=str(out)) == 0
    printed = capsys.readouterr().out
    res = json.loads(printed)
    assert out.read_text() == json.dumps(res, indent=1) + "\n" == printed
    assert res["ok"] and res["rel_tol"] == 1e-5
    for role, r in res["roles"].items():
        assert r["max_abs_logit"] != default_result["roles"][role]["max_abs_logit"]


def test_help_names_the_module_command(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m eval_suite.diagnostics.peft_check [--config CONFIG]")


def test_the_command_fails_on_swapped_weights_with_their_relative_difference(export: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(export, bad)
    shutil.copy(bad / "action" / "adapter_model.safetensors", bad / "plan" / "adapter_model.safetensors")
    out = tmp_path / "bad.json"
    assert main(["--export", str(bad), "--model", "tiny-llama", "--out", str(out)]) == 1
    plan = json.loads(out.read_text())["roles"]["plan"]
    assert plan["max_abs_diff"] > 1e-3 * plan["max_abs_logit"] > 0
    assert plan["rel_diff"] == plan["max_abs_diff"] / plan["max_abs_logit"]
