"""How much of the shared pass a *reverse* reuse could skip on cross-role batches (issue 19, sizing only).

Absorption (``MultiLoraModule.absorption_plan``) scores a source row's plain term inside its consumer's shared pass.
The reverse would run a row's shared pass without its context: when another row ``b`` of the batch starts with row
``j``'s first ``split_j`` tokens (e.g. ``b`` continues ``j``'s trajectory) and ``b``'s role is ``j``'s producer,
``b``'s plain pass already holds the producer's states over ``j``'s context, and only ``j``'s consumer rows would need
computing (a tree-shaped attention in the training pass, not built). This script
counts, over one epoch of ``fit``'s batches, the rows where that holds and the share of the shared pass's tokens they
would skip.

python scripts/reverse_reuse_share.py [--settings hotpotqa:.tok:4096:t16384 ...] [--producers random prefix] \
    [--out results/prefix_reuse/reverse_reuse]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from cross_role_cost_model import parse_setting, planned_batches  # noqa: E402

from lragent.provenance import provenance  # noqa: E402


def reverse_rows(batch: dict, producers: list[int], split: list[int]) -> set[int]:
    """Rows ``j`` whose shared pass could read its context from another row's plain pass: some row ``b`` of the
    batch has ``j``'s producer as its role and starts with ``j``'s first ``split_j`` tokens (compared by prefix hash;
    both rows start at position 0)."""
    from datamodules.cross_role_prefixes import prefix_hashes

    roles, lengths = batch["host"]["role_ids"], batch["host"]["lengths"]
    ids = batch["input_ids"].tolist()
    hashes = [prefix_hashes(row[:n]) for row, n in zip(ids, lengths, strict=True)]
    return {
        j
        for j in range(len(lengths))
        if any(  # b == j never passes: a producer is another role than the row's own
            roles[b] == producers[j] and split[j] <= lengths[b] and hashes[b][split[j]] == hashes[j][split[j]]
            for b in range(len(lengths))
        )
    }


def count(setting: str, producer: str) -> dict:
    """Rows absorbed, reverse-reusable and both, and the share of the shared pass's tokens the reverse would skip,
    over one epoch of ``setting`` (:func:`cross_role_cost_model.parse_setting`)."""
    out = {"setting": setting, "producer": producer, "rows": 0, "absorbed": 0, "reverse": 0, "both": 0}
    tokens = skipped = 0
    for batch, producers, plan, split in planned_batches(*parse_setting(setting), producer):
        rev = reverse_rows(batch, producers, split)
        out["rows"] += len(split)
        out["absorbed"] += len(plan)
        out["reverse"] += len(rev)
        out["both"] += len(rev & set(plan))
        tokens += sum(batch["host"]["lengths"])
        skipped += sum(split[j] for j in rev)
    out["shared_pass_tokens_skipped"] = skipped / max(1, tokens)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--settings", nargs="+",
        default=["hotpotqa:.tok:4096:t16384", "scienceqa:.tok:4096:t16384", "hotpotqa:byte:4096:b4",
                 "hotpotqa:byte:16384:t16384"],
        help="benchmark:tokenizer:seq_len:b<batch size> or :t<max_tokens>",
    )  # fmt: skip
    ap.add_argument("--producers", nargs="+", default=["random", "prefix"])
    ap.add_argument("--out", default="results/prefix_reuse/reverse_reuse")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"rows": [], "provenance": provenance(device="cpu")}
    lines = [
        "# Reverse reuse on cross-role batches: rows whose shared pass could read its context from another row's "
        "plain pass (a count, not built)",
        "",
        "| setting | producer | rows | absorbed | reverse-reusable | both | shared-pass tokens skipped |",
        "| :--- | :--- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for setting in args.settings:
        for producer in args.producers:
            r = count(setting, producer)
            report["rows"].append(r)
            lines.append(
                f"| {setting} | {producer} | {r['rows']} | {r['absorbed']} | {r['reverse']} | {r['both']} | "
                f"{100 * r['shared_pass_tokens_skipped']:.1f}% |"
            )
            print(lines[-1], flush=True)
            out.with_suffix(".json").write_text(json.dumps(report, indent=1))  # written as it goes
    prov = report["provenance"]
    lines += ["", "---", f"Produced on {prov['device']['name']}, commit {prov['git_commit']}, {prov['utc']}. "
              f"Command: `{prov['command']}`"]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
