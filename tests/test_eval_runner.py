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


class OutOfMemoryAt(Factory):
    """A :class:`Factory` whose policy for the episode after ``calls`` made ones runs out of memory."""

    def __init__(self, calls: int, questions) -> None:
        super().__init__(questions)
        self.at = calls

    def __call__(self, task) -> FakePolicy:
        if self.calls == self.at:
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().__call__(task)


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
    assert re.search(r"^non_shared: em \d+\.\d ± \d+\.\d OOF", out, re.M)  # one benchmark: no name before the row
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
    _, again = _run(
        tmp_path / "cons", qs, runs=1, schemes=["full_shared"], benchmark="scienceqa",
        constraints=("action_type", "answer"), temperature=0.9, top_p=0.75,
    )  # fmt: skip
    assert again.calls == 0  # resumed: the log's episodes are found under their row's name, not the scheme's
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
    done, _ = _run(out, questions, max_episodes=10, progress=True)
    records, _ = _run(out, questions, progress=True)
    first, second = bars
    assert first.total == second.total == 9 * 2 * 2  # questions x runs x rows
    assert (first.n, second.n) == (10, 36) and second.n - 26 == 10  # the resume starts at the 10 done
    assert first.postfix == {"oof": f"{sum(r['oof'] for r in done)}/10"} != {"oof": "0/10"}
    oof = sum(r["oof"] for r in records)
    assert second.postfix == {"oof": f"{oof}/36"}  # the logged episodes' OOF counted too


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


# ------------------------------------------------------------------ the command's small parts, one value at a time
def test_cli_values_last_lines_shards_and_seeds(tmp_path):
    """What --devices re-issues per shard (booleans lower case, lists bracketed), a shard log's last line, --shard's
    parse and the paired episode seed, each against its value."""
    assert [run_eval._cli_value(v) for v in (True, False, [1, "a"], ("x", 2), 0.5, "s")] == [
        "true", "false", "[1,a]", "[x,2]", "0.5", "s"
    ]  # fmt: skip
    log = tmp_path / "shard_0.log"
    assert run_eval._last_line(log) == "no output"  # not written
    log.write_text("")
    assert run_eval._last_line(log) == "no output"
    log.write_text("first\n  error: the one line  \n\n   \n")
    assert run_eval._last_line(log) == "error: the one line"
    log.write_text("x" * 400 + "\n")
    assert run_eval._last_line(log) == "x" * 300
    log.write_bytes(b"error: \xff bad byte\n")  # a shard's output is not always UTF-8: read, not refused
    assert run_eval._last_line(log) == "error: \ufffd bad byte"
    assert run_eval.parse_shard("0/1") == (0, 1) and run_eval.parse_shard("3/4") == (3, 4)
    for bad, why in (("4/4", "need 0 <= i < n"), ("-1/4", "need 0 <= i < n"), ("0/0", "need 0 <= i < n"),
                     ("1/2/3", "must look like i/n"), ("a/2", "must look like i/n")):  # fmt: skip
        with pytest.raises(
            ValueError, match=f"^--shard {re.escape(repr(bad))}: {why}|^--shard {re.escape(repr(bad))} {why}"
        ):
            run_eval.parse_shard(bad)
    digest = hashlib.sha256(b"7:2:q-1").hexdigest()
    assert run_eval.episode_seed(7, 2, "q-1") == int(digest[:8], 16)
    assert 0 <= run_eval.episode_seed(0, 0, "x") < 2**32
    assert len({run_eval.episode_seed(b, r, q) for b in (0, 1) for r in (0, 1) for q in ("a", "b")}) == 8


def test_run_config_is_written_then_kept_and_old_files_read_with_their_defaults(tmp_path):
    """The first run writes run_config.json (its folder created); a resume with the same identity rewrites it; an
    older file without sampler/split reads as sampler 1 and split dev; only the fields that differ are named."""
    out = tmp_path / "a" / "b"
    config = {k: 1 for k in run_eval.IDENTITY_FIELDS} | {"sampler": 2, "split": ["dev"], "runs": 3}
    run_eval.check_run_config(out, config)
    assert json.loads((out / "run_config.json").read_text()) == config
    run_eval.check_run_config(out, {**config, "runs": 5})  # not an identity field
    assert json.loads((out / "run_config.json").read_text())["runs"] == 5
    old = {k: v for k, v in config.items() if k not in ("sampler", "split")}
    (out / "run_config.json").write_text(json.dumps(old))
    run_eval.check_run_config(out, {**old, "sampler": 1, "split": ["dev"]})  # what the old file meant
    (out / "run_config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError) as err:
        run_eval.check_run_config(out, {**old, "seed": 2, "split": ["test"], "sampler": 1})
    assert (
        str(err.value)
        == f"{out} holds a run with other settings (seed: 1 -> 2, split: ['dev'] -> ['test']); use another --out"
    )


def test_lists_adapter_defaults_and_benchmark_calls():
    assert run_eval._as_list(None) == [] and run_eval._as_list("") == []
    assert run_eval._as_list(" a, b,,c ") == ["a", "b", "c"] and run_eval._as_list([1, "x"]) == ["1", "x"]
    d = Path("/data")
    assert run_eval.default_adapters("hotpotqa", d) == d / "adapters" / "hotpotqa_sharedA"
    assert run_eval.default_adapters("scienceqa", d, "Qwen2.5-Coder-1.5B") == d / "adapters" / "qwen_scienceqa_sharedA"
    assert run_eval.default_adapters("scienceqa", d, "other") == d / "adapters" / "scienceqa_sharedA"
    assert run_eval.default_adapters("hotpotqa") == run_eval.DATA_DIR / "adapters" / "hotpotqa_sharedA"
    assert run_eval.benchmark_names("scienceqa,hotpotqa") == ["scienceqa", "hotpotqa"]
    assert run_eval.benchmark_names(["hotpotqa"]) == ["hotpotqa"]
    call = {"out": "O/{benchmark}/x", "work_queue": None, "adapters": "A/{benchmark}_sharedA", "benchmark": "b"}
    one = run_eval.benchmark_call(call, "scienceqa", several=True)
    assert one == {"out": "O/scienceqa/x", "work_queue": None, "adapters": "A/scienceqa_sharedA",
                   "benchmark": "scienceqa"}  # fmt: skip
    assert call["out"] == "O/{benchmark}/x"  # the caller's call is not changed
    assert run_eval.benchmark_call({"out": "O", "work_queue": None, "adapters": None}, "hotpotqa", several=True)[
        "out"
    ] == str(Path("O") / "hotpotqa")
    assert run_eval.benchmark_call({"out": "O", "work_queue": None, "adapters": None}, "hotpotqa", False)["out"] == "O"
    queued = {"out": "Q/{benchmark}/shard_0", "work_queue": "Q/{benchmark}/queue", "adapters": None}
    assert run_eval.benchmark_call(queued, "hotpotqa", several=True)["work_queue"] == "Q/hotpotqa/queue"
    with pytest.raises(ValueError, match=r"^--out Q/shard_0 with several benchmarks and --work_queue: put \{benchmark"):
        run_eval.benchmark_call({**queued, "out": "Q/shard_0"}, "hotpotqa", several=True)
    assert run_eval.benchmark_call({**queued, "out": "Q/shard_0"}, "hotpotqa", several=False)["out"] == "Q/shard_0"


def _call(tmp_path, **kw):
    import inspect

    call = {k: p.default for k, p in inspect.signature(run_eval.evaluate).parameters.items()}
    call.update(adapter_init="random", device="cpu", out=str(tmp_path / "o"), limit=4)
    call.update(kw)
    return call


@pytest.mark.parametrize("name", list(run_eval._AT_LEAST))
def test_each_lower_bound_is_checked_at_its_bound_and_refuses_a_boolean(name, tmp_path):
    low = run_eval._AT_LEAST[name]
    for bad in (low - 1, True):
        with pytest.raises(ValueError, match=f"^--{name} must be >= {low}, got {bad}$"):
            run_eval.check_eval_args(_call(tmp_path, **{name: bad}), notes=False)
    if name not in ("devices", "limit", "max_context_tokens"):  # those three make their own checks at their bound
        run_eval.check_eval_args(_call(tmp_path, **{name: max(low, 1)}), notes=False)


def test_the_plan_holds_the_checked_arguments(tmp_path, capsys):
    """check_eval_args: greedy records top_p 1; --batch sets the context bound from --capacity; a shard takes every
    n-th question, a queue shard all of them; the untrained row is non_shared only; nothing is written."""
    from eval_suite.evaluate.benchmarks import load_questions as load
    from lragent.schemes import Scheme

    plan = run_eval.check_eval_args(_call(tmp_path, temperature=0.0, top_p=0.5, seed=3, runs=2), notes=False)
    assert plan.top_p == 1.0 and plan.temperature == 0.0 and plan.max_context_tokens is None
    assert plan.agent.max_steps == 15 and plan.agent.max_context_tokens is None
    assert plan.questions == load("hotpotqa", None, 4) and plan.levels is None and plan.splits == ("dev",)
    assert plan.out_dir == tmp_path / "o" and plan.adapters is None and plan.corpus_files == []
    assert plan.droidspeak_layers is None and list(plan.constraints) == [] and plan.args["seed"] == 3
    assert [str(s) for s in plan.schemes] == ["base_lr_shared"]
    assert run_eval.check_eval_args(_call(tmp_path, temperature=0.5, top_p=0.5), notes=False).top_p == 0.5
    plan = run_eval.check_eval_args(_call(tmp_path, batch=2, capacity=4096, max_steps=3, thought_tokens=5,
                                          argument_tokens=6), notes=False)  # fmt: skip
    assert plan.max_context_tokens == plan.agent.max_context_tokens == 4096 - 2048
    assert (plan.agent.max_steps, plan.agent.thought_tokens, plan.agent.argument_tokens) == (3, 5, 6)
    plan = run_eval.check_eval_args(_call(tmp_path, batch=2, capacity=8192, max_context_tokens=6144), notes=False)
    assert plan.max_context_tokens == 6144  # exactly capacity - 2048: allowed
    assert (
        run_eval.check_eval_args(_call(tmp_path, batch="auto", capacity=8192), notes=False).max_context_tokens == 6144
    )
    assert run_eval.check_eval_args(_call(tmp_path, max_context_tokens=99), notes=False).max_context_tokens == 99
    plan = run_eval.check_eval_args(_call(tmp_path, shard="1/2"), notes=False)
    assert plan.questions == load("hotpotqa", None, 4)[1::2]
    plan = run_eval.check_eval_args(_call(tmp_path, shard="1/2", work_queue=str(tmp_path / "q")), notes=False)
    assert plan.questions == load("hotpotqa", None, 4)
    plan = run_eval.check_eval_args(_call(tmp_path, adapter_init="zero", limit=None, levels="easy"), notes=False)
    assert plan.schemes == [Scheme.NON_SHARED] and plan.levels == ["easy"]
    assert {q.level for q in plan.questions} == {"easy"}
    plan = run_eval.check_eval_args(_call(tmp_path, adapter_init="zero", scheme="non_shared"), notes=False)
    assert plan.schemes == [Scheme.NON_SHARED]
    assert run_eval.check_eval_args(_call(tmp_path, shard="3/4"), notes=False).questions == [plan.questions[3]]
    assert run_eval.check_eval_args(_call(tmp_path, devices=4), notes=False).questions == plan.questions
    assert not (tmp_path / "o").exists() and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"memory_fraction": 1.5}, "--memory_fraction 1.5: allowed"),
        ({"stall_s": -1.0}, "--stall_s"),
        ({"batch": 2, "capacity": 4095}, "--capacity must be >= 4096 positions per episode, got 4095"),
        ({"batch": 2, "capacity": 8192, "max_context_tokens": 6145}, "--max_context_tokens 6145 leaves no room"),
        ({"adapter_init": "zero", "scheme": "base_shared"}, "--adapter_init zero is the untrained row"),
        ({"devices": 2, "work_queue": "q"}, "give --devices or --work_queue, not both"),
        ({"devices": 5}, "--devices 5: 4 question(s) to split over 5 shards (--limit, --levels); allowed at most 4"),
        ({"devices": 2, "limit": 1}, "--devices 2: 1 question(s) to split over 2 shards"),
        ({"shard": "4/5"}, "--shard 4/5: 4 question(s) to split over 5 shards"),
        ({"constrain": "answer_text"}, "answer_text"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(kw, message, tmp_path):
    with pytest.raises(ValueError) as err:
        run_eval.check_eval_args(_call(tmp_path, **kw), notes=False)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


def test_a_work_queue_that_is_a_file_and_a_missing_default_adapter_set_are_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "q").write_text("")
    with pytest.raises(ValueError, match=rf"^--work_queue {re.escape(str(tmp_path / 'q'))} is a file: give a folder"):
        run_eval.check_eval_args(_call(tmp_path, work_queue=str(tmp_path / "q")), notes=False)
    monkeypatch.setattr(run_eval, "DATA_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="no --adapters given"):
        run_eval.check_eval_args(_call(tmp_path, adapter_init=None), notes=False)
    shipped = tmp_path / "adapters" / "hotpotqa_sharedA"
    shipped.mkdir(parents=True)
    monkeypatch.setattr(run_eval, "check_model_args", lambda **kw: None)  # an empty folder: only its choice here
    assert run_eval.check_eval_args(_call(tmp_path, adapter_init=None), notes=True).adapters == str(shipped)
    err = capsys.readouterr().err
    assert f"eval: using the trained shared-A adapters {shipped} (no --adapters given)" in err
    assert "--limit without --scheme runs base_lr_shared only" in err
    run_eval.check_eval_args(_call(tmp_path, adapter_init=None), notes=False)
    assert "--limit without --scheme" not in capsys.readouterr().err  # said once, by the first benchmark


def test_the_default_adapters_follow_the_model_and_the_model_check_gets_the_adapter_options(
    tmp_path, monkeypatch, capsys
):
    """Without --adapters the accuracy model's default is its own qwen_ set; the model check gets the command's model,
    adapters and adapter init as given; check_eval_args says what a default chose unless told not to."""
    checked = []
    monkeypatch.setattr(run_eval, "check_model_args", lambda **kw: checked.append(kw))
    monkeypatch.setattr(run_eval, "DATA_DIR", tmp_path)
    qwen = tmp_path / "adapters" / "qwen_hotpotqa_sharedA"
    qwen.mkdir(parents=True)
    plan = run_eval.check_eval_args(_call(tmp_path, adapter_init=None, model="Qwen2.5-Coder-1.5B"))
    assert plan.adapters == str(qwen)
    assert [(c["model"], c["adapters"], c["adapter_init"]) for c in checked] == [
        ("Qwen2.5-Coder-1.5B", str(qwen), None)
    ]
    err = capsys.readouterr().err
    assert f"eval: using the trained shared-A adapters {qwen} (no --adapters given)" in err
    assert "eval: --limit without --scheme runs base_lr_shared only" in err  # the default: notes
    run_eval.check_eval_args(_call(tmp_path, adapter_init="zero"), notes=False)
    assert (checked[-1]["model"], checked[-1]["adapters"], checked[-1]["adapter_init"]) == ("default", None, "zero")
    assert capsys.readouterr().err == ""


def test_check_out_and_merge_refuse_in_one_line(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is an existing file; give a directory"):
        run_eval._check_out(str(tmp_path / "f"))
    assert run_eval._check_out(str(tmp_path / "d")) == tmp_path / "d"
    with pytest.raises(ValueError, match="^--merge needs at least one output directory$"):
        run_eval.merge_outputs([], tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=f"^--merge {re.escape(str(tmp_path))}: no {EPISODES_FILE} there$"):
        run_eval.merge_outputs([str(tmp_path)], tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_shard_queue_knows_the_episodes_its_sibling_shards_hold(tmp_path):
    assert run_eval.shard_queue(None, "0/2", tmp_path / "shard_0") == (None, set())
    assert run_eval.shard_queue("", "0/2", tmp_path / "shard_0") == (None, set())
    (tmp_path / "shard_1").mkdir()
    rec = {"row": "non_shared", "run": 1, "qid": "q7"}
    (tmp_path / "shard_1" / EPISODES_FILE).write_text(json.dumps(rec) + "\n")
    (tmp_path / "shard_0").mkdir()
    (tmp_path / "shard_0" / EPISODES_FILE).write_text(json.dumps({**rec, "qid": "mine"}) + "\n")
    (tmp_path / "shard_2").mkdir()  # a third sibling: what every one holds counts
    (tmp_path / "shard_2" / EPISODES_FILE).write_text(json.dumps({**rec, "qid": "q8"}) + "\n")
    queue, elsewhere = run_eval.shard_queue(str(tmp_path / "queue"), "0/2", tmp_path / "shard_0")
    assert elsewhere == {("non_shared", 1, "q7"), ("non_shared", 1, "q8")}
    assert queue.shard == "0/2"  # the name its claims carry
    assert queue.claim(("non_shared", 0, "q1")) is True and queue.claim(("non_shared", 0, "q1")) is False


def test_sigterm_raises_keyboard_interrupt_until_the_handler_is_restored():
    import signal
    import threading

    before = signal.getsignal(signal.SIGTERM)
    restore = run_eval._stop_on_sigterm()
    try:
        assert signal.getsignal(signal.SIGTERM) is not before  # set: the signal below cannot end this process
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before
    got = []
    t = threading.Thread(target=lambda: got.append(run_eval._stop_on_sigterm()))
    t.start()
    t.join()
    assert got[0]() is None and signal.getsignal(signal.SIGTERM) is before  # off the main thread: nothing set


# ------------------------------------------------------------- run_plan and fan_out, with the fake policy's episodes
def _fake_model(monkeypatch, questions):
    """The model's loading and its policies replaced by the fake policy (run_plan's own work is what is checked);
    returns what they were called with."""
    seen: dict = {"load": [], "factory": []}

    def load(**kw):
        seen["load"].append(kw)
        return "LM", "TOK"

    def factory(lm, tokenizer, **kw):
        seen["factory"].append((lm, tokenizer, kw))
        return Factory(questions)

    monkeypatch.setattr(run_eval, "load_lora_model", load)
    monkeypatch.setattr(run_eval, "build_policy_factory", factory)
    return seen


def _without(records, *keys):
    return [{k: v for k, v in r.items() if k not in keys} for r in records]


def test_run_plan_writes_its_config_records_timing_and_summary_and_a_rerun_redoes_nothing(
    tmp_path, monkeypatch, capsys
):
    import time

    qs = load_questions("hotpotqa", limit=3)
    seen = _fake_model(monkeypatch, qs)
    out = tmp_path / "o"
    kw = dict(benchmark="hotpotqa", scheme="non_shared,base_lr_shared", limit=3, runs=2, seed=5, max_steps=4,
              adapter_init="random", device="cpu", quiet=True, out=str(out), temperature=0.7, top_p=0.8)  # fmt: skip
    t0 = time.perf_counter()
    assert run_eval.evaluate(**kw) == 0
    elapsed = time.perf_counter() - t0
    assert seen["load"] == [dict(model="default", adapters=None, adapter_init="random", rank=8, alpha=16.0, seed=5,
                                 dtype="float32", device="cpu")]  # fmt: skip
    assert seen["factory"] == [("LM", "TOK", dict(temperature=0.7, top_p=0.8, use_kernel=True,
                                                  droidspeak_layers=None))]  # fmt: skip
    records = read_episodes(out / EPISODES_FILE)
    ref = run_episodes(
        qs, ["non_shared", "base_lr_shared"], 2, SequentialExecutor(Factory(qs)), tmp_path / "ref",
        benchmark="hotpotqa", adapters="init:random", seed=5, agent_config=AgentConfig(max_steps=4), temperature=0.7,
        top_p=0.8, progress=False,
    )  # fmt: skip
    assert len(records) == 12 and _without(records, "provenance", "wall_s") == _without(ref, "wall_s")
    assert records[0]["provenance"]["dtype"] == "float32"
    config = json.loads((out / "run_config.json").read_text())
    assert {k: config[k] for k in ("benchmark", "model", "adapters", "dtype", "temperature", "top_p", "constraints",
                                   "answer_score", "corpus_files", "seed", "droidspeak_layers", "schemes", "runs",
                                   "levels", "split", "limit", "shard", "work_queue", "questions",
                                   "batch_invariant")} == dict(
        benchmark="hotpotqa", model="default", adapters="init:random", dtype="float32", temperature=0.7, top_p=0.8,
        constraints=[], answer_score=None, corpus_files=[], seed=5, droidspeak_layers=None,
        schemes=["non_shared", "base_lr_shared"], runs=2, levels=None, split=["dev"], limit=3, shard="0/1",
        work_queue=None, questions=3, batch_invariant=False,
    )  # fmt: skip
    from lragent.sampling import SAMPLER_VERSION

    assert config["agent"] == vars(AgentConfig(max_steps=4)) and config["sampler"] == SAMPLER_VERSION
    assert config["corpus"]["splits"] == ["dev"] and config["provenance"] == records[0]["provenance"]
    timing = json.loads((out / "timing.json").read_text())
    assert timing["complete"] is True and timing["episodes"] == 12 and timing["batch"] == 0
    assert timing["device"] == "cpu" and timing["episodes_s"] > 0 and timing["summary_s"] is not None
    assert timing["prefill_in_decode"] is None and timing["decode_steps"] is None and timing["torch_threads"] >= 1
    assert timing["setup_s"] >= timing["prepare_s"] + timing["load_s"] >= 0 and timing["size_s"] >= 0
    assert timing["setup_s"] + timing["episodes_s"] <= elapsed and timing["size_s"] <= timing["setup_s"]
    assert 0 <= timing["summary_s"] <= elapsed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == ["non_shared", "base_lr_shared"] and (out / "report.md").is_file()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["non_shared", "base_lr_shared"]
    assert all(re.fullmatch(r"\w+: em \d+\.\d ± \d+\.\d OOF \d+\.\d ± \d+\.\d", line) for line in lines[:2]), lines
    assert lines[2] == f"-> {out / 'summary.json'}, {out / 'report.md'}"
    before = (out / "timing.json").read_text()
    assert run_eval.evaluate(**kw) == 0  # nothing to do: the records and the runs' timing stay as they were
    assert read_episodes(out / EPISODES_FILE) == records and (out / "timing.json").read_text() == before
    assert run_eval.evaluate(**{**kw, "runs": 3}) == 0  # the third run only
    assert len(read_episodes(out / EPISODES_FILE)) == 18
    timing = json.loads((out / "timing.json").read_text())
    assert [p["episodes"] for p in timing["parts"]] == [12, 6] and timing["parts"][1]["startup_s"] >= 0


def test_run_plan_greedy_records_top_p_one_and_a_stopped_loop_keeps_its_time(tmp_path, monkeypatch):
    import time

    qs = load_questions("hotpotqa", limit=3)
    _fake_model(monkeypatch, qs)
    out = tmp_path / "o"
    kw = dict(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4, adapter_init="random",
              device="cpu", quiet=True, out=str(out), temperature=0.0)  # fmt: skip
    real = run_eval.run_episodes

    def stopped_after_two(*args, on_record=None, **kwargs):
        count = []

        def record():
            on_record()
            count.append(1)
            if len(count) == 2:
                raise KeyboardInterrupt

        return real(*args, on_record=record, **kwargs)

    monkeypatch.setattr(run_eval, "run_episodes", stopped_after_two)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_eval.evaluate(**kw)
    elapsed = time.perf_counter() - t0
    timing = json.loads((out / "timing.json").read_text())
    assert timing["complete"] is False and timing["episodes"] == 2 and timing["summary_s"] is None
    assert 0 < timing["episodes_s"] <= elapsed  # the loop's time until it stopped
    assert not (out / "summary.json").exists()
    records = read_episodes(out / EPISODES_FILE)
    assert len(records) == 2 and {r["protocol"]["top_p"] for r in records} == {1.0}
    assert json.loads((out / "run_config.json").read_text())["top_p"] == 1.0


def test_timing_is_rewritten_as_episodes_end_only_every_few_seconds(tmp_path, monkeypatch):
    import time

    qs = load_questions("hotpotqa", limit=3)
    _fake_model(monkeypatch, qs)
    seen, parts = [], []
    real = run_eval.run_episodes

    def watch(*args, on_record=None, **kwargs):
        def record():
            on_record()
            path = tmp_path / "o" / "timing.json"
            seen.append(json.loads(path.read_text())["episodes"] if path.exists() else None)
            if path.exists():
                parts.append(json.loads(path.read_text())["parts"][-1])

        return real(*args, on_record=record, **kwargs)

    monkeypatch.setattr(run_eval, "run_episodes", watch)
    kw = dict(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4, adapter_init="random",
              device="cpu", quiet=True, out=str(tmp_path / "o"))  # fmt: skip
    assert run_eval.evaluate(**kw) == 0
    assert seen == [None, None, None]  # within TIMING_EVERY_S of the loop's start: not rewritten
    monkeypatch.setattr(run_eval, "TIMING_EVERY_S", 0.0)
    seen.clear()
    parts.clear()
    t0 = time.perf_counter()
    assert run_eval.evaluate(**{**kw, "runs": 2}) == 0  # every record rewrites it: the resumed part counts up
    elapsed = time.perf_counter() - t0
    assert seen == [4, 5, 6]
    # written while the loop runs: this part is not complete yet, and its loop time is the time so far
    assert [p["complete"] for p in parts[-3:]] == [False] * 3
    assert all(0 < p["episodes_s"] <= elapsed for p in parts[-3:])
    assert [p["episodes_s"] for p in parts[-3:]] == sorted(p["episodes_s"] for p in parts[-3:])


def test_out_of_memory_one_episode_at_a_time_ends_in_one_line_keeping_the_finished_episodes(tmp_path, monkeypatch):

    qs = load_questions("hotpotqa", limit=3)
    _fake_model(monkeypatch, qs)

    monkeypatch.setattr(run_eval, "build_policy_factory", lambda *a, **kw: OutOfMemoryAt(2, qs))
    out = tmp_path / "o"
    with pytest.raises(ValueError) as err:
        run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4,
                          adapter_init="random", device="cpu", quiet=True, out=str(out))  # fmt: skip
    assert str(err.value).endswith(f"(finished episodes are kept in {out / EPISODES_FILE})")
    assert "--batch N, or fewer processes on the device" in str(err.value)
    assert str(err.value).startswith("out of memory on cpu allocating 2.00 GiB; try ")
    assert len(read_episodes(out / EPISODES_FILE)) == 2
    monkeypatch.setattr(run_eval, "build_policy_factory", lambda *a, **kw: Factory(qs))
    with pytest.raises(RuntimeError, match="not memory"):  # any other error goes through as it is

        def broken(*a, **kw):
            raise RuntimeError("not memory")

        monkeypatch.setattr(run_eval, "build_policy_factory", broken)
        run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4,
                          adapter_init="random", device="cpu", quiet=True, out=str(out))  # fmt: skip


def test_a_queue_shard_runs_what_it_claims_and_writes_no_summary(tmp_path, monkeypatch, capsys):
    qs = load_questions("hotpotqa", limit=4)
    _fake_model(monkeypatch, qs)
    out, queue = tmp_path / "shard_0", tmp_path / "queue"
    (tmp_path / "shard_1").mkdir()  # an earlier launch's shard holds one episode: not run again
    ref, _ = _run(tmp_path / "ref", qs[:1], runs=1, schemes=["full_shared"])
    (tmp_path / "shard_1" / EPISODES_FILE).write_text(json.dumps(ref[0]) + "\n")
    from eval_suite.evaluate.work_queue import WorkQueue

    assert WorkQueue(queue, shard="1/2").claim(("full_shared", 0, qs[1].qid))  # the other shard runs this one now
    mine, _ = _run(tmp_path / "ref2", qs[2:3], runs=1, schemes=["full_shared"])
    out.mkdir()
    (out / EPISODES_FILE).write_text(json.dumps(mine[0]) + "\n")  # an earlier launch of this shard ran this one
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=4, runs=1, max_steps=4,
                             adapter_init="random", device="cpu", quiet=True, out=str(out), shard="0/2",
                             work_queue=str(queue)) == 0  # fmt: skip
    records = read_episodes(out / EPISODES_FILE)
    assert sorted(r["qid"] for r in records) == sorted(q.qid for q in qs[2:])  # less the held and the claimed one
    assert not (out / "summary.json").exists()
    assert capsys.readouterr().out == (
        f"eval: shard 0/2 ran 1 hotpotqa episode(s) from the queue {queue} -> {out / EPISODES_FILE}\n"
    )
    assert json.loads((out / "timing.json").read_text())["episodes"] == 1


def test_several_benchmarks_in_one_process_each_into_its_folder_with_its_label(tmp_path, monkeypatch, capsys):
    qs = load_questions("hotpotqa", limit=2) + load_questions("scienceqa", limit=2)
    _fake_model(monkeypatch, qs)
    plans = []
    real = run_eval.run_plan

    def watch(plan, first=True, label=""):
        plans.append((plan.bench.name, first, label))
        return real(plan, first=first, label=label)

    monkeypatch.setattr(run_eval, "run_plan", watch)
    kw = dict(benchmark="hotpotqa,scienceqa", scheme="full_shared", limit=2, runs=1, adapter_init="random",
              device="cpu", quiet=True)  # fmt: skip
    assert run_eval.evaluate(**kw, max_steps=4, out=str(tmp_path / "o")) == 0
    assert plans == [("hotpotqa", True, "hotpotqa"), ("scienceqa", False, "scienceqa")]
    for b in ("hotpotqa", "scienceqa"):
        assert {r["benchmark"] for r in read_episodes(tmp_path / "o" / b / EPISODES_FILE)} == {b}
    t = json.loads((tmp_path / "o" / "scienceqa" / "timing.json").read_text())
    assert t["startup_s"] == 0.0  # the process's start is counted once, by the first benchmark
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hotpotqa full_shared: em ") and lines[2].startswith("scienceqa full_shared: acc")
    assert lines[1] == f"-> {tmp_path / 'o' / 'hotpotqa' / 'summary.json'}, {tmp_path / 'o' / 'hotpotqa' / 'report.md'}"
    monkeypatch.setattr(run_eval, "run_plan", lambda plan, first, label: 3)  # a failed benchmark ends the command
    assert run_eval.evaluate(**kw, out=str(tmp_path / "p")) == 3


def _shards_that_ran(monkeypatch, episodes: dict[str, list], codes=None):
    """spawn_shards replaced by processes that have ended (exit status ``codes[i]``, default 0), whose shard folders
    hold the episodes given per benchmark (split over the shards): what fan_out's wait, merge and launch.json see."""
    import subprocess

    calls = []

    def spawn(n, out_dir, args, gpus, device, env, benchmarks=()):
        calls.append({"n": n, "out_dir": out_dir, "args": list(args), "gpus": gpus, "device": device,
                      "benchmarks": list(benchmarks)})  # fmt: skip
        out_dir.mkdir(parents=True, exist_ok=True)
        for b, records in episodes.items():
            for i in range(n):
                folder = (out_dir / b if len(benchmarks) > 1 else out_dir) / f"shard_{i}"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / EPISODES_FILE).write_text("".join(json.dumps(r) + "\n" for r in records[i::n]))
        logs = [open(out_dir / f"shard_{i}.log", "w") for i in range(n)]  # noqa: SIM115
        procs = [subprocess.Popen(["true" if not codes or codes[i] == 0 else "false"]) for i in range(n)]
        for proc in procs:  # ended before the launcher's first poll, however loaded the machine
            proc.wait()
        calls[-1].update(env=env, logs=logs)
        return procs, logs, [f"shard {i}" for i in range(n)]

    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    real_sleep, polls = run_eval.time.sleep, []

    def poll_wait(seconds):  # the shards end at once: a launcher still polling after 300 waits never sees them end
        polls.append(seconds)
        if len(polls) > 300:
            raise AssertionError("fan_out kept waiting for shards that had ended")
        real_sleep(seconds)

    monkeypatch.setattr(run_eval.time, "sleep", poll_wait)
    return calls


def test_fan_out_gives_each_shard_the_options_that_differ_merges_them_and_records_the_launch(
    tmp_path, monkeypatch, capsys
):
    qs = load_questions("hotpotqa", limit=4)
    records, _ = _run(tmp_path / "one", qs, runs=1, schemes=["full_shared"])
    calls = _shards_that_ran(monkeypatch, {"": records})
    call = _call(tmp_path, scheme="full_shared", runs=1, use_kernel=False, levels=["easy", "medium"], quiet=False,
                 devices=2)  # fmt: skip
    out = tmp_path / "o"
    assert run_eval.fan_out(call, 2, out, total=4) == 0
    assert calls[0].pop("env") is os.environ and all(log.closed for log in calls[0].pop("logs"))
    assert calls == [{"n": 2, "out_dir": out, "gpus": 0, "device": "cpu", "benchmarks": [], "args": [
        "--scheme", "full_shared", "--levels", "[easy,medium]", "--limit", "4", "--runs", "1", "--adapter_init",
        "random", "--use_kernel", "false"]}]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    expected = write_summary(records, tmp_path / "one")
    assert {k: v for k, v in summary.items() if k != "provenance"} == {
        k: v for k, v in json.loads(json.dumps(expected)).items() if k != "provenance"
    }
    assert summary["provenance"]["dtype"] == "float32"
    launch = json.loads((out / "launch.json").read_text())
    assert set(launch) == {"devices", "early", "startup_s", "launch_s", "shard_wall_s", "merge_s"}
    assert launch["launch_s"] < 60
    assert launch["devices"] == 2 and launch["early"] is False and len(launch["shard_wall_s"]) == 2
    assert all(0 < s < 60 for s in launch["shard_wall_s"]) and 0 <= launch["merge_s"] < 60
    assert launch["launch_s"] >= 0 and launch["startup_s"] >= 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert re.fullmatch(r"full_shared: em \d+\.\d OOF \d+\.\d", lines[0]) and lines[1] == (
        f"-> {out / 'summary.json'}, {out / 'report.md'}"
    )
    assert "shard 0\nshard 1\n" in captured.err and "4/4" in captured.err  # where each runs; the bar, at its end
    assert "eval hotpotqa (2 shards)" in captured.err
    from lragent import command

    assert command._INTERRUPT_NOTE == [f"the shards' finished episodes are in {out}/shard_*/{EPISODES_FILE}; rerun "
                                       "the same command to resume"]  # fmt: skip


def test_launch_json_parts_the_launchers_time_into_start_shards_and_merge(tmp_path, monkeypatch):
    """launch.json: the shards' walls count from their start, the merge from the last shard's end, so the launch, the
    longest wall and the merge add up to no more than the launcher's own time (the shards here run 0.3 s)."""
    import subprocess
    import time

    records, _ = _run(tmp_path / "one", load_questions("hotpotqa", limit=2), runs=1, schemes=["full_shared"])

    def spawn(n, out_dir, args, gpus, device, env, benchmarks=()):
        for i in range(n):
            (out_dir / f"shard_{i}").mkdir(parents=True)
            (out_dir / f"shard_{i}" / EPISODES_FILE).write_text("".join(json.dumps(r) + "\n" for r in records[i::n]))
        logs = [open(out_dir / f"shard_{i}.log", "w") for i in range(n)]  # noqa: SIM115
        return [subprocess.Popen(["sleep", "0.3"]) for _ in range(n)], logs, []

    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    t0 = time.perf_counter()
    assert run_eval.fan_out(_call(tmp_path, quiet=True), 2, tmp_path / "o", total=2) == 0
    elapsed = time.perf_counter() - t0
    launch = json.loads((tmp_path / "o" / "launch.json").read_text())
    walls = launch["shard_wall_s"]
    assert min(walls) > 0.2 and launch["merge_s"] >= 0 and launch["launch_s"] >= 0
    assert launch["launch_s"] + max(walls) + launch["merge_s"] <= elapsed


def test_fan_out_of_several_benchmarks_merges_each_into_its_folder(tmp_path, monkeypatch, capsys):
    hp = load_questions("hotpotqa", limit=2)
    sq = load_questions("scienceqa", limit=2)
    episodes = {
        "hotpotqa": _run(tmp_path / "hp", hp, runs=1, schemes=["full_shared"])[0],
        "scienceqa": _run(tmp_path / "sq", sq, runs=1, schemes=["full_shared"], benchmark="scienceqa")[0],
    }
    calls = _shards_that_ran(monkeypatch, episodes)
    call = _call(tmp_path, benchmark="hotpotqa,scienceqa", scheme="full_shared", runs=1, quiet=True, devices=2)
    out = tmp_path / "o"
    assert run_eval.fan_out(call, 2, out, total=4, benchmarks=["hotpotqa", "scienceqa"]) == 0
    assert calls[0]["benchmarks"] == ["hotpotqa", "scienceqa"]
    assert calls[0]["args"][:2] == ["--benchmark", "hotpotqa,scienceqa"]
    for b in ("hotpotqa", "scienceqa"):
        assert json.loads((out / b / "summary.json").read_text())["episodes"] == {"full_shared": {"0": 2}}
    assert json.loads((out / "launch.json").read_text())["benchmarks"] == ["hotpotqa", "scienceqa"]
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("hotpotqa full_shared: em ") and lines[2].startswith("scienceqa full_shared: accuracy ")
    assert lines[3] == f"-> {out / 'scienceqa' / 'summary.json'}, {out / 'scienceqa' / 'report.md'}"
    assert "eval hotpotqa,scienceqa" not in captured.err  # --quiet: no bar
    from lragent import command

    assert command._INTERRUPT_NOTE == [f"the shards' finished episodes are in {out}/*/shard_*/{EPISODES_FILE}; rerun "
                                       "the same command to resume"]  # fmt: skip


def test_a_shard_that_fails_after_the_others_ended_is_named_and_nothing_is_merged(tmp_path, monkeypatch, capsys):
    records, _ = _run(tmp_path / "one", load_questions("hotpotqa", limit=2), runs=1, schemes=["full_shared"])
    _shards_that_ran(monkeypatch, {"": records}, codes=[0, 0, 1])
    out = tmp_path / "o"
    (out).mkdir()
    (out / "shard_2.log").write_text("")
    assert run_eval.fan_out(_call(tmp_path, quiet=True, devices=3), 3, out, total=6) == 1
    err = capsys.readouterr().err
    assert f"error: shard 2/3 failed: no output (log: {out / 'shard_2.log'})" in err
    assert "eval: finished episodes are kept: rerun the same command to resume" in err
    assert "shard 0/3 failed" not in err and not (out / "summary.json").exists() and not (out / "launch.json").exists()


def test_evaluate_with_devices_fans_out_over_its_plans_questions(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(run_eval, "fan_out", lambda call, n, out, total, benchmarks: seen.append(
        (call["benchmark"], call["out"], n, out, total, benchmarks)) or 0)  # fmt: skip
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="non_shared,full_shared", limit=3, runs=2, devices=2,
                             adapter_init="random", device="cpu", out=str(tmp_path / "o")) == 0  # fmt: skip
    assert seen == [("hotpotqa", str(tmp_path / "o"), 2, tmp_path / "o", 3 * 2 * 2, ["hotpotqa"])]
    seen.clear()
    assert run_eval.evaluate(benchmark="hotpotqa,scienceqa", scheme="non_shared", limit=2, runs=1, devices=2,
                             adapter_init="random", device="cpu", out=str(tmp_path / "p")) == 0  # fmt: skip
    assert seen == [("hotpotqa,scienceqa", str(tmp_path / "p"), 2, tmp_path / "p", 4, ["hotpotqa", "scienceqa"])]
    seen.clear()
    assert (
        run_eval.evaluate(
            benchmark="scienceqa",
            scheme="non_shared",
            limit=2,
            runs=1,
            devices=2,
            adapter_init="random",
            device="cpu",
            out=str(tmp_path / "q" / "{benchmark}"),
        )
        == 0
    )
    assert seen == [("scienceqa", str(tmp_path / "q" / "scienceqa"), 2, tmp_path / "q" / "scienceqa", 2,
                     ["scienceqa"])]  # fmt: skip
    assert not (tmp_path / "o").exists() and not (tmp_path / "p").exists()


# ------------------------------------------------------------------------------------- run_episodes, record by record
def test_an_untrained_scienceqa_record_holds_every_field(tmp_path):
    qs = load_questions("scienceqa", limit=1)
    records, _ = _run(tmp_path / "o", qs, runs=1, schemes=["full_shared"], benchmark="scienceqa", adapters="init:zero",
                      provenance={"x": 1}, temperature=0.9, top_p=0.75)  # fmt: skip
    (rec,) = records
    assert rec.pop("wall_s") > 0
    stats = {"calls": 2, "prefill_tokens": 473, "decode_tokens": 4, "prefill_s": 0.18950000000000003,
             "decode_s": 0.020999999999999998, "recomputed_tokens": 0}  # fmt: skip
    assert rec == {
        "benchmark": "scienceqa", "qid": "14767", "level": "1-4", "split": "dev", "row": "untrained",
        "scheme": "full_shared", "adapters": "init:zero", "run": 0, "seed": run_eval.episode_seed(7, 0, "14767"),
        "protocol": {"temperature": 0.9, "top_p": 0.75, "constraints": [], "sampler": 2},
        "prediction": "something else", "candidate": "something else", "gold": 0,
        "choices": ["All the judges at the important meeting.", "The cardboard box gets wet it falls apart."],
        "correct": 0.0, "oof": False, "stop_reason": "finished", "steps": 2, "constrained_calls": 0,
        "actions": ["Finish[something else]", "Reflect[right]"], "thoughts": ["I should think.", "I should think."],
        "num_tokens": 510,
        "roles": {
            "plan": stats,
            "action": {"calls": 1, "prefill_tokens": 4, "decode_tokens": 3, "prefill_s": 0.0016, "decode_s": 0.014,
                       "recomputed_tokens": 0},
            "reflect": {"calls": 2, "prefill_tokens": 16, "decode_tokens": 6, "prefill_s": 0.0068000000000000005,
                        "decode_s": 0.028999999999999998, "recomputed_tokens": 0},
        },
        "provenance": {"x": 1},
    }  # fmt: skip
    hp, _ = _run(tmp_path / "hp", load_questions("hotpotqa", limit=1), runs=1, schemes=["full_shared"])
    assert "choices" not in hp[0] and "provenance" not in hp[0] and hp[0]["row"] == "full_shared"


def test_letter_constrained_rows_record_no_answer_score_and_thoughts_are_stripped(tmp_path):
    qs = load_questions("scienceqa", limit=2)

    class Spaced(Factory):
        def __call__(self, task):
            policy = super().__call__(task)
            real = policy.generate

            def generate(role, new_text, **kw):
                out = real(role, new_text, **kw)
                return f"  {out} \n" if out == "I should think." else out

            policy.generate = generate
            return policy

    records, _ = _run(tmp_path / "o", qs, runs=1, schemes=["full_shared"], benchmark="scienceqa",
                      constraints=("action_type", "answer"), factory=Spaced(qs))  # fmt: skip
    assert {r["row"] for r in records} == {"full_shared+constrained"}
    assert all("answer_score" not in r["protocol"] for r in records)
    assert all(t == t.strip() and t for r in records for t in r["thoughts"])


def test_only_missing_episodes_run_in_grid_order_and_each_record_is_announced(tmp_path):
    qs = load_questions("hotpotqa", limit=3)
    announced = []
    out = tmp_path / "o"
    first, f1 = _run(out, qs, runs=2, schemes=["non_shared", "full_shared"], max_episodes=3,
                     on_record=lambda: announced.append(len(read_episodes(out / EPISODES_FILE))))  # fmt: skip
    assert announced == [1, 2, 3] and f1.calls == 3
    assert [record_key(r) for r in first] == [("non_shared", 0, q.qid) for q in qs]
    elsewhere = {("non_shared", 1, qs[0].qid), ("full_shared", 0, qs[2].qid)}
    second, f2 = _run(out, qs, runs=2, schemes=["non_shared", "full_shared"], done_elsewhere=elsewhere)
    assert f2.calls == 12 - 3 - 2 and len(second) == 10
    assert not {record_key(r) for r in second} & elsewhere
    third, f3 = _run(out, qs, runs=2, schemes=["non_shared", "full_shared"])
    assert f3.calls == 2 and len(third) == 12
    assert [record_key(r) for r in third[10:]] == sorted(elsewhere, key=lambda k: (k[0] != "non_shared", k[1]))
    _, f4 = _run(out, qs, runs=2, schemes=["non_shared", "full_shared"], max_episodes=0)
    assert f4.calls == 0


def test_a_queued_run_takes_only_the_episodes_it_claims(tmp_path):
    from eval_suite.evaluate.work_queue import WorkQueue

    qs = load_questions("hotpotqa", limit=3)
    other = WorkQueue(tmp_path / "q", shard="1/2")
    assert other.claim(("full_shared", 0, qs[1].qid))
    records, factory = _run(tmp_path / "o", qs, runs=1, schemes=["full_shared"],
                            work_queue=WorkQueue(tmp_path / "q", shard="0/2"))  # fmt: skip
    assert [r["qid"] for r in records] == [qs[0].qid, qs[2].qid] and factory.calls == 2


def test_a_batched_run_builds_its_engine_from_the_options_and_reserves_each_scheme(tmp_path, monkeypatch, capsys):
    """--batch: the engine's executor gets the command's decode options (CUDA graphs only on a GPU), --batch auto
    takes what fits (on the CPU: every episode, at most MAX_AUTO_BATCH), and each scheme that runs at once reserves
    its rows; timing.json reads the executor's own settings and counters. The executor runs the fake policy."""
    from eval_suite.evaluate import batched_executor

    qs = load_questions("hotpotqa", limit=2)
    _fake_model(monkeypatch, qs)
    built, reserved = [], []

    class Recorder(SequentialExecutor):
        prefill_in_decode, feed_budget, concurrent_schemes, launch_ahead, decode_steps = 7, 8, "c", "l", 9
        advance_s, sync_s, agent_s, replay_s, wait_s, capture_s = 1.5, 2.5, 3.5, 4.5, 5.5, 6.5
        feed_rows, feed_tokens = 10, 8

        def __init__(self, lm, tokenizer, **kw):
            built.append((lm, tokenizer, kw))
            super().__init__(Factory(qs))

        def reserve(self, scheme, n):
            reserved.append((str(scheme), n))

    monkeypatch.setattr(batched_executor, "BatchedExecutor", Recorder)
    kw = dict(benchmark="hotpotqa", scheme="non_shared,full_shared", limit=2, runs=2, max_steps=4,
              adapter_init="random", device="cpu", quiet=True)  # fmt: skip
    assert (
        run_eval.evaluate(
            **kw,
            out=str(tmp_path / "a"),
            batch="auto",
            concurrent_schemes=True,
            prefill_in_decode=5,
            feed_budget=6,
            batch_invariant=True,
            launch_ahead=True,
            use_kernel=False,
        )
        == 0
    )
    assert built == [("LM", "TOK", dict(
        batch=4, capacity=8192, temperature=0.9, top_p=0.75, use_kernel=False, cuda_graphs=False,
        droidspeak_layers=None, prefill_in_decode=5, feed_budget=6, batch_invariant=True, concurrent_schemes=True,
        launch_ahead=True))]  # fmt: skip
    assert reserved == [("non_shared", 4), ("full_shared", 4)]
    assert "eval: --batch auto: 4 episodes at once (what fits now; at most 4)" in capsys.readouterr().err
    timing = json.loads((tmp_path / "a" / "timing.json").read_text())
    assert {k: timing[k] for k in ("batch", "prefill_in_decode", "feed_budget", "concurrent_schemes", "launch_ahead",
                                   "decode_steps", "advance_s", "sync_s", "agent_s", "replay_s", "wait_s",
                                   "capture_s", "feed_rows", "feed_tokens")} == dict(
        batch=4, prefill_in_decode=7, feed_budget=8, concurrent_schemes="c", launch_ahead="l", decode_steps=9,
        advance_s=1.5, sync_s=2.5, agent_s=3.5, replay_s=4.5, wait_s=5.5, capture_s=6.5, feed_rows=10,
        feed_tokens=8)  # fmt: skip
    assert len(read_episodes(tmp_path / "a" / EPISODES_FILE)) == 8
    built.clear(), reserved.clear()
    assert run_eval.evaluate(**kw, out=str(tmp_path / "c"), batch=2) == 0  # one scheme at a time: the first reserves
    assert built[0][2]["concurrent_schemes"] is False and reserved == [("non_shared", 4)]
    built.clear(), reserved.clear()
    assert run_eval.evaluate(**{**kw, "scheme": "full_shared"}, out=str(tmp_path / "d"), batch=2,
                             concurrent_schemes=True) == 0  # fmt: skip
    assert built[0][2]["concurrent_schemes"] is False and reserved == [("full_shared", 4)]
    run_config = json.loads((tmp_path / "d" / "run_config.json").read_text())
    assert run_config["agent"]["max_context_tokens"] == 8192 - 2048


def test_a_batch_out_of_memory_halves_the_batch_and_goes_on_from_the_log(tmp_path, monkeypatch, capsys):
    import torch

    from eval_suite.evaluate import batched_executor

    qs = load_questions("hotpotqa", limit=3)
    _fake_model(monkeypatch, qs)
    batches = []

    class Full(Factory):
        def __call__(self, task):
            if batches[-1] > 1 and self.calls == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().__call__(task)

    class Recorder(SequentialExecutor):
        def __init__(self, lm, tokenizer, **kw):
            batches.append(kw["batch"])
            super().__init__(Full(qs))

        def reserve(self, scheme, n):
            pass

    monkeypatch.setattr(batched_executor, "BatchedExecutor", Recorder)
    out = tmp_path / "o"
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4, batch=4,
                             adapter_init="random", device="cpu", quiet=True, out=str(out)) == 0  # fmt: skip
    assert batches == [4, 2, 1]
    err = capsys.readouterr().err
    assert "; going on at --batch 2 (finished episodes kept)" in err and "; going on at --batch 1 (" in err
    assert "a smaller --capacity, a larger --memory_fraction, or fewer processes on the device" in err
    assert len(read_episodes(out / EPISODES_FILE)) == 3
    assert json.loads((out / "timing.json").read_text())["batch"] == 1


def test_the_launchers_bar_is_named_counts_episodes_and_is_off_when_asked(tmp_path):
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    logs[1].write_text("{}\n{}\n{}\n")
    bar = run_eval._ShardProgress(logs, total=2, desc="eval x", enabled=False)
    assert bar.done == 3 and bar.bar.n == 2 and bar.bar.disable is True and bar.offsets == [0, 9]
    bar.close()
    on = run_eval._ShardProgress(logs, total=5, desc="eval y", enabled=True)
    assert on.bar.disable is False and on.bar.n == 3 and on.bar.desc == "eval y" and on.bar.unit == "ep"
    logs[0].write_text("{}\n")
    on.update()
    assert on.done == 4 and on.bar.n == 4 and on.offsets == [3, 9]
    on.update()
    assert on.done == 4 and on.bar.n == 4  # nothing new: nothing counted twice
    on.close()


def test_run_plan_hands_the_device_its_share_sizes_under_its_lock_and_watches_for_stalls(tmp_path, monkeypatch, capsys):
    """What run_plan gives the device helpers (memory share, allocation lock, batch sizing before and after the model
    loads), the stall watchdog (seconds, folder, what it names, what it writes when it fires), the engine's heartbeat,
    the adapters' label, and that SIGTERM's handler and the interrupt note are as they should be afterwards."""
    import contextlib
    import signal

    from eval_suite.evaluate import batched_executor
    from lragent import command

    qs = load_questions("hotpotqa", limit=2)
    seen = _fake_model(monkeypatch, qs)
    calls: dict = {"fraction": [], "lock": [], "choose": [], "dog": [], "models": [], "execs": []}

    @contextlib.contextmanager
    def lock(device):
        calls["lock"].append(device)
        yield

    def choose(model, schemes, batch, capacity, **kw):
        calls["choose"].append((model, [str(s) for s in schemes], batch, capacity, kw))
        return 2 if batch == "auto" else batch

    class Dog(run_eval.StallWatchdog):
        def __init__(self, seconds, out_dir, describe, on_stall):
            calls["dog"].append((seconds, out_dir, describe, on_stall))
            super().__init__(seconds, out_dir, describe=describe, on_stall=on_stall)

    class Recorder(SequentialExecutor):
        heartbeat = None

        def __init__(self, lm, tokenizer, **kw):
            calls["execs"].append(self)
            super().__init__(Factory(qs))

        def reserve(self, scheme, n):
            pass

    monkeypatch.setattr(run_eval, "apply_memory_fraction", lambda device, f: calls["fraction"].append((device, f)))
    monkeypatch.setattr(run_eval, "allocation_lock", lock)
    monkeypatch.setattr(run_eval, "choose_batch", choose)
    monkeypatch.setattr(run_eval, "StallWatchdog", Dog)
    monkeypatch.setattr(run_eval, "check_model_args", lambda **kw: calls["models"].append(kw))
    monkeypatch.setattr(batched_executor, "BatchedExecutor", Recorder)
    adapters = tmp_path / "set"
    adapters.mkdir()
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "o"
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="non_shared,full_shared", limit=2, runs=1, max_steps=4,
                             adapters="set", rank=4, alpha=8.0, dtype="bfloat16", device="cpu", quiet=True,
                             out=str(out), batch="auto", memory_fraction=0.5, concurrent_schemes=True, stall_s=7.0,
                             droidspeak_config=None) == 0  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) is before
    assert command._INTERRUPT_NOTE == [
        f"finished episodes are in {out / EPISODES_FILE}; rerun the same command to resume"
    ]
    assert calls["fraction"] == [("cpu", 0.5)] and calls["lock"] == ["cpu"]
    size = dict(dtype="bfloat16", device="cpu", rank=4, droidspeak_layers=None, memory_fraction=0.5, concurrent=True)
    schemes = ["non_shared", "full_shared"]
    assert calls["choose"] == [
        ("default", schemes, 1, 8192, size),
        ("default", schemes, "auto", 8192, dict(max_batch=2, model_loaded=True, **size)),
    ]
    assert calls["models"] == [
        dict(
            model="default",
            adapters="set",
            adapter_init=None,
            rank=4,
            alpha=8.0,
            dtype="bfloat16",
            device="cpu",
            roles=run_eval.DEFAULT_ROLES,
            needs_text=True,
        )
    ]
    assert seen["load"][0]["adapters"] == "set" and seen["load"][0]["dtype"] == "bfloat16"
    ((seconds, folder, describe, on_stall),) = calls["dog"]
    assert seconds == 7.0 and folder == out and describe() == "Recorder"
    (executor,) = calls["execs"]
    assert executor.heartbeat is not None and executor.heartbeat.__self__.__class__ is Dog
    on_stall()  # what a stall writes: the loop's time so far, its episodes from the log
    timing = json.loads((out / "timing.json").read_text())
    assert timing["complete"] is False and timing["episodes"] == 4 and timing["batch"] == 2
    config = json.loads((out / "run_config.json").read_text())
    assert config["adapters"] == str(adapters.resolve()) and config["dtype"] == "bfloat16"
    assert {r["adapters"] for r in read_episodes(out / EPISODES_FILE)} == {str(adapters.resolve())}
    err = capsys.readouterr().err
    assert err.startswith("eval: hotpotqa search corpus: {") and '"splits": ["dev"]' in err.splitlines()[0]
    calls["choose"].clear()
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, adapter_init="random",
                             device="cpu", quiet=True, out=str(tmp_path / "seq")) == 0  # fmt: skip
    assert calls["choose"] == [] and calls["dog"][-1][0] == 0.0  # one at a time: nothing to size; CPU: no watchdog


def test_a_described_executor_is_named_by_its_own_description(tmp_path, monkeypatch):
    from eval_suite.evaluate import batched_executor

    qs = load_questions("hotpotqa", limit=1)
    _fake_model(monkeypatch, qs)
    dogs = []

    class Dog(run_eval.StallWatchdog):
        def __init__(self, seconds, out_dir, describe, on_stall):
            dogs.append(describe)
            super().__init__(seconds, out_dir, describe=describe, on_stall=on_stall)

    class Described(SequentialExecutor):
        def __init__(self, lm, tokenizer, **kw):
            super().__init__(Factory(qs))

        def reserve(self, scheme, n):
            pass

        def describe(self):
            return "in full_shared advance"

    monkeypatch.setattr(run_eval, "StallWatchdog", Dog)
    monkeypatch.setattr(batched_executor, "BatchedExecutor", Described)
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=1, runs=1, adapter_init="random",
                             device="cpu", quiet=True, out=str(tmp_path / "o"), batch=1) == 0  # fmt: skip
    assert dogs[0]() == "in full_shared advance"


def test_a_loud_run_shows_its_bar_and_a_resumed_stop_counts_only_its_own_episodes(tmp_path, monkeypatch, capsys):
    qs = load_questions("hotpotqa", limit=3)
    _fake_model(monkeypatch, qs)
    kw = dict(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4, adapter_init="random",
              device="cpu", out=str(tmp_path / "o"))  # fmt: skip
    real = run_eval.run_episodes

    def stop_after(k):
        def run(*args, on_record=None, **kwargs):
            count = []

            def record():
                on_record()
                count.append(1)
                if len(count) == k:
                    raise KeyboardInterrupt

            return real(*args, on_record=record, **kwargs)

        return run

    monkeypatch.setattr(run_eval, "run_episodes", stop_after(1))
    with pytest.raises(KeyboardInterrupt):
        run_eval.evaluate(**kw, quiet=False)
    assert "eval hotpotqa:" in capsys.readouterr().err  # the bar, unless --quiet
    with pytest.raises(KeyboardInterrupt):
        run_eval.evaluate(**kw, quiet=True)  # resumed: one more episode, then stopped again
    assert "eval hotpotqa:" not in capsys.readouterr().err
    timing = json.loads((tmp_path / "o" / "timing.json").read_text())
    assert [p["episodes"] for p in timing["parts"]] == [1, 1] and timing["parts"][0]["startup_s"] > 0
    monkeypatch.setattr(run_eval, "run_episodes", real)
    assert run_eval.evaluate(**kw, quiet=True) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["provenance"]["dtype"] == "float32" and summary["episodes"] == {"full_shared": {"0": 3}}


def test_droidspeak_layers_reach_the_plan_and_the_policies(tmp_path, monkeypatch):
    qs = load_questions("hotpotqa", limit=1)
    seen = _fake_model(monkeypatch, qs)
    (tmp_path / "d.json").write_text(json.dumps({"droidspeak_layers": [0, 1]}))
    plan = run_eval.check_eval_args(_call(tmp_path, droidspeak_config=str(tmp_path / "d.json")), notes=False)
    assert plan.droidspeak_layers == [0, 1] and plan.bench.name == "hotpotqa"
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="droidspeak", limit=1, runs=1, adapter_init="random",
                             device="cpu", quiet=True, out=str(tmp_path / "o"),
                             droidspeak_config=str(tmp_path / "d.json")) == 0  # fmt: skip
    assert seen["factory"][0][2]["droidspeak_layers"] == [0, 1]
    assert json.loads((tmp_path / "o" / "run_config.json").read_text())["droidspeak_layers"] == [0, 1]
    from eval_suite.evaluate import batched_executor

    sized, built = [], []
    monkeypatch.setattr(run_eval, "choose_batch", lambda *a, **kw: sized.append((a[2], kw["droidspeak_layers"])) or 1)

    class Recorder(SequentialExecutor):
        def __init__(self, lm, tokenizer, **kw):
            built.append(kw["droidspeak_layers"])
            super().__init__(Factory(qs))

        def reserve(self, scheme, n):
            pass

    monkeypatch.setattr(batched_executor, "BatchedExecutor", Recorder)
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="droidspeak", limit=1, runs=1, adapter_init="random",
                             device="cpu", quiet=True, out=str(tmp_path / "b"), batch="auto",
                             droidspeak_config=str(tmp_path / "d.json")) == 0  # fmt: skip
    assert sized == [(1, [0, 1]), ("auto", [0, 1])] and built == [[0, 1]]  # the batch is sized with the layers


def test_the_policy_factory_opens_a_session_of_the_tasks_scheme_with_the_commands_options(monkeypatch):
    """build_policy_factory: each task's policy samples as the command says, seeded by the task, and each reset opens
    a fresh session of the task's scheme over the one model, with the tokenizer, kernel and droidspeak layers."""
    import lragent.session
    from eval_suite.evaluate.executors import EpisodeTask
    from lragent.agents import SessionPolicy
    from lragent.schemes import Scheme
    from tests.conftest import tiny_multi_lora

    model = tiny_multi_lora(seed=5)
    opened = []
    real = lragent.session.MultiAgentSession

    def opening(*args, **kw):
        opened.append((args, kw))
        return real(*args, **kw)

    monkeypatch.setattr(lragent.session, "MultiAgentSession", opening)
    tokenizer = object()  # the session keeps it for decoding (nothing is decoded here)
    factory = run_eval.build_policy_factory(model, tokenizer, temperature=0.5, top_p=0.6, use_kernel=False,
                                            droidspeak_layers=[1])  # fmt: skip
    task = EpisodeTask(key=("droidspeak", 0, "q"), scheme=Scheme.DROIDSPEAK, seed=11, question=None, episode=None)
    policy = factory(task)
    assert isinstance(policy, SessionPolicy) and (policy.temperature, policy.top_p, policy.seed) == (0.5, 0.6, 11)
    assert opened == []  # a session opens when the episode starts
    policy.reset()
    policy.reset()
    assert opened == [((model, Scheme.DROIDSPEAK), dict(tokenizer=tokenizer, use_kernel=False,
                                                        droidspeak_layers=[1]))] * 2  # fmt: skip
    assert policy.session.scheme is Scheme.DROIDSPEAK and policy.session.engine.use_kernel is False
    assert policy.session.engine.tokenizer is tokenizer


def test_answer_text_episodes_rank_option_texts_and_record_the_score(tmp_path):
    """run_episodes with answer_text: the loop hands the policy the option texts and the mean score (the fake asserts
    both), the rows are scheme+answer_text and the protocol names the score; HotpotQA refuses the constraint."""
    from tests.test_answer_text import _TextPolicy

    qs = load_questions("scienceqa", limit=2)
    gold = {q.text: q.choices[int(q.gold)].strip() for q in qs}
    records = run_episodes(
        qs, ["non_shared"], 1, SequentialExecutor(lambda t: _TextPolicy(gold)), tmp_path / "a" / "b",
        benchmark="scienceqa", adapters="init:random", constraints=("answer_text",), temperature=0.9, top_p=0.75,
        agent_config=AgentConfig(max_steps=3), progress=False,
    )  # fmt: skip
    assert [r["row"] for r in records] == ["non_shared+answer_text"] * 2 and all(r["correct"] for r in records)
    assert records[0]["protocol"] == {"temperature": 0.9, "top_p": 0.75, "constraints": ["answer_text"],
                                      "answer_score": "mean", "sampler": 2}  # fmt: skip
    with pytest.raises(ValueError, match="answer_text"):
        run_episodes(
            load_questions("hotpotqa", limit=1),
            ["non_shared"],
            1,
            SequentialExecutor(Factory([])),
            tmp_path / "h",
            benchmark="hotpotqa",
            adapters="init:random",
            constraints=("answer_text",),
        )
    assert not (tmp_path / "h").exists()


def test_without_a_toolbox_the_benchmarks_own_searches_the_questions_split(tmp_path, capsys):
    qs = load_questions("hotpotqa", limit=1, splits=("test",))
    records = run_episodes(
        qs,
        ["non_shared"],
        1,
        SequentialExecutor(Factory(qs)),
        tmp_path / "o",
        benchmark="hotpotqa",
        adapters="init:random",
        agent_config=CONFIG,
        progress=True,
    )
    assert len(records) == 1 and records[0]["split"] == "test"
    err = capsys.readouterr().err
    assert "eval hotpotqa: 100%" in err and "1/1" in err and "ep/s" in err
    again = run_episodes(
        qs,
        ["non_shared"],
        1,
        SequentialExecutor(Factory(qs)),
        tmp_path / "o",
        benchmark="hotpotqa",
        adapters="init:random",
        agent_config=CONFIG,
        progress=True,
    )
    assert again == records and "eval hotpotqa" not in capsys.readouterr().err  # nothing to run: no bar


def test_the_episodes_get_the_given_toolbox_or_the_benchmarks_own_built_only_for_episodes_to_run(
    tmp_path, monkeypatch, capsys
):
    """A given toolbox factory makes every episode's tools (the benchmark's index is not built); without one the
    benchmark's is built once over the questions' own splits, and not at all when nothing is left to run. By default
    run_episodes seeds from base 0 and shows its bar."""
    from eval_suite.evaluate.benchmarks import Benchmark

    qs = load_questions("hotpotqa", limit=2, splits=("test",))
    built, real = [], Benchmark.toolbox_factory

    def spy(self, *args, splits=None, **kw):
        built.append(splits)
        return real(self, *args, splits=splits, **kw)

    monkeypatch.setattr(Benchmark, "toolbox_factory", spy)
    made = []

    def tools(q):
        made.append(q.qid)
        return _tools(q)

    kw = dict(benchmark="hotpotqa", adapters="init:random", agent_config=CONFIG)
    given = run_episodes(qs, ["non_shared"], 1, SequentialExecutor(Factory(qs)), tmp_path / "g", **kw,
                         toolbox_factory=tools)  # fmt: skip
    assert made == [q.qid for q in qs] and built == []
    assert [r["seed"] for r in given] == [run_eval.episode_seed(0, 0, q.qid) for q in qs]
    err = capsys.readouterr().err
    assert "eval hotpotqa: 100%" in err and "2/2" in err
    run_episodes(qs, ["non_shared"], 1, SequentialExecutor(Factory(qs)), tmp_path / "o", **kw)
    assert built == [["test"]]
    run_episodes(qs, ["non_shared"], 1, SequentialExecutor(Factory(qs)), tmp_path / "o", **kw)
    assert built == [["test"]]  # nothing to run: no index built


def test_a_served_eval_loads_nothing_sizes_nothing_and_takes_its_bound_from_the_server(tmp_path, monkeypatch):
    """--server: its checks run, the context bound comes from the server (with $LRAGENT_API_KEY), the model is not
    loaded nor a batch sized here, and the episodes run on the server's executor (here the fake policy's)."""
    from eval_suite.evaluate import server_client

    qs = load_questions("hotpotqa", limit=2)
    seen = _fake_model(monkeypatch, qs)
    calls: dict = {"check": [], "bound": [], "executor": [], "choose": []}
    monkeypatch.setattr(server_client, "check_server_args", lambda a, cons: calls["check"].append((a["server"], cons)))
    monkeypatch.setattr(server_client, "served_context_bound",
                        lambda url, key: calls["bound"].append((url, key)) or 1000)  # fmt: skip

    class Served(SequentialExecutor):
        def reserve(self, scheme, n):
            calls["reserve"].append((str(scheme), n))

    calls["reserve"] = []
    monkeypatch.setattr(server_client, "server_executor", lambda a, t, p, rows: calls["executor"].append(
        (a["server"], t, p, rows)) or Served(Factory(qs)))  # fmt: skip
    monkeypatch.setattr(run_eval, "choose_batch", lambda *a, **kw: calls["choose"].append(a) or 2)
    monkeypatch.setenv("LRAGENT_API_KEY", "key")
    kw = dict(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, adapter_init="random", device="cpu",
              quiet=True, server="http://127.0.0.1:9", batch=2, temperature=0.5, top_p=0.6)  # fmt: skip
    plan = run_eval.check_eval_args(_call(tmp_path, **kw), notes=False)
    assert plan.max_context_tokens == plan.agent.max_context_tokens == 1000
    assert calls["check"] == [("http://127.0.0.1:9", ())] and calls["bound"] == [("http://127.0.0.1:9", "key")]
    assert (
        run_eval.check_eval_args(_call(tmp_path, **kw, max_context_tokens=500), notes=False).max_context_tokens == 500
    )
    assert len(calls["bound"]) == 1  # given: the server is not asked
    monkeypatch.setenv("LRAGENT_API_KEY", "")
    run_eval.check_eval_args(_call(tmp_path, **kw), notes=False)
    assert calls["bound"][-1] == ("http://127.0.0.1:9", None)
    assert run_eval.evaluate(**kw, out=str(tmp_path / "o")) == 0
    assert seen["load"] == [] and calls["choose"] == [] and calls["executor"] == [("http://127.0.0.1:9", 0.5, 0.6, 2)]
    assert calls["reserve"] == [("full_shared", 2)]
    assert len(read_episodes(tmp_path / "o" / EPISODES_FILE)) == 2
    calls["check"].clear()
    run_eval.check_eval_args(_call(tmp_path, adapter_init="random"), notes=False)
    assert calls["check"] == []  # no --server: its checks do not run


def test_fan_out_adopts_the_early_shards_that_match_and_counts_their_start(tmp_path, monkeypatch, capsys):
    """Shards the console entry started early for this very launch (count, folder, GPUs, device, benchmarks) are
    adopted, not started again: launch.json says early, their launcher's age, and no launch time of its own."""
    import subprocess
    import time

    from eval_suite.evaluate import shard_launch

    records, _ = _run(tmp_path / "one", load_questions("hotpotqa", limit=2), runs=1, schemes=["full_shared"])
    out = tmp_path / "o"
    for i in range(2):
        (out / f"shard_{i}").mkdir(parents=True)
        (out / f"shard_{i}" / EPISODES_FILE).write_text("".join(json.dumps(r) + "\n" for r in records[i::2]))
    logs = [open(out / f"shard_{i}.log", "w") for i in range(2)]  # noqa: SIM115
    early = shard_launch.EarlyShards(n=2, out_dir=out, gpus=0, device="cpu", procs=[subprocess.Popen(["true"])] * 2,
                                     logs=logs, spawned_at=time.perf_counter(), startup_s=1.5,
                                     lines=["early shard 0", "early shard 1"])  # fmt: skip

    def spawn(*args, **kwargs):
        raise AssertionError("started again")

    monkeypatch.setattr(shard_launch, "_EARLY", [early])
    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    assert run_eval.fan_out(_call(tmp_path, quiet=True), 2, out, total=2, benchmarks=["hotpotqa"]) == 0
    launch = json.loads((out / "launch.json").read_text())
    assert launch["early"] is True and launch["startup_s"] == 1.5 and launch["launch_s"] == 0.0
    assert early.adopted and all(log.closed for log in logs)
    assert "early shard 0\nearly shard 1\n" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["episodes"] == {"full_shared": {"0": 2}}


@pytest.mark.parametrize(
    ("device", "count", "n", "gpus", "refused"),
    [("cuda", 4, 2, 4, False), ("cuda", 2, 2, 2, False), (None, 1, 2, 1, True), ("cuda", 1, 2, 1, True),
     (None, 0, 2, 0, False), ("cpu", 2, 3, 0, False)],
)  # fmt: skip
def test_fan_out_counts_the_gpus_of_a_gpu_run_and_refuses_fewer_than_its_shards(
    device, count, n, gpus, refused, tmp_path, monkeypatch
):
    import torch

    records, _ = _run(tmp_path / "one", load_questions("hotpotqa", limit=3), runs=1, schemes=["full_shared"])
    calls = _shards_that_ran(monkeypatch, {"": records})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    call = _call(tmp_path, quiet=True, device=device)
    if refused:
        with pytest.raises(ValueError, match=rf"^--devices {n} but this machine has {count} GPU\(s\): allowed at most"):
            run_eval.fan_out(call, n, tmp_path / "o", total=3, benchmarks=["hotpotqa"])
        assert calls == []
    else:
        assert run_eval.fan_out(call, n, tmp_path / "o", total=3, benchmarks=["hotpotqa"]) == 0
        assert calls[0]["gpus"] == gpus and calls[0]["benchmarks"] == []
        assert (tmp_path / "o" / "summary.json").is_file()


def test_the_launchers_own_options_are_never_given_to_a_shard(tmp_path, monkeypatch, capsys):
    records, _ = _run(tmp_path / "one", load_questions("hotpotqa", limit=2), runs=1, schemes=["full_shared"])
    calls = _shards_that_ran(monkeypatch, {"": records})
    call = _call(tmp_path, quiet=True, shard="1/2", work_queue=str(tmp_path / "q"), merge=["m"], devices=2, limit=2,
                 adapter_init="zero")  # fmt: skip
    assert run_eval.fan_out(call, 2, tmp_path / "o", total=2) == 0
    assert calls[0]["args"] == ["--limit", "2", "--adapter_init", "zero"]
    assert "(2 shards)" not in capsys.readouterr().err  # --quiet: no bar


def test_the_test_split_is_planned_searched_and_recorded(tmp_path, monkeypatch):
    qs = load_questions("hotpotqa", limit=2, splits=("test",))
    _fake_model(monkeypatch, qs)
    plan = run_eval.check_eval_args(_call(tmp_path, split="test", limit=2), notes=False)
    assert plan.splits == ("test",) and plan.questions == qs and {q.split for q in qs} == {"test"}
    assert (
        run_eval.evaluate(
            benchmark="hotpotqa",
            scheme="full_shared",
            split="test",
            limit=2,
            runs=1,
            adapter_init="random",
            device="cpu",
            quiet=True,
            out=str(tmp_path / "o"),
        )
        == 0
    )
    config = json.loads((tmp_path / "o" / "run_config.json").read_text())
    assert config["split"] == ["test"] and config["corpus"]["splits"] == ["test"]
    assert {r["split"] for r in read_episodes(tmp_path / "o" / EPISODES_FILE)} == {"test"}


def test_fan_out_adopts_early_shards_of_several_benchmarks_and_names_them_on_its_bar(tmp_path, monkeypatch, capsys):
    import subprocess
    import time

    from eval_suite.evaluate import shard_launch

    out = tmp_path / "o"
    for b in ("hotpotqa", "scienceqa"):
        records, _ = _run(tmp_path / b, load_questions(b, limit=2), runs=1, schemes=["full_shared"], benchmark=b)
        for i in range(2):
            (out / b / f"shard_{i}").mkdir(parents=True)
            (out / b / f"shard_{i}" / EPISODES_FILE).write_text(json.dumps(records[i]) + "\n")
    logs = [open(out / f"shard_{i}.log", "w") for i in range(2)]  # noqa: SIM115
    early = shard_launch.EarlyShards(n=2, out_dir=out, gpus=0, device="cpu", benchmarks=["hotpotqa", "scienceqa"],
                                     procs=[subprocess.Popen(["true"])] * 2, logs=logs,
                                     spawned_at=time.perf_counter(), startup_s=2.0)  # fmt: skip

    def spawn(*args, **kwargs):
        raise AssertionError("started again")

    monkeypatch.setattr(shard_launch, "_EARLY", [early])
    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    call = _call(tmp_path, benchmark="hotpotqa,scienceqa", quiet=False)
    assert run_eval.fan_out(call, 2, out, total=4, benchmarks=["hotpotqa", "scienceqa"]) == 0
    assert early.adopted and json.loads((out / "launch.json").read_text())["startup_s"] == 2.0
    assert "eval hotpotqa,scienceqa (2 shards)" in capsys.readouterr().err


def test_run_plan_called_alone_counts_the_process_start_and_prints_unlabelled_lines(tmp_path, monkeypatch, capsys):
    """``run_plan(plan)`` with its defaults: the first plan of its process (its start is counted), no benchmark label
    before the summary's lines."""
    qs = load_questions("hotpotqa", limit=2)
    _fake_model(monkeypatch, qs)
    corpus = tmp_path / "more.jsonl"
    corpus.write_text('{"title": "A", "text": "a"}\n')
    call = _call(tmp_path, scheme="full_shared", runs=1, limit=2, max_steps=4, quiet=True, corpus=[str(corpus)],
                 constrain="answer")  # fmt: skip
    assert run_eval.run_plan(run_eval.check_eval_args(call, notes=False)) == 0
    out = tmp_path / "o"
    assert {tuple(r["protocol"]["constraints"]) for r in read_episodes(out / EPISODES_FILE)} == {("answer",)}
    assert json.loads((out / "timing.json").read_text())["startup_s"] > 0
    config = json.loads((out / "run_config.json").read_text())  # the extra corpus file is searched too
    assert config["corpus"]["extra"] == [{"file": str(corpus), "passages": 1}]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("full_shared+constrained:answer: em ")
    assert lines[1] == f"-> {out / 'summary.json'}, {out / 'report.md'}"


def test_run_plan_where_cuda_is_available_runs_on_the_cpu_when_asked(tmp_path, monkeypatch):
    """With CUDA available (the model faked: nothing touches a GPU), ``--device cpu`` loads, runs and records the CPU,
    its episodes' provenance too (CUDA would be the default of each)."""
    import torch

    qs = load_questions("hotpotqa", limit=2)
    seen = _fake_model(monkeypatch, qs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "o"
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, max_steps=4,
                             adapter_init="random", quiet=True, device="cpu", out=str(out)) == 0  # fmt: skip
    assert json.loads((out / "timing.json").read_text())["device"] == "cpu"
    assert [load["device"] for load in seen["load"]] == ["cpu"]
    assert {r["provenance"]["device"]["type"] for r in read_episodes(out / EPISODES_FILE)} == {"cpu"}


def test_fan_out_refreshes_its_bar_every_tenth_poll_of_a_tenth_of_a_second(tmp_path, monkeypatch):
    """While the shards run, the launcher polls them every 0.1 s and refreshes the bar every 10th poll (about once a
    second); the shard here ends once the launcher has polled 25 times."""
    import subprocess

    done = tmp_path / "done"

    def spawn(n, out_dir, args, gpus, device, env, benchmarks=()):
        out_dir.mkdir(parents=True, exist_ok=True)
        logs = [open(out_dir / f"shard_{i}.log", "w") for i in range(n)]  # noqa: SIM115
        # fails (no merge to prepare); gives up after about 20 s, so that a stopped test leaves no shell behind
        wait = f"i=0; while [ ! -e {done} ] && [ $i -lt 2000 ]; do sleep 0.01; i=$((i+1)); done; exit 3"
        return [subprocess.Popen(["sh", "-c", wait]) for _ in range(n)], logs, []

    real_sleep, sleeps, refreshes = run_eval.time.sleep, [], []

    def poll_wait(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 25:
            done.touch()
        if len(sleeps) > 300:
            raise AssertionError("fan_out kept waiting for a shard that had ended")
        real_sleep(seconds)

    real_update = run_eval._ShardProgress.update

    def update(self):
        refreshes.append(len(sleeps))
        real_update(self)

    monkeypatch.setattr(run_eval, "spawn_shards", spawn)
    monkeypatch.setattr(run_eval.time, "sleep", poll_wait)
    monkeypatch.setattr(run_eval._ShardProgress, "update", update)
    assert run_eval.fan_out(_call(tmp_path, quiet=False), 1, tmp_path / "o", total=2) == 1
    assert len(sleeps) >= 25 and set(sleeps) == {0.1}
    assert refreshes[:-1] == list(range(9, len(sleeps), 10))  # after 9, 19, ... waits; the last one: its close


def test_shards_that_failed_together_are_each_named_none_as_stopped(tmp_path, monkeypatch, capsys):
    """Two shards that have both failed by the launcher's first poll: each failure is named (neither was running, so
    neither was stopped)."""
    records, _ = _run(tmp_path / "one", load_questions("hotpotqa", limit=2), runs=1, schemes=["full_shared"])
    _shards_that_ran(monkeypatch, {"": records}, codes=[1, 1])
    out = tmp_path / "o"
    assert run_eval.fan_out(_call(tmp_path, quiet=True, devices=2), 2, out, total=2) == 1
    err = capsys.readouterr().err
    assert "error: shard 0/2 failed: no output" in err and "error: shard 1/2 failed: no output" in err
    assert "eval: finished episodes are kept: rerun the same command to resume" in err and "stopped" not in err


def test_run_plan_on_a_gpu_takes_the_gpu_host_threads_and_arms_the_stall_watchdog(tmp_path, monkeypatch):
    """``--device cuda`` (CUDA reported available; the model faked and the device lock left out: nothing touches a
    GPU): the process takes the GPU host's torch threads (OMP_NUM_THREADS unset), records them and the device, and
    arms the stall watchdog at its GPU default."""
    import contextlib

    import torch

    from eval_suite.evaluate.stall_watchdog import GPU_DEFAULT_S, StallWatchdog
    from lragent.host_threads import GPU_HOST_THREADS

    qs = load_questions("hotpotqa", limit=2)
    seen = _fake_model(monkeypatch, qs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "a GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(run_eval, "allocation_lock", lambda device: contextlib.nullcontext())
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    armed = []

    class Watchdog(StallWatchdog):
        def __init__(self, seconds, *args, **kwargs):
            armed.append(seconds)
            super().__init__(seconds, *args, **kwargs)

    monkeypatch.setattr(run_eval, "StallWatchdog", Watchdog)
    out = tmp_path / "o"
    threads = torch.get_num_threads()
    torch.set_num_threads(GPU_HOST_THREADS + 1)
    try:
        assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, max_steps=4,
                                 adapter_init="random", quiet=True, device="cuda", out=str(out)) == 0  # fmt: skip
        assert torch.get_num_threads() == GPU_HOST_THREADS
    finally:
        torch.set_num_threads(threads)
    timing = json.loads((out / "timing.json").read_text())
    assert (timing["device"], timing["torch_threads"]) == ("cuda", GPU_HOST_THREADS)
    assert [load["device"] for load in seen["load"]] == ["cuda"] and armed == [GPU_DEFAULT_S]


def test_evaluate_with_its_own_defaults(tmp_path, monkeypatch, capsys):
    """``evaluate(limit=1)`` called with the function's own defaults (the CLI's come from its signature): HotpotQA's
    dev split, LRAgent's sampling and three runs, the benchmark's trained shared-A adapters on the embedded model in
    float32 on the CPU (no GPU here), the quick look's one scheme, one process, the AutoAct budgets, ``eval_out`` in
    the working directory and a progress bar."""
    import torch

    from lragent.sampling import SAMPLER_VERSION

    qs = load_questions("hotpotqa", limit=1)
    seen = _fake_model(monkeypatch, qs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("tqdm.std.tqdm.monitor_interval", 0)  # no monitor thread left behind (a fork would inherit it)
    monkeypatch.chdir(tmp_path)
    assert run_eval.evaluate(limit=1) == 0
    out = tmp_path / "eval_out"
    adapters = run_eval.default_adapters("hotpotqa")
    assert seen["load"] == [dict(model="default", adapters=str(adapters), adapter_init=None, rank=8, alpha=16.0, seed=0,
                                 dtype="float32", device="cpu")]  # fmt: skip
    assert seen["factory"] == [("LM", "TOK", dict(temperature=0.9, top_p=0.75, use_kernel=True,
                                                  droidspeak_layers=None))]  # fmt: skip
    config = json.loads((out / "run_config.json").read_text())
    assert {k: config[k] for k in ("benchmark", "model", "adapters", "dtype", "temperature", "top_p", "constraints",
                                   "corpus_files", "seed", "droidspeak_layers", "schemes", "runs", "levels", "split",
                                   "limit", "shard", "work_queue", "questions", "batch_invariant")} == dict(
        benchmark="hotpotqa", model="default", adapters=str(adapters.resolve()), dtype="float32", temperature=0.9,
        top_p=0.75, constraints=[], corpus_files=[], seed=0, droidspeak_layers=None, schemes=["base_lr_shared"],
        runs=3, levels=None, split=["dev"], limit=1, shard="0/1", work_queue=None, questions=1, batch_invariant=False,
    )  # fmt: skip
    assert config["agent"] == vars(AgentConfig(max_steps=15)) and config["sampler"] == SAMPLER_VERSION
    timing = json.loads((out / "timing.json").read_text())
    assert (timing["episodes"], timing["batch"], timing["device"]) == (3, 0, "cpu")
    assert len(read_episodes(out / EPISODES_FILE)) == 3 and (out / "summary.json").is_file()
    err = capsys.readouterr().err
    assert "eval: --limit without --scheme runs base_lr_shared only" in err and "3/3" in err  # the notes; the bar


def _on_a_gpu(monkeypatch, free_bytes: int) -> None:
    """CUDA reported available with one GPU of ``free_bytes`` free (nothing touches a GPU: the model is faked, the
    device lock left out)."""
    import contextlib

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "a GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free_bytes, free_bytes))
    monkeypatch.setattr(run_eval, "allocation_lock", lambda device: contextlib.nullcontext())


def test_a_batched_eval_hands_its_options_to_the_batched_executor_with_cuda_graphs_only_on_a_gpu(tmp_path, monkeypatch):
    """``--batch 2``: the batched executor gets the command's options (its defaults here), CUDA graphs on a GPU and
    never on the CPU; its episodes are the fake policy's, run one after another."""
    from eval_suite.evaluate import batched_executor

    qs = load_questions("hotpotqa", limit=2)
    _fake_model(monkeypatch, qs)
    made = []

    class Recorder:
        def __init__(self, lm, tokenizer, **kw):
            made.append(kw)
            self.inner = SequentialExecutor(Factory(qs))

        def reserve(self, scheme, episodes):
            made[-1]["reserved"] = (str(scheme), episodes)

        def run(self, tasks):
            return self.inner.run(tasks)

    monkeypatch.setattr(batched_executor, "BatchedExecutor", Recorder)
    kw = dict(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, max_steps=4, adapter_init="random",
              quiet=True, batch=2, temperature=0.5, top_p=0.9)  # fmt: skip
    assert run_eval.evaluate(**kw, device="cpu", out=str(tmp_path / "cpu")) == 0
    _on_a_gpu(monkeypatch, 80 << 30)
    assert run_eval.evaluate(**kw, device="cuda", out=str(tmp_path / "gpu")) == 0
    common = dict(batch=2, capacity=8192, temperature=0.5, top_p=0.9, use_kernel=True, droidspeak_layers=None,
                  prefill_in_decode=None, batch_invariant=False, feed_budget=None, concurrent_schemes=False,
                  launch_ahead=False, reserved=("full_shared", 2))  # fmt: skip
    assert made == [{**common, "cuda_graphs": False}, {**common, "cuda_graphs": True}]
    config = tmp_path / "d.json"
    config.write_text(json.dumps({"droidspeak_layers": [1, 2], "profile": {}}))
    droidspeak = {**kw, "scheme": "droidspeak", "droidspeak_config": str(config)}
    assert run_eval.evaluate(**droidspeak, device="cuda", out=str(tmp_path / "ds")) == 0
    assert made[2]["droidspeak_layers"] == [1, 2] and made[2]["reserved"] == ("droidspeak", 2)


def test_an_explicit_batch_that_does_not_fit_the_gpu_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from lragent.memory_plan import model_shape, plan_memory

    qs = load_questions("hotpotqa", limit=2)
    seen = _fake_model(monkeypatch, qs)
    need = [plan_memory(model_shape("default"), "full_shared", b, 8192, element_size=4).total for b in (1, 2)]
    _on_a_gpu(monkeypatch, (need[0] + need[1]) // 2)  # one episode fits, two do not
    with pytest.raises(ValueError, match=r"^--batch 2 needs .* allowed --batch <= 1 or --batch auto$"):
        run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, adapter_init="random",
                          quiet=True, batch=2, device="cuda", out=str(tmp_path / "o"))  # fmt: skip
    assert seen["load"] == [] and not (tmp_path / "o").exists()


def test_the_agents_tools_search_the_extra_corpus_files(tmp_path, monkeypatch):
    """``--corpus FILE``: the tools the episodes get index its passages beside the benchmark's own."""
    qs = load_questions("hotpotqa", limit=2)
    _fake_model(monkeypatch, qs)
    corpus = tmp_path / "more.jsonl"
    corpus.write_text(json.dumps({"title": "Zyxwv Quorble", "text": "Zyxwv Quorble is a made-up band."}) + "\n")
    tools, real = [], run_eval.run_episodes

    def watch(*args, toolbox_factory=None, **kwargs):
        tools.append(toolbox_factory)
        return real(*args, toolbox_factory=toolbox_factory, **kwargs)

    monkeypatch.setattr(run_eval, "run_episodes", watch)
    assert run_eval.evaluate(benchmark="hotpotqa", scheme="full_shared", limit=2, runs=1, max_steps=4,
                             adapter_init="random", device="cpu", quiet=True, corpus=[str(corpus)],
                             out=str(tmp_path / "o")) == 0  # fmt: skip
    toolbox = tools[0](qs[0])
    assert "Zyxwv Quorble is a made-up band." in toolbox("Retrieve", "Zyxwv Quorble")
    assert "Metallica is an American heavy metal band" in toolbox("Retrieve", "Metallica")  # the benchmark's own


def test_out_of_memory_names_the_run_device_and_on_a_gpu_empties_the_cache(tmp_path, monkeypatch):
    """With CUDA available, an out-of-memory error of a ``--device cpu`` run names the CPU; one of a ``--device cuda``
    run names the GPU and what is free there, after handing the allocator's cached blocks back."""
    import torch

    qs = load_questions("hotpotqa", limit=3)
    _fake_model(monkeypatch, qs)

    monkeypatch.setattr(run_eval, "build_policy_factory", lambda *a, **kw: OutOfMemoryAt(1, qs))
    _on_a_gpu(monkeypatch, 1 << 30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=0: 0)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    kw = dict(benchmark="hotpotqa", scheme="full_shared", limit=3, runs=1, max_steps=4, adapter_init="random",
              quiet=True)  # fmt: skip
    lines = []
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError) as err:
            run_eval.evaluate(**kw, device=device, out=str(tmp_path / device))
        lines.append(str(err.value).split("; try ")[0])
    gpu = "out of memory on cuda allocating 2.00 GiB: 1.00 GiB free of 1.00 GiB, 0.00 GiB held here"
    assert lines == ["out of memory on cpu allocating 2.00 GiB", gpu]
    assert emptied == [True]
