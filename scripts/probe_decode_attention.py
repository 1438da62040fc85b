# ruff: noqa  (a one-off driver kept as it ran; removed in the next commit, results/engine_h100/decode_2026-11-27c/)
"""One decode-attention call at 8B shapes, warm, for ncu; prints its CUDA-graph median time (L2 hot).

One-off driver of results/engine_h100/decode_2026-11-27c/ (attention at batch 1 against cuDNN, and under ncu):
    python3 scripts/probe_decode_attention.py MODE BATCH KEYS      # MODE: ours (LoRA) | plain | sdpa (cuDNN)
    ncu --clock-control none --kernel-name regex:_flash_lora_decode --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight ... python3 scripts/probe_decode_attention.py ours 1 2048
"""

import sys

if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eval_suite.bench_kernel import HQ, SCALING, _decode_inputs  # noqa: E402
from kernels.flash_lora_decode import flash_lora_decode  # noqa: E402

mode, bsz, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cap = n + 72
x = _decode_inputs(bsz, cap, torch.bfloat16, seed=1)
x["kv_lens"].fill_(n)
if mode in ("ours", "plain"):
    keys = ("q", "k_cache", "v_cache", "kv_lens", "out") + (
        ("v_lr_cache", "lora_b", "role_ids") if mode == "ours" else ()
    )
    kw = {k: x[k] for k in keys}
    fn = lambda: flash_lora_decode(**kw, **({"scaling": SCALING} if mode == "ours" else {}))
else:
    q = x["q"].view(bsz, HQ, 1, -1)
    k = x["k_cache"][:, :, :n].contiguous()
    v = x["v_cache"][:, :, :n].contiguous()
    from torch.nn.attention import sdpa_kernel, SDPBackend

    def fn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


for _ in range(6):
    fn()
torch.cuda.synchronize()
# graph-timed median for the record
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(20):
        fn()
ts = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    torch.cuda.synchronize()
    ts.append(a.elapsed_time(b) / 20 * 1000)
ts.sort()
print(f"{mode} B={bsz} n={n}: graph median {ts[10]:.2f} us per call")
