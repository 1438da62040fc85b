"""The five cache-sharing schemes as objects (DESIGN.md §2): each owns its cache layout and its bookkeeping.

A scheme object answers, for trajectory ``row`` and role ``j``:

- which cache slots j reads and writes (:meth:`SharingScheme.kv_slot`, :meth:`~SharingScheme.lr_slot`);
- what j must compute before it generates (:meth:`SharingScheme.plan`): a catch-up over context that is in the cache
  but unseen by j (DroidSpeak's layer-group recompute, ``base_shared``'s LR prefill), then a full-depth forward of
  the positions j's cache lacks;
- how the valid lengths change when j writes (:meth:`SharingScheme.record_forward`), when the trajectory is cut
  (:meth:`SharingScheme.truncate`), and how many bytes the caches hold (:meth:`SharingScheme.component_bytes`).

The engine (:mod:`lragent.engine`) executes the plan without branching on the scheme, and the training loss's
shared-context forward asks the same objects which cache layout a consumer reads (:attr:`decomposed`,
:attr:`consumer_reads_producer_cache`).

| scheme | K/V slots per trajectory | V_lr slots | catch-up |
|---|---|---|---|
| ``non_shared`` | one per role | – | none: j's own cache lacks everything j has not seen |
| ``full_shared`` | one | – | none |
| ``droidspeak`` | one (+ hidden states entering each group) | – | rebuild the groups' K/V from those states as j |
| ``base_shared`` | one (K, V_base) | one per role | LR prefill: full depth as j, K/V_base reused, j's V_lr written |
| ``base_lr_shared`` | one (K, V_base) | one (shared A) | none |

DroidSpeak, like the LRAgent implementation, keeps one shared cache and overwrites the recomputed groups in place:
an agent that returns later reads whatever the last agent recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lragent.schemes import Scheme
from lragent.static_cache import PoolLayout


# ---- plan operations --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Forward:
    """Full-depth forward as the acting role over trajectory positions ``[start, end)``, written to its caches."""

    start: int
    end: int


@dataclass(frozen=True)
class LRPrefill:
    """``base_shared``: full depth as the acting role over ``[start, end)``, K and V_base reused (not projected),
    only the role's V_lr written; nothing after the last layer's V_lr is computed."""

    start: int
    end: int


@dataclass(frozen=True)
class Recompute:
    """DroidSpeak: the recompute groups' K/V over ``[start, end)`` rebuilt as the acting role from the stored hidden
    states entering each group; the other layers are reused."""

    start: int
    end: int


PlanOp = Forward | LRPrefill | Recompute


# ---- trajectory state -------------------------------------------------------------------------------------------
@dataclass
class Trajectory:
    """One trajectory's tokens and what its caches hold.

    Attributes:
        ids: the token ids.
        lengths: valid prefix length of each cache, by cache name (``kv``, ``kv:<role>``, ``lr``, ``lr:<role>``,
            ``hidden``); a cache named here holds positions ``[0, length)``.
        seen: per role, the prefix of the trajectory the role has processed as itself.
    """

    ids: list[int] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)

    def length(self, name: str) -> int:
        return self.lengths.get(name, 0)


def groups_from_layers(layers: Sequence[int], n_layers: int) -> list[tuple[int, int]]:
    """Turns layer indices into contiguous half-open groups ``[(start, end), ...]``."""
    bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_layers]
    if bad or not layers:
        raise ValueError(
            f"droidspeak layers {bad or list(layers)} invalid: allowed non-empty subset of 0..{n_layers - 1}"
        )
    groups: list[list[int]] = []
    for i in sorted(set(layers)):
        if groups and groups[-1][1] == i:
            groups[-1][1] = i + 1
        else:
            groups.append([i, i + 1])
    return [(a, b) for a, b in groups]


def default_droidspeak_layers(n_layers: int) -> list[int]:
    """A middle third of the layers: a neutral default until a profiled choice is configured."""
    return list(range(n_layers // 3, (2 * n_layers) // 3 or 1))


# ---- schemes ------------------------------------------------------------------------------------------------------
class SharingScheme:
    """Base class: a scheme's cache layout over ``rows`` trajectories and ``n_roles`` roles.

    Args:
        n_roles: number of roles.
        rows: number of trajectories sharing one pool (a batch of independent episodes).
        shared_a: whether the adapters share one A (``base_lr_shared`` requires it).
        n_layers: decoder layers (DroidSpeak validates its layers against it).
        droidspeak_layers: layers DroidSpeak recomputes (others ignore it).
    """

    scheme: Scheme
    decomposed = False
    """V is stored as V_base plus a low-rank cache V_lr."""
    consumer_reads_producer_cache = False
    """A role that did not write the context reads it as written (no catch-up): what the training loss emulates."""

    def __init__(
        self,
        n_roles: int,
        rows: int = 1,
        *,
        shared_a: bool = True,
        n_layers: int = 1,
        droidspeak_layers: Sequence[int] | None = None,
    ) -> None:
        if n_roles < 1 or rows < 1:
            raise ValueError(f"need at least one role and one row, got n_roles={n_roles}, rows={rows}")
        self.n_roles = n_roles
        self.rows = rows
        self.shared_a = shared_a
        self.n_layers = n_layers

    # ---- layout -----------------------------------------------------------------------------------------------
    @property
    def kv_slots(self) -> int:
        return self.rows

    @property
    def lr_slots(self) -> int:
        return 0

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return ()

    def layout(self, n_kv_heads: int, head_dim: int, rank: int, hidden_size: int) -> PoolLayout:
        """The pool this scheme needs for ``rows`` trajectories."""
        return PoolLayout(
            n_layers=self.n_layers,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            kv_slots=self.kv_slots,
            lr_slots=self.lr_slots,
            rank=rank if self.lr_slots else 0,
            hidden_layers=self.hidden_layers,
            hidden_slots=self.rows if self.hidden_layers else 0,
            hidden_size=hidden_size if self.hidden_layers else 0,
        )

    def kv_slot(self, row: int, role: int) -> int:
        """Slot of the K/V (or K/V_base) pool that ``role`` reads and writes in trajectory ``row``."""
        return row

    def lr_slot(self, row: int, role: int) -> int:
        """Slot of the V_lr pool ``role`` reads and writes (decomposed schemes)."""
        return row

    def hidden_slot(self, row: int) -> int:
        return row

    # ---- lengths ----------------------------------------------------------------------------------------------
    def kv_name(self, role: int) -> str:
        """Name of the cache whose length bounds what ``role`` reads."""
        return "kv"

    def written_by_forward(self, role: int) -> tuple[str, ...]:
        """Caches a full-depth forward as ``role`` writes."""
        return ("kv",)

    def cached_len(self, traj: Trajectory, role: int) -> int:
        """Positions of the trajectory that have K/V in the cache ``role`` reads."""
        return traj.length(self.kv_name(role))

    def catch_up(self, start: int, end: int) -> PlanOp | None:
        """The catch-up over context ``[start, end)`` that is cached but unseen by the role (None: no catch-up)."""
        return None

    def plan(self, traj: Trajectory, role: int) -> list[PlanOp]:
        """What ``role`` computes before generating: a catch-up (if the scheme has one), then a forward over the
        positions its cache lacks. When everything is cached, the last position is recomputed (its logits are
        needed to generate)."""
        n = len(traj.ids)
        if n == 0:
            raise ValueError("the trajectory is empty: append tokens before a step")
        cached = min(self.cached_len(traj, role), n - 1)
        ops: list[PlanOp] = []
        seen = min(traj.seen.get(role, 0), cached)
        op = self.catch_up(seen, cached) if seen < cached else None
        if op is not None:
            ops.append(op)
        ops.append(Forward(cached, n))
        return ops

    def record(self, traj: Trajectory, role: int, op: PlanOp) -> None:
        """Updates the valid lengths after ``op`` ran as ``role``."""
        if isinstance(op, Forward):
            for name in self.written_by_forward(role):
                # a forward at `start` overwrites [start, end): anything cached past `end` is now stale
                traj.lengths[name] = op.end
            # a forward that starts below another cache's length makes positions there inconsistent for nobody:
            # other caches keep their own contents (non_shared) or are the same cache.

    def record_forward(self, traj: Trajectory, role: int, start: int, end: int) -> None:
        """Records a forward as ``role`` over ``[start, end)`` (prefill or decoded tokens)."""
        self.record(traj, role, Forward(start, end))

    def finish_step(self, traj: Trajectory, role: int) -> None:
        """After ``role``'s step: it has seen the cached part of the trajectory."""
        traj.seen[role] = min(len(traj.ids), self.cached_len(traj, role))

    def truncate(self, traj: Trajectory, n: int) -> None:
        """Cuts the trajectory to ``n`` tokens; every cache and every role's ``seen`` are clipped."""
        n = max(0, min(n, len(traj.ids)))
        del traj.ids[n:]
        traj.lengths = {k: min(v, n) for k, v in traj.lengths.items()}
        traj.seen = {r: min(s, n) for r, s in traj.seen.items()}

    def component_bytes(self, traj: Trajectory, per_position: dict[str, int]) -> dict[str, int]:
        """Bytes the trajectory's caches hold now (valid positions), per component.

        Args:
            traj: the trajectory.
            per_position: bytes of one position per component (:meth:`PoolLayout.bytes_per_position`).
        """
        out: dict[str, int] = {}
        for name, length in traj.lengths.items():
            for comp in self._components(name):
                out[comp] = out.get(comp, 0) + length * per_position[comp]
        return out

    def _components(self, cache_name: str) -> tuple[str, ...]:
        base = cache_name.split(":")[0]
        if base == "kv":
            return ("k", "v_base" if self.decomposed else "v")
        if base == "lr":
            return ("v_lr",)
        return ("hidden",)


class NonShared(SharingScheme):
    """One plain K/V cache per role; a role processes every token it has not seen, in its own cache."""

    scheme = Scheme.NON_SHARED

    @property
    def kv_slots(self) -> int:
        return self.rows * self.n_roles

    def kv_slot(self, row: int, role: int) -> int:
        return role * self.rows + row

    def kv_name(self, role: int) -> str:
        return f"kv:{role}"

    def written_by_forward(self, role: int) -> tuple[str, ...]:
        return (f"kv:{role}",)


class FullShared(SharingScheme):
    """One plain K/V cache; V carries the adapter of whichever role wrote each position."""

    scheme = Scheme.FULL_SHARED
    consumer_reads_producer_cache = True


class DroidSpeak(SharingScheme):
    """One plain K/V cache plus the hidden states entering each recompute group; unseen context is recomputed in
    the groups as the acting role, in place."""

    scheme = Scheme.DROIDSPEAK

    def __init__(self, *args, droidspeak_layers: Sequence[int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        layers = default_droidspeak_layers(self.n_layers) if droidspeak_layers is None else list(droidspeak_layers)
        self.groups = groups_from_layers(layers, self.n_layers)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.groups)

    def written_by_forward(self, role: int) -> tuple[str, ...]:
        return ("kv", "hidden")

    def catch_up(self, start: int, end: int) -> PlanOp:
        return Recompute(start, end)


class BaseShared(SharingScheme):
    """Shared K and V_base, one V_lr per role; unseen context gets an LR prefill as the acting role."""

    scheme = Scheme.BASE_SHARED
    decomposed = True

    @property
    def lr_slots(self) -> int:
        return self.rows * self.n_roles

    def lr_slot(self, row: int, role: int) -> int:
        return role * self.rows + row

    def cached_len(self, traj: Trajectory, role: int) -> int:
        return traj.length("kv")

    def written_by_forward(self, role: int) -> tuple[str, ...]:
        return ("kv", f"lr:{role}")

    def catch_up(self, start: int, end: int) -> PlanOp:
        return LRPrefill(start, end)

    def record(self, traj: Trajectory, role: int, op: PlanOp) -> None:
        if isinstance(op, LRPrefill):
            traj.lengths[f"lr:{role}"] = op.end
        else:
            super().record(traj, role, op)


class BaseLRShared(SharingScheme):
    """Shared K, V_base and V_lr (one A for all roles); each role applies its own B when it reads."""

    scheme = Scheme.BASE_LR_SHARED
    decomposed = True
    consumer_reads_producer_cache = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.shared_a:
            raise ValueError(
                "scheme base_lr_shared needs shared A: with one A per role (shared_a=False) the low-rank cache "
                "X·A of one role means nothing to another; use base_shared instead"
            )

    @property
    def lr_slots(self) -> int:
        return self.rows

    def written_by_forward(self, role: int) -> tuple[str, ...]:
        return ("kv", "lr")


_CLASSES: dict[Scheme, type[SharingScheme]] = {
    Scheme.NON_SHARED: NonShared,
    Scheme.FULL_SHARED: FullShared,
    Scheme.DROIDSPEAK: DroidSpeak,
    Scheme.BASE_SHARED: BaseShared,
    Scheme.BASE_LR_SHARED: BaseLRShared,
}


def make_scheme(
    scheme: str | Scheme,
    n_roles: int,
    rows: int = 1,
    *,
    shared_a: bool = True,
    n_layers: int = 1,
    droidspeak_layers: Sequence[int] | None = None,
) -> SharingScheme:
    """The scheme object called ``scheme`` (raises ``ValueError`` naming the allowed schemes)."""
    cls = _CLASSES[Scheme.parse(scheme)]
    kwargs = {"shared_a": shared_a, "n_layers": n_layers}
    if cls is DroidSpeak:
        kwargs["droidspeak_layers"] = droidspeak_layers
    return cls(n_roles, rows, **kwargs)
