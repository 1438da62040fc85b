"""The study's results pages (:mod:`eval_suite.study.report`) cell by cell: the recipe sweep's entries and table, the
λ / every-row / fidelity / chance tables of both benchmarks, the zero-shot reference lines, the HTML page and the
λ figure's plotted points, each from small job outputs written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_suite.scoring.paired import bootstrap_mean_interval
from eval_suite.study import report
from eval_suite.study.jobs import Job

SAMPLED = {"sampler": 2}  # today's sampler: a finished row
COMMON = {"level": "1-4", "row": "non_shared", "scheme": "non_shared", "adapters": "a", "steps": 3, "num_tokens": 100,
          "protocol": {"temperature": 0.9, "top_p": 0.75, "constraints": []}, "roles": {}}  # fmt: skip


@pytest.fixture(autouse=True)
def figures_not_drawn(monkeypatch) -> dict:
    """The figures are built but neither laid out nor rendered to PNG (the slow part; test_study writes them):
    ``{path: figure}`` of each one ``plot`` would save."""
    import matplotlib.figure

    figs: dict = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout", lambda self: None)
    monkeypatch.setattr(report, "save_figure", lambda fig, path, dpi: figs.setdefault(path, (fig, dpi))[0])
    return figs


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _episodes(path: Path, recs: list[dict]) -> None:
    _write(path / "episodes.jsonl", "".join(json.dumps(r) + "\n" for r in recs))


def _hq(qid: str, run: int, em: float, f1: float, oof: bool = False) -> dict:
    return {**COMMON, "benchmark": "hotpotqa", "level": "easy", "qid": qid, "run": run, "em": em, "f1": f1, "oof": oof,
            "prediction": None if oof else ("x" if em else "y"), "gold": "x"}  # fmt: skip


def _sq(qid: str, run: int, correct: bool, prediction: str | None = "", n: int = 3, oof: bool = False) -> dict:
    """A ScienceQA episode; its answer is the gold letter A when right, B when wrong, unless ``prediction`` given."""
    answer = ("A" if correct else "B") if prediction == "" else prediction
    return {**COMMON, "benchmark": "scienceqa", "qid": qid, "run": run, "correct": float(correct), "gold": 0,
            "prediction": answer, "choices": [f"c{i}" for i in range(n)], "oof": oof}  # fmt: skip


def _sweep_job(name: str, bench: str, recipe: dict | None, runs: int = 2) -> Job:
    meta = {"set": name, "benchmark": bench, "runs": runs, "row": "non_shared", "scheme": "non_shared"}
    if recipe is not None:
        meta["recipe"] = recipe
    return Job(f"eval/{name}/non_shared", "eval", [], f"eval/{name}/non_shared/summary.json", meta=meta)


def _done(root: Path, job: Job, runs: int) -> None:
    summary = {"episodes": {"non_shared": {str(r): 3 for r in range(runs)}}, "protocol": {"non_shared": SAMPLED}}
    _write(root / job.done_file, json.dumps(summary))


def _sweep_root(root: Path) -> list[Job]:
    """Four points: hq_a (HotpotQA, finished, the shipped one), hq_b (HotpotQA, unfinished, no training status,
    no adapters), sq_c (ScienceQA, no recipe, a status of resumes only), hq_e (not started: no episodes)."""
    plan = [
        _sweep_job("hq_a", "hotpotqa", {"lr": 1e-4, "epochs": 2, "targets": "qv", "rank": 8}),
        _sweep_job("hq_b", "hotpotqa", {"lr": 3e-4, "epochs": 4, "targets": "qkvo", "rank": 16}),
        _sweep_job("sq_c", "scienceqa", None, runs=1),
        Job("train/hq_a", "train", [], "train/hq_a/adapters/x", meta={"set": "hq_a"}),  # not an eval: no entry
        _sweep_job("hq_e", "hotpotqa", {}),
    ]
    # hq_a, runs 0 and 1: em per question 3/4, 1/2, 1/4 (f1 1, 3/4, 1/4); q2's run 1 out of format
    a = [_hq("q0", 0, 1, 1), _hq("q0", 1, 0.5, 1), _hq("q1", 0, 1, 1), _hq("q1", 1, 0, 0.5), _hq("q2", 0, 0.5, 0.5),
         _hq("q2", 1, 0, 0, oof=True)]  # fmt: skip
    _episodes(root / "eval/hq_a/non_shared", a)
    _done(root, plan[0], 2)
    # hq_b: right on q0 and q1 in both runs (paired to hq_a: +1/4 and +1/2 per question)
    b = [_hq("q0", 0, 1, 1), _hq("q0", 1, 1, 1), _hq("q1", 0, 1, 1), _hq("q1", 1, 1, 1)]
    _episodes(root / "eval/hq_b/non_shared", b)
    # older copies of hq_b's row: sampler1 right on 1 of 4, sampler2 on 3 of 4; a copy without episodes is left out
    _episodes(root / "eval/hq_b/non_shared.sampler1", [_hq(f"q{q}", 0, q == 0, 0) for q in range(4)])
    _episodes(root / "eval/hq_b/non_shared.sampler2", [_hq(f"q{q}", 0, q < 3, 0) for q in range(4)])
    _write(root / "eval/hq_b/non_shared.sampler3/episodes.jsonl", "")
    # sq_c: one run, right on q0 and q1 of three, one answer not a letter, one OOF
    c = [_sq("q0", 0, True), _sq("q1", 0, True, prediction="Z"), _sq("q2", 0, False, prediction=None, oof=True)]
    _episodes(root / "eval/sq_c/non_shared", c)
    _done(root, plan[2], 1)
    # training outputs: hq_a trained three times (the last one and its resume count), validation every epoch
    _write(root / "train/hq_a/csv/version_0/metrics.csv", "epoch,step,val/loss,train/loss\n0,5,1.5,\n0,6,,1.2\n"
           "1,10,1.25,\n2,15,0.875,\n2,16,,0.5\n")  # fmt: skip
    status = [
        {"start_step": 0, "train_s": 100.0},
        {"start_step": 0, "train_s": 40.0},
        {"start_step": 0, "train_s": 10.0},
        {"start_step": 7, "train_s": 2.26},
    ]
    _write(root / "train/hq_a/fit_status.jsonl", "".join(json.dumps(s) + "\n" for s in status))
    _write(root / "train/hq_a/adapters/lragent_adapters.safetensors", "w" * 1_000_000)
    _write(root / "train/hq_a/adapters/plan/adapter_model.safetensors", "w" * 235_000)  # nested: counted
    _write(root / "train/hq_a/adapters/adapter_config.json", "c" * 500_000)  # not weights
    # sq_c: resumes only (no record starts at step 0): every record counts; a missing time counts 0
    _write(root / "train/sq_c/fit_status.jsonl", json.dumps({"start_step": 3, "train_s": 5.0}) + "\n"
           + json.dumps({"start_step": 9, "train_s": None}) + "\n")  # fmt: skip
    return plan


def test_sweep_entries_carry_each_points_recipe_training_and_episodes(tmp_path: Path) -> None:
    """Per recipe point: its recipe, finished or not, episodes and runs, the last validation loss, the time of the
    training whose weights were evaluated, the adapters' weight size, OOF, the headline score (and F1 / letter
    validity) as a mean over questions with its bootstrap interval, the older draws of its row and the paired
    difference to the shipped point; a point without episodes has none of these."""
    root = tmp_path / "sweep"
    plan = _sweep_root(root)
    a, b, c, e = report.collect_sweep(root, plan, {"hotpotqa": "hq_a"})
    assert [x["set"] for x in (a, b, c, e)] == ["hq_a", "hq_b", "sq_c", "hq_e"]
    assert (a["benchmark"], c["benchmark"]) == ("hotpotqa", "scienceqa")
    assert a["recipe"] == {"lr": 1e-4, "epochs": 2, "targets": "qv", "rank": 8} and c["recipe"] == {}
    assert (a["done"], b["done"], c["done"], e["done"]) == (True, False, True, False)
    assert (a["episodes"], a["runs"], b["episodes"], b["runs"], c["episodes"], c["runs"]) == (6, 2, 4, 2, 3, 1)
    assert (a["val_loss"], b["val_loss"], c["val_loss"]) == (0.875, None, None)
    assert (a["train_s"], b["train_s"], c["train_s"]) == (12.3, None, 5.0)
    assert (a["adapters_mb"], b["adapters_mb"], c["adapters_mb"]) == (1.24, None, None)  # 1.235 MB of weights
    assert a["oof"] == pytest.approx(1 / 6) and b["oof"] == 0.0 and c["oof"] == pytest.approx(1 / 3)
    assert a["em"] == bootstrap_mean_interval([0.75, 0.5, 0.25]) and a["em"][0] == pytest.approx(0.5)
    assert a["f1"] == bootstrap_mean_interval([1.0, 0.75, 0.25])
    assert b["em"] == bootstrap_mean_interval([1.0, 1.0]) and "accuracy" not in a and "valid" not in a
    assert c["accuracy"] == bootstrap_mean_interval([1.0, 1.0, 0.0])
    assert c["valid"] == 0.5 and "em" not in c and "f1" not in c  # q1's "Z" is not a letter; the OOF one not asked
    assert a["earlier"] == [] and c["earlier"] == []
    assert b["earlier"] == [{"copy": "non_shared.sampler1", "episodes": 4, "mean": 0.25},
                            {"copy": "non_shared.sampler2", "episodes": 4, "mean": 0.75}]  # fmt: skip
    # hq_b against hq_a on q0 and q1, runs 0 and 1: per question +1/4 and +1/2; the shipped point has none
    assert a["vs_reference"] is None and c["vs_reference"] is None
    assert b["vs_reference"]["mean"] == pytest.approx(0.375) and b["vs_reference"]["questions"] == 2
    assert b["vs_reference"]["pairs"] == 4
    assert e == {"set": "hq_e", "benchmark": "hotpotqa", "recipe": {}, "done": False, "episodes": 0, "runs": 0,
                 "val_loss": None, "train_s": None, "adapters_mb": None, "oof": None, "em": None, "f1": None,
                 "earlier": [], "vs_reference": None}  # fmt: skip


def test_sweep_page_rows_of_both_benchmarks(tmp_path: Path) -> None:
    """``sweep.md``: the explanation, then per benchmark (ScienceQA first) the zero-shot line and one row per point,
    every cell formatted (an unfinished point marked, "–" where nothing is known); ``sweep.json`` holds the entries
    and the command; writing again into the same (nested) folder works."""
    root = tmp_path / "sweep"
    plan = _sweep_root(root)
    probe = {"em": {"mean": 46.7, "low": 36.7, "high": 56.7}, "f1": {"mean": 51.8}, "questions": 90}
    _write(root / "probe/hotpotqa/summary.json", json.dumps(probe))
    out = tmp_path / "pages" / "sweep"
    report.write_sweep_report(root, plan, out, {"hotpotqa": "hq_a"})
    entries = report.write_sweep_report(root, plan, out, {"hotpotqa": "hq_a"})
    md = (out / "sweep.md").read_text()
    em_a, em_b, acc_c = entries[0]["em"], entries[1]["em"], entries[2]["accuracy"]
    assert (round(em_a[1], 2), round(em_a[2], 2)) == (0.25, 0.75)  # an interval inside (0, 1)
    d = entries[1]["vs_reference"]
    assert d["ci95"] == [0.25, 0.5]
    assert md.split("\n## ")[1:] == [
        "scienceqa\n\n| Set | lr | epochs | targets | rank | val loss | Accuracy % [95% CI] | Δ to shipped recipe "
        "[95% CI] | Earlier draw | Valid % | OOF % | Episodes | Train s | MB |\n"
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        f"| sq_c | 0 |  |  |  | – | {100 * acc_c[0]:.1f} [{100 * acc_c[1]:.1f}, {100 * acc_c[2]:.1f}] | – | – "
        "| 50.0 | 33.3 | 3 | 5 | – |\n",
        "hotpotqa\n\nZero-shot reference (base model given the ten context paragraphs, greedy short answer): EM 46.7 "
        "[36.7, 56.7], F1 51.8, 90 questions.\n\n"
        "| Set | lr | epochs | targets | rank | val loss | EM % [95% CI] | Δ to shipped recipe [95% CI] | Earlier draw "
        "| F1 % | OOF % | Episodes | Train s | MB |\n"
        "| :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        "| hq_a | 0.0001 | 2 | qv | 8 | 0.875 | 50.0 [25.0, 75.0] | – | – | 66.7 | 16.7 | 6 | 12 | 1.2 |\n"
        f"| hq_b (unfinished) | 0.0003 | 4 | qkvo | 16 | – | 100.0 [{100 * em_b[1]:.1f}, {100 * em_b[2]:.1f}] | "
        "+37.5 [+25.0, +50.0] | 25.0, 75.0 | 100.0 | 0.0 | 4 | – | – |\n"
        "| hq_e (unfinished) | 0 |  |  |  | – | – | – | – | – | – | 0 | – | – |\n"
        "\n---\n" + md.split("\n---\n")[1],
    ]  # fmt: skip
    assert md.startswith(
        "# Recipe sweep: dev episodes per training recipe\n\nEach point trains one shared-A λ = 0 adapter set from the "
        "bundled trajectories and runs its agents on the 90 dev questions under `non_shared` (sampling as the "
        "evaluation protocol). The interval is a 95% bootstrap over questions (each question's mean over runs); "
        "`val loss` is the last epoch's plain validation loss on held-out role examples. `Δ to shipped recipe` is the "
        "paired difference to the point whose recipe the shipped sets use (same questions, same sampling seeds), with "
        "its 95% bootstrap interval over questions. `Earlier draw` is the same recipe trained and run once before (the "
        "row's older copy, kept when it ran again under a newer sampler): the gap between two draws of one recipe is "
        "the noise that a one-run point is read against. `Train s` is the training's wall time on a GPU that other "
        "jobs shared (not a speed figure); `MB` the adapters' weights, where the root keeps them.\n\n## scienceqa\n"
    )
    page = json.loads((out / "sweep.json").read_text())
    assert page["points"] == json.loads(json.dumps(entries))
    command = f"python -m eval_suite.study.driver report --stage sweep --root {root} --out {out}"
    assert page["provenance"]["command"] == command and md.rstrip().endswith(f"{command}`")


def _meta(bench: str, name: str, lam: float | None, term: str = "base_lr_shared", shared_a: bool = True, **kw) -> dict:
    return {"benchmark": bench, "set": name, "lambda": lam, "train_scheme": term, "shared_a": shared_a, "data": {},
            **kw}  # fmt: skip


def _eval_job(meta: dict, scheme: str, runs: int, row: str | None = None) -> Job:
    name = f"eval/{meta['set']}/{scheme}"
    return Job(name, "eval", [], f"{name}/summary.json", meta={**meta, "scheme": scheme, "runs": runs,
                                                               "row": row or scheme})  # fmt: skip


def _row(root: Path, job: Job, recs: list[dict]) -> None:
    """A finished evaluation row: its episodes and a summary with every run."""
    row = job.meta["row"]
    _episodes(root / job.name, [{**r, "row": row, "scheme": job.meta["scheme"]} for r in recs])
    runs = {str(r["run"]) for r in recs}
    _write(root / job.done_file, json.dumps({"episodes": {row: dict.fromkeys(runs, 1)}, "protocol": {row: SAMPLED}}))


def _study_root(root: Path) -> list[Job]:
    """ScienceQA: sq_lam0 (2 runs, its fidelity done), sq_lam0.5_full (λ 0.5 with the full_shared term, one run, its
    base_lr_shared row missing), sq_indepA (independent A) and sq_untrained; HotpotQA: hq_lam0 (2 runs, a fidelity
    with one scheme)."""
    sq0 = _meta("scienceqa", "sq_lam0", 0.0)
    sq5 = _meta("scienceqa", "sq_lam0.5_full", 0.5, "full_shared")
    ind = {**_meta("scienceqa", "sq_indepA", 0.0, shared_a=False), "data": {"answer_thoughts": True}}
    unt = _meta("scienceqa", "sq_untrained", None, "")
    hq0 = _meta("hotpotqa", "hq_lam0", 0.0)
    plan = [  # HotpotQA first: a set without a chance gap comes before ScienceQA's
        *(_eval_job(hq0, s, 2) for s in ("non_shared", "base_lr_shared", "full_shared", "base_shared")),
        Job("fidelity/hq_lam0", "fidelity", [], "fidelity/hq_lam0/fidelity.json", meta=hq0),
        Job("probe/scienceqa", "probe", [], "probe/scienceqa/summary.json", meta={"benchmark": "scienceqa"}),
        Job("train/sq_lam0", "train", [], "train/sq_lam0/adapters/w.safetensors", meta=sq0),
        *(_eval_job(sq0, s, 2) for s in ("non_shared", "base_lr_shared", "full_shared")),
        Job("fidelity/sq_lam0", "fidelity", [], "fidelity/sq_lam0/fidelity.json", meta=sq0),
        *(_eval_job(sq5, s, 1) for s in ("non_shared", "base_lr_shared", "full_shared")),
        Job("fidelity/sq_lam0.5_full", "fidelity", [], "fidelity/sq_lam0.5_full/fidelity.json", meta=sq5),
        Job("train/sq_lam0.5_full", "train", [], "train/sq_lam0.5_full/adapters/w.safetensors", meta=sq5),  # not done
        _eval_job(ind, "non_shared", 2),
        _eval_job(unt, "non_shared", 2, row="untrained"),
    ]
    jobs = {j.name: j for j in plan}
    # sq_lam0, 4 questions of 2 options, 2 runs: non_shared right on q0-q2 (q3 in run 0 only);
    # base_lr_shared right on q0, q1; full_shared right on q0 only, one OOF and one non-letter answer
    ns = [_sq(f"q{q}", r, q < 3 or r == 0, n=2) for q in range(4) for r in range(2)]
    blr = [_sq(f"q{q}", r, q < 2, n=2) for q in range(4) for r in range(2)]
    full = [_sq(f"q{q}", r, q == 0, n=2) for q in range(4) for r in range(2)]
    full[7].update(oof=True, prediction=None)
    full[6]["prediction"] = "Q"
    _row(root, jobs["eval/sq_lam0/non_shared"], ns)
    _row(root, jobs["eval/sq_lam0/base_lr_shared"], blr)
    _row(root, jobs["eval/sq_lam0/full_shared"], full)
    schemes = {"base_lr_shared": {"overall": {"kl": 0.0123, "top1": 0.987, "examples": 7, "tokens": 70}},
               "full_shared": {"overall": {"kl": 0.25, "top1": 0.5, "examples": 7, "tokens": 70}},
               "droidspeak": {"overall": {"kl": 0.125, "top1": 0.75, "examples": 7, "tokens": 70}}}  # fmt: skip
    _write(root / "fidelity/sq_lam0/fidelity.json", json.dumps({"schemes": schemes, "examples": [{"kl": 1}]}))
    # sq_lam0.5_full, one run: non_shared right on q0 (chance 1/3 with 3 options), full_shared on q0 and q1
    _row(root, jobs["eval/sq_lam0.5_full/non_shared"], [_sq(f"q{q}", 0, q == 0, n=3) for q in range(3)])
    _row(root, jobs["eval/sq_lam0.5_full/full_shared"], [_sq(f"q{q}", 0, q < 2, n=3) for q in range(3)])
    # sq_indepA: wrong everywhere (4 options): below chance; sq_untrained right on half of 2-option questions
    _row(root, jobs["eval/sq_indepA/non_shared"], [_sq(f"q{q}", r, False, n=4) for q in range(4) for r in range(2)])
    _row(root, jobs["eval/sq_untrained/non_shared"], [_sq(f"q{q}", r, q % 2 == 0, n=2) for q in range(4)
                                                        for r in range(2)])  # fmt: skip
    # hq_lam0: em per question 1, 1/2, 0 under non_shared, 0 everywhere under base_lr_shared; full_shared unfinished
    hq = [_hq(f"q{q}", r, float(q == 0 or (q == 1 and r == 0)), 0.5) for q in range(3) for r in range(2)]
    _row(root, jobs["eval/hq_lam0/non_shared"], hq)
    _row(root, jobs["eval/hq_lam0/base_lr_shared"], [_hq(f"q{q}", r, 0.0, 0.0) for q in range(3) for r in range(2)])
    for row, n in (("full_shared", 1), ("base_shared", 2)):  # unfinished rows
        _episodes(
            root / f"eval/hq_lam0/{row}", [{**_hq(f"q{q}", 0, 1, 1), "row": row, "scheme": row} for q in range(n)]
        )
    unfinished = [{**_sq("q0", 0, True), "row": "base_lr_shared", "scheme": "base_lr_shared"}]
    _episodes(root / "eval/sq_lam0.5_full/base_lr_shared", unfinished)
    hq_fid = {"schemes": {"full_shared": {"overall": {"kl": 1.5, "top1": 0.25, "examples": 3, "tokens": 9}},
                          "base_shared": {}}}  # fmt: skip
    _write(root / "fidelity/hq_lam0/fidelity.json", json.dumps(hq_fid))
    _write(root / "train/sq_lam0/adapters/w.safetensors", "w")  # sq_lam0's training done, with its status
    status = [{"start_step": 0}, {"start_step": 5}, {"start_step": 9, "stopped": "max_epochs"}]
    _write(root / "train/sq_lam0/fit_status.jsonl", "".join(json.dumps(x) + "\n" for x in status))
    probe = {"correct": {"mean": 61.1, "low": 51.1, "high": 71.1}, "chance": 41.1, "questions": 90}
    _write(root / "probe/scienceqa/summary.json", json.dumps(probe))
    return plan


@pytest.fixture(scope="module")
def study_page(tmp_path_factory) -> tuple[Path, Path, dict]:
    """The study root of :func:`_study_root`, its page written once (figures not drawn): ``(root, out, data)``."""
    import matplotlib.figure

    tmp = tmp_path_factory.mktemp("study_page")
    root, out = tmp / "study", tmp / "pages" / "out"  # nested: the folders are made
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.figure.Figure, "tight_layout", lambda self: None)
        mp.setattr(report, "save_figure", lambda fig, path, dpi: None)
        data = report.write_report(root, _study_root(root), out)
    return root, out, data


def test_study_page_tables_of_both_benchmarks(study_page) -> None:
    """``study.md``: per benchmark (ScienceQA first) the λ table (shared-A sets in λ order: non_shared mean ± std or
    the one run's value, the paired Δ of base_lr_shared and full_shared with their intervals, OOF, letter validity on
    ScienceQA only, KL and top-1 of the fidelity, runs and what is missing), every row of every set, the fidelity
    table, the chance table with its three verdicts (ScienceQA only), the figure, and the list of what is missing;
    ``study.json``: each set's metadata, summary, chance gap, fidelity without its per-example records, missing rows
    and training status, as returned; ``study.html``: the same tables. One test for the one page written: mutation
    testing traces the module-scoped write to the first test that uses it only."""
    root, out, data = study_page
    md = (out / "study.md").read_text()
    lines = md.splitlines()
    assert [x for x in lines if x.startswith(("| sq", "| hq", "## ", "![", "- "))] == [
        "## scienceqa: λ study (shared A)",
        "| sq_lam0 | 0 (—) | 87.5 ± 17.7 | -37.5 [-75.0, +0.0] | -62.5 [-100.0, -25.0] | 0.0 / 0.0 / 12.5 "
        "| 100.0 / 100.0 / 85.7 | 0.012 / 0.250 | 98.7 / 50.0 | 2 |",
        "| sq_lam0.5_full | 0.5 (full_shared) | 33.3 | – | +33.3 [+0.0, +100.0] | 0.0 / – / 0.0 | 100.0 / – / 100.0 "
        "| – / – | – / – | 1 (missing: base_lr_shared, fidelity) |",
        "## scienceqa: every row",
        "| sq_lam0 | non_shared | 87.5 ± 17.7 | [-71.3, 246.3] | – | 0.0 ± 0.0 | 2 | 8 |",
        "| sq_lam0 | base_lr_shared | 50.0 ± 0.0 | [50.0, 50.0] | -37.5 [-75.0, +0.0] | 0.0 ± 0.0 | 2 | 8 |",
        "| sq_lam0 | full_shared | 25.0 ± 0.0 | [25.0, 25.0] | -62.5 [-100.0, -25.0] | 12.5 ± 17.7 | 2 | 8 |",
        "| sq_lam0.5_full | non_shared | 33.3 | – | – | 0.0 | 1 | 3 |",
        "| sq_lam0.5_full | full_shared | 66.7 | – | +33.3 [+0.0, +100.0] | 0.0 | 1 | 3 |",
        "| sq_indepA | non_shared | 0.0 ± 0.0 | [0.0, 0.0] | – | 0.0 ± 0.0 | 2 | 8 |",
        "| sq_untrained | untrained | 50.0 ± 0.0 | [50.0, 50.0] | – | 0.0 ± 0.0 | 2 | 8 |",
        "## scienceqa: teacher-forced fidelity to non_shared (every set)",
        "| sq_lam0 | 0.012 | 0.250 | – | 0.125 | 98.7 | 50.0 | – | 75.0 | 7 (70) |",
        "## scienceqa: non_shared against the chance rate",
        "| sq_lam0 | 50.0 | +37.5 [+12.5, +50.0] | above chance | 4 |",
        "| sq_lam0.5_full | 33.3 | +0.0 [-33.3, +66.7] | not distinguishable from chance | 3 |",
        "| sq_indepA | 25.0 | -25.0 [-25.0, -25.0] | below chance | 4 |",
        "| sq_untrained | 50.0 | +0.0 [-50.0, +50.0] | not distinguishable from chance | 4 |",
        "![scienceqa](lambda_scienceqa.png)",
        "## hotpotqa: λ study (shared A)",
        "| hq_lam0 | 0 (—) | 50.0 ± 23.6 | -50.0 [-100.0, +0.0] | – | 0.0 / 0.0 / – | – | – / 1.500 | – / 25.0 "
        "| 2 (missing: full_shared, base_shared) |",
        "## hotpotqa: every row",
        "| hq_lam0 | non_shared | 50.0 ± 23.6 | [-161.8, 261.8] | – | 0.0 ± 0.0 | 2 | 6 |",
        "| hq_lam0 | base_lr_shared | 0.0 ± 0.0 | [0.0, 0.0] | -50.0 [-100.0, +0.0] | 0.0 ± 0.0 | 2 | 6 |",
        "## hotpotqa: teacher-forced fidelity to non_shared (every set)",
        "| hq_lam0 | – | 1.500 | – | – | – | 25.0 | – | – | 3 (9) |",
        "![hotpotqa](lambda_hotpotqa.png)",
        "## Not run yet (missing evaluations and fidelity)",
        "- hq_lam0: full_shared, base_shared",
        "- sq_lam0.5_full: base_lr_shared, fidelity",
    ]
    assert (
        "| Adapters | λ (term) | non_shared | Δ base_lr_shared [95% CI] | Δ full_shared [95% CI] | OOF ns / blr / full "
        "| Valid % ns / blr / full | KL blr / full | top-1 blr / full | Runs |"
    ) in lines
    assert (
        "| Adapters | Scheme | Accuracy | 95% CI over runs | Δ vs non_shared, paired [95% CI] | OOF | Runs | Episodes |"
        in lines
    )
    assert (
        "| Adapters | Scheme | EM | 95% CI over runs | Δ vs non_shared, paired [95% CI] | OOF | Runs | Episodes |"
        in lines
    )
    assert (
        "| Adapters | KL base_lr_shared | KL full_shared | KL base_shared | KL droidspeak | top-1 base_lr_shared "
        "| top-1 full_shared | top-1 base_shared | top-1 droidspeak | Examples (tokens) |"
    ) in lines
    assert "| Adapters | Chance rate | non_shared − chance, paired [95% CI] | Verdict | Questions |" in lines
    assert md.startswith(
        "# Sharing study: accuracy under a shared cache, and training for sharing (λ)\n\nEvery number below comes "
        "from the job outputs under the study root (`python -m eval_suite.study report`). Paired differences: per "
        "question, the mean over runs of (scheme − non_shared) with the same sampling seeds; 95% bootstrap interval "
        "over the questions. An interval containing 0 is no measured difference. `ns` / `blr` / `full`: non_shared / "
        "base_lr_shared / full_shared.\n\n## scienceqa"
    )
    sq_rows, hq_rows = lines.index("## scienceqa: every row"), lines.index("## hotpotqa: every row")
    assert lines[sq_rows + 2].startswith("| Adapters | Scheme | Accuracy | 95% CI over runs |")
    assert lines[hq_rows + 2].startswith("| Adapters | Scheme | EM | 95% CI over runs |")
    assert (
        "`ns` / `blr` / `full`: non_shared / base_lr_shared / full_shared.\n\n## scienceqa: λ study (shared A)\n\n"
        "Zero-shot reference (base model, no agents, letter by next-token logit): accuracy 61.1% [51.1, 71.1], chance "
        "41.1%, 90 questions.\n\n| Adapters | λ (term) |"
    ) in md
    assert "## hotpotqa: λ study (shared A)\n\n| Adapters | λ (term) |" in md  # no HotpotQA reference: no line
    assert "Interim page" not in md and "Rows rerun" not in md
    assert md.split("\n---\n")[1].count("python -m eval_suite.study.driver report --root ") == 1
    assert f"--root {root} --out {out}`" in md and "--partial" not in md
    # study.json: per set its metadata, summary, chance gap (ScienceQA), fidelity without the per-example records,
    # missing rows and the training status; the returned data is the same; study.html carries the tables
    page = json.loads((out / "study.json").read_text())
    assert page["sets"] == json.loads(json.dumps(data))
    assert list(data) == ["hq_lam0", "sq_lam0", "sq_lam0.5_full", "sq_indepA", "sq_untrained"]
    sq0 = data["sq_lam0"]
    assert sq0["meta"] == {"benchmark": "scienceqa", "set": "sq_lam0", "lambda": 0.0, "train_scheme": "base_lr_shared",
                           "shared_a": True, "data": {}}  # fmt: skip
    assert sq0["fidelity"] == {"schemes": json.loads((root / "fidelity/sq_lam0/fidelity.json").read_text())["schemes"]}
    assert "examples" in json.loads((root / "fidelity/sq_lam0/fidelity.json").read_text())  # kept in the job
    assert sq0["train"] == {"start_step": 9, "stopped": "max_epochs"} and data["hq_lam0"]["train"] is None
    assert data["sq_indepA"]["meta"]["data"] == {"answer_thoughts": True} and "scienceqa" not in data
    assert sq0["missing"] == [] and sq0["partial"] == {} and "records" not in sq0
    assert sq0["chance"]["mean"] == pytest.approx(0.375) and sq0["chance"]["questions"] == 4
    assert "chance" not in data["hq_lam0"] and data["hq_lam0"]["missing"] == ["full_shared", "base_shared"]
    assert data["sq_lam0.5_full"]["fidelity"] is None and data["sq_lam0.5_full"]["train"] is None
    assert data["sq_lam0.5_full"]["missing"] == ["base_lr_shared", "fidelity"]
    assert page["provenance"]["command"].startswith("python -m eval_suite.study.driver report --root ")
    html = (out / "study.html").read_text()
    assert "<h2>scienceqa: λ study (shared A)</h2>" in html and "<img src='lambda_hotpotqa.png'" in html
    assert (
        "<tr><td>sq_indepA</td><td>25.0</td><td>-25.0 [-25.0, -25.0]</td><td>below chance</td><td>4</td></tr>" in html
    )


def test_a_partial_page_says_which_rows_are_unfinished(tmp_path: Path, monkeypatch) -> None:
    """``partial``: an unfinished row's episodes count, the page opens with the interim note naming each such row with
    its episodes of 90 questions times the set's runs, and the command carries ``--partial`` (figures left out)."""
    monkeypatch.setattr(report, "plot", lambda sets, out: [])
    root = tmp_path / "study"
    data = report.write_report(root, _study_root(root), tmp_path / "out", partial=True)
    md = (tmp_path / "out" / "study.md").read_text()
    assert data["hq_lam0"]["partial"] == {"full_shared": 1, "base_shared": 2} and data["hq_lam0"]["missing"] == []
    note = (
        "\n**Interim page: some rows are unfinished** (their numbers cover only the episodes run so far, the first "
        "questions of the first run; the paired differences pair only the (question, run) both rows have). "
        "Unfinished: hq_lam0: full_shared 1 of 180 episodes, base_shared 2 of 180 episodes; sq_lam0.5_full: "
        "base_lr_shared 1 of 90 episodes.\n"
    )
    assert md.startswith("# Sharing study: accuracy under a shared cache, and training for sharing (λ)\n\n" + note)
    assert "| hq_lam0 | full_shared | 100.0 | – | " in md
    assert md.rstrip().endswith(f"--out {tmp_path / 'out'} --partial`")


def test_study_markdown_becomes_html_headings_tables_images_and_paragraphs() -> None:
    """Headings keep their level, a pipe table becomes one table (header row, the separator dropped), an image its
    img tag, every other non-blank line a paragraph; text is escaped."""
    md = "# Top <1>\n\nsome & text\n### Third\n| a | b&c |\n| --- | --- |\n| 1 | x<y |\n| 2 | z |\n\n"
    md += "![f](fig a.png)\nend"
    got = report._md_to_html(md)
    head, body = got.split("<body>")
    assert head.startswith("<!doctype html><html><head><meta charset='utf-8'><style>body{font-family:sans-serif;")
    assert "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}</style></head>" in head
    assert body == (
        "<h1>Top &lt;1&gt;</h1><p>some &amp; text</p><h3>Third</h3>"
        "<table><tr><th>a</th><th>b&amp;c</th></tr><tr><td>1</td><td>x&lt;y</td></tr><tr><td>2</td><td>z</td></tr>"
        "</table><img src='fig a.png' style='max-width:100%'><p>end</p></body></html>"
    )
    assert report._md_to_html("| h |\n| - |\n| v |").endswith(
        "<body><table><tr><th>h</th></tr><tr><td>v</td></tr></table></body></html>"
    )
    tight = report._md_to_html("#Xy\n|X|Y|\n|-|-|\n|1|2|\n![a](x(1).png)")  # no spaces; a file name with "("
    assert tight.split("<body>")[1] == (
        "<h1>Xy</h1><table><tr><th>X</th><th>Y</th></tr><tr><td>1</td><td>2</td></tr></table>"
        "<img src='x(1).png' style='max-width:100%'></body></html>"
    )


def _r(values) -> list[float]:
    return [round(float(v), 5) for v in values]


def _plotted(figs: dict, sets: dict, out: Path) -> dict:
    """``plot``'s figures as ``{file: {(title, x label, y label, legend): {label: (xs, ys, error bars, marker,
    line style)}}}`` (error bars None for plain lines), read off the figures instead of their PNG files."""
    names = report.plot(sets, out)
    got = {}
    for path, (fig, dpi) in figs.items():
        assert path.parent == out and dpi == 110 and tuple(fig.get_size_inches()) == (10, 4)
        left, right = (ax.get_position() for ax in fig.axes)
        assert left.x1 < right.x0 and left.y0 == right.y0  # accuracy beside KL
        axes = {}
        for ax in fig.axes:
            curves = {}
            assert ax.xaxis.get_gridlines()[0].get_visible() and ax.xaxis.get_gridlines()[0].get_alpha() == 0.3
            if ax.get_legend() is not None:
                assert {t.get_fontsize() for t in ax.get_legend().get_texts()} == {7}
            for c in ax.containers:
                line = c.lines[0]
                assert {cap.get_markersize() for cap in c.lines[1]} == {6}  # capsize 3
                bars = [[round(float(y), 5) for _, y in seg] for seg in c.lines[2][0].get_segments()]
                curves[c.get_label()] = (_r(line.get_xdata()), _r(line.get_ydata()), bars, line.get_marker(),
                                         line.get_linestyle())  # fmt: skip
            for line in ax.lines:
                if not line.get_label().startswith("_"):
                    curves[line.get_label()] = (_r(line.get_xdata()), _r(line.get_ydata()), None, line.get_marker(),
                                                line.get_linestyle())  # fmt: skip
            axes[(ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_legend() is not None)] = curves
        got[path.name] = axes
    assert sorted(names) == sorted(got)
    return got


def test_the_lambda_figure_plots_each_rows_mean_and_std_and_each_schemes_kl(tmp_path: Path, figures_not_drawn) -> None:
    """Per benchmark: accuracy (mean ± std over runs, ×100) of the three λ rows against λ, one curve per training term
    (λ = 0 belongs to both), and KL of base_lr_shared / full_shared against λ; independent-A sets and recipe variants
    are not points."""
    root = tmp_path / "study"
    plan = _study_root(root)
    sets = report.collect(root, plan)
    variant = json.loads(json.dumps(sets["sq_lam0.5_full"]))
    variant["meta"].update(set="sq_variant", data={"answer_thoughts": True}, **{"lambda": 1.0})
    sets["sq_variant"] = variant  # a recipe variant: a table row, not a point
    sets["sq_lam0.5_full"]["fidelity"] = {"schemes": {"full_shared": {"overall": {"kl": 0.5}}}}
    got = _plotted(figures_not_drawn, sets, tmp_path / "out")
    assert list(got) == ["lambda_hotpotqa.png", "lambda_scienceqa.png"]
    sq = got["lambda_scienceqa.png"]
    lo, hi = 69.82233, 105.17767  # non_shared's two runs, 100 and 75: 87.5 ± 17.68
    assert sq[("scienceqa: accuracy vs λ (mean ± std over runs)", "λ", "accuracy (%)", True)] == {
        "eval non_shared (train term base_lr_shared)": ([0.0], [87.5], [[lo, hi]], "o", "-"),
        "eval base_lr_shared (train term base_lr_shared)": ([0.0], [50.0], [[50.0, 50.0]], "o", "--"),
        "eval full_shared (train term base_lr_shared)": ([0.0], [25.0], [[25.0, 25.0]], "o", ":"),
        "eval non_shared (train term full_shared)": ([0.0, 0.5], [87.5, 33.33333], [[lo, hi], [33.33333] * 2], "s",
                                                     "-"),
        "eval base_lr_shared (train term full_shared)": ([0.0], [50.0], [[50.0, 50.0]], "s", "--"),
        "eval full_shared (train term full_shared)": ([0.0, 0.5], [25.0, 66.66667], [[25.0, 25.0], [66.66667] * 2],
                                                      "s", ":"),
    }  # fmt: skip
    assert sq[("scienceqa: teacher-forced KL vs λ", "λ", "KL(non_shared ‖ scheme)", True)] == {
        "base_lr_shared (train term base_lr_shared)": ([0.0], [0.0123], None, "o", "--"),
        "full_shared (train term base_lr_shared)": ([0.0], [0.25], None, "o", ":"),
        "base_lr_shared (train term full_shared)": ([0.0], [0.0123], None, "s", "--"),
        "full_shared (train term full_shared)": ([0.0, 0.5], [0.25, 0.5], None, "s", ":"),
    }
    hq = got["lambda_hotpotqa.png"]
    assert list(hq[("hotpotqa: accuracy vs λ (mean ± std over runs)", "λ", "em (%)", True)]) == [
        "eval non_shared (train term base_lr_shared)", "eval base_lr_shared (train term base_lr_shared)",
        "eval non_shared (train term full_shared)", "eval base_lr_shared (train term full_shared)",
    ]  # fmt: skip
    assert hq[("hotpotqa: teacher-forced KL vs λ", "λ", "KL(non_shared ‖ scheme)", True)] == {
        "full_shared (train term base_lr_shared)": ([0.0], [1.5], None, "o", ":"),
        "full_shared (train term full_shared)": ([0.0], [1.5], None, "s", ":"),
    }


def test_a_benchmark_without_lambda_points_gets_empty_axes_without_legends(tmp_path: Path, figures_not_drawn) -> None:
    """A benchmark whose only set is not a shared-A λ set still gets its figure file, with nothing plotted and no
    legend."""
    root = tmp_path / "study"
    plan = _study_root(root)
    sets = report.collect(root, [j for j in plan if j.meta.get("set") == "sq_indepA"])
    got = _plotted(figures_not_drawn, sets, tmp_path / "out")
    assert got == {"lambda_scienceqa.png": {
        ("scienceqa: accuracy vs λ (mean ± std over runs)", "λ", "accuracy (%)", False): {},
        ("scienceqa: teacher-forced KL vs λ", "λ", "KL(non_shared ‖ scheme)", False): {},
    }}  # fmt: skip
    # only a full_shared-term set at λ 0.5: no base_lr_shared-term curve, the full_shared-term ones drawn
    figures_not_drawn.clear()
    sets = report.collect(root, [j for j in plan if j.meta.get("set") == "sq_lam0.5_full"])
    got = _plotted(figures_not_drawn, sets, tmp_path / "out")["lambda_scienceqa.png"]
    assert list(got[("scienceqa: accuracy vs λ (mean ± std over runs)", "λ", "accuracy (%)", True)]) == [
        "eval non_shared (train term full_shared)", "eval full_shared (train term full_shared)"]  # fmt: skip


def test_lambda_rows_are_ordered_by_lambda_then_term() -> None:
    """Shared-A λ sets sorted by λ, then by the term's scheme name; a set without results shows dashes and 0 runs."""
    order = (("c", 0.5, "full_shared"), ("b", 0.5, "base_lr_shared"), ("a", 0.25, "x"))
    sets = {name: {"meta": _meta("hotpotqa", name, lam, term), "fidelity": None, "summary": None, "missing": ["x"]}
            for name, lam, term in order}  # fmt: skip
    rows = report.lambda_table(sets, "hotpotqa").splitlines()[2:]
    assert rows == [
        "| a | 0.25 (x) | – | – | – | – / – / – | – | – / – | – / – | 0 (missing: x) |",
        "| b | 0.5 (base_lr_shared) | – | – | – | – / – / – | – | – / – | – / – | 0 (missing: x) |",
        "| c | 0.5 (full_shared) | – | – | – | – / – / – | – | – / – | – / – | 0 (missing: x) |",
    ]


def test_the_sampler_line_sums_every_row() -> None:
    """The sampler paragraph: rows, episodes in both and identical ones summed over rows, and how many differ."""
    reruns = {"a/x.sampler1": {"shared": 10, "identical": 7}, "b/y.sampler2": {"shared": 5, "identical": 5}}
    assert report.sampler_reruns_line(reruns) == (
        "\n**Rows rerun with the current sampler** (older copies kept as `<row>.samplerN`, compared in "
        "`sampler_reruns.json`): 2 rows, 15 episodes in both, **12 with the same prediction, token count and "
        "actions** (3 differ).\n"
    )


def test_chance_gap_draws_its_interval_with_the_given_seed() -> None:
    """The interval is the bootstrap of the per-question gaps with the seed asked for (0 by default); rows other than
    non_shared and untrained do not count."""
    recs = [_sq(f"q{q}", 0, q % 3 == 0, n=2 + q % 3) for q in range(9)]
    recs += [{**_sq("q0", 0, False), "row": "full_shared"}]
    values = [float(q % 3 == 0) - 1 / (2 + q % 3) for q in range(9)]
    for seed in (0, 3):
        mean, lo, hi = bootstrap_mean_interval(values, seed=seed)
        got = report.chance_gap(recs, seed=seed)
        chance = pytest.approx(sum(1 / (2 + q % 3) for q in range(9)) / 9)
        assert got == {"mean": mean, "ci95": [lo, hi], "chance": chance, "questions": 9}
    assert report.chance_gap(recs) == report.chance_gap(recs, seed=0) != report.chance_gap(recs, seed=3)
    assert report.chance_gap([{**_sq("q0", 0, True), "row": "base_lr_shared"}]) is None


def test_a_fidelity_result_without_schemes_gives_dashes() -> None:
    """A fidelity file without ``schemes`` (or a scheme without ``overall``) is a row of dashes, not an error."""
    meta = _meta("hotpotqa", "hq", 0.0)
    sets = {"hq": {"meta": meta, "fidelity": {"note": "nothing measured"}, "summary": None, "missing": []}}
    assert report.fidelity_table(sets, "hotpotqa").splitlines()[-1] == "| hq | – | – | – | – | – | – | – | – | – (–) |"
    assert report.fidelity_table(sets, "scienceqa") == "No fidelity results yet.\n"
    assert (
        report.lambda_table(sets, "hotpotqa").splitlines()[-1]
        == "| hq | 0 (—) | – | – | – | – / – / – | – | – / – | – / – | 0 |"
    )


def test_reruns_differing_only_in_their_actions_are_not_identical(tmp_path: Path) -> None:
    """Two drawings of an episode with the same prediction and token count but other actions differ; missing actions
    and an empty list are the same; episodes with and without a seed are compared side by side."""
    ep = {"qid": "a", "run": 0, "seed": 1, "prediction": "x", "num_tokens": 5}
    unseeded = {k: v for k, v in ep.items() if k != "seed"}  # an older record without its seed: the same episode key
    old = [{**ep, "actions": ["Search[x]"]}, {**ep, "qid": "b"}, {**unseeded, "prediction": "y"}]
    _episodes(tmp_path / "eval/s/non_shared.sampler1", old)
    new = [{**ep, "actions": ["Lookup[x]"]}, {**ep, "qid": "b", "actions": []}, {**unseeded, "prediction": "z"}]
    _episodes(tmp_path / "eval/s/non_shared", new)
    row = report.sampler_reruns(tmp_path)["s/non_shared.sampler1"]
    assert (row["shared"], row["identical"]) == (3, 1)
    assert row["differing"] == [["a", 0, 1], ["a", 0, None]]  # in the order of the keys' text


def test_a_started_rows_one_byte_episode_file_is_partial_not_missing(tmp_path: Path) -> None:
    """``partial``: an unfinished row whose episode file holds anything (one blank line) is partial with its count of
    episodes (0), not missing."""
    meta = _meta("scienceqa", "s", 0.0)
    plan = [_eval_job(meta, "non_shared", 1)]
    _write(tmp_path / "eval/s/non_shared/episodes.jsonl", "\n")
    entry = report.collect(tmp_path, plan, partial=True)["s"]
    assert (entry["partial"], entry["missing"], entry["summary"]) == ({"non_shared": 0}, [], None)
