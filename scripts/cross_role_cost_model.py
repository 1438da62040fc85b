"""What the weighted λ step should cost over a whole epoch of cross-role batches: a step-time model fitted to GPU
measurements, applied to every batch of the epoch on the CPU (issue 19). A projection, not a measurement.

python scripts/cross_role_cost_model.py --calibration results/train_8b_h100_cross_role_2026-11-25/run2_a612454 \
    [--settings hotpotqa:byte:4096:b4 hotpotqa:.tok:4096:t16384 ...] [--producers prefix random] \
    [--out results/prefix_reuse/cost_model]

The model (8B shapes, one GPU, checkpointing on), fitted to ``bench train`` JSONs of the warm round:
- a λ 0 step takes ``a + F / R`` seconds, ``F`` the batch's model FLOPs at its padded length (every row as long as the
  longest: the plain pass runs padded rows) and ``R`` the sustained FLOP rate; ``a`` and ``R`` are fitted by least
  squares to the control run's λ 0 steps (``bench_cross_*_none``);
- a weighted λ step takes ``t(kept rows) + c · t(all rows)``: the plain pass over the rows not absorbed, plus the
  shared pass over all rows at ``c`` times a plain pass; ``c`` is fitted to the control run's λ 0.5 steps (no
  absorption there);
- it is then checked, not fitted, on every cross-role run of the folder (``bench_cross_*_{prefix,random}``), whose
  batches and absorbed rows are rebuilt on the CPU with the bench's seeds (and must equal the run's own).

For each setting the script builds the epoch's batches as ``fit`` and ``bench train`` do (``RoleExampleDataModule``
with ``cross_role_batches``), draws the producers as training does (``host_producers``, seed = the step), plans the
absorption (``absorption_plan``) and sums the model's step times. It reports the epoch's ratio and how the ratio of
``n`` random batches spreads, so a GPU run can be sized to tell the ratio from 2.0.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datamodules.cross_role_prefixes import CROSS_ROLE_MIN_SHARE  # noqa: E402
from eval_suite.bench_train import ModelShape, _data_files, pass_flops  # noqa: E402
from lragent.provenance import provenance  # noqa: E402
from lragent.roles import DEFAULT_ROLES  # noqa: E402


def padded_flops(shape: ModelShape, lengths: list[int]) -> float:
    """Model FLOPs of one pass over ``lengths`` padded to the longest (0 for no rows)."""
    return pass_flops(shape, [max(lengths)] * len(lengths), 0) if lengths else 0.0


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares ``y ≈ a + b x``; returns ``(a, b)``."""
    xs = torch.tensor(x, dtype=torch.float64)
    # FLOPs are ~1e14: unscaled, the solver drops the intercept column as rank-deficient
    scale = float(xs.abs().max()) or 1.0
    design = torch.stack([torch.ones_like(xs), xs / scale], 1)
    sol = torch.linalg.lstsq(design, torch.tensor(y, dtype=torch.float64).unsqueeze(1), driver="gelsd").solution
    return float(sol[0, 0]), float(sol[1, 0]) / scale


def fit_scale(x: list[float], y: list[float]) -> float:
    """Least squares ``y ≈ c x`` through the origin; returns ``c``."""
    return sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)


class StepModel:
    """Step times from padded FLOPs: λ 0 ``a + F/R``; weighted λ ``t(kept) + c·t(all)``."""

    def __init__(self, shape: ModelShape, a: float, per_flop: float, c: float) -> None:
        self.shape, self.a, self.per_flop, self.c = shape, a, per_flop, c

    def plain(self, lengths: list[int]) -> float:
        return self.a + self.per_flop * padded_flops(self.shape, lengths) if lengths else 0.0

    def weighted(self, lengths: list[int], kept: list[int]) -> float:
        return self.plain(kept) + self.c * self.plain(lengths)


def shape_of(result: dict) -> ModelShape:
    """The ``ModelShape`` a ``bench train`` JSON was measured with (its ``shape``: ``asdict`` of one)."""
    return ModelShape(**{**result["shape"], "targets": tuple(result["shape"]["targets"])})


def warm_round(row: dict, result: dict, key: str) -> list:
    """The last round's per-step values of ``key`` (rounds are round-major; the last is the warmest)."""
    n = result["steps"]
    return row[key][-n:]


def parse_setting(setting: str) -> tuple[str, str, int, int, int | None]:
    """``benchmark:tokenizer:seq_len:b<batch size>`` or ``...:t<max_tokens>`` -> ``(benchmark, tokenizer, seq_len,
    batch_size, max_tokens)`` (token-budget batches keep chains of at most 4 examples)."""
    benchmark, tokenizer, seq_len, size = setting.split(":")
    max_tokens = int(size[1:]) if size.startswith("t") else None
    return benchmark, tokenizer, int(seq_len), 4 if max_tokens else int(size[1:]), max_tokens


def planned_batches(
    benchmark: str,
    tokenizer: str,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None,
    producer: str,
    cross: bool = True,
    min_share: float = CROSS_ROLE_MIN_SHARE,
) -> Iterator[tuple[dict, list[int] | None, dict[int, int], list[int]]]:
    """Every batch of one training epoch as ``fit`` forms and plans them, on the host (the model is never built).

    Args:
        benchmark: a benchmark under ``data/trajectories``.
        tokenizer: ``byte`` or a tokenizer name / directory.
        seq_len: ``max_length``.
        batch_size: examples per batch (the chain limit with ``max_tokens``).
        max_tokens: token-budget batches; ``None``: ``batch_size`` examples.
        producer: ``model.producer`` (``prefix``, ``random``).
        cross: ``data.cross_role_batches``.
        min_share: ``data.cross_role_min_share``.

    Yields:
        ``(batch, producers, plan, split)``: the batch with its host copies, each row's producer as training draws it
        (seed = the step; ``None`` without ``cross``), the absorption plan (``{}`` without ``cross``) and each row's
        shared split.
    """
    from datamodules.role_examples import RoleExampleDataModule
    from lit_modules.multi_lora_module import MultiLoraModule

    roles = list(DEFAULT_ROLES)
    dm = RoleExampleDataModule(
        _data_files(benchmark, roles), roles=roles, tokenizer=tokenizer, max_length=seq_len, batch_size=batch_size,
        val_fraction=0.0, cross_role_batches=cross, cross_role_min_share=min_share, max_tokens=max_tokens,
    )  # fmt: skip
    dm.setup("fit")
    module = MultiLoraModule(
        model_name="tiny-llama", tokenizer_name="byte", roles=roles, val_schemes=[], producer=producer
    )  # the model is never built: the plan needs the host copies and the split only
    module.train_config.lambda_shared = 0.5
    for step, batch in enumerate(dm.train_dataloader()):
        batch = module.on_before_batch_transfer(batch, 0)
        producers, plan = None, {}
        if cross:
            producers = module.host_producers(batch, seed=step)
            plan = module.absorption_plan(batch, producers) or {}
        yield batch, producers, plan, module.shared_split(batch).tolist()


def epoch_batches(
    benchmark: str,
    tokenizer: str,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None,
    producer: str,
    limit: int | None = None,
    cross: bool = True,
    min_share: float = CROSS_ROLE_MIN_SHARE,
) -> list[tuple[list[int], list[int]]]:
    """``(lengths, kept lengths)`` of every batch of one training epoch (:func:`planned_batches`; ``limit``: stop
    after this many batches)."""
    out = []
    for step, (batch, _, plan, _) in enumerate(
        planned_batches(benchmark, tokenizer, seq_len, batch_size, max_tokens, producer, cross, min_share)
    ):
        if limit is not None and step >= limit:
            break
        lengths = batch["lengths"].tolist()
        out.append((lengths, [n for j, n in enumerate(lengths) if j not in plan]))
    return out


# project's epochs, each built once: project passes the ordinary epoch the same producer and share whatever it is
# asked for (neither changes it), so a sweep over producers and shares builds that epoch once. Callers must not modify
# the lists.
_epoch_once = functools.lru_cache(maxsize=4)(epoch_batches)


# the settings a cross-role run must share with the control for a per-token comparison
SAME_SETTING = ("data", "tokenizer", "seq_len", "batch_size", "max_tokens", "model")


def calibrate(folder: Path) -> tuple[StepModel, dict]:
    """Fits the model to ``folder``'s control run and checks it on its cross-role run (see the module docstring)."""
    control = json.loads(next(folder.glob("bench_cross_*_none/bench_train.json")).read_text())
    zero, half = control["rows"]
    shape = shape_of(control)
    lengths = warm_round(zero, control, "step_lengths")
    t_zero, t_half = warm_round(zero, control, "step_seconds"), warm_round(half, control, "step_seconds")
    flops = [padded_flops(shape, x) for x in lengths]
    a, per_flop = fit_line(flops, t_zero)
    plain = [a + per_flop * f for f in flops]
    c = fit_scale(plain, [t - p for t, p in zip(t_half, plain, strict=True)])
    model = StepModel(shape, a, per_flop, c)
    fit_err = max(abs(p - t) / t for p, t in zip(plain, t_zero, strict=True))
    report = {
        "control": str(folder / "bench_cross_*_none"),
        "a_seconds": a,
        "sustained_tflops": 1 / per_flop / 1e12,
        "shared_pass_over_plain": c,
        "lambda0_fit_max_rel_error": fit_err,
        "control_ratios": [t / p for t, p in zip(t_half, t_zero, strict=True)],
        "check": [],
        "vs_control": [],
    }
    for found in sorted(folder.glob("bench_cross_*/bench_train.json")):
        if found.parent.name.endswith("_none"):
            continue  # the control: fitted above
        run = json.loads(found.read_text())
        zero, half = run["rows"]
        warm = run["warmup_steps"]
        batches = epoch_batches(
            run["data"], run["tokenizer"], run["seq_len"], run["batch_size"], run.get("max_tokens"), run["producer"],
            limit=warm + run["steps"], min_share=run.get("cross_role_min_share", 0.0),  # older runs linked every pair
        )[warm:]  # fmt: skip
        measured_absorbed = warm_round(half, run, "step_absorbed") if "step_absorbed" in half else None
        for n, ((lens, kept), got_lens, t0, th) in enumerate(
            zip(
                batches,
                warm_round(zero, run, "step_lengths"),
                warm_round(zero, run, "step_seconds"),
                warm_round(half, run, "step_seconds"),
                strict=True,
            )
        ):
            if lens != got_lens:
                raise ValueError(f"rebuilt batch {lens} differs from the GPU run's {got_lens}: not the same batches")
            if measured_absorbed is not None and len(lens) - len(kept) != measured_absorbed[n]:
                raise ValueError(
                    f"{found.parent.name} batch {n}: the rebuild absorbs {len(lens) - len(kept)} rows, the GPU run "
                    f"{measured_absorbed[n]}: not the same plan"
                )
            report["check"].append(
                {
                    "run": found.parent.name,
                    "lengths": lens,
                    "absorbed": len(lens) - len(kept),
                    "measured_ratio": th / t0,
                    "model_ratio": model.weighted(lens, kept) / model.plain(lens),
                    "measured_weighted_s": th,
                    "model_weighted_s": model.weighted(lens, kept),
                    "saved_share": 1 - model.plain(kept) / model.plain(lens),  # of the plain pass, by the model
                }
            )
        if all(run.get(k) == control.get(k) for k in SAME_SETTING):
            report["vs_control"].append(
                {"run": found.parent.name, **per_token_vs_control(control, run)}  # the folder's README says which
            )  # runs one call made
    return model, report


def per_token_vs_control(control: dict, run: dict, draws: int = 4000, seed: int = 0) -> dict:
    """What a user compares, measured: seconds per token of ``run``'s weighted λ step (cross-role batches) over the
    control's λ 0 step (ordinary batches) of the same setting. The two runs time different batches, so the 95%
    interval resamples each run's batches independently (not paired).

    Returns:
        ``{"ratio", "interval", "lambda0_ratio"}``: the ratio, its bootstrap interval, and the same for the run's own
        λ 0 step (what cross-role batches cost without the λ term).
    """

    def per_batch(result: dict, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = result["rows"][row]
        secs = torch.tensor(warm_round(r, result, "step_seconds"), dtype=torch.float64)
        toks = torch.tensor([sum(x) for x in warm_round(r, result, "step_lengths")], dtype=torch.float64)
        return secs, toks

    c_secs, c_toks = per_batch(control, 0)
    out = {}
    for key, row in (("ratio", 1), ("lambda0_ratio", 0)):
        r_secs, r_toks = per_batch(run, row)
        out[key] = float((r_secs.sum() / r_toks.sum()) / (c_secs.sum() / c_toks.sum()))
        if key == "ratio":
            g = torch.Generator().manual_seed(seed)
            i = torch.randint(0, len(c_secs), (draws, len(c_secs)), generator=g)
            j = torch.randint(0, len(r_secs), (draws, len(r_secs)), generator=g)
            boot = (r_secs[j].sum(1) / r_toks[j].sum(1)) / (c_secs[i].sum(1) / c_toks[i].sum(1))
            out["interval"] = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return out


def spread(ratios_parts: list[tuple[float, float]], n: int, draws: int = 4000, seed: int = 0) -> list[float]:
    """5th, 50th and 95th percentiles of ``Σ weighted / Σ plain`` over ``n`` batches drawn at random."""
    num = torch.tensor([w for w, _ in ratios_parts], dtype=torch.float64)
    den = torch.tensor([p for _, p in ratios_parts], dtype=torch.float64)
    idx = torch.randint(0, len(num), (draws, n), generator=torch.Generator().manual_seed(seed))
    r = num[idx].sum(1) / den[idx].sum(1)
    return torch.quantile(r, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()


def project(
    model: StepModel, setting: str, producer: str, bench: tuple[int, int] = (2, 20),
    min_share: float = CROSS_ROLE_MIN_SHARE,
) -> dict:  # fmt: skip
    """``setting`` = ``benchmark:tokenizer:seq_len:b<batch>`` or ``...:t<max_tokens>``; ``bench`` = ``(warm-up
    steps, timed steps)`` of a ``bench train`` run: the ratio over the batches that run would time (the epoch's
    batches ``[w, w + n)``, the same batches: ``tests/test_cross_role_cost_model.py``) is reported beside the epoch's,
    since a run times the first batches, not the epoch's average."""
    warm, steps = bench
    benchmark, tokenizer, seq_len, batch_size, max_tokens = parse_setting(setting)
    out = {"setting": setting, "producer": producer, "min_share": min_share}
    ordinary_plain = 0.0
    for cross in (False, True):
        batches = _epoch_once(
            benchmark, tokenizer, seq_len, batch_size, max_tokens, producer if cross else "random", cross=cross,
            min_share=min_share if cross else 0.0,
        )  # fmt: skip
        parts = [(model.weighted(lens, kept), model.plain(lens)) for lens, kept in batches]
        timed_range = slice(warm, warm + steps)  # one range for the lengths and the ratio below
        timed_batches, timed = batches[timed_range], parts[timed_range]
        key = "cross_role" if cross else "ordinary"
        out[key] = {
            "batches": len(batches),
            "rows": sum(len(x) for x, _ in batches),
            "absorbed_rows": sum(len(x) - len(k) for x, k in batches),
            "batches_with_absorption": sum(len(x) != len(k) for x, k in batches),
            "epoch_ratio": sum(w for w, _ in parts) / sum(p for _, p in parts),
            "epoch_plain_hours": sum(p for _, p in parts) / 3600,
            "ratio_of_n_batches_p5_p50_p95": {n: spread(parts, n) for n in (6, 16, 32, 64)},
            "bench_warmup_steps": warm,
            "bench_lengths": [lens for lens, _ in timed_batches],
            "bench_absorbed": [len(lens) - len(kept) for lens, kept in timed_batches],
            "bench_ratio": sum(w for w, _ in timed) / sum(p for _, p in timed) if timed else None,
        }
        if not cross:
            ordinary_plain = sum(p for _, p in parts)
        else:  # what a user compares: an epoch at λ 0.5 on these batches against one at λ 0 on ordinary batches (the
            # same examples; cross-role batches pad more, which a λ 0 run would not choose)
            out[key]["epoch_vs_ordinary_lambda0"] = sum(w for w, _ in parts) / ordinary_plain
            out[key]["lambda0_epoch_vs_ordinary"] = sum(p for _, p in parts) / ordinary_plain
    return out


def render(report: dict, plot_name: str = "cost_model.png") -> str:
    cal = report["calibration"]
    lines = [
        "# The weighted λ step over a whole epoch: a model fitted to GPU steps (a projection, not a measurement)",
        "",
        f"Calibration: `{cal['control']}` (warm round). A λ 0 step takes {cal['a_seconds'] * 1e3:.1f} ms + padded "
        f"FLOPs at {cal['sustained_tflops']:.1f} TFLOP/s (largest error {100 * cal['lambda0_fit_max_rel_error']:.1f}%"
        f"); the shared pass costs {cal['shared_pass_over_plain']:.3f}× a plain pass.",
        "",
        "Check on the cross-role run's batches (not fitted; absorbed rows rebuilt on the CPU with the bench's seeds; "
        f"plotted in `{plot_name}`):",
        "",
        "| run | batch lengths | absorbed | measured ratio | model ratio |",
        "| :--- | :--- | ---: | ---: | ---: |",
    ]
    for c in cal["check"]:
        lines.append(
            f"| {c.get('run', '')} | {c['lengths']} | {c['absorbed']} | {c['measured_ratio']:.3f} | "
            f"{c['model_ratio']:.3f} |"
        )
    if cal.get("vs_control"):
        lines += [
            "",
            "Measured, not modelled: seconds per token of each cross-role run's λ 0.5 step against the control's λ 0 "
            "step (ordinary batches, the same setting, from the same folder: its README says which runs one call "
            "made; 95% interval resampling each run's batches independently), and of its λ 0 step:",
            "",
            "| run | λ 0.5 cross-role / λ 0 ordinary | 95% interval | λ 0 cross-role / λ 0 ordinary |",
            "| :--- | ---: | :--- | ---: |",
        ]
        for v in cal["vs_control"]:
            lo, hi = v["interval"]
            lines.append(f"| {v['run']} | {v['ratio']:.3f} | {lo:.3f}–{hi:.3f} | {v['lambda0_ratio']:.3f} |")
    lines += [
        "",
        "Projected over one epoch (`bench train`'s and `fit`'s batches; ratio = Σ weighted λ step / Σ λ 0 step):",
        "",
        "| setting | producer | min share | batches | absorbed rows / rows | ordinary batches | cross-role batches | "
        "16 random cross-role batches (5–95%) | `bench train`'s timed batches (absorbed / rows): ratio | "
        "λ 0.5 cross-role epoch / λ 0 ordinary epoch (its λ 0 epoch / ordinary) |",
        "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | :--- | :--- |",
    ]
    for p in report["projections"]:
        o, x = p["ordinary"], p["cross_role"]
        spread16 = x["ratio_of_n_batches_p5_p50_p95"]
        lo, _, hi = spread16[16] if 16 in spread16 else spread16["16"]  # int keys come back as str from JSON
        user = "–"
        if "epoch_vs_ordinary_lambda0" in x:
            user = f"{x['epoch_vs_ordinary_lambda0']:.3f} ({x['lambda0_epoch_vs_ordinary']:.3f})"
        bench = "–"
        if x.get("bench_ratio") is not None:
            bench = (
                f"{len(x['bench_lengths'])} after {x['bench_warmup_steps']} warm-up "
                f"({sum(x['bench_absorbed'])} / {sum(map(len, x['bench_lengths']))}): {x['bench_ratio']:.3f}"
            )
        lines.append(
            f"| {p['setting']} | {p['producer']} | {p.get('min_share', 0.0)} | {x['batches']} | "
            f"{x['absorbed_rows']} / {x['rows']} | "
            f"{o['epoch_ratio']:.3f} | **{x['epoch_ratio']:.3f}** | {lo:.3f}–{hi:.3f} | {bench} | {user} |"
        )
    prov = report["provenance"]
    lines += [
        "",
        "---",
        f"Produced on {prov['device']['name']}, commit {prov['git_commit']}"
        + (" (uncommitted changes)" if prov.get("git_dirty") else "")
        + f", {prov['utc']}; torch {prov['versions']['torch']}. Command: `{prov['command']}`",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Each timed batch's λ 0.5 / λ 0 against the share of its plain pass that absorption saved, with the model's
    line ``1 + c - share`` and the projected epochs' ratios beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal = report["calibration"]
    c = cal["shared_pass_over_plain"]
    shares = sorted({p.get("min_share", 0.0) for p in report["projections"]})
    if len(shares) > 1:  # a sweep: a second panel shows each setting's epochs against the share
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot([0, 0.75], [1 + c, 1 + c - 0.75], color="0.4", lw=1, label=f"model: 1 + {c:.3f} − saved share")
    ax.axhline(2.0, color="tab:red", lw=0.8, ls="--", label="2× a λ 0 step")
    ax.scatter([0] * len(cal["control_ratios"]), cal["control_ratios"], marker="x", color="0.3",
               label="ordinary batches (the fit's)")  # fmt: skip
    check = cal["check"]
    ax.scatter([x["saved_share"] for x in check], [x["measured_ratio"] for x in check], color="tab:blue", zorder=3,
               label="cross-role batches, measured (not fitted)")  # fmt: skip
    for i, proj in enumerate(sorted(report["projections"], key=lambda p: p["cross_role"]["epoch_ratio"])):
        share = 1 + c - proj["cross_role"]["epoch_ratio"]
        ax.scatter([share], [proj["cross_role"]["epoch_ratio"]], marker="D", s=18, color="tab:green", zorder=2)
        ax.annotate(
            f"{proj['setting']} {proj['producer']}" + (f" share {proj['min_share']}" if len(shares) > 1 else ""),
            (share, proj["cross_role"]["epoch_ratio"]),
            fontsize=6,
            xytext=(6, 3) if i % 2 else (-6, -9),
            ha="left" if i % 2 else "right",
            textcoords="offset points",
            color="tab:green",
        )  # labels alternate sides: neighbouring epochs sit close
    ax.scatter([], [], marker="D", s=18, color="tab:green", label="whole epochs, projected")
    ax.set_xlabel("share of the batch's plain pass scored in the shared pass instead (by the model)")
    ax.set_ylabel("weighted λ 0.5 step / λ 0 step")
    ax.set_title("The λ term's cost on cross-role batches (8B shapes, one H100, checkpointing on)", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    if len(shares) > 1:
        lines: dict[tuple[str, str], list[dict]] = {}
        for proj in report["projections"]:
            lines.setdefault((proj["setting"], proj["producer"]), []).append(proj)
        for n, ((setting, producer), projs) in enumerate(sorted(lines.items())):
            projs.sort(key=lambda p: p.get("min_share", 0.0))
            x = [p.get("min_share", 0.0) for p in projs]
            color = f"C{n}"
            ax2.plot(x, [p["cross_role"]["epoch_vs_ordinary_lambda0"] for p in projs], "o-", color=color,
                     label=f"{setting} {producer}: against a λ 0 epoch of ordinary batches")  # fmt: skip
            ax2.plot(x, [p["cross_role"]["epoch_ratio"] for p in projs], "o--", color=color, alpha=0.6,
                     label=f"{setting} {producer}: against λ 0 on the same batches")  # fmt: skip
        ax2.axhline(2.0, color="tab:red", lw=0.8, ls="--")
        ax2.set_xlabel("data.cross_role_min_share")
        ax2.set_ylabel("λ 0.5 epoch / λ 0 epoch (projected)")
        ax2.set_title("Whole epochs against the chains' min share", fontsize=9)
        ax2.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibration", required=True, help="a gpu_lambda_cost.sh output folder with bench_cross_*_none/")
    ap.add_argument(
        "--settings",
        nargs="+",
        default=[
            "hotpotqa:byte:4096:b4",
            "hotpotqa:byte:2048:b4",
            "hotpotqa:.tok:4096:t16384",
            "scienceqa:byte:4096:b4",
            "scienceqa:.tok:4096:t16384",
        ],
        help="benchmark:tokenizer:seq_len:b<batch size> or :t<max_tokens>",
    )
    ap.add_argument("--producers", nargs="+", default=["prefix", "random"])
    ap.add_argument(
        "--min_shares", type=float, nargs="+", default=[CROSS_ROLE_MIN_SHARE],
        help="data.cross_role_min_share values to project (each setting and producer at each)",
    )  # fmt: skip
    ap.add_argument(
        "--bench", type=int, nargs=2, default=[2, 20], metavar=("WARMUP", "STEPS"),
        help="also the ratio over the batches `bench train --warmup_steps WARMUP --steps STEPS` times",
    )  # fmt: skip
    ap.add_argument("--out", default="results/prefix_reuse/cost_model")
    args = ap.parse_args(argv)
    model, cal = calibrate(Path(args.calibration))
    print(json.dumps({k: v for k, v in cal.items() if k != "check"}, indent=1))
    for c in cal["check"]:
        print(f"check: {c['absorbed']} absorbed, measured {c['measured_ratio']:.3f}, model {c['model_ratio']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"calibration": cal, "projections": [], "provenance": provenance(device="cpu")}
    for setting in args.settings:
        for producer in args.producers:
            for share in args.min_shares:
                report["projections"].append(project(model, setting, producer, tuple(args.bench), share))
                p = report["projections"][-1]
                print(
                    f"{setting} {producer} min share {share}: ordinary {p['ordinary']['epoch_ratio']:.3f}, "
                    f"cross-role {p['cross_role']['epoch_ratio']:.3f}, against an ordinary λ 0 epoch "
                    f"{p['cross_role']['epoch_vs_ordinary_lambda0']:.3f}",
                    flush=True,
                )
                out.with_suffix(".json").write_text(json.dumps(report, indent=1))  # written as it goes
    out.with_suffix(".md").write_text(render(report, out.with_suffix(".png").name))
    plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
