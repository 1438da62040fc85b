"""Examples whose context begins with another role's whole example (the cache-sharing loss's exact reuse).

In the bundled trajectories an action or reflect example's context often starts with the plan example of the same
step: its input and output, token for token. Under causal attention the rows of those ``k`` tokens depend only on the
tokens and the role that encodes them. So when that other role is the producer of the cache-sharing-aware term, the
shared pass's first ``k`` rows are exactly that example's plain pass, and the example's plain term can be scored inside
the shared pass instead of in a sequence of its own
(:meth:`~lit_modules.multi_lora_module.MultiLoraModule.compute_loss`).

- :func:`prefix_sources`: within one batch, for each row, the other rows whose whole example starts it.
- :func:`cross_role_groups`: over a data set, chains (source, its consumer, that one's consumer ...) to keep in one
  batch (:class:`~datamodules.role_examples.LengthBucketBatchSampler`'s ``groups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_MOD = (1 << 61) - 1
_BASE = 1_000_003
# RoleExampleDataModule's default ``cross_role_min_share``: the share at which a λ 0.5 epoch of cross-role batches
# (prefix producer) costs least against a λ 0 epoch of ordinary batches in the step-time model fitted to an H100
# (results/prefix_reuse/min_share_{hotpotqa,scienceqa}.md: 0.6 and 0.7 tie on HotpotQA, 0.6 is lowest on ScienceQA)
CROSS_ROLE_MIN_SHARE = 0.6


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


def starts_with(consumer: _Example, source: _Example) -> bool:
    """Whether ``source`` (another role's example) is, whole and without its EOS, the start of ``consumer``'s context
    (``whole_length(source) < context_len``)."""
    k = whole_length(source)
    return (
        source.role_id != consumer.role_id
        and _can_source(source)
        and k < consumer.context_len
        and list(consumer.input_ids[:k]) == list(source.input_ids[:k])
    )


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
        found = [(j, whole_length(ej)) for j, ej in enumerate(examples) if j != b and starts_with(eb, ej)]
        out.append(sorted(found, key=lambda p: (-p[1], p[0])))
    return out


def cross_role_groups(
    examples: Sequence[_Example], max_group: int = 2, min_length_share: float = 0.0
) -> list[list[int]]:
    """Chains of examples to batch together: each example's longest unused source (an example of another role whose
    whole text starts its context, :func:`prefix_sources`' condition), so that the shared pass of each one can score
    the plain term of the one before it.

    Consumers are taken longest first. An example is the source of at most one consumer and has at most one source,
    so the links form chains (a source is shorter than its consumer: no cycle); a link that would make a chain longer
    than ``max_group`` is not made. The examples left over are groups of one.

    Args:
        examples: the data set's examples.
        max_group: most examples in a chain (at most the batch size).
        min_length_share: a link is made only if the chain it makes has its shortest example at least this share of
            its longest (in tokens). A chain's rows are padded to its longest in the shared pass, so linking a short
            source to a long consumer can cost more padding than absorbing the source saves; 0 links every pair.

    Returns:
        Groups of indices into ``examples`` (every index exactly once), each chain from its first source to its last
        consumer.
    """
    if max_group < 1:
        raise ValueError(f"max_group must be >= 1, got {max_group}")
    if not 0.0 <= min_length_share <= 1.0:
        raise ValueError(f"min_length_share must be in [0, 1], got {min_length_share}")
    by_key: dict[tuple[int, int], list[int]] = {}  # (length, hash) of a whole example -> its indices
    for j, e in enumerate(examples):
        if _can_source(e):
            k = whole_length(e)
            by_key.setdefault((k, prefix_hashes(e.input_ids[:k])[-1]), []).append(j)
    lengths = sorted({k for k, _ in by_key})
    source_of: dict[int, int] = {}
    consumer_of: dict[int, int] = {}
    chain = list(range(len(examples)))  # union-find parent: each example's chain
    size = [1] * len(examples)

    def root(i: int) -> int:
        while chain[i] != i:
            chain[i] = chain[chain[i]]
            i = chain[i]
        return i

    for c in sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i)) if max_group > 1 else ():
        e = examples[c]
        h = prefix_hashes(e.input_ids[: e.context_len])
        for k in reversed([n for n in lengths if n < e.context_len]):
            cands = [
                j
                for j in by_key.get((k, h[k]), ())
                if j != c and j not in consumer_of and size[root(j)] + size[root(c)] <= max_group
                and len(examples[j].input_ids) >= min_length_share * len(examples[root(c)].input_ids)
                and starts_with(e, examples[j])  # also rules out a hash collision
            ]  # fmt: skip
            # j is shorter than c, so it is not yet linked to a source (consumers go longest first): the new chain's
            # shortest is j and its longest is c's chain's last consumer, its root
            if cands:
                j = cands[0]
                source_of[c], consumer_of[j] = j, c
                rj, rc = root(j), root(c)
                chain[rj] = rc
                size[rc] += size[rj]
                break
    groups: list[list[int]] = []
    for head in range(len(examples)):
        if head in source_of:
            continue  # not the start of its chain
        group = [head]
        while group[-1] in consumer_of:
            group.append(consumer_of[group[-1]])
        groups.append(group)
    return groups
