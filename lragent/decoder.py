"""The decoder forward of LLaMA / Mistral / Qwen2 models, run layer by layer over lragent's caches.

transformers' own forward cannot route a role per sequence or keep V as V_base + V_lr, so this module re-runs the
model's own modules (norms, projections, rotary embedding, MLP) with those two changes. It matches transformers'
forward to float rounding: the tests pin that against a merged-weights transformers model.

Every forward writes the new positions into a cache (a fresh one when none is given) and attends over the
cache's positions ``[0, start + T)``, so prefill, decoding, recompute and training share one code path.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PreTrainedModel

from lragent.attention import decomposed_attention, plain_attention
from lragent.kv_cache import GrowableBuffer, LayerCache, ModelCache
from lragent.multi_lora import MultiLoraLinear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies RoPE to ``x`` ``(B, H, T, D)`` with ``cos``/``sin`` ``(B, T, D)``."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _proj(module: nn.Module, x: torch.Tensor, role_ids: torch.Tensor | None) -> torch.Tensor:
    if isinstance(module, MultiLoraLinear):
        return module(x, role_ids)
    return module(x)


class DecoderEngine:
    """Runs the decoder layers of a causal LM over :class:`~lragent.kv_cache.LayerCache` objects.

    Args:
        model: a LLaMA-, Mistral- or Qwen2-style ``*ForCausalLM`` (possibly with :class:`MultiLoraLinear` injected).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = self.inner.layers
        self.n_layers = len(self.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size

    # ---- pieces -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, hidden)``."""
        return self.inner.embed_tokens(input_ids)

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``(B, T, D)`` for absolute ``positions`` ``(B, T)``."""
        return self.inner.rotary_emb(h, positions)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``(B, T, hidden)`` -> ``(B, T, vocab)``."""
        return self.model.lm_head(self.inner.norm(h))

    def _mlp(self, layer: nn.Module, x: torch.Tensor, role_ids: torch.Tensor | None) -> torch.Tensor:
        mlp = layer.mlp
        if not any(isinstance(getattr(mlp, n), MultiLoraLinear) for n in ("gate_proj", "up_proj", "down_proj")):
            return mlp(x)
        gate = _proj(mlp.gate_proj, x, role_ids)
        return _proj(mlp.down_proj, mlp.act_fn(gate) * _proj(mlp.up_proj, x, role_ids), role_ids)

    # ---- one layer ----------------------------------------------------------------------------------------------
    def layer_forward(
        self,
        index: int,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        role_ids: torch.Tensor | None,
        cache: LayerCache,
        start: int,
        write_kv: bool = True,
        key_mask: torch.Tensor | None = None,
        use_kernel: bool = True,
    ) -> torch.Tensor:
        """One decoder layer over ``T`` positions that sit at cache positions ``[start, start + T)``.

        Args:
            index: layer index.
            h: ``(B, T, hidden)`` hidden states entering the layer.
            rotary: cos/sin ``(B, T, D)`` for the positions.
            role_ids: ``(B,)`` role of each sequence.
            cache: the layer's cache; the new K/V (or V_base/V_lr) are written at ``start``.
            start: cache position of the first of the ``T`` positions.
            write_kv: False when K and V_base for these positions are already cached (``base_shared``'s LR
                prefill): only V_lr is (re)written, and the K and V_base projections are skipped.
            key_mask: ``(B, >= start + T)`` padding mask over cache positions, or ``None``.
            use_kernel: allow the fused kernel on CUDA.

        Returns:
            ``(B, T, hidden)`` hidden states leaving the layer.
        """
        layer = self.layers[index]
        attn = layer.self_attn
        b, t, _ = h.shape
        cos, sin = rotary
        x = layer.input_layernorm(h)
        q = _rope(_proj(attn.q_proj, x, role_ids).view(b, t, -1, self.head_dim).transpose(1, 2), cos, sin)
        v_mod = attn.v_proj
        low_rank = cache.v_is_base and isinstance(v_mod, MultiLoraLinear)
        if write_kv:
            k = _rope(_proj(attn.k_proj, x, role_ids).view(b, t, -1, self.head_dim).transpose(1, 2), cos, sin)
            cache.k.write(start, k)
            v = v_mod.base(x) if low_rank else _proj(v_mod, x, role_ids)
            cache.v.write(start, v.view(b, t, -1, self.head_dim).transpose(1, 2))
        elif not low_rank:
            raise ValueError("write_kv=False needs a decomposed cache and a LoRA on v_proj")
        end = start + t
        km = None if key_mask is None else key_mask[:, :end]
        if low_rank:
            cache.v_lr.write(start, v_mod.lora_input(x, role_ids))
            o = decomposed_attention(
                q,
                cache.k.view(end),
                cache.v.view(end),
                cache.v_lr.view(end),
                v_mod.stacked_b(),
                v_mod.scaling,
                role_ids if role_ids is not None else torch.zeros(b, dtype=torch.long, device=h.device),
                key_mask=km,
                use_kernel=use_kernel,
            )
        else:
            o = plain_attention(q, cache.k.view(end), cache.v.view(end), km)
        h = h + _proj(attn.o_proj, o.transpose(1, 2).reshape(b, t, -1), role_ids)
        return h + self._mlp(layer, layer.post_attention_layernorm(h), role_ids)

    # ---- many layers --------------------------------------------------------------------------------------------
    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        role_ids: torch.Tensor | None,
        caches: ModelCache | list[LayerCache],
        start: int,
        layers: Iterable[int] | None = None,
        write_kv: bool = True,
        key_mask: torch.Tensor | None = None,
        capture: dict[int, GrowableBuffer] | None = None,
        use_kernel: bool = True,
    ) -> torch.Tensor:
        """Runs ``layers`` (default: all) in order; see :meth:`layer_forward`.

        Args:
            h: ``(B, T, hidden)``.
            positions: ``(B, T)`` absolute RoPE positions.
            role_ids: ``(B,)``.
            caches: one :class:`LayerCache` per model layer.
            start: cache position of the first new position.
            layers: layer indices to run.
            write_kv: see :meth:`layer_forward`.
            key_mask: ``(B, L)`` padding mask over cache positions.
            capture: layer index -> buffer ``[B, S, hidden]`` that receives the hidden states entering that layer
                (DroidSpeak's stored inputs of its recompute groups).
            use_kernel: allow the fused kernel on CUDA.

        Returns:
            ``(B, T, hidden)`` after the last layer run.
        """
        rotary = self.rotary(h, positions)
        for i in range(self.n_layers) if layers is None else layers:
            if capture is not None and i in capture:
                capture[i].write(start, h.detach())
            h = self.layer_forward(i, h, rotary, role_ids, caches[i], start, write_kv, key_mask, use_kernel)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        role_ids: torch.Tensor | None,
        caches: ModelCache | list[LayerCache] | None = None,
        start: int | None = None,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        capture: dict[int, GrowableBuffer] | None = None,
        last_only: bool = False,
        use_kernel: bool = True,
    ) -> torch.Tensor:
        """Full-depth forward of new tokens appended to ``caches`` (a fresh plain cache when ``None``).

        Args:
            input_ids: ``(B, T)``.
            role_ids: ``(B,)``.
            caches: per-layer caches; the tokens are written at ``start`` (default: the cache's length).
            start: cache position of the first token.
            positions: ``(B, T)`` RoPE positions; default ``start + arange(T)``.
            key_mask: ``(B, start + T)`` padding mask.
            capture: see :meth:`run_layers`.
            last_only: return logits for the last position only.
            use_kernel: allow the fused kernel on CUDA.

        Returns:
            logits ``(B, T, vocab)`` (``(B, 1, vocab)`` with ``last_only``).
        """
        if caches is None:
            caches = ModelCache(self.n_layers)
        if start is None:
            start = caches[0].length
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        h = self.run_layers(
            self.embed(input_ids),
            positions,
            role_ids,
            caches,
            start,
            key_mask=key_mask,
            capture=capture,
            use_kernel=use_kernel,
        )
        if last_only:
            h = h[:, -1:]
        return self.logits(h)
