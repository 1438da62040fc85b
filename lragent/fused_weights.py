"""Inference-time weight fusion: one matrix for each layer's q/k/v projections and one for gate/up.

A decode step at batch 1 is a chain of matrix-vector products; three small ones (q, k, v) and two large ones
(gate, up) that read the same input are each one launch and one pass over the input when their weights are one
matrix. :func:`fuse_base_weights` concatenates them and rebinds every projection's weight as a row slice (a view)
of the concatenated matrix, so no memory is added and the modules still work on their own (training, PEFT
export). Rebinding is undone by nothing: the values are the same tensors' values.

With ``lora=True`` the shared ``A`` (``r × d_in``) of every adapted projection of the group is appended below the
base rows, so the same GEMM also gives the low-rank input ``X·A`` of each adapter (for ``v_proj`` that is the V_lr
the decomposed caches store). The ``A`` rows are a *copy* kept up to date from the adapter parameters (their
version counters and addresses, :meth:`FusedGroup.refresh`), not views: the adapters stay their own parameters, so
optimisers that hold them, checkpoints and PEFT export are unaffected. They cost ``r × d_in`` elements per adapter
(8 × 4096 in bf16, 64 KiB, for LLaMA-3.1-8B). Only a shared ``A`` is appended: with one ``A`` per role, X·A
depends on the row's role and the decoder computes it from the adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lragent.multi_lora import MultiLoraLinear


@dataclass
class FusedGroup:
    """Projections of one input fused into one matrix.

    Attributes:
        weight: ``(Σ d_out + Σ r, d_in)``: every module's base rows in order, then the appended ``A`` rows.
        bias: ``(Σ d_out + Σ r,)`` (zeros on the ``A`` rows) or ``None``.
        sizes: output size of every slice of ``weight``: one per module, then ``r`` per appended ``A``.
        lora: indices (into the fused modules) whose shared ``A`` rows follow the base rows, in that order.
        modules: the fused modules.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]
    lora: tuple[int, ...] = ()
    modules: list[nn.Module] = field(default_factory=list, repr=False)
    _a_keys: list = field(default_factory=list, repr=False)

    def __getitem__(self, i: int):
        """``(weight, bias, sizes)`` by index, as the tuple this group replaced."""
        return (self.weight, self.bias, self.sizes)[i]

    @property
    def n_base(self) -> int:
        """Number of base slices (the fused modules)."""
        return len(self.modules)

    def a_offset(self, j: int) -> int:
        """First row of the ``j``-th appended ``A`` in :attr:`weight`."""
        return sum(self.sizes[: self.n_base + j])

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies every appended ``A`` whose parameter changed (in place, or rebound) into its rows.

        Host work only while nothing changed; never call it while a CUDA graph is being captured (the copy would be
        captured too).
        """
        for j, i in enumerate(self.lora):
            a = self.modules[i].lora_A[0]
            key = (a.data_ptr(), a._version, a.device, a.dtype)
            if self._a_keys[j] != key:
                off = self.a_offset(j)
                self.weight[off : off + a.shape[0]].copy_(a.detach())
                self._a_keys[j] = key


def _linear(module: nn.Module) -> nn.Linear:
    return module.base if isinstance(module, MultiLoraLinear) else module


def _fuse(modules: list[nn.Module], lora: bool) -> FusedGroup | None:
    lins = [_linear(m) for m in modules]
    if not all(isinstance(lin, nn.Linear) for lin in lins):
        return None
    has_bias = [lin.bias is not None for lin in lins]
    if any(has_bias) and not all(has_bias):
        return None  # mixed biases: leave the layer alone
    ref = lins[0].weight
    adapted = [i for i, m in enumerate(modules) if lora and isinstance(m, MultiLoraLinear) and m.shared_a]
    a_rows = [modules[i].lora_A[0].detach().to(ref.dtype) for i in adapted]
    weight = torch.cat([lin.weight.data for lin in lins] + a_rows, 0)
    bias = None
    if all(has_bias):
        zeros = [torch.zeros(a.shape[0], dtype=lins[0].bias.dtype, device=ref.device) for a in a_rows]
        bias = torch.cat([lin.bias.data for lin in lins] + zeros, 0)
    sizes = []
    offset = 0
    for lin in lins:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[offset : offset + n], requires_grad=False)
        sizes.append(n)
        offset += n
    sizes += [a.shape[0] for a in a_rows]
    group = FusedGroup(weight, bias, sizes, tuple(adapted), list(modules), [None] * len(adapted))
    group.refresh()  # records the adapters' versions (the rows already hold their values)
    return group


def fused_weights(owner: nn.Module, name: str, modules: list[nn.Module], lora: bool = False) -> FusedGroup | None:
    """The :class:`FusedGroup` of ``modules`` kept on ``owner`` under ``name``, (re)built when missing or stale (a
    module's weight is no longer a view of it, e.g. after ``.to()``, or ``lora`` asks for other ``A`` rows);
    ``None`` when they cannot be fused."""
    fused = owner.__dict__.get(name)
    if fused is not None:
        weight = fused.weight
        first = _linear(modules[0]).weight
        want = tuple(i for i, m in enumerate(modules) if lora and isinstance(m, MultiLoraLinear) and m.shared_a)
        same = first.data_ptr() == weight.data_ptr() and first.device == weight.device and first.dtype == weight.dtype
        if same and fused.lora == want:
            fused.refresh()
            return fused
    fused = _fuse(modules, lora)
    owner.__dict__[name] = fused
    return fused


@torch.no_grad()
def fuse_base_weights(model: nn.Module, lora: bool = False) -> int:
    """Fuses q/k/v and gate/up of every decoder layer of a LLaMA-style ``*ForCausalLM``; returns the layers fused.

    Args:
        model: the ``*ForCausalLM`` (possibly with :class:`MultiLoraLinear` injected).
        lora: also append each adapted projection's shared ``A`` to its group (one GEMM gives X·W0 and X·A).
    """
    n = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        a = fused_weights(attn, "_lragent_qkv", [attn.q_proj, attn.k_proj, attn.v_proj], lora)
        m = fused_weights(mlp, "_lragent_gu", [mlp.gate_proj, mlp.up_proj], lora)
        n += a is not None and m is not None
    return n


@torch.no_grad()
def refresh_fused_lora(model: nn.Module) -> None:
    """Brings every fused group's ``A`` rows up to date with the adapters (before CUDA-graph replays)."""
    for layer in model.model.layers:
        for owner, name in ((layer.self_attn, "_lragent_qkv"), (layer.mlp, "_lragent_gu")):
            group = owner.__dict__.get(name)
            if group is not None and group.lora:
                group.refresh()
