"""The evaluation benchmarks, one registry entry each: questions, levels, tools and corpus, constraints, scoring.

==============  ==========================  ================================================  =====================
benchmark       levels                      search corpus (offline tools)                     scores
==============  ==========================  ================================================  =====================
``hotpotqa``    ``easy`` ``medium``         the Wikipedia context paragraphs of every HotpotQA  exact match, F1
                ``hard``                    question of the evaluated splits
``scienceqa``   ``1-4`` ``5-8`` ``9-12``    the search results of the ScienceQA training        choice accuracy
                                            trajectories (:mod:`eval_suite.evaluate.scienceqa_corpus`),
                                            a stand-in for live web search; Image2Text reads
                                            the question's own caption and OCR
==============  ==========================  ================================================  =====================

**Splits** (:data:`SPLITS`) are data: ``data/benchmarks/<benchmark>_<level>.<split>.jsonl``. ``dev`` (30 questions a
level) is where recipes and settings are chosen; ``test`` (HotpotQA 70, ScienceQA 90 a level) completes the paper's
test sets (300 / 360 questions with ``dev``): report on it, choose nothing by it; ``extra`` (ScienceQA only: 1,412
questions of its validation and train splits, none a training example) adds statistical power. Several splits run
as one pool, split by split, each in the interleaved level order. The offline world is the pool's: HotpotQA searches
the paragraphs of the pool's questions, and the ScienceQA corpus leaves out passages that overlap any of them, so
``--split dev`` keeps the corpus (and the records) of runs made before the other splits existed.

Both take extra ``{"title", "text"}`` JSONL corpora (``--corpus FILE``), indexed after their own passages.
With constraints on (:mod:`lragent.agents.constraints`) the action type is chosen among the benchmark's tools plus
``Finish`` and the ``Finish`` argument among the question's option letters (ScienceQA) or ``yes``/``no`` for a
judgement question (HotpotQA, recognised from the question text only). The ``answer_text`` constraint (ScienceQA
only) chooses the ``Finish`` letter by scoring each option's text instead of the letter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval_suite.scoring.answer_scores import (
    HOTPOTQA_LEVELS,
    SCIENCEQA_BANDS,
    exact_match_score,
    f1_score,
    parse_choice,
)
from lragent.agents import BenchmarkSpec, format_question, get_spec
from lragent.agents.constraints import ANSWER_TEXT_SCORE, action_type_options, answer_options, answer_texts
from lragent.agents.tools import Passage, iter_corpus_passages, iter_hotpotqa_passages
from lragent.paths import DATA_DIR

CONSTRAINTS: tuple[str, ...] = ("action_type", "answer", "answer_text")
"""Constrained-choice options: ``action_type`` (choose the action type among the valid ones), ``answer`` (choose the
``Finish`` argument among the question's options / yes-no) and ``answer_text`` (ScienceQA: choose the ``Finish``
letter by scoring each option's text, :data:`~lragent.agents.constraints.ANSWER_TEXT_SCORE`; never with
``answer``)."""

ALL_CONSTRAINTS: tuple[str, ...] = ("action_type", "answer")
"""What ``--constrain all`` means (rows named ``scheme+constrained``); ``answer_text`` is asked for by name."""

TEXT_CONSTRAINT = "answer_text"

SPLITS: tuple[str, ...] = ("dev", "test", "extra")
"""Question splits, in pool order: ``dev`` (choose here), ``test`` (the rest of the paper's test sets), ``extra``
(more unseen ScienceQA questions, for statistical power)."""
DEFAULT_SPLITS: tuple[str, ...] = ("dev",)


@dataclass(frozen=True)
class Question:
    """One benchmark question.

    Attributes:
        qid: the benchmark's id (HotpotQA ``id``, ScienceQA ``pid``).
        level: HotpotQA level (``easy``/``medium``/``hard``) or ScienceQA grade band (``1-4``/``5-8``/``9-12``).
        text: the question as the prompt shows it (:func:`~lragent.agents.format_question`).
        gold: the gold answer (HotpotQA) or gold choice index (ScienceQA).
        choices: ScienceQA options (empty for HotpotQA).
        caption: ScienceQA image caption (None for HotpotQA).
        ocr: ScienceQA OCR field (None for HotpotQA).
        split: the split the question comes from (:data:`SPLITS`).
    """

    qid: str
    level: str
    text: str
    gold: str | int
    choices: tuple[str, ...] = ()
    caption: str | None = None
    ocr: str | None = None
    split: str = "dev"


def _hotpotqa_question(row: dict, level: str, split: str = "dev") -> Question:
    return Question(str(row["id"]), level, format_question(row["question"]), str(row["answer"]), split=split)


def _scienceqa_question(row: dict, level: str, split: str = "dev") -> Question:
    return Question(
        str(row["pid"]),
        level,
        format_question(row["question"], row["choices"]),
        int(row["answer"]),
        tuple(row["choices"]),
        row.get("caption"),
        row.get("ocr"),
        split,
    )


def parse_splits(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``dev`` / ``test`` / ``extra`` / a comma list or list of them -> the canonical tuple in :data:`SPLITS` order
    (``None``: ``dev``); raises ``ValueError`` naming the bad value and what is allowed."""
    if value is None:
        return DEFAULT_SPLITS
    items = [s.strip() for s in (value.split(",") if isinstance(value, str) else value) if str(s).strip()]
    bad = [s for s in items if s not in SPLITS]
    if bad or not items:
        raise ValueError(f"--split {value!r}: unknown split(s) {bad}; allowed {', '.join(SPLITS)} or a comma list")
    return tuple(s for s in SPLITS if s in items)


def _hotpotqa_passages(data_dir: Path, splits: Sequence[str] = DEFAULT_SPLITS) -> tuple[list[Passage], dict]:
    # split by split, each in file-name order (easy, hard, medium): the dev index of runs before the splits existed
    files = [
        f for s in parse_splits(splits) for f in sorted(HOTPOTQA.level_file(lv, data_dir, s) for lv in HOTPOTQA.levels)
    ]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"HotpotQA benchmark file {missing[0]} is missing")
    passages = [p for f in files for p in iter_hotpotqa_passages(f)]
    return passages, {"source": "HotpotQA context paragraphs", "files": [f.name for f in files]}


def _scienceqa_passages(data_dir: Path, splits: Sequence[str] = DEFAULT_SPLITS) -> tuple[list[Passage], dict]:
    from eval_suite.evaluate.scienceqa_corpus import build_search_corpus

    raw = data_dir / "trajectories" / "raw" / "70b_scienceqa_200.jsonl.gz"
    evaluation = [q.text for q in SCIENCEQA.load_questions(data_dir=data_dir, splits=splits)]
    corpus = build_search_corpus(raw, evaluation)
    return list(corpus.passages), {"source": f"search results of {raw.name}", **corpus.describe()}


def _hotpotqa_score(q: Question, prediction: str | None) -> dict[str, float]:
    return {"em": exact_match_score(prediction, str(q.gold)), "f1": f1_score(prediction, str(q.gold))}


def _scienceqa_score(q: Question, prediction: str | None) -> dict[str, float]:
    return {"correct": float(parse_choice(prediction, q.choices) == q.gold)}


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: what the runner, the tools and the summary need to know.

    Attributes:
        name: ``hotpotqa`` or ``scienceqa``.
        levels: level names in report order.
        metrics: summary metrics (``em``/``f1`` or ``accuracy``).
        score_fields: per-episode score fields of a record (``em``/``f1`` or ``correct``).
        file_stem: level -> benchmark file stem (``hotpotqa_easy``; the split follows: ``hotpotqa_easy.dev.jsonl``).
        parse_row: ``(JSON row, level, split) -> Question``.
        own_passages: ``(data_dir, splits) -> (passages, description)``: the benchmark's search corpus for a pool.
        splits: the splits this benchmark has (:data:`SPLITS` order).
        score: ``(question, prediction) -> {score_field: value}``.
        level_aliases: accepted spellings of levels (``grade1_4`` -> ``1-4``).
    """

    name: str
    levels: tuple[str, ...]
    metrics: tuple[str, ...]
    score_fields: tuple[str, ...]
    file_stem: Callable[[str], str]
    parse_row: Callable[[dict, str, str], Question]
    own_passages: Callable[[Path, Sequence[str]], tuple[list[Passage], dict]]
    score: Callable[[Question, str | None], dict[str, float]]
    splits: tuple[str, ...] = ("dev", "test")
    level_aliases: dict[str, str] = field(default_factory=dict)

    @property
    def spec(self) -> BenchmarkSpec:
        """The agent-side description (prompt, tools, observation strings)."""
        return get_spec(self.name)

    def parse_level(self, level: str) -> str:
        """Canonical level name; raises ``ValueError`` naming the allowed ones."""
        key = level.lower()
        key = self.level_aliases.get(key, key)
        if key not in self.levels:
            raise ValueError(f"unknown {self.name} level {level!r}: allowed {', '.join(self.levels)}")
        return key

    def level_file(self, level: str, data_dir: Path = DATA_DIR, split: str = "dev") -> Path:
        """The benchmark JSONL of one level of one split (``data/benchmarks/hotpotqa_easy.dev.jsonl``)."""
        return data_dir / "benchmarks" / f"{self.file_stem(level)}.{split}.jsonl"

    def parse_splits(self, value: str | Sequence[str] | None) -> tuple[str, ...]:
        """:func:`parse_splits`, then a ``ValueError`` for a split this benchmark does not have (HotpotQA has no
        ``extra``), naming the ones it has."""
        splits = parse_splits(value)
        missing = [s for s in splits if s not in self.splits]
        if missing:
            raise ValueError(
                f"--split {value!r}: {self.name} has no {missing[0]} split; allowed {', '.join(self.splits)}"
            )
        return splits

    def load_rows(
        self,
        levels: Sequence[str] | None = None,
        limit: int | None = None,
        data_dir: Path = DATA_DIR,
        splits: str | Sequence[str] | None = None,
    ) -> list[tuple[dict, str, str]]:
        """``(JSON row, level, split)`` of the chosen levels and splits: split by split (:data:`SPLITS` order), each
        in the interleaved level order (first of each level, then second of each, ...).

        Args:
            levels: level names (default all three).
            limit: keep the first ``limit`` rows of that order (every level is represented early).
            data_dir: the ``data`` directory.
            splits: the splits (default ``dev``).
        """
        chosen = [self.parse_level(lv) for lv in (levels or self.levels)]
        out: list[tuple[dict, str, str]] = []
        for split in self.parse_splits(splits):
            per_level: list[list[tuple[dict, str, str]]] = []
            for level in chosen:
                path = self.level_file(level, data_dir, split)
                if not path.is_file():
                    raise FileNotFoundError(f"benchmark file {path} is missing")
                rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
                per_level.append([(r, level, split) for r in rows])
            out += [lv[i] for i in range(max(map(len, per_level), default=0)) for lv in per_level if i < len(lv)]
        return out[:limit] if limit is not None else out

    def load_questions(
        self,
        levels: Sequence[str] | None = None,
        limit: int | None = None,
        data_dir: Path = DATA_DIR,
        splits: str | Sequence[str] | None = None,
    ) -> list[Question]:
        """Questions of the chosen levels and splits, in :meth:`load_rows`'s order (``limit``: the first ones)."""
        return [
            self.parse_row(row, level, split) for row, level, split in self.load_rows(levels, limit, data_dir, splits)
        ]

    def corpus(
        self, extra: Sequence[str | Path] = (), data_dir: Path = DATA_DIR, splits: str | Sequence[str] | None = None
    ) -> tuple[list[Passage], dict]:
        """The search corpus of a question pool: the benchmark's own passages for ``splits`` (default ``dev``), then
        those of each extra JSONL file.

        Returns:
            ``(passages, description)``; the description is JSON-able (sources, counts, the pool's splits).
        """
        pool = self.parse_splits(splits)
        passages, desc = self.own_passages(data_dir, pool)
        desc = {**desc, "splits": list(pool)}
        for path in extra:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"--corpus {path}: no such file")
            more = list(iter_corpus_passages(p))
            passages += more
            desc = {**desc, "extra": [*desc.get("extra", []), {"file": str(p), "passages": len(more)}]}
        return passages, {**desc, "passages": len(passages)}

    def toolbox_factory(
        self, extra: Sequence[str | Path] = (), data_dir: Path = DATA_DIR, splits: str | Sequence[str] | None = None
    ) -> tuple[Callable[[Question], Any], dict]:
        """A fresh :class:`~lragent.agents.Toolbox` per episode over the corpus of the ``splits`` pool (index built
        once).

        Returns:
            ``(question -> Toolbox, corpus description)``.
        """
        from lragent.agents import Toolbox, WikiIndex

        passages, desc = self.corpus(extra, data_dir, splits)
        index = WikiIndex.build(passages)
        spec = self.spec

        def make(q: Question) -> Toolbox:
            return Toolbox(index, caption=q.caption, ocr=q.ocr, search_error=spec.search_error)

        return make, {**desc, "indexed": len(index)}

    def constraint_options(
        self, q: Question, constraints: Sequence[str]
    ) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        """``(action_types, answer_options)`` for :meth:`lragent.agents.AgentLoop.episode` under ``constraints``
        (``answer_text``: the option letters, which :meth:`answer_texts` scores by their texts)."""
        self.check_constraints(constraints)
        types = action_type_options(self.spec) if "action_type" in constraints else None
        letters = "answer" in constraints or TEXT_CONSTRAINT in constraints
        answers = answer_options(self.spec, q.text, q.choices) if letters else None
        return types, answers

    def answer_texts(self, q: Question, constraints: Sequence[str]) -> tuple[str, ...] | None:
        """Under ``answer_text``: the option texts scored for the letters (:func:`~lragent.agents.constraints.
        answer_texts`), for :meth:`lragent.agents.AgentLoop.episode`'s ``answer_texts``; None otherwise."""
        self.check_constraints(constraints)
        return answer_texts(q.choices) if TEXT_CONSTRAINT in constraints else None

    def check_constraints(self, constraints: Sequence[str]) -> None:
        """Raises ``ValueError`` for a constraint this benchmark cannot apply (``answer_text`` needs option texts:
        ScienceQA only), naming what is allowed."""
        if TEXT_CONSTRAINT in constraints and self.name != "scienceqa":
            allowed = ", ".join(c for c in CONSTRAINTS if c != TEXT_CONSTRAINT)
            raise ValueError(
                f"--constrain {TEXT_CONSTRAINT!r} scores the options' texts and {self.name} questions have none: "
                f"allowed on {self.name} none, all or a comma list of {allowed}"
            )


HOTPOTQA = Benchmark(
    name="hotpotqa",
    levels=HOTPOTQA_LEVELS,
    metrics=("em", "f1"),
    score_fields=("em", "f1"),
    file_stem=lambda level: f"hotpotqa_{level}",
    parse_row=_hotpotqa_question,
    own_passages=_hotpotqa_passages,
    score=_hotpotqa_score,
)

SCIENCEQA = Benchmark(
    name="scienceqa",
    levels=SCIENCEQA_BANDS,
    metrics=("accuracy",),
    score_fields=("correct",),
    file_stem=lambda level: "scienceqa_grade" + level.replace("-", "_"),
    parse_row=_scienceqa_question,
    own_passages=_scienceqa_passages,
    score=_scienceqa_score,
    splits=SPLITS,
    level_aliases={
        alias: band
        for band in SCIENCEQA_BANDS
        for alias in ("grade" + band, "grade" + band.replace("-", "_"), band.replace("-", "_"))
    },
)

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (HOTPOTQA, SCIENCEQA)}


def get_benchmark(name: str) -> Benchmark:
    """The registry entry called ``name``; raises ``ValueError`` naming the allowed ones."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}: allowed {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def parse_level(benchmark: str, level: str) -> str:
    """Canonical level name: ``easy``... for HotpotQA; ``1-4``... for ScienceQA (``grade1_4``, ``1_4`` accepted)."""
    return get_benchmark(benchmark).parse_level(level)


def load_questions(
    benchmark: str,
    levels: Sequence[str] | None = None,
    limit: int | None = None,
    data_dir: Path = DATA_DIR,
    splits: str | Sequence[str] | None = None,
) -> list[Question]:
    """Questions of a benchmark (see :meth:`Benchmark.load_questions`)."""
    return get_benchmark(benchmark).load_questions(levels, limit, data_dir, splits)


def parse_constraints(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """``none`` / ``all`` / a comma list of :data:`CONSTRAINTS` -> the canonical tuple, in :data:`CONSTRAINTS` order."""
    if spec is None:
        return ()
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if items in (["none"], []):
        return ()
    if items == ["all"]:
        return ALL_CONSTRAINTS
    bad = [s for s in items if s not in CONSTRAINTS]
    if bad:
        raise ValueError(f"--constrain {spec!r}: unknown {bad}; allowed none, all or a comma list of {CONSTRAINTS}")
    if "answer" in items and TEXT_CONSTRAINT in items:
        raise ValueError(
            f"--constrain {spec!r}: answer and answer_text both choose the Finish argument; allowed one of them"
        )
    return tuple(c for c in CONSTRAINTS if c in items)


def answer_score(constraints: Sequence[str]) -> str | None:
    """The option-text ranking (``sum``/``mean``) that ``constraints`` use: :data:`~lragent.agents.constraints.
    ANSWER_TEXT_SCORE` under ``answer_text``, None otherwise (the letter choice ranks by the sum, as always)."""
    return ANSWER_TEXT_SCORE if TEXT_CONSTRAINT in parse_constraints(list(constraints)) else None


def row_name(scheme_or_row: str, constraints: Sequence[str]) -> str:
    """The report row of a scheme under constraints: ``base_lr_shared``, ``base_lr_shared+constrained`` (all),
    ``base_lr_shared+constrained:answer`` (some); with ``answer_text`` the suffix is the constraint list itself,
    ``base_lr_shared+answer_text`` or ``base_lr_shared+action_type,answer_text``, so option-text rows never mix with
    letter-constrained ones; unconstrained rows keep the plain name."""
    cons = parse_constraints(list(constraints))
    if not cons:
        return scheme_or_row
    if TEXT_CONSTRAINT in cons:
        return f"{scheme_or_row}+{','.join(cons)}"
    if cons == ALL_CONSTRAINTS:
        return f"{scheme_or_row}+constrained"
    return f"{scheme_or_row}+constrained:{','.join(cons)}"
