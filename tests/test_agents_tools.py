"""Offline tools: the FTS5 index over the benchmark's Wikipedia paragraphs and the four tool actions."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lragent.agents.tools import (
    OBS_LOOKUP_FIRST,
    OBS_LOOKUP_RETRIEVE_FAILED,
    OBS_LOOKUP_SEARCH_FAILED,
    OBS_NO_IMAGE,
    OBS_NO_MORE_RESULTS,
    OBS_NO_RESULTS,
    OBS_NOT_FOUND,
    Passage,
    Toolbox,
    WikiIndex,
    fts_query,
    iter_hotpotqa_passages,
    normalize_title,
)

BENCH = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
HOTPOT_FILES = sorted(BENCH.glob("hotpotqa_*.dev.jsonl"))
TOOLS = ("Retrieve", "BingSearch", "Lookup", "Image2Text")


def _unique_passages() -> list[Passage]:
    seen: set[str] = set()
    out = []
    for f in HOTPOT_FILES:
        for p in iter_hotpotqa_passages(f):
            key = normalize_title(p.title)
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


@pytest.fixture(scope="module")
def index() -> WikiIndex:
    idx = WikiIndex.from_benchmarks(HOTPOT_FILES)
    yield idx
    idx.close()


def test_fts5_available_and_index_deduplicated(index: WikiIndex) -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(x)")  # raises if this sqlite3 has no FTS5
    passages = _unique_passages()
    assert len(HOTPOT_FILES) == 3
    assert len(index) == len(passages) > 800
    # every question's 10 paragraphs are in the index
    for f in HOTPOT_FILES:
        for line in f.read_text().splitlines():
            for title in json.loads(line)["context"]["title"]:
                assert index.get(title) is not None, title


def test_retrieve_exact_title_returns_paragraph(index: WikiIndex) -> None:
    tb = Toolbox(index)
    metallica = index.get("Metallica")
    assert metallica is not None
    assert tb("Retrieve", "Metallica") == metallica.text
    assert metallica.text.startswith("Metallica is an American heavy metal band")
    assert tb("Retrieve", "  metallica. ") == metallica.text  # case, spaces, final period
    assert tb("Retrieve", '"Metallica"') == metallica.text
    # a unique title without its disambiguation
    assert tb("Retrieve", "Hurt Locker").startswith("Hurt Locker The Musical is a fictional musical")


def test_retrieve_miss_lists_similar_titles(index: WikiIndex) -> None:
    tb = Toolbox(index)
    obs = tb("Retrieve", "Metallica discography 1983")
    prefix = "Could not find [Metallica discography 1983]. Similar: "
    assert obs.startswith(prefix)
    similar = ast.literal_eval(obs[len(prefix) :])
    assert isinstance(similar, list) and 1 <= len(similar) <= 5
    assert similar[0] == "Metallica"
    assert all(index.get(t) is not None for t in similar)
    assert tb("Lookup", "band") == OBS_LOOKUP_RETRIEVE_FAILED
    assert tb("Retrieve", "qqqzzzxxy") == OBS_NOT_FOUND


def test_bing_search_ranks_source_paragraph_first(index: WikiIndex) -> None:
    passages = _unique_passages()[::9]
    hits = sum(index.search(p.sentences[0], 1)[0].title == p.title for p in passages)
    assert hits >= 0.95 * len(passages)
    tb = Toolbox(index, top_k=3)
    obs = tb("BingSearch", "first governor of Maine after the Missouri Compromise")
    top = index.search("first governor of Maine after the Missouri Compromise", 3)
    assert len(top) == 3 and obs == "".join(p.text for p in top)
    assert tb("BingSearch", "!!! ???") == tb.search_error
    assert tb("Lookup", "x") == OBS_LOOKUP_SEARCH_FAILED


def test_lookup_walks_sentences(index: WikiIndex) -> None:
    tb = Toolbox(index)
    assert tb("Lookup", "band") == OBS_LOOKUP_FIRST
    tb("Retrieve", "Metallica")
    sentences = [s.strip() for s in index.get("Metallica").sentences if "hetfield" in s.lower()]
    assert len(sentences) == 2
    assert tb("Lookup", "Hetfield") == f"(Result 1/2) {sentences[0]}"
    assert tb("Lookup", "hetfield") == f"(Result 2/2) {sentences[1]}"
    assert tb("Lookup", "Hetfield") == OBS_NO_MORE_RESULTS
    assert tb("Lookup", "Hetfield ").startswith("(Result 1/2)") is False  # same keyword: still exhausted
    assert tb("Lookup", "saxophone") == OBS_NO_RESULTS
    assert tb("Lookup", "band").startswith("(Result 1/")  # a new keyword starts over
    # after a BingSearch, Lookup searches the sentences of all returned passages
    tb("BingSearch", "Maine gubernatorial election 1820")
    assert tb("Lookup", "governor").startswith("(Result 1/")


def test_image2text_uses_question_caption_and_ocr() -> None:
    rows = [json.loads(x) for x in (BENCH / "scienceqa_grade1_4.dev.jsonl").read_text().splitlines()]
    boston = next(r for r in rows if r["pid"] == "8931")
    idx = WikiIndex.build([Passage("X", ("x.",))])
    tb = Toolbox(idx, caption=boston["caption"], ocr=boston["ocr"])
    obs = tb("Image2Text", "image")
    assert obs.startswith(f"Image caption: {boston['caption']} OCR result: Average precipitation in Boston")
    assert "[[" not in obs  # boxes and confidences dropped, words kept comma-joined
    no_img = next(r for r in rows if r["caption"] == "no img")
    assert Toolbox(idx, caption=no_img["caption"], ocr=no_img["ocr"])("Image2Text", "x") == OBS_NO_IMAGE
    assert Toolbox(idx, caption="A red wall.", ocr="[]")("Image2Text", "") == "Image caption: A red wall. OCR result:"


def test_extra_corpus_and_first_title_wins(tmp_path: Path) -> None:
    corpus = tmp_path / "extra.jsonl"
    rows = [
        {"title": "Photosynthesis", "text": "Photosynthesis makes sugar. It needs light! Chlorophyll absorbs it."},
        {"title": "Metallica", "text": "A replacement that must not win."},
    ]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    idx = WikiIndex.from_benchmarks(HOTPOT_FILES, extra_corpus=[corpus])
    assert len(idx) == len(_unique_passages()) + 1
    tb = Toolbox(idx)
    assert tb("Retrieve", "photosynthesis") == rows[0]["text"]
    assert tb("Lookup", "light") == "(Result 1/1) It needs light!"
    assert tb("Retrieve", "Metallica").startswith("Metallica is an American")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "x"}\n')
    with pytest.raises(ValueError, match="title"):
        WikiIndex.from_benchmarks([], extra_corpus=[bad])


def test_query_connection_is_read_only(index: WikiIndex, tmp_path: Path) -> None:
    with pytest.raises(sqlite3.OperationalError):
        index._conn.execute("DELETE FROM docs")
    path = tmp_path / "wiki.sqlite"
    on_disk = WikiIndex.from_benchmarks(HOTPOT_FILES, db_path=path)
    with pytest.raises(sqlite3.OperationalError):
        on_disk._conn.execute("INSERT INTO docs_fts (title, text) VALUES ('x', 'y')")
    assert on_disk.fingerprint() == index.fingerprint()
    reopened = WikiIndex.open(path)
    assert reopened.fingerprint() == index.fingerprint()
    with pytest.raises(ValueError, match="exists"):
        WikiIndex.from_benchmarks(HOTPOT_FILES, db_path=path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Metallica", '"metallica"'),
        ('a NEAR(b c) AND "d', '"a" OR "near" OR "b" OR "c" OR "and" OR "d"'),
        ("title:foo* ^bar", '"title" OR "foo" OR "bar"'),
        ("!!! ---", None),
        ("x_y", '"x y"'),
    ],
)
def test_fts_query_is_quoted_words(text: str, expected: str | None) -> None:
    assert fts_query(text) == expected


HOSTILE = [
    "",
    " ",
    '"',
    '""',
    "'",
    "*",
    "^",
    ":",
    "-",
    "NEAR",
    "NEAR(a b, 2)",
    "a AND b OR NOT c",
    "title:Metallica",
    "{title text}: x",
    "text : (a OR b)",
    "Metal*",
    '"unterminated',
    "a) OR (b",
    "'); DROP TABLE docs; --",
    "1; DELETE FROM docs_fts WHERE 1=1",
    "x' OR '1'='1",
    "\x00",
    "Metal\x00lica",
    "\x00" * 1000,
    "\ud800",
    "abc\udfffdef",
    "\u202e\u200b\ufeff",
    "Ǆ ǅ ǆ ﬁ Å Å",
    "日本語 テスト",
    "🙂" * 500,
    "a" * 100_000,
    "word " * 20_000,
    "[" * 5000 + "]" * 5000,
    "\n\r\t\x0b\x0c",
    "Retrieve[Metallica]",
    "%s %d {} {0}",
    "\\",
    "rank MATCH 'x'",
    "docs_fts",
    "bm25(docs_fts)",
    "SELECT * FROM sqlite_master",
    "ATTACH DATABASE '/tmp/x' AS y",
]

FTS_SOUP = st.lists(
    st.sampled_from(
        [
            "NEAR",
            "AND",
            "OR",
            "NOT",
            "*",
            '"',
            "(",
            ")",
            ":",
            "^",
            "{",
            "}",
            "title",
            "text",
            "-",
            "+",
            "'",
            ";",
            "DROP",
            "TABLE",
            "docs",
            "\x00",
            "Metallica",
            "Maine",
            "é",
            "\ud800",
            ",",
            "0",
            "rowid",
            "MATCH",
            "\n",
        ]
    ),
    max_size=30,
).map(" ".join)


class _Guard:
    """Runs every tool on an argument and checks the observation and the index."""

    def __init__(self, index: WikiIndex) -> None:
        self.index = index
        self.toolbox = Toolbox(index, caption="A chart.", ocr="[([[0, 0]], 'word', 0.9)]")
        self.fingerprint = index.fingerprint()
        self.rows = len(index)
        self.changes = index._conn.total_changes
        self.calls = 0

    def check(self, arg: object) -> None:
        for tool in TOOLS:
            obs = self.toolbox(tool, arg)
            self.calls += 1
            assert isinstance(obs, str) and obs
            assert "\n" not in obs and "\x00" not in obs
            assert len(obs) <= self.toolbox.max_observation_chars
            obs.encode("utf-8")  # valid text, no lone surrogates

    def assert_unchanged(self) -> None:
        assert self.index.query_errors == 0
        assert self.index._conn.total_changes == self.changes
        assert len(self.index) == self.rows
        assert self.index.fingerprint() == self.fingerprint


@pytest.fixture(scope="module")
def guard(index: WikiIndex) -> _Guard:
    return _Guard(index)


def test_hostile_arguments(guard: _Guard) -> None:
    for arg in HOSTILE + [None, 42, b"\x00bytes", ["list"], {"d": 1}]:
        guard.check(arg)
    guard.assert_unchanged()


def test_random_arguments(guard: _Guard) -> None:
    rng = random.Random(1234)
    alphabet = list("abcXYZ019 \"*:^(){}[]-+'\\;,.\x00\n\t") + ["NEAR", "AND", "OR", "é", "\ud800", "🙂", "title"]
    for _ in range(1500):
        guard.check("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))))
    guard.assert_unchanged()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arg=st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=200) | FTS_SOUP)
def test_hypothesis_arguments(guard: _Guard, arg: str) -> None:
    guard.check(arg)
    # cheap invariants per example; the full fingerprint is compared once, in the next test
    assert guard.index.query_errors == 0
    assert guard.index._conn.total_changes == guard.changes


def test_index_unchanged_after_all_fuzzing(guard: _Guard) -> None:
    for arg in HOSTILE:  # also when run alone
        guard.check(arg)
    guard.assert_unchanged()


def test_database_file_bytes_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "wiki.sqlite"
    idx = WikiIndex.from_benchmarks(HOTPOT_FILES, db_path=path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    g = _Guard(idx)
    for arg in HOSTILE:
        g.check(arg)
    g.assert_unchanged()
    idx.close()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
