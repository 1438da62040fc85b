"""Cache views: where a forward's new positions go and what they attend to, every kind in this module.

A decoder layer (:mod:`lragent.decoder`) reads and writes its cache only through a view (:class:`CacheView`):

- :class:`GrowableView`: growable per-layer buffers (:mod:`lragent.kv_cache`; training through the cache, autograd);
- :class:`ReplayView`: wraps a view for one activation-checkpointed layer (the recomputation writes nothing);

and over a static pool (:mod:`lragent.static_cache`), for inference:

- :class:`PrefillView`: ``T`` contiguous positions ``[start, start + T)`` of one trajectory, in its slots; queries
  attend causally over ``[0, start + T)`` (bottom-right aligned).
- :class:`DecodeView`: one new token per batch row; row ``b`` writes position ``pos[b]`` of its own slots and attends
  over its first ``pos[b] + 1`` positions. Slots, positions and roles are device tensors, so one captured CUDA graph
  serves every step, every length and every mix of roles.

On CUDA the decomposed prefill uses the fused Flash-LoRA-Attention kernel, and decoding uses the fused decode kernel
(plain and decomposed) where it is available; the PyTorch path below is the reference and the CPU path.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from lragent.attention import decomposed_attention, lora_b_per_head, plain_attention, two_piece_attention
from lragent.kv_cache import GrowableBuffer, LayerCache, ModelCache
from lragent.rope import rope_store_unfused
from lragent.static_cache import StaticCachePool


class CacheView(Protocol):
    """Where one forward's new positions are stored and what they attend to (per layer).

    Attributes:
        decomposed: V is stored as V_base plus the low-rank cache V_lr.
    """

    decomposed: bool

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        """Writes keys ``(B, H_kv, T, D)`` (RoPE applied), values or V_base ``(B, H_kv, T, D)``, V_lr ``(B, T, r)``."""
        ...

    def rope_store(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        v_lr: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Applies RoPE to queries ``(B, T, H_q, D)`` and keys ``(B, T, H_kv, D)``, stores keys, values
        ``(B, T, H_kv, D)`` and V_lr ``(B, T, r)``; returns the rotated queries ``(B, H_q, T, D)``."""
        ...

    def store_lr(self, layer: int, v_lr: torch.Tensor) -> None:
        """Writes only V_lr ``(B, T, r)`` (``base_shared``'s LR prefill: K and V_base are already cached)."""
        ...

    def capture(self, layer: int, h: torch.Tensor) -> None:
        """Receives the hidden states ``(B, T, hidden)`` entering ``layer`` (kept only where the view wants them)."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, lora_b: torch.Tensor | None, scaling: float, role_ids: torch.Tensor
    ) -> torch.Tensor:
        """Attention of queries ``(B, H_q, T, D)`` over the visible cached keys; returns ``(B, H_q, T, D)``.

        ``lora_b`` is the stacked ``(n_roles, H_kv·D, r)`` up-projection of ``v_proj`` for decomposed views."""
        ...


def decode_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor,
    v_lr: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scaling: float = 1.0,
    role_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row over gathered keys, masked to each row's length (PyTorch; any device).

    Args:
        q: ``(B, H_q, D)``.
        k: ``(B, H_kv, L, D)`` the rows' keys (positions ``>= kv_lens[b]`` are ignored).
        v: ``(B, H_kv, L, D)`` values, or V_base when ``v_lr`` is given.
        kv_lens: ``(B,)`` valid keys per row (>= 1).
        v_lr: ``(B, L, r)`` low-rank values or ``None`` (plain attention).
        lora_b: ``(n_roles, H_kv·D, r)`` stacked up-projections (PEFT layout).
        scaling: LoRA scaling.
        role_ids: ``(B,)``.

    Returns:
        ``(B, H_q, D)``.
    """
    b, h_q, d = q.shape
    h_kv, length = k.shape[1], k.shape[2]
    group = h_q // h_kv
    visible = torch.arange(length, device=q.device)[None, :] < kv_lens[:, None]  # (B, L)
    mask = visible[:, None, None, :]  # (B, 1, 1, L)
    if v_lr is not None:
        r = v_lr.shape[-1]
        v = torch.cat([v, v_lr[:, None].expand(b, h_kv, length, r)], dim=-1)  # (B, H_kv, L, D + r)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask)[:, :, 0]  # (B, H_q, D [+ r])
    if v_lr is None:
        return out
    o_base, o_lr = out[..., :d], out[..., d:]  # (B, H_q, D), (B, H_q, r)
    b_sel = lora_b_per_head(lora_b, h_kv)[role_ids]  # (B, H_kv, r, D)
    o_up = torch.einsum("bhgr,bhrd->bhgd", o_lr.reshape(b, h_kv, group, -1), b_sel.to(o_lr.dtype))
    return o_base + o_up.reshape(b, h_q, d) * scaling


def _fused_decode():
    """The fused decode kernel, or None where it cannot be imported (no Triton)."""
    try:
        from kernels.flash_lora_decode import flash_lora_decode
    except ImportError:
        return None
    return flash_lora_decode


def _qkv_rope_switch() -> int:
    """``LRAGENT_QKV_ROPE``: 1 one-row decode steps run RoPE and the cache stores inside the q/k/v GEMV (default 1)."""
    from kernels.fused_qkv_rope import qkv_rope_switch

    return qkv_rope_switch()


def _qkv_maxnreg() -> int:
    """``LRAGENT_QKV_MAXNREG``: registers per thread the one-launch q/k/v kernel may take (default 80; 0: the
    compiler's count)."""
    from kernels.fused_qkv_rope import qkv_maxnreg

    return qkv_maxnreg()


def _fused_gemv_rows() -> int:
    """``LRAGENT_FUSED_GEMV``: the most rows of a decode step whose norms and SiLU·mul run inside the GEMVs."""
    from kernels.fused_gemv import fused_gemv_rows

    return fused_gemv_rows()


class PrefillView:
    """Contiguous new positions of one trajectory (batch 1) in a static pool.

    Args:
        pool: the pool.
        kv_slot: slot of K and V / V_base.
        lr_slot: slot of V_lr (decomposed pools).
        hidden_slot: slot of the kept hidden states (DroidSpeak), or ``None`` to keep none.
        start: position of the first new token.
        length: number of new positions T.
        use_kernel: allow the fused prefill kernel on CUDA.
    """

    def __init__(
        self,
        pool: StaticCachePool,
        kv_slot: int,
        lr_slot: int,
        hidden_slot: int | None,
        start: int,
        length: int,
        use_kernel: bool = True,
        fused: bool | None = None,
    ) -> None:
        if start + length > pool.capacity:
            raise ValueError(f"positions up to {start + length} exceed the cache capacity {pool.capacity}")
        self.pool = pool
        self.kv_slot, self.lr_slot, self.hidden_slot = kv_slot, lr_slot, hidden_slot
        self.start, self.end = start, start + length
        self.use_kernel = use_kernel
        self.decomposed = pool.layout.decomposed
        gpu_ok = use_kernel and pool.device.type == "cuda" and pool.dtype in (torch.float16, torch.bfloat16)
        self.fused = gpu_ok if fused is None else fused

    def rope_store(self, layer, q, k, v, v_lr, cos, sin) -> torch.Tensor:
        if not self.fused:
            return rope_store_unfused(self, layer, q, k, v, v_lr, cos, sin)
        from kernels.fused_ops import rope_store

        p, t = self.pool, q.shape[1]
        pos = torch.arange(self.start, self.end, device=q.device)
        kv_slot = torch.full((t,), self.kv_slot, dtype=torch.long, device=q.device)
        lr_slot = torch.full((t,), self.lr_slot, dtype=torch.long, device=q.device)
        q_out = rope_store(
            q[0], k[0], v[0], None if v_lr is None else v_lr[0], cos[0], sin[0],
            p.k[layer], p.v[layer], p.v_lr[layer] if v_lr is not None else None, kv_slot, lr_slot, pos,
        )  # fmt: skip
        return q_out.transpose(0, 1)[None]  # (1, H_q, T, D)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        p, s, e = self.pool, self.start, self.end
        p.k[layer][self.kv_slot, :, s:e] = k[0]
        p.v[layer][self.kv_slot, :, s:e] = v[0]
        if v_lr is not None:
            p.v_lr[layer][self.lr_slot, s:e] = v_lr[0]

    def store_lr(self, layer: int, v_lr: torch.Tensor) -> None:
        self.pool.v_lr[layer][self.lr_slot, self.start : self.end] = v_lr[0]

    def sub(self, offset: int, length: int) -> PrefillView:
        """The same slots over positions ``[start + offset, start + offset + length)``."""
        return PrefillView(
            self.pool, self.kv_slot, self.lr_slot, self.hidden_slot, self.start + offset, length, self.use_kernel,
            self.fused,
        )  # fmt: skip

    def capture(self, layer: int, h: torch.Tensor) -> None:
        if self.hidden_slot is not None and layer in self.pool.hidden:
            self.pool.hidden[layer][self.hidden_slot, self.start : self.end] = h[0]

    def attend(
        self, layer: int, q: torch.Tensor, lora_b: torch.Tensor | None, scaling: float, role_ids: torch.Tensor
    ) -> torch.Tensor:
        p, ks, e = self.pool, self.kv_slot, self.end
        k = p.k[layer][ks : ks + 1, :, :e]
        v = p.v[layer][ks : ks + 1, :, :e]
        if self.decomposed:
            v_lr = p.v_lr[layer][self.lr_slot : self.lr_slot + 1, :e]
            return decomposed_attention(q, k, v, v_lr, lora_b, scaling, role_ids, use_kernel=self.use_kernel)
        return plain_attention(q, k, v)


class DecodeView:
    """One new token per batch row, each row in its own slots at its own position.

    Args:
        pool: the pool.
        kv_slot: ``(B,)`` K/V slot of each row (the scratch slot for idle rows).
        lr_slot: ``(B,)`` V_lr slot of each row.
        hidden_slot: ``(B,)`` hidden-state slot of each row.
        pos: ``(B,)`` position the row's new token takes; it attends over ``[0, pos]``.
        max_len: a bound on ``pos + 1`` known on the host (eager decoding reads only that many positions), or
            ``None`` (graph capture: the whole capacity, lengths on the device).
        use_kernel: allow the fused decode kernel on CUDA.
        fused: the fused kernels (default: where the decode kernel runs).
        token_groups: ``(start, T)``: rows ``[start, B)`` come in groups of ``T`` token rows of one sequence each
            (fed tokens at consecutive positions; a group's rows past its sequence's tokens are padding, whose output
            is not used): the decode kernel runs them as groups that read each K/V tile once
            (``flash_lora_decode(group_rows=T)``). The attention of every row that is not padding is unchanged.

    ``LRAGENT_FUSED_GEMV=N`` in the environment when the view is made also runs each RMSNorm and SiLU·mul inside the
    GEMV that reads it, and the o projection on the same Triton GEMV (:mod:`kernels.fused_gemv`, on fused views, in
    steps of at most N <= 32 rows; default 1: batch-1 decode 5% faster on an H100; 0 off).
    """

    def __init__(
        self,
        pool: StaticCachePool,
        kv_slot: torch.Tensor,
        lr_slot: torch.Tensor,
        hidden_slot: torch.Tensor,
        pos: torch.Tensor,
        max_len: int | None = None,
        use_kernel: bool = True,
        fused: bool | None = None,
        token_groups: tuple[int, int] | None = None,
    ) -> None:
        self.pool = pool
        self.kv_slot, self.lr_slot, self.hidden_slot, self.pos = kv_slot, lr_slot, hidden_slot, pos
        self.token_groups = token_groups if token_groups is not None and token_groups[1] > 1 else None
        self.kv_lens = pos + 1
        self.max_len = pool.capacity if max_len is None else min(max_len, pool.capacity)
        self.decomposed = pool.layout.decomposed
        kernel = _fused_decode() if (use_kernel and pos.is_cuda) else None
        self.kernel = kernel if kernel is not None and pool.dtype in (torch.float16, torch.bfloat16) else None
        self.fused = self.kernel is not None if fused is None else fused
        self.norm_gemv_rows = _fused_gemv_rows() if self.fused else 0  # 0: the unfused norms and SiLU·mul
        self.qkv_rope = _qkv_rope_switch() if self.norm_gemv_rows else 0  # RoPE and stores in the q/k/v GEMV
        self.qkv_maxnreg = _qkv_maxnreg() if self.qkv_rope else 0  # that launch's register cap (0: the compiler's)
        if self.kernel is not None:  # int32 indices once per step, not per layer
            self.kv_lens32 = self.kv_lens.to(torch.int32)
            self.kv_slot32 = kv_slot.to(torch.int32)
            self.lr_slot32 = lr_slot.to(torch.int32)

    @property
    def folds_q_lora(self) -> bool:
        """:meth:`rope_store` takes q_proj's LoRA term (``q_lora``) into its launch (the fused path)."""
        return bool(self.fused)

    def rope_store(self, layer, q, k, v, v_lr, cos, sin, q_lora=None) -> torch.Tensor:
        """RoPE and cache stores; with ``q_lora`` ``(lr (B, 1, r), b (n_roles, H_q·D, r), s, role (B,))`` the
        queries first get ``s · lr · B_roleᵀ`` (``kernels.fused_ops.rope_store``; fused views only)."""
        if not self.fused:
            if q_lora is not None:
                raise ValueError("q_lora needs a fused view")
            return rope_store_unfused(self, layer, q, k, v, v_lr, cos, sin)
        from kernels.fused_ops import rope_store

        p = self.pool
        ql = None if q_lora is None else (q_lora[0][:, 0], *q_lora[1:])
        q_out = rope_store(
            q[:, 0], k[:, 0], v[:, 0], None if v_lr is None else v_lr[:, 0], cos[:, 0], sin[:, 0],
            p.k[layer], p.v[layer], p.v_lr[layer] if v_lr is not None else None, self.kv_slot, self.lr_slot, self.pos,
            q_lora=ql,
        )  # fmt: skip
        return q_out[:, :, None]  # (B, H_q, 1, D)

    def qkv_rope_store(
        self,
        layer: int,
        h: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        heads: tuple[int, int, int],
        rotary: tuple[torch.Tensor, torch.Tensor],
        v_a_row: int,
        q_lora: tuple | None,
        v_lora: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A one-row step's input norm, q/k/v GEMV, RoPE and cache stores in one launch
        (:func:`kernels.fused_qkv_rope.qkv_rope_store`; ``heads`` is ``(H_q, H_kv, D)``, ``rotary`` cos/sin
        ``(1, 1, D)``; ``v_lora`` v's ``(B (n_roles, H_kv·D, r), s, role)`` for a full cache, None for a decomposed
        one). Returns the rotated base queries ``(1, H_q, 1, D)`` and q's rotated LoRA term (or None)."""
        from kernels.fused_qkv_rope import qkv_rope_store

        p = self.pool
        cos, sin = (t.to(h.dtype) for t in rotary)
        q, q_add = qkv_rope_store(
            h, norm_weight, eps, weight, *heads, cos, sin, p.k[layer], p.v[layer],
            p.v_lr[layer] if self.decomposed else None, self.kv_slot, self.lr_slot, self.pos, v_a_row, q_lora,
            maxnreg=self.qkv_maxnreg, v_lora=None if self.decomposed else v_lora,
        )  # fmt: skip
        return q[:, :, None], q_add

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        p = self.pool
        p.k[layer][self.kv_slot, :, self.pos] = k[:, :, 0]
        p.v[layer][self.kv_slot, :, self.pos] = v[:, :, 0]
        if v_lr is not None:
            p.v_lr[layer][self.lr_slot, self.pos] = v_lr[:, 0]

    def store_lr(self, layer: int, v_lr: torch.Tensor) -> None:
        self.pool.v_lr[layer][self.lr_slot, self.pos] = v_lr[:, 0]

    def capture(self, layer: int, h: torch.Tensor) -> None:
        if layer in self.pool.hidden:
            self.pool.hidden[layer][self.hidden_slot, self.pos] = h[:, 0]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        lora_b: torch.Tensor | None,
        scaling: float,
        role_ids: torch.Tensor,
        q_add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q_add``: ``(B, H_q, D)`` float32 added to the queries first (q's rotated LoRA term of a one-launch
        q/k/v step, :meth:`qkv_rope_store`)."""
        p = self.pool
        q1 = q[:, :, 0]  # (B, H_q, D)
        if self.kernel is not None:
            lr_pool = p.v_lr[layer] if self.decomposed else None
            b_heads = lora_b_per_head(lora_b, p.layout.n_kv_heads) if self.decomposed else None

            def run(rows: slice, **kw) -> torch.Tensor:
                return self.kernel(
                    q1[rows],
                    p.k[layer],
                    p.v[layer],
                    self.kv_lens32[rows],
                    v_lr_cache=lr_pool,
                    lora_b=b_heads,
                    scaling=scaling,
                    role_ids=None if role_ids is None else role_ids[rows],
                    kv_slot=self.kv_slot32[rows],
                    lr_slot=self.lr_slot32[rows],
                    **({} if q_add is None else {"q_add": q_add[rows]}),  # the call of a step without it unchanged
                    **kw,
                )

            if self.token_groups is None:
                return run(slice(None))[:, :, None]
            start, size = self.token_groups
            out = torch.empty_like(q1, memory_format=torch.contiguous_format)
            if start:
                run(slice(0, start), out=out[:start])
            run(slice(start, None), out=out[start:], group_rows=size)
            return out[:, :, None]
        if q_add is not None:
            q1 = (q1.float() + q_add).to(q1.dtype)
        n = self.max_len
        k = p.k[layer][:, :, :n][self.kv_slot]  # (B, H_kv, n, D)
        v = p.v[layer][:, :, :n][self.kv_slot]
        v_lr = p.v_lr[layer][:, :n][self.lr_slot] if self.decomposed else None  # (B, n, r)
        out = decode_attention_reference(q1, k, v, self.kv_lens, v_lr, lora_b, scaling, role_ids)
        return out[:, :, None]


class GrowableView:
    """Cache view (:class:`CacheView`) over growable per-layer caches.

    The new ``T`` positions are written at ``start`` in every layer's buffers and attend over positions
    ``[0, start + T)`` with an optional padding mask. A decomposed cache that carries a
    :class:`~lragent.attention.RoleSplit` (``role_split``: the training step's shared pass, from position 0, no mask)
    attends in two pieces (:func:`~lragent.attention.two_piece_attention`), whatever ``role_ids`` says.

    Args:
        caches: one :class:`LayerCache` per model layer (a :class:`ModelCache` or a list).
        start: cache position of the first new position.
        key_mask: ``(B, >= start + T)`` 1 for real tokens, 0 for padding, or ``None``.
        capture: layer index -> buffer ``[B, S, hidden]`` receiving the hidden states entering that layer.
        use_kernel: allow the fused kernel on CUDA.
    """

    def __init__(
        self,
        caches: ModelCache | list[LayerCache],
        start: int,
        key_mask: torch.Tensor | None = None,
        capture: dict[int, GrowableBuffer] | None = None,
        use_kernel: bool = True,
    ) -> None:
        self.caches = caches
        self.start = start
        self.key_mask = key_mask
        self.capture_buffers = capture or {}
        self.use_kernel = use_kernel
        self.decomposed = bool(caches[0].v_is_base)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        cache = self.caches[layer]
        cache.k.write(self.start, k)
        cache.v.write(self.start, v)
        if v_lr is not None:
            cache.v_lr.write(self.start, v_lr)

    def rope_store(self, layer, q, k, v, v_lr, cos, sin) -> torch.Tensor:
        return rope_store_unfused(self, layer, q, k, v, v_lr, cos, sin)

    def store_lr(self, layer: int, v_lr: torch.Tensor) -> None:
        self.caches[layer].v_lr.write(self.start, v_lr)

    def capture(self, layer: int, h: torch.Tensor) -> None:
        if layer in self.capture_buffers:
            self.capture_buffers[layer].write(self.start, h.detach())

    def attend(
        self, layer: int, q: torch.Tensor, lora_b: torch.Tensor | None, scaling: float, role_ids: torch.Tensor
    ) -> torch.Tensor:
        cache = self.caches[layer]
        end = self.start + q.shape[2]
        km = None if self.key_mask is None else self.key_mask[:, :end]
        layout = getattr(self.caches, "role_split", None)
        if self.decomposed and layout is not None and km is None and self.start == 0:
            # the shared pass: a producer's prefix and a consumer's suffix per sequence (``role_ids`` per token
            # says the same); two D-wide attentions instead of one over [V_base | V_lr]
            v_lr = cache.v_lr.view(end)
            return two_piece_attention(q, cache.k.view(end), cache.v.view(end), v_lr, lora_b, scaling, layout)
        if self.decomposed:
            return decomposed_attention(
                q,
                cache.k.view(end),
                cache.v.view(end),
                cache.v_lr.view(end),
                lora_b,
                scaling,
                role_ids,
                key_mask=km,
                use_kernel=self.use_kernel,
            )
        return plain_attention(q, cache.k.view(end), cache.v.view(end), km)


class ReplayView:
    """A cache view for one checkpointed layer: the first call goes through ``view``; the recomputation in backward
    writes nothing (the cache already holds these positions, and other forwards may have appended after them) and
    attends to what the first call wrote, which has the same values.
    """

    def __init__(self, view: CacheView) -> None:
        self.view = view
        self.decomposed = view.decomposed
        self.replay = False

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, v_lr: torch.Tensor | None) -> None:
        if not self.replay:
            self.view.store(layer, k, v, v_lr)

    def rope_store(self, layer, q, k, v, v_lr, cos, sin) -> torch.Tensor:
        return rope_store_unfused(self, layer, q, k, v, v_lr, cos, sin)

    def store_lr(self, layer: int, v_lr: torch.Tensor) -> None:
        if not self.replay:
            self.view.store_lr(layer, v_lr)

    def capture(self, layer: int, h: torch.Tensor) -> None:
        if not self.replay:
            self.view.capture(layer, h)

    def attend(self, layer, q, lora_b, scaling, role_ids) -> torch.Tensor:
        return self.view.attend(layer, q, lora_b, scaling, role_ids)
