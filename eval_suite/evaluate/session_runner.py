"""`lragent session`: a fixed multi-agent schedule on a real HotpotQA question under one sharing scheme.

The trajectory starts with the AutoAct HotpotQA prompt and a development question; the agents then take turns
(plan, plan, action per cycle, with one of the question's own Wikipedia paragraphs appended as the observation
of each cycle; then two reflect steps), every step going through :class:`~lragent.session.MultiAgentSession`.
The result JSON is rewritten after every step, so an interrupted run keeps what it did.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eval_suite.report import check_writable
from lragent.agents.prompts import HOTPOTQA, RESPONSE, initial_text
from lragent.command import on_interrupt
from lragent.loading import check_model_args, load_lora_model, resolve_device
from lragent.memory_plan import check_session
from lragent.paths import DATA_DIR
from lragent.provenance import provenance
from lragent.report_io import write_json
from lragent.roles import DEFAULT_ROLES
from lragent.schemes import Scheme
from lragent.session import MultiAgentSession


def _load_question(index: int, split: str = "dev") -> dict:
    """The ``index``-th HotpotQA easy question of ``split`` (its record, with the context paragraphs)."""
    from eval_suite.evaluate.benchmarks import HOTPOTQA

    splits = HOTPOTQA.parse_splits(split)
    if len(splits) != 1:
        raise ValueError(f"--split {split!r}: a session runs one question; allowed one of {', '.join(HOTPOTQA.splits)}")
    path = HOTPOTQA.level_file("easy", DATA_DIR, splits[0])
    lines = [line for line in path.read_text().splitlines() if line.strip()]
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


def run(
    *,
    scheme: Scheme,
    model: str,
    adapters: str | None,
    adapter_init: str | None,
    rank: int,
    alpha: float,
    independent_a: bool,
    schedule: str,
    question: int,
    split: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    droidspeak_layers: list[int] | None,
    dtype: str,
    device: str,
    use_kernel: bool,
    cuda_graphs: bool,
    out: str,
    quiet: bool,
) -> dict:
    """Runs the schedule and writes ``out`` after every step; returns the result (arguments as :func:`session`)."""
    record = _load_question(question, split)
    steps = build_schedule(schedule, record)
    text_bytes = sum(len(text.encode()) for _, text in steps) + len(steps) * (max_new_tokens + 1)
    check_session(model, scheme, text_bytes, dtype=dtype, device=device, rank=rank, shared_a=not independent_a,
                  droidspeak_layers=droidspeak_layers)  # fmt: skip
    lm, tokenizer = load_lora_model(
        model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha, shared_a=not independent_a,
        seed=seed, dtype=dtype, device=device,
    )  # fmt: skip
    sess = MultiAgentSession(
        lm,
        scheme,
        tokenizer=tokenizer,
        seed=seed,
        use_kernel=use_kernel,
        droidspeak_layers=droidspeak_layers,
        cuda_graphs=None if cuda_graphs else False,
    )
    out_path = Path(out)
    result = {
        "scheme": sess.scheme.value,
        "model": model,
        "schedule": schedule,
        "question": question,
        "split": split,
        "adapters": adapters or f"init:{adapter_init}",
        "seed": seed,
        "question_id": record["id"],
        "steps": [],
        "cache_bytes": {},
        "peak_cache_bytes": 0,
        "provenance": provenance(dtype=dtype, device=device),
    }
    for i, (role, text) in enumerate(steps):
        sess.append_text(text)
        step = sess.step(role, max_new_tokens=max_new_tokens, temperature=temperature, stop=["\n"])
        result["steps"].append(step.to_dict())
        result["cache_bytes"] = sess.cache_bytes()
        result["peak_cache_bytes"] = sess.peak_cache_bytes
        result["num_tokens"] = sess.num_tokens
        write_json(out_path, result)
        if not quiet:
            print(
                f"[{i + 1:2d}/{len(steps)}] {role:8s} prefill {step.prefill_tokens:5d} tok {step.prefill_s:6.3f}s "
                f"decode {len(step.generated_ids):3d} tok {step.decode_s:6.3f}s | {step.text[:60]!r}",
                file=sys.stderr,
            )
    return result


def session(
    scheme: str = "base_lr_shared",
    model: str = "default",
    adapters: str | None = None,
    adapter_init: str | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    independent_a: bool = False,
    schedule: str = "agent",
    question: int = 0,
    split: str = "dev",
    max_new_tokens: int = 24,
    temperature: float = 0.0,
    seed: int = 0,
    droidspeak_layers: list[int] | None = None,
    dtype: str = "float32",
    device: str | None = None,
    use_kernel: bool = True,
    cuda_graphs: bool = True,
    out: str = "result.json",
    quiet: bool = False,
) -> int:
    """A fixed multi-agent schedule on a real HotpotQA question under one sharing scheme.

    Every step goes through one MultiAgentSession; the result JSON (per-step prefill/decode tokens and times, cache
    bytes, peak cache) is rewritten after every step, so an interrupted run keeps what it did.

    Args:
        scheme: non_shared, full_shared, droidspeak, base_shared or base_lr_shared.
        model: base model: default (embedded SmolLM2-135M-Instruct), a hub name or a local directory.
        adapters: adapter directory (native checkpoint or PEFT role directories).
        adapter_init: zero (untrained) or random (demo) adapters instead of --adapters (default random).
        rank: LoRA rank for --adapter_init.
        alpha: LoRA alpha for --adapter_init.
        independent_a: one A per role (conventional multi-LoRA) for --adapter_init.
        schedule: agent (17 steps), short (plan, action, reflect) or roles (each role twice).
        question: index of the HotpotQA (easy) question within --split.
        split: the question's split: dev (default) or test (recorded in the result).
        max_new_tokens: generation budget of each step (>= 1).
        temperature: sampling temperature (0: greedy).
        seed: adapter init and sampling seed.
        droidspeak_layers: layers DroidSpeak recomputes, e.g. [10,11,12] (default: the middle third).
        dtype: compute dtype (float32, bfloat16, float16).
        device: cpu, cuda, cuda:N or mps (default cuda when available).
        use_kernel: the fused Flash-LoRA-Attention kernel on CUDA (false: the PyTorch attention path).
        cuda_graphs: decode with CUDA graphs on CUDA (false: eager, for debugging).
        out: result JSON file.
        quiet: no per-step lines.

    Returns:
        0 on success.
    """
    parsed = Scheme.parse(scheme)  # the one parse of --scheme: the session and the engine take the Scheme
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: allowed {', '.join(SCHEDULES)}")
    if adapters is None and adapter_init is None:
        adapter_init = "random"
    check_model_args(
        model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha, dtype=dtype,
        device=device, roles=DEFAULT_ROLES, needs_text=True,
    )  # fmt: skip
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if parsed is Scheme.BASE_LR_SHARED and independent_a and not adapters:
        raise ValueError("--scheme base_lr_shared needs shared A: drop --independent_a or use base_shared")
    _load_question(question, split)
    check_writable(out, is_dir=False)
    device = resolve_device(device)
    on_interrupt(f"the steps done so far are in {out}")
    result = run(
        scheme=parsed, model=model, adapters=adapters, adapter_init=adapter_init, rank=rank, alpha=alpha,
        independent_a=independent_a, schedule=schedule, question=question, split=split, max_new_tokens=max_new_tokens,
        temperature=temperature, seed=seed, droidspeak_layers=droidspeak_layers, dtype=dtype, device=device,
        use_kernel=use_kernel, cuda_graphs=cuda_graphs, out=out, quiet=quiet,
    )  # fmt: skip
    total = sum(s["prefill_tokens"] + len(s["generated_ids"]) for s in result["steps"])
    print(
        f"{result['scheme']}: {len(result['steps'])} steps, {total} processed tokens, "
        f"peak cache {result['peak_cache_bytes'] / 2**20:.2f} MiB -> {out}"
    )
    return 0
