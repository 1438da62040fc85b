"""`python cli.py session`: a fixed multi-agent schedule on a real HotpotQA question under one sharing scheme.

The trajectory starts with the AutoAct HotpotQA prompt and a development question; the agents then take turns
(plan, plan, action per cycle, with one of the question's own Wikipedia paragraphs appended as the observation
of each cycle; then two reflect steps), every step going through :class:`~lragent.session.MultiAgentSession`.
The result JSON is rewritten after every step, so an interrupted run keeps what it did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from lragent.adapters_io import adapter_config_of, load_adapter_dir
from lragent.agents.prompts import HOTPOTQA, RESPONSE, initial_text
from lragent.lora_model import MultiLoraModel
from lragent.models import NAMED_ARCHITECTURES, check_device, load_model, parse_dtype
from lragent.multi_lora import MultiLoraConfig
from lragent.paths import DATA_DIR
from lragent.provenance import provenance
from lragent.roles import DEFAULT_ROLES
from lragent.schemes import SCHEMES, Scheme
from lragent.session import MultiAgentSession


def _load_question(index: int) -> dict:
    path = DATA_DIR / "benchmarks" / "hotpotqa_easy.jsonl"
    lines = path.read_text().splitlines()
    if not 0 <= index < len(lines):
        raise ValueError(f"--question {index} out of range: allowed 0..{len(lines) - 1}")
    return json.loads(lines[index])


def build_schedule(name: str, question: dict) -> list[tuple[str, str]]:
    """The (role, appended text) steps of a built-in schedule.

    Args:
        name: ``agent`` (the paper's 17-step iteration: plan/plan/action ×5, then two reflect steps), ``short``
            (plan, action, reflect) or ``roles`` (plan, action, reflect, plan, action, reflect: every role's last
            step at the end, for memory comparisons).
        question: a HotpotQA record (question and its context paragraphs).
    """
    paragraphs = [
        f"{t}: {''.join(s).strip()}"
        for t, s in zip(question["context"]["title"], question["context"]["sentences"], strict=True)
    ]
    head = initial_text(HOTPOTQA, question["question"].strip())
    if name == "agent":
        steps: list[tuple[str, str]] = []
        for c in range(5):
            thought = head if c == 0 else f"\nObversation: {paragraphs[c % len(paragraphs)]}\nThought: {RESPONSE}"
            steps += [
                ("plan", thought),
                ("plan", f"\nAction: {RESPONSE}"),
                ("action", f"\nAciton: Retrieve[{RESPONSE}"),
            ]
        steps += [
            ("reflect", f"]\nObversation: Please reflect your answer.\nThought: {RESPONSE}"),
            ("reflect", f"\nAction: Reflect[{RESPONSE}"),
        ]
        return steps
    if name == "short":
        return [("plan", head), ("action", f"\nAciton: Retrieve[{RESPONSE}"), ("reflect", f"]\nThought: {RESPONSE}")]
    if name == "roles":
        ctx = head + "".join(f"Obversation: {p}\n" for p in paragraphs[:4])
        return [
            ("plan", ctx),
            ("action", f"\nAciton: Retrieve[{RESPONSE}"),
            ("reflect", f"]\nThought: {RESPONSE}"),
            ("plan", f"\nThought: {RESPONSE}"),
            ("action", f"\nAction: {RESPONSE}"),
            ("reflect", f"\nThought: {RESPONSE}"),
        ]
    raise ValueError(f"unknown schedule {name!r}: allowed agent, short, roles")


SCHEDULES = ("agent", "short", "roles")


def build_model(args: argparse.Namespace) -> tuple[MultiLoraModel, object]:
    """The base model with adapters: loaded from ``--adapters`` or initialised by ``--adapter-init``."""
    if args.adapters:
        lora_cfg = adapter_config_of(args.adapters)
    else:
        lora_cfg = MultiLoraConfig(rank=args.rank, alpha=args.alpha, dropout=0.0, shared_a=not args.independent_a)
    hf, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has random weights and no tokenizer: the session job needs text")
    model = MultiLoraModel(hf, lora_cfg)
    if args.adapters:
        load_adapter_dir(model, args.adapters)
    else:
        model.init_adapters(args.adapter_init, seed=args.seed)
    return model.eval(), tokenizer


def model_from_args(args: argparse.Namespace) -> tuple[MultiLoraModel, object]:
    """:func:`build_model` for any command's arguments (``model``, ``adapters``, ``adapter_init``, ``seed``, ``rank``,
    ``alpha``, ``dtype``, ``device``; ``device`` None picks CUDA when there is one)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} but CUDA is not available: allowed cpu")
    ns = argparse.Namespace(
        adapters=args.adapters,
        rank=args.rank,
        alpha=args.alpha,
        independent_a=getattr(args, "independent_a", False),
        model=args.model,
        dtype=args.dtype,
        device=device,
        adapter_init=args.adapter_init,
        seed=args.seed,
    )
    return build_model(ns)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict:
    """Runs the schedule and writes ``args.out``; returns the result."""
    question = _load_question(args.question)
    steps = build_schedule(args.schedule, question)
    model, tokenizer = build_model(args)
    session = MultiAgentSession(
        model,
        args.scheme,
        tokenizer=tokenizer,
        seed=args.seed,
        use_kernel=not args.no_kernel,
        droidspeak_layers=args.droidspeak_layers,
        cuda_graphs=False if args.no_graphs else None,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "scheme": session.scheme.value,
        "model": args.model,
        "schedule": args.schedule,
        "adapters": args.adapters or f"init:{args.adapter_init}",
        "seed": args.seed,
        "question_id": question["id"],
        "steps": [],
        "cache_bytes": {},
        "peak_cache_bytes": 0,
        "provenance": provenance(dtype=args.dtype, device=args.device),
    }
    for i, (role, text) in enumerate(steps):
        session.append_text(text)
        step = session.step(role, max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop=["\n"])
        result["steps"].append(step.to_dict())
        result["cache_bytes"] = session.cache_bytes()
        result["peak_cache_bytes"] = session.peak_cache_bytes
        result["num_tokens"] = session.num_tokens
        _write_json(out, result)
        if not args.quiet:
            print(
                f"[{i + 1:2d}/{len(steps)}] {role:8s} prefill {step.prefill_tokens:5d} tok {step.prefill_s:6.3f}s "
                f"decode {len(step.generated_ids):3d} tok {step.decode_s:6.3f}s | {step.text[:60]!r}",
                file=sys.stderr,
            )
    return result


def add_model_args(p: argparse.ArgumentParser, adapter_init: str | None = None) -> None:
    """The model and adapter options every command that runs agents shares (read by :func:`model_from_args`)."""
    p.add_argument("--model", default="default", help="default (embedded SmolLM2-135M-Instruct), a hub name or dir")
    p.add_argument("--adapters", default=None, help="adapter directory (native checkpoint or PEFT role dirs)")
    p.add_argument("--adapter-init", default=adapter_init, help="zero (untrained) or random (demo), without --adapters")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank for --adapter-init")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha for --adapter-init")


def validate_model_args(args: argparse.Namespace, exactly_one: bool = False) -> None:
    """Checks the options of :func:`add_model_args`; ``exactly_one``: one of --adapters, --adapter-init is required."""
    if exactly_one and bool(args.adapters) == bool(args.adapter_init):
        raise ValueError("give exactly one of --adapters DIR and --adapter-init {zero,random}")
    if args.adapter_init not in (None, "zero", "random"):
        raise ValueError(f"--adapter-init {args.adapter_init!r} not supported: allowed zero, random")
    if args.adapters and not Path(args.adapters).is_dir():
        raise FileNotFoundError(f"--adapters {args.adapters!r}: no such directory")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cli.py session", description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="base_lr_shared", help=f"one of {', '.join(SCHEMES)}")
    add_model_args(p, adapter_init="random")
    p.add_argument("--independent-a", action="store_true", help="one A per role (conventional multi-LoRA)")
    p.add_argument("--schedule", default="agent", help=f"one of {', '.join(SCHEDULES)}")
    p.add_argument("--question", type=int, default=0, help="index of the HotpotQA (easy) dev question")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--droidspeak-layers",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=None,
        help="comma-separated layers DroidSpeak recomputes",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-kernel", action="store_true", help="use the PyTorch attention path even on CUDA")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly on CUDA (no CUDA graphs), for debugging")
    p.add_argument("--out", default="result.json")
    p.add_argument("--quiet", action="store_true")
    return p


def validate(args: argparse.Namespace) -> None:
    """Checks arguments up front; raises ValueError / FileNotFoundError with one-line messages."""
    Scheme.parse(args.scheme)
    if args.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {args.schedule!r}: allowed {', '.join(SCHEDULES)}")
    validate_model_args(args)
    if args.rank <= 0:
        raise ValueError(f"--rank must be a positive integer, got {args.rank}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.scheme == "base_lr_shared" and args.independent_a and not args.adapters:
        raise ValueError("--scheme base_lr_shared needs shared A: drop --independent-a or use base_shared")
    if args.model.lower() in NAMED_ARCHITECTURES:
        raise ValueError(f"--model {args.model!r} has random weights and no tokenizer: the session job needs text")
    check_device(args.device)
    if args.adapters:
        adapter_config_of(args.adapters, roles=DEFAULT_ROLES)


def main(argv: list[str] | None = None) -> int:
    from lragent.command import parse_with_config

    args = parse_with_config(make_parser(), argv)
    if isinstance(args, int):  # --print_config done (0), or a bad --config (2)
        return args
    try:
        validate(args)
        from eval_suite.report import check_writable

        check_writable(args.out, is_dir=False)
        result = run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a hub name that is neither local nor reachable
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: could not load model {args.model!r}: {first}", file=sys.stderr)
        return 2
    total = sum(s["prefill_tokens"] + len(s["generated_ids"]) for s in result["steps"])
    print(
        f"{result['scheme']}: {len(result['steps'])} steps, {total} processed tokens, "
        f"peak cache {result['peak_cache_bytes'] / 2**20:.2f} MiB -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
