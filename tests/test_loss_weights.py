"""The training objective against hand-computed values (DESIGN.md §4 "Cache-sharing-aware loss").

Pinned here: ``loss = (1 - λ) · plain + λ · shared`` at asymmetric λ (0, 0.25, 0.7, 1), each term the pooled mean of
the per-token cross entropies over the batch's supervised predictions (not a mean of per-row means, not counting
``-100`` labels), computed in fp32; ``token_loss`` on tiny logits with unequal numbers of supervised tokens per row;
the one-term-per-step ``sample`` mode; and the absorbed path (``data.cross_role_batches``), whose plain terms of
absorbed rows are read in the shared pass, against the same hand computation. The model is replaced by small
deterministic causal functions of the tokens and their roles, so every number here is computed by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules.records import TokenizedExample
from datamodules.role_examples import IGNORE_INDEX, _Collator
from lit_modules import MultiLoraModule
from lit_modules.multi_lora_module import token_loss

V = 7  # vocabulary of the fake models


def ce(logits: list[float], target: int) -> float:
    """Cross entropy of one prediction, by hand: logsumexp - logit of the target."""
    top = max(logits)
    return top + math.log(sum(math.exp(x - top) for x in logits)) - logits[target]


def pooled(logits: torch.Tensor, targets: torch.Tensor) -> float:
    rows = logits.double().tolist()
    return sum(ce(r, int(t)) for r, t in zip(rows, targets.tolist(), strict=True)) / max(1, len(rows))


# ---------------------------------------------------------------------------------------------------- token_loss


def test_token_loss_is_the_pooled_mean_over_shifted_supervised_tokens() -> None:
    """Rows with 1 and 3 supervised tokens: the pooled mean weighs every token once (a mean of the rows' means
    would not), labels are unshifted (position t predicts label t + 1), ``-100`` positions and label 0 are not
    scored."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g) * 3
    labels = torch.tensor([[4, IGNORE_INDEX, IGNORE_INDEX, 2, IGNORE_INDEX], [1, 3, 0, 6, 5]])
    loss, n = token_loss(logits, labels)
    terms = [ce(logits[0, 2].tolist(), 2)] + [ce(logits[1, t].tolist(), int(labels[1, t + 1])) for t in range(4)]
    assert int(n) == 5 and n.dtype == torch.long
    assert loss.item() == pytest.approx(sum(terms) / 5, rel=1e-6)
    means = (terms[0] + sum(terms[1:]) / 4) / 2
    assert abs(loss.item() - means) > 0.05  # the data tells the two apart


def test_token_loss_of_one_token_and_of_none() -> None:
    logits = torch.tensor([[[0.0, 2.0, -1.0, 0.5, 0.0, 1.0, 3.0], [1.0] * V]])
    loss, n = token_loss(logits, torch.tensor([[IGNORE_INDEX, 6]]))
    assert int(n) == 1 and loss.item() == pytest.approx(ce(logits[0, 0].tolist(), 6), rel=1e-6)
    loss, n = token_loss(logits, torch.tensor([[5, IGNORE_INDEX]]))  # the first label has nothing predicting it
    assert int(n) == 0 and loss.item() == 0.0


def test_token_loss_is_computed_in_fp32_for_half_precision_logits() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, 6, V, generator=g) * 4).bfloat16()
    labels = torch.tensor([[0, 1, 2, 3, 4, 5]])
    loss, _ = token_loss(logits, labels)
    want = sum(ce(logits[0, t].float().tolist(), t + 1) for t in range(5)) / 5
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(want, rel=1e-6)


@settings(max_examples=20)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=4), st.integers(0, 10_000))
def test_token_loss_matches_the_hand_computation_for_any_mask(valid: list[int], seed: int) -> None:
    """Row ``i`` supervises its last ``valid[i]`` labels (of 6)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(valid), 6, V, generator=g)
    labels = torch.randint(0, V, (len(valid), 6), generator=g)
    for i, k in enumerate(valid):
        labels[i, : 6 - k] = IGNORE_INDEX
    loss, n = token_loss(logits, labels)
    scored = [(i, t) for i, k in enumerate(valid) for t in range(max(1, 6 - k), 6)]  # label 0: nothing predicts it
    terms = [ce(logits[i, t - 1].tolist(), int(labels[i, t])) for i, t in scored]
    assert int(n) == len(terms)
    assert loss.item() == pytest.approx(sum(terms) / max(1, len(terms)), rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------ compute_loss: the weighted terms


def batch_of(examples: list[TokenizedExample], module: MultiLoraModule, sources: bool = False) -> dict:
    batch = _Collator(pad_id=0, prefix_sources=sources)(examples)
    return module.on_before_batch_transfer(batch, 0)


def ex(ids: list[int], ctx: int, role: int, prefix: int) -> TokenizedExample:
    return TokenizedExample(input_ids=ids, context_len=ctx, prefix_len=prefix, role_id=role, source="t")


ROWS = [  # unequal numbers of supervised predictions per row: 1, 4, 2
    ex([1, 2, 3, 4, 0], 4, 0, 2),
    ex([3, 1, 4, 1, 5, 2, 6, 0], 4, 1, 3),
    ex([6, 5, 4, 3, 2, 0], 4, 2, 1),
]


def module(**kwargs) -> MultiLoraModule:
    """The Lightning module without its model (never built: every forward here is a fake)."""
    return MultiLoraModule(model_name="tiny-llama", **kwargs)


def fixed_logits(m: MultiLoraModule, n: int, calls: list[str], dtype=torch.float32) -> None:
    """``plain_logits`` and ``shared_logits`` return fixed, different ``(n, V)`` logits; ``calls`` records which ran
    (and the producers the shared one got)."""
    g = torch.Generator().manual_seed(5)
    plain, shared = (torch.randn(n, V, generator=g) * 2).to(dtype), (torch.randn(n, V, generator=g) * 2).to(dtype)
    m.plain_logits = lambda batch: calls.append("plain") or plain
    m.shared_logits = lambda batch, producers, scheme, index: calls.append(("shared", producers.tolist())) or shared
    m.fixed = (plain, shared)


@pytest.mark.parametrize("lam", [0.25, 0.7, 1.0, 0.0])
def test_loss_is_one_minus_lambda_plain_plus_lambda_shared(lam: float) -> None:
    m = module(lambda_shared=lam)
    batch = batch_of(ROWS, m)
    n = batch["loss_index"].numel()
    assert n == 7
    calls: list = []
    fixed_logits(m, n, calls)
    out = m.compute_loss(batch)
    plain, shared = (pooled(x, batch["loss_targets"]) for x in m.fixed)
    assert abs(plain - shared) > 0.1
    assert float(out["loss"]) == pytest.approx((1 - lam) * plain + lam * shared, rel=1e-6)
    assert set(out) == {"loss"} | ({"plain"} if lam < 1 else set()) | ({"shared"} if lam > 0 else set())
    if lam < 1:
        assert float(out["plain"]) == pytest.approx(plain, rel=1e-6)
    if lam > 0:
        assert float(out["shared"]) == pytest.approx(shared, rel=1e-6)
    assert [c if c == "plain" else c[0] for c in calls] == ["plain"] * (lam < 1) + ["shared"] * (lam > 0)


def test_terms_are_fp32_for_half_precision_logits() -> None:
    m = module(lambda_shared=0.25)
    batch = batch_of(ROWS, m)
    fixed_logits(m, 7, [], dtype=torch.bfloat16)
    out = m.compute_loss(batch)
    plain, shared = (pooled(x.float(), batch["loss_targets"]) for x in m.fixed)
    assert out["plain"].dtype == out["shared"].dtype == torch.float32
    assert float(out["plain"]) == pytest.approx(plain, rel=1e-6)
    assert float(out["shared"]) == pytest.approx(shared, rel=1e-6)


def test_a_single_supervised_prediction_is_its_own_mean() -> None:
    m = module(lambda_shared=0.7)
    batch = batch_of([ex([1, 2, 3, 0], 3, 0, 1)], m)
    assert batch["loss_index"].numel() == 1
    fixed_logits(m, 1, [])
    out = m.compute_loss(batch)
    plain, shared = (pooled(x, batch["loss_targets"]) for x in m.fixed)
    assert float(out["plain"]) == pytest.approx(plain, rel=1e-6)
    assert float(out["shared"]) == pytest.approx(shared, rel=1e-6)
    assert float(out["loss"]) == pytest.approx(0.3 * plain + 0.7 * shared, rel=1e-6)


def test_the_shared_term_gets_the_seeded_producers_and_seed_zero_is_the_default() -> None:
    m = module(lambda_shared=0.7)
    batch = batch_of(ROWS, m)
    calls: list = []
    fixed_logits(m, 7, calls)
    m.compute_loss(batch)
    m.compute_loss(batch, seed=0)
    for seed in (0, 3, 11):
        m.compute_loss(batch, seed=seed)
    got = [c[1] for c in calls if c != "plain"]
    assert got[0] == got[1] == got[2] == m.host_producers(batch, 0)
    assert got[3] == m.host_producers(batch, 3) and got[4] == m.host_producers(batch, 11)
    assert all(p != r for prods in got for p, r in zip(prods, [0, 1, 2], strict=True))


def test_sample_mode_takes_the_shared_term_with_probability_lambda_drawn_from_the_seed() -> None:
    """``lambda_mode: sample`` at λ = 0.25: the whole loss is the plain term (weight 1) or the shared term (weight 1),
    the shared one iff the seed's draw ``U(seed)`` (first uniform of a generator seeded ``2 · seed + 1``, a stream
    apart from the producers') is below λ: a quarter of the steps, not three quarters."""
    m = module(lambda_shared=0.25, lambda_mode="sample")
    batch = batch_of(ROWS, m)
    fixed_logits(m, 7, [])
    plain, shared = (pooled(x, batch["loss_targets"]) for x in m.fixed)
    n_shared = 0
    for seed in range(120):
        out = m.compute_loss(batch, seed=seed)
        coin = torch.rand((), generator=torch.Generator().manual_seed(seed * 2 + 1)).item()
        want = "shared" if coin < 0.25 else "plain"
        assert set(out) == {"loss", want}
        assert float(out["loss"]) == pytest.approx(shared if want == "shared" else plain, rel=1e-6)
        n_shared += want == "shared"
    assert 15 <= n_shared <= 45, n_shared
    assert set(m.compute_loss(batch)) == set(m.compute_loss(batch, seed=0))
    coin = torch.rand((), generator=torch.Generator().manual_seed(1)).item()  # seed 0's draw
    m.train_config.lambda_shared = coin  # shared iff the draw is strictly below λ
    assert set(m.compute_loss(batch, seed=0)) == {"loss", "plain"}
    for lam, term in ((0.0, "plain"), (1.0, "shared")):  # nothing to draw at the ends
        m.train_config.lambda_shared = lam
        assert all(set(m.compute_loss(batch, seed=s)) == {"loss", term} for s in range(8))


# ----------------------------------------------------------------------------------------- the absorbed path


EMB = torch.Generator().manual_seed(7)
TOKEN = torch.randn(V, V, generator=EMB)
ROLE = torch.randn(3, V, generator=EMB) * 2
POS = torch.randn(16, V, generator=EMB)


def fake_logits(ids: torch.Tensor, roles: torch.Tensor) -> torch.Tensor:
    """A causal fake model ``(B, T) -> (B, T, V)``: position p sees the running mean of token + role embeddings of
    positions ``<= p`` (``roles`` per position), so another role's cache changes what the consumer predicts."""
    h = TOKEN[ids] + ROLE[roles]
    mean = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]
    return mean + POS[: ids.shape[1]]


def install_fake_model(m: MultiLoraModule, calls: list) -> None:
    def forward(ids, role_ids, attention_mask=None, output_index=None):
        calls.append(("plain", ids.shape[0]))
        logits = fake_logits(ids, role_ids[:, None].expand_as(ids))
        return logits.flatten(0, 1)[output_index]

    def shared(batch, producers, scheme, output_index=None):
        calls.append(("shared", producers.tolist()))
        ids = batch["input_ids"]
        split = m.shared_split(batch)
        pos = torch.arange(ids.shape[1])[None]
        roles = torch.where(pos < split[:, None], producers[:, None], batch["role_ids"][:, None])
        return fake_logits(ids, roles).flatten(0, 1)[output_index]

    m.forward = forward
    m.shared_logits = shared


def hand_terms(batch: dict, producers: list[int]) -> tuple[float, float]:
    """Plain and shared terms by hand: per row, per output position p, the fake model under the row's role (plain)
    or under the producer's role before the split and the row's after (shared); pooled over all predictions."""
    host = batch["host"]
    plain, shared, n = 0.0, 0.0, 0
    for b, (ctx, length, role, split) in enumerate(
        zip(host["context_len"], host["lengths"], host["role_ids"], host["prefix_len"], strict=True)
    ):
        ids = batch["input_ids"][b : b + 1, :length]
        own = fake_logits(ids, torch.full_like(ids, role))[0]
        cut = fake_logits(ids, torch.tensor([[producers[b] if p < split else role for p in range(length)]]))[0]
        for p in range(ctx - 1, length - 1):
            target = int(ids[0, p + 1])
            plain += ce(own[p].tolist(), target)
            shared += ce(cut[p].tolist(), target)
            n += 1
    return plain / n, shared / n


CHAIN = [  # row 0 (plan, 2 outputs) is the whole start of row 1's context (action); row 2 (reflect) has no source
    ex([1, 2, 3, 4, 0], 3, 0, 1),
    ex([1, 2, 3, 4, 5, 6, 2, 3, 0], 6, 1, 5),
    ex([6, 5, 4, 3, 2, 1, 0], 3, 2, 2),
    ex([2, 2, 5, 0], 2, 0, 1),
]


@pytest.mark.parametrize("lam", [0.25, 0.7])
def test_absorbed_rows_give_the_hand_computed_weighted_loss(lam: float) -> None:
    m = module(lambda_shared=lam, producer="prefix")
    batch = batch_of(CHAIN, m, sources=True)
    assert batch["prefix_sources"][1] == [(0, 4)]
    producers = m.host_producers(batch, 0)
    assert producers[1] == 0 and m.absorption_plan(batch, producers) == {0: 1}
    calls: list = []
    install_fake_model(m, calls)
    out = m.compute_loss(batch)
    plain, shared = hand_terms(batch, producers)
    assert abs(plain - shared) > 0.05
    assert float(out["plain"]) == pytest.approx(plain, rel=1e-5)
    assert float(out["shared"]) == pytest.approx(shared, rel=1e-5)
    assert float(out["loss"]) == pytest.approx((1 - lam) * plain + lam * shared, rel=1e-5)
    assert float(out["absorbed_rows"]) == 1.0 and out["absorbed_rows"].dtype == torch.float32
    assert calls == [("plain", 3), ("shared", producers)]  # row 0 left the plain pass
    assert m.absorbed_rows_seen == 1
    m.compute_loss(batch)
    assert m.absorbed_rows_seen == 2
    # the same loss through the two separate passes (absorption switched off)
    m.absorption_plan = lambda *a, **k: None
    calls.clear()
    two = m.compute_loss(batch)
    assert set(two) == {"loss", "plain", "shared"} and calls == [("plain", 4), ("shared", producers)]
    for key in ("loss", "plain", "shared"):
        assert float(two[key]) == pytest.approx(float(out[key]), rel=1e-5)


def test_absorption_only_between_the_ends_of_lambda() -> None:
    """λ = 0 and λ = 1 run one pass each and never the absorbed path (its ``absorbed_rows`` would show)."""
    for lam, keys in ((0.0, {"loss", "plain"}), (1.0, {"loss", "shared"})):
        m = module(lambda_shared=lam, producer="prefix")
        batch = batch_of(CHAIN, m, sources=True)
        calls: list = []
        install_fake_model(m, calls)
        out = m.compute_loss(batch)
        plain, shared = hand_terms(batch, m.host_producers(batch, 0))
        assert set(out) == keys and len(calls) == 1
        assert float(out["loss"]) == pytest.approx(plain if lam == 0 else shared, rel=1e-5)


def test_without_an_absorbable_row_the_drawn_producers_feed_the_shared_pass() -> None:
    """Sources whose role is not the drawn producer: nothing absorbed, two passes, the shared one with the producers
    of :meth:`host_producers` for the step's seed."""
    m = module(lambda_shared=0.25, producer="random")
    batch = batch_of(CHAIN, m, sources=True)
    seed = next(s for s in range(50) if m.host_producers(batch, s)[1] != 0)
    producers = m.host_producers(batch, seed)
    assert m.absorption_plan(batch, producers) is None
    calls: list = []
    install_fake_model(m, calls)
    out = m.compute_loss(batch, seed=seed)
    plain, shared = hand_terms(batch, producers)
    assert "absorbed_rows" not in out and calls == [("plain", 4), ("shared", producers)]
    assert float(out["loss"]) == pytest.approx(0.75 * plain + 0.25 * shared, rel=1e-5)


def test_an_absorbed_row_after_the_first_reads_its_own_targets() -> None:
    """The source (CHAIN's row 0) at row 2 and its consumer at row 0: the absorbed row's targets are its own span of
    ``loss_targets`` (offsets 7..9 here, after rows of 3 and 4 predictions), not everything before it."""
    m = module(lambda_shared=0.25, producer="prefix")
    batch = batch_of([CHAIN[1], CHAIN[2], CHAIN[0], CHAIN[3]], m, sources=True)
    assert batch["prefix_sources"][0] == [(2, 4)]
    producers = m.host_producers(batch, 0)
    assert producers[0] == 0 and m.absorption_plan(batch, producers) == {2: 0}
    calls: list = []
    install_fake_model(m, calls)
    out = m.compute_loss(batch)
    plain, shared = hand_terms(batch, producers)
    assert calls == [("plain", 3), ("shared", producers)]  # row 2 left the plain pass
    assert float(out["plain"]) == pytest.approx(plain, rel=1e-5)
    assert float(out["shared"]) == pytest.approx(shared, rel=1e-5)
    assert float(out["loss"]) == pytest.approx(0.75 * plain + 0.25 * shared, rel=1e-5)


@pytest.mark.parametrize("lam", [0.25, 1.0])
def test_the_shared_pass_gets_the_configured_scheme(lam: float) -> None:
    """``full_shared`` (not the default) reaches the shared pass on every path: absorbed (λ = 0.25, prefix producer)
    and the shared term alone (λ = 1)."""
    m = module(lambda_shared=lam, producer="prefix", shared_scheme="full_shared")
    batch = batch_of(CHAIN, m, sources=True)
    calls: list = []
    install_fake_model(m, calls)
    inner, schemes = m.shared_logits, []
    m.shared_logits = lambda batch, producers, scheme, index=None: (
        schemes.append(scheme) or inner(batch, producers, scheme, index)
    )
    out = m.compute_loss(batch)
    assert ("absorbed_rows" in out) == (lam < 1)
    assert schemes == ["full_shared"]


@pytest.mark.parametrize("mode", ["weight", "sample"])
def test_the_shared_term_alone_uses_the_prefix_producer(mode: str) -> None:
    """λ = 1 (or ``sample`` mode's coin picking the shared term): no absorption, yet the producers are the batch's
    (:meth:`host_producers`, ``prefix``: row 1's context starts with row 0's example, role 0), not a random draw from
    the roles alone, which gives row 1 another role at the seed chosen here."""
    m = module(lambda_shared=1.0 if mode == "weight" else 0.5, lambda_mode=mode, producer="prefix")
    batch = batch_of(CHAIN, m, sources=True)
    coin = [torch.rand((), generator=torch.Generator().manual_seed(s * 2 + 1)).item() for s in range(50)]
    seed = next(s for s in range(50) if int(m.draw_producers(batch["role_ids"], s)[1]) != 0 and coin[s] < 0.5)
    producers = m.host_producers(batch, seed)
    assert producers[1] == 0
    calls: list = []
    install_fake_model(m, calls)
    out = m.compute_loss(batch, seed=seed)
    _, shared = hand_terms(batch, producers)
    assert set(out) == {"loss", "shared"} and calls == [("shared", producers)]
    assert float(out["loss"]) == pytest.approx(shared, rel=1e-5)
