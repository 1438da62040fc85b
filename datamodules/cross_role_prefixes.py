"""Examples whose context begins with another role's whole example (the cache-sharing loss's exact reuse).

In the bundled trajectories an action or reflect example's context often starts with the plan example of the same
step: its input and output, token for token. Under causal attention the rows of those ``k`` tokens depend only on the
tokens and the role that encodes them. So when that other role is the producer of the cache-sharing-aware term, the
shared pass's first ``k`` rows are exactly that example's plain pass, and the example's plain term can be scored inside
the shared pass instead of in a sequence of its own
(:meth:`~lit_modules.multi_lora_module.MultiLoraModule.compute_loss`).

- :func:`prefix_sources`: within one batch, for each row, the other rows whose whole example starts it.
- :func:`cross_role_groups`: over a data set, pairs (source, consumer) to keep in one batch
  (:class:`~datamodules.role_examples.LengthBucketBatchSampler`'s ``groups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_MOD = (1 << 61) - 1
_BASE = 1_000_003


class _Example(Protocol):
    input_ids: Sequence[int]
    context_len: int
    role_id: int
    segments: tuple


def prefix_hashes(ids: Sequence[int]) -> list[int]:
    """``h[n]``: a polynomial hash of ``ids[:n]``, for every ``n`` in ``0..len(ids)``."""
    h = [0]
    for t in ids:
        h.append((h[-1] * _BASE + t + 1) % _MOD)
    return h


def whole_length(example: _Example) -> int:
    """Tokens of an example without its final EOS: the rows a consumer's context can share with it."""
    return len(example.input_ids) - 1


def _can_source(example: _Example) -> bool:
    # a packed example scores several segments: it is no single example a context could start with
    return not example.segments and whole_length(example) > example.context_len


def prefix_sources(examples: Sequence[_Example]) -> list[list[tuple[int, int]]]:
    """For every row of a batch, the rows of another role whose whole example (without EOS) starts its context.

    Args:
        examples: the batch's examples, in row order.

    Returns:
        Per row ``b``, ``(j, k)`` pairs, longest ``k`` first: row ``j`` has another role, ``k = whole_length(j)`` and
        ``input_ids[b][:k] == input_ids[j][:k]`` with ``k < context_len[b]`` (the shared tokens lie in ``b``'s
        context). Empty lists when there is none.
    """
    out: list[list[tuple[int, int]]] = []
    for b, eb in enumerate(examples):
        found = []
        for j, ej in enumerate(examples):
            k = whole_length(ej)
            if j == b or ej.role_id == eb.role_id or not _can_source(ej) or k >= eb.context_len:
                continue
            if list(eb.input_ids[:k]) == list(ej.input_ids[:k]):
                found.append((j, k))
        out.append(sorted(found, key=lambda p: (-p[1], p[0])))
    return out


def cross_role_groups(examples: Sequence[_Example]) -> list[list[int]]:
    """Pairs ``[source, consumer]`` of a data set to batch together, each example in at most one pair.

    Consumers are taken longest first; each gets the longest unused example of another role whose whole example
    starts its context (:func:`prefix_sources`' condition). The examples left over are groups of one.

    Returns:
        Groups of indices into ``examples`` (every index exactly once), pairs as ``[source, consumer]``.
    """
    by_key: dict[tuple[int, int], list[int]] = {}  # (length, hash) of a whole example -> its indices
    for j, e in enumerate(examples):
        if _can_source(e):
            k = whole_length(e)
            by_key.setdefault((k, prefix_hashes(e.input_ids[:k])[-1]), []).append(j)
    lengths = sorted({k for k, _ in by_key})
    used: set[int] = set()
    groups: list[list[int]] = []
    for c in sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i)):
        if c in used:
            continue
        e = examples[c]
        h = prefix_hashes(e.input_ids[: e.context_len])
        pick = None
        for k in reversed([n for n in lengths if n < e.context_len]):
            cands = [
                j
                for j in by_key.get((k, h[k]), ())
                if j != c and j not in used and examples[j].role_id != e.role_id
                and list(examples[j].input_ids[:k]) == list(e.input_ids[:k])  # no hash collision
            ]  # fmt: skip
            if cands:
                pick = cands[0]
                break
        if pick is not None:
            used.update((pick, c))
            groups.append([pick, c])
    groups += [[i] for i in range(len(examples)) if i not in used]
    return groups
