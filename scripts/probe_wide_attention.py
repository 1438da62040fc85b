"""Which attention kernel serves the λ term's shared pass fastest: causal GQA attention whose values are
``[V_base | V_lr]`` (head width D + r) while queries and keys have width D (issue 19).

The shared pass's attention (``lragent.attention._sdpa``) pads Q and K with zero columns to D + r so that
FlashAttention takes it; at LLaMA-3.1-8B shapes (D = 128, r = 8) the backward then runs a wider tile than a plain
pass's. This probe times forward + backward of each candidate that computes the same values, side by side in one
process, against the plain D-wide attention of a λ = 0 step, and checks each against the current path's output.

The whole decomposed attention of the shared pass is timed three ways at realistic splits (each sequence's producer
prefix ends ``u`` tokens before the end, ``u`` drawn from 16..500 per row, seeded): the per-query path with Q/K
padded, with cuDNN wide values (``LRAGENT_TWO_PIECE=0``), and the two-piece form (``two_piece_attention``, the
default: two D-wide attentions, the layout made once outside the timing as the forward makes it once for all
layers); the two-piece row also reports the largest gradient differences against the cuDNN wide-value path.

    python scripts/probe_wide_attention.py --out probe.json      # on a GPU
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lragent.provenance import provenance


def _timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="probe_wide_attention.json")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    b, hq, hkv, t, d, r = a.batch, a.heads, a.kv_heads, a.seq, a.dim, a.rank
    q = torch.randn(b, hq, t, d, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(b, hkv, t, d + r, device=dev, dtype=dt, generator=g).requires_grad_()
    grad = torch.randn(b, hq, t, d + r, device=dev, dtype=dt, generator=g)
    scale = d**-0.5
    group = hq // hkv

    def padded(backend):
        def f():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(
                    F.pad(q, (0, r)), F.pad(k, (0, r)), v, is_causal=True, enable_gqa=True, scale=scale
                )

        return f

    def unpadded(backend, gqa=True):
        def f():
            kk, vv = (k, v) if gqa else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa, scale=scale)

        return f

    def split_lr():  # the base columns by FlashAttention at width D; the r low-rank columns by a second pass
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o_base = F.scaled_dot_product_attention(q, k, v[..., :d], is_causal=True, enable_gqa=True, scale=scale)
            vlr = F.pad(v[..., d:], (0, d - r))
            o_lr = F.scaled_dot_product_attention(q, k, vlr, is_causal=True, enable_gqa=True, scale=scale)
        return torch.cat([o_base, o_lr[..., :r]], -1)

    candidates = {
        "padded_flash (current)": padded(SDPBackend.FLASH_ATTENTION),
        "padded_cudnn": padded(SDPBackend.CUDNN_ATTENTION),
        "padded_default": None,
        "unpadded_cudnn_dv": unpadded(SDPBackend.CUDNN_ATTENTION),
        "unpadded_efficient_dv_gqa": unpadded(SDPBackend.EFFICIENT_ATTENTION),
        "unpadded_efficient_dv_expanded": unpadded(SDPBackend.EFFICIENT_ATTENTION, gqa=False),
        "two_flash_passes": split_lr,
    }

    def padded_default():
        return F.scaled_dot_product_attention(
            F.pad(q, (0, r)), F.pad(k, (0, r)), v, is_causal=True, enable_gqa=True, scale=scale
        )

    candidates["padded_default"] = padded_default

    # The whole decomposed attention of the shared pass (values per query role, B applied), both paths
    import os

    from lragent.attention import RoleSplit, decomposed_attention, two_piece_attention

    v_base = v[..., :d].detach().clone().requires_grad_()
    v_lr = v[:, 0, :, d:].detach().clone().requires_grad_()
    lora_b = (torch.randn(3, hkv * d, r, device=dev, generator=g) / r).to(dt).requires_grad_()
    cpu_g = torch.Generator().manual_seed(0)
    u = torch.randint(16, 501, (b,), generator=cpu_g)
    split = (t - u).clamp(min=0).to(dev)  # (B,) producer tokens per sequence
    producer = (torch.arange(b, device=dev) % 3 + 2) % 3  # 2, 0, 1, 2, ...
    consumer = (producer + 1) % 3
    roles = torch.where(torch.arange(t, device=dev)[None, :] < split[:, None], producer[:, None], consumer[:, None])
    layout = RoleSplit.make(producer, consumer, split, t)
    grad_d = grad[..., :d].contiguous()

    def decomposed(two_role: str):
        def f():
            os.environ["LRAGENT_WIDE_CUDNN"] = two_role
            return decomposed_attention(q, k, v_base, v_lr, lora_b, 2.0, roles, use_kernel=False)

        return f

    def two_piece():
        return two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout)

    extra = {
        "decomposed, Q/K padded (before)": decomposed("0"),
        "decomposed, cuDNN wide values": decomposed("1"),
        "decomposed, two-piece": two_piece,
    }
    with torch.no_grad():
        ref_dec = extra["decomposed, Q/K padded (before)"]().float()
    with torch.no_grad():
        ref = candidates["padded_flash (current)"]().float()
    rows = {}

    def plain():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v[..., :d], is_causal=True, enable_gqa=True, scale=scale)

    plain_grad = grad[..., :d].contiguous()
    rows["plain width D (λ = 0 step)"] = {
        "fwd_ms": _timed(lambda: plain(), a.iters),
        "fwd_bwd_ms": _timed(lambda: torch.autograd.backward(plain(), plain_grad), a.iters),
        "max_abs_diff": None,
    }

    def measure(fn, ref: torch.Tensor, out_grad: torch.Tensor) -> dict:
        """Forward and forward + backward time of ``fn`` and its largest difference to ``ref``; a backend that
        refuses these shapes is recorded, not fatal."""
        try:
            with torch.no_grad():
                diff = (fn().float() - ref).abs().max().item()
            return {
                "fwd_ms": _timed(fn, a.iters),
                "fwd_bwd_ms": _timed(lambda: torch.autograd.backward(fn(), out_grad), a.iters),
                "max_abs_diff": diff,
            }
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}

    # (not ``group``: the expanded-heads candidate reads that name, the GQA group size, when it runs)
    for fns, fns_ref, fns_grad in ((candidates, ref, grad), (extra, ref_dec, grad_d)):
        for name, fn in fns.items():
            rows[name] = measure(fn, fns_ref, fns_grad)
            print(name, rows[name], flush=True)

    def input_grads(fn) -> list[torch.Tensor]:
        inputs = [q, k, v_base, v_lr, lora_b]
        return [x.float() for x in torch.autograd.grad(fn(), inputs, grad_d)]

    try:  # the two-piece form's gradients against the cuDNN wide-value path's, per input (largest |diff|, |grad|)
        names = ("q", "k", "v_base", "v_lr", "lora_b")
        wide, ours = input_grads(extra["decomposed, cuDNN wide values"]), input_grads(two_piece)
        rows["decomposed, two-piece"]["grad_max_abs_diff"] = {
            n: [(a - w).abs().max().item(), w.abs().max().item()] for n, a, w in zip(names, ours, wide, strict=True)
        }
        print("two-piece gradients", rows["decomposed, two-piece"]["grad_max_abs_diff"], flush=True)
    except Exception as e:
        rows["decomposed, two-piece"]["grad_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        varlen_sig = str(inspect.signature(varlen_attn))
    except ImportError as e:
        varlen_sig = f"unavailable: {e}"
    base = rows["plain width D (λ = 0 step)"]["fwd_bwd_ms"]
    for row in rows.values():
        if "fwd_bwd_ms" in row:
            row["vs_plain"] = round(row["fwd_bwd_ms"] / base, 3)
    result = {
        "shapes": {"batch": b, "heads": hq, "kv_heads": hkv, "seq": t, "dim": d, "rank": r, "dtype": "bfloat16"},
        "split": {"per_row": split.tolist(), "consumer_rows": layout.rows.n_rows},
        "rows": rows,
        "varlen_attn_signature": varlen_sig,
        "provenance": provenance(device="cuda", dtype=dt),
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, row in rows.items():
        print(
            f"{name:34s} "
            + (
                f"fwd {row['fwd_ms']:.3f} ms  fwd+bwd {row['fwd_bwd_ms']:.3f} ms  ×{row['vs_plain']}"
                f"  maxdiff {row['max_abs_diff']}"
                if "fwd_ms" in row
                else row["error"]
            )
        )


if __name__ == "__main__":
    main()
