"""lragent.train_norm: transformers' RMSNorm through PyTorch's fused ``F.rms_norm`` in training on a GPU. The same
values and gradients as transformers' module to float rounding, for every dtype pairing of input and weight; taken
only where autograd records on CUDA (GPU test: the kernel dispatched, the switch honoured)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lragent.train_norm import fused_rms_norm_wanted, rms_norm_like

PAIRS = [  # (input dtype, weight dtype): the float32 base under autocast, a bfloat16 base, and the mixed ones
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
]


def _norm(hidden: int, dtype: torch.dtype, eps: float = 1e-5, device: str = "cpu") -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, hidden))
    return norm


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # one rounding of the output dtype apart: the sum of squares may be reduced in another order
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}


def _compare(in_dtype: torch.dtype, w_dtype: torch.dtype, scale: float, device: str = "cpu") -> None:
    norm = _norm(64, w_dtype, device=device)
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * scale).to(device=device, dtype=in_dtype)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, new = norm(x_ref), rms_norm_like(norm, x_new, fused=True)
    assert new.dtype == ref.dtype and new.shape == ref.shape
    out_dtype = torch.promote_types(in_dtype, w_dtype)
    tol = _tolerance(torch.bfloat16 if torch.bfloat16 in (in_dtype, w_dtype) else out_dtype)
    torch.testing.assert_close(new, ref, **tol)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=ref.dtype)
    ref.backward(grad)
    new.backward(grad)
    torch.testing.assert_close(x_new.grad, x_ref.grad, **tol)


@pytest.mark.parametrize(("in_dtype", "w_dtype"), PAIRS)
def test_the_fused_formula_equals_transformers_rmsnorm_values_and_gradients(in_dtype, w_dtype) -> None:
    """Output dtype, values and input gradients as transformers' LlamaRMSNorm, for every dtype pairing."""
    _compare(in_dtype, w_dtype, scale=1.0)


def test_eps_counts_where_the_activations_are_tiny() -> None:
    """Activations of order 1e-3 (mean square 1e-6 against eps 1e-5): eps decides the scale, so a formula that drops
    it or applies it outside the root is off by far more than rounding."""
    _compare(torch.float32, torch.float32, scale=1e-3)


def test_the_fused_path_is_taken_only_where_autograd_records_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_rms_norm_wanted``: a CUDA tensor with autograd on (training), not inference, not the CPU (whose
    references stay transformers' module), not with ``LRAGENT_FUSED_RMS_NORM=0``."""
    cuda_like = SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("LRAGENT_FUSED_RMS_NORM", raising=False)
    assert fused_rms_norm_wanted(cuda_like)
    with torch.no_grad():
        assert not fused_rms_norm_wanted(cuda_like)
    assert not fused_rms_norm_wanted(SimpleNamespace(is_cuda=False))
    monkeypatch.setenv("LRAGENT_FUSED_RMS_NORM", "0")
    assert not fused_rms_norm_wanted(cuda_like)


def test_a_cpu_forward_calls_transformers_module() -> None:
    """On the CPU the module itself runs (bit for bit), autograd on or off."""
    norm = _norm(32, torch.float32)
    x = torch.randn(2, 4, 32, requires_grad=True)
    assert torch.equal(rms_norm_like(norm, x), norm(x))


def test_a_module_without_rmsnorm_attributes_is_called_as_it_is() -> None:
    """Anything but an RMSNorm (no ``variance_epsilon``) is called, even when the fused formula is forced."""
    layer_norm = torch.nn.LayerNorm(16)
    x = torch.randn(2, 16)
    assert torch.equal(rms_norm_like(layer_norm, x, fused=True), layer_norm(x))


@pytest.mark.gpu
def test_a_gpu_training_forward_runs_the_fused_rmsnorm_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a training forward + backward of the decoder dispatches ``aten::_fused_rms_norm`` for every norm (two
    a layer and the final one) and gives the loss and adapter gradients of transformers' module (the switch
    ``LRAGENT_FUSED_RMS_NORM=0``, which dispatches none) to bfloat16 rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lit_modules import MultiLoraModule

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ == "_fused_rms_norm"
            return func(*args, **(kwargs or {}))

    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", dropout=0.0, val_schemes=[],
                        model_overrides={"vocab_size": 258, "num_hidden_layers": 2})  # fmt: skip
    m.configure_model()
    m = m.cuda()
    for p in m.lora_model.lora_parameters():  # non-zero B: the adapters' gradients depend on every norm
        torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    roles = torch.tensor([0, 2]).cuda()
    index = torch.arange(10, 80).cuda()

    def run(switch: str) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        monkeypatch.setenv("LRAGENT_FUSED_RMS_NORM", switch)
        m.zero_grad(set_to_none=True)
        count = Count()
        with torch.autocast("cuda", dtype=torch.bfloat16), count:
            logits = m(ids, roles, None, output_index=index)
            loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.lora_model.lora_parameters()], count.n

    loss_fused, grads_fused, n_fused = run("1")
    loss_ref, grads_ref, n_ref = run("0")
    n_layers = 2
    assert n_fused == 2 * n_layers + 1 and n_ref == 0, (n_fused, n_ref)
    torch.testing.assert_close(loss_fused, loss_ref, atol=2e-2, rtol=1e-2)
    for g, r in zip(grads_fused, grads_ref, strict=True):
        torch.testing.assert_close(g, r, atol=2e-2 * r.abs().max().item() + 1e-6, rtol=5e-2)


class _Marked(torch.nn.Module):
    """RMSNorm-shaped (``weight``, ``variance_epsilon``) but its own forward returns a mark: which path ran shows."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden).to(dtype))
        self.variance_epsilon = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.full_like(h, -7.0)


def _formula(norm: _Marked, h: torch.Tensor) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) in float32, cast back to the input's dtype, times the weight."""
    x = h.float()
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(h.dtype)


@pytest.mark.parametrize(("in_dtype", "w_dtype"), PAIRS)
def test_the_fused_formula_reads_the_modules_weight_and_eps_and_never_calls_it(in_dtype, w_dtype) -> None:
    """Forced (or wanted): the formula with the module's own ``weight`` and ``variance_epsilon`` on a (B, T, hidden)
    input, without calling the module; not forced: the module, whatever attributes it has."""
    norm = _Marked(16, eps=0.25, dtype=w_dtype)
    h = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(4)).to(in_dtype)
    out = rms_norm_like(norm, h, fused=True)
    tol = _tolerance(torch.float32 if in_dtype == w_dtype == torch.float32 else torch.bfloat16)
    assert out.dtype == torch.promote_types(in_dtype, w_dtype) and out.shape == h.shape
    torch.testing.assert_close(out, _formula(norm, h), **tol)
    assert torch.equal(rms_norm_like(norm, h, fused=False), torch.full_like(h, -7.0))


def test_unforced_the_path_is_the_one_fused_rms_norm_wanted_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused=None`` defers to :func:`fused_rms_norm_wanted` (here answering for a CUDA training step, and against)."""
    import lragent.train_norm as train_norm

    norm, h = _Marked(8, eps=1e-5), torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(train_norm, "fused_rms_norm_wanted", lambda x: x is h)
    torch.testing.assert_close(rms_norm_like(norm, h), _formula(norm, h), atol=1e-6, rtol=1e-6)
    other = h.clone()
    assert torch.equal(rms_norm_like(norm, other), torch.full_like(other, -7.0))


def test_a_weight_of_another_width_or_a_missing_attribute_calls_the_module() -> None:
    """The formula only where the weight is (hidden,) of the input's last dimension and both attributes exist."""
    h = torch.randn(2, 5, 8)
    assert torch.equal(rms_norm_like(_Marked(5, eps=1e-5), h, fused=True), torch.full_like(h, -7.0))  # (5,): T
    assert torch.equal(rms_norm_like(_Marked(40, eps=1e-5), h, fused=True), torch.full_like(h, -7.0))  # T · hidden
    no_eps = _Marked(8, eps=1e-5)
    del no_eps.variance_epsilon
    assert torch.equal(rms_norm_like(no_eps, h, fused=True), torch.full_like(h, -7.0))
    no_weight = _Marked(8, eps=1e-5)
    no_weight.weight = None
    assert torch.equal(rms_norm_like(no_weight, h, fused=True), torch.full_like(h, -7.0))
    for weightless in (torch.nn.GELU(), torch.nn.Identity()):  # no weight attribute at all
        assert torch.equal(rms_norm_like(weightless, h, fused=True), weightless(h))
        assert torch.equal(rms_norm_like(weightless, h), weightless(h))


@pytest.mark.parametrize(("in_dtype", "w_dtype"), PAIRS)
def test_eps_counts_for_every_dtype_pairing(in_dtype, w_dtype) -> None:
    """Tiny activations (mean square 1e-6 against eps 1e-5) for every pairing: the formula's eps is the module's."""
    _compare(in_dtype, w_dtype, scale=1e-3)


@pytest.mark.parametrize(("in_dtype", "w_dtype"), PAIRS)
def test_the_weight_goes_into_the_kernel_only_where_it_can_fuse(in_dtype, w_dtype, monkeypatch) -> None:
    """One launch where input and weight are float32 (the weight handed to ``F.rms_norm``); any other pairing
    normalizes the float32 input without a weight (a weight of another dtype than the input cannot take the fused
    kernel) and multiplies after."""
    calls = []
    real = torch.nn.functional.rms_norm

    def spy(x, shape, weight=None, eps=None):
        calls.append((x.dtype, weight, eps))
        return real(x, shape, weight, eps)

    monkeypatch.setattr(torch.nn.functional, "rms_norm", spy)
    norm = _Marked(16, eps=0.125, dtype=w_dtype)
    rms_norm_like(norm, torch.randn(3, 16).to(in_dtype), fused=True)
    [(x_dtype, weight, eps)] = calls
    assert x_dtype == torch.float32 and eps == 0.125
    assert weight is (norm.weight if in_dtype == w_dtype == torch.float32 else None)
