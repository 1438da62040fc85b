"""The embedded-recipe sweep driver (scripts/sweep_embedded.py): grid, configs, resume, the table from the logs,
the pick for stage 2, packing and installing the adapters."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from eval_suite.sweep_table import collect, run_summary, sweep_report
from lit_modules import MultiLoraModule
from lit_modules.cli import LRAgentCLI
from tests.conftest import load_script
from tests.test_prefix_packing import write_trajectories

REPO = Path(__file__).resolve().parents[1]
sweep = load_script("sweep_embedded")


def tiny_configs(tmp_path: Path) -> Path:
    """``embedded_{hotpotqa,scienceqa}.yaml``: the real ones on a 2-layer random model and tiny trajectories."""
    files = write_trajectories(tmp_path)
    out = tmp_path / "configs"
    out.mkdir()
    for ds in sweep.DATASETS:
        cfg = yaml.safe_load((REPO / "configs" / f"embedded_{ds}.yaml").read_text())
        cfg["model"].update(
            model_name="tiny-llama", tokenizer_name="byte", model_overrides={"vocab_size": 258, "num_hidden_layers": 2}
        )
        cfg["data"].update(data_files=files, max_length=512, max_tokens=1024, val_fraction=0.25)
        cfg["trainer"].update(accelerator="cpu", precision="32-true")
        (out / f"embedded_{ds}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def driver(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "sweep_embedded.py"), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


# ----------------------------------------------------------------------------------------------------------- grid


def test_grid_names_are_distinct_and_stage2_reuses_the_chosen_run() -> None:
    grid = sweep.stage1_grid([2e-4, 5e-4, 1e-3, 2e-3], ["qv", "qvo_mlp"], [8, 16])
    assert len({s.name for s in grid}) == 16
    assert all(s.dataset == "hotpotqa" and s.shared_a and s.kind == "fit" and s.alpha == 2 * s.rank for s in grid)
    assert grid[0].name == "hotpotqa_sharedA_lr0.0002_qv_r8"
    chosen = grid[5]
    stage2 = sweep.stage2_grid(chosen)
    assert [s.name for s in stage2][0] == chosen.name  # stage 1 already trained it
    assert {(s.dataset, s.shared_a) for s in stage2} == {(d, a) for d in sweep.DATASETS for a in (True, False)}
    assert {(s.lr, s.targets, s.rank) for s in stage2} == {(chosen.lr, chosen.targets, chosen.rank)}


def test_fit_config_is_the_grid_point_and_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = sweep.base_config(REPO / "configs", "hotpotqa")
    spec = sweep.RunSpec("hotpotqa", False, 5e-4, "qvo_mlp", 16)
    run_dir = tmp_path / spec.name
    cfg = sweep.fit_config(spec, base, run_dir, 1234.5, sweep.parse_sets(["data.max_tokens=8192"]))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(REPO)
    cli = LRAgentCLI(run=False, args=["--config", str(path)])
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    assert isinstance(model, MultiLoraModule)
    assert model.train_config.role_lr == dict.fromkeys(["plan", "action", "reflect"], 5e-4)
    assert model.lora_config.targets == ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert model.lora_config.rank == 16 and model.lora_config.alpha == 32.0 and not model.lora_config.shared_a
    assert model.train_config.val_schemes == () and data.max_tokens == 8192
    kinds = {type(c).__name__: c for c in trainer.callbacks}
    assert kinds["TimeBudget"].deadline == 1234.5 and not any(k.endswith("ProgressBar") for k in kinds)
    assert Path(kinds["ModelCheckpoint"].dirpath) == run_dir / "checkpoints"
    assert kinds["ExportAdapters"].out_dir == str(run_dir / "adapters") and kinds["ExportAdapters"].best
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        sweep.parse_sets(["data.max_tokens"])


# ------------------------------------------------------------------------------------------------ fake run dirs


def fake_run(root: Path, spec, val_losses: list[float], reason: str | None, adapters_bytes: int = 0) -> Path:
    """A run directory as the driver and a fit call leave it, with the given per-epoch val/loss."""
    d = root / spec.name
    (d / "csv" / "version_0").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({**sweep.asdict(spec), "name": spec.name}))
    with (d / "csv" / "version_0" / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["epoch", "step", "train/loss", "val/loss", "val/plan/loss", "val/plan/acc"])
        w.writeheader()
        for e, v in enumerate(val_losses):
            w.writerow({"epoch": e, "step": 10 * e + 5, "train/loss": 3.0, "val/loss": "", "val/plan/loss": ""})
            w.writerow({"epoch": e, "step": 10 * e + 9, "val/loss": v, "val/plan/loss": v + 0.1, "val/plan/acc": 0.5})
    if reason is not None:
        finished = reason in ("early_stopping", "max_epochs")
        record = {"reason": reason, "finished": finished, "global_step": 10 * len(val_losses), "wall_s": 5.0,
                  "train_s": 2.0, "train_tokens": 1000}  # fmt: skip
        (d / "fit_status.jsonl").write_text(json.dumps(record) + "\n")
    if adapters_bytes:
        for rel in ("plan/adapter_model.safetensors", "lragent_adapters.safetensors"):
            (d / "adapters" / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / "adapters" / rel).write_bytes(
                random.Random(f"{spec.name}/{rel}").randbytes(adapters_bytes)
            )  # incompressible
    return d


def test_pick_auto_takes_the_lowest_best_val_loss_of_finished_runs(tmp_path: Path) -> None:
    lrs, targets, ranks = [1e-3, 2e-3], ["qv"], [8, 16]
    grid = sweep.stage1_grid(lrs, targets, ranks)
    fake_run(tmp_path, grid[0], [3.0, 2.0, 2.2], "early_stopping", adapters_bytes=1024)
    fake_run(tmp_path, grid[1], [3.0, 1.0], "time_budget", adapters_bytes=1024)  # lower, but paused: no candidate
    fake_run(tmp_path, grid[2], [2.5, 1.9, 1.95], "max_epochs", adapters_bytes=1024)
    assert run_summary(tmp_path / grid[1].name)["status"] == "paused"
    assert sweep.pick_stage2(tmp_path, "auto", lrs, targets, ranks) == grid[2]
    fake_run(tmp_path, grid[3], [1.5], "early_stopping", adapters_bytes=2_000_000)  # best, but its set is 4 MB
    assert sweep.pick_stage2(tmp_path, "auto", lrs, targets, ranks) == grid[3]
    assert sweep.pick_stage2(tmp_path, "auto", lrs, targets, ranks, max_mb=3.0) == grid[2]
    assert sweep.pick_stage2(tmp_path, grid[0].name, lrs, targets, ranks) == grid[0]
    with pytest.raises(ValueError, match="is no stage-1 run"):
        sweep.pick_stage2(tmp_path, "hotpotqa_sharedA_lr9_qv_r8", lrs, targets, ranks)
    with pytest.raises(ValueError, match="no finished stage-1 run"):
        sweep.pick_stage2(tmp_path / "empty", "auto", lrs, targets, ranks)


def test_table_follows_the_logs(tmp_path: Path) -> None:
    spec = sweep.RunSpec("hotpotqa", True, 1e-3, "qv", 8)
    d = fake_run(tmp_path, spec, [3.0, 2.0, 2.2, 2.3], "early_stopping")
    (s,) = collect(tmp_path)
    assert (s["best"]["epoch"], s["best"]["val_loss"], s["status"], s["early_stopped"]) == (1, 2.0, "done", True)
    assert s["best"]["roles"]["plan"] == {"loss": 2.1, "acc": 0.5} and s["epochs"] == 4 and s["steps"] == 40
    _, md = sweep_report(tmp_path, {"device": {"name": "x", "type": "cpu"}})
    assert "| 2.0000 |" in md and "early stop" in md
    # Plant another value in the CSV: the table follows it.
    path = d / "csv" / "version_0" / "metrics.csv"
    path.write_text(path.read_text().replace("\n3,39,,2.3,2.4,", "\n3,39,,1.5,1.6,"))
    (s,) = collect(tmp_path)
    assert (s["best"]["epoch"], s["best"]["val_loss"], s["best"]["roles"]["plan"]["loss"]) == (3, 1.5, 1.6)
    _, md = sweep_report(tmp_path, {"device": {"name": "x", "type": "cpu"}})
    assert "| 1.5000 |" in md and "| 2.0000 |" not in md
    (d / "fit_status.jsonl").write_text(json.dumps({"reason": "time_budget", "finished": False}) + "\n")
    assert run_summary(d)["status"] == "paused" and "time budget" in sweep_report(tmp_path, {})[1]


# ---------------------------------------------------------------------------------------------- pack + install


def test_pack_cuts_big_files_and_install_copies_the_stage2_sets(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    chosen = sweep.RunSpec("hotpotqa", True, 1e-3, "qv", 8)
    stage2 = sweep.stage2_grid(chosen)
    for i, spec in enumerate(stage2):
        fake_run(root, spec, [2.0 + i], "early_stopping", adapters_bytes=4096)
    (root / sweep.STAGE2_FILE).write_text(json.dumps({"chosen": chosen.name, "runs": [s.name for s in stage2]}))
    out = tmp_path / "out"
    first = sweep.pack(root, out, stage1_adapters=0, max_files=3, skip=0, limit=10_000)
    assert len(first) == 3 and all(f.stat().st_size <= 10_000 for f in first)
    assert first[0].name == "sweep_table.md"
    rest = sweep.pack(root, out, stage1_adapters=0, max_files=3, skip=3, limit=10_000)
    names = sorted(f.name for f in first + rest)
    pieces = [out / n for n in names if n.startswith("adapters_stage2.tar.gz.part")]
    assert len(pieces) >= 2  # 4 sets x 8 KB do not fit one 10 KB file
    joined = tmp_path / "adapters.tar.gz"
    joined.write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    for spec in stage2:
        got = tmp_path / "x" / "runs" / spec.name / "adapters" / "lragent_adapters.safetensors"
        assert got.read_bytes() == (root / spec.name / "adapters" / "lragent_adapters.safetensors").read_bytes()
    with tarfile.open(out / "sweep_logs.tar.gz") as tar:
        assert "runs/sweep_table.json" in tar.getnames()
    written = sweep.install(root, tmp_path / "data_adapters", force=False)
    assert sorted(p.name for p in written) == ["hotpotqa_indepA", "hotpotqa_sharedA", "scienceqa_indepA",
                                               "scienceqa_sharedA"]  # fmt: skip
    copied = sorted(f.name for f in written[0].rglob("*"))
    assert copied == ["adapter_model.safetensors", "lragent_adapters.safetensors", "plan"]
    with pytest.raises(ValueError, match="MB > --max-mb 0.005"):
        sweep.install(root, tmp_path / "data_adapters", force=False, max_mb=0.005)
    (native,) = {tuple(sorted(f.name for f in p.rglob("*"))) for p in sweep.install(root, tmp_path / "n", False, True)}
    assert native == ("lragent_adapters.safetensors",)
    (root / stage2[3].name / "fit_status.jsonl").write_text(json.dumps({"reason": "time_budget", "finished": False}))
    with pytest.raises(ValueError, match="is paused, not done"):
        sweep.install(root, tmp_path / "data_adapters", force=False)


# ---------------------------------------------------------------------------------------------------- end to end


SWEEP_RUN = "hotpotqa_sharedA_lr0.02_qv_r4"


@pytest.fixture(scope="module")
def sweep_after_one_epoch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict]:
    """The driver's first launch (1 epoch) of one tiny run, shared by the two end-to-end tests below (each under a
    minute on two CPU cores; as one test they took 60-69 s). Gives the root, the common arguments and the run's
    summary after that epoch."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    configs, root = tiny_configs(tmp_path), tmp_path / "runs"
    common = ["--root", str(root), "--configs", str(configs), "--lrs", "2e-2", "--targets", "qv", "--ranks", "4",
              "--only", "lr0.02", "--budget", "300", "--min-launch", "10", "--poll", "0.5"]  # fmt: skip
    first = driver("run", "--stage", "1", "--max-epochs", "1", *common)
    assert first.returncode == 0, first.stdout + first.stderr
    return root, common, run_summary(root / SWEEP_RUN)


def test_driver_runs_a_job_and_does_not_relaunch_a_finished_one(sweep_after_one_epoch) -> None:
    root, common, s1 = sweep_after_one_epoch
    assert (s1["status"], s1["stop_reason"], s1["epochs"]) == ("done", "max_epochs", 1)
    assert (root / SWEEP_RUN / "adapters" / "lragent_adapters.safetensors").is_file()
    again = driver("run", "--stage", "1", "--max-epochs", "1", *common)  # finished: nothing to launch
    assert again.returncode == 0 and "launched" not in again.stdout
    status = driver("status", "--root", str(root))
    assert SWEEP_RUN in status.stdout and "done" in status.stdout


def test_driver_resumes_a_run_to_a_higher_cap_and_tabulates(sweep_after_one_epoch) -> None:
    root, common, s1 = sweep_after_one_epoch
    second = driver("run", "--stage", "1", "--max-epochs", "2", *common)  # a higher cap continues the run
    assert second.returncode == 0, second.stdout + second.stderr
    assert "--ckpt_path" in (root / SWEEP_RUN / "fit.log").read_text()
    s2 = run_summary(root / SWEEP_RUN)
    assert (s2["status"], s2["epochs"], s2["steps"]) == ("done", 2, 2 * s1["steps"])
    assert len((root / SWEEP_RUN / "launches.jsonl").read_text().splitlines()) == 2
    assert len(list((root / SWEEP_RUN / "csv").glob("version_*/metrics.csv"))) == 2  # one log per fit call
    table = json.loads((root / "sweep_table.json").read_text())
    assert table["provenance"]["command"].startswith("sweep_embedded.py run --stage 1")
    (row,) = [r for r in table["runs"] if r["name"] == SWEEP_RUN]
    assert row["best"] == s2["best"] and row["epochs"] == 2
