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


def _run(model, tok, scheme, use_kernel, cuda_graphs=None, logits=False):
    """Greedy 17-step agent schedule; per step the generated ids and (with ``logits``) each generated token's
    next-token logits row (fp32, CPU)."""
    from eval_suite.evaluate.session_runner import _load_question, build_schedule

    session = MultiAgentSession(
        model, scheme, tokenizer=tok, use_kernel=use_kernel, eos_token_ids=[], cuda_graphs=cuda_graphs
    )
    out, rows = [], []
    for role, text in build_schedule("agent", _load_question(0)):
        session.append_text(text)
        before = session.num_tokens
        r = session.step(role, max_new_tokens=24, return_logits=logits)
        out.append(r.generated_ids)
        if logits:
            at = {p: i for i, p in enumerate(r.logit_positions)}
            rows.append([r.logits[at[before - 1 + j]] for j in range(len(r.generated_ids))])
    return out, rows


def _same_until_a_near_tie(a, b, b_logits, tie: float) -> tuple[int, int]:
    """Walks two greedy runs in order; they must agree until the first differing token, and there ``b``'s logits must
    put the two candidates within ``tie`` (a bf16 rounding-level near-tie): after it the trajectories differ, so the
    comparison stops. Returns (tokens compared, total)."""
    total = sum(len(x) for x in a)
    n = 0
    for x, y, ly in zip(a, b, b_logits, strict=True):
        for j, (s, t) in enumerate(zip(x, y, strict=False)):
            if s != t:
                margin = float(ly[j][t] - ly[j][s])
                assert margin <= tie, f"token {n}: {s} vs {t}, logit margin {margin:.3f} > {tie} (not a near-tie)"
                return n, total
            n += 1
        assert len(x) == len(y)
    return n, total


@pytest.mark.parametrize("scheme", ["base_lr_shared", "base_shared"])
def test_kernel_on_off_same_greedy_tokens(cuda_model, scheme):
    """Kernel on vs off (eager decoding both): identical greedy tokens, except that bf16 rounding may flip a near-tie
    (top-2 margin within 2 bf16 ulps of a logit around 16); the runs must agree up to that point."""
    model, tok = cuda_model
    on, _ = _run(model, tok, scheme, use_kernel=True, cuda_graphs=False)
    off, off_logits = _run(model, tok, scheme, use_kernel=False, cuda_graphs=False, logits=True)
    same, n = _same_until_a_near_tie(on, off, off_logits, tie=0.25)
    print(f"{scheme}: {same}/{n} greedy tokens identical with the kernel on and off before any near-tie flip")


@pytest.mark.parametrize("scheme", ["non_shared", "full_shared", "droidspeak", "base_shared", "base_lr_shared"])
def test_graph_and_eager_decoding_same_greedy_tokens(cuda_model, scheme):
    """The 17-step agent schedule decoded by CUDA-graph replay and eagerly: identical greedy tokens."""
    model, tok = cuda_model
    graph, _ = _run(model, tok, scheme, use_kernel=True, cuda_graphs=True)
    eager, _ = _run(model, tok, scheme, use_kernel=True, cuda_graphs=False)
    n = sum(len(x) for x in graph)
    same = sum(a == b for x, y in zip(graph, eager, strict=True) for a, b in zip(x, y, strict=False))
    print(f"{scheme}: {same}/{n} greedy tokens identical, graph vs eager")
    assert graph == eager
