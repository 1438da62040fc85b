"""Static role router: role names <-> integer ids, passed explicitly to every forward."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

DEFAULT_ROLES: tuple[str, ...] = ("plan", "action", "reflect")


class RoleRouter:
    """Maps role names to the row of the stacked adapter weights that serves them.

    Routing is an argument, not state: callers turn names into ``role_ids`` (one per sequence) with
    :meth:`ids` and hand them to the forward; nothing here is "active".

    Args:
        roles: distinct, non-empty role names in adapter order.
    """

    def __init__(self, roles: Sequence[str] = DEFAULT_ROLES) -> None:
        roles = tuple(roles)
        if not roles:
            raise ValueError("roles: at least one role is needed, got an empty list")
        bad = [r for r in roles if not isinstance(r, str) or not r.strip()]
        if bad:
            raise ValueError(f"roles: role names must be non-empty strings, got {bad!r}")
        if len(set(roles)) != len(roles):
            raise ValueError(f"roles: role names must be distinct, got {list(roles)}")
        self.roles = roles
        self._index = {name: i for i, name in enumerate(roles)}

    def __len__(self) -> int:
        return len(self.roles)

    def __contains__(self, role: object) -> bool:
        return role in self._index

    def id(self, role: str | int) -> int:
        """Returns the id of ``role`` (a name, or an id that is checked for range)."""
        if isinstance(role, int) and not isinstance(role, bool):
            if not 0 <= role < len(self.roles):
                raise ValueError(f"role id {role} is out of range: allowed 0..{len(self.roles) - 1}")
            return role
        if role not in self._index:
            raise ValueError(f"unknown role {role!r}: allowed {', '.join(self.roles)}")
        return self._index[role]

    def name(self, role_id: int) -> str:
        """Returns the name of ``role_id``."""
        return self.roles[self.id(int(role_id))]

    def ids(self, roles: Iterable[str | int], device: torch.device | str | None = None) -> torch.Tensor:
        """Returns a ``(B,)`` int64 tensor of role ids, one per sequence."""
        return torch.tensor([self.id(r) for r in roles], dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return f"RoleRouter({list(self.roles)})"
