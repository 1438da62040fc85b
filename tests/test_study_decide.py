"""The decisive study's plan, its done-test and its verdicts (eval_suite/study/decide.py), on the CPU."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eval_suite.study import decide as sd
from eval_suite.study.driver import PROFILES, main
from eval_suite.study.jobs import is_done

QWEN = PROFILES["qwen2.5-coder-1.5b"]


def _opt(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_plan_runs_three_schemes_in_one_job_on_each_pool_with_its_runs() -> None:
    plan = sd.build_decide_plan(("scienceqa", "hotpotqa"), QWEN)
    by = {j.name: j for j in plan}
    sqa, hp = by["eval/scienceqa_lam0/decide"], by["eval/hotpotqa_lam0/decide"]
    assert _opt(sqa.cmd, "--split") == "dev,test,extra" and _opt(hp.cmd, "--split") == "dev,test"
    assert _opt(sqa.cmd, "--runs") == "2" and _opt(hp.cmd, "--runs") == "8"
    assert _opt(sqa.cmd, "--scheme") == "non_shared,base_lr_shared,full_shared"
    assert _opt(sqa.cmd, "--concurrent_schemes") == "false" and _opt(sqa.cmd, "--model") == "qwen2.5-coder-1.5b"
    assert _opt(sqa.cmd, "--adapters") == "data/adapters/qwen_scienceqa_sharedA"  # the shipped λ = 0 set
    assert "--temperature" not in sqa.cmd  # the protocol's sampling
    # a decode call that never returns ends the job (resumed by the driver's next call), never the whole lease
    assert all(_opt(j.cmd, "--stall_s") == str(sd.STALL_S) for j in plan if j.kind == "eval") and sd.STALL_S <= 180
    # λ = 0.5 is trained first (the weights are not kept), from the study's recipe
    lam = by["eval/hotpotqa_lam0.5/decide"]
    assert lam.deps == ("train/hotpotqa_lam0.5",) and by["train/hotpotqa_lam0.5"].meta["lambda"] == 0.5
    assert _opt(lam.cmd, "--adapters") == "{root}/train/hotpotqa_lam0.5/adapters"
    greedy = by["eval/scienceqa_lam0/greedy"]
    assert _opt(greedy.cmd, "--temperature") == "0" and _opt(greedy.cmd, "--split") == "dev,test"
    assert _opt(greedy.cmd, "--scheme") == "non_shared,base_lr_shared"
    assert _opt(by["eval/hotpotqa_lam0/others"].cmd, "--scheme") == "base_shared,droidspeak"
    # the shipped set's decisive rows come first, the greedy pair last
    names = [j.name for j in plan]
    assert names.index("eval/scienceqa_lam0/decide") < names.index("train/scienceqa_lam0.5")
    assert names[-1].endswith("/greedy")
    # lanes on (refused by eval on CUDA unless asked for): every eval job's schemes at once, nothing else changed
    together = sd.build_decide_plan(("scienceqa", "hotpotqa"), QWEN, lanes=True)
    assert [j.name for j in together] == [j.name for j in plan]
    for a, b in zip(plan, together, strict=True):
        if a.kind == "eval":
            at = a.cmd.index("--concurrent_schemes") + 1
            assert b.cmd == [*a.cmd[:at], "true", *a.cmd[at + 1 :]] and a.cmd[at] == "false"
    # --runs overrides every benchmark
    more = sd.build_decide_plan(("hotpotqa",), QWEN, runs={"hotpotqa": 11})
    assert _opt(next(j for j in more if j.name == "eval/hotpotqa_lam0/decide").cmd, "--runs") == "11"


def _summary(path: Path, rows: dict[str, int]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    summary = {"episodes": {r: {str(i): {} for i in range(n)} for r, n in rows.items()},
               "protocol": {r: {"sampler": 2} for r in rows}}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(summary))


def test_a_job_of_several_schemes_is_done_when_every_row_has_every_run(tmp_path: Path) -> None:
    job = next(j for j in sd.build_decide_plan(("hotpotqa",), QWEN) if j.name == "eval/hotpotqa_lam0/decide")
    _summary(tmp_path / job.name, {"non_shared": 8, "base_lr_shared": 8, "full_shared": 7})
    assert not is_done(job, tmp_path)
    _summary(tmp_path / job.name, {"non_shared": 8, "base_lr_shared": 8})
    assert not is_done(job, tmp_path)
    _summary(tmp_path / job.name, {"non_shared": 8, "base_lr_shared": 8, "full_shared": 8})
    assert is_done(job, tmp_path)


def _records(gap: float, questions: int, runs: int, noise: float, seed: int = 3) -> list[dict]:
    """Paired records: non_shared answers with a per-question rate; the other row loses ``gap`` on average."""
    rng = random.Random(seed)
    out = []
    for q in range(questions):
        p = rng.uniform(0.2, 0.8)
        for run in range(runs):
            for row, shift in (("non_shared", 0.0), ("base_lr_shared", gap)):
                correct = float(rng.random() < min(1.0, max(0.0, p - shift + rng.gauss(0, noise))))
                out.append({"row": row, "run": run, "qid": f"q{q}", "correct": correct,
                            "split": "dev" if q < questions // 3 else "extra"})  # fmt: skip
    return out


@pytest.mark.parametrize(("gap", "questions", "runs", "verdict", "narrow"), [
    (0.0, 4000, 2, "within", True),      # no loss, enough questions: within 2 points and decided
    (0.07, 4000, 2, "outside", True),    # a 7-point loss: decided, not within
    (0.0, 40, 1, "undecided", False),    # too few questions: the interval crosses -2
    (0.3, 100, 1, "outside", False),     # a 30-point loss: wider than the target, yet wholly below -2
])  # fmt: skip
def test_the_verdict_follows_the_intervals_ends_and_width(gap, questions, runs, verdict, narrow) -> None:
    cell = sd.decide_cell(_records(gap, questions, runs, noise=0.05), "base_lr_shared", "correct", "scienceqa")
    assert cell["verdict"] == verdict and cell["within_2_points"] is (verdict == "within")
    assert cell["narrow_enough"] is narrow
    low, high = cell["ci95"]
    assert cell["half_width"] == pytest.approx((high - low) / 2)
    assert low <= cell["mean"] <= high


@pytest.mark.parametrize(("ci", "verdict"), [
    ((-0.05, -0.01), "undecided"),   # crosses -2 from below: a loss, not shown to exceed 2 points
    ((-0.05, -0.021), "outside"),    # wholly below -2
    ((-0.02, 0.01), "within"),       # the lower end exactly at -2 counts as within
    ((-0.0201, 0.03), "undecided"),  # just below -2
    ((0.01, 0.05), "within"),        # a gain
    ((-0.05, -0.02), "undecided"),   # the upper end exactly at -2 is not below it
])  # fmt: skip
def test_the_verdict_at_the_two_point_boundary(ci, verdict, monkeypatch) -> None:
    monkeypatch.setattr(sd, "paired_difference", lambda *a: {"mean": sum(ci) / 2, "ci95": list(ci), "pairs": 10})
    cell = sd.decide_cell([], "base_lr_shared", "correct", "hotpotqa")
    assert cell["verdict"] == verdict and cell["within_2_points"] is (verdict == "within")
    assert cell["half_width"] == pytest.approx((ci[1] - ci[0]) / 2)
    assert cell["narrow_enough"] is ((ci[1] - ci[0]) / 2 <= 0.02) and cell["target_half_width"] == 0.02


def test_the_report_names_the_pool_and_the_papers_questions_apart(tmp_path: Path) -> None:
    plan = [j for j in sd.build_decide_plan(("scienceqa",), QWEN, lambdas=(0.0,)) if j.name.endswith("/decide")]
    recs = _records(0.0, 60, 2, noise=0.05)
    for r in recs:
        r["benchmark"] = "scienceqa"
    more = [dict(r, row="full_shared", correct=0.0) for r in recs if r["row"] == "non_shared"]
    d = tmp_path / plan[0].name
    d.mkdir(parents=True)
    (d / "episodes.jsonl").write_text("\n".join(json.dumps(r) for r in recs + more) + "\n")
    data = sd.write_decide_report(tmp_path, plan, tmp_path / "report")
    cell = data["scienceqa"]["scienceqa_lam0"]["labels"]["decide"]
    assert cell["rows"]["non_shared"]["questions"] == 60 and cell["rows"]["non_shared"]["runs"] == 2
    assert cell["rows"]["non_shared"]["paper_questions"] == 20  # the dev questions only (no test in these records)
    assert cell["paired"]["full_shared"]["mean"] < -0.2 and not cell["paired"]["full_shared"]["within_2_points"]
    md = (tmp_path / "report" / "decide.md").read_text()
    assert "dev,test,extra (60 x 2)" in md and "`full_shared` no |" in md and "(partial:" not in md
    # a job still running: the rows it has so far are paired, and the table says how far it got
    (d / "episodes.jsonl").write_text("\n".join(json.dumps(r) for r in recs + more[:90]) + "\n")
    sd.write_decide_report(tmp_path, plan, tmp_path / "report")
    md = (tmp_path / "report" / "decide.md").read_text()
    assert "`full_shared` no (partial: 90 of 120 pairs)" in md and "`base_lr_shared` yes |" not in md
    # a job whose first scheme is still running: no pair yet, and its `non_shared` figure is marked partial
    ns_only = [r for r in recs if r["row"] == "non_shared"][:70]  # 35 questions reached, of the pool's 60
    (d / "run_config.json").write_text(json.dumps({"questions": 60}))
    (d / "episodes.jsonl").write_text("\n".join(json.dumps(r) for r in ns_only) + "\n")
    sd.write_decide_report(tmp_path, plan, tmp_path / "report")
    md = (tmp_path / "report" / "decide.md").read_text()
    assert "| – (partial: 70 of 360 episodes) |" in md
    # one episode is partial too; a job with none yet is a dash, not "0 of"
    for kept, verdict in ((1, "| – (partial: 1 of 360 episodes) |"), (0, "| – |")):
        (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ns_only[:kept]))
        sd.write_decide_report(tmp_path, plan, tmp_path / "report")
        md = (tmp_path / "report" / "decide.md").read_text()
        row = next(line for line in md.splitlines() if line.startswith("| scienceqa, λ 0 |"))
        assert row.endswith(verdict), (kept, row)


def test_the_decide_stage_is_a_stage_of_the_study_command(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--stage", "decide", "--model", "qwen2.5-coder-1.5b", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "eval/scienceqa_lam0/decide" in out and "train/hotpotqa_lam0.5" in out


def test_a_job_asks_for_the_memory_of_one_engine_at_a_time_or_of_all_with_lanes() -> None:
    """Run one scheme at a time, a job needs its largest scheme's plan (lragent.memory_plan), so the driver can put
    both λ 0.5 trainings or a two-scheme job beside a three-scheme job on one 80 GB card; with lanes it needs every
    scheme's caches at once (about 66 GiB at 48 rows: alone on the card)."""
    from lragent.memory_plan import GIB, model_shape, plan_memory

    shape = model_shape(QWEN.model)

    def one(scheme: str) -> float:
        return plan_memory(shape, scheme, sd.BATCH, sd.CAPACITY, element_size=2).total / GIB

    by = {j.name: j for j in sd.build_decide_plan(("hotpotqa",), QWEN)}
    three, two = by["eval/hotpotqa_lam0/decide"], by["eval/hotpotqa_lam0/others"]
    assert three.gb == sd.job_gib(QWEN.model, ("non_shared", "base_lr_shared", "full_shared"), lanes=False)
    assert one("non_shared") <= three.gb < one("non_shared") + 0.5  # the largest plan, rounded up to a half
    assert max(one("base_shared"), one("droidspeak")) <= two.gb < max(one("base_shared"), one("droidspeak")) + 0.5
    train = by["train/hotpotqa_lam0.5"].gb
    assert three.gb + 2 * train <= 71.5 and three.gb + two.gb <= 71.5  # beside each other on an 80 GB card
    lanes = {j.name: j for j in sd.build_decide_plan(("hotpotqa",), QWEN, lanes=True)}["eval/hotpotqa_lam0/decide"]
    model = plan_memory(shape, "full_shared", 1, 1, element_size=2).model_bytes / GIB
    together = sum(one(s) for s in ("non_shared", "base_lr_shared", "full_shared")) - 2 * model  # the model once
    assert together <= lanes.gb < together + 0.5
    assert lanes.gb > 60 and lanes.gb + train > 71.5  # all three engines at once: the card is full


def _parsed(job) -> dict:
    """The job's eval command as the eval command itself parses it (``--print_config``): an option the command does
    not know, or a value it refuses, fails here as it would on the device."""
    import contextlib
    import io

    import yaml

    from lragent.cli_main import main as cli_main

    argv = [a.replace("{root}", "ROOT") for a in job.cmd[2:]] + ["--print_config"]
    assert job.cmd[:2] == ["python3", "cli.py"]  # the plan's interpreter (python=), then the one entry point
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        cli_main(argv)
    return yaml.safe_load(buf.getvalue())


def test_every_eval_job_is_an_eval_command_with_the_studys_settings() -> None:
    plan = sd.build_decide_plan(("scienceqa", "hotpotqa"), QWEN)
    evals = [j for j in plan if j.kind == "eval"]
    assert len(evals) == 8 and [j.kind for j in plan].count("train") == 2
    for job in evals:
        c = _parsed(job)
        bench, label = job.meta["benchmark"], job.meta["label"]
        assert c["benchmark"] == bench and c["model"] == "qwen2.5-coder-1.5b" and c["dtype"] == "bfloat16"
        assert c["batch"] == sd.BATCH == 48 and c["capacity"] == sd.CAPACITY and c["quiet"] is True
        assert c["concurrent_schemes"] is False and c["stall_s"] == sd.STALL_S
        assert c["launch_ahead"] is True and c["feed_budget"] == sd.FEED_BUDGET == 2048
        assert c["out"] == f"ROOT/{job.name}" and job.done_file == f"{job.name}/summary.json"
        assert c["split"] == job.meta["split"] and c["runs"] == job.meta["runs"]
        assert c["scheme"] == ",".join(job.meta["rows"])
        want_split = {"decide": sd.POOLS[bench], "others": sd.POOLS[bench], "greedy": "dev,test"}[label]
        want_runs = {"decide": sd.RUNS[bench], "others": sd.RUNS[bench], "greedy": 1}[label]
        assert (c["split"], c["runs"]) == (want_split, want_runs), job.name
        assert c["temperature"] == (0.0 if label == "greedy" else 0.9), job.name
        lam = job.meta["lambda"]
        shipped = f"data/adapters/qwen_{bench}_sharedA"
        assert c["adapters"] == (shipped if lam == 0 else f"ROOT/train/{bench}_lam{lam:g}/adapters"), job.name
    by = {j.name: j for j in plan}
    assert by["train/scienceqa_lam0.5"].meta["epochs"] == 2 and by["train/scienceqa_lam0.5"].meta["lambda"] == 0.5
    assert [j.priority for j in plan] == sorted(j.priority for j in plan)  # the plan is in priority order


def test_the_report_tables_line_by_line(tmp_path: Path, monkeypatch) -> None:
    """``decide.md`` on records whose means are counted by hand and whose paired cells are fixed (the bootstrap is
    tested apart): every column of both tables, the partial mark, the verdict words, the rows with no records."""

    def fixed(records, row, ref, field):
        mine = [r for r in records if r["row"] == row]
        if not mine:
            return None
        pool = any(r["split"] == "extra" for r in records)
        paper = {"base_lr_shared": (0.03, (0.0056, 0.0544)), "full_shared": (0.02, (0.0, 0.04))}
        mean, ci = CELLS[row] if pool or row not in paper else paper[row]
        return {"mean": mean, "ci95": list(ci), "pairs": len(mine)}

    monkeypatch.setattr(sd, "paired_difference", fixed)
    plan = sd.build_decide_plan(("scienceqa", "hotpotqa"), QWEN)
    by = {j.name: j for j in plan}

    def write(job_name: str, rows: dict[str, list[float]], runs: int, splits: list[str], field: str) -> None:
        recs = [{"row": row, "run": run, "qid": f"q{i}", "split": split, field: score[i]}
                for row, score in rows.items() for run in range(runs) for i, split in enumerate(splits)]  # fmt: skip
        d = tmp_path / by[job_name].name
        d.mkdir(parents=True)
        (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    sqa = ["dev", "test", "extra"]
    write("eval/scienceqa_lam0/decide", {"non_shared": [1, 1, 1], "base_lr_shared": [1, 0, 1],
                                         "full_shared": [0, 0, 0]}, 2, sqa, "correct")  # fmt: skip
    write("eval/scienceqa_lam0/others", {"base_shared": [1, 0, 0], "droidspeak": [0, 0, 1]}, 2, sqa, "correct")
    write("eval/scienceqa_lam0/greedy", {"non_shared": [1, 1], "base_lr_shared": [0, 1]}, 1, ["dev", "test"],
          "correct")  # fmt: skip
    write("eval/scienceqa_lam0.5/decide", {"non_shared": [1, 0, 1], "full_shared": [0, 0, 1]}, 2, sqa, "correct")
    write("eval/hotpotqa_lam0/greedy", {"non_shared": [1, 0]}, 1, ["dev", "test"], "em")
    write("eval/hotpotqa_lam0/decide", {"non_shared": [0.5, 0]}, 8, ["dev", "test"], "em")
    d = tmp_path / "eval/hotpotqa_lam0/decide/episodes.jsonl"  # base_lr_shared part-way: 10 of its 16 episodes
    more = [{"row": "base_lr_shared", "run": k // 2, "qid": f"q{k % 2}", "split": ["dev", "test"][k % 2], "em": 0.0}
            for k in range(10)]  # fmt: skip
    d.write_text(d.read_text() + "".join(json.dumps(r) + "\n" for r in more))
    data = sd.write_decide_report(tmp_path, plan, tmp_path / "out" / "decide")
    md = (tmp_path / "out" / "decide" / "decide.md").read_text()
    # fmt: off
    want = [
        "# The decisive study: paired gaps to `non_shared` with intervals that decide",
        "",
        "Paired by question and seed; per question the mean over runs; 95% percentile bootstrap over questions. "
        "Within 2 points (yes): the interval's lower end is at least -2; no: its upper end is below -2; else "
        "undecided. Half-width targets: ScienceQA ±2.5, HotpotQA ±2.0 points. A job still running is marked "
        "partial with the pairs it has.",
        "",
        "| benchmark, set | pool (questions x runs) | `non_shared` | Δ `base_lr_shared` [95%] "
        "| Δ `full_shared` [95%] | paper's questions: `non_shared`, Δ `base_lr_shared`, Δ `full_shared` "
        "| within 2 points? |",
        "|---|---|---:|---:|---:|---|---|",
        "| scienceqa, λ 0 | dev,test,extra (3 x 2) | 100.0 | -3.4 [-5.6, -1.2] (±2.2) "
        "| -8.1 [-10.2, -6.0] (±2.1) | 100.0, +3.0, +2.0 "
        "| `base_lr_shared` undecided (interval crosses -2); `full_shared` no |",
        "| scienceqa, λ 0.5 | dev,test,extra (3 x 2) | 66.7 | – | -8.1 [-10.2, -6.0] (±2.1) | 50.0, –, +2.0 "
        "| `full_shared` no |",
        "| hotpotqa, λ 0 | dev,test (2 x 8) | 25.0 | +3.0 [+0.6, +5.4] (±2.4) | – | 25.0, +3.0, – "
        "| `base_lr_shared` yes (partial: 10 of 16 pairs) |",
        "| hotpotqa, λ 0.5 | dev,test (0 x 0) | – | – | – | –, –, – | – |",
        "",
        "## Other rows",
        "",
        "| benchmark, set | job | pool | rows (mean, questions x runs) |",
        "|---|---|---|---|",
        "| scienceqa, λ 0 | others | dev,test,extra | `base_shared` 33.3 (3 x 2), `droidspeak` 33.3 (3 x 2); "
        "Δ `base_shared` -3.0 [-5.0, -1.0] (±2.0); Δ `droidspeak` -15.0 [-20.0, -10.0] (±5.0) |",
        "| scienceqa, λ 0 | greedy | dev,test | `non_shared` 100.0 (2 x 1), `base_lr_shared` 50.0 (2 x 1); "
        "Δ `base_lr_shared` +3.0 [+0.6, +5.4] (±2.4) |",
        "| hotpotqa, λ 0 | greedy | dev,test | `non_shared` 50.0 (2 x 1), `base_lr_shared` – (0 x 0) |",
    ]
    # fmt: on
    assert md == "\n".join(want) + "\n"
    empty = data["hotpotqa"]["hotpotqa_lam0.5"]["labels"]["decide"]["rows"]["non_shared"]
    assert empty == {"mean": None, "episodes": 0, "questions": 0, "runs": 0, "paper_mean": None, "paper_episodes": 0,
                     "paper_questions": 0}  # fmt: skip
    cell = data["scienceqa"]["scienceqa_lam0"]["labels"]["decide"]
    assert cell["rows"]["base_lr_shared"] == {"mean": 4 / 6, "episodes": 6, "questions": 3, "runs": 2,
                                              "paper_mean": 0.5, "paper_episodes": 4, "paper_questions": 2}  # fmt: skip
    assert cell["planned_runs"] == 2 and cell["episodes"] == 18 and cell["pool"] == "dev,test,extra"
    assert data["hotpotqa"]["hotpotqa_lam0"]["lambda"] == 0.0 and data["scienceqa"]["scienceqa_lam0.5"]["lambda"] == 0.5
    written = json.loads((tmp_path / "out" / "decide" / "decide.json").read_text())
    assert written["results"] == json.loads(json.dumps(data)) and written["provenance"]["source_hash"]


CELLS = {"base_lr_shared": (-0.034, (-0.056, -0.012)), "full_shared": (-0.081, (-0.102, -0.06)),
         "base_shared": (-0.03, (-0.05, -0.01)), "droidspeak": (-0.15, (-0.2, -0.1))}  # fmt: skip


def test_the_plan_runs_in_this_order_and_a_lambda_set_trains_first() -> None:
    """The driver starts jobs by priority: the shipped sets' decisive jobs, then the λ 0.5 trainings and their
    decisive jobs, then the other schemes, then the greedy pair; ScienceQA before HotpotQA at each step."""
    plan = sd.build_decide_plan(("scienceqa", "hotpotqa"), QWEN)
    assert [(j.name, j.priority) for j in plan] == [
        ("eval/scienceqa_lam0/decide", 1.0), ("eval/hotpotqa_lam0/decide", 1.1),
        ("train/scienceqa_lam0.5", 10.0), ("train/hotpotqa_lam0.5", 10.1),
        ("eval/scienceqa_lam0.5/decide", 11.0), ("eval/hotpotqa_lam0.5/decide", 11.1),
        ("eval/scienceqa_lam0/others", 100.0), ("eval/hotpotqa_lam0/others", 100.1),
        ("eval/scienceqa_lam0/greedy", 200.0), ("eval/hotpotqa_lam0/greedy", 200.1),
    ]  # fmt: skip
    # the embedded model's profile takes the unprefixed shipped sets
    default = {j.name: j for j in sd.build_decide_plan(("hotpotqa",), PROFILES["default"])}
    assert _opt(default["eval/hotpotqa_lam0/decide"].cmd, "--adapters") == "data/adapters/hotpotqa_sharedA"


def test_a_training_job_writes_its_lambda_recipe_and_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    """The λ 0.5 set's fit config, as the driver writes it: the accuracy model's recipe, shared A, λ 0.5 on
    ``base_lr_shared``, 2 epochs, its own folders; run again after a killed fit, it resumes from ``last.ckpt``."""
    import yaml

    from eval_suite.study.driver import prepare

    job = next(j for j in sd.build_decide_plan(("scienceqa",), QWEN) if j.kind == "train")
    cmd = prepare(job, tmp_path)
    d = tmp_path / job.name
    assert cmd == ["python3", "cli.py", "fit", "--config", str(d / "config.yaml")]
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    model = cfg["model"]
    assert model["model_name"] == "qwen2.5-coder-1.5b" and model["shared_a"] is True
    assert model["lambda_shared"] == 0.5 and model["shared_scheme"] == "base_lr_shared"
    assert cfg["trainer"]["max_epochs"] == 2 and cfg["trainer"]["default_root_dir"] == str(d)
    assert cfg["data"]["pack_prefixes"] is False
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    assert prepare(job, tmp_path) == [*cmd, "--ckpt_path", str(d / "checkpoints" / "last.ckpt")]


def test_records_without_a_split_count_as_dev_questions(tmp_path: Path) -> None:
    """Records written before splits existed name none: they were the dev questions, so they count on the paper's
    questions too."""
    plan = [j for j in sd.build_decide_plan(("hotpotqa",), QWEN, lambdas=(0.0,)) if j.name.endswith("/decide")]
    recs = [{"row": row, "run": 0, "qid": f"q{i}", "em": float(row == "non_shared" or i == 0)}
            for row in ("non_shared", "base_lr_shared") for i in range(4)]  # fmt: skip
    d = tmp_path / plan[0].name
    d.mkdir(parents=True)
    (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cell = sd.collect_decide(tmp_path, plan)["hotpotqa"]["hotpotqa_lam0"]["labels"]["decide"]
    assert (
        cell["rows"]["base_lr_shared"]["paper_episodes"] == 4 and cell["rows"]["base_lr_shared"]["paper_mean"] == 0.25
    )
    assert cell["paired_paper"]["base_lr_shared"]["pairs"] == 4


def test_the_other_rows_pair_with_the_decide_jobs_non_shared_by_question_and_run(tmp_path: Path) -> None:
    """The ``others`` job runs no ``non_shared`` of its own: its rows are paired with the ``decide`` job's
    ``non_shared`` of the same set, question by question and run by run (a run only one side has is left out)."""
    plan = [j for j in sd.build_decide_plan(("hotpotqa",), QWEN, lambdas=(0.0,)) if j.kind == "eval"]
    by = {j.meta["label"]: j for j in plan}
    ns = [{"row": "non_shared", "run": run, "qid": f"q{i}", "split": "dev", "em": float(i < 2)}
          for run in range(2) for i in range(4)]  # fmt: skip
    others = [{"row": "base_shared", "run": 0, "qid": f"q{i}", "split": "test", "em": float(i == 0)} for i in range(4)]
    others.append({"row": "base_shared", "run": 5, "qid": "q3", "split": "test", "em": 1.0})  # no non_shared run 5
    for label, recs in (("decide", ns), ("others", others)):
        d = tmp_path / by[label].name
        d.mkdir(parents=True)
        (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cell = sd.collect_decide(tmp_path, plan)["hotpotqa"]["hotpotqa_lam0"]["labels"]["others"]
    gap = cell["paired"]["base_shared"]
    assert gap["pairs"] == 4 and gap["questions"] == 4
    assert gap["mean"] == pytest.approx((0 - 1 + 0 + 0) / 4)  # q1 lost its point; q0 kept it; q2, q3 both 0
    assert cell["paired"]["droidspeak"] is None  # no droidspeak records yet
    assert cell["rows"]["base_shared"]["episodes"] == 5  # the row's own mean counts every episode it has
    assert cell["paired_paper"]["base_shared"]["pairs"] == 4  # every record here is a paper-pool split
