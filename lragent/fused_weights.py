"""Inference-time weight fusion: one matrix for each layer's q/k/v base projections and one for gate/up.

A decode step at batch 1 is a chain of matrix-vector products; three small ones (q, k, v) and two large ones
(gate, up) that read the same input are each one launch and one pass over the input when their weights are one
matrix. :func:`fuse_base_weights` concatenates them and rebinds every projection's weight as a row slice (a view)
of the concatenated matrix, so no memory is added and the modules still work on their own (training, PEFT
export). LoRA adapters are untouched: the decoder adds each projection's low-rank term to its slice of the fused
output. Rebinding is undone by nothing: the values are the same tensors' values.
"""

from __future__ import annotations

import torch
from torch import nn

from lragent.multi_lora import MultiLoraLinear


def _linear(module: nn.Module) -> nn.Linear:
    return module.base if isinstance(module, MultiLoraLinear) else module


def _fuse(modules: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    lins = [_linear(m) for m in modules]
    if not all(isinstance(lin, nn.Linear) for lin in lins):
        return None
    has_bias = [lin.bias is not None for lin in lins]
    if any(has_bias) and not all(has_bias):
        return None  # mixed biases: leave the layer alone
    weight = torch.cat([lin.weight.data for lin in lins], 0)
    bias = torch.cat([lin.bias.data for lin in lins], 0) if all(has_bias) else None
    sizes = []
    offset = 0
    for lin in lins:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        sizes.append(n)
        offset += n
    return weight, bias, sizes


def fused_weights(owner: nn.Module, name: str, modules: list[nn.Module]):
    """The fused ``(weight, bias, sizes)`` of ``modules`` kept on ``owner`` under ``name``, (re)built when missing or
    stale (a module's weight is no longer a view of it, e.g. after ``.to()``); ``None`` when they cannot be fused."""
    fused = owner.__dict__.get(name)
    if fused is not None:
        weight = fused[0]
        first = _linear(modules[0]).weight
        if first.data_ptr() == weight.data_ptr() and first.device == weight.device and first.dtype == weight.dtype:
            return fused
    fused = _fuse(modules)
    owner.__dict__[name] = fused
    return fused


@torch.no_grad()
def fuse_base_weights(model: nn.Module) -> int:
    """Fuses q/k/v and gate/up of every decoder layer of a LLaMA-style ``*ForCausalLM``; returns the layers fused."""
    n = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        a = fused_weights(attn, "_lragent_qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
        m = fused_weights(mlp, "_lragent_gu", [mlp.gate_proj, mlp.up_proj])
        n += a is not None and m is not None
    return n
