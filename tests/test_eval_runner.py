"""The evaluation runner: resume after a kill, sharding + merge, and the report tables, with a fake policy.

The fake policy plays the AutoAct format (thought, action type, argument, reflect) and decides, from a hash of the
question, the scheme and the episode seed, whether the episode finishes with the gold answer, finishes wrong, or
never finishes (OOF). It reports deterministic token counts and seconds, so summaries can be compared exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
from pathlib import Path

import pytest

import cli
from eval_suite.evaluate import run_eval
from eval_suite.evaluate.benchmarks import load_questions
from eval_suite.evaluate.episode_log import EPISODES_FILE, read_episodes, record_key
from eval_suite.evaluate.eval_report import merge_dirs, render_markdown, summarize, write_summary
from eval_suite.evaluate.executors import SequentialExecutor
from eval_suite.evaluate.run_eval import run_episodes
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

    def choose(self, role: str, new_text: str, options) -> int:
        """Constrained calls: the action type it would have generated, the answer it would have given."""
        self.trajectory += new_text
        want = ("Finish" if self.outcome < 2 else "Retrieve") if role == "plan" else self.answer
        index = list(options).index(want) if want in options else len(options) - 1
        self.trajectory += options[index]
        self.last_stats = StepStats(prefill_tokens=len(new_text) // 4)
        return index


class Factory:
    """Counts the episodes it made policies for."""

    def __init__(self, questions) -> None:
        self.answers = {
            q.text: (q.gold if isinstance(q.gold, str) else OPTION_LETTERS[q.gold]) for q in questions
        }  # ScienceQA: the gold letter
        self.calls = 0

    def __call__(self, task) -> FakePolicy:
        self.calls += 1
        return FakePolicy(task.scheme, task.seed, self.answers)


def _tools(q):
    return lambda action, arg: f"Nothing about {arg}."


def _run(out: Path, questions, runs: int = 2, schemes=SCHEMES, benchmark="hotpotqa", adapters="init:random", **kw):
    factory = kw.pop("factory", None) or Factory(questions)
    kw.setdefault("progress", False)
    records = run_episodes(
        questions, schemes, runs, SequentialExecutor(factory), out, benchmark=benchmark, adapters=adapters, seed=7,
        agent_config=CONFIG, toolbox_factory=_tools, **kw,
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
    # one thought per cycle, beside its action (the thoughts say why an agent answered what it did)
    assert all(len(x["thoughts"]) == len(x["actions"]) == x["steps"] for x in recs)
    assert any(t for x in recs for t in x["thoughts"]) and all(isinstance(t, str) for x in recs for t in x["thoughts"])
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
    assert len({record_key(r) for r in records}) == 36
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
    assert _body(tmp_path / "merged" / "report.md") == _body(ref_dir / "report.md")


def _body(path: Path) -> str:
    """A report without its provenance footer (which names the time and command that wrote it)."""
    text = path.read_text()
    body, footer = text.split("\n---\nProduced on ", 1)
    assert "Command: `" in footer
    return body


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
    md = _body(tmp_path / "all" / "report.md")
    assert md == render_markdown(summary)
    records = read_episodes(ref_dir / EPISODES_FILE) + read_episodes(untrained / EPISODES_FILE)
    levels = ["easy", "medium", "hard"]
    for title, key in (("Accuracy (exact match)", "em"), ("Accuracy (F1)", "f1"), ("Out-of-function rate", "oof")):
        header, body = _table(md, title)
        tail = ["Avg 95% CI", "Δ vs non_shared"] if key != "oof" else []
        assert header == ["Scheme", "Easy", "Medium", "Hard", "Avg", *tail]
        assert [b[0] for b in body] == ["untrained", "non_shared", "base_lr_shared"]
        ref_avg = _expected(records, "non_shared", key, levels)["avg"][0]
        for cells in body:
            exp = _expected(records, cells[0], key, levels)
            runs = len({r["run"] for r in records if r["row"] == cells[0]})
            # one run: the value alone (no spread to show)
            want = [
                f"{100 * m:.1f}" + (f" ± {100 * s:.1f}" if runs > 1 else "")
                for m, s in (exp[k] for k in [*levels, "avg"])
            ]
            if key != "oof":
                mean, std = exp["avg"]
                # two runs: t_{0.975, 1} = tan(0.475 pi) (the Cauchy quantile)
                half = math.tan(0.475 * math.pi) * std / math.sqrt(2)
                want.append(f"[{100 * (mean - half):.1f}, {100 * (mean + half):.1f}]" if runs == 2 else "–")
                want.append(f"{100 * (exp['avg'][0] - ref_avg):+.1f}")
            assert cells[1:] == want, (title, cells)
    assert "±" not in _table(md, "Accuracy (exact match)")[1][0][1]  # one run (untrained): no spread shown
    assert "±" in _table(md, "Accuracy (exact match)")[1][1][1]  # two runs
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

    def run(*argv: str) -> int:
        return cli.main(["eval", *argv])

    assert run("--benchmark", "nope", "--adapter_init", "zero") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown benchmark") and err.count("\n") == 1
    assert run("--adapter_init", "zero", "--scheme", "full_shared") == 2
    assert "untrained" in capsys.readouterr().err
    assert run("--adapters", str(tmp_path / "none")) == 2
    assert run("--adapter_init", "random", "--shard", "3/2") == 2
    assert run("--merge", str(tmp_path / "missing"), "--out", str(tmp_path / "m")) == 2
    assert not (tmp_path / "m").exists()
    assert run("--merge", str(ref_dir), "--out", str(tmp_path / "m")) == 0
    written = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert written.pop("provenance")["command"]
    assert written == json.loads(json.dumps(ref_summary))
    out = capsys.readouterr().out
    assert re.search(r"non_shared: em \d+\.\d ± \d+\.\d OOF", out)
    # several directories as a list; the second copy of every record is a duplicate and is dropped
    assert run("--merge", f"[{ref_dir},{ref_dir}]", "--out", str(tmp_path / "m2")) == 0
    twice = json.loads((tmp_path / "m2" / "summary.json").read_text())
    twice.pop("provenance")
    assert twice.pop("duplicates") == 36 and twice == {k: v for k, v in written.items() if k != "duplicates"}


def test_merge_of_rows_with_other_levels_and_one_run(tmp_path, questions, recwarn):
    """A merged row that lacks a level shows "–" there (no metric is computed on nothing, so no torchmetrics
    warning); one run prints its value without a "± 0.0" spread; the merge's dtype is the episodes' own."""
    _run(tmp_path / "a", questions[:2], runs=1, schemes=["non_shared"], provenance={"dtype": "float32"})
    _run(tmp_path / "b", questions[:1], runs=1, schemes=["non_shared"], adapters="init:zero")
    levels = [q.level for q in questions[:2]]
    assert len(set(levels)) == 2  # the second directory lacks the second question's level
    assert cli.main(["eval", "--merge", f"[{tmp_path / 'a'},{tmp_path / 'b'}]", "--out", str(tmp_path / "m")]) == 0
    assert not [w for w in recwarn if "before the ``update``" in str(w.message)]
    summary = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert summary["accuracy"]["em"]["untrained"][levels[1]]["runs"] == 0
    assert summary["provenance"]["dtype"] == "float32"
    md = (tmp_path / "m" / "report.md").read_text()
    header, body = _table(md, "Accuracy (exact match)")
    cells = dict(zip(header, body[0], strict=True))  # the untrained row
    assert body[0][0] == "untrained" and cells[levels[1].capitalize()] == "–"
    assert all("±" not in c for row in body for c in row)
    assert "dtype float32" in md


def test_resume_refuses_other_settings(tmp_path):
    run_eval.check_run_config(tmp_path, {"benchmark": "hotpotqa", "temperature": 0.0, "seed": 0})
    run_eval.check_run_config(tmp_path, {"benchmark": "hotpotqa", "temperature": 0.0, "seed": 0, "runs": 3})
    with pytest.raises(ValueError, match="temperature: 0.0 -> 0.7"):
        run_eval.check_run_config(tmp_path, {"benchmark": "hotpotqa", "temperature": 0.7, "seed": 0})


def test_a_run_of_the_old_sampler_is_not_resumed_with_the_new_one(tmp_path):
    """A run_config.json from before the sampler was versioned (sampler 1: u could round to 1.0) refuses a resume by
    today's sampler in one line; the records' protocol reads sampler 1, so a row never mixes the two."""
    from eval_suite.evaluate.eval_report import protocol_of
    from lragent.sampling import SAMPLER_VERSION

    old = {"benchmark": "hotpotqa", "temperature": 0.9, "seed": 0}
    (tmp_path / "run_config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=rf"other settings \(sampler: 1 -> {SAMPLER_VERSION}\); use another --out"):
        run_eval.check_run_config(tmp_path, {**old, "sampler": SAMPLER_VERSION})
    run_eval.check_run_config(tmp_path, {**old, "sampler": 1})  # the same run, named explicitly: resumes
    assert protocol_of({"protocol": {"temperature": 0.9}})["sampler"] == 1
    assert protocol_of({"protocol": {"temperature": 0.9, "sampler": 2}})["sampler"] == 2
    recs, _ = _run(tmp_path / "r", load_questions("hotpotqa", limit=2), runs=1, schemes=["full_shared"])
    assert {r["protocol"]["sampler"] for r in recs} == {SAMPLER_VERSION}
    with pytest.raises(ValueError, match="mixes decoding protocols"):
        summarize([{**r, "protocol": {**r["protocol"], "sampler": v}} for r, v in zip(recs, (1, 2), strict=True)])


def test_droidspeak_config_file(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"droidspeak_layers": [3, 4, 9], "profile": {}}))
    assert run_eval.load_droidspeak_config(tmp_path / "d.json") == [3, 4, 9]
    (tmp_path / "d.yaml").write_text("droidspeak_layers: [1, 2]\nprofile: {}\n")
    assert run_eval.load_droidspeak_config(tmp_path / "d.yaml") == [1, 2]
    (tmp_path / "bad.json").write_text(json.dumps({"layers": [1]}))
    with pytest.raises(ValueError, match="droidspeak_layers"):
        run_eval.load_droidspeak_config(tmp_path / "bad.json")


# ------------------------------------------------------------------------------ protocols, executors, the command
def test_constrained_rows_are_their_own_rows(tmp_path):
    qs = load_questions("scienceqa", limit=6)
    free, _ = _run(tmp_path / "free", qs, runs=1, schemes=["full_shared"], benchmark="scienceqa")
    cons, _ = _run(
        tmp_path / "cons", qs, runs=1, schemes=["full_shared"], benchmark="scienceqa",
        constraints=("action_type", "answer"), temperature=0.9, top_p=0.75,
    )  # fmt: skip
    assert {r["row"] for r in cons} == {"full_shared+constrained"}
    assert all(
        r["protocol"] == {"temperature": 0.9, "top_p": 0.75, "constraints": ["action_type", "answer"], "sampler": 2}
        for r in cons
    )
    assert all(r["constrained_calls"] >= 2 for r in cons if not r["oof"])  # action type + answer at least
    assert all(r["constrained_calls"] == 0 for r in free)
    # the same fake decisions: a constrained episode answers what the free one generated if that is an option
    # letter, some option letter if not (the fake's "something else"), and nothing when the free one did not answer
    for f, c in zip(free, cons, strict=True):
        letters = tuple(OPTION_LETTERS[: len(f["choices"])])
        assert (c["prediction"] is None) == (f["prediction"] is None)
        if f["prediction"] in letters:
            assert c["prediction"] == f["prediction"]
        elif f["prediction"] is not None:
            assert c["prediction"] in letters
    assert any(f["prediction"] == "something else" for f in free)
    s = merge_dirs([tmp_path / "free", tmp_path / "cons"], tmp_path / "both")
    assert s["rows"] == ["full_shared", "full_shared+constrained"]
    assert s["protocol"]["full_shared+constrained"]["constraints"] == ["action_type", "answer"]
    assert s["episodes"] == {"full_shared": {"0": 6}, "full_shared+constrained": {"0": 6}}
    mixed = [dict(r) for r in cons]
    mixed[0]["protocol"] = {**mixed[0]["protocol"], "temperature": 0.0}
    with pytest.raises(ValueError, match="mixes decoding protocols"):
        summarize(mixed)


class ReversedExecutor:
    """Takes every task first, then hands results back last task first; checks each was logged before the next."""

    def __init__(self, factory, log_path: Path) -> None:
        self.factory, self.log_path, self.order = factory, log_path, []

    def run(self, tasks):
        from lragent.agents import drive

        pending = list(tasks)
        before = len(read_episodes(self.log_path))
        for k, task in enumerate(reversed(pending)):
            policy = self.factory(task)
            policy.reset()
            self.order.append(task.key)
            yield task, drive(task.episode, policy)
            assert len(read_episodes(self.log_path)) == before + k + 1  # appended as soon as it arrived


def test_results_in_any_order_give_the_same_summary(tmp_path, questions, reference):
    _, ref_summary = reference
    out = tmp_path / "reversed"
    executor = ReversedExecutor(Factory(questions), out / EPISODES_FILE)
    records = run_episodes(
        questions, SCHEMES, 2, executor, out, benchmark="hotpotqa", adapters="init:random", seed=7,
        agent_config=CONFIG, toolbox_factory=_tools, progress=False,
    )  # fmt: skip
    assert [record_key(r) for r in records] == executor.order
    assert executor.order == sorted(executor.order, key=executor.order.index) and len(executor.order) == 36
    assert summarize(records) == ref_summary


def test_progress_bar_counts_the_whole_grid(tmp_path, questions, monkeypatch):
    import tqdm.auto

    bars = []

    class Recorder:
        def __init__(self, total, initial, disable, **kw):
            self.total, self.n, self.disable, self.postfix = total, initial, disable, None
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, k):
            self.n += k

        def set_postfix(self, **kw):
            self.postfix = kw

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    out = tmp_path / "bar"
    _run(out, questions, max_episodes=5, progress=True)
    records, _ = _run(out, questions, progress=True)
    first, second = bars
    assert first.total == second.total == 9 * 2 * 2  # questions x runs x rows
    assert (first.n, second.n) == (5, 36) and second.n - 31 == 5  # the resume starts at the 5 done
    oof = sum(r["oof"] for r in records)
    assert second.postfix == {"oof": f"{oof}/36"}


def test_second_eval_on_the_same_out_is_refused(tmp_path, capsys):
    import subprocess
    import sys

    from eval_suite.evaluate.dir_lock import DirectoryBusyError, DirectoryLock
    from eval_suite.evaluate.run_eval import evaluate

    out = tmp_path / "busy"
    with DirectoryLock(out):
        with pytest.raises(DirectoryBusyError, match=r"in use by another eval \(pid \d+"):
            evaluate(
                benchmark="scienceqa", adapter_init="zero", limit=1, runs=1, max_steps=1, thought_tokens=1,
                argument_tokens=1, out=str(out), quiet=True,
            )  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == [".eval.lock"]  # nothing else written
    # a lock held by another process: the command refuses with one line, exit status 2
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from eval_suite.evaluate.dir_lock import DirectoryLock; "
         f"l = DirectoryLock({str(out)!r}); l.acquire(); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / EPISODES_FILE).write_text("")
        assert cli.main(["eval", "--merge", str(empty), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pid {holder.pid}" in err and "use another --out" in err
    finally:
        holder.kill()
        holder.wait()
    with DirectoryLock(out):  # released when its holder died
        pass


def test_command_checks_before_writing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    for argv, message in (
        (["--temperature", ".nan"], "temperature must be a finite number"),
        (["--temperature=-1"], "temperature must be a finite number"),
        (["--top_p", "0"], "top_p must be in (0, 1]"),
        (["--top_p", "1.5"], "top_p must be in (0, 1]"),
        (["--constrain", "actions"], "--constrain 'actions'"),
        (["--levels", "easy,extreme"], "unknown hotpotqa level 'extreme'"),
        (["--corpus", str(tmp_path / "none.jsonl")], "--corpus"),
        (["--runs", "0"], "--runs must be >= 1, got 0"),
        (["--prefill_in_decode", "-1"], "--prefill_in_decode must be >= 0, got -1"),
        (["--feed_budget", "-1"], "--feed_budget must be >= 0, got -1"),
        (["--devices", "2", "--shard", "0/2"], "give --devices or --shard, not both"),
    ):
        assert cli.main(["eval", "--adapter_init", "zero", "--out", str(out), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (argv, err)
        assert not out.exists()
    monkeypatch.setattr(run_eval, "DATA_DIR", tmp_path)
    assert cli.main(["eval", "--benchmark", "scienceqa", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"trained shared-A adapters {tmp_path / 'adapters' / 'scienceqa_sharedA'} are missing" in err
    assert "--adapter_init zero" in err and not out.exists()


@pytest.mark.model
def test_eval_command_end_to_end_on_the_embedded_model(tmp_path, capsys):
    """One constrained, sampled ScienceQA episode through the real command: records, provenance, report, resume."""
    out = tmp_path / "e2e"
    argv = [
        "eval", "--benchmark", "scienceqa", "--adapter_init", "zero", "--limit", "1", "--runs", "1", "--max_steps",
        "1", "--thought_tokens", "6", "--argument_tokens", "4", "--constrain", "all", "--out", str(out), "--quiet",
        "true",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    (rec,) = read_episodes(out / EPISODES_FILE)
    assert rec["row"] == "untrained+constrained" and rec["adapters"] == "init:zero"
    assert rec["protocol"] == {
        "temperature": 0.9,
        "top_p": 0.75,
        "constraints": ["action_type", "answer"],
        "sampler": 2,
    }
    types = ("Image2Text", "BingSearch", "Retrieve", "Finish")
    assert rec["constrained_calls"] >= 1 and all(a.split("[", 1)[0] in types for a in rec["actions"])
    assert {"command", "device", "dtype", "versions", "git_commit"} <= set(rec["provenance"])
    assert rec["provenance"]["dtype"] == "float32" and rec["provenance"]["device"]["type"] == "cpu"
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "run_config.json").read_text())
    assert summary["provenance"]["git_commit"] == config["provenance"]["git_commit"] == rec["provenance"]["git_commit"]
    assert "\n---\nProduced on " in (out / "report.md").read_text()
    assert config["corpus"]["passages"] > 200 and config["top_p"] == 0.75
    timing = json.loads((out / "timing.json").read_text())  # this process: setup, then the episode loop
    assert timing["episodes"] == 1 and timing["episodes_s"] > 0 and timing["setup_s"] > 0
    capsys.readouterr()
    assert cli.main(argv) == 0  # resume: nothing left to run
    assert len(read_episodes(out / EPISODES_FILE)) == 1
    again = json.loads((out / "timing.json").read_text())  # a rerun that ran nothing leaves the timing as it was
    assert again == timing and again["runs_resumed"] == 0 and again["complete"] is True


def _tiny_model_with_embedded_tokenizer(directory: Path) -> Path:
    """A 2-layer random llama (hidden 64) with the embedded model's tokenizer, saved as a local model directory: the
    agent loop runs its real prompts through it in milliseconds (near-uniform logits, so every sampled token depends
    on the episode's seed)."""
    from lragent.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("default")
    overrides = {"vocab_size": len(tokenizer), "num_hidden_layers": 2, "max_position_embeddings": 8192}
    model, _ = load_model("tiny-llama", seed=0, overrides=overrides)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.model
def test_a_killed_eval_keeps_its_timing_and_the_resumed_run_adds_to_it(tmp_path, monkeypatch):
    """timing.json is written as the episodes finish (a kill keeps what the run spent) and a resumed run adds its
    part: the top level sums both, ``parts`` keeps each. A tiny random model with the embedded tokenizer."""
    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    out = tmp_path / "killed"
    argv = ["eval", "--benchmark", "hotpotqa", "--scheme", "non_shared", "--limit", "3", "--max_steps", "1",
            "--thought_tokens", "4", "--argument_tokens", "3", "--model", str(tiny), "--adapter_init", "random",
            "--runs", "1", "--device", "cpu", "--quiet", "true", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(run_eval, "TIMING_EVERY_S", 0.0)  # every finished episode rewrites timing.json
    real = run_eval.run_episodes

    def killed_after_two(*args, on_record=None, **kwargs):
        appended = []

        def record() -> None:
            on_record()
            appended.append(1)
            if len(appended) == 2:
                raise KeyboardInterrupt  # the call's time limit, after two episodes were written

        return real(*args, on_record=record, **kwargs)

    monkeypatch.setattr(run_eval, "run_episodes", killed_after_two)
    assert cli.main(argv) == 130  # "interrupted: finished episodes are in ..."
    first = json.loads((out / "timing.json").read_text())
    assert first["complete"] is False and first["episodes"] == 2 and first["episodes_s"] > 0
    assert len(read_episodes(out / EPISODES_FILE)) == 2
    monkeypatch.setattr(run_eval, "run_episodes", real)
    assert cli.main(argv) == 0  # resumes: the third episode
    t = json.loads((out / "timing.json").read_text())
    assert t["complete"] is True and t["runs_resumed"] == 1 and [p["episodes"] for p in t["parts"]] == [2, 1]
    assert [p["complete"] for p in t["parts"]] == [False, True]
    for key in ("episodes", "episodes_s", "setup_s", "startup_s"):  # the top level: both runs together
        assert t[key] == pytest.approx(sum(p[key] for p in t["parts"])), key
    assert t["parts"][0]["episodes_s"] == pytest.approx(first["episodes_s"])


@pytest.mark.model
def test_an_interrupt_between_a_records_append_and_its_count_keeps_the_logs_count(tmp_path, monkeypatch):
    """A signal that lands after an episode's record is in the log but before the loop counted it: timing.json says
    the episodes the log holds (2), not the ones counted (1)."""
    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    out = tmp_path / "cut"
    argv = ["eval", "--benchmark", "hotpotqa", "--scheme", "non_shared", "--limit", "3", "--max_steps", "1",
            "--thought_tokens", "4", "--argument_tokens", "3", "--model", str(tiny), "--adapter_init", "random",
            "--runs", "1", "--device", "cpu", "--quiet", "true", "--out", str(out)]  # fmt: skip
    real = run_eval.run_episodes

    def cut_after_the_second_append(*args, on_record=None, **kwargs):
        seen = []

        def record() -> None:
            seen.append(1)
            if len(seen) == 2:
                raise KeyboardInterrupt  # the second record is in the log; on_record never counted it
            on_record()

        return real(*args, on_record=record, **kwargs)

    monkeypatch.setattr(run_eval, "run_episodes", cut_after_the_second_append)
    assert cli.main(argv) == 130
    timing = json.loads((out / "timing.json").read_text())
    assert len(read_episodes(out / EPISODES_FILE)) == 2
    assert timing["complete"] is False and timing["episodes"] == 2


@pytest.mark.model
def test_sigterm_stops_an_eval_like_ctrl_c_with_its_records_and_time_kept(tmp_path):
    """``timeout``'s SIGTERM (a device call's limit) mid-loop: exit 130 with one line, no traceback, and timing.json
    holds exactly the episodes the log holds (written on the way out, not only every few seconds)."""
    import signal
    import subprocess
    import sys
    import time

    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    out = tmp_path / "termed"
    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(repo / "cli.py"), "eval", "--benchmark", "hotpotqa", "--scheme", "non_shared",
            "--limit", "30", "--max_steps", "2", "--thought_tokens", "8", "--argument_tokens", "4", "--model",
            str(tiny), "--adapter_init", "random", "--runs", "2", "--device", "cpu", "--quiet", "true",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=repo, stderr=subprocess.PIPE, text=True)
    log = out / EPISODES_FILE
    deadline = time.monotonic() + 240
    while (not log.is_file() or len(read_episodes(log)) < 2) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()  # still running: 60 episodes take far longer than two
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: finished episodes are in" in err and "Traceback" not in err
    timing = json.loads((out / "timing.json").read_text())
    assert timing["complete"] is False and timing["episodes"] == len(read_episodes(log)) >= 2


@pytest.mark.model
def test_devices_shards_equal_one_process(tmp_path, capsys):
    """eval --devices 2 (two shard processes, merged) gives the same episodes as one process: same questions, same
    seeds, same predictions and lengths. A tiny random model with the embedded tokenizer: what is pinned is which
    questions and seeds each shard runs, not the model."""
    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    base = ["eval", "--benchmark", "hotpotqa", "--scheme", "non_shared", "--limit", "4", "--max_steps", "1",
            "--thought_tokens", "4", "--argument_tokens", "3", "--model", str(tiny), "--adapter_init", "random",
            "--runs", "1", "--device", "cpu",
            "--quiet", "true"]  # fmt: skip
    assert cli.main([*base, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*base, "--devices", "2", "--out", str(tmp_path / "two")]) == 0

    def episodes(d):
        rows = []
        for f in sorted(d.rglob("episodes.jsonl")):
            rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        # the seed and the sampled actions (a random model's tokens differ with the seed), answers and lengths
        return sorted((r["qid"], r["seed"], r["actions"], r["prediction"], r["num_tokens"], r["steps"]) for r in rows)

    one, two = episodes(tmp_path / "one"), episodes(tmp_path / "two")
    assert len(one) == 4 and one == two
    # the console entry started the shards itself, before its own imports (eval_suite/evaluate/shard_launch.py);
    # evaluate() called directly launches them after its checks: the same episodes either way
    assert json.loads((tmp_path / "two" / "launch.json").read_text())["early"] is True
    kw = {k.removeprefix("--"): v for k, v in zip(base[1::2], base[2::2], strict=True)}
    kw.update(limit=4, max_steps=1, thought_tokens=4, argument_tokens=3, runs=1, quiet=False)
    capsys.readouterr()
    assert run_eval.evaluate(**kw, devices=2, out=str(tmp_path / "three")) == 0
    assert episodes(tmp_path / "three") == one
    assert "eval hotpotqa (2 shards): 100%" in capsys.readouterr().err  # the launcher's bar over the shards' logs
    assert json.loads((tmp_path / "three" / "launch.json").read_text())["early"] is False
    shard_timing = [json.loads((tmp_path / "two" / f"shard_{i}" / "timing.json").read_text()) for i in (0, 1)]
    # the shards took their episodes from one queue (eval_suite/evaluate/work_queue.py): each of the 4 ran once, on one
    # shard, and only the launcher's merge summarises (a shard holds whichever episodes it got)
    assert sum(t["episodes"] for t in shard_timing) == 4
    assert len(list((tmp_path / "two" / "queue").iterdir())) == 4
    assert not (tmp_path / "two" / "shard_0" / "summary.json").exists()
    # each shard's torch pool got its share of the cores (shard_launch), as its timing.json records
    share = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 2))
    assert [t["torch_threads"] for t in shard_timing] == [share, share]
    # where the wall went: each shard's start before run_plan, its parts before the loop, and the launcher's record
    for t in shard_timing:
        assert {"advance_s", "sync_s", "replay_s", "wait_s", "agent_s"} <= set(t), sorted(t)  # the loop's splits
        assert 0 < t["startup_s"] < 120 and t["prepare_s"] + t["load_s"] + t["size_s"] == pytest.approx(t["setup_s"])
        assert t["summary_s"] >= 0
    launch = json.loads((tmp_path / "two" / "launch.json").read_text())
    assert launch["devices"] == 2 and launch["launch_s"] >= 0 and launch["merge_s"] >= 0
    for wall, t in zip(launch["shard_wall_s"], shard_timing, strict=True):  # a shard's life holds its own clocks
        assert wall >= t["setup_s"] + t["episodes_s"] + t["summary_s"]
        # a console eval ends without the interpreter's teardown (lragent/cli_main.py:_exit_now), which took 1.3 s
        # of each shard's life on a 2-core CPU: the time after its summary is now its exit alone
        assert wall - t["startup_s"] - t["setup_s"] - t["episodes_s"] - t["summary_s"] < 0.7
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["episodes"]["non_shared"] == {"0": 4}


@pytest.mark.model
def test_several_benchmarks_in_one_process_and_on_two_shards_equal_one_run_each(tmp_path, capsys):
    """eval --benchmark hotpotqa,scienceqa runs both in one process, into OUT/<benchmark>, each with its own adapters
    (--adapters DIR/{benchmark}...): the same records as one eval per benchmark, the process's start counted once.
    With --devices 2 each shard runs both in turn from one queue per benchmark: the same records again, one launch."""
    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    base = ["eval", "--scheme", "non_shared", "--limit", "2", "--max_steps", "1", "--thought_tokens", "4",
            "--argument_tokens", "3", "--model", str(tiny), "--adapter_init", "random", "--runs", "2", "--device",
            "cpu", "--quiet", "true"]  # fmt: skip

    def records(d: Path) -> list:
        rows = [json.loads(x) for f in sorted(d.rglob(EPISODES_FILE)) for x in f.read_text().splitlines() if x]
        return sorted((r["benchmark"], r["qid"], r["run"], r["seed"], r["actions"], r["prediction"], r["num_tokens"])
                      for r in rows)  # fmt: skip

    for b in ("hotpotqa", "scienceqa"):
        assert cli.main([*base, "--benchmark", b, "--out", str(tmp_path / "apart" / b)]) == 0
    assert cli.main([*base, "--benchmark", "hotpotqa,scienceqa", "--out", str(tmp_path / "one")]) == 0
    printed = capsys.readouterr().out
    assert "hotpotqa non_shared: em " in printed and "scienceqa non_shared: accuracy " in printed
    apart = records(tmp_path / "apart")
    assert len(apart) == 8 and {r[0] for r in apart} == {"hotpotqa", "scienceqa"}
    assert records(tmp_path / "one") == apart
    for b in ("hotpotqa", "scienceqa"):  # each benchmark's own folder, summary and timing
        assert json.loads((tmp_path / "one" / b / "summary.json").read_text())["episodes"]["non_shared"] == {
            "0": 2,
            "1": 2,
        }
    first, second = (json.loads((tmp_path / "one" / b / "timing.json").read_text()) for b in ("hotpotqa", "scienceqa"))
    assert first["startup_s"] > 0 and second["startup_s"] == 0.0  # the process's start belongs to its first benchmark
    two = ["--benchmark", "[hotpotqa,scienceqa]", "--devices", "2", "--out", str(tmp_path / "two")]
    assert cli.main([*base, *two]) == 0
    assert records(tmp_path / "two") == apart
    launch = json.loads((tmp_path / "two" / "launch.json").read_text())
    assert launch["benchmarks"] == ["hotpotqa", "scienceqa"] and launch["early"] is True
    for b in ("hotpotqa", "scienceqa"):  # one queue per benchmark; each shard folder beside its benchmark's others
        assert len(list((tmp_path / "two" / b / "queue").iterdir())) == 4
        assert sum(json.loads((tmp_path / "two" / b / f"shard_{i}" / "timing.json").read_text())["episodes"]
                   for i in (0, 1)) == 4  # fmt: skip
        assert (tmp_path / "two" / b / "summary.json").is_file()
    assert not (tmp_path / "two" / "hotpotqa" / "shard_0" / "summary.json").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--benchmark", "hotpotqa,hotpotqa"], "names a benchmark twice"),
        (["--benchmark", "hotpotqa,nosuch"], "unknown benchmark 'nosuch': allowed hotpotqa, scienceqa"),
        (["--benchmark", ","], "give hotpotqa, scienceqa, or a comma list of them"),
        (["--benchmark", "hotpotqa,scienceqa", "--merge", "[a,b]"], "--merge summarises the folders of one benchmark"),
        (["--benchmark", "hotpotqa,scienceqa", "--shard", "0/2", "--work_queue", "Q"], "put {benchmark} in it"),
        (["--benchmark", "hotpotqa,scienceqa", "--devices", "2", "--out", "O/{benchmark}"], "give --out without"),
    ],
)
def test_bad_benchmark_lists_are_refused_in_one_line(extra, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "--adapter_init", "random", "--limit", "2", "--device", "cpu", "--out", "o", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "O").exists()  # refused before anything is written


def test_several_benchmarks_into_an_existing_file_are_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "o").write_text("not a folder")
    argv = ["eval", "--benchmark", "hotpotqa,scienceqa", "--adapter_init", "random", "--limit", "2", "--device", "cpu",
            "--out", str(tmp_path / "o")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'o'} is an existing file; give a directory" in err and "Traceback" not in err


class _Stop(Exception):
    pass


FIVE = ["non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared"]


@pytest.mark.parametrize(
    ("kwargs", "schemes", "note"),
    [
        ({"limit": 2, "adapter_init": "random"}, ["base_lr_shared"], True),  # a quick look: one scheme
        ({"adapter_init": "random"}, FIVE, False),  # the whole benchmark: the paper's five rows
        ({"limit": 2, "adapter_init": "random", "scheme": "all"}, FIVE, False),
        ({"limit": 2, "adapter_init": "random", "scheme": "non_shared"}, ["non_shared"], False),
        ({"limit": 2, "adapter_init": "zero"}, ["non_shared"], False),  # the untrained row is one row
    ],
)
def test_default_scheme_follows_limit(kwargs, schemes, note, tmp_path, monkeypatch, capsys):
    """``eval --limit N`` without --scheme runs base_lr_shared only (and says so); without --limit, or with
    --scheme all, the five schemes run. Nothing is loaded: the run stops where the episodes would start."""
    seen = {}

    def stop(questions, schemes, runs, *args, **kw):
        seen["schemes"] = list(schemes)
        raise _Stop

    monkeypatch.setattr(run_eval, "load_lora_model", lambda **kw: (None, None))
    monkeypatch.setattr(run_eval, "build_policy_factory", lambda *a, **kw: None)
    monkeypatch.setattr(run_eval, "run_episodes", stop)
    with pytest.raises(_Stop):
        run_eval.evaluate(**kwargs, out=str(tmp_path / "o"), device="cpu", quiet=True)
    assert seen["schemes"] == schemes
    assert ("--limit without --scheme runs base_lr_shared only" in capsys.readouterr().err) == note


def test_each_shard_sees_its_own_gpu_and_a_share_of_the_cores():
    """eval --devices N: shard i sees only the i-th visible GPU (nothing of it can land on another shard's GPU) and
    an N-th of the cores for its thread pools, unless the user set them; CPU shards keep their device."""
    from eval_suite.evaluate.shard_launch import shard_launch

    launches = [shard_launch(i, 4, 4, None, {"PATH": "/bin"}, 64) for i in range(4)]
    assert [dev for dev, _ in launches] == ["cuda"] * 4
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launches] == ["0", "1", "2", "3"]
    # a GPU shard's share (64 // 4) capped at GPU_HOST_THREADS: its host work is small ops a wide pool slows down
    assert {env["OMP_NUM_THREADS"] for _, env in launches} == {"4"} and launches[0][1]["PATH"] == "/bin"
    # the parent's own visible GPUs are mapped, not renumbered; a user's thread setting wins
    parent = {"CUDA_VISIBLE_DEVICES": "4,5, 6,7", "OMP_NUM_THREADS": "3"}
    launches = [shard_launch(i, 4, 4, "cuda", parent, 64) for i in range(4)]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launches] == ["4", "5", "6", "7"]
    assert launches[2][1]["OMP_NUM_THREADS"] == "3" and launches[2][1]["MKL_NUM_THREADS"] == "4"
    assert shard_launch(0, 2, 2, "cuda", {}, 6)[1]["OMP_NUM_THREADS"] == "3"  # a share under the cap stays
    assert parent["CUDA_VISIBLE_DEVICES"] == "4,5, 6,7"  # the caller's environment is not changed
    dev, env = shard_launch(1, 2, 0, "cpu", {}, 2)
    assert dev == "cpu" and "CUDA_VISIBLE_DEVICES" not in env and env["OMP_NUM_THREADS"] == "1"
    assert shard_launch(1, 2, 0, "cpu", {}, 64)[1]["OMP_NUM_THREADS"] == "32"  # CPU shards: the model uses the pool


def test_a_gpu_eval_caps_its_host_threads_unless_the_user_set_them():
    """One eval on a GPU takes at most GPU_HOST_THREADS torch threads (64 made its episode loop 2.3x slower on an
    H100 host); OMP_NUM_THREADS set by the user holds; a CPU eval keeps its pool; a small pool is left alone."""
    from lragent.host_threads import GPU_HOST_THREADS, host_threads

    assert host_threads("cuda", {}, 64) == GPU_HOST_THREADS == 4
    assert host_threads("cuda:1", {"PATH": "/bin"}, 16) == 4
    assert host_threads("cuda", {"OMP_NUM_THREADS": "64"}, 64) is None
    assert host_threads("cpu", {}, 64) is None
    assert host_threads("cuda", {}, 2) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "-1"], "--batch must be >= 0 (0: one episode at a time), got -1"),
        (["--batch", "2", "--capacity", "4000"], "--capacity must be >= 4096 positions per episode, got 4000"),
        (
            ["--batch", "2", "--capacity", "8192", "--max_context_tokens", "6200"],
            "--max_context_tokens 6200 leaves no room for a cycle: allowed <= capacity - 2048",
        ),
        (["--shard", "first"], "--shard 'first' must look like i/n (e.g. 0/4)"),
    ],
)
def test_batch_capacity_and_shard_options_are_refused_naming_the_value(tmp_path, capsys, argv, message):
    out = tmp_path / "o"  # a model without a tokenizer: were the option let through, the next check stops the run
    assert cli.main(["eval", "--adapter_init", "zero", "--model", "tiny-llama", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_merge_needs_directories_of_one_benchmark_and_one_adapter_set_per_row(tmp_path, capsys, reference):
    ref_dir, _ = reference
    out = tmp_path / "m"
    assert cli.main(["eval", "--merge", "[]", "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: --merge needs at least one output directory")
    with pytest.raises(FileNotFoundError, match=f"--merge {tmp_path}: no {EPISODES_FILE} there"):
        merge_dirs([ref_dir, tmp_path], out)
    assert not out.exists()
    records = read_episodes(ref_dir / EPISODES_FILE)
    with pytest.raises(ValueError, match="no episode records to summarise"):
        summarize([])
    other = [{**r, "benchmark": "scienceqa"} if i == 0 else r for i, r in enumerate(records)]
    with pytest.raises(ValueError, match=r"records of several benchmarks \['hotpotqa', 'scienceqa'\]: summarise them"):
        summarize(other)
    row = records[0]["row"]
    mixed = [{**r, "adapters": "other/set"} if i == 0 else r for i, r in enumerate(records)]
    with pytest.raises(ValueError, match=rf"row '{row}' mixes results of different adapters \['init:random', 'other"):
        summarize(mixed)


def test_every_corpus_file_is_checked_and_existing_ones_are_kept_in_order(tmp_path):
    """``--corpus`` files: each is checked, not only the first (the missing second one is named), and a plan of
    existing files keeps them all, in order, without writing the output folder."""
    import inspect

    call = {k: p.default for k, p in inspect.signature(run_eval.evaluate).parameters.items()}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"title": "A", "text": "a"}\n')
    call.update(adapter_init="zero", out=str(tmp_path / "o"), corpus=[str(first), str(second)])
    with pytest.raises(FileNotFoundError, match=f"^--corpus {re.escape(str(second))}: no such file$"):
        run_eval.check_eval_args(call, notes=False)
    second.write_text('{"title": "B", "text": "b"}\n')
    assert run_eval.check_eval_args(call, notes=False).corpus_files == [str(first), str(second)]
    assert not (tmp_path / "o").exists()


@pytest.mark.model
def test_eval_launch_ahead_is_an_option_its_records_name(tmp_path):
    """``eval --batch 2 --launch_ahead true`` runs the batched loop with the next steps queued before the host answers
    (the executor's own test pins the order and the episodes); timing.json, beside the other decode settings, says it
    ran so."""
    tiny = _tiny_model_with_embedded_tokenizer(tmp_path / "tiny")
    out = tmp_path / "ahead"
    assert run_eval.evaluate(
        benchmark="hotpotqa", scheme="base_lr_shared", limit=2, runs=1, max_steps=1, thought_tokens=4,
        argument_tokens=3, model=str(tiny), adapter_init="random", device="cpu", batch=2, launch_ahead=True,
        quiet=True, out=str(out),
    ) == 0  # fmt: skip
    assert len(read_episodes(out / EPISODES_FILE)) == 2
    timing = json.loads((out / "timing.json").read_text())
    assert timing["launch_ahead"] is True and timing["batch"] == 2
