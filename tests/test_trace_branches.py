"""``bench trace``'s option checks before any model loads (eval_suite/bench/trace.py)."""

from __future__ import annotations

import pytest

from lragent.cli_main import main


def test_bench_trace_refuses_a_context_below_one_token(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["bench", "trace", "--contexts", "[256, 0]", "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: contexts must be >= 1 token, got [256, 0]") and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_bench_trace_on_cuda_without_a_gpu_is_refused_before_writing(device, tmp_path, monkeypatch):
    """``--device cuda`` or ``cuda:N`` without CUDA: one error pointing at ``--device cpu``, and no output folder."""
    import torch

    from eval_suite.bench.trace import trace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "t"
    message = "^bench trace on cuda needs a CUDA GPU: allowed --device cpu for a functional smoke run$"
    with pytest.raises(ValueError, match=message):
        trace(model="tiny-llama", contexts=[16], schemes=["full_shared"], device=device, out=str(out))
    assert not out.exists()
