"""Prefix packing: examples of one role whose text is a prefix of a longer example's context ride along in it.

The role files are cut from whole agent trajectories, so the examples of one trajectory nest: the input of a later
plan step contains every earlier plan step's input and output. Scoring an earlier example inside the later one's
sequence is *exact*: causal attention makes the prediction at a position depend only on the tokens up to it, and
those tokens are the earlier example's own. Only the targets differ: the earlier example's EOS becomes a label at a
position whose next input token is not EOS, which the unshifted-label layout (``labels[t]`` is what position
``t - 1`` must predict) allows.

So one forward over the longest example of a chain trains every example of the chain, and an epoch still sees every
example exactly once. On the bundled HotpotQA trajectories this cuts the training tokens about 3.4x (see
``python cli.py data-stats``). Packing is for the plain loss only: the cache-sharing-aware loss splits every
sequence at one place, which a sequence with several supervised segments does not have.

The check is on token ids, not text: an example is packed into a host only when its ``input_ids`` without the EOS
are literally the first tokens of the host's context, so tokenisation differences at the boundaries can never
change what is trained.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

from datamodules.records import TokenizedExample


def _body(example: TokenizedExample) -> tuple[int, ...]:
    """The example's tokens without its trailing EOS: what a host's context must start with."""
    return tuple(example.input_ids[:-1])


def _label_positions(example: TokenizedExample) -> range:
    """Unshifted label positions of an example's output + EOS."""
    return range(example.context_len, len(example.input_ids))


def pack_prefix_chains(examples: Sequence[TokenizedExample]) -> list[TokenizedExample]:
    """Packs every example that is a prefix of another example's context (same role) into a host sequence.

    A *host* is an example that no other example of its role covers. Every other example is attached to one host
    whose context starts with its tokens (without the EOS); its output labels are added to the host as a
    ``segments`` entry. An example whose label positions would collide with a label already in the host stays a
    sequence of its own.

    Args:
        examples: tokenised examples (any roles, any order).

    Returns:
        the sequences to train on: every host with its attached examples in ``segments``, and every example that
        could not be attached, in the order of the first example of each in ``examples``. Every input example is
        scored exactly once: ``sum(1 + len(s.segments) for s in result) == len(examples)``.
    """
    by_role: dict[int, list[int]] = {}
    for i, e in enumerate(examples):
        if e.segments:
            raise ValueError(f"{e.source}: example is already packed")
        by_role.setdefault(e.role_id, []).append(i)
    host_of: dict[int, int] = {}  # example index -> host example index
    for indices in by_role.values():
        # An example is covered when some other example's context is strictly longer and starts with its body.
        contexts = sorted((tuple(examples[i].input_ids[: examples[i].context_len]), i) for i in indices)
        keys = [c for c, _ in contexts]

        def cover(i: int, pool: list[tuple[tuple[int, ...], int]], pool_keys: list[tuple[int, ...]]) -> int | None:
            body = _body(examples[i])
            k = bisect.bisect_left(pool_keys, body)
            while k < len(pool) and pool_keys[k][: len(body)] == body:
                ctx, j = pool[k]
                if j != i and len(ctx) > len(body):
                    return j
                k += 1
            return None

        hosts = [(c, i) for c, i in contexts if cover(i, contexts, keys) is None]
        host_keys = [c for c, _ in hosts]
        host_ids = {i for _, i in hosts}
        for i in indices:
            if i in host_ids:
                continue
            # Covered by some example, hence (following the chain of longer contexts) by some host.
            j = cover(i, hosts, host_keys)
            assert j is not None, "a covered example must reach a host"
            host_of[i] = j
    attached: dict[int, list[int]] = {}
    for i, j in host_of.items():
        attached.setdefault(j, []).append(i)
    solo: set[int] = set()
    packed: dict[int, TokenizedExample] = {}
    for j, members in attached.items():
        host = examples[j]
        taken = set(_label_positions(host))
        segments = []
        for i in sorted(members, key=lambda i: examples[i].context_len):
            positions = set(_label_positions(examples[i]))
            if positions & taken:
                solo.add(i)
                continue
            taken |= positions
            e = examples[i]
            segments.append((e.context_len, tuple(e.input_ids[e.context_len :])))
        packed[j] = replace(host, segments=tuple(segments))
    out: list[TokenizedExample] = []
    for i, e in enumerate(examples):
        if i in packed:
            out.append(packed[i])
        elif i not in host_of or i in solo:
            out.append(e)
    return out
