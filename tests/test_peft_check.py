"""eval_suite/diagnostics/peft_check.py: an export's PEFT directories load in peft and match lragent's logits per role;
a directory whose role weights were swapped, or that is not an export, is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eval_suite.diagnostics.peft_check import check_export, main
from lragent.adapters_io import NATIVE_FILE, export_peft
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
