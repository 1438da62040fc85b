"""What a new sequence length costs each SDPA backend, forward + backward (the question behind lragent/attention.py
leaving cuDNN out of the plain causal path): SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64,
bf16), batch 12, five lengths of a training epoch's batches, each timed the first time and again.

Run on a GPU:  python results/ddp_embedded_h200x4_2026-11-28/probe_sdpa_shapes.py
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


if __name__ == "__main__":
    main()
