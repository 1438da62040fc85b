"""Where the shared pass's two-piece attention spends its time (issue 19): each piece of
``lragent.attention.two_piece_attention`` timed alone (forward + backward) at 8B attention shapes, candidate
kernels for the consumer piece (the rows ``[lo, T)`` over all keys, bottom-right causal) side by side, and a
torch-profiler kernel table of one whole forward + backward.

    python scripts/profile_two_piece.py --out DIR      # on a GPU; writes DIR/profile_two_piece.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from lragent.attention import RoleSplit, _role_values, _sdpa, two_piece_attention  # noqa: E402
from lragent.provenance import provenance  # noqa: E402
from scripts.probe_wide_attention import _timed as timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--u_max", type=int, default=64)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, hq, hkv, t, d, r = 4, 32, 8, 2048, 128, 8
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, hq, t, d, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=g).requires_grad_()
    v_base = torch.randn(b, hkv, t, d, device=dev, dtype=dt, generator=g).requires_grad_()
    v_lr = torch.randn(b, t, r, device=dev, dtype=dt, generator=g).requires_grad_()
    lora_b = (torch.randn(3, hkv * d, r, device=dev, generator=g) / r).to(dt).requires_grad_()
    u = torch.randint(16, a.u_max + 1, (b,), generator=torch.Generator().manual_seed(0))
    split = (t - u).to(dev)
    producer = torch.tensor([2, 0, 1, 2][:b], device=dev)
    consumer = (producer + 1) % 3
    layout = RoleSplit.make(producer, consumer, split, t)
    lo, hi = layout.lo, layout.hi
    rows: dict[str, dict] = {}

    def fb(name, fn):
        o = fn()
        gr = torch.randn_like(o)
        rows[name] = {
            "fwd_ms": timed(lambda: fn()),
            "fwd_bwd_ms": timed(lambda: torch.autograd.backward(fn(), gr)),
            "rows": int(o.shape[-2]) if o.dim() == 4 else int(o.shape[0]),
        }
        print(f"{name:<48} fwd {rows[name]['fwd_ms']:.3f}  fwd+bwd {rows[name]['fwd_bwd_ms']:.3f} ms", flush=True)

    fb(
        "plain causal D=128 (default backend)",
        lambda: F.scaled_dot_product_attention(q, k, v_base, is_causal=True, enable_gqa=True),
    )
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):

        def f(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v_base, is_causal=True, enable_gqa=True)

        try:
            fb(f"plain causal D=128 ({name})", f)
        except RuntimeError as exc:
            rows[f"plain causal D=128 ({name})"] = {"error": str(exc)[:200]}
    fb("whole two_piece_attention", lambda: two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout))
    v_rows = v_base.detach().transpose(1, 2).reshape(b, t, hkv * d).requires_grad_()  # token-major, as in the model
    fb("V_cons build (token-major)", lambda: _role_values(v_rows, v_lr, lora_b, consumer, 2.0))
    vc = _role_values(v_rows, v_lr, lora_b, consumer, 2.0).view(b, t, hkv, d).transpose(1, 2)
    vc = vc.detach().requires_grad_()
    fb("producer call (_sdpa rows [0,hi))", lambda: _sdpa(q[:, :, :hi], k[:, :, :hi], vc[:, :, :hi], None))
    fb(f"consumer call (_sdpa rows [{lo},T), lower-right)", lambda: _sdpa(q[:, :, lo:], k, vc, None))
    grp = hq // hkv

    def cons_expanded():
        from torch.nn.attention.bias import causal_lower_right

        ke, ve = k.repeat_interleave(grp, 1), vc.repeat_interleave(grp, 1)
        return F.scaled_dot_product_attention(q[:, :, lo:], ke, ve, attn_mask=causal_lower_right(t - lo, t))

    fb("consumer, KV heads expanded, lower-right", cons_expanded)
    mask = torch.arange(t, device=dev)[None, :] <= torch.arange(lo, t, device=dev)[:, None]

    def cons_mask():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q[:, :, lo:], k, vc, attn_mask=mask, enable_gqa=True)

    try:
        fb("consumer, cuDNN with a boolean mask", cons_mask)
    except RuntimeError as exc:
        rows["consumer, cuDNN with a boolean mask"] = {"error": str(exc)[:200]}

    def cons_pad_causal():  # rows [lo, T) as the last rows of a full causal call: queries padded in front
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, vc, is_causal=True, enable_gqa=True)[:, :, lo:]

    fb("consumer as a full causal call (reference cost)", cons_pad_causal)
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        print("varlen_attn signature:", inspect.signature(varlen_attn), flush=True)
        rows["varlen_signature"] = {"sig": str(inspect.signature(varlen_attn))}
    except Exception as exc:  # noqa: BLE001
        rows["varlen_signature"] = {"error": str(exc)[:200]}

    o = two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout)
    gr = torch.randn_like(o)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.backward(two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout), gr)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
    print(table, flush=True)
    res = {
        "lo": lo,
        "hi": hi,
        "split": split.tolist(),
        "rows": rows,
        "profile_5_fwd_bwd": table,
        "provenance": provenance(dtype=dt, device="cuda"),
    }
    (out / "profile_two_piece.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
