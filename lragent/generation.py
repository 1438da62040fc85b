"""Token selection and stop handling for the session's generation loop."""

from __future__ import annotations

import torch


def select_token(
    logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """Greedy (temperature 0) or sampled next token.

    Args:
        logits: ``(vocab,)`` next-token logits.
        temperature: 0 for greedy; > 0 samples from ``softmax(logits / temperature)``.
        top_p: nucleus sampling mass in (0, 1].
        generator: CPU RNG for reproducible sampling.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or ``None``."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
