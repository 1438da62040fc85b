"""FLOPs of one training epoch of an embedded-model config, and measured optimizer steps on this machine.

FLOPs are counted exactly, batch by batch over the real epoch (the config's data path: packing, token budget), by
running the model on PyTorch's ``meta`` device under ``torch.utils.flop_counter.FlopCounterMode``: the training step
(forward at every position, LM head at the supervised positions only, backward) and the plain validation forward.
Attention is counted as the math kernel computes it (the full T x T product); a causal flash kernel skips about half
of that. Then ``--time-steps N`` runs N real optimizer steps (AdamW, gradient clipping) with the real weights on
``--device`` (fp32 on CPU; bf16 autocast on CUDA) and reports tokens per second and achieved FLOP/s.

    python scripts/estimate_train_cost.py --config configs/embedded_hotpotqa.yaml --time-steps 3 --max-tokens 2048
    python scripts/estimate_train_cost.py --config configs/embedded_hotpotqa.yaml --device cuda --time-steps 20

Writes ``--out`` JSON (with provenance) when given.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

TARGETS = {"qv": ("q_proj", "v_proj"), "qvo_mlp": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


def load_data(cfg: dict[str, Any], max_tokens: int | None) -> Any:
    from datamodules.role_examples import RoleExampleDataModule

    d = dict(cfg["data"])
    if max_tokens is not None:
        d["max_tokens"] = max_tokens
    dm = RoleExampleDataModule(
        d["data_files"], roles=cfg["model"].get("roles"), tokenizer=cfg["model"].get("model_name", "default"),
        max_length=d["max_length"], batch_size=d["batch_size"], val_fraction=d["val_fraction"], seed=d["seed"],
        pool_batches=d["pool_batches"], pack_prefixes=d["pack_prefixes"], max_tokens=d["max_tokens"], pin_memory=False,
    )  # fmt: skip
    dm.setup()
    return dm


def lora_config(cfg: dict[str, Any], targets: str | None, rank: int | None) -> Any:
    from lragent.multi_lora import MultiLoraConfig

    m = cfg["model"]
    r = rank or m["rank"]
    return MultiLoraConfig(
        roles=tuple(m.get("roles") or ("plan", "action", "reflect")),
        rank=r,
        alpha=2.0 * r if rank else m["alpha"],
        dropout=m["dropout"],
        targets=TARGETS[targets] if targets else tuple(m["targets"]),
        shared_a=m["shared_a"],
    )


def module_on(device: str, lcfg: Any, model_name: str) -> Any:
    """A :class:`MultiLoraModule` whose model lives on ``device`` (``meta``: no weights, shapes only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_modules.multi_lora_module import MultiLoraModule
    from lragent.lora_model import MultiLoraModel
    from lragent.models import registered_source

    m = MultiLoraModule(
        model_name=model_name, roles=list(lcfg.roles), rank=lcfg.rank, alpha=lcfg.alpha, dropout=lcfg.dropout,
        targets=list(lcfg.targets), shared_a=lcfg.shared_a, val_schemes=[],
    )  # fmt: skip
    if device == "meta":
        source = registered_source(model_name)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
        m.lora_model = MultiLoraModel(hf, lcfg)
        m.lora_model.model.train()
        return m
    m.configure_model()
    return m.to(device)


def to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def count_epoch(m: Any, dm: Any) -> dict[str, float]:
    """Exact FLOPs of one training epoch and one plain validation, on the meta device."""
    train = {"total": 0.0, "attention": 0.0, "tokens": 0, "batches": 0}
    for batch in dm.train_dataloader():
        with FlopCounterMode(display=False) as fc:
            m.compute_loss(to(batch, "meta"))["loss"].backward()
        counts = fc.get_flop_counts()["Global"]
        train["total"] += fc.get_total_flops()
        train["attention"] += sum(v for k, v in counts.items() if "bmm" in str(k) or "attention" in str(k))
        train["tokens"] += batch["n_tokens"]
        train["batches"] += 1
        m.lora_model.model.zero_grad(set_to_none=True)
    val = {"total": 0.0, "tokens": 0}
    with torch.no_grad():
        for batch in dm.val_dataloader():
            with FlopCounterMode(display=False) as fc:
                m.plain_logits(to(batch, "meta"))
            val["total"] += fc.get_total_flops()
            val["tokens"] += batch["n_tokens"]
    return {
        "train_flops": train["total"],
        "train_attention_flops": train["attention"],
        "train_tokens": train["tokens"],
        "train_batches": train["batches"],
        "train_flops_per_token": train["total"] / train["tokens"],
        "val_flops": val["total"],
        "val_tokens": val["tokens"],
    }


def batch_flops(meta: Any, batch: dict[str, Any]) -> float:
    """FLOPs of one training step on ``batch`` (counted on the meta-device module)."""
    with FlopCounterMode(display=False) as fc:
        meta.compute_loss(to(batch, "meta"))["loss"].backward()
    meta.lora_model.model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


def time_steps(m: Any, meta: Any, dm: Any, device: str, steps: int) -> dict[str, float]:
    """``steps`` real optimizer steps on ``device`` after one warm-up step; tokens/s and FLOP/s.

    The timed steps run without a FLOP counter (it would slow them); their FLOPs are counted on ``meta``.
    """
    opt = torch.optim.AdamW(m.param_groups())
    batches = list(dm.train_dataloader())
    cuda = device.startswith("cuda")
    flops = tokens = elapsed = 0.0
    for i in range(steps + 1):
        batch = batches[i % len(batches)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = m.compute_loss(to(batch, device))["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(m.lora_model.lora_parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if i > 0:  # the first step is warm-up
            elapsed += time.perf_counter() - start
            flops += batch_flops(meta, batch)
            tokens += batch["n_tokens"]
    return {"steps": steps, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "flops_per_s": flops / elapsed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "embedded_hotpotqa.yaml"))
    p.add_argument("--targets", choices=sorted(TARGETS), default=None, help="default: the config's")
    p.add_argument("--rank", type=int, default=None, help="default: the config's (alpha = 2 x rank when given)")
    p.add_argument("--device", default="cpu", help="where to time steps: cpu or cuda")
    p.add_argument("--time-steps", type=int, default=0, help="optimizer steps to time (0: count FLOPs only)")
    p.add_argument("--max-tokens", type=int, default=None, help="token budget of the timed batches (default: config)")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    cfg = yaml.safe_load(Path(args.config).read_text())
    lcfg = lora_config(cfg, args.targets, args.rank)
    name = cfg["model"].get("model_name", "default")
    result: dict[str, Any] = {"config": args.config, "lora": lcfg.to_dict(), "max_tokens": cfg["data"]["max_tokens"]}
    dm = load_data(cfg, None)
    meta = module_on("meta", lcfg, name)
    result["epoch"] = count_epoch(meta, dm)
    e = result["epoch"]
    print(
        f"epoch: {e['train_batches']} optimizer steps, {e['train_tokens']:,} tokens, "
        f"{e['train_flops'] / 1e15:.3f} PFLOP training ({e['train_flops_per_token'] / 1e6:.0f} MFLOP/token, "
        f"{100 * e['train_attention_flops'] / e['train_flops']:.0f}% attention as the math kernel counts it), "
        f"+ {e['val_flops'] / 1e15:.3f} PFLOP validation ({e['val_tokens']:,} tokens)"
    )
    if args.time_steps > 0:
        timed_dm = load_data(cfg, args.max_tokens) if args.max_tokens else dm
        timing = time_steps(module_on(args.device, lcfg, name), meta, timed_dm, args.device, args.time_steps)
        result["timing"] = {**timing, "device": args.device, "max_tokens": args.max_tokens or cfg["data"]["max_tokens"]}
        print(
            f"timed {timing['steps']} steps on {args.device}: {timing['tokens_per_s']:,.0f} tokens/s, "
            f"{timing['flops_per_s'] / 1e12:.2f} TFLOP/s; one epoch at that rate: "
            f"{(e['train_flops'] + e['val_flops']) / timing['flops_per_s']:.0f} s"
        )
    if args.out:
        from eval_suite.report import write_json
        from lragent.provenance import provenance

        dtype = "bf16-mixed" if args.device.startswith("cuda") else "float32"
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out), {**result, "provenance": provenance(dtype=dtype, device=args.device)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
