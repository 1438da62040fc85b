"""Teacher-forced next-token fidelity of each sharing scheme against ``non_shared``.

For a held-out role example (``{"input", "output"}`` of a consumer role), the trajectory is ``input + output + EOS``.
A **producer** role encodes the context into the scheme's cache, then the **consumer** (the example's own role)
processes the rest, teacher-forced, on row 0 of a one-row :class:`~lragent.engine.Engine` (what a
``MultiAgentSession`` step runs)::

    engine.append(0, ids[:split]); engine.generate(0, GenerationRequest(producer, max_new_tokens=0))
    engine.append(0, ids[split:]); engine.generate(0, GenerationRequest(consumer, max_new_tokens=0, return_logits=True))

``split`` is where the shared cache ends, as in the cache-sharing-aware training loss (``--shared_split``): ``last``
(default: everything but the last context token, so the consumer's logits cover every output token, the first one
included) or ``piece`` (the context up to its last prompt piece, e.g. ``"\\nAction: \\n### Response:\\n"``, which the
consumer prefills itself in the agent loop). The scored positions are those whose next token is an output token (or
the EOS). Under ``non_shared`` the consumer has no cache of its own and processes everything itself: that is the
reference. For each scheme the report gives, over the scored positions, mean KL(non_shared ‖ scheme) of the
next-token distributions and top-1 agreement, per consumer role and overall (token-weighted). The ``non_shared`` row
compares the reference with itself (0 and 1 by construction).

Held-out examples: the last ``--holdout`` examples of each role file; ``--limit`` of them are drawn with a seed.
With one role, or adapters whose B = 0, every scheme equals ``non_shared`` (KL 0 up to float error).

The ``fidelity`` command (:mod:`eval_suite.diagnostics.fidelity_command`) and ``droidspeak-select`` run on this module::

    lragent fidelity --benchmark hotpotqa --adapters data/adapters/hotpotqa_sharedA --limit 50 --out out/fid
    lragent fidelity --benchmark hotpotqa --adapter_init random --limit 3 --max_context_tokens 512 --out /tmp/f
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eval_suite.report import markdown_table
from lragent.agents.prompts import last_piece_start
from lragent.engine import Engine, GenerationRequest
from lragent.lora_model import MultiLoraModel
from lragent.paths import DATA_DIR
from lragent.schemes import SCHEMES, Scheme

SHARED_SPLITS: tuple[str, ...] = ("last", "piece")
POOLS: tuple[str, ...] = ("heldout", "dev", "val")
VAL_FRACTION, VAL_SEED = 0.05, 0
"""The validation split of ``configs/embedded_*.yaml`` (``data.val_fraction``, ``data.seed``): ``--pool val``."""


# ------------------------------------------------------------------------------------------------------- examples
@dataclass(frozen=True)
class FidelityExample:
    """One tokenised role example.

    Attributes:
        role: the consumer role (the example's own role).
        source: ``file:line`` of the record.
        ids: ``context + output + [EOS]`` token ids.
        context_len: how many leading ids are the (possibly left-truncated) input.
        prefix_len: how many leading ids precede the input's last prompt piece (0: the input is one piece).
    """

    role: str
    source: str
    ids: tuple[int, ...]
    context_len: int
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.context_len < len(self.ids):
            raise ValueError(f"{self.source}: context_len {self.context_len} must be in 1..{len(self.ids) - 1}")
        if not 0 <= self.prefix_len < self.context_len:
            raise ValueError(f"{self.source}: prefix_len {self.prefix_len} must be in 0..{self.context_len - 1}")

    def split(self, mode: str) -> int:
        """Tokens the producer encodes: ``last`` -> ``context_len - 1``, ``piece`` -> ``prefix_len``."""
        if mode not in SHARED_SPLITS:
            raise ValueError(f"shared split {mode!r} unknown: allowed {', '.join(SHARED_SPLITS)}")
        return self.context_len - 1 if mode == "last" else self.prefix_len


def _leading_specials(tokenizer: Any) -> int:
    """How many special tokens the tokenizer puts before a text (e.g. 1 for a BOS)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for lead in range(len(full) - len(plain) + 1):
        if full[lead : lead + len(plain)] == plain:
            return lead
    return 0


def tokenize_example(
    tokenizer: Any, role: str, source: str, text_in: str, text_out: str, max_context_tokens: int | None = None
) -> FidelityExample:
    """Tokenises ``input`` (with leading special tokens) ``+ output + EOS``; the input is cut from the left."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; one is needed to end every output")
    lead = _leading_specials(tokenizer)
    head = tokenizer("", add_special_tokens=True)["input_ids"][:lead]
    ctx = head + tokenizer(text_in, add_special_tokens=False)["input_ids"]
    piece = last_piece_start(text_in)
    prefix = 0 if piece == 0 else lead + len(tokenizer(text_in[:piece], add_special_tokens=False)["input_ids"])
    out = tokenizer(text_out, add_special_tokens=False)["input_ids"] + [eos]
    if max_context_tokens is not None and len(ctx) > max_context_tokens:
        cut = len(ctx) - max_context_tokens
        ctx = ctx[:lead] + ctx[lead + cut :]
        prefix = prefix - cut if prefix - cut > lead else 0
    prefix = max(0, min(prefix, len(ctx) - 1))
    return FidelityExample(role, source, tuple(int(i) for i in ctx + out), len(ctx), prefix)


def heldout_indices(n: int, holdout: int, limit: int | None, seed: int, role: str, pool: str = "heldout") -> list[int]:
    """Indices of the examples to use among ``n``.

    Args:
        n: examples in the role file.
        holdout: size of the held-out tail (the last ``holdout`` examples).
        limit: draw this many of the pool with ``random.Random(f"{seed}:{role}")`` (None: the whole pool).
        seed: seed of the draw.
        role: role name (part of the seed).
        pool: ``heldout`` (the tail), ``dev`` (the ``holdout`` examples just before the tail, for tuning) or ``val``
            (the validation split of the embedded training configs, ``val_fraction`` 0.05 with data seed 0: the only
            examples that adapters trained by those configs never saw; ``holdout`` is then ignored).
    """
    if holdout < 1:
        raise ValueError(f"holdout must be >= 1, got {holdout}")
    tail = list(range(max(0, n - holdout), n))
    if pool == "val":
        from datamodules.role_examples import split_indices

        tail = split_indices(n, VAL_FRACTION, VAL_SEED, role)[1]
    elif pool == "dev":
        tail = list(range(max(0, n - 2 * holdout), max(0, n - holdout)))
    elif pool != "heldout":
        raise ValueError(f"pool {pool!r} unknown: allowed {', '.join(POOLS)}")
    if limit is not None and limit < len(tail):
        tail = sorted(random.Random(f"{seed}:{role}").sample(tail, limit))
    return tail


def load_role_examples(
    benchmark: str,
    roles: Sequence[str],
    tokenizer: Any,
    *,
    holdout: int = 100,
    limit: int | None = None,
    seed: int = 0,
    max_context_tokens: int | None = None,
    pool: str = "heldout",
    data_dir: Path = DATA_DIR,
) -> list[FidelityExample]:
    """Held-out examples of every role from ``data/trajectories/{benchmark}/{role}.jsonl.gz``, tokenised."""
    examples: list[FidelityExample] = []
    for role in roles:
        path = data_dir / "trajectories" / benchmark / f"{role}.jsonl.gz"
        if not path.is_file():
            raise FileNotFoundError(f"role examples {path} are missing")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        for i in heldout_indices(len(lines), holdout, limit, seed, role, pool):
            rec = json.loads(lines[i])
            examples.append(
                tokenize_example(
                    tokenizer, role, f"{path.name}:{i + 1}", rec["input"], rec["output"], max_context_tokens
                )
            )
    return examples


# ---------------------------------------------------------------------------------------------------- measurement
def producer_for(roles: Sequence[str], consumer: str, producer: str) -> str:
    """``next``: the role after ``consumer`` in the model's order (wrapping; itself when alone); else ``producer``."""
    if producer == "next":
        return roles[(list(roles).index(consumer) + 1) % len(roles)]
    if producer not in roles:
        raise ValueError(f"producer {producer!r} unknown: allowed next or one of {', '.join(roles)}")
    return producer


@torch.no_grad()
def scheme_logits(
    model: MultiLoraModel,
    scheme: str | Scheme,
    example: FidelityExample,
    producer: str,
    *,
    shared_split: str = "last",
    droidspeak_layers: Sequence[int] | None = None,
    use_kernel: bool = True,
) -> torch.Tensor:
    """The consumer's next-token logits at the scored positions under ``scheme``.

    Returns:
        ``(n, vocab)`` float32 logits of positions ``context_len - 1 .. len(ids) - 2`` (they predict the output
        tokens and the EOS).
    """
    ids = list(example.ids)
    split = example.split(shared_split)
    # one trajectory, grown as needed: the engine a MultiAgentSession would open (capacity 1024, growable)
    engine = Engine(model, scheme, capacity=1024, growable=True, droidspeak_layers=droidspeak_layers,
                    use_kernel=use_kernel)  # fmt: skip
    if split > 0:
        engine.append(0, ids[:split])
        engine.generate(0, GenerationRequest(model.router.id(producer), max_new_tokens=0))
    engine.append(0, ids[split:])
    res = engine.generate(0, GenerationRequest(model.router.id(example.role), max_new_tokens=0, return_logits=True))
    first = res.logit_positions[0]
    start, end = example.context_len - 1, len(ids) - 1
    assert first <= start and res.logit_positions[-1] >= end - 1, (first, start, res.logit_positions[-1])
    return res.logits[start - first : end - first]


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(reference ‖ other) (float64, nats) and top-1 agreement (bool) of ``(n, vocab)`` logits."""
    if reference.shape != other.shape:
        raise ValueError(f"logit shapes differ: {tuple(reference.shape)} vs {tuple(other.shape)}")
    lp = F.log_softmax(reference.double(), dim=-1)
    lq = F.log_softmax(other.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    return kl, reference.argmax(-1) == other.argmax(-1)


class _Acc:
    """Token-weighted sums of KL and agreement."""

    def __init__(self) -> None:
        self.kl = 0.0
        self.agree = 0
        self.tokens = 0
        self.examples = 0

    def add(self, kl: torch.Tensor, agree: torch.Tensor) -> None:
        self.kl += float(kl.sum())
        self.agree += int(agree.sum())
        self.tokens += int(kl.numel())
        self.examples += 1

    def result(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        return {"kl": self.kl / n, "top1": self.agree / n, "tokens": self.tokens, "examples": self.examples}


def run_fidelity(
    model: MultiLoraModel,
    examples: Sequence[FidelityExample],
    schemes: Sequence[str] = SCHEMES,
    *,
    producer: str = "next",
    shared_split: str = "last",
    droidspeak_layers: Sequence[int] | None = None,
    use_kernel: bool = True,
    progress: bool = False,
) -> dict:
    """Fidelity of every scheme against ``non_shared`` on ``examples``.

    Returns:
        ``{"schemes": {scheme: {role | "overall": {"kl", "top1", "tokens", "examples"}}}, "examples": [...]}``,
        per example the producer, token counts and every scheme's mean KL and agreement.
    """
    from tqdm.auto import tqdm

    roles = list(model.router.roles)
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise ValueError(f"unknown schemes {bad}: allowed {', '.join(SCHEMES)}")
    acc = {s: {r: _Acc() for r in (*roles, "overall")} for s in schemes}
    per_example = []
    for ex in tqdm(examples, desc="fidelity", unit="ex", disable=not progress):
        prod = producer_for(roles, ex.role, producer)
        ref = scheme_logits(model, "non_shared", ex, prod, shared_split=shared_split, use_kernel=use_kernel)
        row: dict[str, Any] = {"source": ex.source, "role": ex.role, "producer": prod, "tokens": len(ex.ids)}
        for s in schemes:
            if s == "non_shared":
                logits = ref
            else:
                layers = droidspeak_layers if s == "droidspeak" else None
                logits = scheme_logits(
                    model, s, ex, prod, shared_split=shared_split, droidspeak_layers=layers, use_kernel=use_kernel
                )
            kl, agree = compare(ref, logits)
            acc[s][ex.role].add(kl, agree)
            acc[s]["overall"].add(kl, agree)
            row[s] = {"kl": float(kl.mean()), "top1": float(agree.double().mean())}
        per_example.append(row)
    results = {s: {r: a.result() for r, a in acc[s].items() if a.examples} for s in schemes}
    return {"schemes": results, "examples": per_example}


def render_markdown(result: dict, title: str = "Fidelity against non_shared") -> str:
    """Scheme × (KL, top-1 agreement) per consumer role and overall."""
    schemes = list(result["schemes"])
    cols = [c for c in next(iter(result["schemes"].values()))] if schemes else []
    header = ["Scheme"] + [f"{c} {m}" for c in cols for m in ("KL", "top-1 %")]
    rows = []
    for s in schemes:
        cells = [s]
        for c in cols:
            v = result["schemes"][s].get(c)
            cells += ["–", "–"] if v is None else [f"{v['kl']:.3e}", f"{100 * v['top1']:.2f}"]
        rows.append(cells)
    counts = ", ".join(f"{c}: {result['schemes'][schemes[0]][c]['tokens']} tokens" for c in cols) if schemes else ""
    head = f"# {title}\n\nKL(non_shared ‖ scheme) in nats per scored token; top-1 agreement in %. {counts}.\n\n"
    body = head + markdown_table(header, rows)
    if "provenance" in result:
        from lragent.provenance import provenance_footer

        body += provenance_footer(result["provenance"])
    return body


# ------------------------------------------------------------------------------------- checks the commands share
BENCHMARKS: tuple[str, ...] = ("hotpotqa", "scienceqa")


def check_example_args(
    benchmark: str, holdout: int, limit: int, max_context_tokens: int | None, shared_split: str
) -> None:
    """Checks the example options of ``fidelity`` and ``droidspeak-select``; one-line ``ValueError`` otherwise."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}: allowed {', '.join(BENCHMARKS)}")
    for name, value in (("holdout", holdout), ("limit", limit)):
        if value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if max_context_tokens is not None and max_context_tokens < 2:
        raise ValueError(f"--max_context_tokens must be >= 2, got {max_context_tokens}")
    if shared_split not in SHARED_SPLITS:
        raise ValueError(f"--shared_split {shared_split!r} unknown: allowed {', '.join(SHARED_SPLITS)}")


def check_producer(model: MultiLoraModel, producer: str) -> None:
    """``producer`` is ``next`` or one of the model's roles."""
    if producer != "next" and producer not in model.router.roles:
        raise ValueError(f"--producer {producer!r} unknown: allowed next or {', '.join(model.router.roles)}")
