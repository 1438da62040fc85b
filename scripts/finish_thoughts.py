"""What the agents think before they answer: for ScienceQA episode records (``eval`` writes each cycle's thought
beside its action), how often the thought before ``Finish`` names exactly one of the question's options, whether the
answered letter is that option, whether that option is right, and how often the answer is the first letter.

    python scripts/finish_thoughts.py results/study/thoughts_2026-11-24/*/episodes.jsonl --out T.md

Prints one Markdown table (one row per file and scheme) and writes it to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

LETTERS = "ABCDEFGH"


def finish_thought(record: dict) -> str | None:
    """The thought of the cycle whose action is the last ``Finish``, or None."""
    actions, thoughts = record.get("actions") or [], record.get("thoughts") or []
    idx = [i for i, a in enumerate(actions) if a.startswith("Finish")]
    if not idx or idx[-1] >= len(thoughts):
        return None
    return thoughts[idx[-1]] or ""


def summarise(records: list[dict]) -> dict:
    """Counts over one set of episodes (see the module docstring)."""
    n = len(records)
    answered = [r for r in records if r.get("prediction")]
    named = letter_is_named = named_right = answer_a = 0
    for r in answered:
        answer_a += r["prediction"].strip().upper() == "A"
        thought = finish_thought(r)
        if thought is None:
            continue
        hits = [i for i, c in enumerate(r["choices"]) if c.lower() in thought.lower()]
        if len(hits) != 1:
            continue
        named += 1
        named_right += hits[0] == r["gold"]
        letter = r["prediction"].strip().upper()
        letter_is_named += letter in LETTERS and LETTERS.index(letter) == hits[0]
    return {
        "episodes": n,
        "accuracy": sum(r["correct"] for r in records) / max(n, 1),
        "chance": sum(1 / len(r["choices"]) for r in records) / max(n, 1),
        "answered": len(answered),
        "thought_names_one_option": named,
        "answer_is_the_named_option": letter_is_named,
        "named_option_is_right": named_right,
        "answer_A": answer_a,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="episodes.jsonl files")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    head = (
        "| episodes file | scheme | n | accuracy % | chance % | answered | thought names one option | answer = named "
        "option | named option right | answer A |\n"
        "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    lines = [head]
    for f in args.files:
        by_scheme: dict[str, list[dict]] = defaultdict(list)
        for line in Path(f).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                by_scheme[r["scheme"]].append(r)
        for scheme, recs in by_scheme.items():
            if not any("thoughts" in r for r in recs):
                raise SystemExit(f"{f}: the records have no thoughts (written before eval kept them)")
            s = summarise(recs)
            lines.append(
                f"| {f} | {scheme} | {s['episodes']} | {100 * s['accuracy']:.1f} | {100 * s['chance']:.1f} | "
                f"{s['answered']} | {s['thought_names_one_option']} | {s['answer_is_the_named_option']} | "
                f"{s['named_option_is_right']} | {s['answer_A']} |"
            )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
