"""The decoder forward of LLaMA / Mistral / Qwen2 models, run layer by layer over lragent's caches.

transformers' own forward cannot route a role per sequence or keep V as V_base + V_lr, so this module re-runs the
model's own modules (norms, projections, rotary embedding, MLP) with those two changes. It matches transformers'
forward to float rounding: the tests pin that against a merged-weights transformers model.

Every layer reads and writes its cache through a **cache view** (:class:`~lragent.cache_views.CacheView`): the view
knows where the new positions go and which keys they attend to. Every view lives in :mod:`lragent.cache_views`:

- :class:`~lragent.cache_views.GrowableView` over growable per-layer buffers (training through the cache, autograd);
- :class:`~lragent.cache_views.PrefillView`: one trajectory's contiguous positions in a static pool slot;
- :class:`~lragent.cache_views.DecodeView`: one new token per batch row, each row its own slot, position and
  length (what a CUDA graph captures).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from lragent.cache_views import CacheView, GrowableView, ReplayView
from lragent.fused_weights import FusedGroup
from lragent.kv_cache import ModelCache
from lragent.multi_lora import MultiLoraLinear, role_mask, role_masked
from lragent.rope import apply_rope
from lragent.train_norm import rms_norm_like


def _proj(module: nn.Module, x: torch.Tensor, role_ids: torch.Tensor | None) -> torch.Tensor:
    if isinstance(module, MultiLoraLinear):
        return module(x, role_ids)
    return module(x)


def _roles(role_ids: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """``role_ids``, or zeros ``(batch,)`` (one role)."""
    return torch.zeros(batch, dtype=torch.long, device=device) if role_ids is None else role_ids


MaskFn = Callable[[], torch.Tensor]
"""Gives the ``(B, n_roles)`` role mask of the fused LoRA path (made on first call, once per decode step)."""


def _proj_masked(
    module: nn.Module, x: torch.Tensor, role_ids: torch.Tensor | None, mask: MaskFn | None
) -> torch.Tensor:
    """:func:`_proj`, with a LoRA's B applied through the role mask (:meth:`MultiLoraLinear.add_lora_masked`)
    when ``mask`` is given (the fused inference path) instead of gathering every row's B."""
    if mask is None or not isinstance(module, MultiLoraLinear):
        return _proj(module, x, role_ids)
    lr = module.lora_input(x, role_ids)
    return module.add_lora_masked(module.base(x), role_masked(lr, mask(), module.rank)[:, :, 0])


def _refresh_eager(group: FusedGroup, t: torch.Tensor) -> None:
    """Brings ``group``'s appended A rows up to date with its adapters, except while a CUDA graph is captured on
    ``t``'s device (the copy would be captured too; graph replays: the engine refreshes them)."""
    if group.lora and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        group.refresh()


def _group_forward(
    group: FusedGroup,
    x: torch.Tensor,
    role_ids: torch.Tensor | None,
    mask: MaskFn | None,
    no_b: tuple[int, ...] = (),
    normed: tuple[torch.Tensor, nn.Module] | None = None,
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """The fused modules' outputs for ``x``: one GEMM, then every adapter's B.

    Args:
        group: the fused projections (:class:`~lragent.fused_weights.FusedGroup`); when it carries the shared A
            rows, the GEMM's last columns are the adapters' X·A.
        x: ``(B, T, d_in)``.
        role_ids: ``(B,)``.
        mask: gives the ``(B, n_roles)`` role mask: B applied by one GEMM over all roles' B
            (:meth:`MultiLoraLinear.add_lora_masked`); ``None``: each row's B gathered
            (:meth:`MultiLoraLinear._add_lora`).
        no_b: module indices whose B is not applied here (``v_proj`` of a decomposed cache: the attention applies
            it).
        normed: ``(h, norm)``: ``x`` is the RMSNorm ``norm(h)`` and is not needed (None): the norm runs inside the
            GEMM (:func:`kernels.fused_gemv.rms_norm_linear`; see :func:`_norm_gemv_ok` for when it may).

    Returns:
        ``(outputs, lrs)``: each module's ``(B, T, d_out)`` output (base + LoRA, except ``no_b``: base only) and
        each adapted module's ``(B, T, r)`` X·A, by module index.
    """
    _refresh_eager(group, x if x is not None else normed[0])
    if normed is not None:
        from kernels.fused_gemv import rms_norm_linear

        h, norm = normed
        y = rms_norm_linear(h, norm.weight, norm.variance_epsilon, group.weight)[0]
    else:
        y = F.linear(x, group.weight, group.bias)
    parts = y.split(group.sizes, dim=-1)
    n = group.n_base
    outs = list(parts[:n])
    lrs: dict[int, torch.Tensor] = {}
    for j, i in enumerate(group.lora):
        m = group.modules[i]
        if not m.training or isinstance(m.dropout, nn.Identity):  # the GEMM's X·A has no dropout
            lrs[i] = parts[n + j]
    from_gemm = len(lrs) == len(group.lora)
    for i, m in enumerate(group.modules):
        if isinstance(m, MultiLoraLinear) and i not in lrs:
            lrs[i] = m.lora_input(x, role_ids)
    todo = [i for i in sorted(lrs) if i not in no_b]
    if not todo:
        return outs, lrs
    if mask is None:
        for i in todo:
            outs[i] = group.modules[i]._add_lora(outs[i], lrs[i], role_ids)
        return outs, lrs
    if from_gemm and group.lora:  # one mask launch for all the group's A columns
        rank = group.modules[group.lora[0]].rank
        masked = role_masked(y[..., sum(group.sizes[:n]) :], mask(), rank)
        cols = {i: masked[:, :, j] for j, i in enumerate(group.lora)}
    else:
        cols = {}
    for i in todo:
        m = group.modules[i]
        lm = cols[i] if i in cols else role_masked(lrs[i], mask(), m.rank)[:, :, 0]
        outs[i] = m.add_lora_masked(outs[i], lm)
    return outs, lrs


def _fused_step(view: object, x: torch.Tensor) -> bool:
    """Whether the view fuses a decode step of ``x``'s rows into the Triton GEMVs (``LRAGENT_FUSED_GEMV=N``: steps of
    at most N rows; a view without the attribute, or 0, never)."""
    return x.numel() // x.shape[-1] <= getattr(view, "norm_gemv_rows", 0)


def _norm_gemv_ok(view: object, group: FusedGroup | None, h: torch.Tensor) -> bool:
    """Whether ``group``'s GEMM may take the RMSNorm before it into its launch (:mod:`kernels.fused_gemv`): the view
    asks for it at this many rows (``LRAGENT_FUSED_GEMV=N``: steps of at most N rows), no bias, and every adapter's
    X·A from the GEMM (no adapter then needs the normed input itself)."""
    if group is None or group.bias is not None or group.weight.dtype != h.dtype:
        return False
    if not _fused_step(view, h):
        return False
    adapted = [i for i, m in enumerate(group.modules) if isinstance(m, MultiLoraLinear)]
    return sorted(group.lora) == adapted and all(
        not group.modules[i].training or isinstance(group.modules[i].dropout, nn.Identity) for i in adapted
    )


def _wide_norm_fused(x: torch.Tensor, n_out: int) -> bool:
    """:func:`kernels.fused_gemv.wide_norm_fused`: whether this GPU runs the norm GEMV into ``n_out`` outputs fused."""
    from kernels.fused_gemv import fuses_norm_gemv

    return fuses_norm_gemv(x, n_out)


def _plain_gemv_ok(view: object, o_proj: nn.Module, o: torch.Tensor) -> bool:
    """Whether ``o_proj`` runs on the Triton GEMV (:func:`kernels.fused_gemv.gemv`) rather than cuBLAS: a plain
    projection (no adapter, no bias) in a step the view fuses (``LRAGENT_FUSED_GEMV=N``: at most N rows). On an H100
    at one row it read the 8B o projection in 13.8 µs against cuBLAS's 16.1 (its split-K launch and reduction)."""
    if type(o_proj) is not nn.Linear or o_proj.bias is not None or o_proj.weight.dtype != o.dtype:
        return False
    return _fused_step(view, o)


class DecoderEngine:
    """Runs the decoder layers of a causal LM over cache views.

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
        self.vocab_size = cfg.vocab_size
        self._silu = getattr(cfg, "hidden_act", "silu") == "silu"
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fuse_lora = False
        """On the fused inference path (a view with ``fused``, no autograd), take each adapter's X·A from the fused
        GEMM's A columns (:func:`~lragent.fused_weights.fuse_base_weights` with ``lora=True``) and apply every row's B
        through a role mask instead of gathering each row's B per layer (set by the engine)."""
        self._n_roles: int | None = None
        self.gradient_checkpointing = False
        """Recompute each layer's activations in backward instead of keeping them (training through growable
        caches: :meth:`run_view`). Same values and gradients; memory per layer drops to its input and its K/V."""

    # ---- pieces -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, hidden)``."""
        return self.inner.embed_tokens(input_ids)

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``(B, T, D)`` for absolute ``positions`` ``(B, T)`` (transformers' rotary embedding)."""
        return self.inner.rotary_emb(h, positions)

    def rope_table(self, capacity: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``(capacity, D)`` for positions ``0..capacity-1``, computed once by transformers' rotary embedding
        (elementwise in the position, so a gathered row equals the value computed for that position alone)."""
        key = (capacity, dtype, str(device))
        if key not in self._rope_tables:
            dummy = torch.zeros(1, dtype=dtype, device=device)
            cos, sin = self.inner.rotary_emb(dummy, torch.arange(capacity, device=device)[None])
            self._rope_tables = {key: (cos[0].contiguous(), sin[0].contiguous())}
        return self._rope_tables[key]

    def logits(self, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """Final norm and LM head: ``(B, T, hidden)`` -> ``(B, T, vocab)``."""
        return self.model.lm_head(self._norm(self.inner.norm, h, fused))

    def _mlp(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        role_ids: torch.Tensor | None,
        fused: bool = False,
        mask: MaskFn | None = None,
        residual: torch.Tensor | None = None,
        gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
        silu_in_gemv: bool = False,
    ) -> torch.Tensor:
        """The MLP of ``layer`` on ``x`` ``(B, T, hidden)``; with ``residual`` (the fused path) ``residual + MLP(x)``,
        the add done by the down projection's GEMM where it is a plain bias-free linear (one kernel less per layer).
        ``gate_up``: the gate and up projections already computed (their GEMM took the norm: ``x`` is None);
        ``silu_in_gemv``: SiLU·mul inside the down projection's GEMV where it can (:mod:`kernels.fused_gemv`)."""
        mlp = layer.mlp
        if not fused and not any(
            isinstance(getattr(mlp, n), MultiLoraLinear) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            return mlp(x)
        gu = mlp.__dict__.get("_lragent_gu") if fused else None
        if gate_up is not None:
            gate, up = gate_up
        elif gu is not None:
            (gate, up), _ = _group_forward(gu, x, role_ids, mask)
        else:
            gate, up = _proj_masked(mlp.gate_proj, x, role_ids, mask), _proj_masked(mlp.up_proj, x, role_ids, mask)
        down = mlp.down_proj
        plain_down = type(down) is nn.Linear and down.bias is None
        if silu_in_gemv and fused and self._silu and plain_down and residual is not None:
            from kernels.fused_gemv import silu_mul_linear

            if residual.dtype == gate.dtype == down.weight.dtype:
                return silu_mul_linear(gate, up, down.weight, residual=residual)
        if fused and self._silu:
            from kernels.fused_ops import silu_mul

            act = silu_mul(gate, up)
        else:
            act = mlp.act_fn(gate) * up
        if residual is not None and type(down) is nn.Linear and down.bias is None and act.dtype == residual.dtype:
            # residual + act·Wᵀ in the GEMM's epilogue (rounded once, where h + (act·Wᵀ) rounds twice)
            flat = torch.addmm(residual.flatten(0, -2), act.flatten(0, -2), down.weight.t())
            return flat.view_as(residual)
        out = _proj_masked(down, act, role_ids, mask)
        return out if residual is None else residual + out

    def role_mask_for(self, view: CacheView, role_ids: torch.Tensor | None, h: torch.Tensor) -> MaskFn | None:
        """The fused LoRA path (:attr:`fuse_lora`) for this view: a function giving the ``(B, n_roles)`` role mask,
        made on first use once per view (once per decode step) and kept on it; ``None`` where that path is off (no
        fused view, autograd on, a role per token)."""
        if not (self.fuse_lora and getattr(view, "fused", False)) or torch.is_grad_enabled():
            return None
        if role_ids is not None and role_ids.dim() != 1:
            return None
        return functools.partial(self._role_mask, view, role_ids, h)

    def _role_mask(self, view: CacheView, role_ids: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        cached = getattr(view, "_lragent_role_mask", None)
        dtype = h.dtype
        if cached is not None and cached[0] is role_ids and cached[1].dtype == dtype:
            return cached[1]
        if self._n_roles is None:
            lora = [m for m in self.model.modules() if isinstance(m, MultiLoraLinear)]
            self._n_roles = lora[0].n_roles if lora else 1
        if role_ids is None:
            if self._n_roles != 1:
                raise ValueError(f"role_ids is required: the adapters serve {self._n_roles} roles")
            mask = torch.ones(h.shape[0], 1, dtype=dtype, device=h.device)
        else:
            mask = role_mask(role_ids, self._n_roles, dtype)
        view._lragent_role_mask = (role_ids, mask)
        return mask

    # ---- one layer ----------------------------------------------------------------------------------------------
    def layer_forward(
        self,
        index: int,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        role_ids: torch.Tensor | None,
        view: CacheView,
        write_kv: bool = True,
        lr_only: bool = False,
        kv_from: int = 0,
        kv_only: bool = False,
    ) -> torch.Tensor:
        """One decoder layer over ``T`` new positions.

        Args:
            index: layer index.
            h: ``(B, T, hidden)`` hidden states entering the layer.
            rotary: cos/sin ``(B, T, D)`` for the positions.
            role_ids: ``(B,)`` role of each sequence.
            view: where the new K/V go and what they attend to; a view with ``fused = True`` gets the fused
                norm / RoPE-and-store / SiLU kernels (:mod:`kernels.fused_ops`), else transformers' modules.
            write_kv: False when K and V_base of these positions are already cached (``base_shared``'s LR
                prefill): only V_lr is written, and the K and V_base projections are skipped.
            lr_only: write V_lr and stop (the last layer of an LR prefill: nothing after it is needed).
            kv_from: an LR prefill and a forward in one pass (``base_shared``): the first ``kv_from`` positions are
                cached already and get only V_lr (no K/V_base projections), the rest are written in full. Needs a
                view with ``sub()`` (:class:`~lragent.cache_views.PrefillView`).
            kv_only: write K, V (or V_base) and V_lr and stop: the last layer of a pass whose outputs nobody reads,
                only its cache (the producer of the shared-context forward). The values written are those of the
                full layer (same operations); the queries, attention, ``o_proj`` and MLP are skipped.

        Returns:
            ``(B, T, hidden)`` hidden states leaving the layer (``h`` itself with ``lr_only`` or ``kv_only``).
        """
        layer = self.layers[index]
        attn = layer.self_attn
        b, t, _ = h.shape
        cos, sin = rotary
        fused = getattr(view, "fused", False)
        view.capture(index, h)
        qkv = attn.__dict__.get("_lragent_qkv") if fused else None
        # the input norm inside the q/k/v GEMM (decode with LRAGENT_FUSED_GEMV=N, at most N rows): x is then never made
        norm_in_qkv = write_kv and kv_from == 0 and _norm_gemv_ok(view, qkv, h)
        x = None if norm_in_qkv else self._norm(layer.input_layernorm, h, fused)
        v_mod = attn.v_proj
        low_rank = view.decomposed
        if low_rank and not isinstance(v_mod, MultiLoraLinear):
            raise ValueError("a decomposed cache (V_base + V_lr) needs a LoRA adapter on v_proj")
        if not write_kv and not low_rank:
            raise ValueError("write_kv=False needs a decomposed cache and a LoRA on v_proj")
        mask = self.role_mask_for(view, role_ids, h) if fused else None
        # a one-row decode step: norm, q/k/v GEMV, RoPE and cache stores in one launch; q's LoRA term then rides
        # along to the attention (q_add)
        q_add = None
        one_launch = None
        if norm_in_qkv and not kv_only:
            one_launch = self._qkv_rope(index, h, layer, qkv, view, role_ids, rotary)
        if one_launch is not None:
            q, q_add = one_launch
        elif write_kv and kv_from > 0:
            v_lr = v_mod.lora_input(x, role_ids)  # (B, T, r): every position gets this role's V_lr
            view.sub(0, kv_from).store_lr(index, v_lr[:, :kv_from])
            xs = x[:, kv_from:]
            ts = t - kv_from
            k = _proj(attn.k_proj, xs, role_ids).view(b, ts, -1, self.head_dim)
            v = v_mod.base(xs).view(b, ts, -1, self.head_dim)
            q = _proj(attn.q_proj, x, role_ids).view(b, t, -1, self.head_dim)
            q_head = apply_rope(q[:, :kv_from].transpose(1, 2), cos[:, :kv_from], sin[:, :kv_from])
            q_tail = view.sub(kv_from, ts).rope_store(
                index, q[:, kv_from:], k, v, v_lr[:, kv_from:], cos[:, kv_from:], sin[:, kv_from:]
            )
            q = torch.cat([q_head, q_tail], dim=2)  # (B, H_q, T, D)
        elif write_kv and qkv is not None:
            # one GEMM for the three base projections (and, with fuse_lora, their adapters' X·A); each LoRA term
            # added to its slice; a decomposed cache stores v_proj's X·A as V_lr and the attention applies its B;
            # a decode view adds q_proj's LoRA term inside its RoPE-and-store launch
            q_mod = attn.q_proj
            fold_q = mask is not None and isinstance(q_mod, MultiLoraLinear) and getattr(view, "folds_q_lora", False)
            no_b = (0,) * fold_q + (2,) * low_rank
            normed = (h, layer.input_layernorm) if norm_in_qkv else None
            (q, k, v), lrs = _group_forward(qkv, x, role_ids, mask, no_b=no_b, normed=normed)
            v_lr = lrs[2] if low_rank else None
            q = q.view(b, t, -1, self.head_dim)
            k = k.view(b, t, -1, self.head_dim)
            v = v.view(b, t, -1, self.head_dim)
            if fold_q:
                q_lora = (lrs[0], q_mod.stacked_b(), q_mod.scaling, _roles(role_ids, b, h.device))
                q = view.rope_store(index, q, k, v, v_lr, cos, sin, q_lora=q_lora)  # (B, H_q, T, D)
            else:
                q = view.rope_store(index, q, k, v, v_lr, cos, sin)  # (B, H_q, T, D)
        elif write_kv:
            k = _proj(attn.k_proj, x, role_ids).view(b, t, -1, self.head_dim)
            if low_rank:
                v, v_lr = v_mod.base(x), v_mod.lora_input(x, role_ids)
            else:
                v, v_lr = _proj(v_mod, x, role_ids), None
            if kv_only:  # the stores of rope_store_unfused, without the queries
                v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
                view.store(index, apply_rope(k.transpose(1, 2), cos, sin), v, v_lr)  # (B, H_kv, T, D)
                return h
            q = _proj(attn.q_proj, x, role_ids).view(b, t, -1, self.head_dim)
            q = view.rope_store(index, q, k, v.view(b, t, -1, self.head_dim), v_lr, cos, sin)  # (B, H_q, T, D)
        else:
            view.store_lr(index, v_mod.lora_input(x, role_ids))
            if lr_only:
                return h
            q = apply_rope(_proj(attn.q_proj, x, role_ids).view(b, t, -1, self.head_dim).transpose(1, 2), cos, sin)
        if role_ids is None:
            role_ids = torch.zeros(b, dtype=torch.long, device=h.device)
        extra = {} if q_add is None else {"q_add": q_add}
        o = view.attend(
            index, q, v_mod.stacked_b() if low_rank else None, v_mod.scaling if low_rank else 1.0, role_ids, **extra
        )
        o = o.transpose(1, 2).reshape(b, t, -1)
        if _plain_gemv_ok(view, attn.o_proj, o):
            from kernels.fused_gemv import gemv

            o = gemv(o, attn.o_proj.weight)  # one launch, no split-K reduction (_plain_gemv_ok)
        else:
            o = _proj_masked(attn.o_proj, o, role_ids, mask)
        if fused:
            norm = layer.post_attention_layernorm
            gu = layer.mlp.__dict__.get("_lragent_gu")
            # gate/up carry no adapter (no B to add after the GEMV); the GPU's table may leave this wide GEMV to cuBLAS
            if _norm_gemv_ok(view, gu, o) and not gu.lora and _wide_norm_fused(o, gu.weight.shape[0]):
                from kernels.fused_gemv import rms_norm_linear

                y, h = rms_norm_linear(o, norm.weight, norm.variance_epsilon, gu.weight, residual=h)
                gate, up = y.split(gu.sizes, dim=-1)
                return self._mlp(layer, None, role_ids, fused, mask, residual=h, gate_up=(gate, up), silu_in_gemv=True)
            from kernels.fused_ops import rms_norm

            x2, h = rms_norm(o, norm.weight, norm.variance_epsilon, residual=h)
            silu_in_gemv = _fused_step(view, x2)
            return self._mlp(layer, x2, role_ids, fused, mask, residual=h, silu_in_gemv=silu_in_gemv)
        h = h + o
        x2 = rms_norm_like(layer.post_attention_layernorm, h)
        return h + self._mlp(layer, x2, role_ids, fused, mask)

    def _qkv_rope(
        self,
        index: int,
        h: torch.Tensor,
        layer: nn.Module,
        group: FusedGroup,
        view: object,
        role_ids: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A one-row decode step's input norm, q/k/v GEMV, RoPE and cache stores as one launch
        (:mod:`kernels.fused_qkv_rope`): returns the rotated base queries ``(1, H_q, 1, D)`` and q's rotated LoRA
        term ``(1, H_q, D)`` float32 for the attention to add (None without a q adapter); or None (nothing done) where
        the view does not ask for it (``LRAGENT_QKV_ROPE=0``, a prefill, several rows) or the layer is not one it
        takes (``group``, the layer's fused q/k/v weight, exactly q, k, v; adapters on v and optionally q, of one
        rank: the V_lr cache's for a decomposed cache; a full cache gets v's LoRA term added in the launch)."""
        if not getattr(view, "qkv_rope", 0) or h.numel() != h.shape[-1]:
            return None
        from kernels.fused_qkv_rope import usable

        attn = layer.self_attn
        d = self.head_dim
        if group.modules != [attn.q_proj, attn.k_proj, attn.v_proj] or group.sizes[0] % d or group.sizes[1] % d:
            return None
        n_q, n_kv = group.sizes[0] // d, group.sizes[1] // d
        a_rows = {i: group.a_offset(j) for j, i in enumerate(group.lora)}
        if group.sizes[2] != n_kv * d or 2 not in a_rows or 1 in a_rows:
            return None
        v_mod = group.modules[2]
        rank = v_mod.rank
        if view.decomposed and view.pool.v_lr[index].shape[-1] != rank:
            return None
        if not view.decomposed and v_mod.lora_B[0].dtype != group.weight.dtype:  # the launch adds B as stored
            return None
        q_mod = group.modules[0]
        if 0 in a_rows and q_mod.rank != rank:
            return None
        if not usable(h, group.weight, n_q, n_kv, d, rank):
            return None
        _refresh_eager(group, h)
        roles = _roles(role_ids, 1, h.device)
        q_lora = None
        if 0 in a_rows:
            q_lora = (a_rows[0], q_mod.stacked_b(), q_mod.scaling, roles)
        v_lora = None if view.decomposed else (v_mod.stacked_b(), v_mod.scaling, roles)  # v's B: the launch's
        norm = layer.input_layernorm
        return view.qkv_rope_store(
            index,
            h,
            norm.weight,
            norm.variance_epsilon,
            group.weight,
            (n_q, n_kv, d),
            rotary,
            a_rows[2],
            q_lora,
            v_lora,
        )

    @staticmethod
    def _norm(norm: nn.Module, h: torch.Tensor, fused: bool) -> torch.Tensor:
        if not fused:
            return rms_norm_like(norm, h)  # training on a GPU: one fused kernel (lragent.train_norm)
        from kernels.fused_ops import rms_norm

        return rms_norm(h, norm.weight, norm.variance_epsilon)[0]

    # ---- many layers --------------------------------------------------------------------------------------------
    def run_view(
        self,
        h: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        role_ids: torch.Tensor | None,
        view: CacheView,
        layers: Iterable[int] | None = None,
        write_kv: bool = True,
        kv_from: int = 0,
        kv_only_last: bool = False,
    ) -> torch.Tensor:
        """Runs ``layers`` (default: all) in order over one view; see :meth:`layer_forward`.

        With ``write_kv=False`` (LR prefill) the last layer only writes V_lr; with ``kv_only_last`` it only writes
        its K/V (the caller reads the cache, not the output). With :attr:`gradient_checkpointing` set and autograd
        on, every full layer over a :class:`~lragent.cache_views.GrowableView` runs under activation checkpointing.
        """
        order = list(range(self.n_layers) if layers is None else layers)
        ckpt = self.gradient_checkpointing and torch.is_grad_enabled() and isinstance(view, GrowableView)
        for i in order:
            lr_only = not write_kv and i == order[-1]
            kv_only = kv_only_last and write_kv and i == order[-1]
            if ckpt and not (lr_only or kv_only):
                h = _checkpointed_layer(self, i, h, rotary, role_ids, view, write_kv, kv_from)
            else:
                h = self.layer_forward(i, h, rotary, role_ids, view, write_kv, lr_only, kv_from, kv_only)
        return h

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        role_ids: torch.Tensor | None,
        caches,
        start: int,
        layers: Iterable[int] | None = None,
        write_kv: bool = True,
        key_mask: torch.Tensor | None = None,
        use_kernel: bool = True,
        kv_only_last: bool = False,
    ) -> torch.Tensor:
        """Runs layers over growable caches (:class:`~lragent.kv_cache.ModelCache`), new positions at ``start``.

        Args:
            h: ``(B, T, hidden)``.
            positions: ``(B, T)`` absolute RoPE positions.
            role_ids: ``(B,)``.
            caches: a ModelCache (or list of LayerCache), one per model layer.
            start: cache position of the first new position.
            layers: layer indices to run.
            write_kv: see :meth:`layer_forward`.
            key_mask: ``(B, L)`` padding mask over cache positions.
            use_kernel: allow the fused kernel on CUDA.
            kv_only_last: the last layer only writes its K/V (see :meth:`run_view`).

        Returns:
            ``(B, T, hidden)`` after the last layer run.
        """
        view = GrowableView(caches, start, key_mask=key_mask, use_kernel=use_kernel)
        return self.run_view(h, self.rotary(h, positions), role_ids, view, layers, write_kv, kv_only_last=kv_only_last)

    def forward(
        self,
        input_ids: torch.Tensor,
        role_ids: torch.Tensor | None,
        caches=None,
        start: int | None = None,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        last_only: bool = False,
        use_kernel: bool = True,
    ) -> torch.Tensor:
        """Full-depth forward of new tokens appended to growable caches (a fresh plain cache when ``None``).

        Args:
            input_ids: ``(B, T)``.
            role_ids: ``(B,)``.
            caches: per-layer growable caches; the tokens are written at ``start`` (default: the cache's length).
            start: cache position of the first token.
            positions: ``(B, T)`` RoPE positions; default ``start + arange(T)``.
            key_mask: ``(B, start + T)`` padding mask.
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
            self.embed(input_ids), positions, role_ids, caches, start, key_mask=key_mask, use_kernel=use_kernel
        )
        if last_only:
            h = h[:, -1:]
        return self.logits(h)


def _checkpointed_layer(
    engine: DecoderEngine,
    index: int,
    h: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    role_ids: torch.Tensor | None,
    view: CacheView,
    write_kv: bool,
    kv_from: int,
) -> torch.Tensor:
    """:meth:`DecoderEngine.layer_forward` under non-reentrant activation checkpointing (dropout masks replayed).

    Returns:
        ``(B, T, hidden)``, as the layer.
    """
    from torch.utils.checkpoint import checkpoint

    replay = ReplayView(view)
    calls = [0]

    def run(x: torch.Tensor) -> torch.Tensor:
        replay.replay = calls[0] > 0
        calls[0] += 1
        return engine.layer_forward(index, x, rotary, role_ids, replay, write_kv, False, kv_from)

    return checkpoint(run, h, use_reentrant=False, preserve_rng_state=True)
