"""FSDP for LoRA training: the frozen base weights sharded over the GPUs, the small adapters trained as usual.

:class:`LoraFSDPStrategy` is Lightning's ``FSDPStrategy`` (FSDP1, ``use_orig_params``) with what a frozen base plus
LoRA adapters needs:

- **Wrap units = frozen leaf modules.** :class:`~lragent.decoder.DecoderEngine` calls the leaf modules (each
  ``nn.Linear`` base, the norms, the embedding, the LM head) itself and never a decoder layer's ``forward``, so a
  decoder layer cannot be an FSDP unit (its parameters would never be gathered). Every module that owns frozen
  parameters is its own unit, sharded with the configured ``sharding_strategy`` (``FULL_SHARD``): its weights are
  gathered around its call and it holds no gradient.
- **The adapters are replicated.** They stay in the root unit, which is ``NO_SHARD``: a few MB even at 8B, their
  gradients all-reduced (averaged) like DDP's, their optimizer state a plain one-device state on every rank.
- **Tied weights stay in the root.** A weight that two modules share (SmolLM2's input embedding = LM head) cannot
  be split over two units; both modules stay in the (replicated) root, whose flat parameter must then have one
  dtype: a tied ``bfloat16`` base next to float32 adapters is refused with a clear error. Use DDP for such small
  models (``configs/ddp.yaml``); FSDP is for models that do not fit one GPU (``configs/fsdp_8b.yaml``, the untied
  LLaMA-3.1-8B shapes).
- **Norm clipping.** The recipes clip the gradient norm at 1.0, which Lightning refuses under FSDP (a shard's norm is
  not the global one); the only gradients here are the replicated adapters', so :class:`LoraFSDPPrecision` clips
  them as one device would.
- **No FSDP casting by default.** Lightning's FSDP mixed precision for ``bf16-mixed`` would cast every buffer (the
  RoPE frequencies) and reduce the gradients in bfloat16. Here ``mixed_precision`` defaults to no parameter or
  buffer cast and float32 gradient reduction; the precision plugin's autocast does the bfloat16 compute, as under
  DDP, so DDP and FSDP train the same numbers.
- **Checkpoints in the one-device layout.** ``state_dict_type: full`` would gather the whole 16 GB base to rank 0 at
  every checkpoint only for :meth:`~lit_modules.multi_lora_module.MultiLoraModule.on_save_checkpoint` to drop it.
  Here the state dict is the (replicated) adapters and the optimizer state the optimizer's own: the checkpoint file
  is the one a single device writes, so ``--ckpt_path last`` resumes under any strategy and ``export`` reads it.

Use: ``trainer.strategy: {class_path: lit_modules.strategies.LoraFSDPStrategy}`` (``configs/fsdp_8b.yaml``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

FSDP_PREFIXES: tuple[str, ...] = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter name without FSDP's wrapper components (the name it has in the unwrapped module)."""
    for prefix in FSDP_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_parameter_ids(model: nn.Module) -> set[int]:
    """``id`` of every parameter that more than one module owns directly (tied weights)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, n in owners.items() if n > 1}


class FrozenLeafPolicy:
    """FSDP auto-wrap policy (``lambda_fn`` of ``CustomPolicy``): wrap every module that owns parameters directly, all
    of them frozen and none of them tied to another module.

    Args:
        tied: ``id`` of the tied parameters (:func:`tied_parameter_ids`); their modules stay in the root unit.
    """

    def __init__(self, tied: set[int], unit_kwargs: dict[str, Any] | None = None) -> None:
        self.tied = tied
        self.unit_kwargs = unit_kwargs or {}

    def __call__(self, module: nn.Module) -> bool | dict[str, Any]:
        own = list(module.parameters(recurse=False))
        wrap = bool(own) and not any(p.requires_grad or id(p) in self.tied for p in own)
        return (dict(self.unit_kwargs) or True) if wrap else False


def _no_cast_mixed_precision() -> Any:
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=None, reduce_dtype=torch.float32, buffer_dtype=None)


class LoraFSDPPrecision(FSDPPrecision):
    """Lightning's ``FSDPPrecision`` with ``gradient_clip_algorithm: norm`` (the recipes clip at 1.0).

    Lightning refuses norm clipping under FSDP because a sharded gradient's local norm is not the global one. Under
    :class:`LoraFSDPStrategy` the only gradients are the adapters', replicated and already averaged over the ranks:
    torch's ``clip_grad_norm_`` over them is the global norm, the same clipping as under DDP or on one device.
    """

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        Precision.clip_grad_by_norm(self, optimizer, clip_val)


class LoraFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` for a frozen base with LoRA adapters (module docstring).

    Args:
        mixed_precision: FSDP's casts; ``None``: none of the parameters or buffers, gradients reduced in float32
            (the precision plugin's autocast still computes in bfloat16 under ``bf16-mixed``).
        **kwargs: ``FSDPStrategy``'s (``sharding_strategy`` of the frozen units, ``cpu_offload``, ``timeout`` ...).
            ``auto_wrap_policy`` is set here and may not be given; ``state_dict_type`` must stay ``full`` (the
            checkpoint is a plain file of the adapters).
    """

    def __init__(self, mixed_precision: Any = None, **kwargs: Any) -> None:
        if kwargs.pop("auto_wrap_policy", None) is not None:
            raise ValueError("LoraFSDPStrategy sets the auto_wrap_policy itself (each frozen leaf module); drop it")
        if kwargs.get("state_dict_type", "full") != "full":
            raise ValueError(
                f"LoraFSDPStrategy writes adapter-only checkpoints: state_dict_type must be full, got "
                f"{kwargs['state_dict_type']!r}"
            )
        super().__init__(mixed_precision=mixed_precision or _no_cast_mixed_precision(), **kwargs)

    @property
    def precision_plugin(self) -> FSDPPrecision:
        """The precision plugin (a :class:`LoraFSDPPrecision`)."""
        return FSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if type(plugin) is FSDPPrecision:  # the one Lightning's connector makes: norm clipping allowed
            plugin = LoraFSDPPrecision(plugin.precision, plugin.scaler)
        FSDPStrategy.precision_plugin.fset(self, plugin)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``configure_model`` builds the base on this rank's device (an 8B random base: seconds on a GPU, minutes on
        the CPU); every rank builds the same seeded weights, and wrapping then keeps each rank's shards only."""
        with torch.device(self.root_device), self.precision_plugin.tensor_init_context():
            yield

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from lightning.pytorch.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import CustomPolicy

        tied = tied_parameter_ids(model)
        root = [p for p in model.parameters() if p.requires_grad or id(p) in tied]
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in root})
        if len(dtypes) > 1:
            raise ValueError(
                f"FSDP: the tied embedding weights ({', '.join(dtypes)}) and the adapters must share one dtype in the "
                "root unit: train this model with DDP (configs/ddp.yaml) or with model.model_dtype float32"
            )
        # Lightning's _setup_model with: the frozen leaves sharded (the configured sharding strategy), the root unit
        # (the adapters) replicated, so its gradients are all-reduced and its optimizer state is a plain
        # one-device state on every rank; and an explicit CPU device (gloo, CPU tests): FSDP refuses a CPU module
        # without one.
        device = self.root_device
        policy = FrozenLeafPolicy(tied, {"sharding_strategy": self.sharding_strategy})
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=ShardingStrategy.NO_SHARD,
            device_id=device if device.type == "cpu" else device.index,
            auto_wrap_policy=CustomPolicy(policy),
            **self.kwargs,
        )
        _move_torchmetrics_to_device(wrapped, device)
        _setup_activation_checkpointing(wrapped, self._activation_checkpointing_kwargs)
        return wrapped

    # ---- adapter-only checkpoints in the one-device layout ----------------------------------------------------------
    def _adapter_params(self) -> dict[str, nn.Parameter]:
        module = self.lightning_module
        keys = module.adapter_state_keys()
        return {k: p for k, p in ((clean_name(n), p) for n, p in module.named_parameters()) if k in keys}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The adapter tensors (replicated: no collective), named as in the unwrapped module."""
        return {k: p.detach().to("cpu", copy=True) for k, p in self._adapter_params().items()}

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer state is a plain one (the adapters are replicated): Lightning restores it."""
        return True

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's own state dict (the same on every rank, the layout of a one-device run)."""
        from lightning.pytorch.core.optimizer import LightningOptimizer

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Loads the plain optimizer states (FSDPStrategy's own method does nothing)."""
        from lightning.fabric.utilities.optimizer import _optimizer_to_device

        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(state)
            _optimizer_to_device(optimizer, self.root_device)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Reads a checkpoint written by this strategy, DDP or one device (the same layout)."""
        path = Path(self.broadcast(checkpoint_path))
        return torch.load(path, map_location="cpu", weights_only=False if weights_only is None else weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copies the checkpoint's adapters into the (replicated) root unit."""
        stored = checkpoint["state_dict"]
        params = self._adapter_params()
        missing = sorted(set(params) - set(stored))
        if missing:
            raise ValueError(f"checkpoint has no weights for {len(missing)} adapter tensors, e.g. {missing[0]}")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(stored[k])
