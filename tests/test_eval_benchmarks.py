"""The benchmark registry: questions and levels, each benchmark's own search corpus, and what its tools return."""

from __future__ import annotations

import gzip
import html
import json
import random
from pathlib import Path

import pytest

from eval_suite.evaluate.benchmarks import (
    BENCHMARKS,
    HOTPOTQA,
    SCIENCEQA,
    get_benchmark,
    parse_constraints,
    row_name,
)
from eval_suite.evaluate.scienceqa_corpus import (
    FAILED_PREFIXES,
    build_search_corpus,
    overlapping_questions,
    read_raw_trajectories,
    search_results,
)
from lragent.agents import WikiIndex
from lragent.agents.constraints import YES_NO
from lragent.agents.tools import iter_hotpotqa_passages

DATA = Path(__file__).resolve().parents[1] / "data"
RAW_SCIENCEQA = DATA / "trajectories" / "raw" / "70b_scienceqa_200.jsonl.gz"
HOTPOT_FILES = sorted((DATA / "benchmarks").glob("hotpotqa_*.dev.jsonl"))


@pytest.fixture(scope="module")
def hotpot_passages():
    return [p for f in HOTPOT_FILES for p in iter_hotpotqa_passages(f)]


@pytest.fixture(scope="module")
def scienceqa_tools():
    make, desc = SCIENCEQA.toolbox_factory()
    return make, desc


def _windows(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_scienceqa_tools_never_return_hotpotqa_text(hotpot_passages, scienceqa_tools):
    """Every HotpotQA title (Retrieve, BingSearch, Lookup) and a sample of its sentences (BingSearch) as queries:
    no observation contains a HotpotQA paragraph sentence (other than the query itself, which a failed Retrieve
    echoes). A sentence of 10+ words is found through its inner 8-word window (words 2-9: whitespace-delimited
    however the sentences are joined); shorter ones by substring."""
    make, desc = scienceqa_tools
    q = SCIENCEQA.load_questions(limit=1)[0]
    sentences = {" ".join(s.split()) for p in hotpot_passages for s in p.sentences if len(s.split()) >= 4}
    long_keys = {tuple(s.split()[1:9]): s for s in sentences if len(s.split()) >= 10}
    short = [s for s in sentences if len(s.split()) < 10]
    rng = random.Random(0)
    queries = [("Retrieve", p.title) for p in hotpot_passages] + [("BingSearch", p.title) for p in hotpot_passages]
    queries += [("BingSearch", s) for s in rng.sample(sorted(sentences), 300)]
    outputs = []
    for tool, arg in queries:
        box = make(q)
        outputs.append(box(tool, arg).replace(" ".join(arg.split()), "<query>"))
        if tool == "BingSearch":
            outputs.append(box("Lookup", arg.split()[0]))
    assert sum(len(o) > 200 for o in outputs) > 300, "the queries must find science text, or the check proves nothing"
    for out in outputs:
        hits = [long_keys[w] for w in _windows(out) if w in long_keys]
        assert not hits, hits[0]
    joined = "\n".join(outputs)
    leaked = [s for s in short if len(s) >= 30 and s in joined]
    assert not leaked, leaked[:3]
    assert desc["passages"] == desc["indexed"] > 200 and desc["excluded_overlapping_questions"] == []


def test_hotpotqa_toolbox_is_the_benchmark_index(hotpot_passages):
    make, desc = HOTPOTQA.toolbox_factory()
    box = make(HOTPOTQA.load_questions(limit=1)[0])
    reference = WikiIndex.from_benchmarks(HOTPOT_FILES)
    assert box.index.fingerprint() == reference.fingerprint()
    assert box("Retrieve", "Metallica") == reference.get("Metallica").text
    assert desc["passages"] == len(hotpot_passages) and desc["indexed"] == len(reference)


def test_scienceqa_corpus_is_observation_text_only():
    rows = read_raw_trajectories(RAW_SCIENCEQA)
    prompts = [html.unescape(r["prompt"]) for r in rows]
    corpus = build_search_corpus(RAW_SCIENCEQA, [])
    observations = {" ".join(res.text.split()) for r in rows for res in search_results(r["prompt"])}
    for p in corpus.passages:
        text = " ".join("".join(p.sentences).split())
        assert text in observations
        assert not text.lower().startswith(FAILED_PREFIXES)
    # observation lines only: no thought, action (Finish argument included) or question is in any passage
    everything = "\n".join(" ".join(p.text.split()) for p in corpus.passages)
    checked = 0
    for prompt in prompts:
        question = " ".join(prompt.split("\nQuestion:", 1)[1].split("\nThought 1:", 1)[0].split())
        assert question not in everything
        for line in prompt.split("\n"):
            body = " ".join(line.split(":", 1)[-1].split())
            if line.startswith(("Thought", "Action")) and len(body) > 40:
                assert body not in everything, body
                checked += 1
    assert checked > 50
    assert corpus.trajectories == 200 and len(corpus.passages) > 200


def test_overlapping_training_questions_are_left_out():
    rows = read_raw_trajectories(RAW_SCIENCEQA)
    evaluation = [q.text for q in SCIENCEQA.load_questions()]
    assert overlapping_questions([r["question"] for r in rows], evaluation) == []  # the bundled split is clean
    # plant an overlap: evaluate on a training question (reworded by one word) and its results must go
    i = next(i for i, r in enumerate(rows) if search_results(r["prompt"]))
    planted = rows[i]["question"].replace("Which", "Which one")
    corpus = build_search_corpus(RAW_SCIENCEQA, [*evaluation, planted])
    assert corpus.excluded == (rows[i]["question"],)
    own = {res.text for res in search_results(rows[i]["prompt"])}
    others = {res.text for j, r in enumerate(rows) if j != i for res in search_results(r["prompt"])}
    gone = own - others
    assert gone and not gone & {" ".join(p.text.split()) for p in corpus.passages}


def test_extra_corpus_and_image_text(tmp_path):
    extra = tmp_path / "c.jsonl"
    row = {"title": "Zorblax Crystal", "text": "A zorblax crystal glows green. It is rare."}
    extra.write_text(json.dumps(row) + "\n")
    make, desc = SCIENCEQA.toolbox_factory([extra])
    q = next(q for q in SCIENCEQA.load_questions() if q.caption not in (None, "no img"))
    box = make(q)
    assert box("Retrieve", "zorblax crystal") == "A zorblax crystal glows green. It is rare."
    assert box("Image2Text", "image").startswith(f"Image caption: {q.caption}")
    assert desc["extra"] == [{"file": str(extra), "passages": 1}]
    with pytest.raises(FileNotFoundError, match="--corpus"):
        SCIENCEQA.corpus([tmp_path / "missing.jsonl"])


def test_registry_levels_constraints_and_rows():
    assert set(BENCHMARKS) == {"hotpotqa", "scienceqa"}
    assert [SCIENCEQA.parse_level(x) for x in ("grade1_4", "1_4", "5-8", "grade9-12")] == ["1-4", "1-4", "5-8", "9-12"]
    with pytest.raises(ValueError, match="allowed easy, medium, hard"):
        HOTPOTQA.parse_level("extreme")
    with pytest.raises(ValueError, match="allowed hotpotqa, scienceqa"):
        get_benchmark("gsm8k")
    assert parse_constraints("none") == () and parse_constraints("all") == ("action_type", "answer")
    assert parse_constraints("answer,action_type") == ("action_type", "answer")
    with pytest.raises(ValueError, match="unknown"):
        parse_constraints("actions")
    assert row_name("base_lr_shared", ()) == "base_lr_shared"
    assert row_name("base_lr_shared", ("action_type", "answer")) == "base_lr_shared+constrained"
    assert row_name("untrained", ("answer",)) == "untrained+constrained:answer"
    sq = SCIENCEQA.load_questions(limit=1)[0]
    types, answers = SCIENCEQA.constraint_options(sq, ("action_type", "answer"))
    assert types == ("Image2Text", "BingSearch", "Retrieve", "Finish") and answers == tuple("ABCDE"[: len(sq.choices)])
    hq = [q for q in HOTPOTQA.load_questions() if HOTPOTQA.constraint_options(q, ("answer",))[1] is not None]
    assert len(hq) == 5 and all(HOTPOTQA.constraint_options(q, ("answer",)) == (None, YES_NO) for q in hq)
    assert HOTPOTQA.constraint_options(hq[0], ()) == (None, None)


def test_raw_trajectory_file_has_observations():
    with gzip.open(RAW_SCIENCEQA, "rt", encoding="utf-8") as f:
        first = json.loads(f.readline())
    assert [r.tool for r in search_results(first["prompt"])] == ["BingSearch"]


def test_missing_benchmark_and_trajectory_files_are_named(tmp_path):
    from eval_suite.evaluate.benchmarks import get_benchmark
    from eval_suite.evaluate.scienceqa_corpus import read_raw_trajectories

    hotpot = get_benchmark("hotpotqa")
    with pytest.raises(FileNotFoundError, match=f"benchmark file {tmp_path}/.*hotpotqa_easy.dev.jsonl is missing"):
        hotpot.load_questions(levels=["easy"], data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=f"HotpotQA benchmark file {tmp_path}/.*hotpotqa_.*.dev.jsonl is"):
        hotpot.corpus(data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=f"raw trajectory file {tmp_path / 'raw.jsonl.gz'} is missing"):
        read_raw_trajectories(tmp_path / "raw.jsonl.gz")
