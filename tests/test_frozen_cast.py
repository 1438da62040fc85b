"""A mixed-precision fit stores its frozen linear weights in autocast's dtype (lragent/frozen_cast.py): the same
adapters and losses bit for bit as with float32 weights that autocast casts at every call, seven casts a layer fewer
in each forward, a tied LM head left alone, and only where autocast would cast (not under 32-true or FSDP, not a
low-precision base, not with the switch at 0)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from test_training_recipe import data, module, trainer
from torch.utils._python_dispatch import TorchDispatchMode

from lragent.frozen_cast import SWITCH_ENV, cast_frozen_linears, frozen_cast_dtype, frozen_cast_switch


class _Count(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _tiny(tied: bool = False, arch: str = "tiny-llama"):
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model(arch, seed=0, overrides={"tie_word_embeddings": tied} if tied else None)
    m = MultiLoraModel(hf, MultiLoraConfig(roles=("a", "b", "c"), rank=4, dropout=0.0, targets=("q_proj", "v_proj")))
    m.init_adapters("random", seed=1, b_std=0.3)
    return m.train()


def _step(m, ids: torch.Tensor, roles: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], collections.Counter]:
    """One forward and backward under bf16 autocast on the model's device: the logits, the adapters' gradients and the
    forward's ops."""
    for p in m.lora_parameters():
        p.grad = None
    count = _Count()
    ids, roles = ids.to(m.model.device), roles.to(m.model.device)
    with torch.autocast(m.model.device.type, dtype=torch.bfloat16):
        with count:
            logits = m(ids, roles)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward()
    return logits.detach(), [p.grad.clone() for p in m.lora_parameters()], count.ops


@pytest.mark.parametrize(("tied", "arch"), [(False, "tiny-llama"), (True, "tiny-llama"), (False, "tiny-qwen2")])
def test_cast_weights_give_autocasts_numbers_with_seven_casts_a_layer_fewer(tied: bool, arch: str) -> None:
    """The logits and every adapter gradient equal bit for bit; the forward makes 7 × layers fewer ``_to_copy``
    (q, k, v, o, gate, up, down), one more where the LM head is its own (untied) weight, and Qwen2's q/k/v biases
    cast with their weights (autocast casts a bias too) fewer again; a tied head stays float32."""
    _check_cast_step(tied, arch, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(("tied", "arch"), [(False, "tiny-llama"), (True, "tiny-llama"), (False, "tiny-qwen2")])
def test_cast_weights_give_autocasts_numbers_on_a_gpu(tied: bool, arch: str) -> None:
    """The same on CUDA, where a fit's forward takes the GPU paths (the fused projections, the training norm and
    attention kernels): bit for bit too."""
    _check_cast_step(tied, arch, "cuda")


def _check_cast_step(tied: bool, arch: str, device: str) -> None:
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    roles = torch.tensor([0, 2, 1])
    m = _tiny(tied, arch).to(device)
    want_logits, want_grads, before = _step(m, ids, roles)
    n = cast_frozen_linears(m.model, torch.bfloat16)
    layers = m.model.config.num_hidden_layers
    assert n == 7 * layers + (0 if tied else 1)
    got_logits, got_grads, after = _step(m, ids, roles)
    assert torch.equal(got_logits, want_logits)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    biases = sum(mod.bias is not None for mod in m.model.modules() if isinstance(mod, torch.nn.Linear))
    assert biases == (3 * layers if arch == "tiny-qwen2" else 0)
    assert before["_to_copy"] - after["_to_copy"] == n + biases, (before["_to_copy"], after["_to_copy"])
    inner = m.model.model
    assert inner.layers[0].self_attn.q_proj.base.weight.dtype == torch.bfloat16
    assert inner.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert inner.embed_tokens.weight.dtype == inner.norm.weight.dtype == torch.float32
    assert m.model.lm_head.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in m.lora_parameters())


def test_only_where_autocast_would_cast() -> None:
    """bf16-mixed and 16-mixed with a float32 base; not 32-true, a bfloat16 base, an FSDP strategy or the switch at 0;
    a bad switch value named."""
    f32 = torch.float32
    assert frozen_cast_dtype("bf16-mixed", "DDPStrategy", f32, {}) == torch.bfloat16
    assert frozen_cast_dtype("16-mixed", "SingleDeviceStrategy", f32, {}) == torch.float16
    assert frozen_cast_dtype("32-true", "SingleDeviceStrategy", f32, {}) is None
    assert frozen_cast_dtype("bf16-true", "SingleDeviceStrategy", f32, {}) is None
    assert frozen_cast_dtype("bf16-mixed", "SingleDeviceStrategy", torch.bfloat16, {}) is None
    assert frozen_cast_dtype("bf16-mixed", "LoraFSDPStrategy", f32, {}) is None
    assert frozen_cast_dtype("bf16-mixed", "DDPStrategy", f32, {SWITCH_ENV: "0"}) is None
    assert frozen_cast_switch({SWITCH_ENV: " "}) is True
    for bad in ("2", "off"):
        with pytest.raises(ValueError, match=rf"{SWITCH_ENV}='{bad}': allowed 0 .* or 1"):
            frozen_cast_switch({SWITCH_ENV: bad})


def test_only_frozen_linears_not_yet_in_the_dtype_are_cast_and_counted() -> None:
    """A trainable linear (weight or bias alone requiring grad) stays float32; a frozen one already in the dtype is
    left and not counted; every other frozen linear, wherever it comes, is cast (weight and bias, the same parameter
    objects); a linear tied to an embedding stays as it is."""
    lin = torch.nn.Linear
    already, trainable, bias_trained, frozen = lin(4, 4), lin(4, 4), lin(4, 4), lin(4, 3)
    no_bias = lin(3, 4, bias=False)
    embed, tied = torch.nn.Embedding(5, 4), lin(4, 5, bias=False)
    tied.weight = embed.weight
    model = torch.nn.Sequential(already, trainable, bias_trained, frozen, no_bias, embed, tied)
    for m in (already, frozen, no_bias, tied):
        m.requires_grad_(False)
    bias_trained.weight.requires_grad_(False)
    already.to(torch.bfloat16)
    params = [frozen.weight, frozen.bias, no_bias.weight]
    values = [p.detach().clone() for p in params]
    assert cast_frozen_linears(model, torch.bfloat16) == 2
    now = [frozen.weight, frozen.bias, no_bias.weight]
    assert all(a is p for a, p in zip(now, params, strict=True))  # the same objects, now in bfloat16
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, v.to(p.dtype)) for p, v in zip(params, values, strict=True))
    assert already.weight.dtype == torch.bfloat16
    for m in (trainable, bias_trained):
        assert m.weight.dtype == m.bias.dtype == torch.float32
    assert tied.weight.dtype == embed.weight.dtype == torch.float32
    assert cast_frozen_linears(model, torch.bfloat16) == 0  # a second pass: nothing left to cast


def _fit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    switch: str,
    precision: str,
    accelerator: str = "cpu",
    run: str = "",
    dropout: float = 0.0,
    **model: object,
) -> tuple[list, dict, object]:
    monkeypatch.setenv(SWITCH_ENV, switch)
    torch.manual_seed(0)
    m = module(val_schemes=None, dropout=dropout, **model)  # validation through both shared-cache schemes too
    t = trainer(tmp_path / switch / precision / run, [], max_epochs=1, max_steps=3, precision=precision,
                limit_val_batches=2, accelerator=accelerator)  # fmt: skip
    t.fit(m, datamodule=data(tmp_path))
    metrics = {k: v.clone() for k, v in t.callback_metrics.items()}
    return [p.detach().clone() for p in m.lora_model.lora_parameters()], metrics, m


def test_a_bf16_mixed_fit_trains_the_same_adapters_with_the_weights_cast(tmp_path: Path, monkeypatch) -> None:
    """Three optimizer steps and a validation through the plain and both shared-cache paths, CPU bf16-mixed: the
    adapters, the train loss and every validation metric equal bit for bit with the switch on and off; on, the base
    projections are bfloat16 during the fit; a 32-true fit keeps them float32."""
    on, m_on, mod_on = _fit(tmp_path, monkeypatch, "1", "bf16-mixed")
    off, m_off, mod_off = _fit(tmp_path, monkeypatch, "0", "bf16-mixed")
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    assert m_on.keys() == m_off.keys() and any(k.startswith("val") for k in m_on), sorted(m_on)
    assert all(torch.equal(m_on[k], m_off[k]) for k in m_on), {k: (m_on[k], m_off[k]) for k in m_on}
    layer = mod_on.lora_model.model.model.layers[0]
    assert layer.self_attn.q_proj.base.weight.dtype == layer.self_attn.k_proj.weight.dtype == torch.bfloat16
    assert mod_off.lora_model.model.model.layers[0].self_attn.k_proj.weight.dtype == torch.float32
    _, _, mod_32 = _fit(tmp_path, monkeypatch, "1", "32-true")
    assert mod_32.lora_model.model.model.layers[0].self_attn.k_proj.weight.dtype == torch.float32


def _gpu_fits_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **fit: object) -> object:
    """Three bf16-mixed GPU fits (switch on, off, off again): the adapters and every metric of on and off bit for bit
    (the message says whether off and off again were, to tell the GPU's nondeterminism from the cast). Returns the
    module fitted with the switch on."""
    on, m_on, mod_on = _fit(tmp_path, monkeypatch, "1", "bf16-mixed", "gpu", **fit)
    off, m_off, _ = _fit(tmp_path, monkeypatch, "0", "bf16-mixed", "gpu", **fit)
    again, m_again, _ = _fit(tmp_path, monkeypatch, "0", "bf16-mixed", "gpu", run="again", **fit)
    deterministic = all(torch.equal(a, b) for a, b in zip(off, again, strict=True))
    same = [torch.equal(a, b) for a, b in zip(on, off, strict=True)]
    diffs = {
        k: (m_on[k].item(), m_off[k].item(), m_again[k].item()) for k in m_on if not torch.equal(m_on[k], m_off[k])
    }
    assert all(same) and not diffs, f"off twice bit-identical: {deterministic}; on vs off: {same}, {diffs}"
    return mod_on


@pytest.mark.gpu
@pytest.mark.parametrize("dropout", [0.0, 0.05])  # 0.05: the embedded configs' LoRA dropout
def test_a_bf16_mixed_fit_on_a_gpu_trains_the_same_adapters_with_the_weights_cast(
    tmp_path: Path, monkeypatch, dropout: float
) -> None:
    """The CPU fit above on one GPU: adapters, train loss and every validation metric bit for bit with the switch on
    and off (a one-GPU fit of the embedded model differed by up to 0.003 in val loss between the two on 2026-11-29:
    nondeterminism or the cast, which this pins apart)."""
    mod_on = _gpu_fits_agree(tmp_path, monkeypatch, dropout=dropout)
    assert mod_on.lora_model.model.model.layers[0].self_attn.k_proj.weight.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.model
def test_the_embedded_model_fit_on_a_gpu_is_the_same_with_the_weights_cast(
    tmp_path: Path, monkeypatch, load_embedded
) -> None:
    """The GPU fit above with the embedded SmolLM2-135M's real weights and shapes (byte tokens) and its configs' LoRA
    dropout: on one H200 (2026-11-29) two 4-epoch fits of that model differed by up to 0.0029 in val loss with the
    switch on and off, where fits of one setting differed by at most 0.0008. Bit for bit here, or the cast changes
    the numbers on a GPU; the off fit twice tells the GPU's own nondeterminism apart."""
    _gpu_fits_agree(tmp_path, monkeypatch, dropout=0.05, model_name="default", model_overrides=None)
