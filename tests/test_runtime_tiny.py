"""Exact equivalences of the decomposed runtime (DESIGN.md §2), on tiny random models so they are fast.

Property-based: random schedules (roles, append lengths, generation lengths) must keep
- ``non_shared`` logits equal to a plain transformers model with that role's LoRA merged;
- with one role, every scheme equal to ``non_shared``;
- with B = 0, every scheme equal to the base model's own greedy ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_multi_lora
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession

ROLES = ("plan", "action", "reflect")
ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-mistral")
_MODELS: dict = {}


def model_for(arch: str, zero_b: bool = False, shared_a: bool = True):
    key = (arch, zero_b, shared_a)
    if key not in _MODELS:
        _MODELS[key] = tiny_multi_lora(arch, shared_a=shared_a, b_std=0.0 if zero_b else 0.3)
    return _MODELS[key]


_MERGED: dict = {}


def merged(arch: str, role: str):
    if (arch, role) not in _MERGED:
        _MERGED[(arch, role)] = model_for(arch).merged_model(role)
    return _MERGED[(arch, role)]


schedules = st.lists(
    st.tuples(
        st.sampled_from(ROLES),
        st.lists(st.integers(3, 250), min_size=1, max_size=9),  # appended token ids
        st.integers(0, 4),  # max new tokens
    ),
    min_size=1,
    max_size=5,
)
fast = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_schedule(model, scheme, schedule, return_logits=False, droidspeak_layers=None):
    session = MultiAgentSession(model, scheme, eos_token_ids=[], droidspeak_layers=droidspeak_layers)
    results = []
    for role, ids, n in schedule:
        session.append(ids)
        results.append(session.step(role, max_new_tokens=n, return_logits=return_logits))
    return session, results


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_forward_equals_merged_transformers(arch):
    model = model_for(arch)
    ids = torch.randint(0, 256, (3, 13))
    logits = model(ids, list(ROLES))
    for i, role in enumerate(ROLES):
        ref = model.merged_model(role)(ids[i : i + 1]).logits
        assert (logits[i : i + 1] - ref).abs().max() <= 1e-5


def test_right_padding_matches_unpadded():
    model = model_for("tiny-llama")
    a, b = torch.randint(0, 256, (1, 9)), torch.randint(0, 256, (1, 5))
    batch = torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], 1)])
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    out = model(batch, ["plan", "reflect"], attention_mask=mask)
    torch.testing.assert_close(out[0:1], model(a, ["plan"]), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1:2, :5], model(b, ["reflect"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@fast
@given(schedule=schedules)
def test_non_shared_equals_merged_model(arch, schedule):
    model = model_for(arch)
    session, results = run_schedule(model, "non_shared", schedule, return_logits=True)
    for (role, _, _), res in zip(schedule, results, strict=True):
        ref = merged(arch, role)(torch.tensor([session.ids])).logits[0]
        assert (ref[res.logit_positions] - res.logits).abs().max() <= 1e-4


def assert_same_tokens(ref, got, what):
    """Greedy tokens must match; a first divergence is allowed only at a true near-tie of the reference
    (top-2 logit margin below 1e-4), after which the trajectories differ and comparison stops."""
    for r, g in zip(ref, got, strict=True):
        if r.generated_ids == g.generated_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(r.generated_ids, g.generated_ids, strict=False)) if a != b)
        row = r.logits[len(r.logits) - len(r.generated_ids) + i] if len(r.generated_ids) > 1 else r.logits[-1]
        top2 = row.topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, (what, r.generated_ids, g.generated_ids)
        return


@fast
@given(
    role=st.sampled_from(ROLES),
    pieces=st.lists(
        st.tuples(st.lists(st.integers(3, 250), min_size=1, max_size=9), st.integers(0, 4)), max_size=4, min_size=1
    ),
    arch=st.sampled_from(ARCHS),
)
def test_one_role_all_schemes_identical(role, pieces, arch):
    model = model_for(arch)
    schedule = [(role, ids, n) for ids, n in pieces]
    ref = run_schedule(model, "non_shared", schedule, return_logits=True)[1]
    for scheme in SCHEMES[1:]:
        got = run_schedule(model, scheme, schedule, return_logits=True, droidspeak_layers=[1, 2])[1]
        assert_same_tokens(ref, got, scheme)
        for r, g in zip(ref, got, strict=True):
            if r.generated_ids == g.generated_ids:
                assert (r.logits - g.logits).abs().max() <= 1e-4, scheme


@fast
@given(schedule=schedules, arch=st.sampled_from(ARCHS))
def test_zero_b_all_schemes_equal_base_generate(schedule, arch):
    model = model_for(arch, zero_b=True)
    plain = _plain_copy(model.model)
    ids: list[int] = []
    expected = []
    # The base model's own greedy generate, step by step along the same trajectory.
    for _, appended, n in schedule:
        ids += appended
        if n == 0:
            expected.append(([], []))
            continue
        gen = plain.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),  # token 0 is a real token, not padding
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[0, len(ids) :].tolist()
        expected.append((new, [sc[0] for sc in gen.scores]))
        ids += new
    for scheme in SCHEMES:
        session = MultiAgentSession(model, scheme, eos_token_ids=[], droidspeak_layers=[0, 2, 3])
        for (role, appended, n), (new, scores) in zip(schedule, expected, strict=True):
            session.append(appended)
            got = session.step(role, max_new_tokens=n).generated_ids
            if got != new:  # only a true near-tie of the reference may flip a greedy token
                i = next(i for i, (a, b) in enumerate(zip(new, got, strict=False)) if a != b)
                top2 = scores[i].topk(2).values
                assert float(top2[0] - top2[1]) < 1e-4, (scheme, role, new, got)
                break


def _plain_copy(base):
    """The injected model with every MultiLoraLinear replaced by its base linear (a plain transformers model)."""
    import copy

    from lragent.multi_lora import MultiLoraLinear

    plain = copy.deepcopy(base)
    for name, module in list(plain.named_modules()):
        if isinstance(module, MultiLoraLinear):
            parent, child = name.rsplit(".", 1)
            setattr(plain.get_submodule(parent), child, module.base)
    return plain.eval()


def test_schemes_differ_with_several_roles():
    """Sharing is not a no-op: with distinct adapters, shared schemes change what a second role computes."""
    model = model_for("tiny-llama")
    schedule = [("plan", list(range(3, 40)), 0), ("action", [5, 6], 0)]
    logits = {}
    for scheme in SCHEMES:
        session = MultiAgentSession(model, scheme, eos_token_ids=[])
        for role, ids, n in schedule:
            session.append(ids)
            res = session.step(role, max_new_tokens=n, return_logits=True)
        logits[scheme] = res.logits[-1]
    assert not torch.allclose(logits["non_shared"], logits["full_shared"], atol=1e-4)
    assert not torch.allclose(logits["full_shared"], logits["base_lr_shared"], atol=1e-4)


def test_base_shared_lr_prefill_matches_non_shared_when_context_is_own():
    """base_shared recomputes V_lr with the role's own hidden states; K/V_base come from the writer."""
    model = model_for("tiny-llama")
    s = MultiAgentSession(model, "base_shared", eos_token_ids=[])
    s.append(list(range(3, 30)))
    s.step("plan", max_new_tokens=0)
    s.append([7, 8])
    res = s.step("action", max_new_tokens=0)
    assert res.recomputed_tokens == 27 and res.prefill_tokens == 27 + 2


def test_base_lr_shared_refused_without_shared_a():
    model = model_for("tiny-llama", shared_a=False)
    with pytest.raises(ValueError, match="base_lr_shared needs shared A"):
        MultiAgentSession(model, "base_lr_shared")
    # base_shared works with independent A
    s = MultiAgentSession(model, "base_shared", eos_token_ids=[])
    s.append([4, 5, 6])
    s.step("plan", max_new_tokens=2)


def test_unknown_scheme():
    with pytest.raises(
        ValueError,
        match="unknown scheme 'shared': allowed non_shared, full_shared, droidspeak, base_shared, base_lr_shared",
    ):
        MultiAgentSession(model_for("tiny-llama"), "shared")


def test_memory_accounting_exact_bytes():
    """Per-component bytes follow from the shapes (SmolLM2 layer dims: H_kv 3, D 64, r 8; 2 layers, fp32)."""
    model = tiny_multi_lora("smollm2-135m", rank=8, overrides={"num_hidden_layers": 2})
    sizes, lengths = {}, {}
    for scheme in SCHEMES:
        s = MultiAgentSession(model, scheme, eos_token_ids=[], droidspeak_layers=[1])
        for role in ROLES:
            s.append(list(range(100, 140)))
            s.step(role, max_new_tokens=1)
        for role in ROLES:  # each role's last step sees one more token than the previous role's
            s.append([5])
            s.step(role, max_new_tokens=0)
        sizes[scheme] = s.cache_bytes()
        lengths[scheme] = s.num_tokens
    n = lengths["full_shared"]
    assert n == 3 * 41 + 3
    per_tok = 2 * 3 * 64 * 4  # layers x H_kv x D x 4 bytes
    assert sizes["full_shared"] == {"k": n * per_tok, "v": n * per_tok}
    # non_shared: plan, action, reflect caches end at n-2, n-1, n tokens
    assert sizes["non_shared"] == {"k": (3 * n - 3) * per_tok, "v": (3 * n - 3) * per_tok}
    lr_tok = 2 * 8 * 4
    assert sizes["base_lr_shared"] == {"k": n * per_tok, "v_base": n * per_tok, "v_lr": n * lr_tok}
    assert sizes["base_shared"] == {"k": n * per_tok, "v_base": n * per_tok, "v_lr": (3 * n - 3) * lr_tok}
    assert sizes["droidspeak"] == {"k": n * per_tok, "v": n * per_tok, "hidden": n * 576 * 4}


def test_truncate_rolls_back_caches():
    model = model_for("tiny-llama")
    s = MultiAgentSession(model, "base_lr_shared", eos_token_ids=[])
    s.append(list(range(3, 20)))
    r1 = s.step("plan", max_new_tokens=3, return_logits=True)
    s.truncate(10)
    assert s.num_tokens == 10 and s.cached_len("plan") <= 10
    s.append(list(range(13, 20)))  # the same 17 tokens as before
    r2 = s.step("plan", max_new_tokens=3, return_logits=True)
    assert r2.generated_ids == r1.generated_ids


@pytest.mark.parametrize("scheme", ["base_lr_shared", "full_shared"])
def test_shared_term_forward_equals_session_logits(scheme):
    """The training-time shared forward (batched, left-padded context) equals what the session computes when a
    producer encodes the context and the consumer then processes the target, for the same scheme."""
    model = model_for("tiny-llama")
    contexts = [list(range(10, 27)), list(range(40, 49))]  # different lengths: left padding in the batch
    targets = [[5, 6, 7, 8], [9, 10, 11, 12]]
    producers, consumers = ["reflect", "plan"], ["action", "reflect"]
    tc = max(map(len, contexts))
    ctx = torch.tensor([[0] * (tc - len(c)) + c for c in contexts])
    ctx_mask = torch.tensor([[0] * (tc - len(c)) + [1] * len(c) for c in contexts])
    tgt = torch.tensor(targets)
    batched = model.shared_context_forward(ctx, ctx_mask, tgt, torch.ones_like(tgt), producers, consumers, scheme)
    for i in range(2):
        s = MultiAgentSession(model, scheme, eos_token_ids=[])
        s.append(contexts[i])
        s.step(producers[i], max_new_tokens=0)
        s.append(targets[i])
        res = s.step(consumers[i], max_new_tokens=0, return_logits=True)
        assert res.logit_positions == list(range(len(contexts[i]), len(contexts[i]) + 4))
        assert (batched[i] - res.logits).abs().max() <= 1e-4
    # and the shared forward is not the plain forward of the consumer (the producer's cache matters)
    plain = model(torch.tensor([contexts[0] + targets[0]]), [consumers[0]])[0, len(contexts[0]) :]
    assert (plain - batched[0]).abs().max() > 1e-3
