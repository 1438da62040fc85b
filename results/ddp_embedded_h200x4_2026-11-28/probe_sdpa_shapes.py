"""What a new sequence length costs each SDPA backend, forward + backward (the question behind lragent/attention.py
leaving cuDNN out of the plain causal path): SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64,
bf16), batch 12, five lengths of a training epoch's batches, each timed the first time and again.

Run on a GPU:  python results/ddp_embedded_h200x4_2026-11-28/probe_sdpa_shapes.py
(The last two lines, the shared pass's wider values at 8B shapes, were added after that run: not yet measured.)
On an H200 (torch 2.11, 2026-11-28) the default backend was cuDNN (its kernels in the profile) and took 118-238 ms at
a length's first call, ~1 ms after; FlashAttention took 29 ms once (its first call) and 0.4-1.8 ms at every new length.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

LENGTHS = (1302, 1727, 2325, 889, 654)


def step(b: int, t: int, backends: list[SDPBackend] | None) -> float:
    """ms of one forward + backward at length ``t`` (``backends`` None: torch's choice)."""
    q = torch.randn(b, 9, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, 3, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, 3, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if backends is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def wide_step(t: int, cudnn: bool) -> float:
    """ms of one forward + backward of the shared pass's attention (lragent/attention.py ``_sdpa``, values wider than
    Q/K: ``[V_base | V_lr]``) at LLaMA-3.1-8B's shapes, batch 1, length ``t``: cuDNN as it is, or FlashAttention with
    Q/K zero-padded to the values' width."""
    q = torch.randn(1, 32, t, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, t, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, t, 136, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if cudnn:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=128**-0.5)
    else:
        qp, kp = F.pad(q, (0, 8)), F.pad(k, (0, 8))
        out = F.scaled_dot_product_attention(qp, kp, v, is_causal=True, enable_gqa=True, scale=128**-0.5)
    out.sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_sdpa_shapes: needs a CUDA GPU")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    runs = (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]), ("cudnn", [SDPBackend.CUDNN_ATTENTION]))
    for offset, (name, backends) in enumerate(runs):
        lengths = [t + offset for t in LENGTHS]  # lengths no earlier backend has seen
        first, again = zip(*((step(12, t, backends), step(12, t, backends)) for t in lengths), strict=True)
        print(f"{name:8s} first {[round(x, 1) for x in first]}  again {[round(x, 1) for x in again]}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(4, 777, None)
    attention = ("flash", "cudnn", "fmha")
    picked = sorted({e.name[:60] for e in prof.events() if any(s in e.name.lower() for s in attention)})
    print("default backend's kernels:", picked)
    # the shared pass (lambda > 0) keeps cuDNN for its wider values: does it pay a plan per new length too?
    for offset, cudnn in enumerate((True, False)):
        lengths = [t + 3 + offset for t in (1302, 1727, 2325, 889, 654)]
        first, again = zip(*((wide_step(t, cudnn), wide_step(t, cudnn)) for t in lengths), strict=True)
        name = "wide cuDNN" if cudnn else "wide flash (Q/K padded)"
        print(f"{name:24s} first {[round(x, 1) for x in first]}  again {[round(x, 1) for x in again]}")


if __name__ == "__main__":
    main()
