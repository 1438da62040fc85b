"""The fused LoRA inference path (shared A appended to the fused GEMMs, B applied through a role mask) computes
what the module-by-module path computes, for every sharing scheme and mixed-role batches."""

from __future__ import annotations

import pytest
import torch
from conftest import drive_rows, tiny_multi_lora

from lragent.engine import Engine, GenerationRequest
from lragent.fused_weights import fuse_base_weights
from lragent.multi_lora import ALL_TARGETS, role_mask, role_masked
from lragent.schemes import SCHEMES

ALL = tuple(ALL_TARGETS)


def _schedules(seed: int, rows: int) -> list[list[tuple[int, list[int], int]]]:
    """Per row, two requests (role, appended ids, new tokens); rows get different roles at the same step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        sched = []
        for k in range(2):
            ids = torch.randint(3, 250, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            sched.append(((r + k) % 3, ids, int(torch.randint(2, 5, (1,), generator=g))))
        out.append(sched)
    return out


def _run_batched(model, scheme: str, fuse_ops: bool, fuse_lora: bool, rows: int = 3) -> list[list]:
    """Every row's results, rows advancing together (a batch of mixed roles in every decode step)."""
    eng = Engine(
        model,
        scheme,
        rows=rows,
        capacity=64,
        eos_token_ids=[],
        droidspeak_layers=[1, 2],
        fuse_ops=fuse_ops,
        fuse_lora=fuse_lora,
    )
    assert eng.fuse_lora == (fuse_ops and fuse_lora)
    schedules = _schedules(7, rows)

    def launch(r: int, k: int) -> None:
        role, ids, n = schedules[r][k]
        eng.append(r, ids)
        eng.start(r, GenerationRequest(role=role, max_new_tokens=n, return_logits=True))

    return drive_rows(eng, rows, launch, 2)


CASES = [(s, sa) for s in SCHEMES for sa in (True, False) if not (s == "base_lr_shared" and not sa)]


@pytest.mark.parametrize(("scheme", "shared_a"), CASES)
def test_fused_lora_path_equals_module_path(scheme, shared_a):
    """A fused-LoRA engine (A rows in the q/k/v and gate/up GEMMs; o/down and every B through the role mask) gives
    the tokens and logits of the plain module-by-module engine, with adapters on every projection, q/k/v biases
    (Qwen2: zero bias on the A rows) and three rows of different roles decoding together."""
    kw = {"b_std": 0.3, "targets": ALL, "shared_a": shared_a}
    plain, fused = tiny_multi_lora("tiny-qwen2", **kw), tiny_multi_lora("tiny-qwen2", **kw)
    ref = _run_batched(plain, scheme, fuse_ops=False, fuse_lora=False)
    got = _run_batched(fused, scheme, fuse_ops=True, fuse_lora=True)
    attn = fused.model.model.layers[0].self_attn
    assert attn.__dict__["_lragent_qkv"].lora == ((0, 1, 2) if shared_a else ())
    for r, (rows_a, rows_b) in enumerate(zip(ref, got, strict=True)):
        for a, b in zip(rows_a, rows_b, strict=True):
            assert a.generated_ids == b.generated_ids, (scheme, r)
            assert (a.logits - b.logits).abs().max() <= 1e-4, (scheme, r)


@pytest.mark.parametrize("scheme", ["base_lr_shared", "full_shared"])
def test_fused_lora_on_and_off_agree_with_default_targets(scheme):
    """q/v adapters (the benchmark's layout): the switch ``fuse_lora`` changes the kernels, not the results."""
    a, b = tiny_multi_lora("tiny-llama", b_std=0.3), tiny_multi_lora("tiny-llama", b_std=0.3)
    off = _run_batched(a, scheme, fuse_ops=True, fuse_lora=False)
    on = _run_batched(b, scheme, fuse_ops=True, fuse_lora=True)
    assert a.model.model.layers[0].self_attn.__dict__["_lragent_qkv"].lora == ()
    for rows_a, rows_b in zip(off, on, strict=True):
        for x, y in zip(rows_a, rows_b, strict=True):
            assert x.generated_ids == y.generated_ids
            assert (x.logits - y.logits).abs().max() <= 1e-4


def test_fused_group_layout_and_adapters_untouched():
    """The A rows follow the base rows in target order, as copies: the adapter parameters stay the same objects
    with their own storage (optimisers, checkpoints, PEFT export see nothing), the base weights become views."""
    model = tiny_multi_lora("tiny-qwen2", b_std=0.3, targets=("q_proj", "v_proj", "up_proj"))
    layer = model.model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    a_q, a_v = attn.q_proj.lora_A[0], attn.v_proj.lora_A[0]
    a_q_before = a_q.detach().clone()
    assert fuse_base_weights(model.model, lora=True) == 4
    g = attn.__dict__["_lragent_qkv"]
    dq, dk, dv = attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features
    r = a_q.shape[0]
    assert g.sizes == [dq, dk, dv, r, r] and g.lora == (0, 2)
    assert g.a_offset(0) == dq + dk + dv and g.a_offset(1) == dq + dk + dv + r
    assert torch.equal(g.weight[dq + dk + dv : dq + dk + dv + r], a_q)
    assert torch.equal(g.weight[dq + dk + dv + r :], a_v)
    assert torch.equal(g.bias[dq + dk + dv :], torch.zeros(2 * r))  # Qwen2 q/k/v biases: none on X·A
    assert attn.q_proj.lora_A[0] is a_q and torch.equal(a_q, a_q_before)
    assert a_q.requires_grad and a_q.data_ptr() != g.weight.data_ptr() + (dq + dk + dv) * a_q.shape[1] * 4
    assert attn.k_proj.weight.data_ptr() == g.weight.data_ptr() + dq * g.weight.shape[1] * 4  # a view
    gu = mlp.__dict__["_lragent_gu"]
    assert gu.lora == (1,) and torch.equal(gu.weight[-r:], mlp.up_proj.lora_A[0])
    # the base rows still compute the modules' own outputs; X·A comes out of the same GEMM
    x = torch.randn(2, 3, g.weight.shape[1])
    y = torch.nn.functional.linear(x, g.weight, g.bias)
    torch.testing.assert_close(y[..., :dq], attn.q_proj.base(x))
    torch.testing.assert_close(y[..., -r:], attn.v_proj.lora_input(x, None))
    # lora=False rebuilds the group without A rows
    fuse_base_weights(model.model, lora=False)
    assert attn.__dict__["_lragent_qkv"].sizes == [dq, dk, dv]


def test_changed_adapters_reach_the_fused_path():
    """Adapters changed after the engine fused its weights (an in-place update of A, new B values) are what the
    next generation uses: the A rows and the cached B matrix follow the parameters."""
    kw = {"b_std": 0.3, "targets": ("q_proj", "v_proj", "gate_proj")}
    plain, fused = tiny_multi_lora("tiny-llama", **kw), tiny_multi_lora("tiny-llama", **kw)
    engines = [
        Engine(m, "base_lr_shared", rows=2, capacity=64, eos_token_ids=[], fuse_ops=f, fuse_lora=f)
        for m, f in ((plain, False), (fused, True))
    ]
    prompt = list(range(5, 17))
    for eng in engines:  # one generation before the change: caches (fused A rows, B matrix) built
        eng.append(0, prompt)
        eng.generate(0, GenerationRequest(role=1, max_new_tokens=2))
    for m in (plain, fused):
        with torch.no_grad():
            for mod in m.lora_modules().values():
                mod.lora_A[0].mul_(-1.5)
                mod.lora_B[1].add_(0.2)
    outs = []
    for eng in engines:
        eng.append(1, prompt)
        outs.append(eng.generate(1, GenerationRequest(role=1, max_new_tokens=4, return_logits=True)))
    assert outs[0].generated_ids == outs[1].generated_ids
    assert (outs[0].logits - outs[1].logits).abs().max() <= 1e-4


def test_role_mask_puts_each_row_in_its_role_columns():
    """``role_masked`` places row b's X·A in the r columns of its role, zeros elsewhere, for each of k adapters."""
    role_ids = torch.tensor([2, 0, 1, 2])
    mask = role_mask(role_ids, 3, torch.float32)
    assert torch.equal(mask, torch.eye(3)[role_ids])
    lr = torch.randn(4, 2, 2 * 5)  # (B, T, k·r), k = 2, r = 5
    out = role_masked(lr, mask, 5)
    assert out.shape == (4, 2, 2, 15)
    for b, role in enumerate(role_ids.tolist()):
        for j in range(2):
            expect = torch.zeros(2, 15)
            expect[:, role * 5 : role * 5 + 5] = lr[b, :, j * 5 : j * 5 + 5]
            assert torch.equal(out[b, :, j], expect)


_INTERPRETED = """
import sys
import torch
sys.path.insert(0, "tests")
from conftest import tiny_multi_lora
import kernels.fused_ops as fo
from lragent.engine import Engine, GenerationRequest

seen = []
raw = fo.rope_store
def spy(q, *args, q_lora=None, **kw):
    seen.append(q_lora is not None and fo.kernels_usable(q))
    return raw(q, *args, q_lora=q_lora, **kw)
fo.rope_store = spy
for scheme in ("base_lr_shared", "full_shared"):
    outs = []
    for fuse in (False, True):
        m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"num_hidden_layers": 2})
        m.model.half()
        eng = Engine(m, scheme, rows=2, capacity=32, eos_token_ids=[], fuse_ops=fuse, fuse_lora=fuse)
        for r, role in ((0, 1), (1, 2)):
            eng.append(r, list(range(5 + r, 12 + r)))
            eng.start(r, GenerationRequest(role=role, max_new_tokens=3, return_logits=True))
        res = []
        while eng._pending:
            res.extend(eng.advance())
        outs.append(sorted(res, key=lambda x: x.row))
    for a, b in zip(*outs):
        assert a.generated_ids == b.generated_ids, (scheme, a.generated_ids, b.generated_ids)
        assert float((a.logits - b.logits).abs().max()) <= 2e-3, scheme
assert any(seen), "the q LoRA term never went through the Triton kernel"
print("ok", sum(seen))
"""


def test_q_lora_folded_into_the_rope_kernel_under_the_interpreter():
    """fp16 under TRITON_INTERPRET=1 (a fresh process): decode steps with q_proj's B applied inside the RoPE-and-store
    kernel (strided X·A columns of the fused GEMM, the cached stacked B, each row's role) give the plain path's
    tokens and logits for two rows of different roles."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root}
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok")
