"""Question splits (dev, test, extra) as data: what each split holds, how ``--split`` is parsed and refused, the split
named in every record and run_config.json (and a resume's check of it), and the search corpus that follows the pool.

Nothing here loads a model: evals run with the fake policy of tests/test_eval_runner.py, zero-shot with a fake model
and tokenizer, the session with a fake :class:`~lragent.session.MultiAgentSession`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eval_suite.evaluate import run_eval
from eval_suite.evaluate.benchmarks import HOTPOTQA, SCIENCEQA, SPLITS, Benchmark, parse_splits
from eval_suite.evaluate.episode_log import EPISODES_FILE, read_episodes
from eval_suite.evaluate.executors import SequentialExecutor
from lragent.agents import AgentConfig, WikiIndex
from lragent.cli_main import main
from tests.test_eval_runner import Factory

BENCH_DIR = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
COUNTS = {
    "hotpotqa": {"dev": 90, "test": 210},
    "scienceqa": {"dev": 90, "test": 270, "extra": 1412},
}
PER_LEVEL = {
    ("hotpotqa", "dev"): {"easy": 30, "medium": 30, "hard": 30},
    ("hotpotqa", "test"): {"easy": 70, "medium": 70, "hard": 70},
    ("scienceqa", "dev"): {"1-4": 30, "5-8": 30, "9-12": 30},
    ("scienceqa", "test"): {"1-4": 90, "5-8": 90, "9-12": 90},
    ("scienceqa", "extra"): {"1-4": 545, "5-8": 749, "9-12": 118},
}


def _rows(split: str, level: str = "easy") -> list[dict]:
    """The HotpotQA rows of one level file of ``split``, read directly (not through the code under test)."""
    path = BENCH_DIR / f"hotpotqa_{level}.{split}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ------------------------------------------------------------------------------------------- 1. what each split holds
@pytest.mark.parametrize("bench", [HOTPOTQA, SCIENCEQA], ids=lambda b: b.name)
def test_each_split_holds_its_questions_and_no_question_is_in_two(bench: Benchmark) -> None:
    """dev 90 (30 a level), test 210 HotpotQA / 270 ScienceQA, extra 1,412 ScienceQA (545 / 749 / 118); every
    question names its split; dev,test is 300 / 360, dev first; no id in two splits (none of extra in dev or test)."""
    assert bench.splits == tuple(COUNTS[bench.name])
    per = {s: bench.load_questions(splits=s) for s in bench.splits}
    assert {s: len(qs) for s, qs in per.items()} == COUNTS[bench.name]
    for s, qs in per.items():
        assert {q.split for q in qs} == {s}
        levels = {lv: sum(q.level == lv for q in qs) for lv in bench.levels}
        assert levels == PER_LEVEL[(bench.name, s)]
    pool = bench.load_questions(splits="dev,test")
    assert len(pool) == {"hotpotqa": 300, "scienceqa": 360}[bench.name]
    assert [q.qid for q in pool] == [q.qid for q in per["dev"]] + [q.qid for q in per["test"]]
    assert [q.split for q in pool] == ["dev"] * 90 + ["test"] * len(per["test"])
    assert [q.split for q in bench.load_questions(splits="dev,test", limit=92)][-3:] == ["dev", "test", "test"]
    ids = [q.qid for qs in per.values() for q in qs]
    assert len(set(ids)) == len(ids)
    if "extra" in per:
        extra = {q.qid for q in per["extra"]}
        assert not extra & {q.qid for s in ("dev", "test") for q in per[s]}
        assert {q.text for q in per["extra"]}.isdisjoint(q.text for s in ("dev", "test") for q in per[s])


def test_the_eval_command_pools_its_splits_dev_first(monkeypatch, tmp_path) -> None:
    """``eval --split test,dev`` plans 300 HotpotQA / 360 ScienceQA questions, dev's 90 first (checked as the command
    plans them: nothing is loaded, the plans are caught where they would run)."""
    plans = []
    monkeypatch.setattr(run_eval, "run_plan", lambda plan, **kw: plans.append(plan) or 0)
    argv = ["eval", "--benchmark", "hotpotqa,scienceqa", "--split", "test,dev", "--adapter_init", "zero",
            "--device", "cpu", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 0
    assert [(p.bench.name, p.splits, len(p.questions)) for p in plans] == [
        ("hotpotqa", ("dev", "test"), 300),
        ("scienceqa", ("dev", "test"), 360),
    ]
    for p in plans:
        assert [q.split for q in p.questions] == ["dev"] * 90 + ["test"] * (len(p.questions) - 90)
        assert len({q.qid for q in p.questions}) == len(p.questions)


# --------------------------------------------------------------------------------------------- 2. parsing --split
@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, ("dev",)),
        ("dev", ("dev",)),
        ("test,dev", ("dev", "test")),
        (" extra , dev ", ("dev", "extra")),
        ("extra,test,dev", SPLITS),
        (["test", "dev"], ("dev", "test")),
        (("extra", "test"), ("test", "extra")),
        ("dev,dev", ("dev",)),
    ],
)
def test_splits_parse_to_the_canonical_order(value, want) -> None:
    assert parse_splits(value) == want
    assert SCIENCEQA.parse_splits(value) == want


@pytest.mark.parametrize(("value", "bad"), [("train", "train"), ("", ""), ("dev,tst", "tst"), (["dev", "val"], "val")])
def test_a_bad_split_names_itself_and_what_is_allowed(value, bad) -> None:
    for parse in (parse_splits, HOTPOTQA.parse_splits, SCIENCEQA.parse_splits):
        with pytest.raises(ValueError) as exc:
            parse(value)
        message = str(exc.value)
        assert f"--split {value!r}" in message and "allowed dev, test, extra" in message, message
        assert repr(bad) in message or bad == "", message


@pytest.mark.parametrize("value", ["extra", "dev,extra", ["test", "extra"]])
def test_hotpotqa_has_no_extra_split(value) -> None:
    with pytest.raises(ValueError, match=r"hotpotqa has no extra split; allowed dev, test$"):
        HOTPOTQA.parse_splits(value)
    with pytest.raises(ValueError, match="hotpotqa has no extra split"):
        HOTPOTQA.load_questions(splits=value)


# ------------------------------------------------------------------------- 3. every command refuses a bad --split
def _command(cmd: str, split: str, out: Path) -> list[str]:
    if cmd == "eval":
        return ["eval", "--split", split, "--adapter_init", "zero", "--device", "cpu", "--out", str(out / "o")]
    if cmd == "zero-shot":
        return ["zero-shot", "--benchmark", "hotpotqa", "--split", split, "--device", "cpu", "--out", str(out / "o")]
    return ["session", "--split", split, "--device", "cpu", "--out", str(out / "r.json")]


UNKNOWN = "allowed dev, test, extra or a comma list"


@pytest.mark.parametrize("cmd", ["eval", "zero-shot", "session"])
@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("train", "unknown split(s) ['train']; " + UNKNOWN),
        ("", "unknown split(s) []; " + UNKNOWN),
        ("dev,tst", "unknown split(s) ['tst']; " + UNKNOWN),
        ("extra", "hotpotqa has no extra split; allowed dev, test"),
    ],
)
def test_every_question_command_refuses_a_bad_split_in_one_line_before_loading(
    cmd, split, message, tmp_path, capsys, monkeypatch
) -> None:
    """``eval``, ``zero-shot`` and ``session`` (the commands that read questions) take --split; a bad value is one
    ``error:`` line naming it, exit status 2, before any model loads and before anything is written."""
    import lragent.models
    from eval_suite.evaluate import session_runner

    loaded = []

    def refuse(*args, **kw):
        loaded.append(args)
        raise AssertionError("a model loaded before --split was checked")

    monkeypatch.setattr(run_eval, "load_lora_model", refuse)
    monkeypatch.setattr(session_runner, "load_lora_model", refuse)
    monkeypatch.setattr(lragent.models, "load_model", refuse)
    capsys.readouterr()
    assert main(_command(cmd, split, tmp_path)) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --split {split!r}: ") and message in lines[0], err
    assert not loaded and list(tmp_path.iterdir()) == []


def test_a_session_takes_one_split_only(tmp_path, capsys) -> None:
    assert main(_command("session", "dev,test", tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: --split 'dev,test': a session runs one question; allowed one of dev, test"), err


# ----------------------------------------------------------------------------- 4. the split in every eval record
def _fake_model(monkeypatch, questions) -> Factory:
    """The eval's model replaced by tests/test_eval_runner.py's fake policy over ``questions``."""
    factory = Factory(questions)
    monkeypatch.setattr(run_eval, "load_lora_model", lambda **kw: (None, None))
    monkeypatch.setattr(run_eval, "build_policy_factory", lambda *a, **kw: factory)
    return factory


def _eval(out: Path, split: str, *more: str) -> int:
    return main(["eval", "--split", split, "--levels", "easy", "--adapter_init", "zero", "--runs", "1",
                 "--max_steps", "2", "--device", "cpu", "--quiet", "true", "--out", str(out), *more])  # fmt: skip


def test_an_eval_names_each_records_split_and_refuses_to_resume_with_another(tmp_path, monkeypatch, capsys) -> None:
    """``eval --split dev,test --levels easy --limit 32``: the 30 dev questions then the first 2 test ones, each
    record naming its own split; run_config.json holds ["dev", "test"] and the pool's corpus; a rerun with the same
    split resumes (nothing to do), one with another split is refused in one line naming ``split``."""
    pool = HOTPOTQA.load_questions(levels=["easy"], splits=("dev", "test"))
    factory = _fake_model(monkeypatch, pool)
    out = tmp_path / "o"
    assert _eval(out, "dev,test", "--limit", "32") == 0
    recs = read_episodes(out / EPISODES_FILE)
    test_ids = [str(r["id"]) for r in _rows("test")[:2]]
    assert len(recs) == 32 and factory.calls == 32
    assert {r["qid"]: r["split"] for r in recs} == {
        **{str(r["id"]): "dev" for r in _rows("dev")},
        **{qid: "test" for qid in test_ids},
    }
    config = json.loads((out / "run_config.json").read_text())
    assert config["split"] == ["dev", "test"]
    assert config["corpus"]["splits"] == ["dev", "test"]
    assert [f for f in config["corpus"]["files"] if ".test." in f] == [
        "hotpotqa_easy.test.jsonl",
        "hotpotqa_hard.test.jsonl",
        "hotpotqa_medium.test.jsonl",
    ]
    before = (out / EPISODES_FILE).read_bytes()
    capsys.readouterr()
    assert _eval(out, "test,dev", "--limit", "32") == 0  # the same pool, however spelt: resumes, nothing to run
    assert factory.calls == 32
    for other in ("dev", "test"):
        assert _eval(out, other) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and f"split: ['dev', 'test'] -> [{other!r}]" in lines[0], err
        assert "use another --out" in lines[0]
    assert (out / EPISODES_FILE).read_bytes() == before and factory.calls == 32


def test_an_eval_dir_from_before_the_splits_resumes_as_dev(tmp_path, monkeypatch, capsys) -> None:
    """A run_config.json without ``split`` (runs made before the splits) resumes as dev: ``--split dev`` goes on, a
    test pool is refused naming ``split``."""
    pool = HOTPOTQA.load_questions(levels=["easy"], splits=("dev", "test"))
    factory = _fake_model(monkeypatch, pool)
    out = tmp_path / "old"
    assert _eval(out, "dev", "--limit", "2") == 0
    config = json.loads((out / "run_config.json").read_text())
    assert config.pop("split") == ["dev"]
    (out / "run_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert _eval(out, "dev", "--limit", "3") == 0  # resumed: one more question
    assert factory.calls == 3 and [r["split"] for r in read_episodes(out / EPISODES_FILE)] == ["dev"] * 3
    assert json.loads((out / "run_config.json").read_text())["split"] == ["dev"]
    (out / "run_config.json").write_text(json.dumps(config))  # the old file again
    assert _eval(out, "dev,test", "--limit", "3") == 2
    err = capsys.readouterr().err
    assert "split: ['dev'] -> ['dev', 'test']" in err and err.count("error:") == 1, err
    # the same check on its own: the field missing reads dev
    run_eval.check_run_config(out, {**config, "split": ["dev"]})
    (out / "run_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\(split: \['dev'\] -> \['test'\]\)"):
        run_eval.check_run_config(out, {**config, "split": ["test"]})


def test_episode_records_name_the_questions_split(tmp_path) -> None:
    """run_episodes over a pool of dev and test questions (the test ones' own toolbox given): each record's split is
    its question's."""
    qs = [*HOTPOTQA.load_questions(limit=2), *HOTPOTQA.load_questions(limit=2, splits="test")]
    recs = run_eval.run_episodes(
        qs, ["non_shared"], 1, SequentialExecutor(Factory(qs)), tmp_path, benchmark="hotpotqa",
        adapters="init:random", agent_config=AgentConfig(max_steps=1), progress=False,
        toolbox_factory=lambda q: (lambda action, arg: "Nothing."),
    )  # fmt: skip
    assert [(r["qid"], r["split"]) for r in recs] == [(q.qid, q.split) for q in qs]
    assert [r["split"] for r in recs] == ["dev", "dev", "test", "test"]


# --------------------------------------------------------------------------------- 5. the corpus follows the pool
def test_the_dev_corpus_is_the_index_of_runs_before_the_splits() -> None:
    """HotpotQA's dev pool indexes the dev files' paragraphs in file-name order (easy, hard, medium): the very index
    (same fingerprint) that ``WikiIndex.from_benchmarks`` built from the sorted files before the splits existed; the
    default pool is dev."""
    dev_files = sorted(BENCH_DIR.glob("hotpotqa_*.dev.jsonl"))
    names = [f.name for f in dev_files]
    assert names == ["hotpotqa_easy.dev.jsonl", "hotpotqa_hard.dev.jsonl", "hotpotqa_medium.dev.jsonl"]
    reference = WikiIndex.from_benchmarks(dev_files).fingerprint()
    q = HOTPOTQA.load_questions(limit=1)[0]
    for splits in (("dev",), None, "dev"):
        make, desc = HOTPOTQA.toolbox_factory(splits=splits)
        assert make(q).index.fingerprint() == reference
        assert desc["files"] == names and desc["splits"] == ["dev"]


def test_a_pool_with_test_indexes_the_test_questions_paragraphs() -> None:
    """(dev, test): dev's files then test's, each in file-name order, so a test question's own paragraphs are found
    (some of them are not in the dev index)."""
    dev_files = sorted(BENCH_DIR.glob("hotpotqa_*.dev.jsonl"))
    test_files = sorted(BENCH_DIR.glob("hotpotqa_*.test.jsonl"))
    make, desc = HOTPOTQA.toolbox_factory(splits=("dev", "test"))
    q = HOTPOTQA.load_questions(limit=1, splits="test")[0]
    index = make(q).index
    assert index.fingerprint() == WikiIndex.from_benchmarks(dev_files + test_files).fingerprint()
    assert desc["files"] == [f.name for f in dev_files + test_files] and desc["splits"] == ["dev", "test"]
    dev_index = HOTPOTQA.toolbox_factory(splits="dev")[0](q).index
    row = _rows("test")[0]
    assert str(row["id"]) == q.qid
    titles = row["context"]["title"]
    assert all(index.get(t) is not None for t in titles)
    assert any(dev_index.get(t) is None for t in titles)  # the check can fail: dev alone lacks some of them


def test_an_eval_pool_gives_each_test_question_its_own_paragraphs(tmp_path, monkeypatch) -> None:
    """run_episodes without a toolbox factory builds the corpus of its questions' own splits: every test question's
    toolbox finds each of its context paragraphs."""
    made: dict[str, object] = {}
    pools = []
    original = Benchmark.toolbox_factory

    def spy(self, *args, **kw):
        pools.append(tuple(parse_splits(kw.get("splits"))))
        make, desc = original(self, *args, **kw)

        def wrapped(q):
            made[q.qid] = box = make(q)
            return box

        return wrapped, desc

    monkeypatch.setattr(Benchmark, "toolbox_factory", spy)
    rows = {str(r["id"]): r for r in _rows("test")[:3]}
    qs = [*HOTPOTQA.load_questions(limit=1), *HOTPOTQA.load_questions(levels=["easy"], limit=3, splits="test")]
    run_eval.run_episodes(
        qs, ["non_shared"], 1, SequentialExecutor(Factory(qs)), tmp_path, benchmark="hotpotqa",
        adapters="init:random", agent_config=AgentConfig(max_steps=1), progress=False,
    )  # fmt: skip
    assert pools == [("dev", "test")] and set(made) == {q.qid for q in qs}
    dev_index = original(HOTPOTQA, splits="dev")[0](qs[0]).index
    missing_from_dev = [t for r in rows.values() for t in r["context"]["title"] if dev_index.get(t) is None]
    assert missing_from_dev  # the check can fail
    for qid, row in rows.items():
        assert all(made[qid].index.get(t) is not None for t in row["context"]["title"]), qid


def test_the_scienceqa_corpus_checks_overlap_against_the_whole_pool(monkeypatch) -> None:
    """The ScienceQA corpus leaves out trajectories overlapping any question of the pool: the overlap check is given
    exactly the pool's questions."""
    from eval_suite.evaluate import scienceqa_corpus

    class Stop(Exception):
        pass

    given = []

    def spy(raw, evaluation):
        given.append(list(evaluation))
        raise Stop

    monkeypatch.setattr(scienceqa_corpus, "build_search_corpus", spy)
    for splits in (("test",), ("dev", "test", "extra")):
        with pytest.raises(Stop):
            SCIENCEQA.corpus(splits=splits)
        assert given.pop() == [q.text for q in SCIENCEQA.load_questions(splits=splits)]


# ------------------------------------------------------------------------- 6. zero-shot and session name the split
class _FakeTokenizer:
    chat_template = None
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [1, 2, 3]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(text)]


class _FakeLM:
    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        logits = torch.zeros(1, ids.shape[1], 128)
        logits[0, -1, ord("B")] = 1.0
        return SimpleNamespace(logits=logits)


def test_zero_shot_records_and_summary_name_their_split(tmp_path, monkeypatch) -> None:
    """zero-shot --split dev,test --limit 92: 90 dev records then 2 test ones, each naming its split, the summary the
    pool (a fake model: letter B every time)."""
    import lragent.models
    from eval_suite.evaluate.zero_shot import zero_shot

    monkeypatch.setattr(lragent.models, "load_model", lambda *a, **kw: (_FakeLM(), _FakeTokenizer()))
    out = tmp_path / "zs"
    assert zero_shot(benchmark="scienceqa", split="test,dev", limit=92, device="cpu", dtype="float32", out=str(out),
                     quiet=True) == 0  # fmt: skip
    recs = [json.loads(x) for x in (out / "zero_shot.jsonl").read_text().splitlines()]
    want = SCIENCEQA.load_questions(splits=("dev", "test"), limit=92)
    assert [(r["qid"], r["split"]) for r in recs] == [(q.qid, q.split) for q in want]
    assert [r["split"] for r in recs][-3:] == ["dev", "test", "test"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["split"] == ["dev", "test"] and summary["questions"] == 92


class _FakeSession:
    """What session_runner.run asks of a MultiAgentSession: the text it appended, one token per step."""

    texts: list[str] = []

    def __init__(self, lm, scheme, **kw) -> None:
        self.scheme, self.num_tokens, self.peak_cache_bytes = scheme, 0, 0
        _FakeSession.texts = []

    def append_text(self, text: str) -> None:
        _FakeSession.texts.append(text)

    def step(self, role: str, **kw) -> SimpleNamespace:
        d = {"role": role, "prefill_tokens": 1, "prefill_s": 0.0, "generated_ids": [5], "decode_s": 0.0, "text": "x"}
        return SimpleNamespace(**d, to_dict=lambda: dict(d))

    def cache_bytes(self) -> dict:
        return {}


@pytest.mark.parametrize(("split", "index"), [("test", 3), ("dev", 1)])
def test_a_session_result_names_its_split_and_runs_that_splits_question(split, index, tmp_path, monkeypatch) -> None:
    """``session --split test --question 3``: the 4th easy question of the test file, its text in the schedule; the
    result names the split and the question (a fake session: nothing loads)."""
    from eval_suite.evaluate import session_runner

    monkeypatch.setattr(session_runner, "load_lora_model", lambda **kw: (None, None))
    monkeypatch.setattr(session_runner, "check_session", lambda *a, **kw: None)
    monkeypatch.setattr(session_runner, "MultiAgentSession", _FakeSession)
    out = tmp_path / "r.json"
    argv = ["session", "--split", split, "--question", str(index), "--schedule", "short", "--adapter_init", "random",
            "--device", "cpu", "--quiet", "true", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    row = _rows(split)[index]
    result = json.loads(out.read_text())
    assert (result["split"], result["question"], result["question_id"]) == (split, index, row["id"])
    assert row["question"].strip() in _FakeSession.texts[0]
