"""The evaluation runner: resume after a kill, sharding + merge, and the report tables, with a fake policy.

The fake policy plays the AutoAct format (thought, action type, argument, reflect) and decides, from a hash of the
question, the scheme and the episode seed, whether the episode finishes with the gold answer, finishes wrong, or
never finishes (OOF). It reports deterministic token counts and seconds, so summaries can be compared exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from eval_suite import run_eval
from eval_suite.run_eval import (
    EPISODES_FILE,
    load_questions,
    merge_dirs,
    read_episodes,
    render_markdown,
    run_episodes,
    summarize,
    write_summary,
)
from lragent.agents import AgentConfig
from lragent.agents.loop import StepStats
from lragent.agents.prompts import OPTION_LETTERS

SCHEMES = ("non_shared", "base_lr_shared")
CONFIG = AgentConfig(max_steps=4)


class FakePolicy:
    """A deterministic :class:`~lragent.agents.Policy`; outcome per (question, scheme, seed)."""

    def __init__(self, scheme: str, seed: int, answers: dict[str, str]) -> None:
        self.scheme, self.seed, self.answers = scheme, seed, answers
        self.trajectory = ""
        self.last_stats: StepStats | None = None
        self.outcome = 0
        self.answer = ""

    def reset(self) -> None:
        self.trajectory = ""
        self.last_stats = None

    @property
    def num_tokens(self) -> int:
        return len(self.trajectory) // 4

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        if not self.trajectory:
            question = next(q for q in self.answers if f"Question:{q}\n" in new_text)
            h = int(hashlib.sha256(f"{question}|{self.scheme}|{self.seed}".encode()).hexdigest(), 16)
            self.outcome = h % 3  # 0: right, 1: wrong, 2: never finishes
            self.answer = self.answers[question] if self.outcome == 0 else "something else"
        self.trajectory += new_text
        if role == "plan" and "[" in stop:
            out = "Finish" if self.outcome < 2 else "Retrieve"
        elif role == "action":
            out = self.answer if self.outcome < 2 else "Metallica"
        elif role == "reflect" and new_text == "\n":
            out = "Reflect[right]"
        else:
            out = "I should think."
        self.trajectory += out
        self.last_stats = StepStats(
            prefill_tokens=len(new_text) // 4, decode_tokens=len(out) // 4, prefill_s=len(new_text) * 1e-4,
            decode_s=len(out) * 1e-3,
        )  # fmt: skip
        return out


class Factory:
    """Counts the episodes it made policies for."""

    def __init__(self, questions) -> None:
        self.answers = {
            q.text: (q.gold if isinstance(q.gold, str) else OPTION_LETTERS[q.gold]) for q in questions
        }  # ScienceQA: the gold letter
        self.calls = 0

    def __call__(self, scheme: str, seed: int) -> FakePolicy:
        self.calls += 1
        return FakePolicy(scheme, seed, self.answers)


def _tools(q):
    return lambda action, arg: f"Nothing about {arg}."


def _run(out: Path, questions, runs: int = 2, schemes=SCHEMES, benchmark="hotpotqa", adapters="init:random", **kw):
    factory = kw.pop("factory", None) or Factory(questions)
    records = run_episodes(
        questions, schemes, runs, factory, out, benchmark=benchmark, adapters=adapters, seed=7,
        agent_config=CONFIG, toolbox_factory=_tools, progress=False, **kw,
    )  # fmt: skip
    return records, factory


@pytest.fixture(scope="module")
def questions():
    return load_questions("hotpotqa", limit=9)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, questions):
    """An uninterrupted run: its directory and summary."""
    out = tmp_path_factory.mktemp("full")
    records, factory = _run(out, questions)
    assert factory.calls == len(records) == 2 * 2 * 9
    return out, write_summary(records, out)


def test_questions_interleave_levels_and_shard():
    qs = load_questions("hotpotqa")
    assert len(qs) == 90
    assert [q.level for q in qs[:6]] == ["easy", "medium", "hard"] * 2
    assert len({q.qid for q in qs}) == 90
    shards = [qs[i::4] for i in range(4)]
    assert sorted(q.qid for s in shards for q in s) == sorted(q.qid for q in qs)
    sq = load_questions("scienceqa", levels=["grade9_12"], limit=2)
    assert [q.level for q in sq] == ["9-12", "9-12"] and "\nOptions:(A) " in sq[0].text


def test_records_hold_scores_and_costs(reference):
    out, summary = reference
    recs = read_episodes(out / EPISODES_FILE)
    r = recs[0]
    assert {"qid", "level", "scheme", "run", "seed", "prediction", "gold", "em", "f1", "oof", "steps"} <= set(r)
    assert {"num_tokens", "stop_reason", "wall_s"} <= set(r)
    assert set(r["roles"]) == {"plan", "action", "reflect"}
    assert {"prefill_s", "decode_s", "prefill_tokens", "decode_tokens"} <= set(r["roles"]["plan"])
    # the fake's three outcomes all occur: right, wrong, OOF
    assert {(x["em"], x["oof"]) for x in recs} == {(1.0, False), (0.0, False), (0.0, True)}
    assert all(x["prediction"] is None for x in recs if x["oof"])
    assert all(x["steps"] == CONFIG.max_steps for x in recs if x["oof"])
    # the same episode seed for every scheme (paired), different across runs
    by_key = {(x["run"], x["qid"]): set() for x in recs}
    for x in recs:
        by_key[(x["run"], x["qid"])].add(x["seed"])
    assert all(len(s) == 1 for s in by_key.values())
    assert summary["episodes"] == {s: {"0": 9, "1": 9} for s in SCHEMES}


def test_resume_after_kill_gives_the_same_summary(tmp_path, questions, reference):
    _, ref_summary = reference
    out = tmp_path / "resumed"
    _, first = _run(out, questions, max_episodes=13)
    assert first.calls == 13
    path = out / EPISODES_FILE
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    # a kill in the middle of writing record 13: keep 12 complete lines and half of the 13th
    path.write_bytes(b"".join(lines[:12]) + lines[12][: len(lines[12]) // 2])
    assert len(read_episodes(path)) == 12
    records, second = _run(out, questions)
    assert second.calls == 36 - 12  # finished entries are not redone; the torn one is
    assert len(path.read_text().splitlines()) == 36
    assert len({run_eval.record_key(r) for r in records}) == 36
    assert write_summary(records, out) == ref_summary
    # a second resume finds nothing to do
    _, third = _run(out, questions)
    assert third.calls == 0


def test_shards_merged_equal_one_run(tmp_path, questions, reference):
    ref_dir, ref_summary = reference
    dirs = []
    for i in range(3):
        d = tmp_path / f"shard{i}"
        _run(d, questions[i::3])
        dirs.append(d)
    merged = merge_dirs(dirs, tmp_path / "merged")
    assert merged == ref_summary
    assert (tmp_path / "merged" / "report.md").read_text() == (ref_dir / "report.md").read_text()


def _table(md: str, title: str) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the Markdown table under the heading that starts with ``title``."""
    block = md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines() if line.startswith("|")
    ]
    return rows[0], rows[2:]


def _expected(records, row, key, levels):
    """Mean ± std over runs of the per-level mean of ``key``, and of the level average, in % (1 decimal)."""
    runs = sorted({r["run"] for r in records if r["row"] == row})
    per_run = []
    for run in runs:
        rr = [r for r in records if r["row"] == row and r["run"] == run]
        lv = {lv: statistics.mean(float(r[key]) for r in rr if r["level"] == lv) for lv in levels}
        lv["avg"] = statistics.mean(lv.values())
        per_run.append(lv)
    out = {}
    for k in [*levels, "avg"]:
        vals = [p[k] for p in per_run]
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        out[k] = (statistics.mean(vals), std)
    return out


def test_markdown_tables_match_the_jsonl(tmp_path, questions, reference):
    ref_dir, _ = reference
    untrained = tmp_path / "untrained"
    _run(untrained, questions, runs=1, schemes=["non_shared"], adapters="init:zero")
    summary = merge_dirs([ref_dir, untrained], tmp_path / "all")
    md = (tmp_path / "all" / "report.md").read_text()
    assert md == render_markdown(summary)
    records = read_episodes(ref_dir / EPISODES_FILE) + read_episodes(untrained / EPISODES_FILE)
    levels = ["easy", "medium", "hard"]
    for title, key in (("Accuracy (exact match)", "em"), ("Accuracy (F1)", "f1"), ("Out-of-function rate", "oof")):
        header, body = _table(md, title)
        tail = ["Δ vs non_shared"] if key != "oof" else []
        assert header == ["Scheme", "Easy", "Medium", "Hard", "Avg", *tail]
        assert [b[0] for b in body] == ["untrained", "non_shared", "base_lr_shared"]
        ref_avg = _expected(records, "non_shared", key, levels)["avg"][0]
        for cells in body:
            exp = _expected(records, cells[0], key, levels)
            want = [f"{100 * m:.1f} ± {100 * s:.1f}" for m, s in (exp[k] for k in [*levels, "avg"])]
            if key != "oof":
                want.append(f"{100 * (exp['avg'][0] - ref_avg):+.1f}")
            assert cells[1:] == want, (title, cells)
    assert "± 0.0" in _table(md, "Accuracy (exact match)")[1][0][1]  # one run: std 0
    header, body = _table(md, "Per question: sequence length")
    assert header == ["Scheme", "Sequence length (tokens)", "Cycles"] and len(body) == 3
    header, body = _table(md, "Per question and role")
    assert len(header) == 1 + 3 * 4 and [b[0] for b in body] == ["untrained", "non_shared", "base_lr_shared"]
    recs = [r for r in records if r["row"] == "base_lr_shared"]
    plan_prefill = statistics.mean(
        statistics.mean(r["roles"]["plan"]["prefill_tokens"] for r in recs if r["run"] == run) for run in (0, 1)
    )
    assert body[2][1] == f"{plan_prefill:.0f}"


def test_scienceqa_accuracy_from_choices(tmp_path):
    qs = load_questions("scienceqa", limit=6)
    records, _ = _run(tmp_path, qs, runs=1, schemes=["full_shared"], benchmark="scienceqa")
    s = summarize(records)
    assert s["metrics"] == ["accuracy"] and s["levels"] == ["1-4", "5-8", "9-12"]
    right = [r for r in records if not r["oof"] and r["prediction"] in OPTION_LETTERS and r["correct"] == 1.0]
    assert right, "the fake answers some questions with the gold letter"
    exp = statistics.mean(statistics.mean(r["correct"] for r in records if r["level"] == lv) for lv in s["levels"])
    assert math.isclose(s["accuracy"]["accuracy"]["full_shared"]["avg"]["mean"], exp)
    assert s["accuracy"]["accuracy"]["full_shared"]["diff_vs_non_shared"] is None


def test_episode_log_errors(tmp_path):
    path = tmp_path / EPISODES_FILE
    path.write_text('{"a": 1}\n{"broken\n{"b": 2}\n')
    with pytest.raises(ValueError, match=":2: broken JSON"):
        read_episodes(path)
    path.write_text('{"a": 1}\n{"b": 2}')  # complete last line without its newline: kept, newline added
    assert read_episodes(path, repair=True) == [{"a": 1}, {"b": 2}]
    assert path.read_text().endswith("}\n")


def test_cli_errors_and_merge(tmp_path, capsys, reference):
    ref_dir, ref_summary = reference
    assert run_eval.main(["--benchmark", "nope", "--adapter-init", "zero"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown benchmark") and err.count("\n") == 1
    assert run_eval.main(["--adapter-init", "zero", "--scheme", "full_shared"]) == 2
    assert "untrained" in capsys.readouterr().err
    assert run_eval.main(["--adapters", str(tmp_path / "none")]) == 2
    assert run_eval.main(["--adapter-init", "random", "--shard", "3/2"]) == 2
    assert run_eval.main(["--merge", str(tmp_path / "missing"), "--out", str(tmp_path / "m")]) == 2
    assert run_eval.main(["--merge", str(ref_dir), "--out", str(tmp_path / "m")]) == 0
    assert json.loads((tmp_path / "m" / "summary.json").read_text()) == json.loads(json.dumps(ref_summary))
    out = capsys.readouterr().out
    assert re.search(r"non_shared: em \d+\.\d ± \d+\.\d OOF", out)


def test_resume_refuses_other_settings(tmp_path):
    run_eval.check_run_config(tmp_path, {"benchmark": "hotpotqa", "temperature": 0.0, "seed": 0})
    run_eval.check_run_config(tmp_path, {"benchmark": "hotpotqa", "temperature": 0.0, "seed": 0, "runs": 3})
    with pytest.raises(ValueError, match="temperature: 0.0 -> 0.7"):
        run_eval.check_run_config(tmp_path, {"benchmark": "hotpotqa", "temperature": 0.7, "seed": 0})


def test_droidspeak_config_file(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"droidspeak_layers": [3, 4, 9], "profile": {}}))
    assert run_eval.load_droidspeak_config(tmp_path / "d.json") == [3, 4, 9]
    (tmp_path / "d.yaml").write_text("droidspeak_layers: [1, 2]\nprofile: {}\n")
    assert run_eval.load_droidspeak_config(tmp_path / "d.yaml") == [1, 2]
    (tmp_path / "bad.json").write_text(json.dumps({"layers": [1]}))
    with pytest.raises(ValueError, match="droidspeak_layers"):
        run_eval.load_droidspeak_config(tmp_path / "bad.json")
