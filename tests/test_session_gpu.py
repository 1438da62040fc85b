"""The runtime on CUDA (embedded model, bf16): CUDA-graph decoding and the fused kernels change no greedy token."""

from __future__ import annotations

import pytest
import torch

from lragent.lora_model import MultiLoraModel
from lragent.multi_lora import MultiLoraConfig
from lragent.session import MultiAgentSession

pytestmark = [pytest.mark.gpu, pytest.mark.model]


@pytest.fixture(scope="module")
def cuda_model():
    from lragent.models import load_model

    hf, tok = load_model("default", dtype=torch.bfloat16, device="cuda")
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0))
    model.init_adapters("random", seed=0, b_std=0.02)
    return model.eval(), tok


def _run(model, tok, scheme, use_kernel, cuda_graphs=None):
    from eval_suite.session_runner import _load_question, build_schedule

    session = MultiAgentSession(
        model, scheme, tokenizer=tok, use_kernel=use_kernel, eos_token_ids=[], cuda_graphs=cuda_graphs
    )
    out = []
    for role, text in build_schedule("agent", _load_question(0)):
        session.append_text(text)
        out.append(session.step(role, max_new_tokens=24).generated_ids)
    return out


@pytest.mark.parametrize("scheme", ["base_lr_shared", "base_shared"])
def test_kernel_on_off_same_greedy_tokens(cuda_model, scheme):
    model, tok = cuda_model
    on = _run(model, tok, scheme, use_kernel=True)
    off = _run(model, tok, scheme, use_kernel=False)
    n = sum(len(x) for x in on)
    same = sum(a == b for x, y in zip(on, off, strict=True) for a, b in zip(x, y, strict=False))
    print(f"{scheme}: {same}/{n} greedy tokens identical with the kernel on and off")
    assert on == off


@pytest.mark.parametrize("scheme", ["non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared"])
def test_graph_and_eager_decoding_same_greedy_tokens(cuda_model, scheme):
    """The 17-step agent schedule decoded by CUDA-graph replay and eagerly: identical greedy tokens."""
    model, tok = cuda_model
    graph = _run(model, tok, scheme, use_kernel=True, cuda_graphs=True)
    eager = _run(model, tok, scheme, use_kernel=True, cuda_graphs=False)
    n = sum(len(x) for x in graph)
    same = sum(a == b for x, y in zip(graph, eager, strict=True) for a, b in zip(x, y, strict=False))
    print(f"{scheme}: {same}/{n} greedy tokens identical, graph vs eager")
    assert graph == eager


def test_kernel_is_used_on_cuda(cuda_model, monkeypatch):
    """The decomposed path really dispatches to the Triton kernel on CUDA (and not with use_kernel=False)."""
    import sys

    import kernels.flash_lora_attention as fla  # noqa: F401

    module = sys.modules["kernels.flash_lora_attention"]
    calls = []
    real = module.flash_lora_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "flash_lora_attention", spy)
    model, tok = cuda_model
    s = MultiAgentSession(model, "base_lr_shared", tokenizer=tok, eos_token_ids=[])
    s.append_text("Question: what is the capital of France?\n")
    s.step("plan", max_new_tokens=2)
    assert len(calls) == 2 * model.n_layers
    calls.clear()
    s2 = MultiAgentSession(model, "base_lr_shared", tokenizer=tok, eos_token_ids=[], use_kernel=False)
    s2.append_text("Question: what is the capital of France?\n")
    s2.step("plan", max_new_tokens=2)
    assert not calls
