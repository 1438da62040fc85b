"""The multi-LoRA model every speed benchmark and profile times: the base with random adapters of every role.

Time does not depend on the adapters' values, but a B of zeros would let a path skip its LoRA work unseen, so B is
drawn non-zero (std 0.02); alpha is twice the rank, no dropout, eval mode, seed 0 (the same adapters in every run).
"""

from __future__ import annotations

from transformers import PreTrainedModel

from lragent.lora_model import MultiLoraModel
from lragent.multi_lora import MultiLoraConfig


def weights_label(model: str) -> str:
    """How a benchmark report names ``model``'s base weights: "random weights" for a named architecture (the real
    shapes, drawn values), "real weights" for a model loaded from its own weights (the embedded or accuracy model)."""
    from lragent.models import NAMED_ARCHITECTURES

    return "random weights" if model.lower() in NAMED_ARCHITECTURES else "real weights"


def random_adapter_model(hf: PreTrainedModel, rank: int) -> MultiLoraModel:
    """``hf`` wrapped with rank-``rank`` random adapters (q_proj, v_proj; B != 0), in eval mode.

    Args:
        hf: the base model (any dtype and device; the adapters follow it).
        rank: LoRA rank.
    """
    lm = MultiLoraModel(hf, MultiLoraConfig(rank=rank, alpha=2 * rank, dropout=0.0)).eval()
    lm.init_adapters("random", seed=0, b_std=0.02)
    return lm
