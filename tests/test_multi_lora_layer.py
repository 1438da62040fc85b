"""lragent.multi_lora's layer against the LoRA formula written out by hand: per-token roles (a role per token, as the
one-pass shared forward uses), single-role layers, adapters kept in float32 over a bfloat16 base, the role-masked
GEMM form the decoder uses (``role_mask`` / ``role_masked`` / ``add_lora_masked``), the cached stack of B's, the
PEFT init, dropout, and the config's dict round trip and its refusals, each message whole."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lragent.multi_lora import ALL_TARGETS, MultiLoraConfig, MultiLoraLinear, role_mask, role_masked

D_IN, D_OUT, RANK, ALPHA = 12, 10, 4, 8.0  # scaling 2


def _layer(shared_a: bool = True, n_roles: int = 3, dtype: torch.dtype = torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    base = nn.Linear(D_IN, D_OUT, bias=True).to(dtype)
    layer = MultiLoraLinear(base, n_roles=n_roles, rank=RANK, alpha=ALPHA, shared_a=shared_a)
    with torch.no_grad():
        for b in layer.lora_B:
            b.normal_()
    return layer


def _want(layer: MultiLoraLinear, x: torch.Tensor, role: int) -> torch.Tensor:
    """``x W0ᵀ + b + (alpha / r) (x A_roleᵀ) B_roleᵀ`` in float64, from the config's alpha and rank."""
    a = layer.lora_A[0 if layer.shared_a else role].double()
    x = x.double()
    return (
        x @ layer.base.weight.double().t()
        + layer.base.bias.double()
        + (ALPHA / RANK) * (x @ a.t()) @ (layer.lora_B[role].double().t())
    )


# ---- the config -----------------------------------------------------------------------------------------------------
def test_config_dict_round_trip_names_every_field_and_converts_types():
    cfg = MultiLoraConfig(roles=("a", "b"), rank=3, alpha=6.0, dropout=0.1, targets=("k_proj",), shared_a=False)
    d = cfg.to_dict()
    assert d == {
        "roles": ["a", "b"],
        "rank": 3,
        "alpha": 6.0,
        "dropout": 0.1,
        "targets": ["k_proj"],
        "shared_a": False,
    }
    back = MultiLoraConfig.from_dict(d)
    assert back == cfg and back.scaling == 2.0
    # loose JSON types come back as the config's own; an old checkpoint without dropout reads 0.0
    loose = MultiLoraConfig.from_dict(
        {"roles": ["p"], "rank": "2", "alpha": 3, "targets": ["q_proj", "o_proj"], "shared_a": 1}
    )
    assert loose.roles == ("p",) and loose.targets == ("q_proj", "o_proj")
    assert loose.rank == 2 and type(loose.rank) is int
    assert loose.alpha == 3.0 and type(loose.alpha) is float
    assert loose.dropout == 0.0 and type(loose.dropout) is float
    assert loose.shared_a is True


def test_config_accepts_the_smallest_valid_values():
    cfg = MultiLoraConfig(rank=1, alpha=0.5, dropout=0.0)
    assert cfg.scaling == 0.5


@pytest.mark.parametrize("rank", [True, 2.0])
def test_config_refuses_a_rank_that_is_not_an_int(rank):
    with pytest.raises(ValueError) as err:
        MultiLoraConfig(rank=rank)
    assert str(err.value) == f"rank must be a positive integer, got {rank!r}"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"roles": ()}, "roles: at least one role is needed, got an empty list"),
        ({"targets": ("q_proj", "nope")}, f"targets ['nope'] not supported: allowed {', '.join(ALL_TARGETS)}"),
        ({"targets": ()}, f"targets [] not supported: allowed {', '.join(ALL_TARGETS)}"),
    ],
)
def test_config_refusals_say_the_whole_message(kwargs, message):
    with pytest.raises(ValueError) as err:
        MultiLoraConfig(**kwargs)
    assert str(err.value) == message


# ---- construction and init ------------------------------------------------------------------------------------------
def test_layer_defaults_to_shared_a_and_builds_adapters_in_the_base_dtype():
    base = nn.Linear(D_IN, D_OUT).double()
    layer = MultiLoraLinear(base, n_roles=3, rank=RANK, alpha=ALPHA)
    assert layer.shared_a and len(layer.lora_A) == 1 and len(layer.lora_B) == 3
    assert (layer.n_roles, layer.rank, layer.scaling) == (3, RANK, 2.0)
    assert all(p.dtype == torch.float64 for p in [*layer.lora_A, *layer.lora_B])
    assert not any(p.requires_grad for p in base.parameters())


def test_init_is_peft_default_a_kaiming_uniform_sqrt5_and_b_zero():
    """A is drawn exactly as ``kaiming_uniform_(a=sqrt(5))`` draws it (bound 1/sqrt(d_in)); every B is zero."""
    torch.manual_seed(3)
    base = nn.Linear(64, 8)
    state = torch.get_rng_state()
    layer = MultiLoraLinear(base, n_roles=2, rank=16, alpha=16.0, shared_a=False)
    torch.set_rng_state(state)
    for a in layer.lora_A:
        want = torch.empty(16, 64)
        nn.init.kaiming_uniform_(want, a=math.sqrt(5))
        assert torch.equal(a.detach(), want)
        assert a.abs().max() <= 1 / 8 and a.abs().max() > 0.95 / 8  # the bound of PEFT's init, nearly reached
    assert all(torch.equal(b, torch.zeros(8, 16)) for b in layer.lora_B)


def test_dropout_acts_on_the_adapter_input_in_training_only():
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(64, 4), n_roles=1, rank=2, alpha=2.0, dropout=0.5)
    x = torch.ones(1, 4, 64)
    want = x @ layer.lora_A[0].detach().t()
    layer.train()
    dropped = layer.dropout(x)
    assert set(dropped.unique().tolist()) == {0.0, 2.0}  # inverted dropout at p = 0.5
    assert not torch.allclose(layer.lora_input(x, None), want)
    layer.eval()
    assert torch.equal(layer.lora_input(x, None), want)
    no_drop = MultiLoraLinear(nn.Linear(64, 4), n_roles=1, rank=2, alpha=2.0, dropout=0.0).train()
    assert torch.equal(no_drop.lora_input(x, None), x @ no_drop.lora_A[0].detach().t())


# ---- forwards --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared_a", [True, False])
def test_a_role_per_token_applies_each_tokens_own_adapter(shared_a):
    layer = _layer(shared_a)
    x = torch.randn(2, 5, D_IN, dtype=torch.float64)
    roles = torch.tensor([[0, 1, 2, 2, 1], [2, 0, 0, 1, 0]])
    got = layer(x, roles)
    assert got.shape == (2, 5, D_OUT)
    for b in range(2):
        for t in range(5):
            want = _want(layer, x[b : b + 1, t : t + 1], int(roles[b, t]))
            assert (got[b, t] - want[0, 0]).abs().max() < 1e-12, (b, t)
    lr = layer.lora_input(x, roles)
    for b in range(2):
        for t in range(5):
            a = layer.lora_A[0 if shared_a else int(roles[b, t])]
            assert (lr[b, t] - x[b, t] @ a.t()).abs().max() < 1e-12
    base, parts_lr = layer.forward_parts(x, roles)
    assert (base + layer.lora_output(parts_lr, roles) - got).abs().max() < 1e-12


def test_per_token_role_ids_of_a_wrong_shape_are_refused_naming_it():
    layer = _layer(False)
    x = torch.randn(2, 5, D_IN, dtype=torch.float64)
    for bad in (torch.zeros(3, 5, dtype=torch.long), torch.zeros(2, 5, 1, dtype=torch.long)):
        with pytest.raises(ValueError) as err:
            layer(x, bad)
        assert str(err.value) == (
            f"role_ids must have shape (2,), one id per sequence, or (2, T), one per token; got {tuple(bad.shape)}"
        )
    # (B, T) with T != B is accepted
    assert layer(x, torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, D_OUT)


@pytest.mark.parametrize("shared_a", [True, False])
def test_a_single_role_layer_needs_no_role_ids(shared_a):
    layer = _layer(shared_a, n_roles=1)
    x = torch.randn(3, 2, D_IN, dtype=torch.float64)
    got = layer(x)
    assert (got - _want(layer, x, 0)).abs().max() < 1e-12
    lr = layer.lora_input(x, None)
    assert (layer.lora_output(lr, None) - (ALPHA / RANK) * lr @ layer.lora_B[0].t()).abs().max() < 1e-12
    if shared_a:  # (N, d_in) rows: also served with one shared-A role
        flat = torch.randn(4, D_IN, dtype=torch.float64)
        assert (layer(flat) - _want(layer, flat, 0)).abs().max() < 1e-12


def test_two_roles_use_their_own_b():
    layer = _layer(True, n_roles=2)
    x = torch.randn(2, 3, D_IN, dtype=torch.float64)
    roles = torch.tensor([1, 0])
    got = layer.lora_output(layer.lora_input(x, roles), roles)
    for i, r in enumerate((1, 0)):
        want = (ALPHA / RANK) * (x[i] @ layer.lora_A[0].t()) @ layer.lora_B[r].t()
        assert (got[i] - want).abs().max() < 1e-12
    assert (layer(x, roles)[0] - _want(layer, x[:1], 1)[0]).abs().max() < 1e-12


@pytest.mark.parametrize("shared_a", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_float32_adapters_over_a_bfloat16_base_compute_in_the_activations_dtype(shared_a, per_token):
    """Training keeps the adapters in float32 over a bfloat16 base: the output is bfloat16, the adapter term the
    formula's to bfloat16 precision."""
    layer = _layer(shared_a, dtype=torch.bfloat16)
    layer.lora_A.float()
    layer.lora_B.float()
    assert layer.lora_A[0].dtype == torch.float32 and layer.base.weight.dtype == torch.bfloat16
    x = torch.randn(2, 3, D_IN).to(torch.bfloat16)
    roles = torch.tensor([[2, 0, 1], [1, 1, 0]]) if per_token else torch.tensor([2, 1])
    with torch.no_grad():
        got = layer(x, roles)
    assert got.dtype == torch.bfloat16
    for b in range(2):
        for t in range(3):
            role = int(roles[b, t] if per_token else roles[b])
            want = _want(layer, x[b : b + 1, t : t + 1], role)[0, 0]
            assert (got[b, t].double() - want).abs().max() < 0.1 * want.abs().max(), (b, t)
    with torch.no_grad():
        lr = layer.lora_input(x, roles)
        added = layer.lora_output(lr, roles)
    assert lr.dtype == torch.bfloat16 and added.dtype == torch.bfloat16
    base = x.double() @ layer.base.weight.double().t() + layer.base.bias.double()
    assert (added.double() + base - got.double()).abs().max() < 0.1 * got.double().abs().max()
    single = _layer(shared_a, n_roles=1, dtype=torch.bfloat16)
    single.lora_B.float()
    single.lora_A.float()
    with torch.no_grad():
        out = single(x)
    assert out.dtype == torch.bfloat16
    want = _want(single, x, 0)
    assert (out.double() - want).abs().max() < 0.1 * want.abs().max()


def test_role_ids_on_another_device_follow_the_activations():
    """role_ids handed on the CPU for activations elsewhere (here the meta device) are moved to them."""
    for shared_a in (True, False):
        layer = MultiLoraLinear(nn.Linear(D_IN, D_OUT, device="meta"), 3, RANK, ALPHA, shared_a=shared_a)
        x = torch.empty(2, 5, D_IN, device="meta")
        for roles in (torch.tensor([0, 2]), torch.tensor([[0, 1, 2, 0, 1], [2, 2, 0, 0, 1]])):
            assert layer(x, roles).device.type == "meta"
            assert layer.lora_output(torch.empty(2, 5, RANK, device="meta"), roles).device.type == "meta"
        single = MultiLoraLinear(nn.Linear(D_IN, D_OUT, device="meta"), 1, RANK, ALPHA, shared_a=shared_a)
        assert single.lora_input(x, None).device.type == "meta"
        assert single(x).device.type == "meta"


# ---- the stacked views and the cached B ------------------------------------------------------------------------------
@pytest.mark.parametrize("shared_a", [True, False])
def test_stacked_a_gives_every_roles_a(shared_a):
    layer = _layer(shared_a)
    a = layer.stacked_a()
    assert a.shape == (3, RANK, D_IN)
    for r in range(3):
        assert torch.equal(a[r], layer.lora_A[0 if shared_a else r])


def test_stacked_b_is_one_cached_tensor_refreshed_in_place_when_a_b_changes():
    layer = _layer(True)
    with torch.no_grad():
        first = layer.stacked_b()
        assert torch.equal(first, torch.stack(list(layer.lora_B))) and not first.requires_grad
        again = layer.stacked_b()
        assert again is first
        layer.lora_B[1].add_(1.0)
        refreshed = layer.stacked_b()
        assert refreshed is first and torch.equal(refreshed[1], layer.lora_B[1])
        layer.lora_B[0].zero_()
        assert torch.equal(layer.stacked_b()[0], torch.zeros(D_OUT, RANK, dtype=torch.float64))
    layer.float()  # new parameters in another dtype: a new cache
    with torch.no_grad():
        moved = layer.stacked_b()
    assert moved.dtype == torch.float32 and torch.equal(moved, torch.stack(list(layer.lora_B)))
    trained = layer.stacked_b()  # autograd on: a fresh differentiable stack
    assert trained.requires_grad and trained is not moved
    trained.sum().backward()
    assert torch.equal(layer.lora_B[2].grad, torch.ones(D_OUT, RANK))


# ---- the role-masked GEMM form ---------------------------------------------------------------------------------------
def test_role_mask_is_each_rows_one_hot():
    roles = torch.tensor([2, 0, 1, 2])
    mask = role_mask(roles, 4, torch.float64)
    assert mask.dtype == torch.float64
    assert torch.equal(mask, torch.eye(4, dtype=torch.float64)[[2, 0, 1, 2]])
    assert role_mask(torch.tensor([1], device="meta"), 3, torch.bfloat16).device.type == "meta"


def test_role_masked_puts_each_adapters_activations_in_its_roles_columns():
    r, k, n_roles = 3, 2, 4
    lr = torch.arange(2 * 5 * k * r, dtype=torch.float32).reshape(2, 5, k * r) + 1
    roles = torch.tensor([3, 1])
    out = role_masked(lr, role_mask(roles, n_roles, torch.float64), r)
    assert out.shape == (2, 5, k, n_roles * r) and out.dtype == torch.float32
    want = torch.zeros(2, 5, k, n_roles * r)
    for b, role in enumerate(roles.tolist()):
        for j in range(k):
            want[b, :, j, role * r : (role + 1) * r] = lr[b, :, j * r : (j + 1) * r]
    assert torch.equal(out, want)


def test_add_lora_masked_adds_each_rows_own_b_in_place_or_out_of_place():
    """``base + s · X·A · B_roleᵀ`` in base's dtype (B's cast once into a cached tensor): in place into a base that is
    a matrix view (also a column slice of a wider output), into a new tensor when the rows cannot be merged."""
    layer = _layer(True, dtype=torch.float32)
    x = torch.randn(2, 3, D_IN)
    roles = torch.tensor([2, 1])
    with torch.no_grad():
        lr = layer.lora_input(x, roles).double()  # (2, 3, r), float64 activations over float32 adapters
        masked = role_masked(lr, role_mask(roles, 3, torch.float64), RANK)[:, :, 0].float()
        want = torch.randn(2, 3, D_OUT, dtype=torch.float64)
        add = torch.stack([(ALPHA / RANK) * lr[b] @ layer.lora_B[r].double().t() for b, r in enumerate((2, 1))])
        base = want.clone()
        out = layer.add_lora_masked(base, masked)
        assert out is base and out.dtype == torch.float64
        assert (out - (want + add)).abs().max() < 1e-5
        wide = torch.randn(2, 3, 2 * D_OUT, dtype=torch.float64)
        before = wide.clone()
        sliced = layer.add_lora_masked(wide[..., :D_OUT], masked)
        assert (wide[..., :D_OUT] - (before[..., :D_OUT] + add)).abs().max() < 1e-5
        assert torch.equal(wide[..., D_OUT:], before[..., D_OUT:]) and sliced.shape == (2, 3, D_OUT)
        t_major = want.transpose(0, 1).contiguous().transpose(0, 1)  # (2, 3, d_out) whose rows cannot be merged
        kept = t_major.clone()
        new = layer.add_lora_masked(t_major, masked)
        assert new is not t_major and torch.equal(t_major, kept) and new.shape == (2, 3, D_OUT)
        assert (new - (want + add)).abs().max() < 1e-5
