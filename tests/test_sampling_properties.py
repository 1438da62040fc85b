"""Properties of :mod:`lragent.sampling`: what distribution the decode engine's sampler draws from.

Pinned here: the draws of :func:`sample_next` follow the exact temperature-scaled, top-p-truncated, renormalised
softmax built by hand in the test (frequencies over many fixed-seed draws, with a tolerance that a wrong rule exceeds:
T applied twice, T ignored, one token more or less in the nucleus, mass not renormalised); the nucleus boundary
(a token whose preceding mass equals ``top_p`` is out, one float above it is in); top_p = 1 (every token) and a
single-token nucleus; greedy rows (T = 0, ties to the first index, T -> 0, ``sampling=False``); rows with different
temperatures / top-p in one batch drawing exactly what each would draw alone; the counter-based noise against a pure
Python splitmix64 reference (u strictly inside (0, 1), float32, on the seed's device); :func:`check_sampling`'s
exact boundaries and messages.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.sampling import _shr, _splitmix64, check_sampling, first_argmax, sample_next, uniform_noise

MASK = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
LOGITS = [1.9, -0.3, 0.8, 2.6, -1.4, 0.1]  # no ties, most likely token not first, so order / scatter matter
N = 20000  # draws per setting: a frequency's standard deviation is at most 0.0036
TOL = 0.02


# ----------------------------------------------------------------------------- references
def ref_splitmix64(x: int) -> int:
    z = (x + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * MIX1) & MASK
    z = ((z ^ (z >> 27)) * MIX2) & MASK
    return z ^ (z >> 31)


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def ref_uniform(seed: int, counter: int, v: int) -> np.float32:
    key = ref_splitmix64(ref_splitmix64(seed & MASK) ^ (counter & MASK))
    bits = ref_splitmix64((key + v * GOLDEN) & MASK)
    u = (np.float32(bits >> 40) + np.float32(0.5)) * np.float32(2.0**-24)  # float32 arithmetic, as on the device
    return min(u, np.nextafter(np.float32(1), np.float32(0)))


def exact_distribution(logits: list[float], temperature: float, top_p: float) -> list[float]:
    """softmax(logits / T) in float64, restricted to the smallest most-likely prefix whose mass reaches top_p."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    k = next(k for k in range(1, len(p) + 1) if sum(p[i] for i in order[:k]) >= top_p)
    return renormalised(p, order[:k])


def renormalised(p: list[float], nucleus: list[int]) -> list[float]:
    mass = sum(p[i] for i in nucleus)
    return [p[i] / mass if i in nucleus else 0.0 for i in range(len(p))]


def softmax(logits: list[float], temperature: float) -> list[float]:
    e = [math.exp(x / temperature) for x in logits]
    return [x / sum(e) for x in e]


def draws(rows: list[tuple[list[float], float, float]], seed0: int = 7) -> torch.Tensor:
    """One token per row; row b uses seed ``seed0 + b // 3`` and counter ``b % 3`` (distinct noise per row)."""
    logits = torch.tensor([r[0] for r in rows])
    b = torch.arange(len(rows))
    return sample_next(
        logits, torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows]), seed0 + b // 3, b % 3
    )


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).double() / len(tokens)).tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- the distribution
def test_draws_follow_the_temperature_scaled_top_p_truncated_renormalised_softmax() -> None:
    temperature, top_p = 1.6, 0.75
    want = exact_distribution(LOGITS, temperature, top_p)
    assert sum(x > 0 for x in want) == 3  # a three-token nucleus out of six
    p = softmax(LOGITS, temperature)
    order = sorted(range(6), key=lambda i: -p[i])
    wrong = {
        "T applied twice": exact_distribution(LOGITS, temperature**2, top_p),
        "T ignored (T = 1 path)": exact_distribution(LOGITS, 1.0, top_p),
        "one token more": renormalised(p, order[:4]),
        "one token less": renormalised(p, order[:2]),
        "not renormalised": [p[i] if i in order[:3] else 0.0 for i in range(6)],
        "no truncation": p,
    }
    for name, dist in wrong.items():  # the test has the power to see each wrong rule
        assert max_gap(dist, want) > 2 * TOL, name
    got = frequencies(draws([(LOGITS, temperature, top_p)] * N), 6)
    assert max_gap(got, want) < TOL, (got, want)


def test_rows_with_different_temperature_and_top_p_each_follow_their_own_distribution() -> None:
    a, b = (1.6, 0.75), (0.8, 0.76)
    rows = [(LOGITS, *a), (LOGITS, *b)] * N
    tokens = draws(rows, seed0=1001)
    got_a, got_b = frequencies(tokens[0::2], 6), frequencies(tokens[1::2], 6)
    want_a, want_b = exact_distribution(LOGITS, *a), exact_distribution(LOGITS, *b)
    assert max_gap(want_a, want_b) > 2 * TOL
    assert max_gap(got_a, want_a) < TOL and max_gap(got_b, want_b) < TOL


def test_top_p_one_keeps_every_token() -> None:
    logits = [0.4, -0.9, 1.2, 0.0]
    want = softmax(logits, 1.3)
    got = frequencies(draws([(logits, 1.3, 1.0)] * N, seed0=5), 4)
    assert min(got) > 0 and max_gap(got, want) < TOL


@pytest.mark.parametrize("temperature", [0.35, 1.0, 4.0])
def test_a_top_p_below_the_top_probability_leaves_a_single_token_nucleus(temperature: float) -> None:
    top = softmax(LOGITS, temperature)[3]
    tokens = draws([(LOGITS, temperature, top * 0.9)] * 2000)
    assert set(tokens.tolist()) == {3}


def nucleus_boundary(temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's float32 sorted order and preceding masses for LOGITS at ``temperature``."""
    logits = torch.tensor([LOGITS] * 8)
    t = torch.full((8,), temperature)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    preceding = sorted_p.cumsum(-1) - sorted_p
    assert (preceding == preceding[0]).all()
    return order[0], preceding[0], sorted_p[0]


def test_a_token_whose_preceding_mass_equals_top_p_is_out_and_one_float_above_it_is_in() -> None:
    temperature = 0.9
    order, preceding, _ = nucleus_boundary(temperature)
    at = preceding[2].item()  # the first two tokens' mass exactly: they reach top_p, the third is not needed
    above = np.nextafter(np.float32(at), np.float32(2)).item()
    n = 4000
    out = draws([(LOGITS, temperature, at)] * n)
    assert set(out.tolist()) == set(order[:2].tolist())
    inside = draws([(LOGITS, temperature, above)] * n)
    assert set(inside.tolist()) == set(order[:3].tolist())


def test_the_most_likely_token_is_kept_whatever_the_top_p() -> None:
    order, _, sorted_p = nucleus_boundary(2.0)
    tiny = np.nextafter(np.float32(0), np.float32(1)).item()
    assert set(draws([(LOGITS, 2.0, tiny)] * 500).tolist()) == {int(order[0])}


# ----------------------------------------------------------------------------- greedy
def test_temperature_zero_takes_the_first_arg_max_whatever_the_seed() -> None:
    logits = torch.tensor([[0.3, 2.0, -1.0, 2.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0], [-3.0, -2.0, -2.5, -2.0, 0.0]])
    logits = logits.repeat(50, 1)
    b = len(logits)
    for seed in (0, 1, 12345):
        got = sample_next(logits, torch.zeros(b), torch.full((b,), 0.7), torch.full((b,), seed), torch.arange(b))
        assert got.tolist() == [1, 0, 4] * 50


@given(st.lists(st.floats(-5, 5, width=32), min_size=2, max_size=9, unique=True), st.integers(0, 2**40))
@settings(max_examples=20)
def test_a_tiny_temperature_converges_to_the_arg_max(logits: list[float], seed: int) -> None:
    x = torch.tensor([logits])
    if (x.sort(descending=True).values[0, 0] - x.sort(descending=True).values[0, 1]).item() < 1e-2:
        return  # the gap must dominate the noise at T = 1e-4
    got = sample_next(x, torch.tensor([1e-4]), torch.tensor([1.0]), torch.tensor([seed]), torch.tensor([3]))
    assert got.item() == int(np.argmax(logits))


def test_sampling_false_is_the_row_wise_arg_max() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0], [0.0, 0.5, 0.9]])
    zero = torch.zeros(3)
    got = sample_next(logits, zero, torch.ones(3), torch.arange(3), torch.zeros(3).long(), sampling=False)
    assert got.tolist() == [1, 0, 2]
    assert got.tolist() == sample_next(logits, zero, torch.ones(3), torch.arange(3), torch.zeros(3).long()).tolist()


def _check_first_argmax(device: str) -> None:
    """first_argmax is argmax, index for index: random rows, ties across and within chunks, a row of -inf, NaNs (the
    first one counts as the largest), +inf twice; vocabularies of LLaMA-3 (128,256), Qwen2.5 (151,936), SmolLM2
    (49,152), one that splits into 8 chunks (1,000) and one into fewer (37: argmax itself)."""
    g = torch.Generator().manual_seed(0)
    for v in (128256, 151936, 49152, 1000, 37):
        for x in (
            torch.randn(5, v, generator=g),
            torch.randint(0, 3, (5, v), generator=g).float(),  # many ties for the largest value
            torch.full((2, v), float("-inf")),
        ):
            x = x.to(device)
            assert torch.equal(first_argmax(x), x.argmax(-1)), (v, x[:, :4])
        x = torch.randn(4, v, generator=g)
        x[0, v // 2], x[0, v - 1], x[1, 3] = math.nan, math.nan, math.nan
        x[2, -2:] = math.inf
        x = x.to(device)
        assert first_argmax(x).tolist() == x.argmax(-1).tolist() == [v // 2, 3, v - 2, x[3].argmax().item()]
    # a tie between two chunks' largest values goes to the first chunk, wherever the chunk's own index falls
    x = torch.zeros(1, 128256, device=device)
    x[0, 2004 + 7], x[0, 5 * 2004 + 1] = 3.0, 3.0
    assert first_argmax(x).item() == 2004 + 7


def test_first_argmax_is_argmax() -> None:
    _check_first_argmax("cpu")


@pytest.mark.gpu
def test_first_argmax_is_argmax_on_a_gpu() -> None:
    _check_first_argmax("cuda")


def test_sampling_defaults_to_true() -> None:
    rows = [(LOGITS, 1.2, 1.0)] * 64
    logits, t, p = torch.tensor([r[0] for r in rows]), torch.full((64,), 1.2), torch.ones(64)
    seed, counter = torch.arange(64), torch.zeros(64).long()
    default = sample_next(logits, t, p, seed, counter)
    assert default.tolist() == sample_next(logits, t, p, seed, counter, sampling=True).tolist()
    assert len(set(default.tolist())) > 1


# ----------------------------------------------------------------------------- rows are independent
@given(
    st.lists(
        st.tuples(
            st.lists(st.floats(-4, 4, width=32), min_size=5, max_size=5),
            st.sampled_from([0.0, 0.3, 0.8, 1.0, 2.5]),
            st.sampled_from([0.05, 0.4, 0.77, 0.9, 1.0]),
            st.integers(-(2**62), 2**62),
            st.integers(0, 500),
        ),
        min_size=2,
        max_size=6,
    )
)
@settings(max_examples=25)
def test_a_row_draws_the_same_token_alone_as_in_any_batch(rows: list[tuple]) -> None:
    logits = torch.tensor([r[0] for r in rows])
    t, p = torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])
    seed, counter = torch.tensor([r[3] for r in rows]), torch.tensor([r[4] for r in rows])
    batch = sample_next(logits, t, p, seed, counter)
    for b in range(len(rows)):
        alone = sample_next(logits[b : b + 1], t[b : b + 1], p[b : b + 1], seed[b : b + 1], counter[b : b + 1])
        assert batch[b].item() == alone.item()
        if rows[b][1] == 0.0:
            assert batch[b].item() == int(logits[b].argmax())
        else:  # inside the nucleus computed by hand (float64, with slack for float32 rounding)
            probs = softmax(rows[b][0], rows[b][1])
            tok = batch[b].item()
            preceding = sum(q for i, q in enumerate(probs) if q > probs[tok] or (q == probs[tok] and i < tok))
            assert preceding < rows[b][2] + 1e-5


def test_sample_next_emits_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draws([(LOGITS, 0.8, 0.9), (LOGITS, 0.0, 1.0)])


# ----------------------------------------------------------------------------- the noise
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=20))
@settings(max_examples=25)
def test_shr_is_a_logical_right_shift_of_the_64_bits(xs: list[int]) -> None:
    x = torch.tensor(xs + [-1, -(2**63), 2**63 - 1, 0, 1], dtype=torch.int64)
    for n in (1, 27, 30, 31, 40, 63):
        assert _shr(x, n).tolist() == [(v & MASK) >> n for v in x.tolist()]


def test_splitmix64_matches_the_reference_sequence() -> None:
    # the first outputs of splitmix64 seeded with 0 (Vigna's reference implementation)
    state = torch.tensor([0, GOLDEN - (1 << 64)], dtype=torch.int64)
    assert _splitmix64(state).tolist() == [signed(0xE220A8397B1DCDAF), signed(0x6E789E6AA1B965F4)]
    xs = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321987]
    assert _splitmix64(torch.tensor(xs)).tolist() == [signed(ref_splitmix64(x & MASK)) for x in xs]


def test_uniform_noise_is_the_reference_hash_of_seed_counter_and_vocab_index() -> None:
    seeds = [0, 1, -5, 2**62 + 3, -(2**63), 1116480]
    counters = [0, 7, 1, 2**40, 3, 0]
    u = uniform_noise(torch.tensor(seeds), torch.tensor(counters), 16)
    assert u.shape == (6, 16) and u.dtype == torch.float32
    want = [[ref_uniform(s, c, v) for v in range(16)] for s, c in zip(seeds, counters, strict=True)]
    assert np.array_equal(u.numpy(), np.array(want, dtype=np.float32))


def test_uniform_noise_stays_strictly_inside_zero_one_where_float32_would_round_to_one() -> None:
    # seed 1116480, counter 0, vocabulary index 11 has the top 24 hash bits all set: (2**24 - 0.5) / 2**24 rounds
    # to 1.0 in float32, which made the Gumbel noise +inf there; a -inf logit then gave NaN, which arg-max takes
    u = uniform_noise(torch.tensor([1116480]), torch.tensor([0]), 16)
    assert u[0, 11].item() == np.nextafter(np.float32(1), np.float32(0))
    assert (u > 0).all() and (u < 1).all()
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    logits[:, 11] = -math.inf  # a banned token: probability 0
    ones = torch.ones(64)
    got = sample_next(logits, ones, ones, torch.full((64,), 1116480), torch.zeros(64).long())
    assert 11 not in got.tolist()


def test_uniform_noise_is_float32_whatever_the_default_dtype() -> None:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        u = uniform_noise(torch.tensor([3, 4]), torch.tensor([0, 9]), 5)
    finally:
        torch.set_default_dtype(old)
    assert u.dtype == torch.float32


def test_uniform_noise_lives_on_the_seed_device() -> None:
    u = uniform_noise(torch.tensor([3, 4], device="meta"), torch.tensor([0, 9], device="meta"), 5)
    assert u.device.type == "meta" and u.shape == (2, 5)


# ----------------------------------------------------------------------------- check_sampling
@pytest.mark.parametrize(("temperature", "top_p"), [(0, 1), (0.0, 1.0), (1e-9, 1e-9), (3, 0.5), (2.5, 1)])
def test_check_sampling_accepts_the_closed_ends(temperature: float, top_p: float) -> None:
    check_sampling(temperature, top_p)


@pytest.mark.parametrize("temperature", [-1e-9, -1, math.inf, math.nan, "0.5", None])
def test_check_sampling_rejects_a_bad_temperature_with_its_message(temperature: object) -> None:
    msg = f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        check_sampling(temperature, 0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("top_p", [0, 0.0, -0.1, 1.0000001, 1.5, 2, math.nan, math.inf, "1", None])
def test_check_sampling_rejects_a_top_p_outside_zero_one_with_its_message(top_p: object) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(f'top_p must be in (0, 1], got {top_p!r}')}$"):
        check_sampling(0.5, top_p)  # type: ignore[arg-type]
