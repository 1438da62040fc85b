"""An independent, deliberately naive re-implementation of the five sharing schemes (DESIGN.md §2), for tests.

It shares nothing with the engine but the model's own modules (norms, projections, MLP, LoRA layers): no cache
views, no plans, no static pools, no fused attention. Every position is processed on its own, in order, through
explicit per-layer lists of stored vectors, and values are expanded literally (``V = V_base + (V_lr B_role) s``)
before a plain softmax attention. What each scheme stores and recomputes is written out from the design table:

- ``non_shared``: every role has its own K/V lists; a role processes every position it has not processed.
- ``full_shared``: one K/V list; a role processes only positions nobody has processed.
- ``droidspeak``: one K/V list plus the hidden states entering each recompute group; a role first rebuilds the
  groups' K/V over the positions it has not seen, from those hidden states, then processes the new positions.
- ``base_shared``: one K and V_base list, one V_lr list per role; a role first recomputes its own V_lr over the
  positions it has not seen (full depth as itself, K and V_base untouched), then processes the new positions.
- ``base_lr_shared``: one K, V_base and V_lr list; a role processes only new positions and applies its own B.

"Seen" is the prefix a role has processed as itself; if the whole trajectory is already in the role's cache, the
last position is processed again (its logits are needed to generate).
"""

from __future__ import annotations

import math

import torch

from lragent.multi_lora import MultiLoraLinear
from lragent.sharing import default_droidspeak_layers, groups_from_layers


def _rope(x: torch.Tensor, pos: int, cos_sin) -> torch.Tensor:
    """RoPE of ``x`` ``(H, D)`` at position ``pos``."""
    cos, sin = cos_sin
    c, s = cos[pos], sin[pos]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


class ReferenceSession:
    """One trajectory, the five schemes written out position by position (slow; tiny models only).

    Args:
        model: a :class:`~lragent.lora_model.MultiLoraModel` (fp32, eval mode).
        scheme: scheme name.
        droidspeak_layers: DroidSpeak's recompute layers (default: a middle third).
    """

    def __init__(self, model, scheme: str, droidspeak_layers=None) -> None:
        self.m = model
        self.hf = model.model
        self.scheme = scheme
        self.layers = self.hf.model.layers
        self.n_layers = len(self.layers)
        cfg = self.hf.config
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        cos, sin = self.hf.model.rotary_emb(torch.zeros(1), torch.arange(4096)[None])
        self.cos_sin = (cos[0], sin[0])
        layers = default_droidspeak_layers(self.n_layers) if droidspeak_layers is None else droidspeak_layers
        self.groups = groups_from_layers(list(layers), self.n_layers) if scheme == "droidspeak" else []
        self.ids: list[int] = []
        self.seen: dict[int, int] = {}
        roles = range(len(model.router))
        # caches: name -> per layer list of stored vectors (index = position)
        owners = [f"own{r}" for r in roles] if scheme == "non_shared" else ["shared"]
        self.K = {o: [[] for _ in range(self.n_layers)] for o in owners}
        self.V = {o: [[] for _ in range(self.n_layers)] for o in owners}  # full V or V_base
        lr_owners = [f"lr{r}" for r in roles] if scheme == "base_shared" else ["lr"]
        self.LR = {o: [[] for _ in range(self.n_layers)] for o in lr_owners}
        self.H = {a: [] for a, _ in self.groups}  # hidden entering each group start

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _owner(self, role: int) -> str:
        return f"own{role}" if self.scheme == "non_shared" else "shared"

    def _lr_owner(self, role: int) -> str:
        return f"lr{role}" if self.scheme == "base_shared" else "lr"

    @property
    def decomposed(self) -> bool:
        return self.scheme in ("base_shared", "base_lr_shared")

    def cached(self, role: int) -> int:
        return len(self.K[self._owner(role)][0])

    @staticmethod
    def _put(lst: list, pos: int, value: torch.Tensor) -> None:
        if pos < len(lst):
            lst[pos] = value
        else:
            assert pos == len(lst), "positions are written in order"
            lst.append(value)

    def _lin(self, mod, x: torch.Tensor, role: int) -> torch.Tensor:
        if isinstance(mod, MultiLoraLinear):
            return mod(x[None, None], torch.tensor([role]))[0, 0]
        return mod(x)

    def _attend(self, layer: int, q: torch.Tensor, pos: int, role: int) -> torch.Tensor:
        """Softmax attention of ``q`` ``(H_q, D)`` over stored positions ``[0, pos]`` with literal values."""
        k = torch.stack(self.K[self._owner(role)][layer][: pos + 1])  # (L, H_kv, D)
        v = torch.stack(self.V[self._owner(role)][layer][: pos + 1])  # (L, H_kv, D)
        if self.decomposed:
            mod = self.layers[layer].self_attn.v_proj
            lr = torch.stack(self.LR[self._lr_owner(role)][layer][: pos + 1])  # (L, r)
            v = v + (lr @ mod.lora_B[role].t() * mod.scaling).view(v.shape)  # literal V_base + (V_lr B) s
        group = self.n_heads // self.n_kv
        out = []
        for h in range(self.n_heads):
            g = h // group
            scores = (k[:, g] @ q[h]) / math.sqrt(self.hd)
            out.append(torch.softmax(scores, dim=0) @ v[:, g])
        return torch.stack(out)  # (H_q, D)

    def _layer(self, layer: int, h: torch.Tensor, pos: int, role: int, mode: str) -> torch.Tensor | None:
        """One layer at one position; mode ``full`` (write K/V), ``lr`` (write own V_lr only) or ``reuse``."""
        lay = self.layers[layer]
        attn = lay.self_attn
        x = lay.input_layernorm(h)
        if mode == "full":
            k = _rope(self._lin(attn.k_proj, x, role).view(self.n_kv, self.hd), pos, self.cos_sin)
            self._put(self.K[self._owner(role)][layer], pos, k)
            if self.decomposed:
                self._put(self.V[self._owner(role)][layer], pos, attn.v_proj.base(x).view(self.n_kv, self.hd))
                lr = x @ attn.v_proj.lora_A[0 if attn.v_proj.shared_a else role].t()
                self._put(self.LR[self._lr_owner(role)][layer], pos, lr)
            else:
                v = self._lin(attn.v_proj, x, role).view(self.n_kv, self.hd)
                self._put(self.V[self._owner(role)][layer], pos, v)
        elif mode == "lr":
            lr = x @ attn.v_proj.lora_A[0 if attn.v_proj.shared_a else role].t()
            self._put(self.LR[self._lr_owner(role)][layer], pos, lr)
        q = _rope(self._lin(attn.q_proj, x, role).view(self.n_heads, self.hd), pos, self.cos_sin)
        o = self._attend(layer, q, pos, role)
        h = h + self._lin(attn.o_proj, o.reshape(-1), role)
        x2 = lay.post_attention_layernorm(h)
        mlp = lay.mlp
        act = mlp.act_fn(self._lin(mlp.gate_proj, x2, role)) * self._lin(mlp.up_proj, x2, role)
        return h + self._lin(mlp.down_proj, act, role)

    def _full(self, pos: int, role: int) -> torch.Tensor:
        """Processes position ``pos`` at full depth as ``role``; returns its next-token logits."""
        h = self.hf.model.embed_tokens(torch.tensor(self.ids[pos]))
        for layer in range(self.n_layers):
            if layer in self.H:
                self._put(self.H[layer], pos, h)
            h = self._layer(layer, h, pos, role, "full")
        return self.hf.lm_head(self.hf.model.norm(h))

    def _lr_prefill(self, pos: int, role: int) -> None:
        h = self.hf.model.embed_tokens(torch.tensor(self.ids[pos]))
        for layer in range(self.n_layers):
            h = self._layer(layer, h, pos, role, "lr")

    def _recompute(self, pos: int, role: int) -> None:
        for a, b in self.groups:
            h = self.H[a][pos]
            for layer in range(a, b):
                h = self._layer(layer, h, pos, role, "full")

    # ---- API ------------------------------------------------------------------------------------------------------
    def append(self, ids) -> None:
        self.ids.extend(int(t) for t in ids)

    def truncate(self, n: int) -> None:
        n = max(0, min(n, len(self.ids)))
        del self.ids[n:]
        for store in (self.K, self.V, self.LR):
            for per_layer in store.values():
                for lst in per_layer:
                    del lst[n:]
        for lst in self.H.values():
            del lst[n:]
        self.seen = {r: min(s, n) for r, s in self.seen.items()}

    @torch.no_grad()
    def step(self, role: int, max_new_tokens: int) -> tuple[list[int], list[torch.Tensor], list[int]]:
        """Greedy step; returns (generated ids, logits rows, their positions)."""
        n = len(self.ids)
        cached = min(self.cached(role), n - 1)
        seen = min(self.seen.get(role, 0), cached)
        if self.scheme == "droidspeak":
            for p in range(seen, cached):
                self._recompute(p, role)
        elif self.scheme == "base_shared":
            for p in range(seen, cached):
                self._lr_prefill(p, role)
        logits, positions = [], []
        for p in range(cached, n):
            logits.append(self._full(p, role))
            positions.append(p)
        generated = []
        for i in range(max_new_tokens):
            tok = int(logits[-1].argmax())
            generated.append(tok)
            self.ids.append(tok)
            if i == max_new_tokens - 1:
                break
            logits.append(self._full(len(self.ids) - 1, role))
            positions.append(len(self.ids) - 1)
        self.seen[role] = min(len(self.ids), self.cached(role))
        return generated, logits, positions
