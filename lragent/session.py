"""Multi-agent session: agents (roles) extend one trajectory in turn over a KV cache shared by a scheme.

A thin one-trajectory front end over :class:`lragent.engine.Engine` (which batches many trajectories): each step of
role j prefills what the scheme requires (DESIGN.md §2; :mod:`lragent.sharing` says what per scheme), then
generates. "Unseen by j" means tokens j has not processed itself; after its step j has seen the whole cached
trajectory, so what j has seen is always a prefix, tracked as ``seen[j]``.

The cache is a static pool that grows between steps, in large chunks, when the trajectory needs more room; on CUDA
decoding replays a captured CUDA graph (``cuda_graphs=False`` decodes eagerly, for debugging and comparisons).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lragent.engine import Engine, GenerationRequest, StepResult
from lragent.lora_model import MultiLoraModel
from lragent.schemes import Scheme
from lragent.sharing import default_droidspeak_layers, groups_from_layers  # noqa: F401  (re-exported)

__all__ = ["MultiAgentSession", "StepResult", "default_droidspeak_layers", "groups_from_layers"]


class MultiAgentSession:
    """One trajectory extended by several LoRA agents over caches shared according to ``scheme``.

    Args:
        model: the multi-LoRA model (roles come from its config).
        scheme: one of ``non_shared``, ``full_shared``, ``droidspeak``, ``base_shared``, ``base_lr_shared``.
        tokenizer: needed for :meth:`append_text`, stop strings and ``text``; optional otherwise.
        droidspeak_layers: layers DroidSpeak recomputes (contiguous runs form groups); default a middle third.
        use_kernel: use the fused Triton kernels on CUDA (False: PyTorch attention, for comparisons).
        seed: base seed of sampling; step i samples with ``seed + i`` unless the step gives its own seed.
        eos_token_ids: tokens that end generation; default from the model's generation config.
        capacity: initial cache capacity in positions (grows between steps as needed).
        cuda_graphs: replay decode steps as CUDA graphs (default: on CUDA).
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
        capacity: int = 1024,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.scheme = Scheme.parse(scheme)
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.engine = Engine(
            model,
            self.scheme,  # parsed once, here: the engine and make_scheme take the Scheme as it is
            rows=1,
            capacity=capacity,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            droidspeak_layers=droidspeak_layers,
            use_kernel=use_kernel,
            cuda_graphs=cuda_graphs,
            growable=True,
        )
        self.steps: list[StepResult] = []

    # ---- trajectory ---------------------------------------------------------------------------------------------
    @property
    def ids(self) -> list[int]:
        """The trajectory's token ids."""
        return self.engine.ids(0)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def seen(self) -> dict[int, int]:
        """Per role id, the prefix of the trajectory it has processed as itself."""
        return self.engine.traj[0].seen

    def cached_len(self, role: str | int) -> int:
        """Positions with K/V in the cache ``role`` reads."""
        return self.engine.scheme.cached_len(self.engine.traj[0], self.model.router.id(role))

    def append(self, token_ids: Sequence[int]) -> None:
        """Appends tokens (prompt pieces, tool outputs) to the shared trajectory."""
        self.engine.append(0, token_ids)

    def append_text(self, text: str) -> list[int]:
        """Tokenises ``text`` (no special tokens) and appends it; returns the ids."""
        if self.tokenizer is None:
            raise ValueError("append_text needs a tokenizer: pass tokenizer= to the session")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.append(ids)
        return ids

    def truncate(self, n_tokens: int) -> None:
        """Cuts the trajectory (and every cache) to its first ``n_tokens`` tokens."""
        self.engine.truncate(0, n_tokens)

    # ---- memory -------------------------------------------------------------------------------------------------
    def cache_bytes(self) -> dict[str, int]:
        """Bytes held now, per component: ``k``, ``v`` (plain), ``v_base``, ``v_lr``, ``hidden`` (DroidSpeak)."""
        return self.engine.cache_bytes(0)

    @property
    def peak_cache_bytes(self) -> int:
        return self.engine.peak_cache_bytes

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
            seed: sampling seed of this step (default: the session seed plus the step index).
            stop: stop strings; generation ends when the decoded text contains one. The trajectory keeps the tokens
                before it (``kept_tokens``), so the caller appends whatever format text should follow.
            return_logits: keep the logits of every position the step ran at full depth as this role (eager).

        Returns:
            a :class:`StepResult`.
        """
        rid = self.model.router.id(role)
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the session")
        request = GenerationRequest(
            role=rid,
            max_new_tokens=max_new_tokens,
            stop=tuple(stop or ()),
            temperature=temperature,
            top_p=top_p,
            seed=self.seed + len(self.steps) if seed is None else seed,
            return_logits=return_logits,
        )
        result = self.engine.generate(0, request)
        self.steps.append(result)
        return result

    @torch.no_grad()
    def score(self, role: str | int, options: Sequence[Sequence[int]]) -> list[float]:
        """Teacher-forced log-probability of each option (token ids) as ``role``'s continuation; see
        :meth:`lragent.engine.Engine.score`."""
        return self.engine.score(0, self.model.router.id(role), options)
