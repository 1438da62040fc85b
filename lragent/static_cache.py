"""Static KV-cache pools: per-layer buffers allocated once to a capacity, addressed by slot.

A pool holds, for every decoder layer,

- ``k[l]``: keys after RoPE, ``[S_kv + 1, H_kv, C, D]``;
- ``v[l]``: full values, or base values ``V_base = X W0 (+ b)`` in a decomposed pool, ``[S_kv + 1, H_kv, C, D]``;
- ``v_lr[l]``: low-rank values ``V_lr = X A``, ``[S_lr + 1, C, r]`` (decomposed pools only), one r-vector per token
  shared by all KV heads;

and, for DroidSpeak, ``hidden[l]`` ``[S_h + 1, C, hidden]``: the hidden states entering layer ``l``.

``C`` is the capacity (positions per slot). Which slot a trajectory's role reads and writes is the sharing scheme's
business (:mod:`lragent.sharing`): one slot per trajectory where the cache is shared, one per (role, trajectory)
where it is not. The last slot of every pool is a **scratch slot**: idle rows of a fixed-size decode batch write
there, so a CUDA graph captured for a batch bucket never touches a real cache through a row it does not use.

Buffers never move during decoding: :meth:`StaticCachePool.grow` (between steps only) reallocates to a larger
capacity and copies the valid prefix; it bumps :attr:`StaticCachePool.version`, which invalidates captured graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolLayout:
    """What a pool holds (sizes only).

    Attributes:
        n_layers: decoder layers.
        n_kv_heads: KV heads H_kv.
        head_dim: head dim D.
        kv_slots: slots of K and V (scratch slot not counted).
        lr_slots: slots of V_lr (0: a plain pool without low-rank values).
        rank: LoRA rank r of ``v_proj`` (used when ``lr_slots > 0``).
        hidden_layers: layers whose entering hidden states are kept (DroidSpeak recompute-group starts).
        hidden_slots: slots of the hidden-state buffers.
        hidden_size: model width.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    kv_slots: int
    lr_slots: int = 0
    rank: int = 0
    hidden_layers: tuple[int, ...] = ()
    hidden_slots: int = 0
    hidden_size: int = 0

    def __post_init__(self) -> None:
        if self.kv_slots < 1:
            raise ValueError(f"kv_slots must be >= 1, got {self.kv_slots}")
        if self.lr_slots and self.rank < 1:
            raise ValueError(f"a pool with low-rank slots needs rank >= 1, got {self.rank}")

    @property
    def decomposed(self) -> bool:
        """True when V holds V_base and a V_lr pool exists."""
        return self.lr_slots > 0

    def bytes_per_position(self, element_size: int) -> dict[str, int]:
        """Bytes one trajectory position takes in one slot, per component (all layers)."""
        kv = self.n_layers * self.n_kv_heads * self.head_dim * element_size
        out = {"k": kv, ("v_base" if self.decomposed else "v"): kv}
        if self.decomposed:
            out["v_lr"] = self.n_layers * self.rank * element_size
        if self.hidden_layers:
            out["hidden"] = len(self.hidden_layers) * self.hidden_size * element_size
        return out

    def allocated_bytes(self, capacity: int, element_size: int) -> int:
        """Bytes a pool of this layout allocates at ``capacity`` positions, scratch slots included (what
        :meth:`StaticCachePool.allocated_bytes` reports once allocated)."""
        kv = 2 * self.n_layers * (self.kv_slots + 1) * self.n_kv_heads * self.head_dim
        lr = self.n_layers * (self.lr_slots + 1) * self.rank if self.decomposed else 0
        hidden = len(self.hidden_layers) * (self.hidden_slots + 1) * self.hidden_size
        return capacity * (kv + lr + hidden) * element_size


class StaticCachePool:
    """Preallocated per-layer cache buffers of one layout.

    Args:
        layout: sizes.
        capacity: positions per slot (C).
        dtype: storage dtype (the model's compute dtype).
        device: where the buffers live.
    """

    def __init__(self, layout: PoolLayout, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1 position, got {capacity}")
        self.layout = layout
        self.capacity = int(capacity)
        self.dtype = dtype
        self.device = torch.device(device)
        self.version = 0
        self._allocate(self.capacity)

    # ---- slots --------------------------------------------------------------------------------------------------
    @property
    def scratch_kv(self) -> int:
        """Index of the K/V scratch slot."""
        return self.layout.kv_slots

    @property
    def scratch_lr(self) -> int:
        """Index of the V_lr scratch slot."""
        return self.layout.lr_slots

    @property
    def scratch_hidden(self) -> int:
        """Index of the hidden-state scratch slot."""
        return self.layout.hidden_slots

    # ---- storage ------------------------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        lay, dev, dt = self.layout, self.device, self.dtype
        kv_shape = (lay.kv_slots + 1, lay.n_kv_heads, capacity, lay.head_dim)
        self.k = [torch.zeros(kv_shape, dtype=dt, device=dev) for _ in range(lay.n_layers)]
        self.v = [torch.zeros(kv_shape, dtype=dt, device=dev) for _ in range(lay.n_layers)]
        self.v_lr = (
            [torch.zeros((lay.lr_slots + 1, capacity, lay.rank), dtype=dt, device=dev) for _ in range(lay.n_layers)]
            if lay.decomposed
            else None
        )
        self.hidden = {
            layer: torch.zeros((lay.hidden_slots + 1, capacity, lay.hidden_size), dtype=dt, device=dev)
            for layer in lay.hidden_layers
        }

    def grow(self, capacity: int, valid: int | None = None) -> None:
        """Reallocates every buffer to ``capacity`` positions, keeping positions ``[0, valid)`` (default: all).

        Only between steps: captured graphs hold the old buffers, so :attr:`version` changes.
        """
        if capacity <= self.capacity:
            return
        keep = self.capacity if valid is None else min(valid, self.capacity)
        old_k, old_v, old_lr, old_hidden = self.k, self.v, self.v_lr, self.hidden
        self._allocate(capacity)
        for new, old in zip(self.k + self.v, old_k + old_v, strict=True):
            new[:, :, :keep].copy_(old[:, :, :keep])
        if old_lr is not None:
            for new, old in zip(self.v_lr, old_lr, strict=True):
                new[:, :keep].copy_(old[:, :keep])
        for layer, old in old_hidden.items():
            self.hidden[layer][:, :keep].copy_(old[:, :keep])
        self.capacity = capacity
        self.version += 1

    def allocated_bytes(self) -> int:
        """Bytes of every buffer (capacity, not valid positions), scratch slots included."""
        tensors = [*self.k, *self.v, *(self.v_lr or []), *self.hidden.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
