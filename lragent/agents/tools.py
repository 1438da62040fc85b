"""Offline tools of the AutoAct agents: a local full-text "Wikipedia" and the ScienceQA image text.

:class:`WikiIndex` is a SQLite FTS5 index (stdlib ``sqlite3``, BM25 ranking) over the Wikipedia
paragraphs that come with the HotpotQA benchmark questions (all 10 context paragraphs of every
question, deduplicated by title) plus any extra ``{"title", "text"}`` JSONL corpus. :class:`Toolbox`
holds one episode's tool state (the last passage found, the Lookup cursor) and turns each tool call
into an observation string:

* ``Retrieve[entity]``: the paragraph whose title matches, else ``Could not find [entity]. Similar: [...]``;
* ``BingSearch[query]``: the top-k BM25 passages, concatenated as the Bing snippets of the training data were;
* ``Lookup[keyword]``: ``(Result i/n) sentence``, the next sentence with the keyword in the last passage(s);
* ``Image2Text[...]``: ``Image caption: ... OCR result: ...`` of the current ScienceQA question.

The strings follow the AutoAct/LRAgent trajectory-synthesis code that produced the training
trajectories (``Self_Plan/Traj_Syn/benchmark_run/agent_arch.py``) and LangChain's ``DocstoreExplorer``
(``Could not find [x]. Similar: [...]``, ``No Results``, ``No More Results``).

**Untrusted arguments.** Tool arguments come from a model. Every public method takes any object and
returns a string; nothing it is given can raise or change the index: the query connection is read-only
(``mode=ro`` for a file, ``PRAGMA query_only`` for an in-memory index), every SQL statement is
parameterised, and the FTS5 ``MATCH`` expression is rebuilt from ``\\w+`` word tokens, each one a quoted
string joined by ``OR`` (so ``NEAR``, ``AND``, ``*``, ``^``, column filters and quotes in the argument are
plain words). Arguments are cleaned first (NUL and control characters dropped, lone surrogates replaced,
length capped).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sqlite3
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_ARGUMENT_CHARS = 2000
"""Arguments longer than this are cut before they are searched for."""

MAX_ECHO_CHARS = 200
"""At most this much of an argument is echoed back in an observation."""

MAX_QUERY_TOKENS = 32
"""At most this many distinct word tokens of a query go into the FTS5 expression."""

MAX_TOKEN_CHARS = 64

# Observation strings (AutoAct/LRAgent trajectory synthesis code and LangChain DocstoreExplorer).
OBS_NOT_FOUND = "Could not find that page, please try again."
OBS_NO_RESULTS = "No Results"
OBS_NO_MORE_RESULTS = "No More Results"
OBS_LOOKUP_RETRIEVE_FAILED = (
    "The last page Retrieved was not found, so you cannot Lookup a keyword in it. "
    "Please try one of the similar pages given."
)
OBS_LOOKUP_SEARCH_FAILED = (
    "The last page Searched was not found, so you cannot Lookup a keyword in it. "
    "Please try one of the similar pages given."
)
OBS_LOOKUP_FIRST = "Invalid action. Lookup only follows the Retrieve or BingSearch action."
OBS_NO_IMAGE = "This question doesn't have an image."
OBS_SEARCH_ERROR = "BingSearch error, please try again."

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)")


def clean_argument(arg: object, max_chars: int = MAX_ARGUMENT_CHARS) -> str:
    """Turns any tool argument into a safe, single-line string.

    Args:
        arg: what the model produced (normally a string; anything else is ``str()``-ed).
        max_chars: the result is cut to this many characters.

    Returns:
        The argument with lone surrogates replaced, control characters (NUL included) dropped,
        whitespace runs collapsed to one space and outer whitespace stripped.
    """
    text = arg if isinstance(arg, str) else str(arg)
    text = text[: max_chars * 4]
    text = text.encode("utf-8", "replace").decode("utf-8")
    text = _CONTROL.sub(" ", text)
    text = _SPACE.sub(" ", text).strip()
    return text[:max_chars]


def query_tokens(text: str) -> list[str]:
    """Returns the distinct lower-case word tokens of ``text`` (at most :data:`MAX_QUERY_TOKENS`)."""
    seen: dict[str, None] = {}
    for tok in _WORD.findall(text.lower()):
        tok = tok.replace("_", " ").strip()[:MAX_TOKEN_CHARS]
        if tok and tok not in seen:
            seen[tok] = None
            if len(seen) >= MAX_QUERY_TOKENS:
                break
    return list(seen)


def fts_query(text: str) -> str | None:
    """Builds a safe FTS5 ``MATCH`` expression: every word token quoted, joined by ``OR``.

    Tokens only hold word characters and spaces, so no token can close its quotes; FTS5 operators
    (``AND``, ``NEAR``, ``*``, ``:``) inside an argument are searched for as plain words.

    Returns:
        The expression, or None when ``text`` has no word token.
    """
    tokens = query_tokens(text)
    if not tokens:
        return None
    return " OR ".join(f'"{tok}"' for tok in tokens)


def normalize_title(title: str) -> str:
    """Key under which titles are matched: NFKC, casefolded, underscores and whitespace runs as one space."""
    text = unicodedata.normalize("NFKC", title).replace("_", " ")
    return _SPACE.sub(" ", text).strip().casefold()


def split_sentences(text: str) -> list[str]:
    """Splits a plain paragraph after ``.``/``!``/``?``; joining the pieces gives ``text`` back."""
    return [s for s in _SENTENCE_END.split(text) if s]


@dataclass(frozen=True)
class Passage:
    """One Wikipedia paragraph.

    Attributes:
        title: the article title.
        sentences: the paragraph's sentences; HotpotQA keeps the leading space of each one, so
            ``"".join(sentences)`` is the paragraph text.
    """

    title: str
    sentences: tuple[str, ...]

    @property
    def text(self) -> str:
        """The paragraph on one line."""
        return _SPACE.sub(" ", "".join(self.sentences)).strip()


def iter_hotpotqa_passages(path: str | Path) -> Iterable[Passage]:
    """Yields the context paragraphs of every question in a HotpotQA benchmark JSONL file."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            ctx = json.loads(line)["context"]
            for title, sentences in zip(ctx["title"], ctx["sentences"], strict=True):
                yield Passage(title, tuple(sentences))


def iter_corpus_passages(path: str | Path) -> Iterable[Passage]:
    """Yields the passages of an extra corpus: JSON lines with ``title`` and ``text`` (or ``sentences``)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or "title" not in row or ("text" not in row and "sentences" not in row):
                raise ValueError(f"{path}:{n}: expected an object with 'title' and 'text', got {line[:80]!r}")
            sentences = row["sentences"] if "sentences" in row else split_sentences(str(row["text"]))
            yield Passage(str(row["title"]), tuple(str(s) for s in sentences))


_SCHEMA = """
CREATE TABLE docs (id INTEGER PRIMARY KEY, title TEXT NOT NULL, norm_title TEXT NOT NULL UNIQUE,
                   base_title TEXT NOT NULL, sentences TEXT NOT NULL);
CREATE INDEX docs_base ON docs(base_title);
CREATE VIRTUAL TABLE docs_fts USING fts5(title, text, tokenize = 'unicode61 remove_diacritics 2');
"""


class WikiIndex:
    """A read-only SQLite FTS5 index of Wikipedia paragraphs, deduplicated by title (first one wins).

    Build it with :meth:`build` / :meth:`from_benchmarks`, or open a built file with :meth:`open`.
    The connection used for queries cannot write: a file is reopened with ``mode=ro``, an in-memory
    index is switched to ``PRAGMA query_only``.

    Args:
        conn: an open connection to a built index (use the class methods instead).
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.query_errors = 0
        """SQLite errors met while querying (answered as "nothing found"); 0 unless the sanitiser has a hole."""

    # ----------------------------------------------------------------------------------------- building
    @classmethod
    def build(cls, passages: Iterable[Passage], db_path: str | Path | None = None) -> WikiIndex:
        """Builds an index from passages.

        Args:
            passages: the paragraphs; a later paragraph whose title matches an earlier one is skipped.
            db_path: file to write (must not exist), or None for an in-memory index.
        """
        if db_path is not None and Path(db_path).exists():
            raise ValueError(f"db_path {db_path} exists already; open it with WikiIndex.open")
        if sqlite3.sqlite_version_info < (3, 9, 0):
            raise RuntimeError(f"SQLite {sqlite3.sqlite_version} has no FTS5; 3.9 or newer is needed")
        conn = sqlite3.connect(":memory:" if db_path is None else str(db_path))
        try:
            conn.executescript(_SCHEMA)
        except sqlite3.OperationalError as err:  # compiled without FTS5
            conn.close()
            raise RuntimeError(f"this sqlite3 build has no FTS5 ({err})") from err
        with conn:
            for p in passages:
                key = normalize_title(p.title)
                if not key:
                    continue
                cur = conn.execute(
                    "INSERT OR IGNORE INTO docs (title, norm_title, base_title, sentences) VALUES (?, ?, ?, ?)",
                    (p.title, key, _base_title(key), json.dumps(list(p.sentences), ensure_ascii=False)),
                )
                if cur.rowcount:
                    conn.execute(
                        "INSERT INTO docs_fts (rowid, title, text) VALUES (?, ?, ?)", (cur.lastrowid, p.title, p.text)
                    )
        if db_path is None:
            conn.execute("PRAGMA query_only = ON")
            return cls(conn)
        conn.close()
        return cls.open(db_path)

    @classmethod
    def from_benchmarks(
        cls,
        hotpotqa_files: Sequence[str | Path],
        extra_corpus: Sequence[str | Path] = (),
        db_path: str | Path | None = None,
    ) -> WikiIndex:
        """Builds the index over the context paragraphs of HotpotQA benchmark files plus extra corpora.

        Args:
            hotpotqa_files: HotpotQA benchmark JSONL files (``data/benchmarks/hotpotqa_<level>.<split>.jsonl``).
            extra_corpus: JSONL files of ``{"title", "text"}`` passages, indexed after the benchmark ones.
            db_path: file to write, or None for an in-memory index.
        """

        def passages() -> Iterable[Passage]:
            for path in hotpotqa_files:
                yield from iter_hotpotqa_passages(path)
            for path in extra_corpus:
                yield from iter_corpus_passages(path)

        return cls.build(passages(), db_path)

    @classmethod
    def open(cls, db_path: str | Path) -> WikiIndex:
        """Opens a built index file read-only."""
        path = Path(db_path)
        if not path.is_file():
            raise ValueError(f"no index file at {db_path}")
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        conn.execute("PRAGMA query_only = ON")
        return cls(conn)

    def close(self) -> None:
        """Closes the connection."""
        self._conn.close()

    def __len__(self) -> int:
        return self._conn.execute("SELECT count(*) FROM docs").fetchone()[0]

    def fingerprint(self) -> str:
        """SHA-256 of the schema, every document row and every FTS row: equal iff the index is unchanged."""
        h = hashlib.sha256()
        for sql in (
            "SELECT type, name, sql FROM sqlite_master ORDER BY name",
            "SELECT id, title, norm_title, base_title, sentences FROM docs ORDER BY id",
            "SELECT rowid, title, text FROM docs_fts ORDER BY rowid",
        ):
            for row in self._conn.execute(sql):
                h.update(repr(row).encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    # ------------------------------------------------------------------------------------------ queries
    def _rows(self, sql: str, params: tuple) -> list[tuple]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error:
            self.query_errors += 1
            return []

    @staticmethod
    def _passage(row: tuple) -> Passage:
        return Passage(row[0], tuple(json.loads(row[1])))

    def get(self, title: object) -> Passage | None:
        """Returns the paragraph titled ``title`` (case-, width- and whitespace-insensitive), or None.

        When no title matches exactly but exactly one title matches once its parenthesised
        disambiguation is dropped (``Hurt Locker`` -> ``Hurt Locker (musical)``), that one is returned.
        """
        arg = clean_argument(title)
        key = normalize_title(_strip_wrapping(arg))
        if not key:
            return None
        rows = self._rows(
            "SELECT title, sentences FROM docs WHERE norm_title IN (?, ?) ORDER BY norm_title = ? DESC LIMIT 1",
            (normalize_title(arg), key, normalize_title(arg)),
        )
        if not rows:
            rows = self._rows("SELECT title, sentences FROM docs WHERE base_title = ? LIMIT 2", (key,))
            if len(rows) != 1:
                return None
        return self._passage(rows[0])

    def search(self, query: object, k: int = 3) -> list[Passage]:
        """Returns the ``k`` best paragraphs for ``query`` by BM25 (title hits weigh 5x text hits)."""
        match = fts_query(clean_argument(query))
        if match is None or k <= 0:
            return []
        rows = self._rows(
            "SELECT d.title, d.sentences FROM docs_fts JOIN docs d ON d.id = docs_fts.rowid "
            "WHERE docs_fts MATCH ? ORDER BY bm25(docs_fts, 5.0, 1.0) LIMIT ?",
            (match, int(k)),
        )
        return [self._passage(r) for r in rows]

    def similar_titles(self, query: object, k: int = 5) -> list[str]:
        """Returns up to ``k`` titles similar to ``query``: BM25 over titles, then over text."""
        match = fts_query(clean_argument(query))
        if match is None or k <= 0:
            return []
        titles: list[str] = []
        for expr in (f"{{title}} : ({match})", match):
            for (title,) in self._rows(
                "SELECT title FROM docs_fts WHERE docs_fts MATCH ? ORDER BY bm25(docs_fts, 5.0, 1.0) LIMIT ?",
                (expr, int(k)),
            ):
                if title not in titles:
                    titles.append(title)
            if len(titles) >= k:
                break
        return titles[:k]


def _base_title(key: str) -> str:
    return re.sub(r"\s*\([^()]*\)$", "", key).strip()


def _strip_wrapping(text: str) -> str:
    """Drops quotes, brackets and a final period around an entity (``"Metallica".`` -> ``Metallica``)."""
    return text.strip().rstrip(".").strip().strip("\"'`[]").strip()


def ocr_text(ocr: str) -> str:
    """Returns the words of an EasyOCR result string (``[([[x, y], ...], 'word', conf), ...]``), comma-joined.

    The raw string is returned when it is not such a list (the OCR field is benchmark data, not model output).
    """
    try:
        items = ast.literal_eval(ocr)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return ocr
    if not isinstance(items, list):
        return ocr
    words = [str(it[1]) for it in items if isinstance(it, (list, tuple)) and len(it) >= 2]
    return ",".join(words)


class Toolbox:
    """One episode's tools: Retrieve, BingSearch, Lookup and Image2Text over a :class:`WikiIndex`.

    The Lookup cursor follows LangChain's ``DocstoreExplorer.lookup``: the same keyword again gives the
    next hit, a new keyword starts over; a new Retrieve/BingSearch resets it.

    Args:
        index: the shared, read-only index.
        top_k: passages a BingSearch returns.
        caption: the ScienceQA image caption (``"no img"`` or None when the question has no image).
        ocr: the ScienceQA OCR field (EasyOCR list string, ``"[]"`` or ``"no img"``).
        search_error: observation of a BingSearch that finds nothing (benchmark-specific spelling).
        max_observation_chars: observations are cut to this many characters.
    """

    def __init__(
        self,
        index: WikiIndex,
        *,
        top_k: int = 3,
        caption: str | None = None,
        ocr: str | None = None,
        search_error: str = OBS_SEARCH_ERROR,
        max_observation_chars: int = 4000,
    ) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if max_observation_chars < 100:
            raise ValueError(f"max_observation_chars must be >= 100, got {max_observation_chars}")
        self.index = index
        self.top_k = top_k
        self.caption = caption
        self.ocr = ocr
        self.search_error = search_error
        self.max_observation_chars = max_observation_chars
        self._last_search: str | None = None  # "Retrieve" | "BingSearch" | None
        self._sentences: list[str] | None = None  # sentences of the last passage(s) found
        self._lookup_keyword: str | None = None
        self._lookup_index = 0
        self._image_text: str | None = None

    def __call__(self, action: str, argument: object) -> str:
        """Runs tool ``action`` (``Retrieve``/``BingSearch``/``Lookup``/``Image2Text``) on ``argument``."""
        fn = {
            "Retrieve": self.retrieve,
            "BingSearch": self.bing_search,
            "Lookup": self.lookup,
            "Image2Text": self.image2text,
        }.get(action)
        if fn is None:
            return f"Unknown tool {clean_argument(action, MAX_ECHO_CHARS)}."
        return fn(argument)

    def _finish(self, text: str) -> str:
        text = _SPACE.sub(" ", text).strip()
        if len(text) > self.max_observation_chars:
            text = text[: self.max_observation_chars - 3].rstrip() + "..."
        return text

    def _found(self, kind: str, passages: Sequence[Passage]) -> None:
        self._last_search = kind
        self._sentences = [s.strip() for p in passages for s in p.sentences if s.strip()] if passages else None
        self._lookup_keyword = None
        self._lookup_index = 0

    def retrieve(self, entity: object) -> str:
        """``Retrieve[entity]``: the matching paragraph, else ``Could not find [entity]. Similar: [...]``."""
        arg = clean_argument(entity)
        passage = self.index.get(arg)
        if passage is not None:
            self._found("Retrieve", [passage])
            return self._finish(passage.text)
        self._found("Retrieve", [])
        similar = self.index.similar_titles(arg)
        if not similar:
            return OBS_NOT_FOUND
        return self._finish(f"Could not find [{arg[:MAX_ECHO_CHARS]}]. Similar: {similar!r}")

    def bing_search(self, query: object) -> str:
        """``BingSearch[query]``: the top-k BM25 paragraphs, concatenated like the training data's snippets."""
        passages = self.index.search(clean_argument(query), self.top_k)
        self._found("BingSearch", passages)
        if not passages:
            return self.search_error
        return self._finish("".join(p.text for p in passages))

    def lookup(self, keyword: object) -> str:
        """``Lookup[keyword]``: ``(Result i/n) sentence`` for the next sentence of the last passage(s) with it."""
        if self._last_search is None:
            return OBS_LOOKUP_FIRST
        if self._sentences is None:
            return OBS_LOOKUP_RETRIEVE_FAILED if self._last_search == "Retrieve" else OBS_LOOKUP_SEARCH_FAILED
        term = _strip_wrapping(clean_argument(keyword)).lower()
        if term != self._lookup_keyword:
            self._lookup_keyword = term
            self._lookup_index = 0
        else:
            self._lookup_index += 1
        hits = [s for s in self._sentences if term and term in s.lower()]
        if not hits:
            return OBS_NO_RESULTS
        if self._lookup_index >= len(hits):
            return OBS_NO_MORE_RESULTS
        return self._finish(f"(Result {self._lookup_index + 1}/{len(hits)}) {hits[self._lookup_index]}")

    def image2text(self, argument: object = None) -> str:
        """``Image2Text[...]``: the question's caption and OCR words; the argument is ignored."""
        if self.caption in (None, "no img") or self.ocr in (None, "no img"):
            return OBS_NO_IMAGE
        if self._image_text is None:
            self._image_text = self._finish(f"Image caption: {self.caption} OCR result: {ocr_text(self.ocr or '')}")
        return self._image_text
