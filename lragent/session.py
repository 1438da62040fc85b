"""Multi-agent session: agents (roles) extend one trajectory in turn over a KV cache shared by a scheme.

Each step of role j: prefill what j must (the scheme decides; DESIGN.md §2), then generate. "Unseen by j" means
tokens j has not processed itself; after its step j has seen the whole trajectory, so what j has seen is always
a prefix, tracked as ``seen[j]``.

- ``non_shared``: a plain K/V cache per agent; j prefills every token it has not seen into its own cache.
- ``full_shared``: one plain K/V cache; j prefills only tokens not in the shared cache.
- ``droidspeak``: one plain cache plus the hidden states entering each recompute group; j recomputes the groups'
  K/V for context it has not seen, from the stored hidden states with its own adapter (overwriting them), then
  prefills the new tokens.
- ``base_shared``: shared K and V_base, one V_lr per agent; j runs an LR prefill over context it has not seen (full
  depth as j, K/V_base reused, j's V_lr written), then prefills the new tokens.
- ``base_lr_shared``: shared K, V_base and V_lr (shared A); j prefills only new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lragent.generation import find_stop, select_token
from lragent.kv_cache import GrowableBuffer, ModelCache
from lragent.lora_model import MultiLoraModel
from lragent.schemes import Scheme


@dataclass
class StepResult:
    """What one agent step did.

    Attributes:
        role: the role that acted.
        prefill_tokens: positions the prefill ran the model over (new tokens, plus recomputed or LR-prefilled
            context for ``droidspeak`` / ``base_shared``, plus everything unseen for ``non_shared``).
        recomputed_tokens: of those, context positions already in a shared cache that were processed again.
        generated_ids: generated tokens (all of them, stop string included).
        text: decoded generated text, cut before the first stop string.
        kept_tokens: generated tokens kept in the trajectory (the stop string's tokens are dropped).
        prefill_s: wall seconds of the prefill.
        decode_s: wall seconds of the generation loop.
        stop_reason: ``stop``, ``eos`` or ``length``.
        logits: with ``return_logits``: ``(n, vocab)`` logits of the positions in ``logit_positions``.
        logit_positions: trajectory positions whose next-token logits are in ``logits``.
    """

    role: str
    prefill_tokens: int
    recomputed_tokens: int
    generated_ids: list[int]
    text: str
    kept_tokens: int
    prefill_s: float
    decode_s: float
    stop_reason: str
    logits: torch.Tensor | None = None
    logit_positions: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "generated_ids": self.generated_ids,
            "text": self.text,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "stop_reason": self.stop_reason,
        }


def groups_from_layers(layers: Sequence[int], n_layers: int) -> list[tuple[int, int]]:
    """Turns a list of layer indices into contiguous half-open groups ``[(start, end), ...]``."""
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < n_layers]
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


class MultiAgentSession:
    """One trajectory extended by several LoRA agents over caches shared according to ``scheme``.

    Args:
        model: the multi-LoRA model (roles come from its config).
        scheme: one of ``non_shared``, ``full_shared``, ``droidspeak``, ``base_shared``, ``base_lr_shared``.
        tokenizer: needed for :meth:`append_text`, stop strings and ``text``; optional otherwise.
        droidspeak_layers: layers DroidSpeak recomputes (contiguous runs form groups); default a middle third.
        use_kernel: use the fused Flash-LoRA-Attention kernel on CUDA (False: PyTorch path, for comparisons).
        seed: seed of the sampling RNG.
        eos_token_ids: tokens that end generation; default from the model's generation config and tokenizer.
    """

    def __init__(
        self,
        model: MultiLoraModel,
        scheme: str | Scheme,
        tokenizer: object | None = None,
        droidspeak_layers: Sequence[int] | None = None,
        use_kernel: bool = True,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.scheme = Scheme.parse(scheme)
        if self.scheme is Scheme.BASE_LR_SHARED and not model.lora_config.shared_a:
            raise ValueError(
                "scheme base_lr_shared needs shared A: with one A per role (shared_a=False) the low-rank cache "
                "X·A of one role means nothing to another; use base_shared instead"
            )
        self.model = model
        self.engine = model.engine
        self.tokenizer = tokenizer
        self.use_kernel = use_kernel
        self.generator = torch.Generator().manual_seed(seed)
        self.device = next(model.model.parameters()).device
        self.ids: list[int] = []
        self.seen: dict[int, int] = {}
        n = self.engine.n_layers
        roles = range(len(model.router))
        if self.scheme is Scheme.NON_SHARED:
            self.caches = {r: ModelCache(n) for r in roles}
        elif self.scheme is Scheme.BASE_SHARED:
            self.shared = ModelCache(n, decomposed=True, with_lr=False)
            self.lr = {r: [GrowableBuffer(1) for _ in range(n)] for r in roles}
        else:
            self.shared = ModelCache(n, decomposed=self.scheme is Scheme.BASE_LR_SHARED)
        self.groups: list[tuple[int, int]] = []
        self.hidden: dict[int, GrowableBuffer] = {}
        if self.scheme is Scheme.DROIDSPEAK:
            layers = default_droidspeak_layers(n) if droidspeak_layers is None else list(droidspeak_layers)
            self.groups = groups_from_layers(layers, n)
            self.hidden = {a: GrowableBuffer(1) for a, _ in self.groups}
        if eos_token_ids is None:
            eos = model.model.generation_config.eos_token_id if model.model.generation_config else None
            eos_list = [eos] if isinstance(eos, int) else list(eos or [])
            eos_token_ids = eos_list
        self.eos_token_ids = set(eos_token_ids)
        self.peak_cache_bytes = 0
        self.steps: list[StepResult] = []

    # ---- trajectory ---------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def append(self, token_ids: Sequence[int]) -> None:
        """Appends tokens (prompt pieces, tool outputs) to the shared trajectory."""
        vocab = self.model.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of range: allowed 0..{vocab - 1}")
        self.ids.extend(int(t) for t in token_ids)

    def append_text(self, text: str) -> list[int]:
        """Tokenises ``text`` (no special tokens) and appends it; returns the ids."""
        if self.tokenizer is None:
            raise ValueError("append_text needs a tokenizer: pass tokenizer= to the session")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.append(ids)
        return ids

    def truncate(self, n_tokens: int) -> None:
        """Cuts the trajectory (and every cache) to its first ``n_tokens`` tokens."""
        n_tokens = max(0, min(n_tokens, len(self.ids)))
        del self.ids[n_tokens:]
        self._truncate_caches(n_tokens)

    def _truncate_caches(self, n: int) -> None:
        if self.scheme is Scheme.NON_SHARED:
            for c in self.caches.values():
                c.truncate(n)
        else:
            self.shared.truncate(n)
        for buffers in getattr(self, "lr", {}).values():
            for buf in buffers:
                buf.truncate(n)
        for buf in self.hidden.values():
            buf.truncate(n)
        self.seen = {r: min(s, n) for r, s in self.seen.items()}

    # ---- memory -------------------------------------------------------------------------------------------------
    def cache_bytes(self) -> dict[str, int]:
        """Bytes held now, per component: ``k``, ``v`` (plain), ``v_base``, ``v_lr``, ``hidden`` (DroidSpeak)."""
        total: dict[str, int] = {}

        def add(parts: dict[str, int]) -> None:
            for k, v in parts.items():
                total[k] = total.get(k, 0) + v

        if self.scheme is Scheme.NON_SHARED:
            for c in self.caches.values():
                add(c.component_bytes())
        else:
            add(self.shared.component_bytes())
        for buffers in getattr(self, "lr", {}).values():
            add({"v_lr": sum(b.nbytes() for b in buffers)})
        if self.hidden:
            add({"hidden": sum(b.nbytes() for b in self.hidden.values())})
        return total

    def _note_peak(self) -> None:
        self.peak_cache_bytes = max(self.peak_cache_bytes, sum(self.cache_bytes().values()))

    # ---- one role's view of the caches ----------------------------------------------------------------------------
    def _layers_for(self, role: int) -> list:
        if self.scheme is Scheme.NON_SHARED:
            return self.caches[role].layers
        if self.scheme is Scheme.BASE_SHARED:
            return [layer.with_lr(buf) for layer, buf in zip(self.shared.layers, self.lr[role], strict=True)]
        return self.shared.layers

    def _cached_len(self, role: int) -> int:
        """Positions of the trajectory that already have K/V in the cache ``role`` reads."""
        if self.scheme is Scheme.NON_SHARED:
            return self.caches[role].length
        return self.shared.length

    def _positions(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.device)[None]

    def _run(self, role: int, start: int, end: int, last_only: bool) -> torch.Tensor:
        """Full-depth forward of trajectory tokens ``[start, end)`` as ``role``, written at ``start``."""
        ids = torch.tensor([self.ids[start:end]], device=self.device)
        return self.engine.forward(
            ids,
            torch.tensor([role], device=self.device),
            self._layers_for(role),
            start=start,
            capture=self.hidden or None,
            last_only=last_only,
            use_kernel=self.use_kernel,
        )[0]

    def _catch_up(self, role: int, start: int, end: int) -> None:
        """Processes context ``[start, end)`` that is in the shared cache but unseen by ``role``."""
        role_t = torch.tensor([role], device=self.device)
        pos = self._positions(start, end)
        if self.scheme is Scheme.BASE_SHARED:
            # LR prefill: full depth as `role`, K and V_base reused, the role's own V_lr written.
            h = self.engine.embed(torch.tensor([self.ids[start:end]], device=self.device))
            self.engine.run_layers(
                h, pos, role_t, self._layers_for(role), start, write_kv=False, use_kernel=self.use_kernel
            )
        elif self.scheme is Scheme.DROIDSPEAK:
            for a, b in self.groups:
                h = self.hidden[a].view()[:, start:end]
                self.engine.run_layers(h, pos, role_t, self.shared.layers, start, layers=range(a, b))

    # ---- a step -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        role: str | int,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        return_logits: bool = False,
    ) -> StepResult:
        """Lets ``role`` prefill what the scheme requires, then generate.

        Args:
            role: role name or id.
            max_new_tokens: generation bound (0: prefill only).
            temperature: 0 for greedy, > 0 to sample.
            top_p: nucleus mass for sampling.
            seed: reseeds the sampling RNG for this step.
            stop: stop strings; generation ends when the decoded text contains one. The trajectory keeps the tokens
                before it (``kept_tokens``), so the caller appends whatever format text should follow.
            return_logits: keep the logits of every position the step ran at full depth as this role.

        Returns:
            a :class:`StepResult`.
        """
        rid = self.model.router.id(role)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the session")
        if not self.ids:
            raise ValueError("the trajectory is empty: append tokens before a step")
        if seed is not None:
            self.generator.manual_seed(seed)
        stops = list(stop or [])
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        sync()
        t0 = time.perf_counter()
        n = len(self.ids)
        cached = self._cached_len(rid)
        if cached >= n:
            # Everything is cached already; recompute the last token to get its logits.
            self._truncate_caches(n - 1)
            cached = n - 1
        seen = self.seen.get(rid, 0)
        recomputed = 0
        if self.scheme in (Scheme.BASE_SHARED, Scheme.DROIDSPEAK) and seen < cached:
            self._catch_up(rid, seen, cached)
            recomputed = cached - seen
        logits = self._run(rid, cached, n, last_only=not return_logits)
        self._note_peak()
        sync()
        prefill_s = time.perf_counter() - t0
        logit_rows = [logits] if return_logits else []
        positions = list(range(cached, n)) if return_logits else []

        t1 = time.perf_counter()
        generated: list[int] = []
        reason = "length"
        text = ""
        next_logits = logits[-1]
        for i in range(max_new_tokens):
            token = select_token(next_logits, temperature, top_p, self.generator)
            generated.append(token)
            self.ids.append(token)
            if token in self.eos_token_ids:
                reason = "eos"
                break
            if stops:
                text = self.tokenizer.decode(generated, skip_special_tokens=False)
                if find_stop(text, stops) is not None:
                    reason = "stop"
                    break
            if i == max_new_tokens - 1:
                break
            pos = len(self.ids) - 1
            out = self._run(rid, pos, pos + 1, last_only=True)
            next_logits = out[-1]
            if return_logits:
                logit_rows.append(out)
                positions.append(pos)
        self._note_peak()
        sync()
        decode_s = time.perf_counter() - t1

        kept = len(generated)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            cut = find_stop(text, stops)
            if cut is not None:
                text = text[:cut]
                kept = self._tokens_before(generated, text)
        if reason == "eos":
            kept = min(kept, len(generated) - 1)  # EOS ends the turn; it is not part of the trajectory
        drop = len(generated) - kept
        if drop:
            self.truncate(len(self.ids) - drop)
        self.seen[rid] = min(len(self.ids), self._cached_len(rid))
        result = StepResult(
            role=self.model.router.name(rid),
            prefill_tokens=(n - cached) + recomputed,
            recomputed_tokens=recomputed,
            generated_ids=generated,
            text=text,
            kept_tokens=kept,
            prefill_s=prefill_s,
            decode_s=decode_s,
            stop_reason=reason,
            logits=torch.cat(logit_rows).float().cpu() if return_logits else None,
            logit_positions=positions,
        )
        self.steps.append(result)
        return result

    def _tokens_before(self, generated: list[int], text: str) -> int:
        """Largest k such that the first k generated tokens decode to a prefix of ``text``."""
        k = 0
        for j in range(1, len(generated) + 1):
            if text.startswith(self.tokenizer.decode(generated[:j], skip_special_tokens=True)):
                k = j
            else:
                break
        return k
