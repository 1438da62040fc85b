"""A causal LM with shared-A multi-LoRA role adapters injected, and its forwards (plain and through shared caches)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from lragent.attention import RoleSplit, two_piece_enabled
from lragent.decoder import DecoderEngine
from lragent.kv_cache import ModelCache
from lragent.models import check_supported
from lragent.multi_lora import MultiLoraConfig, MultiLoraLinear
from lragent.roles import RoleRouter
from lragent.schemes import Scheme
from lragent.sharing import make_scheme


def _inject(model: PreTrainedModel, config: MultiLoraConfig) -> dict[str, MultiLoraLinear]:
    """Replaces the target linears of every decoder layer by :class:`MultiLoraLinear`; returns them by name."""
    found: dict[str, MultiLoraLinear] = {}
    layers = model.model.layers
    available: set[str] = set()
    for i, layer in enumerate(layers):
        for parent_name in ("self_attn", "mlp"):
            parent = getattr(layer, parent_name)
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear | MultiLoraLinear):
                    available.add(child_name)
                if child_name in config.targets and isinstance(child, nn.Linear):
                    wrapped = MultiLoraLinear(
                        child, len(config.roles), config.rank, config.alpha, config.dropout, config.shared_a
                    )
                    setattr(parent, child_name, wrapped)
                    found[f"model.layers.{i}.{parent_name}.{child_name}"] = wrapped
    missing = [t for t in config.targets if t not in available]
    if missing:
        raise ValueError(f"target modules {missing} not found in the model: it has {', '.join(sorted(available))}")
    return found


class MultiLoraModel(nn.Module):
    """A frozen base causal LM plus per-role LoRA adapters (shared A by default).

    Args:
        model: a LLaMA, Mistral or Qwen2 ``*ForCausalLM``; modified in place (targets wrapped, base frozen).
        config: adapter layout.
    """

    def __init__(self, model: PreTrainedModel, config: MultiLoraConfig) -> None:
        super().__init__()
        check_supported(model.config)
        self.model = model
        self.lora_config = config
        self.router = RoleRouter(config.roles)
        for p in model.parameters():
            p.requires_grad_(False)
        self._lora = _inject(model, config)
        self.decoder = DecoderEngine(model)

    # ---- parameters ---------------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.decoder.n_layers

    def lora_modules(self) -> dict[str, MultiLoraLinear]:
        """The injected layers by module path (``model.layers.{i}.self_attn.q_proj`` ...)."""
        return dict(self._lora)

    def lora_parameters(self) -> Iterator[nn.Parameter]:
        for m in self._lora.values():
            yield from m.lora_A
            yield from m.lora_B

    def lora_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by owner: ``"shared_a"`` (shared A) and one entry per role (its B, and its A if not shared)."""
        groups: dict[str, list[nn.Parameter]] = {"shared_a": []} if self.lora_config.shared_a else {}
        groups.update({role: [] for role in self.lora_config.roles})
        for m in self._lora.values():
            if self.lora_config.shared_a:
                groups["shared_a"].append(m.lora_A[0])
            for i, role in enumerate(self.lora_config.roles):
                groups[role].append(m.lora_B[i])
                if not self.lora_config.shared_a:
                    groups[role].append(m.lora_A[i])
        return groups

    @torch.no_grad()
    def init_adapters(self, mode: str = "zero", seed: int = 0, b_std: float = 0.02) -> None:
        """Re-initialises every adapter.

        Args:
            mode: ``zero`` (PEFT default: A Kaiming-uniform, B = 0, the adapters change nothing) or ``random``
                (B ~ N(0, b_std²) as well, distinct per role: for demos and tests of the sharing schemes).
            seed: RNG seed.
            b_std: standard deviation of B for ``random``.
        """
        if mode not in ("zero", "random"):
            raise ValueError(f"adapter init {mode!r} not supported: allowed zero, random")
        gen = torch.Generator().manual_seed(seed)
        for m in self._lora.values():
            for a in m.lora_A:
                bound = 1.0 / a.shape[1] ** 0.5
                # explicit CPU: the RNG is a CPU generator even under a default-device context (Lightning's)
                a.copy_((torch.rand(a.shape, generator=gen, device="cpu") * 2 - 1) * bound)
            for b in m.lora_B:
                if mode == "random":
                    b.copy_(torch.randn(b.shape, generator=gen, device="cpu") * b_std)
                else:
                    b.zero_()

    # ---- forwards -----------------------------------------------------------------------------------------------
    def _role_tensor(self, role_ids: torch.Tensor | list | None, batch: int, device: torch.device) -> torch.Tensor:
        if role_ids is None:
            if len(self.router) != 1:
                raise ValueError(f"role_ids is required: the model has roles {list(self.router.roles)}")
            return torch.zeros(batch, dtype=torch.long, device=device)
        if not isinstance(role_ids, torch.Tensor):
            role_ids = self.router.ids(role_ids, device=device)
        if role_ids.shape != (batch,):
            raise ValueError(f"role_ids must have shape ({batch},), got {tuple(role_ids.shape)}")
        if role_ids.device.type == "cpu":
            if role_ids.numel() and (int(role_ids.min()) < 0 or int(role_ids.max()) >= len(self.router)):
                raise ValueError(f"role_ids out of range: allowed 0..{len(self.router) - 1}, got {role_ids.tolist()}")
        else:  # checked on the device, without a host sync on every forward (a bad id fails the next sync)
            torch._assert_async(((role_ids >= 0) & (role_ids < len(self.router))).all())
        return role_ids.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        role_ids: torch.Tensor | list | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        output_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plain multi-LoRA forward, a role per sequence (training, scoring).

        Args:
            input_ids: ``(B, T)``.
            role_ids: ``(B,)`` ids or role names.
            attention_mask: ``(B, T)`` 1 for tokens, 0 for padding; with right padding positions are ``arange(T)``.
                Right-padded batches may pass ``None`` (real positions are the same; checking the padding costs a
                host sync).
            position_ids: ``(B, T)``; default: count of real tokens before each position.
            output_index: ``(N,)`` flat positions ``b * T + t`` whose logits are wanted; ``None``: all. The LM head
                then runs on N positions only (training scores about 1% of the tokens).

        Returns:
            logits ``(B, T, vocab)``, or ``(N, vocab)`` with ``output_index``.
        """
        b, t = input_ids.shape
        role_ids = self._role_tensor(role_ids, b, input_ids.device)
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        if attention_mask is not None and bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
            # Right padding only: the causal mask already keeps real tokens off the trailing padding, so plain
            # causal attention (flash kernels) gives the same outputs at every real position.
            attention_mask = None
        if output_index is None:
            return self.decoder.forward(input_ids, role_ids, positions=position_ids, key_mask=attention_mask)
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.decoder.run_layers(
            self.decoder.embed(input_ids), position_ids, role_ids, ModelCache(self.n_layers), 0, key_mask=attention_mask
        )  # (B, T, hidden)
        # index_select: its backward is an index_add (no sort, no host sync)
        return self.decoder.logits(h.flatten(0, 1).index_select(0, output_index))  # (N, vocab)

    def shared_context_forward(
        self,
        context_ids: torch.Tensor,
        context_mask: torch.Tensor,
        target_ids: torch.Tensor,
        target_mask: torch.Tensor,
        producer_ids: torch.Tensor | list,
        consumer_ids: torch.Tensor | list,
        scheme: str | Scheme = Scheme.BASE_LR_SHARED,
        output_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Context encoded by a producer role into a shared cache; target scored by the consumer role over it.

        This is the condition a consumer meets at inference under ``scheme`` (``base_lr_shared``: shared K, V_base
        and V_lr, the consumer applies its own B; ``full_shared``: V carries the producer's adapter), differentiable
        for the cache-sharing-aware loss.

        Args:
            context_ids: ``(B, Tc)`` left-padded context.
            context_mask: ``(B, Tc)`` 1 for tokens.
            target_ids: ``(B, Tt)`` right-padded continuation.
            target_mask: ``(B, Tt)`` 1 for tokens.
            producer_ids: ``(B,)`` role encoding the context.
            consumer_ids: ``(B,)`` role processing the target.
            scheme: ``base_lr_shared`` or ``full_shared``.
            output_index: ``(N,)`` flat target positions ``b * Tt + t`` whose logits are wanted; ``None``: all.

        Returns:
            logits over the target positions ``(B, Tt, vocab)``, or ``(N, vocab)`` with ``output_index``.

        The producer's last layer only writes its K/V (its outputs are never read), and with ``output_index`` the
        LM head runs on the N scored positions only: the logits there are those of the full computation.
        """
        layout = make_scheme(scheme, len(self.router), shared_a=self.lora_config.shared_a, n_layers=self.n_layers)
        if not layout.consumer_reads_producer_cache:
            raise ValueError(
                f"the shared-context forward emulates schemes in which the consumer reads the producer's cache as "
                f"written (full_shared, base_lr_shared); {layout.scheme.value} makes the consumer re-process the "
                "context, which this forward does not emulate"
            )
        b, tc = context_ids.shape
        dev = context_ids.device
        producer = self._role_tensor(producer_ids, b, dev)
        consumer = self._role_tensor(consumer_ids, b, dev)
        cache = ModelCache(self.n_layers, decomposed=layout.decomposed)
        ctx_pos = (context_mask.long().cumsum(-1) - 1).clamp_min(0)
        key_mask = torch.cat([context_mask, target_mask], dim=1)
        # the producer's outputs are not scored, only its cache is used: its last layer stops after writing K/V
        self.decoder.run_layers(
            self.decoder.embed(context_ids), ctx_pos, producer, cache, 0, key_mask=key_mask, kv_only_last=True
        )
        tgt_pos = context_mask.long().sum(-1, keepdim=True) + (target_mask.long().cumsum(-1) - 1).clamp_min(0)
        h = self.decoder.run_layers(self.decoder.embed(target_ids), tgt_pos, consumer, cache, tc, key_mask=key_mask)
        if output_index is not None:
            h = h.flatten(0, 1).index_select(0, output_index)  # (N, hidden)
        return self.decoder.logits(h)

    def shared_sequence_forward(
        self,
        input_ids: torch.Tensor,
        split: torch.Tensor,
        producer_ids: torch.Tensor | list,
        consumer_ids: torch.Tensor | list,
        scheme: str | Scheme = Scheme.BASE_LR_SHARED,
        output_index: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`shared_context_forward` in one pass over the unsplit sequences: the producer and the consumer
        batched token by token.

        Each token is processed by its own role: the first ``split`` tokens of a sequence by the producer, the rest
        by the consumer, at their own positions, causally. That is what the two-pass form computes: a context
        token attends only to context tokens, as the producer did; under ``full_shared`` every key carries the
        values its writer's adapter made; under ``base_lr_shared`` each query applies its own role's B to the
        shared V_lr. Here the sequences keep their right padding (no re-layout, no mask: causal attention over one
        length), and the producer and consumer projections run as one batch. Under ``base_lr_shared`` each layer's
        attention is the plain causal attention over the producer's values plus an r-wide correction of the consumer
        rows (:func:`~lragent.attention.two_piece_attention`; ``LRAGENT_TWO_PIECE=0``: one attention over
        ``[V_base | V_lr]`` with each query's B applied after); the consumer rows cost one host sync per forward.

        Args:
            input_ids: ``(B, T)`` right-padded sequences.
            split: ``(B,)`` tokens of each sequence encoded by the producer.
            producer_ids: ``(B,)`` role encoding the first ``split`` tokens.
            consumer_ids: ``(B,)`` role of the remaining tokens.
            scheme: ``base_lr_shared`` or ``full_shared``.
            output_index: ``(N,)`` flat positions ``b * T + t`` whose logits are wanted; ``None``: all.
            lengths: ``(B,)`` real tokens per sequence (right padding after); ``None``: ``T``. Padding positions
                (never read by a real one) then keep the producer's values in the two-piece attention.

        Returns:
            logits ``(B, T, vocab)``, or ``(N, vocab)`` with ``output_index``; the consumer's positions are those of
            :meth:`shared_context_forward` (the producer's are the producer's own outputs).
        """
        layout = make_scheme(scheme, len(self.router), shared_a=self.lora_config.shared_a, n_layers=self.n_layers)
        if not layout.consumer_reads_producer_cache:
            raise ValueError(
                f"the shared-context forward emulates schemes in which the consumer reads the producer's cache as "
                f"written (full_shared, base_lr_shared); {layout.scheme.value} makes the consumer re-process the "
                "context, which this forward does not emulate"
            )
        b, t = input_ids.shape
        dev = input_ids.device
        producer = self._role_tensor(producer_ids, b, dev)
        consumer = self._role_tensor(consumer_ids, b, dev)
        pos = torch.arange(t, device=dev).expand(b, t)  # (B, T)
        roles = torch.where(pos < split.to(dev)[:, None], producer[:, None], consumer[:, None])  # (B, T)
        role_split = None
        if layout.decomposed and two_piece_enabled():  # one host sync here, not one per layer
            role_split = RoleSplit.make(producer, consumer, split, t, lengths)
        cache = ModelCache(self.n_layers, decomposed=layout.decomposed, role_split=role_split)
        # use_kernel=False: the fused attention kernel has no backward, and this forward trains
        h = self.decoder.run_layers(self.decoder.embed(input_ids), pos, roles, cache, 0, use_kernel=False)
        if output_index is not None:
            h = h.flatten(0, 1).index_select(0, output_index)  # (N, hidden)
        return self.decoder.logits(h)

    # ---- comparison helpers -------------------------------------------------------------------------------------
    @torch.no_grad()
    def merged_model(self, role: str | int) -> PreTrainedModel:
        """A plain transformers model (deep copy) with ``role``'s adapters merged into the base weights."""
        rid = self.router.id(role)
        merged = copy.deepcopy(self.model)
        for name, module in self._lora.items():
            parent_name, child_name = name.rsplit(".", 1)
            parent = merged.get_submodule(parent_name)
            linear = copy.deepcopy(module.base)
            linear.weight.copy_(module.merged_weight(rid))
            setattr(parent, child_name, linear)
        return merged.eval()
