"""How much of the shared pass could come from another role's plain pass: the share of the training tokens whose rows
another role's whole example already computes (issue 19, the λ term's cost).

python scripts/prefix_reuse_share.py [--benchmarks hotpotqa scienceqa] [--tokenizer default|byte] [--max_length 4096]
                                     [--out results/prefix_reuse]

Under causal attention, the rows of tokens ``[0, k)`` depend only on those tokens and the role that encodes them. So
when an example of role ``p`` (its input, output, without the EOS) is the first ``k`` tokens of another example's
context, before its split (``prefix_len``), the shared pass with producer ``p`` recomputes exactly the rows that
``p``'s plain pass already has. For every example this counts the longest such ``k`` over the examples of the other
roles, and reports ``sum k / sum tokens``. That is an upper bound on what reuse could save: it assumes the matching
example is in the same batch and that the drawn producer is its role.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datamodules.cross_role_prefixes import prefix_hashes  # noqa: E402
from datamodules.role_examples import read_local_records, resolve_tokenizer, tokenize_example  # noqa: E402
from lragent.provenance import provenance  # noqa: E402
from lragent.roles import DEFAULT_ROLES  # noqa: E402


def reusable_lengths(examples: list[tuple[int, list[int], int]]) -> list[int]:
    """For each ``(role, ids, split)``, the longest ``k <= split`` such that ``ids[:k]`` is another role's whole example
    (``ids`` without its final EOS); 0 when there is none.

    Args:
        examples: ``(role id, token ids ending with EOS, split)`` per example.
    """
    owners: dict[tuple[int, int], set[int]] = {}  # (length, hash) -> roles whose whole example it is
    for role, ids, _ in examples:
        body = ids[:-1]
        owners.setdefault((len(body), prefix_hashes(body)[-1]), set()).add(role)
    lengths = sorted({n for n, _ in owners})
    out = []
    for role, ids, split in examples:
        h = prefix_hashes(ids[:split])
        best = 0
        for n in lengths:
            if n > split:
                break
            roles = owners.get((n, h[n]))
            if roles and roles - {role}:
                best = n
        out.append(best)
    return out


def measure(benchmark: str, tokenizer: object, max_length: int) -> dict:
    examples = []
    for rid, role in enumerate(DEFAULT_ROLES):
        path = ROOT / "data" / "trajectories" / benchmark / f"{role}.jsonl.gz"
        for rec in read_local_records(path):
            e = tokenize_example(tokenizer, rec, rid, max_length)
            examples.append((rid, list(e.input_ids), e.prefix_len))
    k = reusable_lengths(examples)
    tokens = sum(len(ids) for _, ids, _ in examples)
    per_role = {}
    for rid, role in enumerate(DEFAULT_ROLES):
        idx = [i for i, (r, _, _) in enumerate(examples) if r == rid]
        per_role[role] = {
            "examples": len(idx),
            "with_reuse": sum(1 for i in idx if k[i] > 0),
            "reusable_share": sum(k[i] for i in idx) / max(1, sum(len(examples[i][1]) for i in idx)),
        }
    return {
        "examples": len(examples),
        "tokens": tokens,
        "reusable_tokens": sum(k),
        "reusable_share": sum(k) / max(1, tokens),
        "per_role": per_role,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmarks", nargs="+", default=["hotpotqa", "scienceqa"])
    ap.add_argument("--tokenizer", default="default", help="default (the embedded model's) or byte")
    ap.add_argument("--max_length", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "results" / "prefix_reuse"))
    args = ap.parse_args(argv)
    tok = resolve_tokenizer(args.tokenizer)
    res = {b: measure(b, tok, args.max_length) for b in args.benchmarks}
    res["provenance"] = provenance(device="cpu", command=sys.argv)
    res["settings"] = {"tokenizer": args.tokenizer, "max_length": args.max_length}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prefix_reuse_{args.tokenizer}.json").write_text(json.dumps(res, indent=1) + "\n")
    for b in args.benchmarks:
        r = res[b]
        roles = ", ".join(f"{k} {v['reusable_share']:.1%}" for k, v in r["per_role"].items())
        print(f"{b}: {r['reusable_share']:.1%} of {r['tokens']} tokens ({roles})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
