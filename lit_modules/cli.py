"""Lightning CLI for training: ``fit`` / ``validate`` / ``test`` over YAML configs, and ``export``.

The ``lragent`` command (:mod:`lragent.cli_main`) dispatches ``fit``/``validate``/``test`` to
:func:`run_lightning_cli` and ``export`` to :func:`export`. Examples (from the repository root)::

    lragent fit --config configs/smoke.yaml
    lragent fit --config configs/hotpotqa.yaml --ckpt_path last      # resume the last checkpoint
    lragent fit --config configs/hotpotqa.yaml --print_config         # the full resolved config
    lragent export --ckpt runs/hotpotqa/checkpoints/last.ckpt --out adapters/hotpotqa
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningCLI

from datamodules.role_examples import RoleExampleDataModule
from lit_modules.multi_lora_module import MultiLoraModule
from lit_modules.progress import RunProgressBar
from lragent.command import first_line
from lragent.roles import DEFAULT_ROLES


def _roles_or_default(roles: Sequence[str] | None) -> list[str]:
    return list(DEFAULT_ROLES) if roles is None else list(roles)


def _tokenizer_of(model_name: str, tokenizer: str | None) -> str:
    return tokenizer if tokenizer is not None else model_name


class LRAgentCLI(LightningCLI):
    """``LightningCLI`` over :class:`MultiLoraModule` and :class:`RoleExampleDataModule`.

    Linked values (set on the model side only): ``model.roles`` -> ``data.roles`` (role ids must mean the same on
    both sides) and ``model.tokenizer_name`` (else ``model.model_name``) -> ``data.tokenizer``. A config that names
    no progress bar gets :class:`~lit_modules.progress.RunProgressBar` (its training total is what the run will
    take) instead of Lightning's default one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", MultiLoraModule)
        kwargs.setdefault("datamodule_class", RoleExampleDataModule)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)  # the module builds its per-role AdamW groups
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.link_arguments("model.roles", "data.roles", compute_fn=_roles_or_default)
        parser.link_arguments(("model.model_name", "model.tokenizer_name"), "data.tokenizer", compute_fn=_tokenizer_of)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        # LightningCLI's hook that puts the config's and the extra callbacks together (lightning is pinned).
        named = config.get("callbacks") or []
        configured = [*(named if isinstance(named, list) else [named]), *callbacks]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in configured):
            callbacks = [*callbacks, RunProgressBar()]
        return super()._instantiate_trainer(config, callbacks)


def run_lightning_cli(args: list[str]) -> None:
    """Runs ``fit``/``validate``/``test`` (``args`` = the command line after the program name).

    A bad value (unknown role, rank <= 0, lr <= 0, missing data path, a target module the model lacks ...) stops
    with a one-line ``error: ...`` on stderr and exit status 2.
    """
    try:
        # Called as `python cli.py fit ...` the arguments are sys.argv's; passing them again makes Lightning warn.
        LRAgentCLI(args=None if list(args) == sys.argv[1:] else list(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def export(ckpt: str, out: str, dtype: str | None = None, device: str = "cpu") -> int:
    """Writes one PEFT LoRA directory per role, the native checkpoint and the training config from a checkpoint.

    Args:
        ckpt: Lightning checkpoint written by fit (e.g. runs/hotpotqa/checkpoints/last.ckpt).
        out: output directory.
        dtype: dtype of the stored adapter tensors: float32, bfloat16 (half the size) or float16 (default: float32).
        device: where the base model is built to hold the adapters: ``cpu`` or ``cuda`` (``cuda:N``). An 8B base
            with random weights takes minutes to build on the CPU and seconds on a GPU; the files are the same.

    Returns:
        0 on success.
    """
    import torch

    from lit_modules.export import checkpoint_source, export_adapters

    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {dtype!r} not supported: allowed float32, bfloat16, float16")
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"--device {device!r} not supported: allowed cpu, cuda, cuda:N")
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here")
    ckpt_path = Path(ckpt)
    if not ckpt_path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt_path}")
    try:
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or "state_dict" not in state or "hyper_parameters" not in state:
            raise ValueError("no state_dict and hyper_parameters")
    except Exception as exc:  # unpickling errors come in many types; any of them means "not a checkpoint"
        what = first_line(exc)[:200]
        raise ValueError(f"{ckpt_path} is not a Lightning checkpoint written by fit ({what})") from None
    with torch.device(device):  # configure_model builds the base on the default device
        module = MultiLoraModule.load_from_checkpoint(ckpt_path, map_location=device)
    source = checkpoint_source(state, ckpt_path)
    paths = export_adapters(module, out, state.get("datamodule_hyper_parameters"), dtype, source)
    print(f"exported {', '.join(paths)} to {out}")
    return 0
