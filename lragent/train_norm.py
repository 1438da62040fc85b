"""transformers' RMSNorm in one fused kernel for training on a GPU.

A small model's training step is host-bound: one micro-batch of the embedded 135M model dispatches about 5,000
non-view ops forward and backward (a CPU census of one batch), and the GPU waits for the host (docs/several-gpus.md).
transformers' RMSNorm (LLaMA, Qwen2, Mistral) is six to eight kernels forward (eight with the casts of a bfloat16
input) and about a dozen backward, twice a layer and once at the end; PyTorch's ``F.rms_norm`` is one fused kernel
each way on CUDA (``aten::_fused_rms_norm``, PyTorch 2.8 and later). Same formula: ``x · rsqrt(mean(x²) + eps)`` in
float32, cast back to the input's dtype, times the weight. The sum of squares may be reduced in another order, so the
result can differ from transformers' by float rounding (tests: within bfloat16/float32 rounding of it).

Used where autograd records (training) on CUDA; inference keeps its own kernels (:mod:`kernels.fused_ops`) or
transformers' module, and the CPU keeps transformers' module (the references the tests pin). ``LRAGENT_FUSED_RMS_NORM
=0`` keeps transformers' module everywhere (to time the two side by side).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def fused_rms_norm_wanted(h: torch.Tensor) -> bool:
    """Whether :func:`rms_norm_like` takes the fused kernel for ``h``: autograd on, a CUDA tensor, not switched off."""
    return h.is_cuda and torch.is_grad_enabled() and os.environ.get("LRAGENT_FUSED_RMS_NORM", "1") != "0"


def rms_norm_like(norm: nn.Module, h: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """``norm(h)`` for a transformers RMSNorm ``norm`` (``weight``, ``variance_epsilon``), with PyTorch's fused
    kernel where :func:`fused_rms_norm_wanted` (or ``fused``) says so.

    Args:
        norm: the model's RMSNorm module; any other module is simply called.
        h: ``(..., hidden)``.
        fused: force the fused formula (True) or the module (False); ``None``: :func:`fused_rms_norm_wanted`.

    Returns:
        ``(..., hidden)`` in the dtype transformers' module returns (the promotion of the weight's and ``h``'s).
    """
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None)
    if fused is None:
        fused = fused_rms_norm_wanted(h)
    if not fused or weight is None or eps is None or weight.shape != h.shape[-1:]:
        return norm(h)
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        # the weight inside the kernel: one launch (transformers: weight · (x · rstd), all float32)
        return F.rms_norm(h, h.shape[-1:], weight, eps)
    return weight * F.rms_norm(h.float(), h.shape[-1:], None, eps).to(h.dtype)
