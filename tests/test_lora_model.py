"""lragent.lora_model's forwards against independent references on a tiny random model: the plain forward against
each sequence alone (left and right padding, explicit positions, only some positions' logits), the shared-context
forward against what ``MultiAgentSession`` computes when the producer encodes the context and the consumer then
reads it, the one-pass shared-sequence forward against the two-pass one (two-piece attention on and off), and the
adapters' init and parameter groups."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_multi_lora

from lragent.session import MultiAgentSession

ROLES = ("plan", "action", "reflect")
TOL = 1e-4
_MODELS: dict = {}


def _model(shared_a: bool = True):
    if shared_a not in _MODELS:
        _MODELS[shared_a] = tiny_multi_lora("tiny-llama", shared_a=shared_a)
    return _MODELS[shared_a]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the plain forward ----------------------------------------------------------------------------------------------
def test_left_padded_batch_equals_each_sequence_alone_and_output_index_picks_positions():
    model = _model()
    seqs = [_ids(7, 1), _ids(4, 2)]
    roles = ["reflect", "action"]
    alone = [model(torch.tensor([s]), [r])[0] for s, r in zip(seqs, roles, strict=True)]
    ids = torch.tensor([seqs[0], [0, 0, 0] + seqs[1]])
    mask = torch.tensor([[1] * 7, [0, 0, 0] + [1] * 4])
    with torch.no_grad():
        full = model(ids, roles, attention_mask=mask)
        assert (full[0] - alone[0]).abs().max() < TOL
        assert (full[1, 3:] - alone[1]).abs().max() < TOL
        index = torch.tensor([0, 6, 10, 13])  # flat b * T + t
        picked = model(ids, roles, attention_mask=mask, output_index=index)
    assert picked.shape == (4, 256)
    assert (picked - full.flatten(0, 1)[index]).abs().max() < TOL
    assert (picked[2] - alone[1][0]).abs().max() < TOL and (picked[3] - alone[1][3]).abs().max() < TOL


def test_right_padded_batch_and_explicit_positions():
    model = _model()
    seqs = [_ids(6, 3), _ids(3, 4)]
    ids = torch.tensor([seqs[0], seqs[1] + [0, 0, 0]])
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    roles = torch.tensor([0, 2])
    with torch.no_grad():
        alone = model(torch.tensor([seqs[1]]), [2])[0]
        for index in (None, torch.tensor([6, 7, 8])):
            out = model(ids, roles, attention_mask=mask, output_index=index)
            got = out[1, :3] if index is None else out
            assert (got - alone).abs().max() < TOL
        # positions given with a mask are the caller's: stretched positions change the logits, and are those used
        shifted = torch.arange(6).expand(2, 6) * 3
        moved = model(ids, roles, attention_mask=torch.ones(2, 6, dtype=torch.long), position_ids=shifted)
        plain = model(ids, roles, position_ids=shifted)
        assert (moved - plain).abs().max() < TOL
        assert (moved - model(ids, roles)).abs().max() > 1e-3
        idx = torch.tensor([1, 4, 11])
        sel = model(ids, roles, position_ids=shifted, output_index=idx)
        assert (sel - plain.flatten(0, 1)[idx]).abs().max() < TOL


def test_role_names_are_resolved_and_a_single_role_model_needs_none():
    model = _model()
    ids = torch.tensor([_ids(5, 5), _ids(5, 6)])
    with torch.no_grad():
        by_name = model(ids, ["reflect", "plan"])
        by_id = model(ids, torch.tensor([2, 0]))
    assert torch.equal(by_name, by_id)
    one = tiny_multi_lora(roles=("plan",))
    with torch.no_grad():
        assert torch.equal(one(ids), one(ids, torch.tensor([0, 0])))
        picked = one(ids, output_index=torch.tensor([2, 7]))
        assert (picked - one(ids).flatten(0, 1)[[2, 7]]).abs().max() < TOL


# ---- the shared-context forward against the session -----------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["base_lr_shared", "full_shared"])
def test_shared_context_forward_equals_the_session(scheme):
    model = _model()
    contexts = [_ids(9, 7), _ids(5, 8)]  # left-padded in the batch
    targets = [_ids(4, 9), _ids(2, 10) + [0, 0]]  # the second right-padded
    producers, consumers = ["reflect", "plan"], ["action", "reflect"]
    ctx = torch.tensor([contexts[0], [0] * 4 + contexts[1]])
    ctx_mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5])
    tgt = torch.tensor(targets)
    tgt_mask = torch.tensor([[1] * 4, [1, 1, 0, 0]])
    with torch.no_grad():
        batched = model.shared_context_forward(ctx, ctx_mask, tgt, tgt_mask, producers, consumers, scheme)
        index = torch.tensor([1, 3, 4, 5])
        picked = model.shared_context_forward(ctx, ctx_mask, tgt, tgt_mask, producers, consumers, scheme, index)
    assert batched.shape == (2, 4, 256)
    assert (picked - batched.flatten(0, 1)[index]).abs().max() < TOL
    for i, n in enumerate((4, 2)):
        s = MultiAgentSession(model, scheme, eos_token_ids=[])
        s.append(contexts[i])
        s.step(producers[i], max_new_tokens=0)
        s.append(targets[i][:n])
        res = s.step(consumers[i], max_new_tokens=0, return_logits=True)
        assert (batched[i, :n] - res.logits).abs().max() < TOL, i
    # the producer's cache matters: the consumer's own plain forward differs
    plain = model(torch.tensor([contexts[0] + targets[0]]), [consumers[0]])[0, 9:]
    assert (plain - batched[0]).abs().max() > 1e-3


# ---- the one-pass shared-sequence forward ---------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["base_lr_shared", "full_shared"])
@pytest.mark.parametrize("two_piece", ["1", "0"])
def test_shared_sequence_forward_equals_the_two_pass_form(scheme, two_piece, monkeypatch):
    """Consumer positions as in shared_context_forward; producer positions as the producer's own plain forward."""
    monkeypatch.setenv("LRAGENT_TWO_PIECE", two_piece)
    model = _model()
    seqs = [_ids(10, 11), _ids(7, 12)]
    split = torch.tensor([6, 3])
    producers, consumers = torch.tensor([2, 0]), torch.tensor([1, 2])
    ids = torch.tensor([seqs[0], seqs[1] + [0, 0, 0]])
    lengths = torch.tensor([10, 7])
    with torch.no_grad():
        one = model.shared_sequence_forward(ids, split, producers, consumers, scheme, lengths=lengths)
        index = torch.tensor([2, 6, 9, 13, 16])
        picked = model.shared_sequence_forward(ids, split, ["reflect", "plan"], consumers, scheme, index, lengths)
        assert one.shape == (2, 10, 256)
        assert (picked - one.flatten(0, 1)[index]).abs().max() < TOL
        for b, n in enumerate((10, 7)):
            k = int(split[b])
            own = model(torch.tensor([seqs[b][:k]]), producers[b : b + 1])[0]
            assert (one[b, :k] - own).abs().max() < TOL, b
            two = model.shared_context_forward(
                torch.tensor([seqs[b][:k]]),
                torch.ones(1, k, dtype=torch.long),
                torch.tensor([seqs[b][k:n]]),
                torch.ones(1, n - k, dtype=torch.long),
                producers[b : b + 1],
                consumers[b : b + 1],
                scheme,
            )[0]
            assert (one[b, k:n] - two).abs().max() < TOL, b


# ---- adapters -------------------------------------------------------------------------------------------------------
def test_init_adapters_zero_and_random_are_seeded_and_bounded():
    model = tiny_multi_lora(b_std=0.3)
    model.init_adapters("random", seed=5, b_std=0.5)
    first = [p.detach().clone() for p in model.lora_parameters()]
    model.init_adapters("random", seed=5, b_std=0.5)
    assert all(torch.equal(a, p) for a, p in zip(first, model.lora_parameters(), strict=True))
    for m in model.lora_modules().values():
        bound = 1.0 / m.in_features**0.5
        for a in m.lora_A:
            assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
        bs = torch.stack(list(m.lora_B)).detach()
        assert 0.4 < float(bs.std()) < 0.6
        assert not torch.equal(m.lora_B[0], m.lora_B[1])
    model.init_adapters("zero", seed=5)
    for m in model.lora_modules().values():
        assert all(torch.equal(b, torch.zeros_like(b)) for b in m.lora_B)
    # the same seed draws the same first A in both modes (zero mode only skips the B draws)
    assert torch.equal(next(model.lora_parameters()), first[0])


def test_parameter_groups_hold_each_owners_own_tensors():
    for shared_a in (True, False):
        model = _model(shared_a)
        groups = model.lora_parameter_groups()
        mods = list(model.lora_modules().values())
        if shared_a:
            assert [id(p) for p in groups["shared_a"]] == [id(m.lora_A[0]) for m in mods]
        for i, role in enumerate(ROLES):
            want = [m.lora_B[i] for m in mods] if shared_a else [p for m in mods for p in (m.lora_B[i], m.lora_A[i])]
            assert [id(p) for p in groups[role]] == [id(p) for p in want]


def test_a_missing_target_names_what_the_model_has():
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model("tiny-llama")
    for layer in hf.model.layers:
        del layer.mlp.down_proj
    with pytest.raises(ValueError) as err:
        MultiLoraModel(hf, MultiLoraConfig(targets=("q_proj", "down_proj")))
    assert str(err.value) == (
        "target modules ['down_proj'] not found in the model: it has gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    )


def _shared_args(forward: str, ids: torch.Tensor) -> tuple:
    if forward == "shared_context_forward":
        return (ids, torch.ones_like(ids), ids, torch.ones_like(ids), [0], [1])
    return (ids, torch.tensor([2]), [0], [1])


@pytest.mark.parametrize("forward", ["shared_context_forward", "shared_sequence_forward"])
def test_shared_forwards_refuse_base_lr_shared_without_shared_a_and_droidspeak(forward):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError) as err:
        getattr(_model(shared_a=False), forward)(*_shared_args(forward, ids), scheme="base_lr_shared")
    assert str(err.value).startswith("scheme base_lr_shared needs shared A: with one A per role (shared_a=False)")
    with pytest.raises(ValueError) as err:  # the layout is made for the model's own layers
        getattr(_model(), forward)(*_shared_args(forward, ids), scheme="droidspeak")
    assert "droidspeak makes the consumer re-process the context, which this forward does not emulate" in str(err.value)
    out = getattr(_model(shared_a=False), forward)(*_shared_args(forward, ids), scheme="full_shared")
    assert out.shape == (1, 4, 256)
