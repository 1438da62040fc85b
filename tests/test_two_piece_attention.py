"""The shared pass's two-piece attention: each sequence a producer's prefix and a consumer's suffix attends
as the plain causal attention over the producer's values plus an r-wide correction of the consumer rows, equal
(values and gradients) to the per-query decomposed attention over ``[V_base | V_lr]``; the consumer-row kernels
(Triton, run here under ``TRITON_INTERPRET=1``) equal their PyTorch implementation; and the shared-sequence forward
gives the same logits and gradients with the path on and off (``LRAGENT_TWO_PIECE=0``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lragent import cache_views
from lragent.attention import RoleSplit, decomposed_attention, two_piece_attention

REPO = Path(__file__).resolve().parents[1]
T = 40


def inputs(dtype: torch.dtype, b: int = 4, t: int = T, h_q: int = 4, h_kv: int = 2, d: int = 8, r: int = 3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(b, h_q, t, d, generator=g, dtype=dtype),
        "k": torch.randn(b, h_kv, t, d, generator=g, dtype=dtype),
        "v_base": torch.randn(b, h_kv, t, d, generator=g, dtype=dtype),
        "v_lr": torch.randn(b, t, r, generator=g, dtype=dtype),
        "lora_b": torch.randn(3, h_kv * d, r, generator=g, dtype=dtype),
    }
    return {k: v.requires_grad_() for k, v in x.items()}


SPLITS = {
    "mixed rows, one at T": [5, 17, 23, 40],
    "0-ish and T-ish": [0, 1, 39, 40],
    "all 0 (consumer only)": [0, 0, 0, 0],
    "all T (producer only)": [40, 40, 40, 40],
    "one split": [16, 16, 16, 16],
}


def both(x: dict, split: list[int], producer: list[int], consumer: list[int], t: int = T, ends=None):
    """(two-piece output, per-query output, layout)."""
    split_t, prod, cons = torch.tensor(split), torch.tensor(producer), torch.tensor(consumer)
    layout = RoleSplit.make(prod, cons, split_t, t, None if ends is None else torch.tensor(ends))
    roles = torch.where(torch.arange(t)[None, :] < split_t[:, None], prod[:, None], cons[:, None])  # (B, T)
    ours = two_piece_attention(x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], 0.7, layout)
    ref = decomposed_attention(x["q"], x["k"], x["v_base"], x["v_lr"], x["lora_b"], 0.7, roles, use_kernel=False)
    return ours, ref, layout


def assert_same_with_grads(x: dict, ours: torch.Tensor, ref: torch.Tensor, tol: float, real=None) -> None:
    """Equal outputs and input gradients; ``real`` ``(B, T)`` bool: compare (and weight the loss on) those rows."""
    assert ours.shape == ref.shape
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    if real is not None:
        g = g * real[:, None, :, None]
        ours_v, ref_v = ours.transpose(1, 2)[real], ref.transpose(1, 2)[real]
    else:
        ours_v, ref_v = ours, ref
    assert torch.allclose(ours_v, ref_v, atol=tol, rtol=0), (ours_v - ref_v).abs().max()
    names = list(x)
    got = torch.autograd.grad(ours, [x[n] for n in names], g)
    want = torch.autograd.grad(ref, [x[n] for n in names], g)
    for n, a, w in zip(names, got, want, strict=True):
        assert torch.allclose(a, w, atol=tol * 10, rtol=0), (n, (a - w).abs().max())


@pytest.mark.parametrize("split", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_two_piece_equals_the_per_query_path(split: list[int], dtype: torch.dtype) -> None:
    x = inputs(dtype)
    ours, ref, _ = both(x, split, producer=[1, 2, 0, 2], consumer=[0, 0, 1, 1])
    assert_same_with_grads(x, ours, ref, 1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_padding_rows_change_no_real_row(dtype: torch.dtype) -> None:
    """With ``ends`` the rows past a sequence's end keep the producer's values (no correction): every real row and
    every gradient of a loss over real rows is unchanged."""
    x = inputs(dtype)
    ends = [30, 40, 23, 12]
    ours, ref, layout = both(x, [5, 17, 23, 40], producer=[1, 2, 0, 2], consumer=[0, 0, 1, 1], ends=ends)
    assert layout.rows.n_rows == 25 + 23 + 0 + 0
    real = torch.arange(T)[None, :] < torch.tensor(ends)[:, None]
    assert_same_with_grads(x, ours, ref, 1e-10 if dtype == torch.float64 else 1e-5, real=real)


def test_producer_equal_to_consumer_adds_nothing() -> None:
    x = inputs(torch.float64, t=37)
    ours, ref, layout = both(x, [3, 37, 20, 30], producer=[1, 2, 0, 0], consumer=[1, 2, 0, 2], t=37)
    assert layout.rows.n_rows == 34 + 0 + 17 + 7
    assert_same_with_grads(x, ours, ref, 1e-10)


def test_consumer_rows_are_packed_sequence_by_sequence() -> None:
    r = torch.zeros(3, dtype=torch.long)
    rows = RoleSplit.make(r, r, torch.tensor([7, 10, 4]), 10).rows
    assert rows.row_pos.tolist() == [7, 8, 9, 4, 5, 6, 7, 8, 9] and rows.row_seq.tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 2]
    assert rows.cu.tolist() == [0, 3, 3, 9] and rows.start.tolist() == [7, 10, 4] and rows.count.tolist() == [3, 0, 6]
    assert rows.max_count == 6 and rows.cu.dtype == rows.start.dtype == torch.int32
    ended = RoleSplit.make(r, r, torch.tensor([7, 12, 4]), 10, torch.tensor([9, 10, 3])).rows  # split past T: T
    assert ended.count.tolist() == [2, 0, 0] and ended.row_pos.tolist() == [7, 8] and ended.max_count == 2


def test_attention_backward_sees_its_own_output(monkeypatch) -> None:
    """The correction writes into the attention's output buffer; the backward must write the saved rows back before
    the attention's backward reads that buffer (CPU FlashAttention derives rowsum(dO ∘ O) from it, as CUDA's does)."""
    x = inputs(torch.float32)
    ours, ref, _ = both(x, [5, 17, 23, 40], producer=[1, 2, 0, 2], consumer=[0, 0, 1, 1])
    assert_same_with_grads(x, ours, ref, 1e-5)
    monkeypatch.setattr("lragent.attention.restore_rows", lambda *a: None)  # the bug this test pins
    x = inputs(torch.float32)
    ours, ref, _ = both(x, [5, 17, 23, 40], producer=[1, 2, 0, 2], consumer=[0, 0, 1, 1])
    with pytest.raises(AssertionError):
        assert_same_with_grads(x, ours, ref, 1e-5)


def test_output_does_not_change_under_backward() -> None:
    """The backward restores the attention's own rows in the shared buffer for that attention's backward, then puts
    the corrected rows back: the output a caller holds is the same before and after ``backward()``."""
    x = inputs(torch.float32)
    ours, _, _ = both(x, [5, 17, 23, 40], producer=[1, 2, 0, 2], consumer=[0, 0, 1, 1])
    before = ours.detach().clone()
    ours.square().sum().backward()
    assert torch.equal(ours.detach(), before)


# ------------------------------------------------------------------------------------------------ Triton kernels
_INTERPRET_SCRIPT = """
import json, torch
from lragent.attention import RoleSplit
from kernels.consumer_rows import add_dq_rows, consumer_backward, consumer_lr_forward
res = []
for (b, h_q, h_kv, t, d, r, split, ends) in CASES:
    g = torch.Generator().manual_seed(t)
    q = torch.randn(b, t, h_q, d, generator=g).half().transpose(1, 2)  # token-major underneath, as in the model
    k = torch.randn(b, t, h_kv, d, generator=g).half().transpose(1, 2)
    lr = torch.randn(b, t, r, generator=g).half()
    db = torch.randn(b, h_kv, r, d, generator=g) * 0.5
    out0 = torch.randn(b, t, h_q, d, generator=g).half().transpose(1, 2)
    grad = torch.randn(b, t, h_q, d, generator=g).half().transpose(1, 2)
    gq0 = torch.randn(b, t, h_q, d, generator=g).half().transpose(1, 2)
    z = torch.zeros(b, dtype=torch.long)
    rows = RoleSplit.make(z, z, torch.tensor(split), t, torch.tensor(ends)).rows
    n = rows.n_rows
    got, want = {}, {}
    for use_kernel, store in ((True, got), (False, want)):
        out = out0.clone()
        lse, o_lr, saved = consumer_lr_forward(q, k, lr, db, out, rows, use_kernel=use_kernel)
        gr = consumer_backward(grad, q, k, lr, db, rows, lse.float(), o_lr.float(), use_kernel=use_kernel)
        gq = gq0.clone()
        add_dq_rows(gq, rows, gr.dq_parts, h_kv, use_kernel=use_kernel)
        store.update(lse=lse, o_lr=o_lr, saved=saved, out=out, dq=gq, dk=gr.dk, dlr=gr.dv_lr, x=gr.x)
    res.append({name: [(got[name].float() - want[name].float()).abs().max().item() if n else 0.0,
                       want[name].float().abs().max().item() if n else 0.0] for name in got})
print(json.dumps(res))
"""

INTERPRET_CASES = [
    # b, h_q, h_kv, t, d, r, split, ends: GQA 2 (32 rows of a block per 64), 2 row blocks, 2 key tiles, a sequence
    # without consumer rows, one from position 0, rank 3 -> R_PAD 16
    (3, 4, 2, 70, 16, 3, [20, 70, 0], [70, 70, 45]),
    (2, 2, 2, 33, 32, 8, [31, 1], [33, 33]),
    (1, 8, 2, 130, 16, 16, [60], [129]),
    (2, 4, 2, 600, 16, 8, [300, 590], [600, 598]),  # 3 key splits of 256, 10 row blocks
]


def test_consumer_row_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    script = f"CASES = {INTERPRET_CASES!r}\n" + _INTERPRET_SCRIPT
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == len(INTERPRET_CASES)
    for case, err in zip(INTERPRET_CASES, errors, strict=True):
        for name, (diff, scale) in err.items():
            # fp16 inputs; the kernels round P to fp16 for the V_lr product (as FlashAttention does) and dS for dK
            assert diff <= 2e-3 * max(scale, 1.0), (case, name, diff, scale)
        assert err["saved"][0] == 0.0 and err["lse"][1] > 0  # the saved rows are copies; something was computed


# ------------------------------------------------------------------------------------------------ whole model
def tiny_model(layers: int = 2):
    from lit_modules import MultiLoraModule

    tiny = {"vocab_size": 258, "num_hidden_layers": layers}
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=tiny, dropout=0.0)
    m.configure_model()
    m.lora_model.init_adapters("random", seed=4, b_std=0.5)
    return m.lora_model


OUT_INDEX = torch.tensor([0, 8, 12, 30, 41, 55, 64, 79, 100, 135, 150, 159])  # producer and consumer rows


def run_shared(model, checkpointing: bool, scheme: str = "base_lr_shared", lengths=None, index=OUT_INDEX):
    """Logits at some positions and the adapters' gradients of a loss over them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 258, (4, T), generator=g)
    split = torch.tensor([9, 15, 17, 23])
    model.decoder.gradient_checkpointing = checkpointing
    for p in model.lora_parameters():
        p.grad = None
    logits = model.shared_sequence_forward(ids, split, [1, 2, 0, 2], [0, 0, 1, 1], scheme, index, lengths)
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.lora_parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_sequence_forward_two_piece_on_equals_off(monkeypatch, checkpointing: bool) -> None:
    calls: list[RoleSplit] = []

    def counted(*args, **kwargs):
        calls.append(args[6])
        return two_piece_attention(*args, **kwargs)

    monkeypatch.setattr(cache_views, "two_piece_attention", counted)
    model = tiny_model()
    monkeypatch.setenv("LRAGENT_TWO_PIECE", "0")
    ref_logits, ref_grads = run_shared(model, checkpointing=False)
    assert calls == []  # switched off: the per-query path
    monkeypatch.setenv("LRAGENT_TWO_PIECE", "1")
    logits, grads = run_shared(model, checkpointing)
    # every layer (and its recomputation under checkpointing) attended in two pieces, one layout for the forward
    assert len(calls) == model.n_layers * (2 if checkpointing else 1)
    assert all(c is calls[0] for c in calls) and calls[0].rows.n_rows == 4 * T - (9 + 15 + 17 + 23)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0), (logits - ref_logits).abs().max()
    for a, w in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, w, atol=1e-5, rtol=1e-4), (a - w).abs().max()
    assert any(a.abs().max() > 0 for a in grads)


def test_shared_sequence_forward_lengths_leave_real_rows_alone() -> None:
    """``lengths`` drops the padding rows from the correction; logits and gradients of real rows do not move."""
    model = tiny_model()
    index = torch.tensor([0, 8, 12, 30, 41, 55, 64, 100, 135])  # all before each sequence's end below
    lengths = torch.tensor([32, 40, 30, 20])
    assert all(int(i) % T < int(lengths[int(i) // T]) for i in index)
    ref_logits, ref_grads = run_shared(model, False, index=index)
    logits, grads = run_shared(model, False, lengths=lengths, index=index)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    for a, w in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, w, atol=1e-5, rtol=1e-4), (a - w).abs().max()


def test_full_shared_keeps_its_path(monkeypatch) -> None:
    """``full_shared`` stores full values (no decomposed cache): no layout, no two-piece attention."""
    monkeypatch.setattr(cache_views, "two_piece_attention", lambda *a, **k: pytest.fail("two-piece under full_shared"))
    monkeypatch.setattr(RoleSplit, "make", lambda *a, **k: pytest.fail("layout made under full_shared"))
    run_shared(tiny_model(), checkpointing=False, scheme="full_shared")


def test_training_step_lays_out_the_shared_pass_from_host_copies(tmp_path: Path) -> None:
    """The module keeps host copies of the per-sequence lengths before the batch moves, and the shared pass reads
    only those: the batch's own length tensors may sit where the host cannot read them (``meta`` here; the GPU in
    training, where reading them is a device sync), and the loss is unchanged."""
    from datamodules import collate_examples
    from tests.test_training_recipe import data, module

    dm = data(tmp_path, pack_prefixes=False)
    dm.setup()
    batch = collate_examples(dm.train_set.examples[:4], pad_id=257)
    m = module(lambda_shared=0.5, val_schemes=[])
    m.configure_model()
    want = m.compute_loss(batch, seed=3)
    moved = m.on_before_batch_transfer(dict(batch), 0)
    assert moved["host"]["context_len"] == batch["context_len"].tolist()
    assert moved["host"]["lengths"] == batch["lengths"].tolist()
    for key in ("context_len", "prefix_len", "lengths"):
        moved[key] = torch.empty(moved[key].shape, dtype=torch.long, device="meta")
    got = m.compute_loss(moved, seed=3)
    assert torch.equal(got["loss"], want["loss"]) and torch.equal(got["shared"], want["shared"])


def test_queries_keys_and_layout_of_other_lengths_are_refused() -> None:
    """The two-piece path is for a whole sequence at once: queries, keys and the layout must all have T positions."""
    x = {k: v.detach() for k, v in inputs(torch.float32).items()}
    r = torch.zeros(4, dtype=torch.long)
    for q_len, k_len, layout_len in ((T - 1, T, T), (T, T - 1, T), (T, T, T + 1)):
        layout = RoleSplit.make(r, r + 1, torch.full((4,), 5), layout_len)
        q, k = x["q"][:, :, :q_len], x["k"][:, :, :k_len]
        with pytest.raises(ValueError) as info:
            two_piece_attention(q, k, x["v_base"], x["v_lr"], x["lora_b"], 0.7, layout)
        assert str(info.value) == (
            "two-piece attention needs as many queries as keys as the layout's length, "
            f"got {q_len}, {k_len} and {layout_len}"
        )
