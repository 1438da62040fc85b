"""L2 prefetch of o_proj's weight during the attention (kernels/l2_prefetch.py): the kernel reads every 32-bit word of
the tensor exactly once (its XOR checksum equals numpy's, with a lone set word at either end, sizes that end inside a
loop step and fewer words than programs), and the engine with the switch on decodes what it decodes with it off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_under_interpreter


def _xor_reference(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.cpu().contiguous().view(-1).view(torch.int32).numpy()))


def _check_checksums(device: str) -> None:
    from kernels.l2_prefetch import BLOCK_WORDS, checksum

    g = torch.Generator().manual_seed(0)
    sizes = (1, 3, 4 * BLOCK_WORDS, 4 * BLOCK_WORDS + 1, 9 * BLOCK_WORDS - 7)  # words; 4 programs under the interpreter
    for words in sizes:
        for where in ("random", "first", "last"):
            if where == "random":
                t = torch.randint(-(2**31), 2**31 - 1, (words,), generator=g, dtype=torch.int32)
            else:  # a lone set word at index 0 or at the very end: missed or read twice, the checksum is 0
                t = torch.zeros(words, dtype=torch.int32)
                t[0 if where == "first" else -1] = 0x5A5A5A5
            t = t.to(device)
            got = checksum(t)
            assert got == _xor_reference(t), (words, where, got)
            assert where == "random" or got == 0x5A5A5A5
    w = torch.randn(37, 22, generator=g).to(device=device, dtype=torch.bfloat16)  # a weight: 407 words of two bf16 each
    assert checksum(w) == _xor_reference(w)
    assert checksum(w, programs=7) == _xor_reference(w)


def test_the_prefetch_kernel_reads_every_word_once_under_the_interpreter():
    assert run_under_interpreter("import tests.test_l2_prefetch as t; t._check_checksums('cpu'); print('ok')") == "ok\n"


@pytest.mark.gpu
def test_the_prefetch_kernel_reads_every_word_once_on_a_gpu():
    _check_checksums("cuda")


def test_a_tensor_the_kernel_cannot_read_is_named():
    from kernels.l2_prefetch import _words

    with pytest.raises(ValueError, match=r"whole 32-bit words, got \(3,\) torch.bfloat16"):
        _words(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        _words(torch.zeros(4, 4, dtype=torch.bfloat16).t())


def test_the_switch_names_the_most_rows_of_a_prefetching_step(monkeypatch):
    from kernels.l2_prefetch import MAX_ROWS, l2_prefetch_rows

    monkeypatch.delenv("LRAGENT_L2_PREFETCH", raising=False)
    assert l2_prefetch_rows() == 0  # off unless asked
    for value in ("0", "1", str(MAX_ROWS)):
        monkeypatch.setenv("LRAGENT_L2_PREFETCH", value)
        assert l2_prefetch_rows() == int(value)
    for bad in (str(MAX_ROWS + 1), "-1", "on", "0.5"):
        with pytest.raises(ValueError, match=f"LRAGENT_L2_PREFETCH='{bad}': allowed 0 \\(off\\) to {MAX_ROWS}"):
            l2_prefetch_rows(bad)


def _engine_check(device: str) -> dict[str, int]:
    """Decode two rows of different roles (tiny LLaMA, q/v adapters, fp16) with LRAGENT_L2_PREFETCH 0, 2 and 1: at 2
    every layer of every decode step prefetches o_proj's weight and reads it through the Triton GEMV, with the same
    tokens as 0 and logits within 2e-3; at 1 (steps of one row only) the two-row steps prefetch nothing and give 0's
    logits exactly."""
    from conftest import decode_under_switch

    import kernels.fused_gemv as fg
    import kernels.l2_prefetch as lp

    calls = {"prefetch": 0, "gemv": 0}
    raw, raw_gemv = lp.prefetch, fg.gemv

    def spy(t):
        calls["prefetch"] += 1
        return raw(t)

    def gemv_spy(x, w, *a, **kw):
        calls["gemv"] += 1
        return raw_gemv(x, w, *a, **kw)

    layers: list[int] = []
    lp.prefetch, fg.gemv = spy, gemv_spy
    try:
        counted = decode_under_switch("LRAGENT_L2_PREFETCH", device, calls,
                                      prepare=lambda m: layers.append(len(m.model.model.layers)))  # fmt: skip
    finally:
        lp.prefetch, fg.gemv = raw, raw_gemv
    for scheme in ("base_lr_shared", "full_shared"):
        assert counted[(scheme, "0")] == counted[(scheme, "1")] == {"prefetch": 0, "gemv": 0}, counted
        # every layer of each decode step, and its o projection through the GEMV (a graph-captured step calls them
        # once per capture, eager ones once per step)
        n = counted[(scheme, "2")]
        assert n["prefetch"] > 0 and n["prefetch"] % layers[0] == 0 and n["gemv"] == n["prefetch"], counted
    return counted


def test_the_engine_decodes_the_same_with_the_prefetch_under_the_interpreter():
    assert run_under_interpreter("import tests.test_l2_prefetch as t; print('ok', t._engine_check('cpu'))").startswith(
        "ok"
    )


@pytest.mark.gpu
def test_the_engine_decodes_the_same_with_the_prefetch_on_a_gpu():
    """The same on a GPU: decode steps captured as CUDA graphs with the side stream's fork and join inside them."""
    _engine_check("cuda")
