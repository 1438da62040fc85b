"""bench eval (eval_suite/bench/eval_throughput.py): episodes per GPU-second over real job processes, their time split,
the comparison of episodes with another bench, and its argument checks. The jobs here are a stand-in interpreter that
writes an eval's files (the real eval is tested elsewhere)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from eval_suite.bench import eval_throughput as be
from lragent.cli_main import main

FAKE_EVAL = """#!{python}
import json, sys, time
args = sys.argv[1:]
out = args[args.index("--out") + 1]
n = int(args[args.index("--episodes") + 1])
pred = args[args.index("--pred") + 1]
time.sleep(float(args[args.index("--sleep") + 1]))
with open(out + "/episodes.jsonl", "w") as f:
    for i in range(n):
        f.write(json.dumps({{"row": "base_lr_shared", "run": 0, "qid": f"q{{i}}", "prediction": pred if i == 0 else "x",
                            "actions": ["Finish[x]"], "num_tokens": 10 + i, "seed": i}}) + "\\n")
with open(out + "/timing.json", "w") as f:
    json.dump({{"batch": 4, "decode_steps": 7 * n, "startup_s": 0.5, "load_s": 0.25, "episodes_s": 1.5,
               "advance_s": 1.0, "wait_s": 0.75, "replay_s": 0.1, "capture_s": 0.0, "agent_s": 0.5,
               "feed_rows": 40 * n, "feed_tokens": 30 * n}}, f)
sys.exit(int(args[args.index("--rc") + 1]))
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    path = tmp_path / "fake_eval"
    path.write_text(FAKE_EVAL.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _job(n: int, pred: str = "a", sleep: float = 0.0, rc: int = 0) -> str:
    return f"--episodes {n} --pred {pred} --sleep {sleep} --rc {rc}"


def test_episodes_per_second_counts_every_jobs_episodes_over_the_whole_wall(tmp_path: Path, fake_python: str) -> None:
    out = tmp_path / "b"
    rc = be.bench_eval([_job(3, sleep=1.5), _job(5, sleep=1.5), _job(2)], out=str(out), concurrent=2,
                       python=fake_python, sample_s=0.05)  # fmt: skip
    assert rc == 0
    result = json.loads((out / "bench_eval.json").read_text())
    s = result["summary"]
    assert s["episodes"] == 10
    assert s["episodes_per_gpu_s"] == pytest.approx(10 / s["wall_s"])
    assert 1.5 <= s["wall_s"] < 2.9  # the two sleepers ran at once (one after the other: at least 3 s)
    jobs = result["jobs"]
    assert [j["episodes"] for j in jobs] == [3, 5, 2] and [j["decode_steps"] for j in jobs] == [21, 35, 14]
    assert all(j["wait_s"] == 0.75 and j["agent_s"] == 0.5 for j in jobs)  # each job's timing.json split, as written
    assert [(j["feed_rows"], j["feed_tokens"]) for j in jobs] == [(120, 90), (200, 150), (80, 60)]
    md = (out / "bench_eval.md").read_text()
    assert "10 episodes" in md and "episodes per GPU-second" in md
    assert "| fed rows used |" in md and "| 75.0% of 120 |" in md and "| 75.0% of 200 |" in md


def test_a_failed_job_fails_the_bench_but_its_episodes_count(tmp_path: Path, fake_python: str) -> None:
    out = tmp_path / "b"
    assert be.bench_eval([_job(2), _job(3, rc=3)], out=str(out), python=fake_python) == 1
    result = json.loads((out / "bench_eval.json").read_text())
    assert [j["rc"] for j in result["jobs"]] == [0, 3] and result["summary"]["episodes"] == 5


def test_compare_counts_the_same_episodes_of_another_bench(tmp_path: Path, fake_python: str) -> None:
    be.bench_eval([_job(4, pred="a")], out=str(tmp_path / "one"), python=fake_python)
    be.bench_eval([_job(3, pred="b")], out=str(tmp_path / "two"), python=fake_python, compare=str(tmp_path / "one"))
    c = json.loads((tmp_path / "two" / "bench_eval.json").read_text())["compare"]
    # three episodes both ran; the first differs in its prediction, the other two are the same
    assert (c["left"], c["right"], c["both"], c["same"]) == (3, 4, 3, 2)


def test_compare_reads_a_kept_episode_file(tmp_path: Path, fake_python: str) -> None:
    import lzma

    recs = [{"row": "base_lr_shared", "run": 0, "qid": f"q{i}", "prediction": "a" if i == 0 else "x",
             "actions": ["Finish[x]"], "num_tokens": 10 + i, "seed": i} for i in range(2)]  # fmt: skip
    kept = tmp_path / "kept.jsonl.xz"
    kept.write_bytes(lzma.compress("\n".join(json.dumps(r) for r in recs).encode()))
    be.bench_eval([_job(3, pred="b")], out=str(tmp_path / "two"), python=fake_python, compare=str(kept))
    c = json.loads((tmp_path / "two" / "bench_eval.json").read_text())["compare"]
    assert (c["left"], c["right"], c["both"], c["same"]) == (3, 2, 2, 1)


def test_compare_records_keys_by_row_run_and_question() -> None:
    a = [{"row": "x", "run": 0, "qid": "1", "prediction": "p", "actions": [], "num_tokens": 1, "seed": 5}]
    b = [dict(a[0], run=1), dict(a[0], num_tokens=2)]
    assert be.compare_records(a, b) == {"left": 1, "right": 2, "both": 1, "same": 0}
    assert be.compare_records(a, [dict(a[0])])["same"] == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--jobs", "[]"], "--jobs is empty"),
        (["--jobs", '["--scheme base_lr_shared --out x"]'], "--out is set by bench eval"),
        (["--jobs", '["--scheme base_lr_shared"]', "--concurrent", "0"], "--concurrent must be >= 1"),
        (["--jobs", '["--scheme base_lr_shared"]', "--compare", "/no/such/dir"], "--compare /no/such/dir: no such"),
    ],
)
def test_bad_arguments_are_one_error_line(argv: list[str], needle: str, capsys, tmp_path: Path) -> None:
    assert main(["bench", "eval", *argv, "--out", str(tmp_path / "o")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_a_sampling_interval_that_is_not_positive_is_refused(capsys, tmp_path: Path) -> None:
    argv = ["bench", "eval", "--jobs", '["--scheme base_lr_shared"]', "--sample_s", "0", "--out", str(tmp_path / "o")]
    assert main([*argv, "--compare", str(tmp_path / "none")]) == 2  # checked first: no job starts
    err = capsys.readouterr().err
    assert err.startswith("error: --sample_s must be > 0, got 0") and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


CRASHING_EVAL = """#!{python}
import sys
sys.exit(5)  # dies before it writes any episode
"""


def test_a_job_that_wrote_no_episode_file_counts_none_and_fails_the_bench(tmp_path: Path) -> None:
    """A job that exits before writing ``episodes.jsonl``: zero episodes in its summary and the record, exit 1."""
    fake = tmp_path / "crashing_eval"
    fake.write_text(CRASHING_EVAL.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "b"
    assert be.bench_eval(["--scheme base_lr_shared"], out=str(out), python=str(fake)) == 1
    assert not (out / "job_0" / "episodes.jsonl").exists()
    result = json.loads((out / "bench_eval.json").read_text())
    assert [(j["rc"], j["episodes"]) for j in result["jobs"]] == [(5, 0)] and result["summary"]["episodes"] == 0
    assert be.read_compared(out) == []  # a compared bench's job folder without episodes adds none


def _fake_nvidia_smi(bindir: Path, apps: int) -> None:
    """An ``nvidia-smi`` (a CPU has none) reporting 50% busy, 1,000 MiB and ``apps`` processes computing."""
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "nvidia-smi"
    pids = "\\n".join(str(4000 + i) for i in range(apps))
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f'  --query-compute-apps=pid) printf "{pids}{chr(92)}n" ;;\n'
        '  --query-gpu=utilization.gpu,memory.used) echo "50, 1000" ;;\n'
        "  *) exit 1 ;;\n"
        "esac\n"
    )
    script.chmod(0o755)


@pytest.mark.parametrize(("apps", "others"), [(1, 0), (3, 2)])
def test_processes_beside_the_jobs_on_the_gpu_mark_the_run_unclean(tmp_path: Path, fake_python: str, monkeypatch,
                                                                   capsys, apps: int, others: int) -> None:  # fmt: skip
    """One job at a time: one process computing is the job's own; three are two others sharing the GPU's time, which
    the report and a warning line say (the figure is still written)."""
    _fake_nvidia_smi(tmp_path / "bin", apps)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin")
    out = tmp_path / "b"
    assert be.bench_eval([_job(2, sleep=0.5)], out=str(out), python=fake_python, sample_s=0.05) == 0
    s = json.loads((out / "bench_eval.json").read_text())["summary"]
    assert s["peak_processes"] == apps and s["other_processes"] == others and s["busy_pct"] == 50.0
    md = (out / "bench_eval.md").read_text()
    assert ("**Not a clean measurement**: 2 more process(es)" in md) == bool(others)
    assert ("warning: 2 more process(es)" in capsys.readouterr().err) == bool(others)


def test_without_nvidia_smi_no_process_count_and_no_verdict(tmp_path: Path, fake_python: str, monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")
    if be.shutil.which("nvidia-smi"):
        pytest.skip("this machine has an nvidia-smi")
    out = tmp_path / "b"
    be.bench_eval([_job(1)], out=str(out), python=fake_python, sample_s=0.05)
    s = json.loads((out / "bench_eval.json").read_text())["summary"]
    assert s["peak_processes"] is None and s["other_processes"] is None and s["busy_pct"] is None
    assert "Not a clean measurement" not in (out / "bench_eval.md").read_text()
