"""Properties of the agents' offline tools: the Toolbox state across sequences of actions.

Pinned here: the Lookup cursor (advances on the same keyword, restarts on a new one, resets on every new
Retrieve/BingSearch, refuses before any search or after a failed one), the exact observation strings the model
sees, every length budget at exactly its limit (argument, echo, query tokens, token chars, observation chars),
title matching under case / width / whitespace / wrapping variants, and the index's build / open / query rules.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.agents import tools
from lragent.agents.tools import (
    MAX_ARGUMENT_CHARS,
    MAX_ECHO_CHARS,
    MAX_QUERY_TOKENS,
    MAX_TOKEN_CHARS,
    OBS_LOOKUP_FIRST,
    OBS_LOOKUP_RETRIEVE_FAILED,
    OBS_LOOKUP_SEARCH_FAILED,
    OBS_NO_IMAGE,
    OBS_NO_MORE_RESULTS,
    OBS_NO_RESULTS,
    OBS_NOT_FOUND,
    OBS_SEARCH_ERROR,
    Passage,
    Toolbox,
    WikiIndex,
    clean_argument,
    fts_query,
    iter_corpus_passages,
    iter_hotpotqa_passages,
    normalize_title,
    ocr_text,
    query_tokens,
    split_sentences,
)

ALPHA = Passage(
    "Alpha Band",
    (
        "Alpha Band is a rock band.",
        " The band formed in 1990.",
        "   ",
        " Its singer left the   band in 2001!",
        " Alpha is Greek?",
    ),
)
BETA = Passage("Beta (film)", ("Beta is a film.", " It stars the Alpha Band."))
GAMMA_ALBUM = Passage("Gamma (album)", ("Gamma is an album by Omega.",))
GAMMA_SONG = Passage("Gamma (song)", ("Gamma is a song by Omega.",))
DOT = Passage("St.", ("St. is an abbreviation.",))
NODOT = Passage("St", ("St is a street.",))
CORPUS = [ALPHA, BETA, GAMMA_ALBUM, GAMMA_SONG, DOT, NODOT]


@pytest.fixture(scope="module")
def index() -> WikiIndex:
    idx = WikiIndex.build(CORPUS)
    yield idx
    idx.close()


def _many(n: int, word: str = "kappa") -> list[Passage]:
    return [Passage(f"Doc{i}", (f"{word} number {i}.",)) for i in range(n)]


# ----------------------------------------------------------------------------- observation strings and defaults
def test_observation_strings_are_the_training_data_strings() -> None:
    assert OBS_NOT_FOUND == "Could not find that page, please try again."
    assert OBS_NO_RESULTS == "No Results"
    assert OBS_NO_MORE_RESULTS == "No More Results"
    assert OBS_LOOKUP_RETRIEVE_FAILED == (
        "The last page Retrieved was not found, so you cannot Lookup a keyword in it. "
        "Please try one of the similar pages given."
    )
    assert OBS_LOOKUP_SEARCH_FAILED == (
        "The last page Searched was not found, so you cannot Lookup a keyword in it. "
        "Please try one of the similar pages given."
    )
    assert OBS_LOOKUP_FIRST == "Invalid action. Lookup only follows the Retrieve or BingSearch action."
    assert OBS_NO_IMAGE == "This question doesn't have an image."
    assert OBS_SEARCH_ERROR == "BingSearch error, please try again."


def test_documented_limits_and_toolbox_defaults(index: WikiIndex) -> None:
    assert (MAX_ARGUMENT_CHARS, MAX_ECHO_CHARS, MAX_QUERY_TOKENS, MAX_TOKEN_CHARS) == (2000, 200, 32, 64)
    tb = Toolbox(index)
    assert (tb.top_k, tb.caption, tb.ocr, tb.search_error, tb.max_observation_chars) == (
        3,
        None,
        None,
        OBS_SEARCH_ERROR,
        4000,
    )
    assert tb("Image2Text", "x") == OBS_NO_IMAGE


def test_default_top_k_and_similar_k_cut_results() -> None:
    idx = WikiIndex.build(_many(8))
    assert len(idx.search("kappa")) == 3
    assert len(idx.search("kappa", 1)) == 1
    assert idx.search("kappa", 0) == [] and idx.search("kappa", -1) == []
    assert len(idx.similar_titles("kappa")) == 5
    assert len(idx.similar_titles("kappa", 1)) == 1
    assert idx.similar_titles("kappa", 0) == [] and idx.similar_titles("kappa", -2) == []
    tb = Toolbox(idx)
    assert tb("BingSearch", "kappa") == "".join(p.text for p in idx.search("kappa", 3))
    assert tb("Lookup", "kappa").startswith("(Result 1/3) ")


def test_toolbox_rejects_bad_budgets_at_the_boundary(index: WikiIndex) -> None:
    with pytest.raises(ValueError, match=r"^top_k must be >= 1, got 0$"):
        Toolbox(index, top_k=0)
    with pytest.raises(ValueError, match=r"^max_observation_chars must be >= 100, got 99$"):
        Toolbox(index, max_observation_chars=99)
    assert Toolbox(index, top_k=1, max_observation_chars=100).top_k == 1


def test_unknown_tool_is_named_and_echo_is_cut(index: WikiIndex) -> None:
    tb = Toolbox(index)
    assert tb("Search", "Alpha Band") == "Unknown tool Search."
    assert tb("Finish", "x") == "Unknown tool Finish."
    long = "Z" * (MAX_ECHO_CHARS + 50)
    assert tb(long, "x") == f"Unknown tool {'Z' * MAX_ECHO_CHARS}."
    assert tb("Lookup", "band") == OBS_LOOKUP_FIRST  # an unknown tool starts no search


# ----------------------------------------------------------------------------- the Lookup cursor across sequences
def test_lookup_before_any_search_is_refused_and_changes_nothing(index: WikiIndex) -> None:
    tb = Toolbox(index)
    assert tb("Lookup", "band") == OBS_LOOKUP_FIRST
    assert tb("Lookup", "band") == OBS_LOOKUP_FIRST
    assert tb("Image2Text", "") == OBS_NO_IMAGE
    assert tb("Lookup", "band") == OBS_LOOKUP_FIRST
    tb("Retrieve", "Alpha Band")
    assert tb("Lookup", "band") == "(Result 1/3) Alpha Band is a rock band."  # cursor starts at 1, not 2


def test_lookup_cursor_walks_all_hits_then_stays_exhausted(index: WikiIndex) -> None:
    tb = Toolbox(index)
    assert tb("Retrieve", "Alpha Band") == (
        "Alpha Band is a rock band. The band formed in 1990. Its singer left the band in 2001! Alpha is Greek?"
    )
    assert tb("Lookup", "band") == "(Result 1/3) Alpha Band is a rock band."
    assert tb("Lookup", "Band") == "(Result 2/3) The band formed in 1990."  # case-insensitive: same keyword
    assert tb("Lookup", ' "band". ') == "(Result 3/3) Its singer left the band in 2001!"  # wrapping dropped
    assert tb("Lookup", "band") == OBS_NO_MORE_RESULTS
    assert tb("Lookup", "band") == OBS_NO_MORE_RESULTS


def test_new_keyword_restarts_and_old_keyword_restarts_too(index: WikiIndex) -> None:
    tb = Toolbox(index)
    tb("Retrieve", "Alpha Band")
    assert tb("Lookup", "band").startswith("(Result 1/3) ")
    assert tb("Lookup", "band").startswith("(Result 2/3) ")
    assert tb("Lookup", "alpha") == "(Result 1/2) Alpha Band is a rock band."  # match at the very start
    assert tb("Lookup", "alpha") == "(Result 2/2) Alpha is Greek?"
    assert tb("Lookup", "band") == "(Result 1/3) Alpha Band is a rock band."
    assert tb("Lookup", "greek?") == "(Result 1/1) Alpha is Greek?"  # match at the very end
    assert tb("Lookup", "saxophone") == OBS_NO_RESULTS
    assert tb("Lookup", "saxophone") == OBS_NO_RESULTS


def test_new_search_resets_the_cursor_even_for_the_same_entity(index: WikiIndex) -> None:
    tb = Toolbox(index)
    first = tb("Retrieve", "Alpha Band")
    tb("Lookup", "band")
    tb("Lookup", "band")
    assert tb("Retrieve", "alpha band") == first  # repeated search of the same entity: same page
    assert tb("Lookup", "band").startswith("(Result 1/3) ")
    tb("Lookup", "band")
    tb("BingSearch", "Beta film")
    obs = tb("Lookup", "band")
    assert obs.startswith("(Result 1/") and obs != OBS_NO_MORE_RESULTS


def test_empty_or_wrapping_only_keyword_finds_nothing(index: WikiIndex) -> None:
    tb = Toolbox(index)
    tb("Retrieve", "Alpha Band")
    assert tb("Lookup", "") == OBS_NO_RESULTS
    assert tb("Lookup", ' "" ') == OBS_NO_RESULTS
    assert tb("Lookup", "[]") == OBS_NO_RESULTS
    assert tb("Lookup", "band").startswith("(Result 1/3) ")


def test_failed_retrieve_and_failed_search_refuse_lookup_with_their_own_message(index: WikiIndex) -> None:
    tb = Toolbox(index)
    tb("Retrieve", "Alpha Band")
    assert tb("Retrieve", "qqqzzz") == OBS_NOT_FOUND
    assert tb("Lookup", "band") == OBS_LOOKUP_RETRIEVE_FAILED
    assert tb("BingSearch", "qqqzzz") == OBS_SEARCH_ERROR
    assert tb("Lookup", "band") == OBS_LOOKUP_SEARCH_FAILED
    assert tb("Retrieve", "Omega").startswith("Could not find [Omega]. Similar: ")
    assert tb("Lookup", "band") == OBS_LOOKUP_RETRIEVE_FAILED
    assert tb("BingSearch", "Alpha Band") != OBS_SEARCH_ERROR
    assert tb("Lookup", "band").startswith("(Result 1/")


def test_bing_search_lookup_spans_every_returned_passage_in_rank_order() -> None:
    idx = WikiIndex.build(_many(4, "lambda"))
    tb = Toolbox(idx, top_k=2)
    obs = tb("BingSearch", "lambda")
    ranked = idx.search("lambda", 2)
    assert obs == ranked[0].text + ranked[1].text  # concatenated without a separator, like the Bing snippets
    assert tb("Lookup", "lambda") == f"(Result 1/2) {ranked[0].text}"
    assert tb("Lookup", "lambda") == f"(Result 2/2) {ranked[1].text}"
    assert tb("Lookup", "lambda") == OBS_NO_MORE_RESULTS


def test_custom_search_error_is_the_miss_observation(index: WikiIndex) -> None:
    tb = Toolbox(index, search_error="No results found.")
    assert tb("BingSearch", "!!!") == "No results found."
    assert tb("Lookup", "x") == OBS_LOOKUP_SEARCH_FAILED


@settings(max_examples=12)
@given(n=st.integers(1, 6), extra=st.integers(0, 3))
def test_lookup_counts_one_to_n_then_no_more(n: int, extra: int) -> None:
    sentences = tuple(f" Mu item {i}." for i in range(n)) + (" Nothing here.",)
    idx = WikiIndex.build([Passage("Mu", sentences)])
    tb = Toolbox(idx)
    tb("Retrieve", "Mu")
    got = [tb("Lookup", "mu item") for _ in range(n + extra + 1)]
    assert got[:n] == [f"(Result {i + 1}/{n}) Mu item {i}." for i in range(n)]
    assert got[n:] == [OBS_NO_MORE_RESULTS] * (extra + 1)


# ----------------------------------------------------------------------------- Retrieve
def test_retrieve_matches_case_width_whitespace_and_wrapping(index: WikiIndex) -> None:
    tb = Toolbox(index)
    text = "Alpha Band is a rock band. The band formed in 1990. Its singer left the band in 2001! Alpha is Greek?"
    for arg in (
        "Alpha Band",
        "ALPHA   band",
        "alpha_band",
        "Ａｌｐｈａ Ｂａｎｄ",
        ' "Alpha Band". ',
        "[Alpha Band]",
        "`Alpha Band`",
        "'Alpha Band'",
        "Alpha Band...",
        '"Alpha Band" .',
        "Alpha\x00Band",
    ):
        assert tb("Retrieve", arg) == text, arg


def test_exact_title_beats_title_without_final_period(index: WikiIndex) -> None:
    assert index.get("St.") == DOT
    assert index.get("st.") == DOT
    assert index.get("St") == NODOT
    assert index.get('"St"') == NODOT


def test_disambiguation_dropped_only_when_unique(index: WikiIndex) -> None:
    assert index.get("Beta") == BETA
    assert index.get("beta (FILM)") == BETA
    assert index.get("Gamma") is None  # two titles share the base: ambiguous
    assert index.get("Gamma (song)") == GAMMA_SONG
    assert index.get("") is None and index.get('".') is None and index.get(None) is None


def test_retrieve_miss_echoes_the_cleaned_argument_cut_to_the_echo_limit(index: WikiIndex) -> None:
    tb = Toolbox(index)
    similar = "Similar: ['Gamma (album)', 'Gamma (song)']"
    assert tb("Retrieve", "Omega  record") == f"Could not find [Omega record]. {similar}"
    long = "omega " + "q" * 400
    obs = tb("Retrieve", long)
    assert obs == f"Could not find [{long[:MAX_ECHO_CHARS]}]. Similar: ['Gamma (album)', 'Gamma (song)']"
    assert tb("Retrieve", "zzzz qqqq") == OBS_NOT_FOUND


def test_similar_titles_puts_title_hits_before_text_hits_without_duplicates(index: WikiIndex) -> None:
    assert index.similar_titles("alpha") == ["Alpha Band", "Beta (film)"]
    assert index.similar_titles("alpha", 1) == ["Alpha Band"]
    assert index.similar_titles("beta alpha") == ["Beta (film)", "Alpha Band"]
    assert index.similar_titles("omega") == ["Gamma (album)", "Gamma (song)"]
    assert index.similar_titles("!!!") == []
    assert index.query_errors == 0


def test_search_weighs_title_hits_over_text_hits() -> None:
    idx = WikiIndex.build(
        [
            Passage("Other", ("Zeta appears here in the text of a long paragraph about other things.",)),
            Passage("Zeta", ("A short one.",)),
        ]
    )
    assert [p.title for p in idx.search("zeta", 2)] == ["Zeta", "Other"]
    assert idx.search("!!! ???") == []


# ----------------------------------------------------------------------------- observation length budget
@pytest.mark.parametrize("length", [99, 100, 101, 150])
def test_observation_cut_exactly_at_the_limit(length: int) -> None:
    body = "w" * (length - 1) + "."
    idx = WikiIndex.build([Passage("Long", (body,))])
    tb = Toolbox(idx, max_observation_chars=100)
    obs = tb("Retrieve", "Long")
    if length <= 100:
        assert obs == body
    else:
        assert obs == "w" * 97 + "..."
        assert len(obs) == 100


def test_observation_cut_drops_trailing_space_before_ellipsis() -> None:
    body = "w" * 96 + " " + "v" * 20
    idx = WikiIndex.build([Passage("Long", (body,))])
    tb = Toolbox(idx, max_observation_chars=100)
    assert tb("Retrieve", "Long") == "w" * 96 + "..."


def test_observation_whitespace_collapsed_in_lookup(index: WikiIndex) -> None:
    idx = WikiIndex.build([Passage("Ws", ("A  b\tc\n d.",))])
    tb = Toolbox(idx)
    tb("Retrieve", "Ws")
    assert tb("Lookup", "b") == "(Result 1/1) A b c d."


# ----------------------------------------------------------------------------- Image2Text
def test_image2text_needs_both_caption_and_ocr(index: WikiIndex) -> None:
    assert Toolbox(index, caption="A map.", ocr=None)("Image2Text", "") == OBS_NO_IMAGE
    assert Toolbox(index, caption="A map.", ocr="no img")("Image2Text", "") == OBS_NO_IMAGE
    assert Toolbox(index, caption=None, ocr="[]")("Image2Text", "") == OBS_NO_IMAGE
    assert Toolbox(index, caption="no img", ocr="[]")("Image2Text", "") == OBS_NO_IMAGE
    assert Toolbox(index, caption="A map.", ocr="")("Image2Text", "") == "Image caption: A map. OCR result:"
    assert Toolbox(index, caption="A map.", ocr="[]").image2text() == "Image caption: A map. OCR result:"


def test_image2text_is_computed_once_and_ignores_argument(index: WikiIndex) -> None:
    ocr = "[([[0, 0], [1, 1]], 'Boston', 0.9), ([[2, 2]], 'rain', 0.5)]"
    tb = Toolbox(index, caption="A  chart.", ocr=ocr)
    first = tb("Image2Text", "anything")
    assert first == "Image caption: A chart. OCR result: Boston,rain"
    tb.caption = "changed"
    tb.ocr = "[]"
    assert tb("Image2Text", "other") == first
    tb("Retrieve", "Alpha Band")
    assert tb("Lookup", "band").startswith("(Result 1/3)")  # Image2Text leaves the Lookup state alone


def test_image2text_cut_to_observation_limit(index: WikiIndex) -> None:
    tb = Toolbox(index, caption="c" * 200, ocr="[]", max_observation_chars=100)
    assert tb("Image2Text", "") == ("Image caption: " + "c" * 200)[:97] + "..."


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("[([[0, 0]], 'Hi', 0.9), ([[1, 1]], 'There', 0.8)]", "Hi,There"),
        ("[('a',), ('b', 'c')]", "c"),
        ("[1, 'ab', ([0], 'w'), [[0], 7]]", "w,7"),
        ("[]", ""),
        ("(1, 2)", "(1, 2)"),
        ("{'a': 1}", "{'a': 1}"),
        ("[", "["),
        ("not a list", "not a list"),
        ("", ""),
        ("[" * 5000 + "]" * 5000, "[" * 5000 + "]" * 5000),
    ],
)
def test_ocr_text_keeps_words_or_returns_raw(raw: str, words: str) -> None:
    assert ocr_text(raw) == words


# ----------------------------------------------------------------------------- argument cleaning and query building
def test_clean_argument_limits_and_characters() -> None:
    assert clean_argument("a" * 5000) == "a" * MAX_ARGUMENT_CHARS
    assert clean_argument("a" * 10, 4) == "aaaa"
    assert clean_argument("a" * 4, 4) == "aaaa"
    assert clean_argument(12) == "12" and clean_argument(None) == "None"
    assert clean_argument("a\x00b\x08c\x0bd\x1fe\x7ff\x0eg") == "a b c d e f g"
    assert clean_argument("  x \n\t y  ") == "x y"
    assert clean_argument("a\ud800b") == "a?b"
    # only the first 4 * max_chars characters are read before whitespace is collapsed
    assert clean_argument("a" + " " * 40 + "b", 10) == "a"
    assert clean_argument("a" + " " * 38 + "b", 10) == "a b"


def test_clean_argument_keeps_a_str_subclass_text() -> None:
    class Shouting(str):
        def __str__(self) -> str:
            return "OTHER"

    assert clean_argument(Shouting("x  y")) == "x y"


def test_readers_decode_utf8_whatever_the_locale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    def latin1_locale_open(path, mode="r", encoding=None, **kw):  # noqa: ANN001, ANN003, ANN202
        return builtins.open(path, mode, encoding=encoding or "latin-1", **kw)

    monkeypatch.setattr(tools, "open", latin1_locale_open, raising=False)
    hot = tmp_path / "h.jsonl"
    hot.write_text(
        json.dumps({"context": {"title": ["Café"], "sentences": [["Crème."]]}}, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    assert list(iter_hotpotqa_passages(hot)) == [Passage("Café", ("Crème.",))]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"title": "Café", "text": "Crème."}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert list(iter_corpus_passages(corpus)) == [Passage("Café", ("Crème.",))]


def test_query_tokens_distinct_lowercase_and_capped() -> None:
    assert query_tokens("The the THE cat") == ["the", "cat"]
    assert query_tokens("x_y _z __") == ["x y", "z"]
    words = [f"w{i}" for i in range(40)]
    assert query_tokens(" ".join(words)) == words[:MAX_QUERY_TOKENS]
    assert query_tokens(" ".join(words[:MAX_QUERY_TOKENS])) == words[:MAX_QUERY_TOKENS]
    assert query_tokens("a" * 100) == ["a" * MAX_TOKEN_CHARS]
    assert query_tokens("a" * MAX_TOKEN_CHARS) == ["a" * MAX_TOKEN_CHARS]
    assert fts_query("Foo bar") == '"foo" OR "bar"'
    assert fts_query("") is None


def test_base_title_and_wrapping_helpers() -> None:
    assert tools._base_title("gamma (album)") == "gamma"
    assert tools._base_title(" x (y) ") == "x (y)"
    assert tools._base_title("a (b) c") == "a (b) c"
    assert tools._base_title("(intro)") == ""
    assert tools._strip_wrapping(" x. ") == "x"
    assert tools._strip_wrapping(' "x" . ') == "x"
    assert tools._strip_wrapping("[`'x'`]..") == "x"
    assert tools._strip_wrapping("BOX") == "BOX"  # only dots, quotes and brackets are dropped


def test_normalize_title_and_split_sentences() -> None:
    assert normalize_title("  Ｓtraße_of\t the  NORTH ") == "strasse of the north"
    assert split_sentences("One. Two! Three? Four.Five") == ["One.", " Two!", " Three?", " Four.Five"]
    assert split_sentences("") == []
    assert Passage("T", (" a  b.", " c.")).text == "a b. c."


# ----------------------------------------------------------------------------- index building and opening
def test_build_skips_empty_titles_and_keeps_the_first_duplicate() -> None:
    idx = WikiIndex.build(
        [
            Passage("  _ ", ("dropped.",)),
            Passage("Eta", ("first eta.",)),
            Passage("ETA", ("second eta with zebra.",)),
            Passage("Theta", ("café θ.",)),
        ]
    )
    assert len(idx) == 2
    assert idx.get("eta").sentences == ("first eta.",)
    assert idx.search("zebra") == [] and idx.search("dropped") == []
    stored = [r[0] for r in idx._conn.execute("SELECT sentences FROM docs ORDER BY id")]
    assert stored == [json.dumps(["first eta."]), '["café θ."]']  # UTF-8 JSON, not \\u escapes
    with pytest.raises(sqlite3.OperationalError):
        idx._conn.execute("DELETE FROM docs")


def test_build_refuses_old_sqlite_and_missing_fts5(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 9, 0))
    assert len(WikiIndex.build([ALPHA])) == 1
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 8, 11))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.8.11")
    with pytest.raises(RuntimeError, match=r"^SQLite 3\.8\.11 has no FTS5; 3\.9 or newer is needed$"):
        WikiIndex.build([ALPHA])
    monkeypatch.undo()
    monkeypatch.setattr(tools, "_SCHEMA", "CREATE VIRTUAL TABLE t USING nosuchmodule(x);")
    with pytest.raises(RuntimeError, match=r"^this sqlite3 build has no FTS5 \(no such module: nosuchmodule\)$"):
        WikiIndex.build([ALPHA])


def test_file_index_round_trips_and_refuses_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "w.sqlite"
    built = WikiIndex.build(CORPUS, db_path=path)
    mem = WikiIndex.build(CORPUS)
    assert built.fingerprint() == mem.fingerprint() == WikiIndex.open(path).fingerprint()
    assert len(built) == len(CORPUS)
    assert built.get("Alpha Band") == ALPHA
    with pytest.raises(sqlite3.OperationalError):
        built._conn.execute("DELETE FROM docs")
    with pytest.raises(ValueError, match=r"exists already; open it with WikiIndex\.open$"):
        WikiIndex.build(CORPUS, db_path=path)
    with pytest.raises(ValueError, match=r"^no index file at "):
        WikiIndex.open(tmp_path / "missing.sqlite")
    assert WikiIndex.build(CORPUS[::-1]).fingerprint() != mem.fingerprint()
    assert WikiIndex.build(CORPUS[:-1]).fingerprint() != mem.fingerprint()


def test_query_errors_are_counted_and_answered_as_nothing() -> None:
    idx = WikiIndex.build([ALPHA])
    assert idx.query_errors == 0
    assert idx.get("Alpha Band") == ALPHA and idx.query_errors == 0
    idx.close()
    assert idx.get("Alpha Band") is None
    assert idx.query_errors == 2  # the exact-title query and the disambiguation fallback
    assert idx.search("alpha") == []
    assert idx.query_errors == 3
    assert idx.similar_titles("alpha") == []
    assert idx.query_errors == 5  # the title-only query and the full-text one


def test_passage_readers(tmp_path: Path) -> None:
    hot = tmp_path / "h.jsonl"
    row = {"context": {"title": ["A", "B"], "sentences": [["a1.", " a2."], ["b1."]]}}
    hot.write_text(json.dumps(row) + "\n\n" + json.dumps(row) + "\n")
    assert list(iter_hotpotqa_passages(hot)) == [Passage("A", ("a1.", " a2.")), Passage("B", ("b1.",))] * 2
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        json.dumps({"title": "T", "text": "One. Two!"})
        + "\n   \n"
        + json.dumps({"title": 5, "sentences": ["x", 3]})
        + "\n"
    )
    assert list(iter_corpus_passages(corpus)) == [Passage("T", ("One.", " Two!")), Passage("5", ("x", "3"))]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"title": "T"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected an object with 'title' and 'text', got '\{"):
        list(iter_corpus_passages(bad))
    bad.write_text("\n" + json.dumps(["title", "text"]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: "):
        list(iter_corpus_passages(bad))
    long = json.dumps({"name": "n" * 200})
    bad.write_text(long + "\n")
    with pytest.raises(ValueError) as err:
        list(iter_corpus_passages(bad))
    assert str(err.value) == f"{bad}:1: expected an object with 'title' and 'text', got {long[:80]!r}"
    uneven = tmp_path / "u.jsonl"
    uneven.write_text(json.dumps({"context": {"title": ["A", "B"], "sentences": [["a."]]}}) + "\n")
    with pytest.raises(ValueError):
        list(iter_hotpotqa_passages(uneven))
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="expected an object"):
        list(iter_corpus_passages(bad))
    idx = WikiIndex.from_benchmarks([hot], extra_corpus=[corpus])
    assert len(idx) == 4 and idx.get("5").sentences == ("x", "3")
