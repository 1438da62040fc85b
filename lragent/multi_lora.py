"""Shared-A multi-LoRA linear layer (DESIGN.md §3).

One frozen base weight ``W0`` (d_out × d_in), one down-projection ``lora_A`` (r × d_in) shared by all roles, and one
up-projection ``lora_B`` (d_out × r) per role. The role of every sequence is an explicit argument (``role_ids``).
With ``shared_a=False`` each role has its own ``A``: conventional multi-LoRA, as in the paper's comparison.

The layer can return the base output ``X W0 (+ b)`` and the low-rank input ``X A`` separately: that pair is what the
decomposed KV cache stores for ``v_proj`` (V_base and V_lr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")
ALL_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class MultiLoraConfig:
    """Adapter layout shared by every role.

    Attributes:
        roles: role names, in adapter order.
        rank: LoRA rank r (> 0).
        alpha: LoRA alpha; the adapter output is scaled by alpha / rank.
        dropout: dropout on the adapter input during training, in [0, 1).
        targets: names of the linear layers inside each decoder layer that get an adapter.
        shared_a: one A for all roles (shared-A multi-LoRA); False gives one A per role.
    """

    roles: tuple[str, ...] = ("plan", "action", "reflect")
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = DEFAULT_TARGETS
    shared_a: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.roles = tuple(self.roles)
        self.targets = tuple(self.targets)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.roles:
            raise ValueError("roles: at least one role is needed, got an empty list")
        if len(set(self.roles)) != len(self.roles):
            raise ValueError(f"roles must be distinct, got {list(self.roles)}")
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if not self.targets or unknown:
            raise ValueError(f"targets {unknown or list(self.targets)} not supported: allowed {', '.join(ALL_TARGETS)}")

    @property
    def scaling(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        """JSON-serialisable form (for checkpoints)."""
        return {
            "roles": list(self.roles),
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "shared_a": self.shared_a,
        }

    @classmethod
    def from_dict(cls, d: dict) -> MultiLoraConfig:
        """Inverse of :meth:`to_dict`."""
        return cls(
            roles=tuple(d["roles"]),
            rank=int(d["rank"]),
            alpha=float(d["alpha"]),
            dropout=float(d.get("dropout", 0.0)),
            targets=tuple(d["targets"]),
            shared_a=bool(d["shared_a"]),
        )


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus shared-A (or independent-A) per-role LoRA adapters.

    ``y = x W0ᵀ (+ b) + s · (drop(x) A_roleᵀ) B_roleᵀ`` with ``s = alpha / r``. Each role's ``B`` (and, without
    shared A, each role's ``A``) is its own ``Parameter`` so that optimisers can give roles different learning rates.

    Args:
        base: the linear layer to adapt; its parameters are frozen.
        n_roles: number of roles.
        rank: LoRA rank r.
        alpha: LoRA alpha.
        dropout: dropout probability on the adapter input (training only).
        shared_a: one A for all roles.
    """

    def __init__(
        self, base: nn.Linear, n_roles: int, rank: int, alpha: float, dropout: float = 0.0, shared_a: bool = True
    ) -> None:
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.n_roles = n_roles
        self.rank = rank
        self.scaling = alpha / rank
        self.shared_a = shared_a
        self.in_features = base.in_features
        self.out_features = base.out_features
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        n_a = 1 if shared_a else n_roles
        self.lora_A = nn.ParameterList(
            [nn.Parameter(torch.empty(rank, self.in_features, **factory)) for _ in range(n_a)]
        )
        self.lora_B = nn.ParameterList(
            [nn.Parameter(torch.zeros(self.out_features, rank, **factory)) for _ in range(n_roles)]
        )
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        """PEFT's default init: A Kaiming-uniform, B zero (so a fresh adapter is the identity)."""
        for a in self.lora_A:
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        for b in self.lora_B:
            nn.init.zeros_(b)

    def stacked_a(self) -> torch.Tensor:
        """Returns A for every role, ``(n_roles, r, d_in)`` (a broadcast view when A is shared)."""
        if self.shared_a:
            return self.lora_A[0].unsqueeze(0).expand(self.n_roles, -1, -1)
        return torch.stack(list(self.lora_A))

    def stacked_b(self) -> torch.Tensor:
        """Returns B for every role, ``(n_roles, d_out, r)``.

        With autograd on (training) this is a fresh differentiable stack. Without it (inference) it is one cached
        tensor, refreshed in place whenever a B changed (tracked by the parameters' version counters), so its
        address never moves: a captured CUDA graph reads it as an input, and whoever replays the graph calls this
        method first to bring it up to date.
        """
        if torch.is_grad_enabled():
            return torch.stack(list(self.lora_B))
        versions = tuple(b._version for b in self.lora_B)
        cache = self.__dict__.get("_b_cache")
        ref = self.lora_B[0]
        if cache is None or cache.device != ref.device or cache.dtype != ref.dtype:
            self.__dict__["_b_cache"] = torch.stack([b.detach() for b in self.lora_B])
        elif versions != self.__dict__.get("_b_versions"):
            cache.copy_(torch.stack([b.detach() for b in self.lora_B]))
        self.__dict__["_b_versions"] = versions
        return self.__dict__["_b_cache"]

    def _check_roles(self, role_ids: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
        if role_ids is None:
            if self.n_roles != 1:
                raise ValueError(f"role_ids is required: this layer serves {self.n_roles} roles")
            return torch.zeros(batch, dtype=torch.long, device=device)
        if role_ids.shape != (batch,) and not (role_ids.dim() == 2 and role_ids.shape[0] == batch):
            raise ValueError(
                f"role_ids must have shape ({batch},), one id per sequence, or ({batch}, T), one per token; "
                f"got {tuple(role_ids.shape)}"
            )
        return role_ids.to(device)

    def _per_role(self, lr: torch.Tensor, role_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T, n_roles·r)``: ``lr`` ``(B, T, r)`` in the r columns of each token's role (``role_ids`` ``(B, T)``),
        zero elsewhere: one GEMM with the concatenated B's then applies every token's own B."""
        onehot = F.one_hot(role_ids, self.n_roles).to(lr.dtype)  # (B, T, n_roles)
        return (onehot[..., None] * lr[..., None, :]).flatten(-2)

    def cat_b(self) -> torch.Tensor:
        """``(d_out, n_roles·r)``: every role's B side by side (role-major columns)."""
        return torch.cat(list(self.lora_B), dim=1)

    @torch.no_grad()
    def cat_b_cached(self, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`cat_b` in ``dtype`` as one cached tensor, refreshed in place whenever a B changed (inference).

        Like :meth:`stacked_b`'s cache, its address never moves: a captured CUDA graph reads it as an input, and
        whoever replays the graph calls this method first to bring it up to date.

        Returns:
            ``(d_out, n_roles·r)``.
        """
        versions = tuple((b.data_ptr(), b._version) for b in self.lora_B)
        cache = self.__dict__.get("_cb_cache")
        ref = self.lora_B[0]
        if cache is None or cache.device != ref.device or cache.dtype != dtype:
            self.__dict__["_cb_cache"] = self.cat_b().detach().to(dtype)
        elif versions != self.__dict__.get("_cb_versions"):
            cache.copy_(self.cat_b())
        self.__dict__["_cb_versions"] = versions
        return self.__dict__["_cb_cache"]

    def add_lora_masked(self, base: torch.Tensor, lr_masked: torch.Tensor) -> torch.Tensor:
        """``base + s · lr_masked · cat_bᵀ``: every row's own B applied by one GEMM over all roles' B, no gather.

        ``lr_masked`` holds each row's ``X·A`` in the r columns of its role and zeros elsewhere
        (:func:`role_masked`), so the GEMM adds exactly ``s · X·A · B_roleᵀ`` (the zero columns contribute exact
        zeros). Inference only (no autograd). Adds in place into ``base`` when it can be viewed as a matrix (a
        slice of a fused GEMM's output), which spares the copy an out-of-place ``addmm`` makes.

        Args:
            base: ``(B, T, d_out)`` base output (may be a column slice of a wider output).
            lr_masked: ``(B, T, n_roles·r)``.

        Returns:
            ``(B, T, d_out)``: ``base`` itself when added in place.
        """
        d_out = base.shape[-1]
        w = self.cat_b_cached(base.dtype).t()
        lr2 = lr_masked.reshape(-1, lr_masked.shape[-1]).to(base.dtype)
        try:
            b2 = base.view(-1, d_out)
        except RuntimeError:
            return torch.addmm(base.reshape(-1, d_out), lr2, w, alpha=self.scaling).view(base.shape)
        b2.addmm_(lr2, w, alpha=self.scaling)
        return base

    def lora_input(self, x: torch.Tensor, role_ids: torch.Tensor | None) -> torch.Tensor:
        """The low-rank activation ``drop(x) A_roleᵀ`` (what V_lr stores for ``v_proj``).

        Args:
            x: ``(B, T, d_in)``.
            role_ids: ``(B,)`` role of each sequence, or ``(B, T)`` of each token (ignored with shared A).

        Returns:
            ``(B, T, r)``.
        """
        x = self.dropout(x)
        # adapters may be kept in float32 over a bfloat16 base (training): compute in the activations' dtype
        if self.shared_a:
            return x @ self.lora_A[0].t().to(x.dtype)
        role_ids = self._check_roles(role_ids, x.shape[0], x.device)
        if role_ids.dim() == 2:  # every role's A, then each token's own r columns
            lr_all = (x @ torch.cat(list(self.lora_A)).t().to(x.dtype)).unflatten(-1, (self.n_roles, self.rank))
            return lr_all.gather(2, role_ids[..., None, None].expand(-1, -1, 1, self.rank)).squeeze(2)
        a = torch.stack(list(self.lora_A))[role_ids]  # (B, r, d_in)
        return torch.einsum("btd,brd->btr", x, a.to(x.dtype))

    def lora_output(self, lr: torch.Tensor, role_ids: torch.Tensor | None) -> torch.Tensor:
        """Applies each sequence's up-projection and scaling: ``s · lr B_roleᵀ``.

        Args:
            lr: ``(B, T, r)`` low-rank activations.
            role_ids: ``(B,)``, or ``(B, T)`` (a role per token).

        Returns:
            ``(B, T, d_out)``.
        """
        role_ids = self._check_roles(role_ids, lr.shape[0], lr.device)
        if role_ids.dim() == 2:
            return (self._per_role(lr, role_ids) @ self.cat_b().t().to(lr.dtype)) * self.scaling
        if self.n_roles == 1:
            return (lr @ self.lora_B[0].t().to(lr.dtype)) * self.scaling
        b = self.stacked_b()[role_ids]  # (B, d_out, r)
        return torch.einsum("btr,bor->bto", lr, b.to(lr.dtype)) * self.scaling

    def _add_lora(self, base: torch.Tensor, lr: torch.Tensor, role_ids: torch.Tensor | None) -> torch.Tensor:
        """``base + s · lr B_roleᵀ`` in one batched multiply-add for ``(B, T, ·)`` inputs."""
        if self.n_roles == 1 or lr.dim() != 3 or (role_ids is not None and role_ids.dim() == 2):
            return base + self.lora_output(lr, role_ids).to(base.dtype)
        role_ids = self._check_roles(role_ids, lr.shape[0], lr.device)
        b = self.stacked_b()[role_ids]  # (B, d_out, r)
        return torch.baddbmm(base, lr.to(base.dtype), b.transpose(1, 2).to(base.dtype), alpha=self.scaling)

    def forward_parts(self, x: torch.Tensor, role_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(x W0ᵀ + b, drop(x) A_roleᵀ)``: shapes ``(B, T, d_out)`` and ``(B, T, r)``."""
        return self.base(x), self.lora_input(x, role_ids)

    def forward(self, x: torch.Tensor, role_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T, d_in) -> (B, T, d_out)`` with each sequence's role adapter."""
        base, lr = self.forward_parts(x, role_ids)
        return self._add_lora(base, lr, role_ids)

    def merged_weight(self, role: int) -> torch.Tensor:
        """``W0 + s · B_role A_role`` (d_out × d_in), for comparison with a plain merged model."""
        a = self.lora_A[0 if self.shared_a else role]
        # Merge in float64 and round once, so the merged weight is the closest representable one.
        merged = self.base.weight.double() + self.scaling * (self.lora_B[role].double() @ a.double())
        return merged.to(self.base.weight.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, roles={self.n_roles}, r={self.rank}, "
            f"scaling={self.scaling:g}, shared_a={self.shared_a}"
        )


def role_mask(role_ids: torch.Tensor, n_roles: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, n_roles)`` one-hot of each row's role in ``dtype`` (no host sync: CUDA-graph capturable).

    Args:
        role_ids: ``(B,)`` role of each row, in ``[0, n_roles)``.
    """
    return (role_ids[:, None] == torch.arange(n_roles, device=role_ids.device)).to(dtype)


def role_masked(lr: torch.Tensor, mask: torch.Tensor, rank: int) -> torch.Tensor:
    """Each row's low-rank activations in the r columns of its role, zeros elsewhere (one elementwise launch).

    Args:
        lr: ``(B, T, k·r)``: the X·A of ``k`` adapters of rank ``rank`` side by side (e.g. a slice of a fused GEMM).
        mask: ``(B, n_roles)`` from :func:`role_mask`.
        rank: r.

    Returns:
        ``(B, T, k, n_roles·r)``; ``[:, :, j]`` is adapter j's input to :meth:`MultiLoraLinear.add_lora_masked`.
    """
    lr = lr.unflatten(-1, (-1, 1, rank))  # (B, T, k, 1, r)
    out = lr * mask[:, None, None, :, None].to(lr.dtype)  # (B, T, k, n_roles, r)
    return out.flatten(-2)
