"""Where the shared pass's two-piece attention spends its time (issue 19), at 8B attention shapes on a GPU:
``lragent.attention.two_piece_attention`` forward + backward against the plain pass's causal attention (the cost
it should match), the per-query path over ``[V_base | V_lr]`` (before), the consumer-row kernels alone, and a
torch-profiler kernel table of the whole two-piece forward + backward.

    python scripts/profile_two_piece.py --out DIR      # writes DIR/profile_two_piece.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.consumer_rows import consumer_backward, consumer_lr_forward  # noqa: E402
from lragent.attention import RoleSplit, _delta_b, decomposed_attention, two_piece_attention  # noqa: E402
from lragent.provenance import provenance  # noqa: E402
from scripts.probe_wide_attention import _timed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--u_max", type=int, default=64, help="consumer rows per sequence drawn from [16, u_max]")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, hq, hkv, t, d, r = 4, 32, 8, 2048, 128, 8
    g = torch.Generator(device=dev).manual_seed(0)

    def token_major(*shape: int) -> torch.Tensor:  # (B, T, H, D) underneath, viewed (B, H, T, D): as in the model
        x = torch.randn(shape[0], shape[2], shape[1], shape[3], device=dev, dtype=dt, generator=g)
        return x.transpose(1, 2).detach().requires_grad_()

    q, k, v_base = token_major(b, hq, t, d), token_major(b, hkv, t, d), token_major(b, hkv, t, d)
    v_lr = torch.randn(b, t, r, device=dev, dtype=dt, generator=g).requires_grad_()
    lora_b = (torch.randn(3, hkv * d, r, device=dev, generator=g) / r).to(dt).requires_grad_()
    u = torch.randint(16, a.u_max + 1, (b,), generator=torch.Generator().manual_seed(0))
    split = (t - u).to(dev)
    producer = torch.tensor([2, 0, 1, 2][:b], device=dev)
    consumer = (producer + 1) % 3
    layout = RoleSplit.make(producer, consumer, split, t)
    roles = torch.where(torch.arange(t, device=dev)[None, :] < split[:, None], producer[:, None], consumer[:, None])
    rows: dict[str, dict] = {}

    def fb(name, fn):
        o = fn()
        gr = torch.randn_like(o)
        rows[name] = {
            "fwd_ms": _timed(lambda: fn(), a.iters),
            "fwd_bwd_ms": _timed(lambda: torch.autograd.backward(fn(), gr), a.iters),
        }
        print(f"{name:<52} fwd {rows[name]['fwd_ms']:.3f}  fwd+bwd {rows[name]['fwd_bwd_ms']:.3f} ms", flush=True)

    fb("plain causal D=128 (the plain pass)", lambda: F.scaled_dot_product_attention(q, k, v_base, is_causal=True,
                                                                                      enable_gqa=True))  # fmt: skip
    fb("two_piece_attention (now)", lambda: two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout))
    fb("per-query over [V_base | V_lr] (LRAGENT_TWO_PIECE=0)",
       lambda: decomposed_attention(q, k, v_base, v_lr, lora_b, 2.0, roles, use_kernel=False))  # fmt: skip
    with torch.no_grad():
        kk, lr, qq = k.detach(), v_lr.detach(), q.detach()
        db = _delta_b(lora_b.detach(), layout, hkv, 2.0)
        o = torch.zeros(b, t, hq, d, device=dev, dtype=dt).transpose(1, 2)
        lse, o_lr, _ = consumer_lr_forward(qq, kk, lr, db, o, layout.rows)
        n = layout.rows.n_rows
        grad = torch.randn_like(o)
        rows["consumer kernels alone"] = {
            "fwd_ms": _timed(lambda: consumer_lr_forward(qq, kk, lr, db, o, layout.rows), a.iters),
            "bwd_ms": _timed(lambda: consumer_backward(grad, qq, kk, lr, db, layout.rows, lse, o_lr), a.iters),
            "rows": n,
        }
    print("consumer kernels alone", rows["consumer kernels alone"], flush=True)
    gr = torch.randn_like(two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.backward(two_piece_attention(q, k, v_base, v_lr, lora_b, 2.0, layout), gr)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
    print(table, flush=True)
    res = {
        "shapes": {"batch": b, "heads": hq, "kv_heads": hkv, "seq": t, "dim": d, "rank": r, "dtype": "bfloat16"},
        "split": split.tolist(),
        "rows": rows,
        "profile_5_fwd_bwd": table,
        "provenance": provenance(dtype=dt, device="cuda"),
    }
    (out / "profile_two_piece.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
