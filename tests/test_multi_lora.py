"""The shared-A multi-LoRA layer, injection and the role router."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_multi_lora
from torch import nn

from lragent.multi_lora import MultiLoraConfig, MultiLoraLinear
from lragent.roles import RoleRouter


def _layer(shared_a: bool) -> MultiLoraLinear:
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(12, 10, bias=True), n_roles=3, rank=4, alpha=8.0, shared_a=shared_a)
    with torch.no_grad():
        for b in layer.lora_B:
            b.normal_()
    return layer


@pytest.mark.parametrize("shared_a", [True, False])
def test_mixed_batch_equals_each_role_alone(shared_a):
    layer = _layer(shared_a)
    x = torch.randn(6, 5, 12)
    roles = torch.tensor([0, 2, 1, 1, 0, 2])
    mixed = layer(x, roles)
    for i, r in enumerate(roles.tolist()):
        alone = layer(x[i : i + 1], torch.tensor([r]))
        ref = x[i : i + 1] @ layer.merged_weight(r).t() + layer.base.bias
        torch.testing.assert_close(mixed[i : i + 1], alone, rtol=0, atol=1e-6)
        torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)
    # roles really differ (B != 0)
    assert not torch.allclose(layer(x[:1], torch.tensor([0])), layer(x[:1], torch.tensor([1])))


def test_parts_recompose_forward():
    layer = _layer(True)
    x = torch.randn(2, 7, 12)
    roles = torch.tensor([1, 2])
    base, lr = layer.forward_parts(x, roles)
    assert lr.shape == (2, 7, 4)
    torch.testing.assert_close(base + layer.lora_output(lr, roles), layer(x, roles))
    torch.testing.assert_close(base, layer.base(x))


def test_shared_a_has_one_a_and_role_b():
    assert len(_layer(True).lora_A) == 1 and len(_layer(True).lora_B) == 3
    assert len(_layer(False).lora_A) == 3


def test_fresh_adapter_is_identity():
    layer = MultiLoraLinear(nn.Linear(8, 8), n_roles=2, rank=2, alpha=4)
    x = torch.randn(1, 3, 8)
    torch.testing.assert_close(layer(x, torch.tensor([1])), layer.base(x))


def test_role_ids_required_and_checked():
    layer = _layer(True)
    with pytest.raises(ValueError, match="role_ids is required"):
        layer(torch.randn(1, 2, 12))
    with pytest.raises(ValueError, match="one id per sequence"):
        layer(torch.randn(2, 2, 12), torch.tensor([0]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 0}, "rank must be a positive integer, got 0"),
        ({"rank": -3}, "rank must be a positive integer, got -3"),
        ({"alpha": 0}, "alpha must be > 0"),
        ({"dropout": 1.0}, "dropout must be in"),
        ({"targets": ("q_proj", "nope")}, "'nope'"),
        ({"roles": ("plan", "plan")}, "distinct"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiLoraConfig(**kwargs)


def test_router():
    router = RoleRouter(("plan", "action", "reflect"))
    assert router.ids(["reflect", "plan"]).tolist() == [2, 0]
    assert router.name(1) == "action"
    with pytest.raises(ValueError, match="unknown role 'critic': allowed plan, action, reflect"):
        router.id("critic")
    with pytest.raises(ValueError, match="out of range"):
        router.id(3)


def test_injection_targets_and_groups():
    model = tiny_multi_lora(targets=("q_proj", "v_proj", "down_proj"))
    names = model.lora_modules()
    assert len(names) == 3 * model.n_layers
    assert all(n.rsplit(".", 1)[1] in ("q_proj", "v_proj", "down_proj") for n in names)
    groups = model.lora_parameter_groups()
    assert set(groups) == {"shared_a", "plan", "action", "reflect"}
    assert len(groups["shared_a"]) == len(names) and len(groups["plan"]) == len(names)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in model.lora_parameters()}
    indep = tiny_multi_lora(shared_a=False)
    assert set(indep.lora_parameter_groups()) == {"plan", "action", "reflect"}


def test_missing_target_is_refused():
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model

    hf, _ = load_model("tiny-llama")
    hf.model.layers[0].self_attn.q_proj = nn.Identity()
    for layer in hf.model.layers:
        layer.self_attn.q_proj = nn.Identity()
    with pytest.raises(ValueError, match=r"target modules \['q_proj'\] not found"):
        MultiLoraModel(hf, MultiLoraConfig())


@pytest.mark.parametrize("shared_a", [True, False])
def test_forward_equals_hand_written_lora_formula(shared_a):
    """``x W0ᵀ + b + (alpha / r) (x A_roleᵀ) B_roleᵀ`` computed from the config's alpha and rank, not from the
    layer's own ``scaling`` (a wrong scaling would also be in the layer's merged weight, so that check is blind)."""
    layer = _layer(shared_a)
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    layer = layer.double()
    for role in range(3):
        a = layer.lora_A[0 if shared_a else role]
        want = x @ layer.base.weight.t() + layer.base.bias + (8.0 / 4) * (x @ a.t()) @ layer.lora_B[role].t()
        got = layer(x, torch.tensor([role, role]))
        assert (got - want).abs().max() < 1e-12


def test_tiny_model_equals_peft_lora(tmp_path):
    """The whole injected model against PEFT's own LoRA implementation of each exported role (tiny, fp32)."""
    from peft import PeftModel

    from lragent.adapters_io import export_peft

    model = tiny_multi_lora("tiny-llama", rank=4, b_std=0.3)
    paths = export_peft(model, tmp_path)
    ids = torch.randint(0, 256, (1, 11))
    for role in ("plan", "action", "reflect"):
        base = tiny_multi_lora("tiny-llama", rank=4, b_std=0.0)  # same base weights (seeded), no adapters
        plain = base.merged_model(role)  # B = 0: the plain base model
        peft_model = PeftModel.from_pretrained(plain, str(paths[role])).eval()
        want = peft_model(ids).logits
        got = model(ids, [role])
        assert (got - want).abs().max() <= 1e-5, role


@pytest.mark.parametrize(
    "roles, match",
    [
        ((), "at least one role is needed, got an empty list"),
        (("plan", " "), r"role names must be non-empty strings, got \[' '\]"),
        (("plan", 3), r"role names must be non-empty strings, got \[3\]"),
        (("plan", "act", "plan"), r"role names must be distinct, got \['plan', 'act', 'plan'\]"),
    ],
)
def test_router_refuses_bad_role_lists(roles, match):
    with pytest.raises(ValueError, match=match):
        RoleRouter(roles)


def test_config_refuses_no_roles():
    with pytest.raises(ValueError, match="roles: at least one role is needed, got an empty list"):
        MultiLoraConfig(roles=())


def test_model_role_ids_checked_and_init_mode_named():
    model = tiny_multi_lora()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"role_ids is required: the model has roles \['plan', 'action', 'reflect'\]"):
        model(ids)
    with pytest.raises(ValueError, match=r"role_ids must have shape \(1,\), got \(2,\)"):
        model(ids, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"role_ids out of range: allowed 0..2, got \[3\]"):
        model(ids, torch.tensor([3]))
    with pytest.raises(ValueError, match=r"role_ids out of range: allowed 0..2, got \[-1\]"):
        model(ids, torch.tensor([-1]))
    with pytest.raises(ValueError, match="adapter init 'gaussian' not supported: allowed zero, random"):
        model.init_adapters("gaussian")
    one = tiny_multi_lora(roles=("plan",))
    assert one(ids).shape[:2] == (1, 3)  # a single role needs no role_ids


@pytest.mark.parametrize("forward", ["shared_context_forward", "shared_sequence_forward"])
def test_shared_forwards_refuse_a_scheme_that_reprocesses_the_context(forward):
    model = tiny_multi_lora()
    ids = torch.tensor([[5, 6, 7, 8]])
    args = (
        (ids, torch.ones_like(ids), ids, torch.ones_like(ids), [0], [1])
        if forward == "shared_context_forward"
        else (ids, torch.tensor([2]), [0], [1])
    )
    with pytest.raises(ValueError, match="non_shared makes the consumer re-process the context"):
        getattr(model, forward)(*args, scheme="non_shared")


def test_router_accepts_every_id_from_zero_to_last_and_names_the_allowed_range_when_out_of_it():
    router = RoleRouter(("plan", "action", "reflect"))
    assert [router.id(i) for i in range(3)] == [0, 1, 2]
    assert router.name(0) == "plan"
    for bad in (3, -1):
        with pytest.raises(ValueError) as err:
            router.id(bad)
        assert str(err.value) == f"role id {bad} is out of range: allowed 0..2"


def test_router_refuses_an_empty_role_list_with_the_whole_message():
    with pytest.raises(ValueError) as err:
        RoleRouter([])
    assert str(err.value) == "roles: at least one role is needed, got an empty list"


def test_router_ids_are_int64_on_the_requested_device_even_for_an_empty_batch():
    """``ids`` is documented as an int64 ``(B,)`` tensor on ``device``: also for B = 0 (torch.tensor([]) is float)."""
    router = RoleRouter(("plan", "action"))
    empty = router.ids([])
    assert empty.dtype == torch.long and empty.shape == (0,)
    on_meta = router.ids(["action", 0], device="meta")
    assert on_meta.device.type == "meta" and on_meta.dtype == torch.long and on_meta.shape == (2,)
    assert router.ids(["action", 0], device="cpu").tolist() == [1, 0]


def test_router_membership_length_and_repr_follow_the_role_names():
    router = RoleRouter(("plan", "reflect"))
    assert "plan" in router and "reflect" in router
    assert "action" not in router and 0 not in router
    assert len(router) == 2
    assert repr(router) == "RoleRouter(['plan', 'reflect'])"
