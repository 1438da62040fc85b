"""One-off probe (not a maintained script): µs per layer of the 8B q/k/v step at one row, each variant over 32 layers'
weights in one CUDA graph (weights from DRAM, as in a decode step)."""

import json
import sys

import torch

from kernels.fused_gemv import NORM_CONFIG, rms_norm_linear
from kernels.fused_ops import rope_store
from kernels.fused_qkv_rope import qkv_rope_store

dev, dt = "cuda", torch.bfloat16
hq, hkv, d, hidden, r, layers = 32, 8, 128, 4096, 8, 32
n_base = (hq + 2 * hkv) * d
g = torch.Generator(device=dev).manual_seed(0)
W = [torch.randn(n_base + 2 * r, hidden, device=dev, dtype=dt, generator=g) * hidden**-0.5 for _ in range(layers)]
nw = torch.rand(hidden, device=dev, dtype=dt) + 0.5
h = torch.randn(1, hidden, device=dev, dtype=dt)
bq = torch.randn(3, hq * d, r, device=dev, dtype=dt) * 0.3
cos, sin = torch.rand(d, device=dev, dtype=dt), torch.rand(d, device=dev, dtype=dt)
kp = [torch.zeros(2, hkv, 4096, d, device=dev, dtype=dt) for _ in range(layers)]
vp = [torch.zeros(2, hkv, 4096, d, device=dev, dtype=dt) for _ in range(layers)]
lp = [torch.zeros(2, 4096, r, device=dev, dtype=dt) for _ in range(layers)]
one = dict(dtype=torch.long, device=dev)
slot, lslot, pos, role = (torch.tensor([v], **one) for v in (1, 1, 2047, 2))


def old(i):
    y = rms_norm_linear(h, nw, 1e-5, W[i], config=NORM_CONFIG)[0]
    q, k, v, lq, lv = y.split([hq * d, hkv * d, hkv * d, r, r], dim=-1)
    rope_store(q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), lv, cos[None], sin[None], kp[i], vp[i], lp[i],
               slot, lslot, pos, q_lora=(lq, bq, 2.0, role))  # fmt: skip


def gemv_only(i):
    rms_norm_linear(h, nw, 1e-5, W[i], config=NORM_CONFIG)


def new(i, lora=True):
    qkv_rope_store(h, nw, 1e-5, W[i], hq, hkv, d, cos, sin, kp[i], vp[i], lp[i], slot, lslot, pos, n_base + r,
                   (n_base, bq, 2.0, role) if lora else None)  # fmt: skip


def timed(fn) -> float:
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / layers)
    return sorted(times)[len(times) // 2]


variants = {
    "gemv only (rms_norm_linear)": gemv_only,
    "old: gemv + rope_store": old,
    "new: q term programs + V_lr": new,
    "new: no q adapter": lambda i: new(i, lora=False),
}
out = {}
for _turn in range(2):
    for name, fn in variants.items():
        try:
            out.setdefault(name, []).append(round(timed(fn), 2))
        except Exception as exc:  # noqa: BLE001
            out.setdefault(name, []).append(f"{type(exc).__name__}: {str(exc)[-300:]}")
for name, v in out.items():
    print(f"{name:40s} {v} µs/layer")
regs = {}
import kernels.fused_gemv as fg
import kernels.fused_qkv_rope as fq

for label, kern in (("rms_norm_gemv", fg._rms_norm_gemv_kernel), ("qkv_rope_store", fq._qkv_rope_store_kernel)):
    try:
        for dev_cache in kern.device_caches.values():
            for key, compiled in dev_cache[0].items():
                regs.setdefault(label, []).append({"regs": compiled.n_regs, "spills": compiled.n_spills})
    except Exception as exc:  # noqa: BLE001
        regs[label] = repr(exc)[-200:]
print(regs)
json.dump({"device": torch.cuda.get_device_name(), "us_per_layer": out, "registers": regs}, open(sys.argv[1], "w"),
          indent=1)  # fmt: skip
