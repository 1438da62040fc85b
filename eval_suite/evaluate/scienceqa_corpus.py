"""The ScienceQA search corpus: real search results of the training trajectories, a stand-in for live web search.

The AutoAct/LRAgent ScienceQA agents searched the live web (Bing) and Wikipedia; this toolkit is offline. The
ScienceQA tools therefore search the observations that those searches actually returned while the training
trajectories were made (``data/trajectories/raw/70b_scienceqa_200.jsonl.gz``: 200 LLaMA-2-70B trajectories on
self-instructed science questions):

* only the observation text of ``BingSearch`` / ``Retrieve`` / ``Lookup`` steps is kept, never thoughts, actions'
  Finish arguments, answers, the question or Image2Text captions; failed searches (``Could not find ...``,
  ``BingSearch error ...``) are dropped;
* a ``Retrieve[entity]`` result becomes the passage titled ``entity`` (a Wikipedia paragraph); a
  ``BingSearch[query]`` result the passage titled ``query`` (``query (search result)`` when a Retrieve result has
  that title already); HTML entities are unescaped;
* the trajectories of training questions that also appear among the evaluation questions are left out
  (:func:`overlapping_questions`; with the bundled data there are none: the training questions are synthetic).

Any extra ``{"title", "text"}`` JSONL corpus (``cli.py eval --corpus FILE``) is indexed after these passages.
"""

from __future__ import annotations

import gzip
import html
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lragent.agents.tools import Passage, split_sentences

SEARCH_TOOLS: tuple[str, ...] = ("Retrieve", "BingSearch", "Lookup")
"""Tools whose observations are search results (Retrieve first: its titles are Wikipedia titles)."""

FAILED_PREFIXES: tuple[str, ...] = (
    "could not find",
    "bingsearch error",
    "no results",
    "no more results",
    "invalid action",
    "the last page",
    "this question doesn't",
)
"""Observations that start with these (case-insensitive) report a failed search, not text."""

NEAR_DUPLICATE_JACCARD = 0.8
"""Word-set Jaccard similarity (question + options) at or above which two questions count as the same."""

_STEP = re.compile(r"\nAction (\d+): (\w+)\[(.*?)\]?\.?[ \t]*\nObservation \1: (.*?)(?=\nThought \d+:|\Z)", re.DOTALL)
_LOOKUP_PREFIX = re.compile(r"^\(Result \d+\s*/\s*\d+\)\s*")
_WORDS = re.compile(r"\w+")


@dataclass(frozen=True)
class SearchResult:
    """One successful search step of a training trajectory.

    Attributes:
        tool: ``Retrieve``, ``BingSearch`` or ``Lookup``.
        argument: the entity, query or keyword searched for.
        text: the observation (HTML entities unescaped, whitespace collapsed).
    """

    tool: str
    argument: str
    text: str


def read_raw_trajectories(path: str | Path) -> list[dict]:
    """Rows of a raw trajectory file (``question``, ``answer``, ``prompt``, ...), gzip JSON lines."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"raw trajectory file {p} is missing")
    with gzip.open(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def search_results(prompt: str) -> list[SearchResult]:
    """The successful search steps of one raw trajectory (its ``prompt`` field: ``Action N: T[x]`` lines)."""
    out = []
    for m in _STEP.finditer(prompt):
        tool, arg, obs = m.group(2), " ".join(m.group(3).split()), " ".join(html.unescape(m.group(4)).split())
        if tool not in SEARCH_TOOLS or not obs or obs.lower().startswith(FAILED_PREFIXES):
            continue
        if tool == "Lookup":
            obs = _LOOKUP_PREFIX.sub("", obs)
        out.append(SearchResult(tool, arg, obs))
    return out


def question_key(text: str) -> frozenset[str]:
    """Lower-case word set of a question (stem plus options): what :func:`overlapping_questions` compares."""
    return frozenset(_WORDS.findall(text.lower()))


def overlapping_questions(training: Sequence[str], evaluation: Sequence[str]) -> list[int]:
    """Indices of training questions that are also evaluation questions.

    Two questions are the same when their word sets (question and options) are equal or have a Jaccard similarity
    of at least :data:`NEAR_DUPLICATE_JACCARD`.

    Args:
        training: training questions (``Question\\nOptions:(A) ...``).
        evaluation: evaluation questions in the same format.
    """
    keys = [question_key(q) for q in evaluation]
    hits = []
    for i, q in enumerate(training):
        k = question_key(q)
        if any(k and e and len(k & e) / len(k | e) >= NEAR_DUPLICATE_JACCARD for e in keys):
            hits.append(i)
    return hits


def max_similarity(training: Sequence[str], evaluation: Sequence[str]) -> float:
    """The highest word-set Jaccard similarity between any training and any evaluation question (0 if none)."""
    keys = [question_key(q) for q in evaluation]
    best = 0.0
    for q in training:
        k = question_key(q)
        for e in keys:
            if k | e:
                best = max(best, len(k & e) / len(k | e))
    return best


@dataclass(frozen=True)
class SearchCorpus:
    """The passages of the ScienceQA search corpus and what was left out.

    Attributes:
        passages: the passages, Retrieve results first.
        trajectories: raw trajectories read.
        excluded: training questions left out because they overlap an evaluation question.
        max_similarity: the highest training/evaluation question similarity found (a check that the split is clean).
    """

    passages: tuple[Passage, ...]
    trajectories: int
    excluded: tuple[str, ...]
    max_similarity: float

    def describe(self) -> dict:
        """A JSON-able summary for run configs and reports."""
        return {
            "passages": len(self.passages),
            "trajectories": self.trajectories,
            "excluded_overlapping_questions": list(self.excluded),
            "max_train_eval_question_similarity": round(self.max_similarity, 4),
        }


def build_search_corpus(raw_path: str | Path, evaluation_questions: Sequence[str]) -> SearchCorpus:
    """The ScienceQA search corpus from the raw training trajectories (see the module docstring).

    Args:
        raw_path: ``data/trajectories/raw/70b_scienceqa_200.jsonl.gz``.
        evaluation_questions: every evaluation question (``Question\\nOptions:(A) ...``), for the overlap check.
    """
    rows = read_raw_trajectories(raw_path)
    questions = [str(r["question"]) for r in rows]
    excluded = set(overlapping_questions(questions, evaluation_questions))
    results = [res for i, r in enumerate(rows) if i not in excluded for res in search_results(str(r["prompt"]))]
    ordered = sorted(results, key=lambda res: SEARCH_TOOLS.index(res.tool))  # stable: Retrieve first
    passages: list[Passage] = []
    titles: set[str] = set()
    texts: set[str] = set()
    for res in ordered:
        if res.text in texts:
            continue
        title = res.argument.strip().strip("\"'") or res.text[:60]
        if title.casefold() in titles:
            title = f"{title} (search result)"
        if title.casefold() in titles:
            continue
        titles.add(title.casefold())
        texts.add(res.text)
        passages.append(Passage(title, tuple(split_sentences(res.text))))
    return SearchCorpus(
        passages=tuple(passages),
        trajectories=len(rows),
        excluded=tuple(questions[i] for i in sorted(excluded)),
        max_similarity=max_similarity(questions, evaluation_questions),
    )


def iter_passages(corpus: SearchCorpus, extra: Iterable[Passage] = ()) -> Iterable[Passage]:
    """The corpus passages, then any extra ones."""
    yield from corpus.passages
    yield from extra
