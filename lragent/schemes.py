"""The five KV-cache sharing schemes (DESIGN.md §2), selectable by name."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class Scheme(str, Enum):
    """How agents share the KV cache of one trajectory.

    - ``non_shared``: one full K/V cache per agent; each agent processes every token it has not seen.
    - ``full_shared``: one K/V cache; V holds the adapter of whichever agent wrote it; only new tokens.
    - ``droidspeak``: one K/V cache plus the hidden states entering each recompute group; unseen context is
      recomputed in those layer groups with the current agent's adapter, the other layers are reused.
    - ``base_shared``: shared K and V_base = X W0, one low-rank cache V_lr = X A per agent; an agent runs an
      "LR prefill" over context it has not seen (full depth, skipping the K and V_base projections).
    - ``base_lr_shared``: shared K, V_base and V_lr (needs shared A); only new tokens.
    """

    NON_SHARED = "non_shared"
    FULL_SHARED = "full_shared"
    DROIDSPEAK = "droidspeak"
    BASE_SHARED = "base_shared"
    BASE_LR_SHARED = "base_lr_shared"

    @classmethod
    def parse(cls, name: str | Scheme) -> Scheme:
        """Returns the scheme called ``name``; raises ``ValueError`` listing the allowed names."""
        if isinstance(name, Scheme):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown scheme {name!r}: allowed {', '.join(SCHEMES)}") from None

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)  # f"{scheme}" is the name on every Python (3.11 prints Scheme.X)

    @property
    def decomposed(self) -> bool:
        """True where V is stored as V_base plus the low-rank cache V_lr."""
        return self in (Scheme.BASE_SHARED, Scheme.BASE_LR_SHARED)


SCHEMES: tuple[str, ...] = tuple(s.value for s in Scheme)


def parse_schemes(spec: str, option: str = "--scheme") -> list[Scheme]:
    """``all`` or a comma list of scheme names: the schemes a command runs, in the order given.

    This is where a command's ``--scheme`` is parsed, once: what it returns goes down to the session, the engine and
    :func:`~lragent.sharing.make_scheme` as it is (:meth:`Scheme.parse` hands a ``Scheme`` back untouched).
    """
    names = list(SCHEMES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEMES]
    if bad or not names:
        raise ValueError(f"{option} {spec!r}: unknown {bad or 'nothing'}; allowed {', '.join(SCHEMES)} or all")
    return [Scheme.parse(s) for s in names]


def resolve_schemes(schemes: str | Sequence[str] | None, default: Sequence[str]) -> list[Scheme]:
    """A benchmark's ``--schemes``: ``None`` (``default``), ``all`` or a comma list (:func:`parse_schemes`), or a
    list of names, each checked."""
    if schemes is None:
        return [Scheme.parse(s) for s in default]
    if isinstance(schemes, str):
        return parse_schemes(schemes, "--schemes")
    return parse_schemes(",".join(str(s) for s in schemes), "--schemes")
