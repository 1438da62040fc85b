"""How long a server takes to match a prompt to the trajectories it holds (host work, no model run).

``lragent serve`` matches every request's prompt against the text of each held trajectory
(:meth:`~lragent.serving.trajectories.TrajectoryStore.best_match`) before it admits the request. Agents of one
benchmark share a long system prompt, so every held trajectory shares thousands of characters with every prompt.
This times the ranked search against matching every candidate (:func:`match_every_candidate`, what the search must
equal), side by side in one process, on AutoAct-like trajectories built from the bundled benchmark questions and
tokenised by the embedded model's tokenizer (or ``--tokenizer``):

- *continuing*: each held trajectory's own text plus a new piece (an agent's next call);
- *first prompt*: a new question's first prompt (a new session), which no trajectory extends.

Usage::

    python -m eval_suite.bench.serve_match [--rows 64] [--benchmark hotpotqa] [--steps 6] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lragent.agents.prompts import format_question, get_spec, initial_text, observation_text
from lragent.paths import DATA_DIR
from lragent.serving.trajectories import (
    Match,
    TextTrajectory,
    TrajectoryStore,
    common_prefix_len,
    match_prompt,
    tokenize_once,
)

Tokenize = Callable[[str], list[int]]


def match_every_candidate(
    store: TrajectoryStore,
    prompt: str,
    candidates: Sequence[int],
    ids_of: Callable[[int], Sequence[int]],
    reusable: Callable[[int, int], int],
    tokenize: Tokenize,
) -> Match | None:
    """``best_match`` without its ranking: every candidate that shares a character is matched (the reference), the
    tokenisations cached by text within the request as ``best_match`` caches them."""
    cached = tokenize_once(tokenize)
    best, best_key = None, None
    for row in candidates:
        held = store.held.get(row)
        if held is None or not common_prefix_len(prompt, held.text):
            continue
        m = match_prompt(prompt, held, ids_of(row), cached, row)
        key = (reusable(row, m.shared), m.shared, store._used.get(row, 0))
        if m.shared and (best_key is None or key > best_key):
            best, best_key = m, key
    return best


def bundled_questions(benchmark: str, data_dir: Path = DATA_DIR) -> list[str]:
    """The benchmark's dev and test questions as the agents' prompt shows them, read from the bundled files."""
    questions = []
    for path in sorted((data_dir / "benchmarks").glob(f"{benchmark}_*.jsonl")):
        if path.name.endswith((".dev.jsonl", ".test.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                questions.append(format_question(row["question"], row.get("choices")))
    return questions


def build_store(
    questions: Sequence[str], benchmark: str, tokenize: Tokenize, steps: int
) -> tuple[TrajectoryStore, dict[int, list[int]]]:
    """One held trajectory per question (as the prompt shows it): its first prompt, then ``steps`` generated and
    observed pieces, each piece tokenised on its own (as the server holds them)."""
    spec = get_spec(benchmark)
    store, ids = TrajectoryStore(len(questions)), {}
    for row, question in enumerate(questions):
        held, toks = TextTrajectory(), []
        pieces = [initial_text(spec, question)]
        for step in range(steps):
            pieces.append(f" Thought {step}: I need to look up {question[:40]}.\nAction: Search[{question[:24]}]\n")
            pieces.append(observation_text(f"{question[:60]} is described in this passage. " * 8))
        for piece in pieces:
            piece_ids = tokenize(piece)
            held.append(piece, len(piece_ids))
            toks += piece_ids
        store.set(row, held)
        ids[row] = toks
    return store, ids


def time_matching(rows: int, benchmark: str, steps: int, repeat: int, tokenizer: str) -> dict:
    """Milliseconds per request of the ranked search and of matching every candidate, both request kinds."""
    from lragent.models import load_tokenizer
    from lragent.serving.text_encoder import text_encoder

    tokenize = text_encoder(load_tokenizer(tokenizer))  # the server's own tokenisation

    questions = bundled_questions(benchmark)[: rows * 2]
    if len(questions) < rows * 2:
        raise SystemExit(f"error: --rows {rows}: {benchmark} has {len(questions)} questions, allowed --rows <= "
                         f"{len(questions) // 2}")  # fmt: skip
    store, ids = build_store(questions[:rows], benchmark, tokenize, steps)
    spec = get_spec(benchmark)
    requests = {
        "continuing": [(store.held[r].text + " Thought: next.", r) for r in range(rows)],
        "first_prompt": [(initial_text(spec, q), None) for q in questions[rows:]],
    }
    reusable = lambda row, shared: shared  # noqa: E731  (base_lr_shared: any row's caches serve any role)
    out: dict = {"rows": rows, "benchmark": benchmark, "tokenizer": tokenizer,
                 "held_tokens_mean": sum(map(len, ids.values())) / rows}  # fmt: skip
    for kind, prompts in requests.items():
        for name, search in (("ranked", store.best_match), ("every_candidate", None)):
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                for prompt, own in prompts:
                    if search is None:
                        m = match_every_candidate(store, prompt, range(rows), ids.__getitem__, reusable, tokenize)
                    else:
                        m = search(prompt, range(rows), ids.__getitem__, reusable, tokenize)
                    if own is not None and (m is None or m.row != own or not m.extends):
                        raise AssertionError(f"{name}: a prompt continuing row {own} matched {m and m.row}")
                best = min(best, (time.perf_counter() - t0) / len(prompts))
            out[f"{kind}_{name}_ms"] = best * 1e3
        out[f"{kind}_speedup"] = out[f"{kind}_every_candidate_ms"] / out[f"{kind}_ranked_ms"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64, help="held trajectories (the server's rows)")
    parser.add_argument("--benchmark", default="hotpotqa", choices=("hotpotqa", "scienceqa"))
    parser.add_argument("--steps", type=int, default=6, help="generated + observed piece pairs per trajectory")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes (the fastest is reported)")
    parser.add_argument("--tokenizer", default="default", help="a model name lragent knows (default: embedded)")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.steps < 0 or args.repeat < 1:
        parser.error(f"--rows {args.rows}, --steps {args.steps}, --repeat {args.repeat}: allowed >= 1, >= 0, >= 1")
    res = time_matching(args.rows, args.benchmark, args.steps, args.repeat, args.tokenizer)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
