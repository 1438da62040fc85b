"""KV cache storage for the multi-agent runtime.

Per decoder layer a :class:`LayerCache` holds

- ``k``: keys after RoPE, ``[B, H_kv, S, D]``;
- ``v``: the full values ``[B, H_kv, S, D]`` (schemes with a plain cache), or the base values
  ``V_base = X W0 (+ b)`` (decomposed schemes);
- ``v_lr``: the low-rank cache ``V_lr = X A``, ``[B, S, r]``: one r-vector per token shared by all KV heads
  (decomposed schemes only).

These growable caches serve training through the cache (the cache-sharing-aware loss) and other batched teacher-forced
forwards; inference uses the static pools of :mod:`lragent.static_cache`. Their cache view is
:class:`lragent.cache_views.GrowableView`.

What is shared across agents, and whether that is exact, is the scheme's business (:mod:`lragent.sharing`): K and
V_base depend on the adapters only through the hidden states, so an agent reading another agent's K/V_base sees
the context as that agent encoded it (approximate, and exact with one agent or with B = 0); ``V_lr`` with shared
A is the same kind of quantity for every role, and each agent applies its own ``B`` at read time.

Buffers grow by doubling and are written in place (no O(L²) copying during decoding). When autograd needs the
written tensor (training through the cache), a buffer appends by concatenation instead, which keeps every
version that backward needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lragent.attention import RoleSplit


class GrowableBuffer:
    """A tensor that grows along one dimension, with a valid length.

    Args:
        dim: the sequence dimension.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.data: torch.Tensor | None = None
        self.length = 0

    def _capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[self.dim]

    def write(self, start: int, x: torch.Tensor) -> None:
        """Writes ``x`` at positions ``[start, start + n)``; positions past the end extend the buffer.

        Args:
            start: first position, at most the current length.
            x: tensor whose ``dim`` has the ``n`` new positions.
        """
        if not 0 <= start <= self.length:
            raise IndexError(f"write at {start} leaves a gap: buffer length is {self.length}")
        n = x.shape[self.dim]
        end = start + n
        if x.requires_grad and torch.is_grad_enabled():
            # Autograd path: functional concatenation so earlier reads stay valid for backward.
            if start != self.length and end < self.length:
                raise RuntimeError("differentiable writes must append at the end of the buffer")
            head = self.view(start) if start > 0 else None
            self.data = x if head is None else torch.cat([head, x], dim=self.dim)
            self.length = end
            return
        if self.data is None or end > self._capacity() or self.data.requires_grad:
            cap = max(end, 2 * self._capacity(), 16)
            shape = list(x.shape)
            shape[self.dim] = cap
            new = torch.empty(shape, dtype=x.dtype, device=x.device)
            if self.length:
                new.narrow(self.dim, 0, self.length).copy_(self.view().detach())
            self.data = new
        self.data.narrow(self.dim, start, n).copy_(x)
        self.length = max(self.length, end)

    def view(self, end: int | None = None) -> torch.Tensor:
        """Returns positions ``[0, end)`` (default: all valid positions) as a view."""
        end = self.length if end is None else end
        if self.data is None:
            raise RuntimeError("empty buffer")
        return self.data.narrow(self.dim, 0, end)

    def truncate(self, length: int) -> None:
        """Forgets positions ``>= length``."""
        self.length = min(self.length, max(0, length))

    def nbytes(self) -> int:
        """Bytes of the valid positions (what the cache holds, not the spare capacity)."""
        if self.data is None or self.length == 0:
            return 0
        per_pos = self.data.element_size() * self.data.numel() // self.data.shape[self.dim]
        return per_pos * self.length


@dataclass
class LayerCache:
    """One decoder layer's cache.

    Attributes:
        k: keys ``[B, H_kv, S, D]``.
        v: full values, or V_base in decomposed form, ``[B, H_kv, S, D]``.
        v_lr: low-rank cache ``[B, S, r]`` or ``None`` for a plain cache.
        v_is_base: True when ``v`` holds V_base (decomposed form).
    """

    k: GrowableBuffer
    v: GrowableBuffer
    v_lr: GrowableBuffer | None
    v_is_base: bool

    @classmethod
    def plain(cls) -> LayerCache:
        return cls(GrowableBuffer(2), GrowableBuffer(2), None, False)

    @classmethod
    def decomposed(cls, with_lr: bool = True) -> LayerCache:
        return cls(GrowableBuffer(2), GrowableBuffer(2), GrowableBuffer(1) if with_lr else None, True)

    def with_lr(self, v_lr: GrowableBuffer) -> LayerCache:
        """The same K/V_base with another agent's low-rank cache (``base_shared``)."""
        return LayerCache(self.k, self.v, v_lr, True)

    @property
    def length(self) -> int:
        return self.k.length

    def truncate(self, length: int) -> None:
        for buf in (self.k, self.v, self.v_lr):
            if buf is not None:
                buf.truncate(length)

    def component_bytes(self) -> dict[str, int]:
        out = {"k": self.k.nbytes(), ("v_base" if self.v_is_base else "v"): self.v.nbytes()}
        if self.v_lr is not None:
            out["v_lr"] = self.v_lr.nbytes()
        return out


class ModelCache:
    """The per-layer caches of one model (one agent's, or one shared by agents).

    Args:
        n_layers: number of decoder layers.
        decomposed: store V_base (+ V_lr) instead of full V.
        with_lr: keep a V_lr buffer in each layer (decomposed only; ``base_shared`` keeps V_lr per agent).
        role_split: each sequence a producer's prefix and a consumer's suffix (the training step's shared pass):
            a decomposed cache's views attend in two pieces (:func:`~lragent.attention.two_piece_attention`).
    """

    def __init__(
        self, n_layers: int, decomposed: bool = False, with_lr: bool = True, role_split: RoleSplit | None = None
    ) -> None:
        self.decomposed = decomposed
        self.role_split = role_split
        self.layers = [LayerCache.decomposed(with_lr) if decomposed else LayerCache.plain() for _ in range(n_layers)]

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def component_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for layer in self.layers:
            for name, n in layer.component_bytes().items():
                total[name] = total.get(name, 0) + n
        return total
