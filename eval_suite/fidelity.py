"""`python cli.py fidelity`: teacher-forced next-token fidelity of each sharing scheme against ``non_shared``.

For a held-out role example (``{"input", "output"}`` of a consumer role), the trajectory is ``input + output + EOS``.
A **producer** role encodes the context into the scheme's cache, then the **consumer** (the example's own role)
processes the rest, teacher-forced, through :class:`~lragent.session.MultiAgentSession`::

    session.append(ids[:split]); session.step(producer, max_new_tokens=0)
    session.append(ids[split:]); session.step(consumer, max_new_tokens=0, return_logits=True)

``split`` is where the shared cache ends, as in the cache-sharing-aware training loss (``--shared-split``): ``last``
(default: everything but the last context token, so the consumer's logits cover every output token, the first one
included) or ``piece`` (the context up to its last prompt piece, e.g. ``"\\nAction: \\n### Response:\\n"``, which the
consumer prefills itself in the agent loop). The scored positions are those whose next token is an output token (or
the EOS). Under ``non_shared`` the consumer has no cache of its own and processes everything itself: that is the
reference. For each scheme the report gives, over the scored positions, mean KL(non_shared ‖ scheme) of the
next-token distributions and top-1 agreement, per consumer role and overall (token-weighted). The ``non_shared`` row
compares the reference with itself (0 and 1 by construction).

Held-out examples: the last ``--holdout`` examples of each role file; ``--limit`` of them are drawn with a seed.
With one role, or adapters whose B = 0, every scheme equals ``non_shared`` (KL 0 up to float error).

Usage::

    python cli.py fidelity --benchmark hotpotqa --adapters runs/hp/adapters --limit 50 --out out/fid
    python cli.py fidelity --benchmark hotpotqa --adapter-init random --limit 3 --max-context-tokens 512 --out /tmp/f
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eval_suite.report import check_writable, markdown_table, write_json, write_text
from eval_suite.session_runner import add_model_args, model_from_args, validate_model_args
from lragent.agents.prompts import last_piece_start
from lragent.lora_model import MultiLoraModel
from lragent.paths import DATA_DIR
from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession

SHARED_SPLITS: tuple[str, ...] = ("last", "piece")


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
        pool: ``heldout`` (the tail) or ``dev`` (the ``holdout`` examples just before the tail, for tuning).
    """
    if holdout < 1:
        raise ValueError(f"holdout must be >= 1, got {holdout}")
    tail = list(range(max(0, n - holdout), n))
    if pool == "dev":
        tail = list(range(max(0, n - 2 * holdout), max(0, n - holdout)))
    elif pool != "heldout":
        raise ValueError(f"pool {pool!r} unknown: allowed heldout, dev")
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
    scheme: str,
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
    session = MultiAgentSession(model, scheme, droidspeak_layers=droidspeak_layers, use_kernel=use_kernel)
    if split > 0:
        session.append(ids[:split])
        session.step(producer, max_new_tokens=0)
    session.append(ids[split:])
    res = session.step(example.role, max_new_tokens=0, return_logits=True)
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


# ------------------------------------------------------------------------------------------------------------ CLI
def add_common_args(p: argparse.ArgumentParser) -> None:
    """Model, adapter and example arguments shared by ``fidelity`` and ``droidspeak_select``."""
    p.add_argument("--benchmark", default="hotpotqa", help="hotpotqa or scienceqa (its role example files)")
    add_model_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the adapter init and of the example draw")
    p.add_argument("--holdout", type=int, default=100, help="held-out tail of each role file")
    p.add_argument("--limit", type=int, default=20, help="examples per role drawn from the held-out tail")
    p.add_argument("--max-context-tokens", type=int, default=None, help="cut each context from the left to this")
    p.add_argument("--producer", default="next", help="next (the next role, wrapping) or a fixed role name")
    p.add_argument("--shared-split", default="last", help="last or piece: where the shared cache ends")
    p.add_argument("--device", default=None, help="cpu or cuda (default cuda when available)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-kernel", action="store_true", help="use the PyTorch attention path even on CUDA")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cli.py fidelity", description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--scheme", default="all", help=f"one of {', '.join(SCHEMES)}, a comma list, or all")
    p.add_argument("--droidspeak-config", default=None, help="JSON/YAML with droidspeak_layers (droidspeak_select)")
    p.add_argument("--out", default="fidelity_out", help="output directory (fidelity.json, fidelity.md)")
    return p


def validate_common(args: argparse.Namespace) -> None:
    """Checks the shared arguments; raises ValueError / FileNotFoundError with one-line messages."""
    if args.benchmark not in ("hotpotqa", "scienceqa"):
        raise ValueError(f"unknown benchmark {args.benchmark!r}: allowed hotpotqa, scienceqa")
    validate_model_args(args, exactly_one=True)
    for name in ("holdout", "limit", "rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_context_tokens is not None and args.max_context_tokens < 2:
        raise ValueError(f"--max-context-tokens must be >= 2, got {args.max_context_tokens}")
    if args.shared_split not in SHARED_SPLITS:
        raise ValueError(f"--shared-split {args.shared_split!r} unknown: allowed {', '.join(SHARED_SPLITS)}")


def build_model(args: argparse.Namespace) -> tuple[MultiLoraModel, Any]:
    """Model and tokenizer for the CLI (adapters loaded or initialised), checked against ``--producer``."""
    model, tokenizer = model_from_args(args)
    if args.producer != "next" and args.producer not in model.router.roles:
        raise ValueError(f"--producer {args.producer!r} unknown: allowed next or {', '.join(model.router.roles)}")
    return model, tokenizer


def examples_from_args(args: argparse.Namespace, model: MultiLoraModel, tokenizer: Any, pool: str) -> list:
    return load_role_examples(
        args.benchmark, list(model.router.roles), tokenizer, holdout=args.holdout, limit=args.limit, seed=args.seed,
        max_context_tokens=args.max_context_tokens, pool=pool,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from eval_suite.run_eval import load_droidspeak_config, parse_schemes
    from lragent.command import parse_with_config

    args = parse_with_config(make_parser(), argv)
    if isinstance(args, int):  # --print_config done (0), or a bad --config (2)
        return args
    try:
        validate_common(args)
        check_writable(args.out, is_dir=True)
        schemes = parse_schemes(args.scheme)
        if "non_shared" not in schemes:
            schemes = ["non_shared", *schemes]
        layers = load_droidspeak_config(args.droidspeak_config) if args.droidspeak_config else None
        model, tokenizer = build_model(args)
        examples = examples_from_args(args, model, tokenizer, "heldout")
        result = run_fidelity(
            model, examples, schemes, producer=args.producer, shared_split=args.shared_split,
            droidspeak_layers=layers, use_kernel=not args.no_kernel, progress=not args.quiet,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result["config"] = {
        "benchmark": args.benchmark, "model": args.model,
        "adapters": str(Path(args.adapters).resolve()) if args.adapters else f"init:{args.adapter_init}",
        "seed": args.seed, "holdout": args.holdout, "limit": args.limit, "producer": args.producer,
        "shared_split": args.shared_split, "max_context_tokens": args.max_context_tokens,
        "droidspeak_layers": layers, "dtype": args.dtype,
    }  # fmt: skip
    from lragent.provenance import provenance

    command = None if argv is None else ["cli.py", "fidelity", *argv]  # None: this process's own command line
    result["provenance"] = provenance(
        dtype=args.dtype, device=str(next(model.parameters()).device.type), command=command
    )
    out = Path(args.out)  # created by check_writable before the work
    write_json(out / "fidelity.json", result)
    write_text(out / "fidelity.md", render_markdown(result))
    for s, v in result["schemes"].items():
        print(f"{s:15s} KL {v['overall']['kl']:.3e}  top-1 {100 * v['overall']['top1']:.2f}%")
    print(f"-> {out / 'fidelity.json'}, {out / 'fidelity.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
