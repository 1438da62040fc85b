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
    SearchResult,
    build_search_corpus,
    max_similarity,
    overlapping_questions,
    question_key,
    read_raw_trajectories,
    search_results,
)
from lragent.agents import WikiIndex
from lragent.agents.constraints import YES_NO
from lragent.agents.tools import Passage, iter_hotpotqa_passages

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


# ------------------------------------------------------------------------------- a small data folder of our own
_SUN = "Which of the following could be used to measure the distance between the Earth and the Sun?"
_SUN_CHOICES = ["A meter stick", "A stopwatch", "A telescope", "A laser rangefinder"]  # a training question's


def _hotpot_row(qid: object, question: str, answer: str, *paragraphs: tuple[str, list[str]]) -> dict:
    titles, sentences = [t for t, _ in paragraphs], [s for _, s in paragraphs]
    return {"id": qid, "question": question, "answer": answer, "context": {"title": titles, "sentences": sentences}}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A data folder with a few hand-written questions per level and split, and the real ScienceQA trajectories."""
    files = {
        "hotpotqa_easy.dev": [
            _hotpot_row(101, "Are  Paris and Lyon both in France? ", "yes", ("Paris", ["Paris is in France."]),
                        ("Lyon", ["Lyon is a French city.", " It is old."])),
            _hotpot_row("e2", "Who founded Lugdunum?", "the Romans", ("Lugdunum", ["Romans founded Lugdunum."])),
        ],
        "hotpotqa_medium.dev": [_hotpot_row("m1", "Where is Zorb?", "Qux", ("Zorb", ["Zorb is in Qux."]))],
        "hotpotqa_hard.dev": [_hotpot_row(f"h{i}", f"Hard {i}?", str(i), (f"Hard{i}", [f"Hard{i} says {i}."]))
                              for i in (1, 2, 3)],
        "scienceqa_grade1_4.dev": [{"pid": 7, "question": _SUN, "choices": _SUN_CHOICES, "answer": 3,
                                    "caption": "a ruler", "ocr": "10 cm"}],
        "scienceqa_grade5_8.dev": [{"pid": "58a", "question": "Hot or cold?", "choices": ["hot", "cold"],
                                    "answer": "1"}],
        "scienceqa_grade9_12.dev": [{"pid": "912a", "question": "Is ice a solid?", "choices": ["yes", "no"],
                                     "answer": 0}],
        "scienceqa_grade9_12.test": [{"pid": f"t{i}", "question": f"Test {i}?", "choices": ["x", "y", "z"],
                                      "answer": i} for i in (2, 1)],
    }  # fmt: skip
    (tmp_path / "benchmarks").mkdir()
    for stem, rows in files.items():
        (tmp_path / "benchmarks" / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    (tmp_path / "trajectories" / "raw").mkdir(parents=True)
    (tmp_path / "trajectories" / "raw" / RAW_SCIENCEQA.name).symlink_to(RAW_SCIENCEQA)
    return tmp_path


def test_questions_are_read_with_their_ids_texts_golds_options_and_split_level_by_level(data_dir) -> None:
    """One Question per row: the id as a string, the prompt's question text (ScienceQA: with its options), the gold
    answer (HotpotQA: its text; ScienceQA: the option index as an int), options, caption and OCR (None when the row has
    none) and the split; levels interleave (first of each level, then the second...), ``limit`` keeps the first."""
    from eval_suite.evaluate.benchmarks import Question, load_questions

    qs = HOTPOTQA.load_questions(data_dir=data_dir)
    assert [(q.qid, q.level) for q in qs] == [("101", "easy"), ("m1", "medium"), ("h1", "hard"), ("e2", "easy"),
                                              ("h2", "hard"), ("h3", "hard")]  # fmt: skip
    assert qs[0] == Question("101", "easy", "Are  Paris and Lyon both in France?", "yes", split="dev")
    assert qs[3] == Question("e2", "easy", "Who founded Lugdunum?", "the Romans", (), None, None, "dev")
    assert load_questions("hotpotqa", levels=["hard", "EASY"], limit=3, data_dir=data_dir) == [qs[2], qs[0], qs[4]]
    sq = load_questions("scienceqa", data_dir=data_dir)
    options = "\nOptions:(A) A meter stick (B) A stopwatch (C) A telescope (D) A laser rangefinder"
    assert sq == [
        Question("7", "1-4", _SUN + options, 3, tuple(_SUN_CHOICES), "a ruler", "10 cm", "dev"),
        Question("58a", "5-8", "Hot or cold?\nOptions:(A) hot (B) cold", 1, ("hot", "cold"), None, None, "dev"),
        Question("912a", "9-12", "Is ice a solid?\nOptions:(A) yes (B) no", 0, ("yes", "no"), None, None, "dev"),
    ]
    test_q = Question("t2", "9-12", "Test 2?\nOptions:(A) x (B) y (C) z", 2, ("x", "y", "z"), None, None, "test")
    assert load_questions("scienceqa", levels=["grade9_12"], limit=1, data_dir=data_dir, splits="test") == [test_q]


def test_a_row_parsed_without_a_split_is_a_dev_question_and_level_files_default_to_dev(data_dir) -> None:
    row = json.loads((data_dir / "benchmarks" / "hotpotqa_medium.dev.jsonl").read_text().splitlines()[0])
    assert HOTPOTQA.parse_row(row, "medium").split == "dev"
    assert SCIENCEQA.parse_row({"pid": 1, "question": "Q?", "choices": ["a"], "answer": 0}, "1-4").split == "dev"
    assert HOTPOTQA.level_file("easy", data_dir) == data_dir / "benchmarks" / "hotpotqa_easy.dev.jsonl"
    assert SCIENCEQA.level_file("5-8", data_dir, "extra") == data_dir / "benchmarks" / "scienceqa_grade5_8.extra.jsonl"


def test_each_benchmark_scores_an_answer_by_its_own_fields(data_dir) -> None:
    """HotpotQA: exact match and token F1 against the gold text; ScienceQA: whether the answer names the gold option
    (by letter or text); no answer scores 0."""
    hq = HOTPOTQA.load_questions(data_dir=data_dir)[3]  # gold "the Romans"
    assert HOTPOTQA.score(hq, "Romans") == {"em": 1.0, "f1": 1.0}  # articles are dropped
    assert HOTPOTQA.score(hq, "old Romans") == {"em": 0.0, "f1": pytest.approx(2 / 3)}
    assert HOTPOTQA.score(hq, None) == {"em": 0.0, "f1": 0.0}
    sq = SCIENCEQA.load_questions(data_dir=data_dir)[0]  # gold D
    assert SCIENCEQA.score(sq, "D") == {"correct": 1.0} and SCIENCEQA.score(sq, "A laser rangefinder") == {
        "correct": 1.0
    }
    assert SCIENCEQA.score(sq, "A") == {"correct": 0.0} and SCIENCEQA.score(sq, None) == {"correct": 0.0}


def test_the_hotpotqa_corpus_is_the_pools_paragraphs_then_each_extra_file_in_order(data_dir, tmp_path) -> None:
    extras = [tmp_path / "one.jsonl", tmp_path / "two.jsonl"]
    extras[0].write_text(json.dumps({"title": "Extra A", "text": "A is first."}) + "\n")
    extras[1].write_text("".join(json.dumps({"title": f"Extra {t}", "text": f"{t}."}) + "\n" for t in "BC"))
    passages, desc = HOTPOTQA.corpus(extras, data_dir=data_dir)
    # the dev files in file-name order: easy, hard, medium
    own = ["Paris", "Lyon", "Lugdunum", "Hard1", "Hard2", "Hard3", "Zorb"]
    assert [p.title for p in passages] == [*own, "Extra A", "Extra B", "Extra C"]
    assert desc == {
        "source": "HotpotQA context paragraphs",
        "files": ["hotpotqa_easy.dev.jsonl", "hotpotqa_hard.dev.jsonl", "hotpotqa_medium.dev.jsonl"],
        "splits": ["dev"],
        "extra": [{"file": str(extras[0]), "passages": 1}, {"file": str(extras[1]), "passages": 2}],
        "passages": 10,
    }


def test_a_missing_hotpotqa_file_of_the_pool_is_named(data_dir) -> None:
    missing = data_dir / "benchmarks" / "hotpotqa_medium.dev.jsonl"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=f"^HotpotQA benchmark file {missing} is missing$"):
        HOTPOTQA.corpus(data_dir=data_dir)


def test_the_scienceqa_corpus_leaves_out_training_questions_of_the_given_data_folders_pool(data_dir) -> None:
    """The overlap check reads the questions of the data folder it is given (here one is a training question)."""
    passages, desc = SCIENCEQA.corpus(data_dir=data_dir)
    sun = SCIENCEQA.load_questions(data_dir=data_dir)[0].text
    assert desc["source"] == f"search results of {RAW_SCIENCEQA.name}" and desc["splits"] == ["dev"]
    assert desc["excluded_overlapping_questions"] == [sun] and desc["trajectories"] == 200
    assert desc["passages"] == len(passages) > 200


def test_a_hotpotqa_search_that_finds_nothing_answers_with_the_training_datas_spelling(data_dir) -> None:
    """HotpotQA's failed BingSearch observation is its training trajectories' ``bingSearch error`` (lower-case b)."""
    make, desc = HOTPOTQA.toolbox_factory(data_dir=data_dir)
    box = make(HOTPOTQA.load_questions(data_dir=data_dir)[0])
    assert box("BingSearch", "xylophone quasar") == "bingSearch error, please try again."
    assert box("Retrieve", "Zorb") == "Zorb is in Qux."
    assert desc["indexed"] == desc["passages"] == 7


def test_the_answer_text_constraint_is_scienceqa_only_and_excludes_the_letter_constraint(data_dir) -> None:
    from eval_suite.evaluate.benchmarks import answer_score, parse_level

    assert parse_constraints("answer_text") == ("answer_text",)
    assert parse_constraints(["answer_text", " action_type"]) == ("action_type", "answer_text")
    with pytest.raises(ValueError, match="^--constrain 'answer, answer_text': answer and answer_text both choose the "
                                         "Finish argument; allowed one of them$"):  # fmt: skip
        parse_constraints("answer, answer_text")
    assert row_name("base_lr_shared", ["answer_text"]) == "base_lr_shared+answer_text"
    assert row_name("base_lr_shared", ["answer_text", "action_type"]) == "base_lr_shared+action_type,answer_text"
    assert answer_score(["answer_text"]) == "mean" and answer_score(("action_type", "answer_text")) == "mean"
    assert answer_score(["action_type", "answer"]) is None and answer_score([]) is None
    sq = SCIENCEQA.load_questions(data_dir=data_dir)[0]
    assert SCIENCEQA.answer_texts(sq, ("answer_text",)) == tuple(_SUN_CHOICES)
    assert SCIENCEQA.answer_texts(sq, ("answer",)) is None
    assert SCIENCEQA.constraint_options(sq, ("answer_text",)) == (None, ("A", "B", "C", "D"))
    SCIENCEQA.check_constraints(("action_type", "answer_text"))
    hq = HOTPOTQA.load_questions(data_dir=data_dir)[0]
    message = (
        "^--constrain 'answer_text' scores the options' texts and hotpotqa questions have none: allowed on hotpotqa "
        "none, all or a comma list of action_type, answer$"
    )
    for refused in (
        lambda: HOTPOTQA.check_constraints(["answer_text"]),
        lambda: HOTPOTQA.constraint_options(hq, ("answer_text",)),
        lambda: HOTPOTQA.answer_texts(hq, ("action_type", "answer_text")),
    ):
        with pytest.raises(ValueError, match=message):
            refused()
    assert parse_level("scienceqa", "GRADE5_8") == "5-8" and parse_level("hotpotqa", "Hard") == "hard"
    with pytest.raises(ValueError, match="^unknown scienceqa level 'grade13': allowed 1-4, 5-8, 9-12$"):
        parse_level("scienceqa", "grade13")


def test_benchmark_questions_load_the_same_under_a_locale_that_is_not_utf8(monkeypatch) -> None:
    """Where the default text encoding is not UTF-8 (an ASCII locale without UTF-8 mode, in a fresh process and
    simulated here through :func:`io.text_encoding`) the questions load as they do under UTF-8, non-ASCII text
    included."""
    import io
    import os
    import subprocess
    import sys

    utf8 = HOTPOTQA.load_questions(levels=["easy"])
    non_ascii = sum(any(ord(c) > 127 for c in q.text) for q in utf8)
    assert non_ascii > 0, "the easy questions must hold non-ASCII text, or this checks nothing"
    code = (
        "import locale; from eval_suite.evaluate.benchmarks import HOTPOTQA; "
        "print(locale.getpreferredencoding(False)); "
        "print(sum(any(ord(c) > 127 for c in q.text) for q in HOTPOTQA.load_questions(levels=['easy'])))"
    )
    env = {**os.environ, "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "LC_ALL": "C", "LANG": "C"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    encoding, count = run.stdout.split()
    assert encoding.lower() not in ("utf-8", "utf8") and int(count) == non_ascii
    real = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda enc, stacklevel=2: "ascii" if enc is None else real(enc))
    assert HOTPOTQA.load_questions(levels=["easy"]) == utf8


# ---------------------------------------------------------- the ScienceQA search corpus on hand-made trajectories
def _prompt(*steps: tuple[str, str]) -> str:
    """A raw trajectory prompt whose step i is ``Action i: <action>`` then ``Observation i: <observation>``."""
    body = "".join(
        f"\nThought {i}: I look it up.\nAction {i}: {action}\nObservation {i}: {obs}" for i, (action, obs) in
        enumerate(steps, 1)
    )  # fmt: skip
    return f"Question: a question\nOptions:(A) yes (B) no{body}\nThought {len(steps) + 1}: done."


def test_search_results_keep_each_search_steps_tool_argument_and_unescaped_observation() -> None:
    """Arguments and observations have their whitespace collapsed (observations HTML-unescaped); only a Lookup
    observation loses its ``(Result i / n)`` prefix; failed searches and non-search steps are dropped."""
    prompt = _prompt(
        ("BingSearch[  solar   energy uses ]", "Solar  energy &amp; wind\n  power are renewable."),
        ("Lookup[wind]", "(Result 1 / 3) Wind power is clean."),
        ("Retrieve[Photosynthesis]", "(Result 2/5) Photosynthesis makes sugar."),
        ("Lookup[sun]", "No more results."),
        ("Image2Text[image]", "A red planet."),
    )
    assert search_results(prompt) == [
        SearchResult("BingSearch", "solar energy uses", "Solar energy & wind power are renewable."),
        SearchResult("Lookup", "wind", "Wind power is clean."),
        SearchResult("Retrieve", "Photosynthesis", "(Result 2/5) Photosynthesis makes sugar."),
    ]


def test_question_similarity_is_the_lower_case_word_set_jaccard_and_0_8_counts_as_the_same() -> None:
    """Word sets are lower-case; a Jaccard similarity of exactly 0.8 is an overlap, 4/6 is not; the highest
    similarity is the Jaccard ratio itself (0 without any pair or without shared words)."""
    assert question_key("Which  GAS? Options:(A) CO2") == frozenset({"which", "gas", "options", "a", "co2"})
    assert overlapping_questions(["a b c d e", "A b c d e f", "x y"], ["a B c d"]) == [0]
    assert max_similarity(["a b c d e f", "x y"], ["a b c d"]) == 4 / 6
    assert max_similarity(["x y"], ["a b"]) == 0.0 and max_similarity([], ["a b"]) == 0.0


def test_the_search_corpus_titles_deduplicates_and_excludes_hand_made_trajectories(tmp_path) -> None:
    """Retrieve passages come first, then BingSearch, then Lookup; titles lose surrounding quotes, an empty one is
    the text's first 60 characters, a taken title gets `` (search result)`` and a result whose suffixed title is
    taken too is dropped (later ones kept); a repeated text is dropped; the overlapping training question's results
    are left out, and :meth:`describe` reports it all."""
    long_text = "An empty search still returns a passage whose text is longer than sixty characters."
    spider = "How many legs does a spider have"
    rows = [
        {
            "question": "Which planet is red? Options:(A) Mars (B) Venus",
            "prompt": _prompt(
                ('BingSearch["red planet"]', "Mars is called the red planet. It looks red."),
                ("Lookup[gas]", "(Result 1 / 2) Noble gases do not react."),
                ("Retrieve[Mars]", "Mars is the fourth planet."),
            ),
        },
        {
            "question": "What is xenon? Options:(A) a gas (B) a metal",
            "prompt": _prompt(
                ("BingSearch[Mars]", "Mars has two moons."),
                ("BingSearch[mars]", "Mars is cold."),
                ("BingSearch[Xenon]", "Xenon is a noble gas."),
                ("BingSearch['']", long_text),
                ("BingSearch[solar wind]", "Mars is the fourth planet."),
                ("BingSearch[Neon]", "Neon glows red."),
            ),
        },
        {"question": spider, "prompt": _prompt(("Retrieve[Spider]", "Spiders have eight legs."))},
    ]
    raw = tmp_path / "raw.jsonl.gz"
    with gzip.open(raw, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    corpus = build_search_corpus(raw, ["How many legs does a spider", "Unrelated"])
    assert corpus.passages == (
        Passage("Mars", ("Mars is the fourth planet.",)),
        Passage("red planet", ("Mars is called the red planet.", " It looks red.")),
        Passage("Mars (search result)", ("Mars has two moons.",)),
        Passage("Xenon", ("Xenon is a noble gas.",)),
        Passage(long_text[:60], (long_text,)),
        Passage("Neon", ("Neon glows red.",)),
        Passage("gas", ("Noble gases do not react.",)),
    )
    assert corpus.trajectories == 3 and corpus.excluded == (spider,) and corpus.max_similarity == 6 / 7
    assert corpus.describe() == {
        "passages": 7,
        "trajectories": 3,
        "excluded_overlapping_questions": [spider],
        "max_train_eval_question_similarity": 0.8571,
    }


def test_raw_trajectories_are_read_as_utf8_under_a_locale_that_is_not(tmp_path, monkeypatch) -> None:
    """Raw trajectory files are UTF-8 whatever the default text encoding (simulated through
    :func:`io.text_encoding`); blank lines are skipped."""
    import io

    rows = [{"question": "How long is 1 \u00c5ngstr\u00f6m?", "prompt": "40 \u00b0C"}, {"question": "q", "prompt": "p"}]
    raw = tmp_path / "raw.jsonl.gz"
    with gzip.open(raw, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    real = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda enc, stacklevel=2: "ascii" if enc is None else real(enc))
    assert read_raw_trajectories(raw) == rows
