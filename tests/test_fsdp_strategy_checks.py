"""``LoraFSDPStrategy``'s own checks and its adapter-only state, in one process (lit_modules/strategies.py): the
settings it refuses, the dtype rule of its root unit, its wrapping on a one-rank gloo group, parameter names without
FSDP's wrappers, and a checkpoint lacking adapter weights refused. The two-process FSDP fits are in
tests/test_multi_gpu.py."""

from __future__ import annotations

import pickle
import re
from pathlib import PurePosixPath

import pytest
import torch
from torch import nn

from datamodules import BYTE_VOCAB_SIZE
from lit_modules import MultiLoraModule
from lit_modules.strategies import FrozenLeafPolicy, LoraFSDPPrecision, LoraFSDPStrategy, clean_name, tied_parameter_ids


def test_the_wrappers_components_are_dropped_from_a_name_wherever_they_are() -> None:
    wrapped = "_fsdp_wrapped_module.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.lora_A.0"
    assert clean_name(wrapped) == "model.layers.0.mlp.lora_A.0"
    assert clean_name("model.layers.0.mlp.lora_A.0") == "model.layers.0.mlp.lora_A.0"


def test_settings_the_strategy_makes_itself_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="^LoraFSDPStrategy sets the auto_wrap_policy itself"):
        LoraFSDPStrategy(auto_wrap_policy={nn.Linear})
    with pytest.raises(ValueError, match="state_dict_type must be full, got 'sharded'$"):
        LoraFSDPStrategy(state_dict_type="sharded")
    assert LoraFSDPStrategy(state_dict_type="full") is not None


def test_a_root_unit_of_two_dtypes_is_refused_before_wrapping() -> None:
    """Tied embeddings in bf16 beside fp32 adapters cannot share FSDP's flat root unit: refused naming both, with
    what to run instead."""
    model = nn.Module()
    model.embed = nn.Embedding(8, 4).to(torch.bfloat16)
    model.head = nn.Linear(4, 8, bias=False).to(torch.bfloat16)
    model.head.weight = model.embed.weight  # tied: owned by two modules
    model.embed.weight.requires_grad_(False)
    model.adapter = nn.Linear(4, 4)  # trainable, fp32
    with pytest.raises(ValueError) as err:
        LoraFSDPStrategy()._setup_model(model)
    assert str(err.value) == (
        "FSDP: the tied embedding weights (bfloat16, float32) and the adapters must share one dtype in the root unit: "
        "train this model with DDP (configs/ddp.yaml) or with model.model_dtype float32"
    )


def _strategy_of_a_tiny_module(layers: int) -> tuple[MultiLoraModule, LoraFSDPStrategy]:
    """A tiny-llama training module (byte vocabulary, ``layers`` layers), built, and an FSDP strategy attached to it
    without a process group (what the strategy's state-dict hooks need)."""
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte",
                        model_overrides={"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": layers})  # fmt: skip
    m.configure_model()
    strategy = LoraFSDPStrategy()
    strategy._lightning_module = m
    return m, strategy


def test_a_checkpoint_lacking_adapter_weights_is_refused_and_a_whole_one_is_copied_in() -> None:
    m, strategy = _strategy_of_a_tiny_module(layers=2)
    state = strategy.lightning_module_state_dict()
    assert set(state) == m.adapter_state_keys()
    stored = {k: torch.full_like(v, 0.5) for k, v in state.items()}
    strategy.load_model_state_dict({"state_dict": stored})
    assert all(torch.equal(p, stored[k]) for k, p in strategy._adapter_params().items())
    drop = sorted(stored)[0]
    del stored[drop]
    with pytest.raises(ValueError, match=f"^checkpoint has no weights for 1 adapter tensors, e.g. {re.escape(drop)}$"):
        strategy.load_model_state_dict({"state_dict": stored})


def test_tied_parameters_are_those_two_modules_own() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(8, 4)
    model.head = nn.Linear(4, 8, bias=False)
    model.head.weight = model.embed.weight
    model.other = nn.Linear(4, 4)
    assert tied_parameter_ids(model) == {id(model.embed.weight)}
    assert tied_parameter_ids(nn.Linear(3, 3)) == set()


def test_frozen_leaf_policy_wraps_frozen_untied_owners_with_the_unit_settings() -> None:
    frozen = nn.Linear(4, 4).requires_grad_(False)
    trainable = nn.Linear(4, 4)
    half = nn.Linear(4, 4)
    half.weight.requires_grad_(False)  # its bias still trains
    tied = nn.Embedding(8, 4).requires_grad_(False)
    parent = nn.Sequential(frozen)  # owns no parameter itself
    policy = FrozenLeafPolicy({id(tied.weight)}, {"sharding_strategy": "FULL_SHARD"})
    assert policy(frozen) == {"sharding_strategy": "FULL_SHARD"}
    assert policy(trainable) is False and policy(half) is False and policy(tied) is False
    assert policy(parent) is False
    assert FrozenLeafPolicy(set())(frozen) is True  # no unit settings: plain wrap
    unit = {"a": 1}
    given = FrozenLeafPolicy(set(), unit)(frozen)
    assert given == unit and given is not unit  # each unit its own copy


def test_the_default_mixed_precision_casts_nothing_and_reduces_in_float32() -> None:
    mp = LoraFSDPStrategy().mixed_precision
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (None, torch.float32, None)
    from torch.distributed.fsdp import MixedPrecision

    mine = MixedPrecision(param_dtype=torch.bfloat16)
    assert LoraFSDPStrategy(mixed_precision=mine).mixed_precision is mine


def test_norm_clipping_of_the_replicated_adapters_is_torchs_global_norm() -> None:
    from lightning.pytorch.plugins.precision import FSDPPrecision

    strategy = LoraFSDPStrategy()
    strategy.precision_plugin = FSDPPrecision("32-true")
    plugin = strategy.precision_plugin
    assert isinstance(plugin, LoraFSDPPrecision)
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))
    p.grad, q.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)  # norm sqrt(27 + 64)
    opt = torch.optim.SGD([p, q], lr=0.1)
    plugin.clip_grad_by_norm(opt, 1.0)
    norm = (27 + 64) ** 0.5
    assert torch.allclose(p.grad, torch.full((3,), 3.0 / norm), atol=1e-6)
    assert torch.allclose(q.grad, torch.full((4,), 4.0 / norm), atol=1e-6)


def test_optimizer_state_is_the_plain_one_saved_loaded_and_read_back(tmp_path) -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.tensor([1.0, -2.0])
    opt.step()
    strategy = LoraFSDPStrategy(parallel_devices=[torch.device("cpu")])
    state = strategy.optimizer_state(LightningOptimizer(opt))
    assert state == opt.state_dict()
    assert torch.equal(strategy.optimizer_state(opt)["state"][0]["exp_avg"], opt.state[p]["exp_avg"])
    fresh_p = nn.Parameter(torch.ones(2))
    fresh = torch.optim.Adam([fresh_p], lr=0.5)
    strategy.optimizers = [fresh]
    strategy.load_optimizer_state_dict({"optimizer_states": [state]})
    assert fresh.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh.state[fresh_p]["exp_avg"], opt.state[p]["exp_avg"])
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.arange(3)}, "optimizer_states": [state], "note": "x"}, path)
    back = strategy.load_checkpoint(path)
    assert torch.equal(back["state_dict"]["w"], torch.arange(3)) and back["note"] == "x"
    back = strategy.load_checkpoint(str(path), weights_only=True)
    assert back["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1
    # by default a checkpoint's other Python objects load too (Lightning's own files hold some); weights_only refuses
    odd = tmp_path / "odd.ckpt"
    torch.save({"state_dict": {}, "where": PurePosixPath("runs/a")}, odd)
    assert strategy.load_checkpoint(odd)["where"] == PurePosixPath("runs/a")
    with pytest.raises(pickle.UnpicklingError):
        strategy.load_checkpoint(odd, weights_only=True)
    # one state per optimizer: a checkpoint of another optimizer count is refused
    strategy.optimizers = [fresh, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0)]
    with pytest.raises(ValueError, match="zip"):
        strategy.load_optimizer_state_dict({"optimizer_states": [state]})


def test_the_adapter_state_is_a_detached_cpu_copy_named_without_the_wrappers() -> None:
    m, strategy = _strategy_of_a_tiny_module(layers=1)
    params = strategy._adapter_params()
    assert set(params) == m.adapter_state_keys() and all(p.requires_grad for p in params.values())
    state = strategy.lightning_module_state_dict()
    for k, v in state.items():
        assert v.device.type == "cpu" and not v.requires_grad and torch.equal(v, params[k].detach())
        assert v.data_ptr() != params[k].data_ptr()  # a copy: a later step does not change the saved state


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_setup_model_makes_each_frozen_untied_leaf_a_unit_of_the_configured_sharding_and_keeps_the_rest_in_the_root(
    tmp_path, monkeypatch
) -> None:
    """A one-rank gloo group wraps for real: the frozen leaf is its own FSDP unit, the adapter and the tied
    embedding/head stay in the replicated (NO_SHARD) root, which gets the strategy's offload, mixed precision, extra
    FSDP arguments and activation checkpointing; the units ask for the configured sharding strategy (one rank turns it
    into NO_SHARD, so FSDP's arguments are read as given)."""
    import torch.distributed as dist
    import torch.distributed.fsdp as torch_fsdp
    from lightning.pytorch.strategies import fsdp as lightning_fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    given: list[dict] = []

    class Recorded(FullyShardedDataParallel):
        def __init__(self, **kwargs) -> None:
            given.append(kwargs)
            super().__init__(**kwargs)

    moved: list[tuple] = []
    monkeypatch.setattr(torch_fsdp, "FullyShardedDataParallel", Recorded)
    monkeypatch.setattr(
        lightning_fsdp, "_move_torchmetrics_to_device", lambda module, device: moved.append((module, device))
    )
    model = nn.Module()
    model.embed = nn.Embedding(8, 4)
    model.head = nn.Linear(4, 8, bias=False)
    model.head.weight = model.embed.weight  # tied: stays in the root
    model.embed.requires_grad_(False)
    model.base = nn.Linear(4, 4).requires_grad_(False)  # frozen, untied: its own unit
    model.adapter = nn.Linear(4, 2)  # trainable: the root
    strategy = LoraFSDPStrategy(
        parallel_devices=[torch.device("cpu")], cpu_offload=True, forward_prefetch=True,
        activation_checkpointing_policy={nn.Embedding},
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        wrapped = strategy._setup_model(model)
    finally:
        dist.destroy_process_group()
    units = {clean_name(n) for n, m in wrapped.named_modules() if isinstance(m, FullyShardedDataParallel)}
    assert units == {"", "base"}
    assert isinstance(wrapped, Recorded) and len(given) == 1 and given[0]["module"] is model
    root = given[0]
    assert root["sharding_strategy"] is ShardingStrategy.NO_SHARD
    assert root["cpu_offload"] is strategy.cpu_offload and wrapped.cpu_offload.offload_params
    assert root["mixed_precision"] is strategy.mixed_precision_config
    assert wrapped.mixed_precision.reduce_dtype is torch.float32
    assert root["device_id"] == torch.device("cpu") and root["forward_prefetch"] is True and wrapped.forward_prefetch
    policy = root["auto_wrap_policy"]._lambda_fn  # the FrozenLeafPolicy behind torch's CustomPolicy
    assert policy.tied == {id(model.embed.weight)}
    assert policy.unit_kwargs == {"sharding_strategy": strategy.sharding_strategy}
    assert strategy.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert moved == [(wrapped, torch.device("cpu"))]
    names = [n for n, _ in wrapped.named_parameters()]
    assert "_fsdp_wrapped_module.embed._checkpoint_wrapped_module.weight" in names  # activation checkpointing applied
    assert sorted(clean_name(n) for n in names) == ["adapter.bias", "adapter.weight", "base.bias", "base.weight",
                                                     "embed.weight"]  # fmt: skip


def test_the_adapter_state_is_asked_as_a_cpu_copy_wherever_the_adapters_live() -> None:
    """Adapters on a GPU are saved as CPU copies (a stand-in tensor records where its detached copy goes)."""

    class OnAnotherDevice:
        def __init__(self) -> None:
            self.sent: list = []

        def detach(self) -> OnAnotherDevice:
            return self

        def to(self, *args, **kwargs) -> str:
            self.sent.append((args, kwargs))
            return "cpu copy"

    strategy = LoraFSDPStrategy()
    adapter = OnAnotherDevice()
    strategy._adapter_params = lambda: {"layers.0.lora_A": adapter}
    assert strategy.lightning_module_state_dict() == {"layers.0.lora_A": "cpu copy"}
    assert adapter.sent == [(("cpu",), {"copy": True})]


def test_a_checkpoint_written_on_a_gpu_loads_onto_the_cpu(tmp_path, monkeypatch) -> None:
    """Tensors a GPU run saved (storages tagged ``cuda:0``) load onto the CPU, whatever devices this host has."""
    import torch.serialization

    path = tmp_path / "gpu.ckpt"
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"state_dict": {"w": torch.arange(3.0)}}, path)
    strategy = LoraFSDPStrategy()
    for weights_only in (None, True):
        back = strategy.load_checkpoint(path, weights_only=weights_only)["state_dict"]["w"]
        assert back.device.type == "cpu" and torch.equal(back, torch.arange(3.0))


def test_a_loaded_optimizer_state_moves_to_the_strategys_device() -> None:
    """The loaded moments go to the root device (``meta`` standing in for a GPU); Adam's step count stays put."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(2)
    opt.step()
    strategy = LoraFSDPStrategy(parallel_devices=[torch.device("meta")])
    fresh = torch.optim.Adam([nn.Parameter(torch.ones(2))], lr=0.5)
    strategy.optimizers = [fresh]
    strategy.load_optimizer_state_dict({"optimizer_states": [opt.state_dict()]})
    (state,) = fresh.state.values()
    assert {k: v.device.type for k, v in state.items()} == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}
