"""GPU probe: SDPA backends for the masked shapes training uses, and peak memory of one training step."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lragent.lora_model import MultiLoraModel
from lragent.models import load_model
from lragent.multi_lora import MultiLoraConfig

dev = "cuda"
q = torch.randn(4, 9, 1024, 64, device=dev, dtype=torch.bfloat16)
k = torch.randn(4, 3, 1024, 64, device=dev, dtype=torch.bfloat16)
for ev in (64, 72):
    v = torch.randn(4, 3, 1024, ev, device=dev, dtype=torch.bfloat16)
    mask = torch.ones(4, 1, 1024, 1024, device=dev, dtype=torch.bool).tril()
    for name, be in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ]:
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
            try:
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=gqa)
                ok = "ok"
            except Exception as e:  # noqa: BLE001
                ok = "no: " + str(e).splitlines()[0][:60]
            print(f"Ev={ev} {name} masked gqa={gqa}: {ok}")

hf, _ = load_model("smollm2-135m", dtype=torch.float32, device=dev)
m = MultiLoraModel(hf, MultiLoraConfig()).to(dev)
for b, t in [(4, 2048), (8, 1024)]:
    ids = torch.randint(0, 49152, (b, t), device=dev)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = m(ids, torch.zeros(b, dtype=torch.long, device=dev), attention_mask=torch.ones_like(ids))
        loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    torch.cuda.synchronize()
    print(f"plain B={b} T={t}: {time.time() - t0:.2f}s peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    cmask = torch.ones(b, t // 2, device=dev, dtype=torch.long)
    cmask[:, : t // 8] = 0  # left padding
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = m.shared_context_forward(
            ids[:, : t // 2],
            cmask,
            ids[:, t // 2 :],
            torch.ones_like(cmask),
            torch.zeros(b, dtype=torch.long, device=dev),
            torch.ones(b, dtype=torch.long, device=dev),
        )
        loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    torch.cuda.synchronize()
    print(f"shared B={b} T={t}: {time.time() - t0:.2f}s peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    for _ in range(3):
        t0 = time.time()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(ids, torch.zeros(b, dtype=torch.long, device=dev), attention_mask=torch.ones_like(ids))
            loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        torch.cuda.synchronize()
    print(f"plain step B={b} T={t}: {time.time() - t0:.3f}s")
