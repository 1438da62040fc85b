"""The prefill profile's bookkeeping on the CPU (tiny model): only the ops inside Engine.prefill count, every class
that the prefill path has gets time, and the labels are removed afterwards."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_multi_lora

from eval_suite.bench import profile_prefill as P
from lragent.cache_views import PrefillView
from lragent.engine import Engine


def _short_trace(monkeypatch) -> None:
    """One plan-plan-action cycle with short generations instead of the 17 steps (CPU time)."""
    import eval_suite.bench.trace as T

    monkeypatch.setattr(T, "CYCLES", 1)
    monkeypatch.setattr(T, "CYCLE", (("plan", 8, 3), ("plan", 8, 2), ("action", 8, 2)))
    monkeypatch.setattr(T, "REFLECT", (("reflect", 4, 2),))


def test_only_the_prefill_is_counted_and_every_class_gets_time(monkeypatch) -> None:
    _short_trace(monkeypatch)
    model = tiny_multi_lora("tiny-llama", rank=4)
    before = (PrefillView.__dict__["attend"], PrefillView.__dict__["rope_store"], Engine.__dict__["prefill"])
    with torch.no_grad():
        row = P.profile_scheme(model, "base_lr_shared", 24, torch.device("cpu"), None, timed_runs=False)
    assert (PrefillView.__dict__["attend"], PrefillView.__dict__["rope_store"], Engine.__dict__["prefill"]) == before
    ms = row["prefill_ms_by_class"]
    assert set(ms) == set(P.CLASSES)  # no decode-only class (sampling) leaked in
    for cls in ("GEMM (base weights)", "LoRA", "attention kernel", "RoPE and cache writes", "norms/SiLU"):
        assert ms[cls] > 0, (cls, ms)
    assert row["prefill_busy_ms"] == sum(ms.values())
    # the prefill's CPU op time is a part of the whole profiled trace's, which also decodes
    assert 0 < row["prefill_busy_ms"] < 1e3 * row["profiled_wall_s"]


def test_without_the_phase_filter_decode_classes_would_show(monkeypatch) -> None:
    """The control for the test above: counting every op (the phase filter off) brings in the decode's sampling
    class and more time, so `set(ms) == CLASSES` there does check the filter."""
    _short_trace(monkeypatch)
    model = tiny_multi_lora("tiny-llama", rank=4)
    monkeypatch.setattr(P, "_in_prefill", lambda evt: True)
    with torch.no_grad():
        row = P.profile_scheme(model, "full_shared", 16, torch.device("cpu"), None, timed_runs=False)
    assert "sampling" in row["prefill_ms_by_class"]


def test_profile_prefill_refuses_an_empty_context(capsys):
    from eval_suite.bench.profile_prefill import main

    assert main(["--context", "0", "--device", "cuda"]) == 2  # checked first; without a GPU nothing runs after
    err = capsys.readouterr().err
    assert err.startswith("error: context must be >= 1 token, got 0") and err.count("\n") == 1, err


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_profile_prefill_on_cuda_without_a_gpu_is_refused_before_writing(device, tmp_path, monkeypatch) -> None:
    """``--device cuda`` or ``cuda:N`` without CUDA: one error naming the device and cpu, and no output folder."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "profile"
    with pytest.raises(ValueError, match=f"^--device '{device}' but CUDA is not available: allowed cpu$"):
        P.profile_prefill(model="tiny-llama", context=16, device=device, out=str(out))
    assert not out.exists()


def test_a_cpu_prefill_profile_writes_its_json_and_markdown_into_a_new_folder(tmp_path, monkeypatch) -> None:
    """On the CPU the profile creates its (nested) output folder and writes both records, one row per scheme."""
    import json

    _short_trace(monkeypatch)
    out = tmp_path / "a" / "b"
    assert P.profile_prefill(model="tiny-llama", schemes=["full_shared"], context=16, dtype="float32", device="cpu",
                             overrides={"num_hidden_layers": 1}, out=str(out)) == 0  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["prefill_profile.json", "prefill_profile.md"]
    rec = json.loads((out / "prefill_profile.json").read_text())
    assert [r["scheme"] for r in rec["rows"]] == ["full_shared"] and rec["context"] == 16
    assert (out / "prefill_profile.md").read_text().startswith("# Prefill profile of the 17-step trace: tiny-llama")
