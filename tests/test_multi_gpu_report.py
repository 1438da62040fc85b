"""The several-GPU report (eval_suite/bench/multi_gpu_report.py) reads what gpu_multi.sh wrote, including cut calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def report():
    import eval_suite.bench.multi_gpu_report

    return eval_suite.bench.multi_gpu_report


def _speed(path: Path, tokens_per_s: float, world: int = 1, peak: float = 12.5) -> None:
    body = {"tokens_per_s": tokens_per_s / world, "global_step": 3, "ms_per_step": 1000.0, "steps": 2,
            "peak_memory_gib": peak, "provenance": {"device": {"type": "cuda"}}}  # fmt: skip
    if world > 1:
        ranks = [{"rank": r, "tokens_per_s": tokens_per_s / world, "steps": 2, "peak_memory_gib": peak}
                 for r in range(world)]  # fmt: skip
        body.update(world_size=world, global_tokens_per_s=tokens_per_s, ranks=ranks)
    path.write_text(json.dumps(body))


def _metrics(path: Path, losses: list[float]) -> None:
    path.write_text("epoch,step,val/loss,train/loss\n" + "".join(f"{i},{i},{v},\n" for i, v in enumerate(losses)))


def test_cut_call_speedups_and_skipped_phases(tmp_path: Path, report) -> None:
    (tmp_path / "timings.txt").write_text("b1 rc=0 seconds=52\nfsdp2 rc=0 seconds=58\nemb1s rc=124 seconds=19\n"
                                          "ddp8b2 rc=skipped seconds=0\n")  # fmt: skip
    _speed(tmp_path / "b1_speed.json", 8000.0, peak=20.0)
    _speed(tmp_path / "fsdp2_speed.json", 12000.0, world=2, peak=12.0)
    t = report.timings(tmp_path)
    assert t["emb1s"] == {"rc": 124, "seconds": 19} and t["ddp8b2"] == {"rc": "skipped", "seconds": 0}
    res = report.collect(tmp_path, "cmd", [2])
    f = res["fsdp_8b"]
    assert f["speed_fsdp2_speedup_tokens_per_s"] == pytest.approx(1.5)  # global tokens/s over one GPU's
    assert f["fsdp2_peak_memory_over_1gpu"] == pytest.approx(0.6)  # the largest rank's peak over one GPU's
    assert f["speed_ddp2"] is None and "speed_ddp2_speedup_tokens_per_s" not in f  # missing stays missing
    assert res["ddp_embedded"]["val_loss_1gpu"] is None
    md = report.markdown(res)
    assert "| FSDP, 2 devices | 12000 | 1.50x |" in md and "| ddp8b2 | skipped | 0 |" in md
    assert "DDP, 2 devices (the whole base on each) | missing | missingx" in md


def test_a_call_that_ran_some_phases_shows_only_their_sections(tmp_path: Path, report) -> None:
    _speed(tmp_path / "b1_speed.json", 8000.0, peak=20.0)  # FSDP's reference alone: DDP and eval never ran
    md = report.markdown(report.collect(tmp_path, "cmd", [2]))
    assert "Not in this output (none of their phases ran): DDP, eval --devices N." in md
    assert "## FSDP" in md and "## DDP" not in md and "## eval --devices" not in md
    _metrics(tmp_path / "emb1_metrics.csv", [2.0, 1.5])  # one DDP-block phase left a figure: its section is back
    md = report.markdown(report.collect(tmp_path, "cmd", [2]))
    assert "none of their phases ran): eval --devices N." in md and "## DDP" in md
    fsdp_only = tmp_path / "fsdp_only"  # a strategy's run without the one-GPU reference still has its section
    fsdp_only.mkdir()
    _speed(fsdp_only / "fsdp2_speed.json", 12000.0, world=2, peak=12.0)
    assert "## FSDP" in report.markdown(report.collect(fsdp_only, "cmd", [2]))
    empty = tmp_path / "empty"
    empty.mkdir()
    md = report.markdown(report.collect(empty, "cmd", [2]))
    assert "none of their phases ran): DDP, FSDP, eval --devices N." in md and "| 1 device |" not in md


def test_each_size_is_compared_with_one_gpu_and_the_seed_noise(tmp_path: Path, report) -> None:
    _metrics(tmp_path / "emb1_metrics.csv", [2.0, 1.5])
    _metrics(tmp_path / "emb1s_metrics.csv", [2.01, 1.52])  # seed noise 0.02 at the last validation
    _metrics(tmp_path / "ddp2_metrics.csv", [2.001, 1.51])  # 0.01: within
    _metrics(tmp_path / "ddp4_metrics.csv", [2.0, 1.53])  # 0.03: outside
    _speed(tmp_path / "emb1_speed.json", 1000.0)
    _speed(tmp_path / "ddp2_speed.json", 1900.0, world=2)
    _speed(tmp_path / "ddp4_speed.json", 3000.0, world=4)
    for name, qid_sets in (("ev1", [["a", "b", "c"]]), ("ev2", [["a", "b"], ["c"]]), ("ev4", [["a"], ["b"], ["x"]])):
        for i, qids in enumerate(qid_sets):
            d = tmp_path / name / "hotpotqa" / f"shard_{i}"
            d.mkdir(parents=True)
            (d / "episodes.jsonl").write_text("".join(json.dumps({"qid": q, "seed": 0, "prediction": q}) + "\n"
                                                      for q in qids))  # fmt: skip
    (tmp_path / "timings.txt").write_text("ev1 rc=0 seconds=100\nev2 rc=0 seconds=50\nev4 rc=1 seconds=20\n")
    res = report.collect(tmp_path, None, [2, 4])
    d = res["ddp_embedded"]
    assert d["ddp2_within_noise"] is True and d["ddp4_within_noise"] is False
    assert d["ddp2_speedup_tokens_per_s"] == pytest.approx(1.9) and d["ddp4_speedup_tokens_per_s"] == pytest.approx(3.0)
    e = res["eval_devices"]
    assert e["same_episodes_2"] is True and e["speedup_2"] == pytest.approx(2.0)
    # a failed phase: what it finished is checked (x is none of one GPU's episodes), no speed-up
    assert e["stopped_4"] == 1 and e["finished_equal_4"] is False and "same_episodes_4" not in e
    assert "speedup_4" not in e
    assert res["ddp_accuracy_model"]["speed_1gpu"] is None  # its phases did not run: missing, not zero
    md = report.markdown(res)
    assert "| DDP, 4 devices | [2.0000, 1.5300] | 3000 | 3.00x |" in md
    assert "Qwen" not in md  # no accuracy-model section without its runs


def test_sizes_are_checked(tmp_path: Path, report, capsys) -> None:
    assert report.main(["--out", str(tmp_path), "--sizes", "1 4"]) == 2
    assert "--sizes '1 4'" in capsys.readouterr().err


def test_scaling_curves_hold_only_measured_points(tmp_path: Path, report) -> None:
    _speed(tmp_path / "emb1_speed.json", 1000.0)
    _speed(tmp_path / "ddp4_speed.json", 3000.0, world=4)  # ddp2 not run
    res = report.collect(tmp_path, None, [2, 4])
    assert report.scaling_curves(res) == {"DDP, embedded model": [(1, 1.0), (4, pytest.approx(3.0))]}
    assert report.plot(res, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000
    assert not report.plot(report.collect(tmp_path / "none", None, [2]), tmp_path / "q.png")  # nothing measured


def test_more_seeds_widen_the_spread_that_ddp_is_held_to(tmp_path: Path, report) -> None:
    _metrics(tmp_path / "q1_metrics.csv", [3.0])
    _metrics(tmp_path / "q1s_metrics.csv", [3.0001])  # seed 1: +0.0001
    _metrics(tmp_path / "qddp4_metrics.csv", [2.9995])  # DDP: -0.0005, outside seed 1 alone
    assert report.collect(tmp_path, None, [4])["ddp_accuracy_model"]["ddp4_within_noise"] is False
    _metrics(tmp_path / "q1s3_metrics.csv", [3.0006])  # seed 3: +0.0006 (seed 2 not run)
    d = report.collect(tmp_path, None, [4])["ddp_accuracy_model"]
    assert d["seed_final_losses"] == {0: 3.0, 1: 3.0001, 3: 3.0006}
    assert d["seed_spread_last"] == pytest.approx(0.0006) and d["ddp4_within_noise"] is True


def test_rebuilt_off_device_names_the_runs_gpus_and_versions(tmp_path: Path, report, monkeypatch) -> None:
    """Merging two calls' outputs on a machine without CUDA: the page names the runs' GPUs, commits and versions."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for name, count, commit in (("b1", 1, "a" * 40), ("fsdp4", 4, "b" * 40)):
        body = {"tokens_per_s": 1.0, "provenance": {"device": {"type": "cuda", "name": "H100 X", "count": count},
                "git_commit": commit, "utc": "2026-11-27T01:00:00Z", "versions": {"torch": "2.11.0"}}}  # fmt: skip
        (tmp_path / f"{name}_speed.json").write_text(json.dumps(body))
    res = report.collect(tmp_path, "cmd", [4])
    assert res["provenance"]["gpus"] == ["H100 X"] * 4  # the widest run's device, not this machine's none
    md = report.markdown(res)
    assert "Devices: H100 X, H100 X, H100 X, H100 X." in md
    assert "Runs: commits aaaaaaa, bbbbbbb; dates 2026-11-27; torch 2.11.0." in md
    evals = tmp_path / "evals"  # a call of `ev` phases alone: the evals' run configs name the machine
    for name, commit in (("ev1", "c" * 40), ("ev4", "d" * 40)):
        (evals / name / "hotpotqa").mkdir(parents=True)
        prov = {"device": {"type": "cuda", "name": "H200 Y", "count": 4}, "git_commit": commit,
                "utc": "2026-11-28T05:00:00Z", "versions": {"torch": "2.11.0"}}  # fmt: skip
        (evals / name / "hotpotqa" / "run_config.json").write_text(json.dumps({"provenance": prov}))
    md = report.markdown(report.collect(evals, "cmd", [4]))
    assert "Devices: H200 Y, H200 Y, H200 Y, H200 Y." in md and "Runs: commits ccccccc, ddddddd; dates 2026-11-28" in md
    # a run that recorded no versions names none: no empty entry in the Runs line
    prov = {"device": {"type": "cuda", "name": "H200 Y", "count": 4}, "git_commit": "e" * 40, "utc": "2026-11-28"}
    (evals / "ev2" / "hotpotqa").mkdir(parents=True)
    (evals / "ev2" / "hotpotqa" / "run_config.json").write_text(json.dumps({"provenance": prov}))
    res = report.collect(evals, "cmd", [4])
    assert res["provenance"]["run_versions"] == ["torch 2.11.0"]
    assert "dates 2026-11-28; torch 2.11.0." in report.markdown(res)


def test_episode_loop_speedup_counts_the_slowest_shard_of_each_benchmark(tmp_path: Path, report) -> None:
    """eval --devices N against one process with the model loading left out: per benchmark the one process's loop
    against its slowest shard's, summed over benchmarks; a benchmark without timing gives no figure."""

    def timing(d: Path, seconds: float) -> None:
        d.mkdir(parents=True, exist_ok=True)
        body = {"setup_s": 30.0, "episodes_s": seconds, "episodes": 10, "decode_steps": int(10 * seconds),
                "advance_s": 0.6 * seconds, "agent_s": 0.3 * seconds, "startup_s": seconds / 10,
                "capture_s": seconds / 20}  # fmt: skip
        (d / "timing.json").write_text(json.dumps(body))

    timing(tmp_path / "ev1" / "hotpotqa", 80.0)
    timing(tmp_path / "ev1" / "scienceqa", 40.0)
    for i, (h, s) in enumerate(((20.0, 9.0), (25.0, 12.0), (18.0, 10.0), (21.0, 11.0))):
        timing(tmp_path / "ev4" / "hotpotqa" / f"shard_{i}", h)
        timing(tmp_path / "ev4" / "scienceqa" / f"shard_{i}", s)
    # the launcher of each --devices 4 benchmark: its own start and launch, summed over the benchmarks
    launch = {"devices": 4, "startup_s": 6.0, "launch_s": 0.0, "shard_wall_s": [1.0] * 4, "merge_s": 0.5}
    (tmp_path / "ev4" / "hotpotqa" / "launch.json").write_text(json.dumps({**launch, "launch_s": 1.5}))
    (tmp_path / "ev4" / "scienceqa" / "launch.json").write_text(json.dumps({**launch, "launch_s": 2.5}))
    timing(tmp_path / "ev2" / "hotpotqa" / "shard_0", 40.0)  # ev2's scienceqa has no timing: no figure
    (tmp_path / "ev2" / "scienceqa" / "shard_0").mkdir(parents=True)
    e = report.collect(tmp_path, None, [2, 4])["eval_devices"]
    assert e["episode_loop_seconds_1"] == pytest.approx(120.0)
    assert e["episode_loop_seconds_4"] == pytest.approx(25.0 + 12.0)  # the slowest shard of each benchmark
    assert e["loop_speedup_4"] == pytest.approx(120.0 / 37.0)
    assert e["episode_loop_seconds_2"] is None and "loop_speedup_2" not in e
    assert e["decode_steps_1"] == 1200 and e["decode_steps_4"] == 250 + 120  # the busiest shard's steps
    assert e["advance_s_4"] == pytest.approx(0.6 * 37.0) and e["agent_s_1"] == pytest.approx(0.3 * 120.0)
    assert e["startup_s_4"] == pytest.approx(2.5 + 1.2) and e["setup_s_1"] == pytest.approx(60.0)
    assert e["launch_s_4"] == pytest.approx(6.0 + 1.5 + 6.0 + 2.5) and e["launch_s_2"] is None  # ev2: no launch.json
    md = report.markdown(report.collect(tmp_path, None, [4]))
    assert "episode loops alone (the slowest shard) 120.0 vs 37.0 s, 3.24x; decode steps of the busiest process" in md
    assert "in the engine's decode calls 72.0 vs 22.2 and in the episodes' own work 36.0 vs 11.1;" in md
    assert "its start (interpreter, imports) 12.0 vs 3.7 and setup (corpus, model, sizing) 60.0 vs 60.0" in md
    assert "the graph captures (kernel compiles included) 6.0 vs 1.9; the launcher's own start 16.0 s." in md
    # how evenly the shards shared each benchmark: their episodes, steps, and the slowest loop over the mean
    bal = e["balance_4"]["hotpotqa"]
    assert bal["episodes"] == [10] * 4 and bal["decode_steps"] == [200, 250, 180, 210]
    assert bal["slowest_over_mean"] == pytest.approx(25.0 / 21.0)
    assert e["balance_4"]["scienceqa"]["slowest_over_mean"] == pytest.approx(12.0 / 10.5)
    assert e["balance_2"] is None  # ev2's scienceqa shard has no timing
    assert "  - hotpotqa shards: episodes [10, 10, 10, 10], decode steps [200, 250, 180, 210]; slowest loop 1.19x" in md


def test_a_stopped_eval_phase_is_checked_on_what_it_finished_and_not_timed(tmp_path: Path, report) -> None:
    """A phase the call's budget stopped (exit 124) is not 'different records': its finished episodes are checked
    against one device's, and it gets no speed-up; a finished phase is compared whole."""

    def eps(d: Path, qids: list[str], pred: str = "x") -> None:
        d.mkdir(parents=True, exist_ok=True)
        rows = [{"qid": q, "seed": 1, "prediction": pred, "num_tokens": 5, "steps": 1} for q in qids]
        (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "timing.json").write_text(json.dumps({"setup_s": 1.0, "episodes_s": 10.0 * len(qids)}))

    eps(tmp_path / "ev1" / "hotpotqa", ["a", "b", "c", "d"])
    eps(tmp_path / "ev4" / "hotpotqa" / "shard_0", ["a", "c"])
    eps(tmp_path / "ev4" / "hotpotqa" / "shard_1", ["b", "d"])
    eps(tmp_path / "ev2" / "hotpotqa" / "shard_0", ["a"])  # stopped after one episode
    (tmp_path / "timings.txt").write_text("ev1 rc=0 seconds=100\nev4 rc=0 seconds=40\nev2 rc=124 seconds=30\n")
    e = report.collect(tmp_path, None, [2, 4])["eval_devices"]
    assert e["stopped_2"] == 124 and e["finished_equal_2"] is True
    assert "same_episodes_2" not in e and "speedup_2" not in e and "loop_speedup_2" not in e
    assert e["same_episodes_4"] is True and e["speedup_4"] == pytest.approx(2.5)
    md = report.markdown(report.collect(tmp_path, None, [2, 4]))
    assert "2 devices: stopped (exit 124) after 1 episodes; each of them equal to one device's: True" in md
    eps(tmp_path / "ev2" / "hotpotqa" / "shard_0", ["a"], pred="y")  # a finished episode that differs
    assert report.collect(tmp_path, None, [2])["eval_devices"]["finished_equal_2"] is False


def test_the_peft_line_names_the_worst_diff_and_whether_the_adapters_were_resolved() -> None:
    from eval_suite.bench.multi_gpu_report import _peft_detail

    roles = {"plan": {"rel_diff": 2e-6, "resolved": True}, "action": {"rel_diff": 7e-6, "resolved": False}}
    assert _peft_detail({"ok": True, "rel_tol": 1e-5, "roles": roles}) == (
        " (largest relative diff 7.00e-06 against 1e-05; the adapters' effect resolved: no)"
    )
    roles["action"]["resolved"] = True
    assert _peft_detail({"rel_tol": 1e-5, "roles": roles}).endswith("resolved: yes)")
    old = {"rel_tol": 0.03, "roles": {"plan": {"rel_diff": 0.0485}}}  # a record from before the key
    assert _peft_detail(old) == " (largest relative diff 4.85e-02 against 0.03)"
    assert _peft_detail({}) == ""


def test_the_loop_per_decode_step_sums_every_process(tmp_path: Path, report) -> None:
    """Per decode step, over every process of a run (all shards summed): the wait for the GPU, the replay calls, the
    engine's other host work and the episodes' work, in ms; the report's line shows 1 vs N; runs whose timing.json
    lacks a figure (kept before replay_s / wait_s) give none."""

    def timing(d: Path, steps: int, wait: float, replay: float, advance: float, agent: float) -> None:
        d.mkdir(parents=True, exist_ok=True)
        body = {"episodes_s": 1.0, "decode_steps": steps, "wait_s": wait, "replay_s": replay, "advance_s": advance,
                "agent_s": agent}  # fmt: skip
        (d / "timing.json").write_text(json.dumps(body))

    timing(tmp_path / "ev1" / "hotpotqa", 1000, 6.0, 0.5, 7.0, 1.0)
    body = json.loads((tmp_path / "ev1" / "hotpotqa" / "timing.json").read_text())
    body["capture_s"] = 0.4  # of advance_s: a fixed cost, not a step's host work
    (tmp_path / "ev1" / "hotpotqa" / "timing.json").write_text(json.dumps(body))
    timing(tmp_path / "ev1" / "scienceqa", 1000, 6.0, 0.5, 7.0, 3.0)
    timing(tmp_path / "ev4" / "hotpotqa" / "shard_0", 300, 1.8, 0.3, 2.7, 0.3)
    timing(tmp_path / "ev4" / "hotpotqa" / "shard_1", 200, 1.2, 0.2, 1.8, 0.2)
    assert report.per_step_ms(tmp_path / "ev1") == pytest.approx((6.0, 0.5, 0.3, 2.0))
    assert report.per_step_ms(tmp_path / "ev4") == pytest.approx((6.0, 1.0, 2.0, 1.0))  # 500 steps over both shards
    md = report.markdown(report.collect(tmp_path, None, [4]))
    line = (
        "  - per decode step, all processes together, 1 vs 4 devices (ms): waiting for the GPU 6.00 vs 6.00; graph "
        "replay calls 0.50 vs 1.00; the engine's other host work 0.30 vs 2.00; the episodes' work 2.00 vs 1.00."
    )
    assert line in md
    old = tmp_path / "old" / "hotpotqa"
    timing(old, 10, 1.0, 0.1, 1.5, 0.5)
    body = json.loads((old / "timing.json").read_text())
    del body["replay_s"]
    (old / "timing.json").write_text(json.dumps(body))
    assert report.per_step_ms(tmp_path / "old") is None and report.per_step_ms(tmp_path / "missing") is None


def test_an_eval_run_in_one_call_per_benchmark_counts_as_one_phase(tmp_path: Path, report) -> None:
    """gpu_multi.sh's evN-<benchmark> phases (one benchmark per call) make evN: the parts' seconds summed, the first
    failing part's status; a plain evN that ran stays as it is."""
    (tmp_path / "timings.txt").write_text(
        "ev1-hotpotqa rc=0 seconds=300\nev1-scienceqa rc=0 seconds=150\nev4 rc=0 seconds=140\n"
        "ev2-hotpotqa rc=0 seconds=160\nev2-scienceqa rc=124 seconds=40\nev4-hotpotqa rc=0 seconds=1\n"
    )
    t = report.timings(tmp_path)
    assert t["ev1"] == {"rc": 0, "seconds": 450} and t["ev2"] == {"rc": 124, "seconds": 200}
    assert t["ev4"] == {"rc": 0, "seconds": 140}  # ran whole: its parts do not replace it
    e = report.collect(tmp_path, None, [2, 4])["eval_devices"]
    assert e["wall_seconds_1"] == 450 and e["speedup_4"] == pytest.approx(450 / 140)
    assert e["stopped_2"] == 124 and "speedup_2" not in e


def test_the_queue_bound_list_schedules_one_devices_episode_times(tmp_path: Path, report) -> None:
    """What the episodes' lengths allow --devices N: one device's episode times (wall_s), scheme by scheme, scheduled
    on one process of its rows and on N of them. Worked by hand: rows take the next episode as they free up, and a
    process whose rows have emptied starts the next scheme while another still finishes the last one's."""
    assert report.list_schedule_s([], 2) == 0.0
    assert report.list_schedule_s([3.0, 1.0, 1.0, 1.0], 2) == pytest.approx(3.0)  # row 2 takes 1, 1, 1
    assert report.list_schedule_s([1.0, 1.0, 1.0, 3.0], 2) == pytest.approx(4.0)  # the long one last: a tail
    assert report.list_schedule_s([1.0, 1.0, 1.0, 3.0], 4) == pytest.approx(3.0)
    d = tmp_path / "ev1" / "hotpotqa"
    d.mkdir(parents=True)
    (d / "timing.json").write_text(json.dumps({"batch": 2}))
    recs = [("a", 1.0), ("a", 1.0), ("a", 1.0), ("a", 3.0), ("b", 2.0), ("b", 2.0)]  # two schemes, one after the other
    lines = (json.dumps({"qid": f"q{i}", "row": r, "wall_s": w}) + "\n" for i, (r, w) in enumerate(recs))
    (d / "episodes.jsonl").write_text("".join(lines))
    bound = report.queue_bound(tmp_path / "ev1", 2)
    # one process: a's rows take 1+1+... (ends at 4: the 3 s one starts at 1), then b's two at once (2): 6 s. Two
    # processes of 2 rows: the first takes a's 1, 1 and at 1 s starts b's 2, 2 (ends at 3); the second takes a's
    # 1 and 3 (ends at 3): 3 s
    assert bound == pytest.approx({"loop_s_1": 4.0 + 2.0, "loop_s_2": 3.0, "bound": 6.0 / 3.0})
    # each scheme is its own queue: a's 3 s episode holds a's rows while b waits (3 + 1 s), where one queue of all
    # four episodes would take 3 s
    e = tmp_path / "ev2" / "hotpotqa"
    e.mkdir(parents=True)
    (e / "timing.json").write_text(json.dumps({"batch": 2}))
    recs2 = [("a", 3.0), ("a", 1.0), ("b", 1.0), ("b", 1.0)]
    (e / "episodes.jsonl").write_text(
        "".join(json.dumps({"qid": f"q{i}", "row": r, "wall_s": w}) + "\n" for i, (r, w) in enumerate(recs2))
    )
    assert report.queue_bound(tmp_path / "ev2", 2)["loop_s_1"] == pytest.approx(4.0)
    (d / "timing.json").write_text(json.dumps({}))  # no rows (the sequential executor): no bound
    assert report.queue_bound(tmp_path / "ev1", 2) is None
    (d / "timing.json").write_text(json.dumps({"batch": 2}))
    ev4 = tmp_path / "ev4" / "hotpotqa" / "shard_0"
    ev4.mkdir(parents=True)
    (ev4 / "timing.json").write_text(json.dumps({"episodes_s": 1.0}))
    md = report.markdown(report.collect(tmp_path, None, [2]))
    assert "scheme by scheme on one process of its rows and on 2 of them, 6.0 vs 3.0 s, at most **2.00x**" in md


def test_stages_run_in_turn_per_process_and_one_stage_is_a_list_schedule(report) -> None:
    """stage_schedule_s: one stage on P processes of R rows is list_schedule_s on P*R rows (random durations), and a
    process moves to the next stage only once its own rows have emptied (worked by hand)."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        d = [rng.uniform(0.1, 5.0) for _ in range(rng.randint(0, 40))]
        procs, rows = rng.randint(1, 4), rng.randint(1, 5)
        assert report.stage_schedule_s([d], procs, rows) == pytest.approx(report.list_schedule_s(d, procs * rows))
    # one process of 2 rows: stage 1 [3, 1] ends at 3 (the row that freed at 1 waits), then stage 2 [1, 1]: 4
    assert report.stage_schedule_s([[3.0, 1.0], [1.0, 1.0]], 1, 2) == pytest.approx(4.0)
    # two processes of 1 row: p0 takes 3, p1 takes 1 and at 1 s, stage 1 empty, moves on: 1, 1 -> ends at 3
    assert report.stage_schedule_s([[3.0, 1.0], [1.0, 1.0]], 2, 1) == pytest.approx(3.0)
    assert report.stage_schedule_s([[], [2.0]], 1, 3) == pytest.approx(2.0)  # an empty stage is passed through
    assert report.stage_schedule_s([], 2, 2) == 0.0


def test_one_launch_over_both_benchmarks_counts_each_shard_whole(tmp_path: Path, report) -> None:
    """eval --benchmark a,b --devices N (launch.json at the top names the benchmarks): each shard process ran both, so
    its loop is its own sum and the busiest shard is the one whose sum is largest (not the slowest shard of each
    benchmark added up); the launcher's start counts once; the queue bound runs both benchmarks without a barrier."""

    def timing(d: Path, seconds: float, startup: float, batch: int = 2) -> None:
        d.mkdir(parents=True, exist_ok=True)
        body = {"episodes_s": seconds, "startup_s": startup, "decode_steps": int(seconds), "batch": batch}
        (d / "timing.json").write_text(json.dumps(body))

    for i, (h, s) in enumerate(((20.0, 9.0), (25.0, 2.0), (18.0, 10.0))):
        timing(tmp_path / "ev3" / "hotpotqa" / f"shard_{i}", h, 5.0)
        timing(tmp_path / "ev3" / "scienceqa" / f"shard_{i}", s, 0.0)  # the process was up: its start counted once
    launch = {"devices": 3, "startup_s": 6.0, "launch_s": 0.5, "shard_wall_s": [1.0] * 3, "merge_s": 0.5}
    (tmp_path / "ev3" / "launch.json").write_text(json.dumps({**launch, "benchmarks": ["hotpotqa", "scienceqa"]}))
    assert report.combined_launch(tmp_path / "ev3")
    assert report.busiest_process(tmp_path / "ev3", "episodes_s") == pytest.approx(29.0)  # shard 0: 20 + 9
    assert report.busiest_process(tmp_path / "ev3", "startup_s") == pytest.approx(5.0)
    assert report.launch_seconds(tmp_path / "ev3") == pytest.approx(6.5)
    (tmp_path / "ev3" / "launch.json").write_text(json.dumps(launch))  # one launch per benchmark, as before
    assert not report.combined_launch(tmp_path / "ev3")
    assert report.busiest_process(tmp_path / "ev3", "episodes_s") == pytest.approx(25.0 + 10.0)
    # the bound: one device ran hotpotqa [3, 1] then scienceqa [1, 1] on 2 rows; two processes of 2 rows
    for bench, walls in (("hotpotqa", [3.0, 1.0, 1.0, 1.0]), ("scienceqa", [1.0, 1.0])):
        timing(tmp_path / "ev1" / bench, 0.0, 0.0)
        lines = (json.dumps({"qid": f"q{i}", "row": "s", "wall_s": w}) + "\n" for i, w in enumerate(walls))
        (tmp_path / "ev1" / bench / "episodes.jsonl").write_text("".join(lines))
    apart = report.queue_bound(tmp_path / "ev1", 2)
    together = report.queue_bound(tmp_path / "ev1", 2, combined=True)
    # one device: hotpotqa's rows end at 3 (3 | 1, 1, 1), scienceqa's at 1 more: 4 either way. Two processes of 2 rows:
    # apart, hotpotqa ends at 3 (one row runs the 3 s episode), then scienceqa at 1 more; together, the second
    # process takes scienceqa's two at 1 s while the first still runs the 3 s one: 3
    assert apart == pytest.approx({"loop_s_1": 4.0, "loop_s_2": 4.0, "bound": 1.0})
    assert together == pytest.approx({"loop_s_1": 4.0, "loop_s_2": 3.0, "bound": 4.0 / 3.0})
    # one launch per benchmark may size each with its own rows: scienceqa on 1 row takes 2 s alone, 1 s on two
    timing(tmp_path / "ev1" / "scienceqa", 0.0, 0.0, batch=1)
    apart = report.queue_bound(tmp_path / "ev1", 2)
    assert apart == pytest.approx({"loop_s_1": 3.0 + 2.0, "loop_s_2": 3.0 + 1.0, "bound": 5.0 / 4.0})
    assert report.queue_bound(tmp_path / "ev1", 2, combined=True) is None  # one process: one row count, or no bound


def test_a_phase_resumed_in_a_later_call_counts_once_with_both_calls_seconds(tmp_path: Path, report) -> None:
    """An eval stopped at one call's limit (exit 124) and resumed from its log in the next call: one phase, the
    calls' seconds summed, the last status; a later call that skipped the phase changes nothing."""
    (tmp_path / "timings.txt").write_text(
        "ev1-hotpotqa rc=124 seconds=590\nev1-scienceqa rc=0 seconds=300\nev1-hotpotqa rc=0 seconds=120\n"
        "ev4 rc=0 seconds=200\nev4 rc=skipped seconds=0\nev2 rc=skipped seconds=0\nev2 rc=0 seconds=90\n"
    )
    t = report.timings(tmp_path)
    assert t["ev1-hotpotqa"] == {"rc": 0, "seconds": 710, "calls": 2}
    assert t["ev1"] == {"rc": 0, "seconds": 1010}  # the benchmarks joined
    assert t["ev4"] == {"rc": 0, "seconds": 200}
    assert t["ev2"] == {"rc": 0, "seconds": 90}  # skipped in one call, run in the next: one call ran it


def test_a_reference_resumed_in_a_later_call_has_its_second_start_taken_out(tmp_path: Path, report) -> None:
    """The one-GPU eval stopped at a call's limit and resumed: its second process's start, setup and captures are in
    the phase's wall but not in a run in one go, so the speed-up is also given without them (taken from the resumed
    parts of timing.json); a run in one go has none."""
    (tmp_path / "timings.txt").write_text("ev1 rc=124 seconds=590\nev1 rc=0 seconds=130\nev2 rc=0 seconds=360\n")
    parts = [{"startup_s": 13.0, "setup_s": 3.0, "capture_s": 1.0, "episodes_s": 570.0},
             {"startup_s": 14.0, "setup_s": 2.5, "capture_s": 1.5, "episodes_s": 100.0}]  # fmt: skip
    for bench, ps in (("hotpotqa", parts), ("scienceqa", [{"startup_s": 0.0, "setup_s": 2.0, "episodes_s": 9.0}])):
        (tmp_path / "ev1" / bench).mkdir(parents=True)
        (tmp_path / "ev1" / bench / "timing.json").write_text(json.dumps({"parts": ps}))
    for bench in ("hotpotqa", "scienceqa"):
        for i in (0, 1):
            d = tmp_path / "ev2" / bench / f"shard_{i}"
            d.mkdir(parents=True)
            (d / "timing.json").write_text(json.dumps({"parts": [{"startup_s": 13.0, "episodes_s": 1.0}]}))
    (tmp_path / "ev2" / "launch.json").write_text(json.dumps({"benchmarks": ["hotpotqa", "scienceqa"]}))
    e = report.collect(tmp_path, None, [2])["eval_devices"]
    assert e["restart_s_1"] == pytest.approx(14.0 + 2.5 + 1.5) and e["restart_s_2"] == 0.0
    assert e["speedup_2"] == pytest.approx(720 / 360)
    assert e["speedup_2_less_restarts"] == pytest.approx((720 - 18.0) / 360)
    md = report.markdown(report.collect(tmp_path, None, [2]))
    assert "(18.0 vs 0.0 s of start, setup and captures): without it the speed-up is **1.95x**" in md


def test_repeated_fits_are_pooled_and_each_pair_is_shown(tmp_path: Path, report) -> None:
    """emb1/ddp4 and their repeats emb1r2/ddp4r2 (the measured pair of 2026-11-28: 95,248 and 109,741 tokens/s on one
    GPU, 338,015 and 333,844 on four): the speed-up is that of the pooled rates, 3.28x, not the first pair's 3.55x, and
    each pair's ratio is listed; without repeats the single pair stands."""
    _speed(tmp_path / "emb1_speed.json", 95248.0)
    _speed(tmp_path / "ddp4_speed.json", 338015.0, world=4)
    first = report.collect(tmp_path, None, [4])["ddp_embedded"]
    assert first["ddp4_speedup_tokens_per_s"] == pytest.approx(3.549, 1e-3) and "ddp4_repeats" not in first
    _speed(tmp_path / "emb1r2_speed.json", 109741.0)
    _speed(tmp_path / "ddp4r2_speed.json", 333844.0, world=4)
    d = report.collect(tmp_path, None, [4])["ddp_embedded"]
    pooled = ((338015.0 + 333844.0) / 2) / ((95248.0 + 109741.0) / 2)
    assert d["ddp4_speedup_tokens_per_s"] == pytest.approx(pooled) and pooled == pytest.approx(3.278, 1e-3)
    assert d["ddp4_repeats"]["speedup_paired"] == pytest.approx([338015 / 95248, 333844 / 109741])
    md = report.markdown(report.collect(tmp_path, None, [4]))
    assert "| DDP, 4 devices: every repeat pooled | | one device 95248, 109741; DDP 338015, 333844 |" in md
    assert "repeat by repeat 3.55x, 3.04x |" in md and "| 3.28x |" in md


def test_each_repeat_pair_s_val_loss_difference_is_reported(tmp_path: Path, report) -> None:
    """A repeat pair (emb1rK, ddp4rK: the same seeds) gets its own DDP - one GPU val/loss difference, each judged
    against the seed spread: one repeat outside it makes the verdict False; repeats of one side only give none."""
    _metrics(tmp_path / "emb1_metrics.csv", [2.0, 1.5])
    _metrics(tmp_path / "emb1s_metrics.csv", [2.01, 1.52])  # seed spread 0.02 at the last validation
    _metrics(tmp_path / "ddp4_metrics.csv", [2.0, 1.51])
    _metrics(tmp_path / "emb1r2_metrics.csv", [2.0, 1.50])
    _metrics(tmp_path / "ddp4r2_metrics.csv", [2.002, 1.515])  # +0.015: within
    _metrics(tmp_path / "emb1r3_metrics.csv", [2.0, 1.50])  # no ddp4r3: no pair 3
    d = report.collect(tmp_path, None, [4])["ddp_embedded"]
    assert list(d["ddp4_minus_1gpu_repeats"]) == [2]
    assert d["ddp4_minus_1gpu_repeats"][2] == pytest.approx([0.002, 0.015])
    assert d["ddp4_repeats_within_noise"] is True
    md = report.markdown(report.collect(tmp_path, None, [4]))
    assert "DDP on 4 - 1 device, repeat 2: [0.002000, 0.015000]." in md
    _metrics(tmp_path / "ddp4r3_metrics.csv", [2.0, 1.53])  # +0.03: outside
    d = report.collect(tmp_path, None, [4])["ddp_embedded"]
    assert d["ddp4_repeats_within_noise"] is False and d["ddp4_minus_1gpu_repeats"][3] == pytest.approx([0.0, 0.03])


def test_host_split_counts_each_phase_per_micro_batch_and_leaves_the_wait(tmp_path: Path, report) -> None:
    """Per rank: the micro-batch (CUDA events), the host's time between the hooks (each phase's mean times its count,
    over the timed micro-batches: an optimizer step every 4th counts a quarter) and the rest; in the Markdown."""
    phases = {"host": {"forward": 60.0, "backward": 70.0, "optimizer": 8.0},
              "count": {"forward": 8, "backward": 8, "optimizer": 2}}  # fmt: skip
    one = {"steps": 8, "ms_per_step": 140.0, "phases_ms": phases}
    (tmp_path / "emb1_speed.json").write_text(json.dumps(one))
    for r, wait in ((0, 5.0), (1, 25.0)):
        rank = {"rank": r, "steps": 2, "ms_per_step": 140.0 + wait,
                "phases_ms": {"host": {"forward": 60.0, "backward": 70.0, "optimizer": 10.0},
                              "count": {"forward": 2, "backward": 2, "optimizer": 2}}}  # fmt: skip
        (tmp_path / f"ddp4_speed.rank{r}.json").write_text(json.dumps(rank))
    assert report.host_split(tmp_path, "emb1") == [{"rank": 0, "step_ms": 140.0, "host_ms": 132.0, "rest_ms": 8.0}]
    split = report.host_split(tmp_path, "ddp4")
    assert [(r["rank"], r["host_ms"], r["rest_ms"]) for r in split] == [(0, 140.0, 5.0), (1, 140.0, 25.0)]
    (tmp_path / "ddp2_speed.rank0.json").write_text(json.dumps({"steps": 2, "ms_per_step": 1.0}))
    assert report.host_split(tmp_path, "ddp2") is None  # no phases: nothing to split
    md = report.markdown(report.collect(tmp_path, None, [4]))
    assert "- 1 device: rank 0 140.0 / 132.0 / 8.0" in md
    assert "- DDP, 4 devices: rank 0 145.0 / 140.0 / 5.0; rank 1 165.0 / 140.0 / 25.0" in md


def test_an_out_that_is_no_folder_is_refused_and_left_as_it_is(tmp_path: Path, report, capsys) -> None:
    out = tmp_path / "multi_gpu.txt"
    out.write_text("a file")
    assert report.main(["--out", str(out), "--sizes", "2"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out {out} is not a directory")
    assert out.read_text() == "a file" and not (tmp_path / "multi_gpu.json").exists()


def test_lines_of_timings_that_are_not_phase_records_are_skipped(tmp_path: Path, report) -> None:
    """Only ``phase rc=N seconds=S`` lines count; a note, a cut line or a wrong field leaves the phases as they are."""
    (tmp_path / "timings.txt").write_text("b1 rc=0 seconds=52\n# a note\nfsdp2 rc=0\nfsdp2 status=0 seconds=3\n"
                                          "fsdp2 rc=1 seconds=9\n\nemb1 rc=0 took=4\n")  # fmt: skip
    assert report.timings(tmp_path) == {"b1": {"rc": 0, "seconds": 52}, "fsdp2": {"rc": 1, "seconds": 9}}


def _export(directory: Path, value: float) -> None:
    import torch
    from safetensors.torch import save_file

    (directory / "plan").mkdir(parents=True)
    save_file({"a": torch.full((2, 4), value), "b": torch.zeros(3)}, str(directory / "lragent_adapters.safetensors"))
    (directory / "plan" / "adapter_config.json").write_text(
        json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA", "target_modules": ["v_proj", "q_proj"]})
    )


def test_exports_are_compared_by_their_layout_and_largest_difference(tmp_path: Path, report) -> None:
    """An export folder's files, tensor shapes and PEFT configs are read; two exports of the same layout compare
    equal, one with another file does not, and the fit's export against the export command's gives the largest
    absolute difference (none where a native file is missing)."""
    _export(tmp_path / "b1_export", 0.0)
    _export(tmp_path / "fsdp2r_export", 1.0)
    _export(tmp_path / "fx2_export", 1.25)
    (tmp_path / "fx2_export" / "notes.txt").write_text("an extra file")
    layout = report.export_layout(tmp_path / "b1_export")
    assert layout["files"] == ["lragent_adapters.safetensors", "plan/adapter_config.json"]
    assert layout["tensors"] == {"lragent_adapters.safetensors": {"a": [2, 4], "b": [3]}}
    assert layout["peft_configs"]["plan/adapter_config.json"] == {"r": 8, "lora_alpha": 16, "peft_type": "LORA",
                                                                  "target_modules": ["q_proj", "v_proj"]}  # fmt: skip
    f = report.collect(tmp_path, None, [2])["fsdp_8b"]
    assert f["export_layout_1gpu"] == layout
    assert f["export_fsdp2r_same_format_as_1gpu"] is True and f["export_fx2_same_format_as_1gpu"] is False
    assert f["fsdp2_export_fit_vs_export_command_max_abs_diff"] == pytest.approx(0.25)
    assert report.max_abs_diff(tmp_path / "b1_export", tmp_path / "fsdp2r_export") == pytest.approx(1.0)
    (tmp_path / "fx2_export" / "lragent_adapters.safetensors").unlink()
    assert report.max_abs_diff(tmp_path / "fsdp2r_export", tmp_path / "fx2_export") is None


def test_the_report_writes_json_and_markdown_and_links_the_plot_only_when_one_was_drawn(tmp_path: Path, report) -> None:
    """Nothing measured: json and md, no plot and no image line. A measured speed-up: the plot and its line."""
    (tmp_path / "timings.txt").write_text("b1 rc=0 seconds=5\n")
    assert report.multi_gpu_report(str(tmp_path), command="cmd", sizes="2") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multi_gpu.json", "multi_gpu.md", "timings.txt"]
    assert json.loads((tmp_path / "multi_gpu.json").read_text())["phases"] == {"b1": {"rc": 0, "seconds": 5}}
    md = (tmp_path / "multi_gpu.md").read_text()
    assert "| b1 | 0 | 5 |" in md and "multi_gpu.png" not in md
    _speed(tmp_path / "emb1_speed.json", 1000.0)
    _speed(tmp_path / "ddp2_speed.json", 1800.0, world=2)
    assert report.multi_gpu_report(str(tmp_path), sizes="2") == 0
    assert (tmp_path / "multi_gpu.png").stat().st_size > 1000
    assert (tmp_path / "multi_gpu.md").read_text().endswith("\n![speed-up against GPUs](multi_gpu.png)\n")
    assert json.loads((tmp_path / "multi_gpu.json").read_text())["ddp_embedded"]["ddp2_speedup_tokens_per_s"] == (
        pytest.approx(1.8)
    )


def _write(path: Path, body) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body if isinstance(body, str) else json.dumps(body))


def _full_output(out: Path) -> None:
    """A gpu_multi.sh output with every phase's files (sizes 2 and 4): binary-exact losses, distinct figures."""
    _write(
        out / "timings.txt",
        "emb1 rc=0 seconds=61\nddp2 rc=0 seconds=35\nb1 rc=0 seconds=52\n"
        "fsdp2 rc=0 seconds=58\nev1 rc=0 seconds=400\nev2 rc=124 seconds=590\nev4 rc=0 seconds=130\n",
    )
    _write(out / "emb_model.txt", "embedded SmolLM2-360M\n")
    # DDP, embedded model: three validations; seed 1 and seed 2 (seed 10 is past gpu_multi.sh's 2..9: not read)
    for name, losses in (
        ("emb1", [2.5, 2.0, 1.5]),
        ("emb1s", [2.5625, 2.0, 1.4375]),
        ("emb1s2", [2.5, 2.0, 1.625]),
        ("emb1s10", [2.5, 2.0, 3.0]),
        ("ddp2", [2.53125, 2.0, 1.625]),
        ("ddp4", [2.5, 2.0, 1.25]),
        ("emb1r2", [2.5, 2.0, 1.5]),
        ("ddp4r2", [2.5, 2.5, 1.375]),
    ):
        _metrics(out / f"{name}_metrics.csv", losses)
    for name, rate, world in (
        ("emb1", 1000.0, 1),
        ("emb1r2", 1250.0, 1),
        ("ddp2", 1900.0, 2),
        ("ddp4", 3600.0, 4),
        ("ddp4r2", 4000.0, 4),
        ("q1", 500.0, 1),
        ("qddp2", 900.0, 2),
    ):
        _speed(out / f"{name}_speed.json", rate, world=world)
    for path in out.glob("*_speed.json"):  # the runs' own provenance: only where a test sets it
        _write(path, {k: v for k, v in json.loads(path.read_text()).items() if k != "provenance"})
    body = json.loads((out / "emb1_speed.json").read_text())  # the host's phases: the optimizer's count not kept
    body.update(
        tokens=400000,
        seconds=400.0,
        peak_reserved_gib=14.5,
        steps=4,
        ms_per_step=100.0,
        phases_ms={
            "host": {"forward": 30.0, "backward": 50.0, "optimizer": 8.0},
            "count": {"forward": 4, "backward": 4},
        },
    )
    body["provenance"] = {
        "device": {"type": "cuda", "name": "H100 X", "count": 4},
        "git_commit": "a" * 40,
        "utc": "2026-11-27T01:00:00Z",
        "versions": {"torch": "2.11.0", "peft": "0.17.0"},
    }
    _write(out / "emb1_speed.json", body)
    for r, ms in ((0, 110.0), (1, 125.0)):
        _write(
            out / f"ddp2_speed.rank{r}.json",
            {
                "rank": r,
                "steps": 2,
                "ms_per_step": ms,
                "phases_ms": {"host": {"forward": 40.0, "backward": 60.0}, "count": {"forward": 2, "backward": 2}},
            },
        )
    _metrics(out / "q1_metrics.csv", [3.0])
    _metrics(out / "qddp2_metrics.csv", [3.125])
    # FSDP at 8B shapes: one GPU, FSDP on 2 (its ranks' peaks differ), resumed, DDP; exports and the PEFT check
    _speed(out / "b1_speed.json", 8000.0, peak=20.0)
    _speed(out / "fsdp2r_speed.json", 11000.0, world=2, peak=12.5)
    _speed(out / "ddp8b2_speed.json", 10000.0, world=2, peak=30.0)
    body = {
        "tokens_per_s": 6000.0,
        "global_tokens_per_s": 12000.0,
        "global_step": 5,
        "world_size": 2,
        "ms_per_step": 900.0,
        "peak_reserved_gib": 14.0,
        "ranks": [
            {"rank": 0, "tokens_per_s": 6000.0, "steps": 4, "peak_memory_gib": 12.0},
            {"rank": 1, "tokens_per_s": 6000.0, "steps": 3, "peak_memory_gib": 13.0},
        ],
        "provenance": {
            "device": {"type": "cuda", "name": "H100 X", "count": 2},
            "git_commit": "b" * 40,
            "utc": "2026-11-28T02:00:00Z",
            "versions": {"torch": "2.11.0"},
        },
    }
    _write(out / "fsdp2_speed.json", body)
    for name in ("b1", "fsdp2r", "ddp8b2"):
        path = out / f"{name}_speed.json"
        _write(path, {k: v for k, v in json.loads(path.read_text()).items() if k != "provenance"})
    _write(out / "fsdp2r.log", "Epoch 0\n  Restoring states from the checkpoint path at last.ckpt  \nEpoch 1\n")
    _export(out / "b1_export", 0.0)
    _export(out / "fsdp2r_export", 1.0)
    _export(out / "fx2_export", 1.25)
    _write(out / "peft2.json", {"ok": True, "rel_tol": 1e-5, "roles": {"plan": {"rel_diff": 2e-6, "resolved": True}}})
    # eval: one device (two schemes x and y, one after the other, on 2 rows); 2 devices stopped by the call's limit
    # after all four episodes; 4 devices finished, one episode's length differs, shard 0 resumed once
    rows = [
        {"qid": q, "seed": 0, "prediction": q.upper(), "num_tokens": 7, "steps": 2, "scheme": s, "wall_s": w}
        for q, s, w in (("a", "x", 3.0), ("b", "x", 1.0), ("c", "y", 1.0), ("d", "y", 1.0))
    ]
    _write(out / "ev1" / "hotpotqa" / "episodes.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    _write(
        out / "ev1" / "hotpotqa" / "timing.json",
        {
            "batch": 2,
            "episodes": 4,
            "episodes_s": 100.0,
            "decode_steps": 1000,
            "wait_s": 2.0,
            "replay_s": 0.5,
            "advance_s": 5.0,
            "agent_s": 3.0,
            "startup_s": 10.0,
            "setup_s": 20.0,
            "capture_s": 1.0,
        },
    )
    for i, qids in enumerate((["a", "c"], ["b", "d"])):
        _write(
            out / "ev2" / "hotpotqa" / f"shard_{i}" / "episodes.jsonl",
            "".join(json.dumps(r) + "\n" for r in rows if r["qid"] in qids),
        )
        four = [{**r, "num_tokens": 8 if r["qid"] == "d" else 7} for r in rows if r["qid"] in qids]
        _write(out / "ev4" / "hotpotqa" / f"shard_{i}" / "episodes.jsonl", "".join(json.dumps(r) + "\n" for r in four))
    _write(
        out / "ev4" / "hotpotqa" / "shard_0" / "timing.json",
        {
            "episodes": 2,
            "episodes_s": 30.0,
            "decode_steps": 300,
            "wait_s": 0.6,
            "replay_s": 0.3,
            "advance_s": 1.8,
            "agent_s": 0.9,
            "startup_s": 7.0,
            "setup_s": 11.0,
            "capture_s": 0.4,
            "parts": [{"startup_s": 5.0, "setup_s": 6.0}, {"startup_s": 2.0, "setup_s": 1.0, "capture_s": 0.5}],
        },
    )
    _write(
        out / "ev4" / "hotpotqa" / "shard_1" / "timing.json",
        {
            "episodes": 2,
            "episodes_s": 20.0,
            "decode_steps": 200,
            "wait_s": 0.4,
            "replay_s": 0.2,
            "advance_s": 1.2,
            "agent_s": 1.1,
            "startup_s": 8.0,
            "setup_s": 9.0,
            "capture_s": 0.6,
        },
    )
    _write(out / "ev4" / "hotpotqa" / "launch.json", {"startup_s": 3.0, "launch_s": 0.75})


def _fixed_machine(res: dict) -> dict:
    """The report's own provenance (this machine's commit, clock and versions) set to fixed values."""
    res["provenance"].update(git_commit="f" * 40, git_dirty=True, utc="2026-12-07T08:00:00Z",
                             versions={"python": "3.11.7", "torch": "2.13.0", "peft": None})  # fmt: skip
    return res


def test_a_whole_output_gives_every_figure(tmp_path: Path, report) -> None:
    """Every phase's files, sizes 2 and 4: each figure worked by hand from the files (losses binary-exact)."""
    _full_output(tmp_path)
    res = report.collect(tmp_path, "bash scripts/gpu_multi.sh", [2, 4])
    d = res["ddp_embedded"]
    assert d["speed_1gpu"] == {
        "world_size": 1, "global_step": 3, "tokens_per_s": 1000.0, "ms_per_micro_batch": 100.0,
        "peak_memory_gib_per_rank": [12.5], "peak_reserved_gib_rank0": 14.5, "timed_micro_batches_per_rank": [4],
        "ranks": [{"rank": 0, "tokens": 400000, "seconds": 400.0, "tokens_per_s": 1000.0, "peak_memory_gib": 12.5,
                   "steps": 4}],
    }  # fmt: skip
    assert d["host_split_1gpu"] == [{"rank": 0, "step_ms": 100.0, "host_ms": 80.0, "rest_ms": 20.0}]
    assert d["seed_noise"] == [0.0625, 0.0, -0.0625]
    assert d["seed_final_losses"] == {0: 1.5, 1: 1.4375, 2: 1.625}  # seed 10 is not one gpu_multi.sh runs
    assert d["seed_spread_last"] == 0.125
    assert d["ddp2_minus_1gpu"] == [0.03125, 0.0, 0.125] and d["ddp2_within_noise"] is True  # on the spread: within
    assert d["ddp4_minus_1gpu"] == [0.0, 0.0, -0.25] and d["ddp4_within_noise"] is False
    assert d["ddp4_minus_1gpu_repeats"] == {2: [0.0, 0.5, -0.125]} and d["ddp4_repeats_within_noise"] is True
    assert "ddp2_minus_1gpu_repeats" not in d and "ddp2_repeats_within_noise" not in d
    assert d["ddp2_speedup_tokens_per_s"] == pytest.approx(1900 / 1125)  # one DDP fit against one GPU's two, pooled
    assert d["ddp2_repeats"] == {"tokens_per_s_1gpu": [1000.0, 1250.0], "tokens_per_s_ddp2": [1900.0],
                                 "speedup_paired": [1.9]}  # fmt: skip
    assert d["ddp4_repeats"]["speedup_paired"] == [3.6, 3.2]
    assert d["speed_ddp2"]["world_size"] == 2 and d["speed_ddp2"]["timed_micro_batches_per_rank"] == [2, 2]
    q = res["ddp_accuracy_model"]
    assert q["ddp2_minus_1gpu"] == [0.125] and "seed_noise" not in q and "ddp2_within_noise" not in q
    assert q["ddp2_speedup_tokens_per_s"] == pytest.approx(1.8) and q["val_loss_ddp4"] is None
    f = res["fsdp_8b"]
    assert f["speed_fsdp2"]["peak_memory_gib_per_rank"] == [12.0, 13.0] and f["speed_fsdp2"]["global_step"] == 5
    assert f["speed_fsdp2"]["peak_reserved_gib_rank0"] == 14.0 and f["speed_fsdp2"]["ms_per_micro_batch"] == 900.0
    assert f["speed_fsdp2"]["timed_micro_batches_per_rank"] == [4, 3] and len(f["speed_fsdp2"]["ranks"]) == 2
    assert f["fsdp2_peak_memory_over_1gpu"] == pytest.approx(13.0 / 20.0)  # the largest rank's
    assert f["fsdp2_resumed_to_step"] == 3 and f["fsdp4_resumed_to_step"] is None
    assert f["fsdp2_resume_log_line"] == "Restoring states from the checkpoint path at last.ckpt"
    assert f["fsdp4_resume_log_line"] is None
    assert f["export_fsdp2r_same_format_as_1gpu"] is True and f["export_fx2_same_format_as_1gpu"] is True
    assert f["export_fsdp4r_same_format_as_1gpu"] is None and f["export_fx4_same_format_as_1gpu"] is None  # no export
    assert f["fsdp2_export_in_peft"]["ok"] is True and f["fsdp4_export_in_peft"] is None
    e = res["eval_devices"]
    assert e["episodes_1"] == 4 and e["episodes_2"] == 4 and e["stopped_2"] == 124 and e["finished_equal_2"] is True
    assert e["same_episodes_4"] is False and e["differing_episodes_4"] == 2  # d's length differs: both versions
    assert e["speedup_4"] == pytest.approx(400 / 130) and e["restart_s_1"] == 0.0 and e["restart_s_4"] == 3.5
    assert e["speedup_4_less_restarts"] == pytest.approx(400 / (130 - 3.5))
    assert e["combined_4"] is False and e["launch_s_4"] == 3.75
    assert e["queue_bound_4"] == pytest.approx({"loop_s_1": 4.0, "loop_s_4": 3.0, "bound": 4.0 / 3.0})  # by scheme
    prov = res["provenance"]
    assert prov["dtype"] == "bfloat16" and prov["cpu_check"] is False and prov["command"] == "bash scripts/gpu_multi.sh"
    assert prov["gpus"] == ["H100 X"] * 4 and prov["run_commits"] == ["a" * 40, "b" * 40]
    assert prov["run_versions"] == ["torch 2.11.0", "torch 2.11.0, peft 0.17.0"]
    assert prov["run_dates"] == ["2026-11-27", "2026-11-28"] and res["ddp_model"] == "embedded SmolLM2-360M"
    assert report.scaling_curves(res) == {
        "DDP, embedded model": [(1, 1.0), (2, pytest.approx(1900 / 1125)), (4, pytest.approx(3800 / 1125))],
        "DDP, accuracy model": [(1, 1.0), (2, pytest.approx(1.8))],
        "FSDP, 8B shapes": [(1, 1.0), (2, pytest.approx(1.5))],
        "eval --devices N (wall)": [(1, 1.0), (4, pytest.approx(400 / 130))],
    }
    del res["sizes"]  # a record without its sizes: GPU count 2
    assert list(report.scaling_curves(res)) == ["DDP, embedded model", "DDP, accuracy model", "FSDP, 8B shapes"]


FULL_MARKDOWN = """# Several GPUs: scripts/gpu_multi.sh

Devices: H100 X, H100 X, H100 X, H100 X.

## DDP, embedded SmolLM2-360M, same global batch

| run | val/loss per validation | tokens/s | speed-up |
|---|---|---|---|
| 1 device | [2.5000, 2.0000, 1.5000] | 1000 | 1 |
| 1 device, adapter seed 1 (noise) | [2.5625, 2.0000, 1.4375] | | |
| DDP, 2 devices | [2.5312, 2.0000, 1.6250] | 1900 | 1.69x |
| DDP, 4 devices | [2.5000, 2.0000, 1.2500] | 3600 | 3.38x |
| DDP, 2 devices: every repeat pooled | | one device 1000, 1250; DDP 1900 | repeat by repeat 1.90x |
| DDP, 4 devices: every repeat pooled | | one device 1000, 1250; DDP 3600, 4000 | repeat by repeat 3.60x, 3.20x |

Where a micro-batch went (ms, first fit of each; per rank: micro-batch / host time between Lightning's hooks / the \
rest, waiting):
- 1 device: rank 0 100.0 / 80.0 / 20.0
- DDP, 2 devices: rank 0 110.0 / 100.0 / 10.0; rank 1 125.0 / 100.0 / 25.0

Seed noise (seed 1 - seed 0): [0.062500, 0.000000, -0.062500]; final loss by adapter seed: 0: 1.50000, 1: 1.43750, \
2: 1.62500; spread (largest |seed k - seed 0|): 0.125000.
DDP on 2 - 1 device: [0.031250, 0.000000, 0.125000]; within the seed noise at the last validation: True.
DDP on 4 - 1 device: [0.000000, 0.000000, -0.250000]; within the seed noise at the last validation: False.
DDP on 4 - 1 device, repeat 2: [0.000000, 0.500000, -0.125000].
Every repeat within the seed noise at the last validation: True.

## DDP, the accuracy model (Qwen2.5-Coder-1.5B-Instruct), same global batch

| run | val/loss per validation | tokens/s | speed-up |
|---|---|---|---|
| 1 device | [3.0000] | 500 | 1 |
| 1 device, adapter seed 1 (noise) | missing | | |
| DDP, 2 devices | [3.1250] | 900 | 1.80x |
| DDP, 4 devices | missing | missing | missingx |

Seed noise (seed 1 - seed 0): missing; final loss by adapter seed: missing; spread (largest |seed k - seed 0|): \
missing.
DDP on 2 - 1 device: [0.125000]; within the seed noise at the last validation: missing.
DDP on 4 - 1 device: missing; within the seed noise at the last validation: missing.

## FSDP, LLaMA-3.1-8B shapes

| run | tokens/s | speed-up | peak memory per device (GiB) | steps |
|---|---|---|---|---|
| 1 device | 8000 | 1 | [20.00] | 3 |
| FSDP, 2 devices | 12000 | 1.50x | [12.00, 13.00] | 5 |
| FSDP, 2 devices, resumed (--ckpt_path last) | 11000 | 1.38x | [12.50, 12.50] | 3 |
| DDP, 2 devices (the whole base on each) | 10000 | 1.25x | [30.00, 30.00] | 3 |
| FSDP, 4 devices | missing | missingx | missing | missing |
| FSDP, 4 devices, resumed (--ckpt_path last) | missing | missingx | missing | missing |
| DDP, 4 devices (the whole base on each) | missing | missingx | missing | missing |

FSDP on 2: peak memory per device 0.650x one device's; resumed to step 3 (Restoring states from the checkpoint path \
at last.ckpt); export format equal to the 1-device export: fit's True, `export` command's True; fit's export vs the \
export command: max |diff| 0.25000000; loads in PEFT with lragent's logits: True (largest relative diff 2.00e-06 \
against 1e-05; the adapters' effect resolved: yes).
FSDP on 4: peak memory per device missingx one device's; resumed to step missing (missing); export format equal to \
the 1-device export: fit's missing, `export` command's missing; fit's export vs the export command: max |diff| \
missing; loads in PEFT with lragent's logits: missing.

## eval --devices N vs --devices 1

2 devices: stopped (exit 124) after 4 episodes; each of them equal to one device's: True; no speed-up (not finished).
4 devices: episodes 4 vs 4; same predictions and lengths: False (2 differ); wall seconds 400 vs 130, speed-up 3.08x; \
episode loops alone (the slowest shard) 100.0 vs 30.0 s, 3.33x; decode steps of the busiest process 1000 vs 300; its \
seconds in the engine's decode calls 5.0 vs 1.8 and in the episodes' own work 3.0 vs 1.1; before its loop, its start \
(interpreter, imports) 10.0 vs 8.0 and setup (corpus, model, sizing) 20.0 vs 11.0; in its loop, the graph captures \
(kernel compiles included) 1.0 vs 0.6; the launcher's own start 3.8 s.
  - a run resumed in a later call paid its start again (0.0 vs 3.5 s of start, setup and captures): without it the \
speed-up is **3.16x**.
  - per decode step, all processes together, 1 vs 4 devices (ms): waiting for the GPU 2.00 vs 2.00; graph replay \
calls 0.50 vs 1.00; the engine's other host work 1.50 vs 1.00; the episodes' work 3.00 vs 4.00.
  - what the episodes' lengths allow: one device's episode times, scheduled scheme by scheme on one process of its \
rows and on 4 of them, 4.0 vs 3.0 s, at most **1.33x** for the loops (the queue's tail alone: steps as fast as one \
device's, no fixed cost).
  - hotpotqa shards: episodes [2, 2], decode steps [300, 200]; slowest loop 1.20x the mean.

## Phases

| phase | exit | seconds |
|---|---|---|
| emb1 | 0 | 61 |
| ddp2 | 0 | 35 |
| b1 | 0 | 52 |
| fsdp2 | 0 | 58 |
| ev1 | 0 | 400 |
| ev2 | 124 | 590 |
| ev4 | 0 | 130 |

---
Commit ffffffffffffffffffffffffffffffffffffffff (dirty), 2026-12-07T08:00:00Z; python 3.11.7, torch 2.13.0; dtype \
bfloat16.<br>
Runs: commits aaaaaaa, bbbbbbb; dates 2026-11-27, 2026-11-28; torch 2.11.0; torch 2.11.0, peft 0.17.0.<br>
Command: `bash scripts/gpu_multi.sh`
""".replace("<br>", "  ")  # the footer's Markdown line breaks


def test_a_whole_output_s_page_states_each_figure_in_its_place(tmp_path: Path, report) -> None:
    """The page of the whole output above, line by line (its own commit, clock and versions fixed): every section,
    each figure where its label says (the 2-device eval stopped, the 4-device one finished)."""
    _full_output(tmp_path)
    res = _fixed_machine(report.collect(tmp_path, "bash scripts/gpu_multi.sh", [2, 4]))
    assert report.markdown(res) == FULL_MARKDOWN
    res["provenance"]["git_dirty"] = False
    assert "Commit ffffffffffffffffffffffffffffffffffffffff, 2026-12-07T08:00:00Z;" in report.markdown(res)


def test_a_phase_s_status_and_calls_and_which_phases_join(tmp_path: Path, report) -> None:
    """A negative exit status (a signal) stays a number; a phase run in three calls counts three; only ``evN-<b>``
    names join into ``evN``, split at their first dash."""
    (tmp_path / "timings.txt").write_text(
        "fsdp2 rc=-9 seconds=3\nev1 rc=124 seconds=5\nev1 rc=124 seconds=6\nev1 rc=0 seconds=7\n"
        "ev2-hotpot-qa rc=0 seconds=4\nb1-x rc=0 seconds=2\nxx2-a rc=0 seconds=1\n"
    )
    t = report.timings(tmp_path)
    assert t["fsdp2"] == {"rc": -9, "seconds": 3} and t["ev1"] == {"rc": 0, "seconds": 18, "calls": 3}
    assert t["ev2"] == {"rc": 0, "seconds": 4} and "ev2-hotpot" not in t
    assert sorted(t) == ["b1-x", "ev1", "ev2", "ev2-hotpot-qa", "fsdp2", "xx2-a"]  # no b1, no xx2


def test_episodes_keep_every_field_and_a_fixed_order(tmp_path: Path, report) -> None:
    """An episode is (qid, seed, prediction, num_tokens, steps), a field it lacks None; sorted by their text, so the
    order holds whatever the fields' types (seed 10 before seed 9)."""
    rows = [{"qid": "a", "seed": 9, "prediction": "p", "num_tokens": 3, "steps": 1},
            {"qid": "b"}, {"qid": "a", "seed": 10, "prediction": "q", "num_tokens": 4, "steps": 2}]  # fmt: skip
    (tmp_path / "ev1").mkdir()
    (tmp_path / "ev1" / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert report.episodes(tmp_path / "ev1") == [
        ("a", 10, "q", 4, 2),
        ("a", 9, "p", 3, 1),
        ("b", None, None, None, None),
    ]
    assert report.episodes(tmp_path / "none") is None


def test_one_figure_of_a_block_is_enough_for_its_section(tmp_path: Path, report) -> None:
    """A DDP section for a DDP fit's speed or loss alone; an FSDP section for a resumed run's speed, the 8B DDP run's
    or a PEFT check alone."""
    for name, write in (
        ("ddp2_speed", lambda d: _speed(d / "ddp2_speed.json", 1900.0, world=2)),
        ("ddp2_metrics", lambda d: _metrics(d / "ddp2_metrics.csv", [2.0])),
        ("fsdp2r", lambda d: _speed(d / "fsdp2r_speed.json", 1.0, world=2)),
        ("ddp8b2", lambda d: _speed(d / "ddp8b2_speed.json", 1.0, world=2)),
        ("peft2", lambda d: (d / "peft2.json").write_text(json.dumps({"ok": True}))),
    ):
        d = tmp_path / name
        d.mkdir()
        write(d)
        md = report.markdown(report.collect(d, None, [2]))
        section = "## DDP" if name.startswith("ddp2_") else "## FSDP"
        assert section in md and "none of their phases ran" in md, name


def test_edges_of_the_timing_readers(tmp_path: Path, report) -> None:
    """The readers' edge cases: a benchmark folder without timing makes a run's per-step split and restart seconds
    missing; a resumed part lacking a figure counts it 0; one benchmark named in launch.json is no combined launch;
    shards or episodes of zero seconds give no ratio; a role without rel_diff counts 0."""
    (tmp_path / "ev1" / "hotpotqa").mkdir(parents=True)
    (tmp_path / "ev1" / "scienceqa").mkdir()
    body = {"decode_steps": 10, "wait_s": 1.0, "replay_s": 0.1, "advance_s": 2.0, "agent_s": 0.5,
            "parts": [{}, {"startup_s": 2.0}], "batch": 2}  # fmt: skip
    (tmp_path / "ev1" / "hotpotqa" / "timing.json").write_text(json.dumps(body))
    assert report.per_step_ms(tmp_path / "ev1") is None and report.restart_seconds(tmp_path / "ev1") is None
    (tmp_path / "ev1" / "scienceqa").rmdir()
    assert report.per_step_ms(tmp_path / "ev1") is not None
    assert report.restart_seconds(tmp_path / "ev1") == 2.0  # the resumed part's start; its setup and captures 0
    assert report.queue_bound(tmp_path / "ev1", 2) is None  # rows, but no episodes.jsonl
    (tmp_path / "ev1" / "hotpotqa" / "episodes.jsonl").write_text(json.dumps({"qid": "a", "wall_s": 0.0}) + "\n")
    assert report.queue_bound(tmp_path / "ev1", 2) == {"loop_s_1": 0.0, "loop_s_2": 0.0, "bound": None}
    (tmp_path / "ev1" / "hotpotqa" / "episodes.jsonl").write_text(json.dumps({"qid": "a", "wall_s": 2.0}) + "\n")
    one = report.queue_bound(tmp_path / "ev1", 2)
    assert one == {"loop_s_1": 2.0, "loop_s_2": 2.0, "bound": 1.0}
    assert report.queue_bound(tmp_path / "ev1", 2, combined=True) == one  # one benchmark: the same launch
    (tmp_path / "ev1" / "launch.json").write_text(json.dumps({"benchmarks": ["hotpotqa"]}))
    assert not report.combined_launch(tmp_path / "ev1")
    for i in (0, 1):
        d = tmp_path / "ev2" / "hotpotqa" / f"shard_{i}"
        d.mkdir(parents=True)
        (d / "timing.json").write_text(json.dumps({"episodes": 0, "decode_steps": 0, "episodes_s": 0.0}))
    assert report.shard_balance(tmp_path / "ev2")["hotpotqa"]["slowest_over_mean"] is None
    from eval_suite.bench.multi_gpu_report import _peft_detail

    roles = {"plan": {"rel_diff": 2e-6}, "action": {}}
    assert _peft_detail({"rel_tol": 1e-5, "roles": roles}) == " (largest relative diff 2.00e-06 against 1e-05)"
    assert report.host_split(tmp_path, "none") is None
    (tmp_path / "h_speed.json").write_text(
        json.dumps({"steps": 2, "ms_per_step": 5.0, "phases_ms": {"host": {"a": 1}}})
    )
    assert report.host_split(tmp_path, "h") is None  # host times without their counts


def test_a_stage_waits_for_its_process_s_rows_however_many_stages(report) -> None:
    """One process of 2 rows, three stages: [3, 1] ends at 3 (the row freed at 1 waits); [1, 5] then runs 3-4 and
    3-8; the row freed at 4 waits for the 5 s episode, and [1] runs 8-9."""
    assert report.stage_schedule_s([[3.0, 1.0], [1.0, 5.0], [1.0]], 1, 2) == pytest.approx(9.0)


def test_evals_without_records_or_timing_lines(tmp_path: Path, report) -> None:
    """An eval phase that stopped before any episode, one that finished without records, one with records but no
    timing line: no comparison, no speed-up; a phase of one second is timed as one second."""
    d = tmp_path / "ev1" / "hotpotqa"
    d.mkdir(parents=True)
    (d / "episodes.jsonl").write_text(json.dumps({"qid": "a"}) + "\n")
    d8 = tmp_path / "ev8" / "hotpotqa"
    d8.mkdir(parents=True)
    (d8 / "episodes.jsonl").write_text(json.dumps({"qid": "a"}) + "\n")
    (tmp_path / "timings.txt").write_text("ev1 rc=0 seconds=10\nev2 rc=1 seconds=3\nev4 rc=0 seconds=1\n")
    e = report.collect(tmp_path, None, [2, 4, 8])["eval_devices"]
    assert e["stopped_2"] == 1 and "finished_equal_2" not in e  # no records
    assert "same_episodes_4" not in e and e["speedup_4"] == 10.0  # one second: ten times ten seconds
    assert e["same_episodes_8"] is True and "speedup_8" not in e and "wall_seconds_8" not in e  # no timing line
    (tmp_path / "ev4" / "hotpotqa" / "shard_0").mkdir(parents=True)
    part = {"startup_s": 1.0, "episodes_s": 1.0}
    (tmp_path / "ev4" / "hotpotqa" / "shard_0" / "timing.json").write_text(json.dumps({"parts": [part, part]}))
    (tmp_path / "timings.txt").write_text("ev1 rc=0 seconds=10\nev4 rc=0 seconds=2\n")
    e = report.collect(tmp_path, None, [4])["eval_devices"]
    assert e["restart_s_4"] == 1.0 and e["speedup_4_less_restarts"] == 10.0  # 10 / max(2 - 1, 1)
    e = report.collect(tmp_path, None)["eval_devices"]
    assert report.collect(tmp_path, None)["sizes"] == [2] and "episodes_2" in e and "episodes_4" not in e


def test_a_cpu_check_and_the_device_names(tmp_path: Path, report, monkeypatch) -> None:
    """A run whose speed file says CPU makes the report a CPU check (float32, the CPU, the tiny models named); a GPU
    run's report names this machine's GPUs, or where it has none or cannot say, the widest run's device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"GPU {i}")
    _speed(tmp_path / "b1_speed.json", 8000.0)
    _metrics(tmp_path / "emb1_metrics.csv", [2.0])
    res = report.collect(tmp_path, "cmd", [2])
    prov = res["provenance"]
    assert prov["device"]["type"] == "cuda" and prov["dtype"] == "bfloat16" and prov["cpu_check"] is False
    assert prov["gpus"] == ["GPU 0", "GPU 1"] and res["ddp_model"] == "embedded SmolLM2-135M-Instruct"
    del res["ddp_model"]  # a record from before the label: the embedded model
    assert "## DDP, embedded SmolLM2-135M-Instruct, same global batch" in report.markdown(res)
    body = json.loads((tmp_path / "b1_speed.json").read_text())
    body["provenance"]["device"] = {"type": "cpu"}
    (tmp_path / "b1_speed.json").write_text(json.dumps(body))
    res = report.collect(tmp_path, "cmd", [2])
    prov = res["provenance"]
    assert prov["device"]["type"] == "cpu" and prov["dtype"] == "float32" and prov["cpu_check"] is True
    md = report.markdown(res)
    assert "Devices: CPU check (gloo processes, tiny random models; no GPU figure).\n" in md
    assert "## FSDP, tiny random LLaMA (CPU check)\n" in md and "dtype float32." in md
    del res["ddp_model"]
    assert "## DDP, tiny random LLaMA (CPU check), same global batch" in report.markdown(res)

    def no_cuda() -> int:
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", no_cuda)
    (tmp_path / "b1_speed.json").unlink()
    res = report.collect(tmp_path, "cmd", [2])
    assert res["provenance"]["gpus"] == [] and "Devices: ?.\n" in report.markdown(res)
    # the widest run: the largest count; a run without one counts 0 (an equal count keeps the first); no name is "?"
    for name, device in (("a", {"type": "cuda", "name": "X"}), ("b", {"type": "cuda", "name": "Y", "count": 1}),
                         ("c", {"type": "cuda", "count": 1})):  # fmt: skip
        (tmp_path / f"{name}_speed.json").write_text(json.dumps({"provenance": {"device": device}}))
    assert report.collect(tmp_path, "cmd", [2])["provenance"]["gpus"] == ["Y"]
    (tmp_path / "b_speed.json").unlink()
    (tmp_path / "c_speed.json").write_text(json.dumps({"provenance": {"device": {"type": "cuda", "count": 3}}}))
    assert report.collect(tmp_path, "cmd", [2])["provenance"]["gpus"] == ["?"] * 3
    (tmp_path / "c_speed.json").unlink()
    assert report.collect(tmp_path, "cmd", [2])["provenance"]["gpus"] == ["X"]  # no count: one


def test_the_plot_draws_each_measured_curve_against_the_ideal(tmp_path: Path, report, monkeypatch) -> None:
    """The figure the report saves: the ideal line from (1, 1) to the most GPUs, each run's points, its axes, legend
    and title (the GPUs), closed once saved."""
    import matplotlib.pyplot as plt

    saved = []
    real = report.save_figure
    monkeypatch.setattr(report, "save_figure", lambda fig, path: (saved.append(fig), real(fig, path)))
    _full_output(tmp_path)
    res = report.collect(tmp_path, None, [2, 4])
    res["provenance"]["gpus"] = ["H100 X", "H100 X"]
    assert report.plot(res, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 1000
    (fig,) = saved
    assert not plt.fignum_exists(fig.number) and tuple(fig.get_size_inches()) == (5.5, 4.0)
    (ax,) = fig.axes
    ideal, *runs = ax.get_lines()
    assert list(ideal.get_xdata()) == [1, 4] and list(ideal.get_ydata()) == [1, 4] and ideal.get_label() == "ideal"
    assert ideal.get_color() == "0.7" and ideal.get_linestyle() == "--" and ideal.get_marker() in ("None", None, "")
    curves = report.scaling_curves(res)
    assert [line.get_label() for line in runs] == list(curves)
    for line, pts in zip(runs, curves.values(), strict=True):
        assert list(line.get_xdata()) == [n for n, _ in pts] and list(line.get_ydata()) == [v for _, v in pts]
        assert line.get_marker() == "o"
    assert ax.get_xlabel() == "GPUs" and ax.get_ylabel() == "tokens/s (eval: 1 / wall time) over one GPU's"
    assert list(ax.get_xticks()) == [1, 2, 4]
    assert ax.get_title() == "2 × H100 X" and ax.title.get_fontsize() == 9
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["ideal", *curves] and legend.get_texts()[
        0
    ].get_fontsize() == 8
    assert all(g.get_alpha() == 0.3 for g in ax.get_xgridlines())
    res["provenance"]["gpus"] = ["H100 X", "H200 Y"]
    report.plot(res, tmp_path / "q.png")
    assert saved[1].axes[0].get_title() == "H100 X, H200 Y"
    res["provenance"]["gpus"] = []
    report.plot(res, tmp_path / "r.png")
    assert saved[2].axes[0].get_title() == "1 × ?"


def test_the_command_writes_indented_json_and_prints_the_page(tmp_path: Path, report, capsys) -> None:
    """``--sizes`` takes commas or spaces (default 2); the JSON is the project's one-space indent; the page printed
    is the one written, headed, with the plot's line; without --command the command line itself is recorded."""
    _full_output(tmp_path)
    assert report.multi_gpu_report(str(tmp_path), command="cmd", sizes="2,4") == 0
    text = (tmp_path / "multi_gpu.json").read_text()
    res = json.loads(text)
    assert res["sizes"] == [2, 4] and res["provenance"]["command"] == "cmd"
    assert text == json.dumps(res, indent=1) + "\n"
    md = (tmp_path / "multi_gpu.md").read_text()
    assert md.startswith("# Several GPUs: scripts/gpu_multi.sh\n") and md.endswith("(multi_gpu.png)\n")
    assert capsys.readouterr().out == md + "\n"
    assert report.multi_gpu_report(str(tmp_path)) == 0
    assert json.loads((tmp_path / "multi_gpu.json").read_text())["sizes"] == [2]
    capsys.readouterr()
    assert report.main(["--out", str(tmp_path)]) == 0
    command = json.loads((tmp_path / "multi_gpu.json").read_text())["provenance"]["command"]
    assert command == f"python -m eval_suite.bench.multi_gpu_report --out {tmp_path}"


def test_the_bound_of_a_combined_launch_runs_the_benchmarks_without_a_barrier(tmp_path: Path, report) -> None:
    """An ``eval --benchmark a,b --devices 2`` output (its launch.json names both) is bounded by one device's episodes
    run as one launch: hotpotqa [3, 1, 1, 1] then scienceqa [1, 1] on 2 rows take 4 s on one process, 3 s on two
    (apart: 4 s on two as well)."""
    for bench, walls in (("hotpotqa", [3.0, 1.0, 1.0, 1.0]), ("scienceqa", [1.0, 1.0])):
        d = tmp_path / "ev1" / bench
        d.mkdir(parents=True)
        (d / "timing.json").write_text(json.dumps({"batch": 2, "episodes_s": 1.0}))
        lines = (json.dumps({"qid": f"q{i}", "row": "s", "wall_s": w}) + "\n" for i, w in enumerate(walls))
        (d / "episodes.jsonl").write_text("".join(lines))
    (tmp_path / "ev2").mkdir()
    (tmp_path / "ev2" / "launch.json").write_text(json.dumps({"benchmarks": ["hotpotqa", "scienceqa"]}))
    e = report.collect(tmp_path, None, [2])["eval_devices"]
    assert e["combined_2"] is True
    assert e["queue_bound_2"] == pytest.approx({"loop_s_1": 4.0, "loop_s_2": 3.0, "bound": 4.0 / 3.0})
    (tmp_path / "ev2" / "launch.json").write_text(json.dumps({"benchmarks": ["hotpotqa"]}))
    e = report.collect(tmp_path, None, [2])["eval_devices"]
    assert e["combined_2"] is False and e["queue_bound_2"] == pytest.approx(
        {"loop_s_1": 4.0, "loop_s_2": 4.0, "bound": 1.0}
    )


def test_older_records_and_an_output_without_runs(tmp_path: Path, report) -> None:
    """A record from before ``sizes`` and the accuracy model's block reads as one size of 2 without that block; decode
    steps read as floats print whole; a page without the runs' provenance has no Runs line; the note of the absent
    sections stands in its own paragraph."""
    _full_output(tmp_path)
    res = _fixed_machine(report.collect(tmp_path, "cmd", [2]))
    del res["sizes"], res["ddp_accuracy_model"]
    md = report.markdown(res)
    assert "| DDP, 2 devices |" in md and "4 devices" not in md and "3 devices" not in md and "Qwen" not in md
    res = report.collect(tmp_path, "cmd", [4])
    res["eval_devices"].update(decode_steps_1=1000.0, decode_steps_4=250.0)
    assert "decode steps of the busiest process 1000 vs 250;" in report.markdown(res)
    empty = tmp_path / "empty"
    empty.mkdir()
    md = report.markdown(report.collect(empty, "cmd", [2]))
    assert "Runs:" not in md
    assert "none of their phases ran): DDP, FSDP, eval --devices N.\n\n## Phases\n" in md


def test_a_resume_log_without_the_restore_line_gives_none(tmp_path: Path, report) -> None:
    """A resumed run's log that never says it restored (it started afresh): no resume line, not a failure."""
    (tmp_path / "fsdp2r.log").write_text("Epoch 0\nEpoch 1\n")
    assert report.collect(tmp_path, None, [2])["fsdp_8b"]["fsdp2_resume_log_line"] is None
