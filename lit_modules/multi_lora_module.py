"""LightningModule that trains shared-A multi-LoRA role adapters (DESIGN.md §4).

Only the LoRA parameters train: one shared A (or one A per role with ``shared_a=False``) and one B per role, each
role in its own AdamW parameter group with its own learning rate, under a linear-warmup + cosine schedule.

**Cache-sharing-aware loss.** ``loss = (1 - λ) · plain + λ · shared``. The plain term is the usual multi-LoRA
causal-LM loss on the output tokens, each sequence under its own role. The shared term recreates what a consumer
meets at inference under ``base_lr_shared`` (or ``full_shared``): the context that other agents already put in the
shared cache is encoded by a *producer* role (drawn among the other roles) into the decomposed cache, and the
example's own role (the *consumer*) encodes its own prompt piece and the output over that cache; the loss is on the
same output tokens. ``λ = 0`` never runs the shared forward, so it is exactly plain multi-LoRA training.

**Validation** logs, per role, the plain loss and token accuracy, the same through the shared-cache path under each
scheme of ``val_schemes``, and the mean next-token KL(plain ‖ shared) over the output tokens. ``val_schemes: []``
validates the plain forward only (one forward instead of three: for sweeps; validate the chosen checkpoint with the
schemes afterwards).

**No host syncs per micro-batch.** The plain forward computes logits only at the supervised positions that the
collator lists (``loss_index``), passes no attention mask for the right-padded batches and accumulates validation
sums on the device; the host waits for the device only where Lightning logs (every ``log_every_n_steps``) and at
the end of a validation. The shared-cache paths (λ > 0, ``val_schemes``) run producer and consumer in one pass over
the unsplit batch (a role per token), so they need no host sync either and score only the supervised positions.

The frozen base weights are not stored in Lightning checkpoints (they are reloaded from ``model_name``); only the
adapters, optimizer and schedule state are.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torchmetrics import Metric

from datamodules.role_examples import IGNORE_INDEX
from lragent.host_threads import host_threads, pin_rank, pin_requested
from lragent.multi_lora import MultiLoraConfig
from lragent.roles import DEFAULT_ROLES
from lragent.schemes import Scheme

PAPER_ROLE_LR: dict[str, float] = {"plan": 5e-5, "action": 6e-5, "reflect": 6e-5}
"""Per-role learning rates of the paper."""
SHARED_SCHEMES: tuple[str, ...] = (Scheme.BASE_LR_SHARED.value, Scheme.FULL_SHARED.value)
"""Schemes the shared-cache forward (training term and validation) supports."""
PRODUCER_MODES: tuple[str, ...] = ("random", "next", "prefix")
SPLIT_MODES: tuple[str, ...] = ("piece", "last_token")
LAMBDA_MODES: tuple[str, ...] = ("weight", "sample")

log = logging.getLogger(__name__)


@dataclass
class TrainingConfig:
    """Optimisation and cache-sharing-loss settings, checked on construction.

    Attributes:
        role_lr: learning rate of each role's adapter parameters (its B, and its A without shared A).
        shared_a_lr: learning rate of the shared A.
        weight_decay: AdamW weight decay (paper: 0).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_ratio: share of the optimizer steps with linear warmup, in [0, 1).
        min_lr_ratio: cosine floor as a share of each group's peak lr, in [0, 1].
        lambda_shared: weight of the cache-sharing-aware term, in [0, 1].
        lambda_mode: how λ mixes the terms (DESIGN §4, "with probability / weight λ"): ``weight``, every step
            ``(1 - λ)·plain + λ·shared`` (two passes); ``sample``, one term per step, the shared one with probability
            λ (the same loss in expectation at about one pass per step; a noisier gradient).
        shared_scheme: scheme of the shared term (``base_lr_shared`` or ``full_shared``).
        producer: how the producer role is drawn: ``random`` among the other roles, ``next`` (role id + 1), or
            ``prefix``: the role of the batch's example whose whole text starts the context (as at inference, where
            that agent put it in the cache; needs ``data.cross_role_batches``), else ``random``.
        shared_split: what the consumer encodes itself: ``piece`` (the input's last prompt piece, as in the agent
            loop) or ``last_token`` (only the last input token).
        val_schemes: schemes evaluated through the shared-cache path during validation.
    """

    role_lr: dict[str, float]
    shared_a_lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.0
    lambda_shared: float = 0.0
    lambda_mode: str = "weight"
    shared_scheme: str = Scheme.BASE_LR_SHARED.value
    producer: str = "random"
    shared_split: str = "piece"
    val_schemes: tuple[str, ...] = SHARED_SCHEMES

    def __post_init__(self) -> None:
        for role, lr in self.role_lr.items():
            if not lr > 0:
                raise ValueError(f"learning rate of role {role!r} must be > 0, got {lr!r}")
        if not self.shared_a_lr > 0:
            raise ValueError(f"shared_a_lr must be > 0, got {self.shared_a_lr!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {self.betas!r}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0 <= self.lambda_shared <= 1:
            raise ValueError(f"lambda_shared must be in [0, 1], got {self.lambda_shared!r}")
        if self.lambda_mode not in LAMBDA_MODES:
            raise ValueError(f"lambda_mode {self.lambda_mode!r} not supported: allowed {', '.join(LAMBDA_MODES)}")
        for scheme in (self.shared_scheme, *self.val_schemes):
            if Scheme.parse(scheme).value not in SHARED_SCHEMES:
                raise ValueError(
                    f"scheme {scheme!r} cannot be trained or validated through the shared-cache path: "
                    f"allowed {', '.join(SHARED_SCHEMES)}"
                )
        if self.producer not in PRODUCER_MODES:
            raise ValueError(f"producer {self.producer!r} not supported: allowed {', '.join(PRODUCER_MODES)}")
        if self.shared_split not in SPLIT_MODES:
            raise ValueError(f"shared_split {self.shared_split!r} not supported: allowed {', '.join(SPLIT_MODES)}")


def fused_adamw_ok(params: list[torch.Tensor], precision_plugin: Any) -> bool:
    """Whether the adapters take torch's fused AdamW: every one on a CUDA device, and no gradient scaler (with
    ``16-mixed``'s scaler Lightning would refuse to clip the gradients of an optimizer that unscales them itself).
    The fused step makes the same update as torch's default (multi-tensor) step up to float rounding."""
    return bool(params) and all(p.is_cuda for p in params) and getattr(precision_plugin, "scaler", None) is None


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """Learning-rate factor: linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross entropy of unshifted labels.

    Args:
        logits: ``(B, T, V)``; position t predicts token t + 1.
        labels: ``(B, T)`` token ids, ``-100`` where no loss is taken.

    Returns:
        ``(loss, n)``: the mean over supervised tokens (0 when there are none) and their count.
    """
    shift_labels = labels[:, 1:]
    n = (shift_labels != IGNORE_INDEX).sum()
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss / n.clamp_min(1), n


def split_for_sharing(batch: dict[str, torch.Tensor], split: torch.Tensor, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Cuts every sequence at ``split``: the part before goes to the shared cache, the rest to the consumer.

    Args:
        batch: ``input_ids``, ``labels``, ``attention_mask`` ``(B, T)`` right-padded, ``lengths`` ``(B,)``.
        split: ``(B,)`` tokens of each sequence encoded by the producer, ``0 <= split < context_len``.
        pad_id: id written at padding positions.

    Returns:
        ``context_ids``/``context_mask`` ``(B, Tc)`` left-padded, ``target_ids``/``target_mask``/``target_labels``
        ``(B, Tt)`` right-padded, with ``Tc = max(split)`` and ``Tt = max(lengths - split)``.
    """
    ids, labels, lengths = batch["input_ids"], batch["labels"], batch["lengths"]
    b, t = ids.shape
    tc = int(split.max())
    tt = int((lengths - split).max())
    j = torch.arange(tc, device=ids.device)[None]  # (1, Tc)
    src = j - (tc - split[:, None])  # (B, Tc): source position, negative on the left padding
    ctx_mask = src >= 0
    context_ids = torch.where(ctx_mask, ids.gather(1, src.clamp(0, t - 1)), pad_id)
    j = torch.arange(tt, device=ids.device)[None]  # (1, Tt)
    src = (split[:, None] + j).clamp(max=t - 1)  # (B, Tt)
    tgt_mask = j < (lengths - split)[:, None]
    return {
        "context_ids": context_ids,
        "context_mask": ctx_mask.long(),
        "target_ids": torch.where(tgt_mask, ids.gather(1, src), pad_id),
        "target_mask": tgt_mask.long(),
        "target_labels": torch.where(tgt_mask, labels.gather(1, src), IGNORE_INDEX),
        "target_pos": src,
    }


def _host_to(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values as a long tensor on ``device``; to a GPU from page-locked memory without waiting (a plain copy
    from pageable memory would make the host wait for the device)."""
    t = values if torch.is_tensor(values) else torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class RoleSums(Metric):
    """Per-role sums of token-level values, accumulated on the device without host syncs.

    ``update(values, role)`` adds row i of ``values`` ``(N, K)`` to role ``role[i]``; :meth:`compute` returns the
    ``(n_roles, K)`` sums (summed over processes under DDP).

    Args:
        n_roles: number of roles.
        n_values: values per token (columns of ``values``).
    """

    full_state_update = False

    def __init__(self, n_roles: int, n_values: int) -> None:
        super().__init__()
        self.add_state("sums", default=torch.zeros(n_roles, n_values, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor, role: torch.Tensor) -> None:
        """Adds ``values`` ``(N, K)`` of tokens whose roles are ``role`` ``(N,)``."""
        self.sums.index_add_(0, role, values.to(self.sums.dtype))

    def compute(self) -> torch.Tensor:
        return self.sums


VAL_COLUMNS: tuple[str, ...] = ("loss", "acc", "kl", "n")
"""Columns of the validation sums: summed NLL, correct top-1, KL(plain ‖ shared), token count."""


class MultiLoraModule(LightningModule):
    """Trains per-role LoRA adapters (shared A by default) on a frozen base causal LM.

    Args:
        model_name: base model: ``default`` (the embedded SmolLM2-135M-Instruct), a hub name or local directory, or
            a named random architecture of :mod:`lragent.models` (e.g. ``tiny-llama``, for tests).
        tokenizer_name: tokenizer to use when it is not the model's own (``byte``: the offline byte tokenizer, for
            random architectures); ``None``: the model's. Linked to the data module's tokenizer by the CLI.
        model_overrides: config fields changed for a named random architecture (e.g. ``{"vocab_size": 258}``).
        model_seed: seed of a random architecture's weights.
        roles: role names in adapter order (role id = position); linked to the data module.
        rank: LoRA rank r.
        alpha: LoRA alpha (scaling alpha / r).
        dropout: dropout on the adapter input.
        targets: linear layers (per decoder layer) that get adapters, e.g. ``[q_proj, v_proj]``.
        shared_a: one A shared by all roles; False: one A per role (conventional multi-LoRA).
        adapter_seed: seed of the adapter init (A Kaiming-uniform, B zero).
        lr: learning rate of every role not in ``role_lr``.
        role_lr: per-role learning rates; ``None``: the paper's (plan 5e-5, action/reflect 6e-5) for those roles.
        shared_a_lr: learning rate of the shared A; ``None``: ``lr``.
        weight_decay: AdamW weight decay.
        warmup_ratio: share of the optimizer steps with linear warmup.
        min_lr_ratio: cosine floor as a share of the peak lr.
        lambda_shared: weight λ of the cache-sharing-aware term (0: plain multi-LoRA training).
        lambda_mode: ``weight`` (both terms every step, weighted) or ``sample`` (one term per step, the shared one
            with probability λ, drawn from the step number: the same draw on every rank and after a resume).
        shared_scheme: scheme of the shared term: ``base_lr_shared`` (needs shared A) or ``full_shared``.
        producer: ``random`` (among the other roles, seeded by the step), ``next`` (role id + 1), or ``prefix`` (the
            role of the batch's example whose whole text starts the context, else ``random``; with
            ``data.cross_role_batches``).
        shared_split: what the consumer encodes itself: ``piece`` (the input's last prompt piece) or ``last_token``.
        val_schemes: schemes validated through the shared-cache path; ``None``: ``base_lr_shared`` (with shared
            A) and ``full_shared``; ``[]``: the plain forward only (fast validation for sweeps).
        producer_seed: seed of the producer draws.
        adapters_path: start from this exported adapter set (a directory with ``lragent_adapters.safetensors`` or
            one PEFT directory per role) instead of fresh adapters; its layout must match. E.g. validate shipped
            adapters through every scheme: ``cli.py validate --config C --model.adapters_path DIR
            --model.val_schemes null`` (a ``--ckpt_path`` would also restore the checkpoint's hyperparameters).
        model_dtype: dtype of the frozen base weights (``float32``, ``bfloat16``, ``float16``); ``None``: float32.
            With ``trainer.precision: bf16-mixed`` an 8B model wants ``bfloat16``: half the memory, and autocast
            does not re-cast every weight on every matmul. The adapters stay float32 (AdamW on float32 weights).
        gradient_checkpointing: recompute each decoder layer's activations in backward instead of storing them
            (same loss and gradients; memory per layer drops to its input and its K/V; about one more forward).
    """

    def __init__(
        self,
        model_name: str = "default",
        tokenizer_name: str | None = None,
        model_overrides: dict[str, Any] | None = None,
        model_seed: int = 0,
        roles: list[str] | None = None,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.05,
        targets: list[str] | None = None,
        shared_a: bool = True,
        adapter_seed: int = 0,
        lr: float = 6e-5,
        role_lr: dict[str, float] | None = None,
        shared_a_lr: float | None = None,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.0,
        lambda_shared: float = 0.0,
        lambda_mode: str = "weight",
        shared_scheme: str = "base_lr_shared",
        producer: str = "random",
        shared_split: str = "piece",
        val_schemes: list[str] | None = None,
        producer_seed: int = 0,
        adapters_path: str | None = None,
        model_dtype: str | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        roles = list(DEFAULT_ROLES) if roles is None else list(roles)
        self.lora_config = MultiLoraConfig(
            roles=tuple(roles),
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            targets=("q_proj", "v_proj") if targets is None else tuple(targets),
            shared_a=shared_a,
        )
        unknown = [r for r in (role_lr or {}) if r not in roles]
        if unknown:
            raise ValueError(f"unknown role {unknown[0]!r} in role_lr: roles are {', '.join(roles)}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        defaults = {r: PAPER_ROLE_LR.get(r, lr) for r in roles} if role_lr is None else dict.fromkeys(roles, lr)
        if val_schemes is None:
            val_schemes = list(SHARED_SCHEMES) if shared_a else [Scheme.FULL_SHARED.value]
        self.train_config = TrainingConfig(
            role_lr={**defaults, **(role_lr or {})},
            shared_a_lr=lr if shared_a_lr is None else shared_a_lr,
            weight_decay=weight_decay,
            warmup_ratio=warmup_ratio,
            min_lr_ratio=min_lr_ratio,
            lambda_shared=lambda_shared,
            lambda_mode=lambda_mode,
            shared_scheme=shared_scheme,
            producer=producer,
            shared_split=shared_split,
            val_schemes=tuple(val_schemes),
        )
        if not shared_a:
            for scheme in (shared_scheme if lambda_shared > 0 else None, *val_schemes):
                if scheme == Scheme.BASE_LR_SHARED.value:
                    raise ValueError("scheme base_lr_shared needs shared A: set shared_a: true or use full_shared")
        if adapters_path is not None and not Path(adapters_path).is_dir():
            raise FileNotFoundError(f"adapters_path {adapters_path} is not a directory")
        if model_dtype is not None:
            from lragent.models import parse_dtype

            parse_dtype(model_dtype)  # a bad name fails here, before the model is loaded
        self.roles = roles
        self.lora_model = None  # built in configure_model (so that parsing a config does not load the model)
        self.pad_id = 0
        self.strict_loading = False  # checkpoints hold the adapters only; the frozen base comes from model_name
        self.val_sums = torch.nn.ModuleDict(
            {part: RoleSums(len(roles), len(VAL_COLUMNS)) for part in ["plain", *self.train_config.val_schemes]}
        )

    # ---- model ----------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Loads the base model and injects the adapters (once)."""
        if self.lora_model is not None:
            return
        from lragent.lora_model import MultiLoraModel
        from lragent.models import load_model

        # On the device Lightning initialises on (its tensor_init_context; the CPU elsewhere): an 8B model is built
        # on the GPU directly instead of in host memory.
        hf_model, tok = load_model(
            self.hparams.model_name,
            dtype=self.hparams.get("model_dtype") or torch.float32,
            device=torch.get_default_device(),
            overrides=self.hparams.model_overrides,
            seed=self.hparams.model_seed,
        )
        if self.hparams.tokenizer_name is not None:
            from datamodules.role_examples import resolve_tokenizer

            tok = resolve_tokenizer(self.hparams.tokenizer_name)
        if tok is not None:
            if len(tok) > hf_model.config.vocab_size:
                raise ValueError(
                    f"tokenizer has {len(tok)} tokens but model {self.hparams.model_name!r} only "
                    f"{hf_model.config.vocab_size} embeddings"
                )
            self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        dev = torch.get_default_device()  # fork only the RNG the adapters are drawn on (not every visible GPU's)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
            torch.manual_seed(self.hparams.adapter_seed)
            self.lora_model = MultiLoraModel(hf_model, self.lora_config)
            for p in self.lora_model.lora_parameters():  # the trained weights stay float32 under a low-precision base
                p.data = p.data.float()
            self.lora_model.init_adapters("zero", seed=self.hparams.adapter_seed)
        self.lora_model.decoder.gradient_checkpointing = bool(self.hparams.get("gradient_checkpointing", False))
        if self._trainer is not None:  # a mixed-precision fit: frozen linears in autocast's dtype (lragent.frozen_cast)
            from lragent.frozen_cast import cast_frozen_linears, frozen_cast_dtype

            cast = frozen_cast_dtype(self.trainer.precision, type(self.trainer.strategy).__name__, hf_model.dtype)
            if cast is not None:
                n = cast_frozen_linears(self.lora_model.model, cast)
                log.info("%d frozen linear layers stored in %s, as %s's autocast casts them", n, cast,
                         self.trainer.precision)  # fmt: skip
        if self.hparams.adapters_path is not None:
            from lragent.adapters_io import load_adapter_dir

            load_adapter_dir(self.lora_model, self.hparams.adapters_path)
        self.lora_model.model.train()

    def setup(self, stage: str) -> None:
        """Refuses prefix-packed training data with the cache-sharing-aware loss (before the model is loaded); on a
        GPU, narrows torch's host thread pool as an eval does (:mod:`lragent.host_threads`) unless ``OMP_NUM_THREADS``
        is set (Lightning sets it for DDP ranks)."""
        dm = None
        if self._trainer is not None:
            threads = host_threads(str(self.trainer.strategy.root_device), os.environ, torch.get_num_threads())
            if threads:
                torch.set_num_threads(threads)
            if stage == "fit" and pin_requested(os.environ):  # opt-in: lragent.host_threads
                pinned = pin_rank(self.trainer.local_rank, self.trainer.num_devices, os.environ)
                if pinned:
                    log.info("local rank %d pinned to CPUs %s", self.trainer.local_rank, pinned)
            dm = getattr(self.trainer, "datamodule", None)
        if stage == "fit" and self.train_config.lambda_shared > 0 and getattr(dm, "pack_prefixes", False):
            raise ValueError(
                f"lambda_shared={self.train_config.lambda_shared} needs one example per sequence: set "
                "data.pack_prefixes false (packed sequences have several supervised segments and no single split)"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        role_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Plain multi-LoRA logits ``(B, T, V)`` for ``input_ids`` ``(B, T)`` and ``role_ids`` ``(B,)``; ``(N, V)``
        at the flat positions ``output_index`` ``(N,)`` only, when given."""
        return self.lora_model(input_ids, role_ids, attention_mask=attention_mask, output_index=output_index)

    def plain_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``(N, V)`` of the batch's N supervised predictions (``loss_index``, row-major), plain forward.

        The batch is right-padded (the collator's layout), so no attention mask is needed: real positions only
        attend to real positions, and the padding positions are never scored.
        """
        return self(batch["input_ids"], batch["role_ids"], None, output_index=batch["loss_index"])

    # ---- losses ---------------------------------------------------------------------------------------------------
    def draw_producers(self, consumers: torch.Tensor, seed: int, batch: dict[str, Any] | None = None) -> torch.Tensor:
        """A producer role for every consumer ``(B,)``: a different role (the same one when there is only one).

        Drawn on the host from the batch's host copies when it has them (:meth:`host_producers`), else from
        ``consumers``; both give the same roles.
        """
        if batch is not None and "role_ids" in (batch.get("host") or {}):
            return _host_to(self.host_producers(batch, seed), consumers.device)
        n = len(self.roles)
        if n == 1:
            return consumers.clone()
        if self.train_config.producer == "next":
            return (consumers + 1) % n
        g = torch.Generator().manual_seed(seed)
        offset = torch.randint(1, n, consumers.shape, generator=g)
        return (consumers + _host_to(offset, consumers.device)) % n

    def host_producers(self, batch: dict[str, Any], seed: int) -> list[int]:
        """The producer of every row, from the host copy of the roles (``batch["host"]["role_ids"]``).

        ``random``: another role, seeded by ``seed``; ``next``: role id + 1. ``prefix``: where the batch lists
        ``prefix_sources`` (``data.cross_role_batches``), a row whose context starts with another row's whole example
        within the shared split gets that row's role (the longest such example); the other rows as ``random``.
        """
        roles = list(batch["host"]["role_ids"])
        n = len(self.roles)
        if n == 1:
            return roles
        if self.train_config.producer == "next":
            return [(r + 1) % n for r in roles]
        g = torch.Generator().manual_seed(seed)
        offset = torch.randint(1, n, (len(roles),), generator=g).tolist()
        drawn = [(r + o) % n for r, o in zip(roles, offset, strict=True)]
        if self.train_config.producer == "prefix" and batch.get("prefix_sources"):
            split = self.shared_split(batch).tolist()
            for b, found in enumerate(batch["prefix_sources"]):
                fits = [j for j, k in found if k <= split[b]]
                if fits:
                    drawn[b] = roles[fits[0]]
        return drawn

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Keeps host copies of the per-sequence lengths (``batch["host"]``, lists: Lightning moves only tensors): the
        shared pass lays out its producer and consumer rows from them without a device-to-host sync, which would
        leave the GPU idle while the host catches up (3.5 ms per step at 8B shapes on an H200)."""
        if isinstance(batch, dict) and "context_len" in batch and "host" not in batch:
            keys = ("context_len", "prefix_len", "lengths", "role_ids")
            batch = {**batch, "host": {k: batch[k].tolist() for k in keys if torch.is_tensor(batch.get(k))}}
        return batch

    def _per_sequence(self, batch: dict[str, Any], key: str) -> torch.Tensor | None:
        """``batch[key]`` from the host copy where there is one (a CPU tensor), else as it is."""
        host = batch.get("host") or {}
        return torch.tensor(host[key], dtype=torch.long) if key in host else batch.get(key)

    def shared_split(self, batch: dict[str, Any]) -> torch.Tensor:
        """``(B,)`` tokens of each sequence that come from the shared cache (see ``shared_split``); on the host where
        the batch has host copies."""
        if self.train_config.shared_split == "piece":
            return self._per_sequence(batch, "prefix_len")
        return self._per_sequence(batch, "context_len") - 1

    def shared_logits(
        self,
        batch: dict[str, torch.Tensor],
        producers: torch.Tensor,
        scheme: str,
        output_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits with each sequence's first ``shared_split`` tokens encoded by its producer into the shared cache
        and the rest by its own role (the consumer) over that cache, in one pass
        (:meth:`~lragent.lora_model.MultiLoraModel.shared_sequence_forward`).

        Args:
            batch: a collated batch (one example per sequence).
            producers: ``(B,)`` producer role of each sequence.
            scheme: ``base_lr_shared`` or ``full_shared``.
            output_index: ``(N,)`` flat positions ``b * T + t`` to score (e.g. ``loss_index``); ``None``: all.

        Returns:
            ``(B, T, V)``, or ``(N, V)`` at ``output_index``. Every supervised prediction lies in the consumer's part
            (``split < context_len``).
        """
        return self.lora_model.shared_sequence_forward(
            batch["input_ids"],
            self.shared_split(batch),
            producers,
            batch["role_ids"],
            scheme,
            output_index,
            self._per_sequence(batch, "lengths"),
        )

    def compute_loss(self, batch: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
        """``(1 - λ) · plain + λ · shared`` (terms with weight 0 are not computed); with ``lambda_mode: sample``
        one of the two per call, the shared one with probability λ (drawn from ``seed`` on the host: no device sync).

        Returns:
            ``loss`` and the terms that were computed (``plain``, ``shared``), all scalars.
        """
        lam = self.train_config.lambda_shared
        if self.train_config.lambda_mode == "sample" and 0 < lam < 1:
            # a stream apart from the producer draw's (same seed): the coin must not decide the producer
            coin = torch.rand((), generator=torch.Generator().manual_seed(seed * 2 + 1)).item()
            lam = 1.0 if coin < lam else 0.0
        out: dict[str, torch.Tensor] = {}
        producers = None
        if 0 < lam < 1 and batch.get("prefix_sources") and "role_ids" in (batch.get("host") or {}):
            prod = self.host_producers(batch, seed)
            producers = _host_to(prod, batch["role_ids"].device)
            plan = self.absorption_plan(batch, prod)
            if plan is not None:
                return self._weighted_loss_absorbed(batch, producers, plan, lam)
        loss = 0.0
        if lam < 1:
            logits = self.plain_logits(batch)  # (N, V)
            n = max(1, batch["loss_index"].numel())
            out["plain"] = F.cross_entropy(logits.float(), batch["loss_targets"], reduction="sum") / n
            loss = loss + (1 - lam) * out["plain"]
        if lam > 0:
            if producers is None:
                producers = self.draw_producers(batch["role_ids"], seed, batch)
            # one pass over the unsplit sequences, the LM head at the supervised positions only
            logits = self.shared_logits(batch, producers, self.train_config.shared_scheme, batch["loss_index"])
            n = max(1, batch["loss_index"].numel())
            out["shared"] = F.cross_entropy(logits.float(), batch["loss_targets"], reduction="sum") / n
            loss = loss + lam * out["shared"]
        out["loss"] = loss
        return out

    def absorption_plan(self, batch: dict[str, Any], producers: list[int]) -> dict[int, int] | None:
        """Which rows' plain terms the shared pass can score (``data.cross_role_batches``): ``{j: b}`` when row
        ``j``'s whole example starts row ``b``'s context within the shared split and ``j``'s role is ``b``'s producer.

        Then the shared pass's rows ``[0, k)`` of ``b`` are exactly row ``j``'s plain pass (causal attention, the
        same tokens and role), so ``j``'s plain predictions are read there and ``j`` leaves the plain pass. Each
        ``j`` goes to one ``b``. ``None`` when nothing is absorbed, or the batch lacks the host copies or has packed
        rows. Decided on the host from ``producers`` (:meth:`host_producers`): no device read.
        """
        sources = batch.get("prefix_sources")
        host = batch.get("host") or {}
        if not sources or not all(k in host for k in ("role_ids", "context_len", "lengths")):
            return None
        roles, ctx, lengths = host["role_ids"], host["context_len"], host["lengths"]
        if sum(n - c for n, c in zip(lengths, ctx, strict=True)) != batch["loss_index"].numel():
            return None  # packed segments: the rows' supervised positions are not one span each
        split = self.shared_split(batch).tolist()
        plan: dict[int, int] = {}
        for b, found in enumerate(sources):
            for j, k in found:
                if j not in plan and roles[j] == producers[b] and k <= split[b]:
                    plan[j] = b
                    break
        return plan or None

    def _weighted_loss_absorbed(
        self, batch: dict[str, Any], producers: torch.Tensor, plan: dict[int, int], lam: float
    ) -> dict[str, torch.Tensor]:
        """``(1 - λ)·plain + λ·shared`` with the plain terms of ``plan``'s rows scored in the shared pass (equal to
        :meth:`compute_loss`'s two passes up to the LoRA dropout masks, which those rows then share)."""
        host = batch["host"]
        ctx, lengths = host["context_len"], host["lengths"]
        ids, targets = batch["input_ids"], batch["loss_targets"]
        t = ids.shape[1]
        offsets = [0]
        for n_r, c_r in zip(lengths, ctx, strict=True):
            offsets.append(offsets[-1] + n_r - c_r)
        # a source is shorter than its consumer: the batch's longest row is always kept (so ``keep`` is never empty)
        # and the kept rows keep the batch's width
        keep = [r for r in range(len(lengths)) if r not in plan]
        plain_index = [i * t + p for i, r in enumerate(keep) for p in range(ctx[r] - 1, lengths[r] - 1)]
        plain_targets = [q for r in keep for q in range(offsets[r], offsets[r + 1])]
        moved_index = [b * t + p for j, b in plan.items() for p in range(ctx[j] - 1, lengths[j] - 1)]
        moved_targets = [q for j in plan for q in range(offsets[j], offsets[j + 1])]
        dev = ids.device
        n = max(1, targets.numel())
        rows = _host_to(keep, dev)
        logits = self(ids[rows], batch["role_ids"][rows], None, output_index=_host_to(plain_index, dev))
        plain_sum = F.cross_entropy(logits.float(), targets[_host_to(plain_targets, dev)], reduction="sum")
        index = torch.cat([batch["loss_index"], _host_to(moved_index, dev)])
        logits = self.shared_logits(batch, producers, self.train_config.shared_scheme, index)  # (N + M, V)
        n_shared = targets.numel()
        moved = F.cross_entropy(logits[n_shared:].float(), targets[_host_to(moved_targets, dev)], reduction="sum")
        out = {
            "plain": (plain_sum + moved) / n,
            "shared": F.cross_entropy(logits[:n_shared].float(), targets, reduction="sum") / n,
        }
        out["loss"] = (1 - lam) * out["plain"] + lam * out["shared"]
        out["absorbed_rows"] = torch.tensor(float(len(plan)))
        self.absorbed_rows_seen = getattr(self, "absorbed_rows_seen", 0) + len(plan)  # host count (bench train)
        return out

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.compute_loss(batch, seed=self.hparams.producer_seed * 1_000_003 + self.global_step)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", out["loss"], prog_bar=True, batch_size=bs)
        for name in ("plain", "shared"):
            if name in out:
                self.log(f"train/{name}_loss", out[name], batch_size=bs)
        if "absorbed_rows" in out:  # rows whose plain term the shared pass scored (data.cross_role_batches)
            # a host number: Lightning fills a device scalar with it (a host tensor would be copied, a possible sync)
            self.log("train/absorbed_rows", float(out["absorbed_rows"]), batch_size=bs)
        return out["loss"]

    # ---- validation -----------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        index, targets = batch["loss_index"], batch["loss_targets"]  # (N,)
        t = batch["input_ids"].shape[1]
        rows = index // t  # (N,) sequence of each supervised prediction
        role = batch["role_ids"][rows]
        logp = self.plain_logits(batch).float().log_softmax(-1)  # (N, V)
        nll = -logp.gather(-1, targets[:, None])[:, 0]
        zeros, ones = torch.zeros_like(nll), torch.ones_like(nll)
        correct = (logp.argmax(-1) == targets).to(nll.dtype)
        self.val_sums["plain"].update(torch.stack([nll, correct, zeros, ones], -1), role)
        if not self.train_config.val_schemes:
            return
        producers = self.draw_producers(
            batch["role_ids"], seed=self.hparams.producer_seed * 1_000_003 + batch_idx, batch=batch
        )
        for scheme in self.train_config.val_schemes:
            # examples are not packed in validation: every supervised prediction lies in the consumer's part
            logp_s = self.shared_logits(batch, producers, scheme, index).float().log_softmax(-1)  # (N, V)
            s_nll = -logp_s.gather(-1, targets[:, None])[:, 0]
            s_correct = (logp_s.argmax(-1) == targets).to(nll.dtype)
            kl = (logp.exp() * (logp - logp_s)).sum(-1)  # KL(plain || shared) per prediction
            self.val_sums[scheme].update(torch.stack([s_nll, s_correct, kl, ones], -1), role)

    def on_validation_epoch_end(self) -> None:
        for part, metric in self.val_sums.items():
            if not metric.update_called:
                continue
            sums = metric.compute()  # (n_roles, len(VAL_COLUMNS))
            n = sums[:, VAL_COLUMNS.index("n")]
            total = n.sum().clamp_min(1)
            tag = "val/loss" if part == "plain" else f"val/{part}/loss"
            self.log(tag, (sums[:, 0].sum() / total).float(), prog_bar=part == "plain")
            for rid, role in enumerate(self.roles):
                if n[rid] == 0:
                    continue
                for col, name in enumerate(VAL_COLUMNS[:3]):
                    if part == "plain" and name == "kl":
                        continue
                    tag = f"val/{role}/{name}" if part == "plain" else f"val/{role}/{part}/{name}"
                    self.log(tag, (sums[rid, col] / n[rid]).float())
            metric.reset()

    def configure_callbacks(self) -> list[Callback]:
        """Every fit gets :class:`~lit_modules.sigterm_check.HostSigtermAgreement` (it acts with several processes
        only): the ranks agree on SIGTERM on the host instead of draining each GPU at every batch."""
        from lit_modules.sigterm_check import HostSigtermAgreement

        return [HostSigtermAgreement()]

    # ---- optimisation ---------------------------------------------------------------------------------------------
    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups: ``shared_a`` (with shared A) and one per role, each with its lr."""
        groups = []
        for name, params in self.lora_model.lora_parameter_groups().items():
            lr = self.train_config.shared_a_lr if name == "shared_a" else self.train_config.role_lr[name]
            groups.append({"params": params, "lr": lr, "name": name, "weight_decay": self.train_config.weight_decay})
        return groups

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over :meth:`param_groups` under a linear-warmup + cosine schedule; torch's fused AdamW where
        :func:`fused_adamw_ok` allows it (the 135M model's optimizer step is bound by the host's work per tensor,
        14 ms for its 240 adapter tensors on an H100 host, and DDP on N GPUs pays it N times as often as one GPU
        accumulating N micro-batches), else torch's default step."""
        cfg = self.train_config
        groups = self.param_groups()
        fused = fused_adamw_ok([p for g in groups for p in g["params"]], self.trainer.precision_plugin)
        optimizer = torch.optim.AdamW(groups, betas=cfg.betas, eps=cfg.eps, fused=True if fused else None)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = math.ceil(cfg.warmup_ratio * total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, total, warmup, cfg.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Lightning's clipping, also for the fused AdamW under ``bf16-mixed``.

        Lightning's mixed-precision plugin refuses any clipping with an optimizer that unscales gradients itself
        (fused AdamW), which only matters with a gradient scaler (``16-mixed``). Without one the gradients are the
        true ones, and the plugin's base class clips them exactly as it would otherwise (norm over every adapter).
        """
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        from lightning.pytorch.utilities import GradClipAlgorithmType

        plugin = self.trainer.precision_plugin
        fused = any(g.get("fused") for g in getattr(optimizer, "param_groups", []))
        if fused and gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            algorithm = GradClipAlgorithmType((gradient_clip_algorithm or "norm").lower())
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def adapter_state_keys(self) -> set[str]:
        """State-dict keys of the adapter parameters."""
        ids = {id(p) for p in self.lora_model.lora_parameters()}
        return {k for k, p in self.named_parameters() if id(p) in ids}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keeps only the adapters (and metric states) of the state dict: the frozen base is reloaded."""
        keep = self.adapter_state_keys()
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items() if k in keep or not k.startswith("lora_model.")
        }
        checkpoint["lora_config"] = self.lora_config.to_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuses a checkpoint that lacks some adapter weights (loading is otherwise non-strict)."""
        if self.lora_model is None:
            self.configure_model()
        missing = sorted(self.adapter_state_keys() - set(checkpoint["state_dict"]))
        if missing:
            raise ValueError(f"checkpoint has no weights for {len(missing)} adapter tensors, e.g. {missing[0]}")
