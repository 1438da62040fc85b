"""Model FLOPs: the architecture a count needs (:class:`ModelShape`), the cards' dense bf16 peaks, and the FLOPs of
an agent step's prefill and decode, counted as `bench train` counts a forward.

Per token and decoder layer, with ``P`` = Σ over the 7 frozen projections of ``d_in·d_out``, ``R`` = Σ over the LoRA
targets of ``r·(d_in + d_out)`` and ``W = H_q·D`` the query width (:class:`ModelShape`):

- a full-depth forward (:class:`~lragent.sharing.Forward`, and every decode step): ``2·P + 2·R`` per token, plus
  ``4·W`` per causal query-key pair (QKᵀ and PV; a token at position ``p`` attends to ``p + 1`` positions);
- ``base_shared``'s LR prefill (:class:`~lragent.sharing.LRPrefill`): the same less the K and V_base projections it
  reuses (``2·d·(H_kv·D)`` each); the last layer's work after its V_lr, which it skips, is counted (an over-count
  below 1/n_layers of the op);
- DroidSpeak's recompute (:class:`~lragent.sharing.Recompute`): a full forward of the recomputed layers only;
- the LM head, ``2·d·V``, once per position whose logits are computed: the last prefilled position and each decode
  step.

Decode runs one forward per generated token but the last (that token enters the cache through the next step's plan,
which this count then includes as a prefilled position). Embeddings, norms, RoPE and sampling are not counted. A
scheme's FLOPs depend on what it recomputes: ``non_shared`` prefills every token its role has not seen, the shared
schemes only the new ones, so the same trace costs the schemes different FLOPs and MFU compares how well each uses
the card on the work it does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Dense bf16 peak (no sparsity) by device-name fragment, most specific first; from NVIDIA's data sheets.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of an architecture.

    Attributes:
        n_layers: decoder layers.
        hidden: model width d.
        n_heads: query heads H_q.
        n_kv_heads: key/value heads H_kv.
        head_dim: head width D.
        intermediate: MLP width.
        vocab: vocabulary size V (LM head rows).
        rank: LoRA rank r.
        targets: projections with a LoRA adapter.
    """

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rank: int
    targets: tuple[str, ...]

    @classmethod
    def from_config(cls, config: Any, rank: int, targets: tuple[str, ...] | list[str]) -> ModelShape:
        """From a transformers config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            n_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            rank=rank,
            targets=tuple(targets),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(d_in, d_out)`` of each projection of a decoder layer."""
        d, q, kv, ff = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, ff),
            "up_proj": (d, ff),
            "down_proj": (ff, d),
        }


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named ``device_name``; ``None`` when unknown (or a CPU)."""
    for fragment, value in PEAK_BF16_FLOPS:
        if fragment in device_name:
            return value
    return None


def _pairs(start: int, end: int) -> int:
    """Causal query-key pairs of positions ``[start, end)`` over a cache holding ``[0, end)``: Σ (p + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def _layer_parts(shape: ModelShape) -> tuple[int, int, int, int]:
    """``(P, R, W, P_kv)``: frozen and LoRA multiply-adds per token per layer, query width, and K + V_base's share."""
    lin = shape.linear_shapes()
    p = sum(i * o for i, o in lin.values())
    r = sum(shape.rank * (lin[t][0] + lin[t][1]) for t in shape.targets)
    kv = lin["k_proj"][0] * lin["k_proj"][1] + lin["v_proj"][0] * lin["v_proj"][1]
    return p, r, shape.n_heads * shape.head_dim, kv


def span_flops(shape: ModelShape, start: int, end: int, layers: int | None = None, skip_kv: bool = False) -> float:
    """FLOPs of ``layers`` decoder layers (default all) over positions ``[start, end)``, LM head not included.

    Args:
        shape: architecture and adapters.
        start: first position processed.
        end: one past the last position; the cache holds ``[0, end)`` when they attend.
        layers: how many layers run (DroidSpeak's recompute groups); ``None``: all of them.
        skip_kv: the K and V_base projections are reused, not computed (``base_shared``'s LR prefill).

    Returns:
        FLOPs.
    """
    if end < start or start < 0:
        raise ValueError(f"positions [{start}, {end}): need 0 <= start <= end")
    p, r, width, kv = _layer_parts(shape)
    n = end - start
    per_layer = 2 * (p - (kv if skip_kv else 0)) * n + 2 * r * n + 4 * width * _pairs(start, end)
    return float((shape.n_layers if layers is None else layers) * per_layer)


def head_flops(shape: ModelShape, positions: int = 1) -> float:
    """FLOPs of the LM head over ``positions`` positions."""
    return float(2 * shape.hidden * shape.vocab * positions)


def prefill_flops(shape: ModelShape, ops: Iterable, recompute_layers: int = 0) -> float:
    """FLOPs of one step's prefill: its plan's ops (``Forward`` / ``LRPrefill`` / ``Recompute``) and the LM head at
    the last position.

    Args:
        shape: architecture and adapters.
        ops: the scheme's plan for the step (:meth:`lragent.sharing.SharingScheme.plan`).
        recompute_layers: layers a ``Recompute`` op runs (DroidSpeak's groups).
    """
    from lragent.sharing import Forward, LRPrefill, Recompute

    total = 0.0
    for op in ops:
        if isinstance(op, Forward):
            total += span_flops(shape, op.start, op.end)
        elif isinstance(op, LRPrefill):
            total += span_flops(shape, op.start, op.end, skip_kv=True)
        elif isinstance(op, Recompute):
            total += span_flops(shape, op.start, op.end, layers=recompute_layers)
        else:
            raise TypeError(f"unknown plan op {op!r}: allowed Forward, LRPrefill, Recompute")
    return total + head_flops(shape, 1)


def decode_flops(shape: ModelShape, length_after_prefill: int, generated: int) -> float:
    """FLOPs of decoding ``generated`` tokens after a prefill that left ``length_after_prefill`` positions: one
    full forward (and LM head) per generated token but the last, the ``i``-th at position ``length + i``."""
    steps = max(0, generated - 1)
    start = length_after_prefill
    return span_flops(shape, start, start + steps) + head_flops(shape, steps)


def recompute_layer_count(groups: Sequence[tuple[int, int]]) -> int:
    """Layers in DroidSpeak's recompute groups ``[(first, one past last), ...]``."""
    return sum(b - a for a, b in groups)
