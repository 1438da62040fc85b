"""Forking an engine row: a new trajectory that starts with another's first tokens, its caches copied.

A served prompt that parts from a held trajectory (another episode with the same system prompt, a client that
re-sends an earlier state) continues from the part they share. The shared part's caches are copied, slot by slot,
from the trajectory's row into a spare row; the copy is exactly the state the source would be in if it were cut to
that length (:meth:`lragent.engine.Engine.truncate`), so the requesting role then computes what the scheme asks of it
(:meth:`lragent.sharing.SharingScheme.plan`) as it would on the source.

Which slots a row has is the scheme's business: per role where the cache is not shared (``non_shared``'s K/V,
``base_shared``'s V_lr), one per row otherwise, plus DroidSpeak's hidden states. Every slot of the row is copied.
"""

from __future__ import annotations

import torch

from lragent.engine import Engine
from lragent.sharing import Trajectory


@torch.no_grad()
def fork_row(engine: Engine, src: int, dst: int, n: int) -> None:
    """Makes row ``dst`` hold the first ``n`` tokens of row ``src``'s trajectory, with their caches.

    Args:
        engine: the engine (neither row generating).
        src: the source row.
        dst: the destination row (its trajectory is replaced).
        n: tokens to keep (at most the source's length).
    """
    if src == dst:
        raise ValueError(f"fork_row: source and destination are the same row {src}")
    source = engine.traj[src]
    if not 0 <= n <= len(source.ids):
        raise ValueError(f"fork_row: {n} tokens asked of a trajectory of {len(source.ids)}")
    sch, pool = engine.scheme, engine.pool
    roles = range(len(engine.model.router))
    lengths = {name: min(length, n) for name, length in source.lengths.items()}
    upto = max(lengths.values(), default=0)  # positions any cache holds (the rest is stale)
    if upto:
        kv = sorted({(sch.kv_slot(src, r), sch.kv_slot(dst, r)) for r in roles})
        for layer in range(pool.layout.n_layers):
            for s, d in kv:
                pool.k[layer][d, :, :upto].copy_(pool.k[layer][s, :, :upto])  # (H_kv, upto, D)
                pool.v[layer][d, :, :upto].copy_(pool.v[layer][s, :, :upto])
        if pool.v_lr is not None:
            lr = sorted({(sch.lr_slot(src, r), sch.lr_slot(dst, r)) for r in roles})
            for layer in range(pool.layout.n_layers):
                for s, d in lr:
                    pool.v_lr[layer][d, :upto].copy_(pool.v_lr[layer][s, :upto])  # (upto, r)
        if pool.hidden:
            s, d = sch.hidden_slot(src), sch.hidden_slot(dst)
            for buf in pool.hidden.values():
                buf[d, :upto].copy_(buf[s, :upto])  # (upto, hidden)
    engine.traj[dst] = Trajectory(
        ids=list(source.ids[:n]),
        lengths=lengths,
        seen={role: min(seen, n) for role, seen in source.seen.items()},
    )


def abandon_rows(engine: Engine, rows: list[int]) -> None:
    """Ends the generation of ``rows`` without a result and empties them: after a decode step that failed (out of
    memory), when their caches can no longer be trusted. The engine has no abort of its own; this releases each row
    as its own collection of a finished row does (the row points at the scratch slots again), then resets it."""
    for row in rows:
        engine._pending.pop(row, None)
        engine._release(row)
        engine.reset(row)
