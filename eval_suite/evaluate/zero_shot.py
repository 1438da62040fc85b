"""``cli.py zero-shot``: what the base model knows without agents or adapters, the reference row of the sharing study.

* **ScienceQA**: the question, its image caption (when it has one) and its lettered options in one chat turn; the
  answer is the option letter with the highest next-token logit among the question's own letters (so every answer is
  valid). Accuracy with a 95% bootstrap interval over questions, beside the chance rate (mean 1/#options).
* **HotpotQA**: the question's ten context paragraphs (the gold ones among distractors: the agents must search for
  them, this probe is given them) and the question in one chat turn; a greedy short answer (first line, at most
  ``max_new_tokens`` tokens), scored by exact match and F1 after the standard normalisation.

One JSON line per question as it is answered (``zero_shot.jsonl``; a rerun skips what is there), then
``summary.json`` with provenance. Models without a chat template get the same text as a plain prompt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eval_suite.evaluate.benchmarks import get_benchmark
from eval_suite.scoring.answer_scores import exact_match_score, f1_score
from eval_suite.scoring.paired import bootstrap_mean_interval

LETTERS = "ABCDEFGHIJ"
SCIENCEQA_INSTRUCTION = "Answer with the letter of the correct option only."
HOTPOTQA_INSTRUCTION = (
    "Answer the question using the paragraphs. Reply with the short answer only (a name, a date, a number, a short "
    "phrase, or yes or no), without explanation."
)


def scienceqa_prompt(row: dict) -> str:
    """The user turn of one ScienceQA question: caption (if any), question, lettered options, instruction."""
    lines = []
    if row.get("caption") and row["caption"] != "no img":
        lines.append(f"Image: {row['caption']}")
    lines.append(f"Question: {row['question']}")
    lines.append("Options:")
    lines += [f"({LETTERS[i]}) {c}" for i, c in enumerate(row["choices"])]
    lines.append(SCIENCEQA_INSTRUCTION)
    return "\n".join(lines)


def hotpotqa_prompt(row: dict) -> str:
    """The user turn of one HotpotQA question: its ten context paragraphs, the question, the instruction."""
    ctx = row["context"]
    paragraphs = [f"{t}: {''.join(s).strip()}" for t, s in zip(ctx["title"], ctx["sentences"], strict=True)]
    return "\n\n".join([HOTPOTQA_INSTRUCTION, *paragraphs, f"Question: {row['question']}"])


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as one user turn with the generation prompt (plain text where the tokenizer has no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text + "\nAnswer: ", add_special_tokens=True)["input_ids"]


def letter_token_ids(tokenizer: Any, n: int) -> list[int]:
    """The single-token ids of the letters ``A`` … (the n-th letter); ``ValueError`` if one is not one token."""
    ids = []
    for letter in LETTERS[:n]:
        toks = tokenizer.encode(letter, add_special_tokens=False)
        if len(toks) != 1:
            raise ValueError(f"the tokenizer splits the option letter {letter!r} into {len(toks)} tokens")
        ids.append(toks[0])
    return ids


def short_answer(text: str) -> str:
    """The first non-empty line of a generated answer, without a trailing full stop or an ``Answer:`` prefix."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    if line.lower().startswith("answer:"):
        line = line[len("answer:") :].strip()
    return line.rstrip(".").strip()


def summarize(benchmark: str, records: list[dict]) -> dict:
    """Accuracy (ScienceQA, with chance) or EM/F1 (HotpotQA), each a mean with its 95% bootstrap interval (%)."""
    if not records:
        raise ValueError("no answered questions to summarize")
    fields = ("correct",) if benchmark == "scienceqa" else ("em", "f1")
    out: dict[str, Any] = {"questions": len(records)}
    for f in fields:
        mean, low, high = bootstrap_mean_interval([r[f] for r in records])
        out[f] = {"mean": 100 * mean, "low": 100 * low, "high": 100 * high}
    if benchmark == "scienceqa":
        out["chance"] = 100 * sum(1 / r["n_choices"] for r in records) / len(records)
    return out


def zero_shot(
    benchmark: str = "scienceqa",
    out: str = "out/zero_shot",
    model: str = "default",
    dtype: str = "bfloat16",
    device: str | None = None,
    limit: int | None = None,
    split: str = "dev",
    max_new_tokens: int = 32,
    quiet: bool = False,
) -> int:
    """Zero-shot probe of the base model (no agents, no adapters) on the questions of --split (default dev).

    Args:
        benchmark: scienceqa (letter by next-token logit among the question's options) or hotpotqa (greedy short
            answer given the ten context paragraphs).
        out: output directory (``zero_shot.jsonl`` per question, ``summary.json``, ``report.md``).
        model: base model: default (embedded SmolLM2-135M-Instruct), qwen2.5-coder-1.5b, a hub name or a local dir.
        dtype: compute dtype (float32, bfloat16, float16).
        device: cpu, cuda, cuda:N (default: cuda when there is one).
        limit: only the first N questions (levels interleaved).
        split: question split(s): dev (default), test, extra (ScienceQA), or a comma list (one pool, split by split);
            every record and the summary name it.
        max_new_tokens: HotpotQA: longest generated answer.
        quiet: no per-question progress lines.
    """
    import torch

    from lragent.loading import resolve_device
    from lragent.models import load_model, parse_dtype
    from lragent.provenance import provenance
    from lragent.report_io import write_json, write_text

    if benchmark not in ("scienceqa", "hotpotqa"):
        raise ValueError(f"--benchmark {benchmark!r}: allowed scienceqa, hotpotqa")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    dev = resolve_device(device)
    torch_dtype = parse_dtype(dtype)
    bench = get_benchmark(benchmark)
    splits = bench.parse_splits(split)
    loaded = bench.load_rows(limit=limit, splits=splits)
    rows = [row for row, _, _ in loaded]
    split_of = {str(row.get("pid", row.get("id"))): s for row, _, s in loaded}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "zero_shot.jsonl"
    done = {}
    if log_path.is_file():
        for line in log_path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["qid"]] = rec
    hf, tokenizer = load_model(model, dtype=torch_dtype, device=dev)
    if tokenizer is None:
        raise ValueError(f"--model {model!r} has random weights and no tokenizer: the probe needs text")
    t0 = time.time()
    with log_path.open("a") as log, torch.inference_mode():
        for i, row in enumerate(rows):
            qid = str(row.get("pid", row.get("id")))
            if qid in done:
                continue
            if benchmark == "scienceqa":
                ids = chat_ids(tokenizer, scienceqa_prompt(row))
                logits = hf(torch.tensor([ids], device=dev)).logits[0, -1].float()  # (V,)
                letters = letter_token_ids(tokenizer, len(row["choices"]))
                choice = int(torch.argmax(logits[letters]).item())
                rec = {"qid": qid, "answer": LETTERS[choice], "gold": LETTERS[int(row["answer"])],
                       "correct": float(choice == int(row["answer"])), "n_choices": len(row["choices"])}  # fmt: skip
            else:
                ids = chat_ids(tokenizer, hotpotqa_prompt(row))
                x = torch.tensor([ids], device=dev)
                gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.eos_token_id)  # fmt: skip
                text = tokenizer.decode(gen[0, len(ids) :], skip_special_tokens=True)
                pred = short_answer(text)
                rec = {"qid": qid, "answer": pred, "gold": row["answer"], "raw": text,
                       "em": exact_match_score(pred, row["answer"]), "f1": f1_score(pred, row["answer"])}  # fmt: skip
            rec["prompt_tokens"] = len(ids)
            rec["split"] = split_of[qid]
            log.write(json.dumps(rec) + "\n")
            log.flush()
            done[qid] = rec
            if not quiet:
                print(f"[{i + 1}/{len(rows)}] {qid}: {rec['answer']!r} (gold {rec['gold']!r})", flush=True)
    records = [done[str(r.get("pid", r.get("id")))] for r in rows]
    summary = {"benchmark": benchmark, "model": model, "split": list(splits), **summarize(benchmark, records),
               "seconds": round(time.time() - t0, 1),
               "provenance": provenance(dtype=torch_dtype, device=dev)}  # fmt: skip
    write_json(out_dir / "summary.json", summary)
    if benchmark == "scienceqa":
        a = summary["correct"]
        line = (f"accuracy {a['mean']:.1f}% [{a['low']:.1f}, {a['high']:.1f}], chance {summary['chance']:.1f}%, "
                f"{len(records)} questions")  # fmt: skip
    else:
        e, f = summary["em"], summary["f1"]
        line = (f"EM {e['mean']:.1f} [{e['low']:.1f}, {e['high']:.1f}], F1 {f['mean']:.1f} "
                f"[{f['low']:.1f}, {f['high']:.1f}], {len(records)} questions")  # fmt: skip
    write_text(out_dir / "report.md", f"# Zero-shot probe: {benchmark}, {model}\n\n{line}\n")
    print(f"{benchmark} zero-shot ({model}): {line}")
    return 0
