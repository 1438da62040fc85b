"""Which normalisation the ``answer_text`` constraint should rank option texts by: sum or mean token log-prob.

The embedded base model (SmolLM2-135M-Instruct, no adapters), on the CPU, scores every option text of the 90 ScienceQA
dev questions as the teacher-forced continuation of a prompt that ends with the question and its options, tokenised
as a :class:`~lragent.agents.requests.Choose` tokenises (prompt and option each on their own, no special tokens), and
picks the option by :func:`~lragent.agents.requests.best_option` under ``sum`` and under ``mean``. Two prompts:

* ``short``: ``Question:{question}\\nOptions:(A) .. (B) ..\\nAnswer:\\n`` (the question as
  :func:`~lragent.agents.prompts.format_question` writes it);
* ``agent``: the agent's own trajectory up to the ``Finish`` argument, with an empty thought: the ScienceQA system
  prompt, ``Question:...``, ``Thought: \\n### Response:\\n``, ``\\nAction: \\n### Response:\\n``, ``Finish``,
  ``[\\n### Response:\\n`` (what the action role sees when the constraint asks it; no adapters here).

Prints a Markdown table: accuracy by sum and by mean, and the chance rate (mean of 1/#options)::

    PYTHONPATH=. python scripts/answer_text_score_cpu.py            # ~1-2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import time

import torch

from eval_suite.benchmarks import SCIENCEQA, Question
from lragent.agents.prompts import ACTION_MARKER, ARGUMENT_MARKER, get_spec, initial_text
from lragent.agents.requests import CHOICE_SCORES, best_option


def prompts(q: Question) -> dict[str, str]:
    """The two prompts the option texts continue (see the module docstring)."""
    return {
        "short": f"Question:{q.text}\nAnswer:\n",
        "agent": initial_text(get_spec("scienceqa"), q.text) + ACTION_MARKER + "Finish" + ARGUMENT_MARKER,
    }


class PrefixCache:
    """The KV cache of a token prefix that many prompts share (the agent prompt's system prompt), run once.

    Prompts are tokenised whole (as the session tokenises an appended piece); only the tokens they have in common
    with the cached prefix are reused, so every score is the one a full forward gives.
    """

    def __init__(self, model, prefix_ids: list[int]) -> None:
        self.ids = list(prefix_ids)
        with torch.no_grad():
            self.past = model(torch.tensor([self.ids]), use_cache=True).past_key_values if self.ids else None

    def common(self, ids: list[int]) -> int:
        """Tokens of ``ids`` the cache covers (at most ``len(ids) - 1``: the last prompt token must run)."""
        n = 0
        for a, b in zip(self.ids, ids[:-1], strict=False):
            if a != b:
                break
            n += 1
        return n


@torch.no_grad()
def option_sums(
    model, tokenizer, prompt: str, options: list[str], cache: PrefixCache | None = None
) -> tuple[list[float], list[int]]:
    """Per option: the sum of its token log-probs after ``prompt``, and its token count.

    The prompt runs once (after whatever of it ``cache`` holds); its KV cache is reused for each option.
    """
    import copy

    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    p = enc(prompt)
    past = None
    n = cache.common(p) if cache is not None else 0
    if n:
        past = copy.deepcopy(cache.past)
        past.crop(n)
    out = model(torch.tensor([p[n:]]), past_key_values=past, use_cache=True)
    head = torch.log_softmax(out.logits[0, -1].float(), -1)
    sums, lengths = [], []
    for o in options:
        ids = enc(o)
        total = float(head[ids[0]])
        if len(ids) > 1:
            past = copy.deepcopy(out.past_key_values)
            logits = model(torch.tensor([ids[:-1]]), past_key_values=past, use_cache=True).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            total += float(sum(logp[j, ids[j + 1]] for j in range(len(ids) - 1)))
        sums.append(total)
        lengths.append(len(ids))
    return sums, lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="first N dev questions (default all 90)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lragent.models import load_model

    model, tokenizer = load_model("default", dtype=torch.float32, device="cpu")
    questions = SCIENCEQA.load_questions(limit=args.limit)
    t0 = time.time()
    correct = {(p, s): 0 for p in ("short", "agent") for s in CHOICE_SCORES}
    chance = sum(1.0 / len(q.choices) for q in questions) / len(questions)
    differ = {p: 0 for p in ("short", "agent")}
    differ_right = {(p, s): 0 for p in ("short", "agent") for s in CHOICE_SCORES}  # right where the picks differ
    shortest = {(p, s): 0 for p in ("short", "agent") for s in CHOICE_SCORES}  # picks of the fewest-token option
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    a, b = (enc(prompts(q)["agent"]) for q in questions[:2]) if len(questions) > 1 else (enc("x"), enc("y"))
    shared = a[: next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))]
    cache = PrefixCache(model, shared)  # the system prompt's tokens, common to every agent prompt
    for q in questions:
        texts = [c.strip() for c in q.choices]
        for name, prompt in prompts(q).items():
            sums, lengths = option_sums(model, tokenizer, prompt, texts, cache if name == "agent" else None)
            picks = {s: best_option(sums, lengths, s) for s in CHOICE_SCORES}
            differ[name] += picks["sum"] != picks["mean"]
            for s, i in picks.items():
                correct[(name, s)] += i == q.gold
                differ_right[(name, s)] += picks["sum"] != picks["mean"] and i == q.gold
                shortest[(name, s)] += lengths[i] == min(lengths)
    n = len(questions)
    print(f"ScienceQA dev, {n} questions, embedded base model (no adapters), CPU fp32, {time.time() - t0:.0f} s\n")
    print("| prompt | accuracy, sum of log-probs | accuracy, mean log-prob | chance (mean 1/#options) | picks differ "
          "(right by sum / by mean) | picks the fewest-token option (sum / mean) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("short", "agent"):
        s, m = (100 * correct[(name, k)] / n for k in ("sum", "mean"))
        print(f"| {name} | {s:.1f}% ({correct[(name, 'sum')]}/{n}) | {m:.1f}% ({correct[(name, 'mean')]}/{n}) | "
              f"{100 * chance:.1f}% | {differ[name]} ({differ_right[(name, 'sum')]} / {differ_right[(name, 'mean')]}) "
              f"| {shortest[(name, 'sum')]} / {shortest[(name, 'mean')]} |")  # fmt: skip


if __name__ == "__main__":
    main()
