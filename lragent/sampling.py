"""Next-token selection on the device, per row, reproducible and independent of the batch it runs in.

Greedy rows take the arg-max. Sampling rows draw from ``softmax(logits / temperature)`` restricted to the nucleus
(the smallest set of most likely tokens whose mass reaches ``top_p``) by the Gumbel-max trick: the token with the
largest ``logits / T + g`` among the nucleus, where ``g = -log(-log u)`` and ``u`` is a counter-based hash of
(row seed, token index within the request, vocabulary index). The noise therefore depends only on those three
integers: the same request with the same seed gives the same tokens whatever else is in the batch, on CPU and GPU,
and no host RNG or synchronisation is involved (so a CUDA graph can capture it).
"""

from __future__ import annotations

import torch

# The sampler's version, recorded in every episode's protocol and every eval's run_config: a row or a resumed run
# never mixes versions. 1: until 2026-11-26, when u could round to exactly 1.0 (an infinite Gumbel noise: a nucleus
# token with that u was always drawn, in about nucleus size / 2**24 of draws; 0.9% at top-p 1 on a 151,936-token
# vocabulary); 2: u kept below 1.
SAMPLER_VERSION = 2


def recorded_sampler(fields: dict) -> int:
    """The sampler version a protocol or run config names; one without the field predates versions: sampler 1."""
    return fields.get("sampler", 1)


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic; wrap-around multiplication is the same bits)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u`` in (0, 1), shape ``(B, vocab)``, a pure function of ``(seed[b], counter[b], v)``.

    Args:
        seed: ``(B,)`` int64 seeds.
        counter: ``(B,)`` int64 token index within each row's request.
        vocab: vocabulary size V.
    """
    v = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    key = _splitmix64(_splitmix64(seed.long()) ^ counter.long())  # (B,)
    bits = _splitmix64(key[:, None] + v[None, :] * _GOLDEN)  # (B, V)
    u = (_shr(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # 2**24 - 0.5 rounds to 2**24 in float32, so the top value would be u = 1 and an infinite Gumbel noise (that
    # token always drawn): clamp it to the largest float32 below 1
    return u.clamp_max(1.0 - 2.0**-24)


ARGMAX_CHUNKS = 64
"""The chunks :func:`first_argmax` splits a row into: one reduction over the chunks in parallel, then one over their
maxima. On an H200 ``torch.argmax`` of one 128,256-token row took 29 µs of a 4.6 ms 8B decode step (one thread
block reduces the whole row); the two reductions 11 + 4 µs (``results/engine_h200/gemv_launches_2026-11-29``)."""


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a ``(B, V)`` tensor, the first index of each row's largest value (a NaN counts as the
    largest, as in ``argmax``), in two reductions: each of :data:`ARGMAX_CHUNKS` chunks of the row (the largest power
    of two up to it that divides V) gives its largest value and that value's first index, then the first chunk holding
    the row's largest value gives the answer. Fewer than 8 chunks: ``argmax`` itself.

    Args:
        x: ``(B, V)``.

    Returns:
        ``(B,)`` int64.
    """
    b, v = x.shape
    chunks = ARGMAX_CHUNKS
    while chunks > 1 and v % chunks:
        chunks //= 2
    if chunks < 8:
        return x.argmax(-1)
    width = v // chunks
    values, within = x.reshape(b, chunks, width).max(-1)
    best = values.argmax(-1, keepdim=True)  # (B, 1): the first chunk holding the row's largest value
    return (best * width + within.gather(1, best))[:, 0]


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    sampling: bool = True,
) -> torch.Tensor:
    """Next token per row.

    Args:
        logits: ``(B, V)`` next-token logits.
        temperature: ``(B,)``; 0 means greedy for that row.
        top_p: ``(B,)`` nucleus mass in (0, 1].
        seed: ``(B,)`` int64 per-row seed.
        counter: ``(B,)`` int64 index of the token within the row's request.
        sampling: False when every row is greedy (skips the sort; the result is the same).

    Returns:
        ``(B,)`` int64 token ids.
    """
    greedy = first_argmax(logits)
    if not sampling:
        return greedy
    logits = logits.float()
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # keep the most likely tokens whose preceding mass is below top_p (the first token is always kept)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    gumbel = -torch.log(-torch.log(uniform_noise(seed, counter, logits.shape[-1])))
    drawn = first_argmax(torch.where(keep, scaled + gumbel, torch.full_like(scaled, float("-inf"))))
    return torch.where(temperature > 0, drawn, greedy)


def check_sampling(temperature: float, top_p: float) -> None:
    """Raises ``ValueError`` unless ``temperature`` is finite and >= 0 and ``top_p`` is in (0, 1]."""
    import math

    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not (isinstance(top_p, int | float) and math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
