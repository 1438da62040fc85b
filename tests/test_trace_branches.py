"""``bench trace``'s option checks before any model loads (eval_suite/bench/trace.py)."""

from __future__ import annotations

from lragent.cli_main import main


def test_bench_trace_refuses_a_context_below_one_token(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["bench", "trace", "--contexts", "[256, 0]", "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: contexts must be >= 1 token, got [256, 0]") and err.count("\n") == 1, err
    assert not out.exists()
