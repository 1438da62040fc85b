"""scripts/cross_role_cost_model.py: the step-time fit and the rebuilt batches it projects from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main
from eval_suite.bench_train import ModelShape, pass_flops
from tests.conftest import load_script
from tests.test_cross_role_batches import write_chained

cost_model = load_script("cross_role_cost_model")
TINY = {"vocab_size": 258, "num_hidden_layers": 2}


def test_fit_line_keeps_the_intercept_at_flop_scale() -> None:
    """Step times against FLOPs of ~1e14: the fit must return the fixed cost and the rate (an unscaled least-squares
    solve dropped the intercept as rank-deficient and put the whole time on the FLOPs)."""
    flops = [3.1e14, 4.4e14, 5.2e14, 2.0e14]
    seconds = [0.05 + f / 300e12 for f in flops]
    a, per_flop = cost_model.fit_line(flops, seconds)
    assert a == pytest.approx(0.05, rel=1e-6) and 1 / per_flop == pytest.approx(300e12, rel=1e-6)
    assert cost_model.fit_scale([1.0, 2.0, 3.0], [1.5, 3.0, 4.5]) == pytest.approx(1.5)


def test_step_model_drops_only_the_absorbed_rows_plain_work() -> None:
    shape = ModelShape(2, 16, 2, 1, 8, 32, 50, 2, ("q_proj",))
    model = cost_model.StepModel(shape, a=0.01, per_flop=1e-9, c=1.04)
    lengths = [40, 30, 20]
    assert model.weighted(lengths, lengths) == pytest.approx(2.04 * model.plain(lengths))
    assert model.weighted(lengths, []) == pytest.approx(1.04 * model.plain(lengths))
    # the plain pass pads the kept rows to their own longest: dropping the longest row shortens the others' padding
    assert cost_model.padded_flops(shape, [30, 20]) == pass_flops(shape, [30, 30], 0)
    assert model.plain([30, 20]) == pytest.approx(0.01 + 1e-9 * pass_flops(shape, [30, 30], 0))
    assert model.plain([]) == 0.0


@pytest.mark.parametrize("producer", ["prefix", "random"])
def test_rebuilt_batches_are_the_bench_runs_batches(tmp_path: Path, producer: str) -> None:
    """The projection and the calibration check rebuild ``bench train``'s batches and absorbed rows on the host; they
    must be the very batches, and absorb the same rows per step, as the bench's steps (seeded producers included)."""
    data = tmp_path / "data"
    data.mkdir()
    write_chained(data, n=8)
    out = tmp_path / "out"
    argv = [
        "bench", "train", "--model", "tiny-llama", "--model_overrides", json.dumps(TINY), "--data", str(data),
        "--seq_len", "512", "--batch_size", "4", "--steps", "5", "--warmup_steps", "1", "--lambdas", "[0, 0.5]",
        "--checkpointing", "[false]", "--pack_prefixes", "false", "--peft_baseline", "false", "--precision",
        "32-true", "--cross_role_batches", "true", "--producer", producer, "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    half = json.loads((out / "bench_train.json").read_text())["rows"][1]
    rebuilt = cost_model.epoch_batches(str(data), "byte", 512, 4, None, producer, limit=6)[1:]
    assert [lens for lens, _ in rebuilt] == half["step_lengths"]
    assert [len(lens) - len(kept) for lens, kept in rebuilt] == half["step_absorbed"]
    assert sum(half["step_absorbed"]) > 0
    # the projection's "bench" figure covers the same batches the bench timed
    model = cost_model.StepModel(ModelShape(2, 16, 2, 1, 8, 32, 258, 2, ("q_proj",)), a=0.01, per_flop=1e-9, c=1.04)
    proj = cost_model.project(model, f"{data}:byte:512:b4", producer, bench=(1, 5))["cross_role"]
    assert proj["bench_lengths"] == half["step_lengths"]
    assert proj["bench_absorbed"] == half["step_absorbed"]


def test_calibration_checks_every_cross_role_run_and_the_user_ratio(tmp_path: Path) -> None:
    """``calibrate`` rebuilds every cross-role run of a folder with that run's own ``cross_role_min_share`` (here 0,
    not the default, which forms other chains in this data), and ``project``'s ``epoch_vs_ordinary_lambda0`` is a
    λ 0.5 cross-role epoch over a λ 0 epoch of ordinary batches, by hand from the rebuilt epochs."""
    data = tmp_path / "data"
    data.mkdir()
    write_chained(data, n=8)
    base = [
        "bench", "train", "--model", "tiny-llama", "--model_overrides", json.dumps(TINY), "--data", str(data),
        "--seq_len", "512", "--batch_size", "4", "--steps", "4", "--warmup_steps", "1", "--lambdas", "[0, 0.5]",
        "--checkpointing", "[false]", "--pack_prefixes", "false", "--peft_baseline", "false", "--precision",
        "32-true",
    ]  # fmt: skip
    runs = tmp_path / "runs"
    assert main([*base, "--out", str(runs / "bench_cross_byte_none")]) == 0
    for producer in ("prefix", "random"):
        argv = [*base, "--cross_role_batches", "true", "--cross_role_min_share", "0", "--producer", producer]
        assert main([*argv, "--out", str(runs / f"bench_cross_byte_{producer}")]) == 0
    assert cost_model.epoch_batches(str(data), "byte", 512, 4, None, "prefix", min_share=0.0) != (
        cost_model.epoch_batches(str(data), "byte", 512, 4, None, "prefix")
    )  # the default share forms other batches: a rebuild that ignored the run's share would not match
    model, report = cost_model.calibrate(runs)
    assert sorted({c["run"] for c in report["check"]}) == ["bench_cross_byte_prefix", "bench_cross_byte_random"]
    assert len(report["check"]) == 8 and sum(c["absorbed"] for c in report["check"]) > 0
    proj = cost_model.project(model, f"{data}:byte:512:b4", "prefix", bench=(1, 4), min_share=0.0)
    cross = cost_model.epoch_batches(str(data), "byte", 512, 4, None, "prefix", min_share=0.0)
    ordinary = cost_model.epoch_batches(str(data), "byte", 512, 4, None, "prefix", cross=False)
    weighted = sum(model.weighted(lens, kept) for lens, kept in cross)
    assert proj["cross_role"]["epoch_vs_ordinary_lambda0"] == pytest.approx(
        weighted / sum(model.plain(lens) for lens, _ in ordinary)
    )
    assert proj["cross_role"]["lambda0_epoch_vs_ordinary"] == pytest.approx(
        sum(model.plain(lens) for lens, _ in cross) / sum(model.plain(lens) for lens, _ in ordinary)
    )
    # measured per token against the control's λ 0 step, by hand from the JSONs
    assert [v["run"] for v in report["vs_control"]] == ["bench_cross_byte_prefix", "bench_cross_byte_random"]
    control = json.loads((runs / "bench_cross_byte_none" / "bench_train.json").read_text())
    for v in report["vs_control"]:
        run = json.loads((runs / v["run"] / "bench_train.json").read_text())

        def per_token(result: dict, row: int) -> float:
            r = result["rows"][row]
            n = result["steps"]
            return sum(r["step_seconds"][-n:]) / sum(sum(x) for x in r["step_lengths"][-n:])

        assert v["ratio"] == pytest.approx(per_token(run, 1) / per_token(control, 0))
        assert v["lambda0_ratio"] == pytest.approx(per_token(run, 0) / per_token(control, 0))
        assert v["interval"][0] < v["ratio"] < v["interval"][1]
