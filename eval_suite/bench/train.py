"""`lragent bench train`: training-step speed of the multi-LoRA LightningModule against a plain PEFT loop.

For one model (a named random-weight architecture such as ``llama-3.1-8b``: speed does not depend on the values; the
embedded model; or a tiny config for CI) and one batch of settings, it times in one run:

- **lragent**: :class:`~lit_modules.multi_lora_module.MultiLoraModule` under a Lightning ``Trainer`` (the path of
  ``lragent fit``): role examples from :class:`~datamodules.role_examples.RoleExampleDataModule`, the given precision
  (``bf16-mixed``: bfloat16 frozen base, float32 adapters), gradient checkpointing on or off, at every λ of
  ``lambdas`` (λ > 0 adds the cache-sharing-aware term); with ``pack_prefixes`` also λ = 0 on prefix-packed
  sequences (the packed data path; packing is refused with λ > 0);
- **peft**: what a user would otherwise run: transformers + peft, one LoRA per role (``add_adapter``), the same
  batches; each batch's rows of one role go through ``set_adapter(role)`` and one forward/backward (the
  supervised-token mean over the whole batch, as lragent's), then one AdamW step; autocast, checkpointing and the
  frozen base dtype as lragent's.

A step is timed from the end of the previous step to the end of this one (device synchronised): data loading,
the host-to-device copy, forward, backward and optimizer step. The first ``warmup_steps`` are not timed.

**Model FLOPs** (MFU = model FLOPs / step time / the GPU's dense bf16 peak). Per sequence of ``L`` real tokens,
per decoder layer, with ``P`` = Σ over the 7 frozen projections of ``d_in·d_out`` (q, k, v, o, gate, up, down),
``R`` = Σ over the LoRA targets of ``r·(d_in + d_out)``, and ``H_q·D`` the query width:

- frozen projections: forward ``2·P·L``; backward ``2·P·L`` (only the gradient of the input: frozen weights get
  no weight gradient; that is why LoRA training is about 4·N·T, not 6·N·T);
- LoRA: forward ``2·R·L``; backward ``4·R·L`` (gradients of the input and of A and B);
- attention (causal): ``L·(L+1)/2`` query-key pairs, each ``4·H_q·D`` forward (QKᵀ and PV) and ``8·H_q·D``
  backward;
- LM head (``d·V``, frozen): ``2·d·V`` forward + ``2·d·V`` backward per **scored** position (lragent computes
  logits only at the supervised positions; the PEFT loop computes them at every position, which is not counted);
- embeddings and norms: not counted.

Padding is not counted (real tokens only). Recomputation under gradient checkpointing is not counted (model FLOPs,
not hardware FLOPs). With λ > 0 the shared term is one more pass over the same tokens (the producer encodes the
context, the consumer the rest, over the same causal pairs), counted as equal to the plain pass; this over-counts
it by the producer's last layer after its K/V, which the forward skips (< 1/n_layers of the term). The autograd
skip of layer 0's q/k/v input gradients (nothing upstream needs them) is not subtracted either.

Writes ``bench_train.json`` (with provenance) and ``bench_train.md``; prints the table.

    lragent bench train --model llama-3.1-8b --seq_len 2048 --batch_size 4 --lambdas [0,0.5] --out DIR
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from datamodules.cross_role_prefixes import CROSS_ROLE_MIN_SHARE
from eval_suite.bench.model_flops import PEAK_BF16_FLOPS, ModelShape, peak_flops  # noqa: F401 (PEAK_BF16_FLOPS: re-exported)
from eval_suite.report import markdown_table, write_json, write_text
from lragent.provenance import provenance, provenance_footer

LINEARS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRECISIONS: tuple[str, ...] = ("bf16-mixed", "32-true", "32")


def pass_flops(shape: ModelShape, lengths: list[int], n_scored: int) -> float:
    """Model FLOPs of one forward + backward of LoRA training (frozen base) over causal sequences.

    Args:
        shape: the architecture and adapters.
        lengths: real tokens of each sequence (padding excluded).
        n_scored: positions whose logits the loss needs (the LM head runs there).

    Returns:
        FLOPs (see the module docstring for the count).
    """
    lin = shape.linear_shapes()
    p = sum(i * o for i, o in lin.values())  # frozen multiply-adds per token per layer
    r = sum(shape.rank * (lin[t][0] + lin[t][1]) for t in shape.targets)  # LoRA multiply-adds per token per layer
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    width = shape.n_heads * shape.head_dim
    per_layer = (2 + 2) * p * tokens + (2 + 4) * r * tokens + (4 + 8) * width * pairs
    head = (2 + 2) * shape.hidden * shape.vocab * n_scored
    return float(shape.n_layers * per_layer + head)


def step_flops(
    shape: ModelShape, lengths: list[int], n_scored: int, lambda_shared: float, lambda_mode: str = "weight"
) -> float:
    """Model FLOPs of one training step: the plain pass (λ < 1) plus the shared-term pass (λ > 0); one pass with
    ``lambda_mode: sample`` (either term costs one pass by this count)."""
    one = pass_flops(shape, lengths, n_scored)
    if lambda_mode == "sample":
        return one
    return one * ((lambda_shared < 1) + (lambda_shared > 0))


# ------------------------------------------------------------------------------------------------------------ data
def _data_files(data: str, roles: list[str]) -> dict[str, str]:
    """``data``: a benchmark name under ``data/trajectories`` or a directory with one ``<role>.jsonl[.gz]`` each."""
    from lragent.provenance import ROOT

    base = Path(data) if Path(data).is_dir() else ROOT / "data" / "trajectories" / data
    if not base.is_dir():
        raise ValueError(f"data {data!r} is neither a directory nor a benchmark under data/trajectories")
    files = {}
    for role in roles:
        found = [base / f"{role}{ext}" for ext in (".jsonl.gz", ".jsonl", ".json") if (base / f"{role}{ext}").is_file()]
        if not found:
            raise ValueError(f"data {base} has no file for role {role!r} ({role}.jsonl.gz, .jsonl or .json)")
        files[role] = str(found[0])
    return files


def _batch_stats(batch: dict[str, Any]) -> dict[str, Any]:
    """Host-side sizes of a collated batch: the lengths from the host copy the module keeps (``batch["host"]``, see
    ``MultiLoraModule.on_before_batch_transfer``) where there is one, so that reading them on the device does not
    stall the host."""
    host = batch.get("host") or {}
    return {
        "lengths": list(host["lengths"]) if "lengths" in host else batch["lengths"].tolist(),
        "padded": int(batch["input_ids"].numel()),
        "n_scored": int(batch["loss_index"].numel()),
        "n_examples": int(batch["n_examples"]),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timer_name(device: torch.device, sync_steps: bool) -> str:
    if device.type != "cuda":
        return "host clock"
    return "host clock, device synced at each micro-batch" if sync_steps else "cuda events"


def _cuda_mark(device: torch.device) -> Any:
    """A timing event recorded on ``device``'s current stream (no host wait)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


# -------------------------------------------------------------------------------------------------------- timing
class _StepTimer:
    """Times steps from the end of one to the end of the next (device synchronised); records batch sizes."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device = device
        self.warmup = warmup
        self.last: float | None = None
        self.steps: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None

    def begin(self, stats: dict[str, Any]) -> None:
        self.pending = stats
        if self.last is None:  # the first step: from its start
            _sync(self.device)
            self.last = time.perf_counter()

    def end(self) -> None:
        _sync(self.device)
        now = time.perf_counter()
        self.steps.append({**(self.pending or {}), "seconds": now - self.last})
        self.last = now

    def timed(self) -> list[dict[str, Any]]:
        return self.steps[self.warmup :]


def _lightning_timer(timer: _StepTimer) -> Callback:
    class StepTimerCallback(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            timer.begin({**_batch_stats(batch), "absorbed_before": getattr(pl_module, "absorbed_rows_seen", 0)})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            timer.end()
            step = timer.steps[-1]  # rows whose plain term the shared pass scored (cross-role batches)
            step["absorbed"] = getattr(pl_module, "absorbed_rows_seen", 0) - step.pop("absorbed_before")

    return StepTimerCallback()


class FitSpeed(Callback):
    """Lightning callback for a real ``fit``: step times, tokens/s, model FLOPs / MFU and peak CUDA memory, written as
    JSON when fit ends (add it to a config's ``trainer.callbacks`` as ``eval_suite.bench.train.FitSpeed``).

    Each micro-batch is timed from its start to its end (forward, backward and, on the last micro-batch of an
    accumulation, the optimizer step); the first ``warmup`` micro-batches are not counted. On a GPU the marks are
    CUDA events on the device's stream, read once when training ends, so the timer never makes the host wait for the
    GPU: a device sync at every micro-batch would stop the host from running ahead, and under DDP would make every
    rank wait for the slowest one at every micro-batch instead of only where the gradients are all-reduced
    (``sync_steps=True`` restores such a sync and the host clock, to compare). Data loading, validation and
    checkpointing are outside the micro-batches: ``other_seconds`` reports them. In the JSON, ``steps`` /
    ``ms_per_step`` count timed micro-batches (an optimizer step is ``accumulate_grad_batches`` of them) and
    ``timer`` names the clock.

    With several processes (DDP, FSDP) every rank times its own micro-batches and writes ``<out stem>.rank<k>.json``;
    rank 0 also writes ``out``: its own figures plus ``world_size``, ``ranks`` (tokens, seconds, tokens/s and peak
    memory of every rank) and ``global_tokens_per_s`` (the tokens of all ranks over the slowest rank's timed
    seconds: the ranks step together, so that is the job's rate).

    Args:
        out: JSON file to write.
        warmup: micro-batches not timed at the start of the run.
        peak_tflops: peak TFLOP/s for MFU; ``None``: the dense bf16 peak of a known GPU.
        sync_steps: synchronise the device at every micro-batch's start and end and time with the host clock (the
            timer before 2026-11-28) instead of CUDA events.
        sync_debug: count the host-device synchronisations of each timed micro-batch (torch's sync debug mode,
            warnings recorded, not shown) and name where they come from (``syncs_per_micro_batch``,
            ``sync_sites``). A diagnostic: the warnings cost host time.

    The JSON's ``phases_ms`` splits the timed micro-batches at Lightning's hooks: ``forward`` (to
    ``on_before_backward``), ``backward`` (to ``on_after_backward``), ``to_optimizer`` (to
    ``on_before_optimizer_step``), ``optimizer`` (clipping, the optimizer step, zeroing the gradients, the scheduler:
    to the micro-batch's end) and ``end`` (after the backward of a micro-batch that does not step); each as the mean
    host time (``host``: the Python thread's clock between the hooks, waits included) and GPU time (``gpu``: between
    CUDA events at the hooks), with the number of micro-batches that had it (``count``).
    """

    def __init__(
        self,
        out: str,
        warmup: int = 2,
        peak_tflops: float | None = None,
        sync_steps: bool = False,
        sync_debug: bool = False,
    ) -> None:
        self.out, self.warmup, self.peak_tflops, self.sync_steps = out, warmup, peak_tflops, sync_steps
        self.sync_debug = sync_debug
        self._caught: Any = None
        self.marks: list[tuple[str, float, Any]] = []
        self.records: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {}
        self.t_fit = 0.0
        self.device = torch.device("cpu")
        self.ranks: list[dict[str, Any]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        self.t_fit = time.perf_counter()
        self.device = pl_module.device
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def _events(self) -> bool:
        return self.device.type == "cuda" and not self.sync_steps

    def _mark(self, name: str) -> None:
        """A phase boundary: the host clock and, on a GPU, a CUDA event."""
        self.marks.append((name, time.perf_counter(), _cuda_mark(self.device) if self._events() else None))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The device the steps ran on: by on_fit_end Lightning's teardown has moved the module to the CPU.
        self.device = pl_module.device
        self.stats = _batch_stats(batch)
        if self.sync_debug and self.device.type == "cuda" and len(self.records) >= self.warmup:
            self._caught = warnings.catch_warnings(record=True)
            self.stats["syncs"] = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        if not self._events():
            _sync(self.device)
        self.marks = []
        self._mark("start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._mark("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._mark("to_optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stepped = any(name == "to_optimizer" for name, _, _ in self.marks)
        if not self._events():
            _sync(self.device)
        self._mark("optimizer" if stepped else "end")
        if self._caught is not None:
            self.stats["syncs"] = [f"{Path(w.filename).name}:{w.lineno}" for w in self._stop_sync_debug()]
        self.records.append({**self.stats, "marks": self.marks})

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """A fit stopped inside a counted micro-batch leaves neither torch's sync debug mode nor the warning filter
        behind."""
        if self._caught is not None:
            self._stop_sync_debug()

    def _stop_sync_debug(self) -> list[warnings.WarningMessage]:
        """Ends a micro-batch's sync counting: torch's sync debug mode off, the warning filters back; returns the
        warnings it recorded."""
        torch.cuda.set_sync_debug_mode(0)
        self._caught.__exit__(None, None, None)
        self._caught = None
        return self.stats["syncs"]

    def _read_marks(self) -> None:
        """Turns every micro-batch's marks into its ``seconds`` (first to last mark: the CUDA events where there are
        some, read after one device sync for all of them; else the host clock) and its ``phases``."""
        pending = [r for r in self.records if "marks" in r]
        if any(r["marks"][0][2] is not None for r in pending):
            _sync(self.device)
        for r in pending:
            marks = r.pop("marks")
            (_, h0, e0), (_, h1, e1) = marks[0], marks[-1]
            r["seconds"] = e0.elapsed_time(e1) / 1e3 if e0 is not None else h1 - h0
            r["phases"] = _phases(marks)

    def on_train_end(self, trainer, pl_module) -> None:
        self._read_marks()
        # every rank's totals, gathered while the process group is up (Lightning's teardown precedes on_fit_end)
        if getattr(trainer, "world_size", 1) <= 1:
            return
        timed = self.records[self.warmup :]
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else -1.0
        local = torch.tensor(
            [sum(sum(r["lengths"]) for r in timed), sum(r["seconds"] for r in timed), peak, len(timed)],
            dtype=torch.float64,
            device=pl_module.device,
        )
        rows = trainer.strategy.all_gather(local).reshape(trainer.world_size, -1).cpu().tolist()
        self.ranks = [
            {
                "rank": k,
                "tokens": int(tok),
                "seconds": sec,
                "tokens_per_s": tok / sec if sec else None,
                "peak_memory_gib": mem if mem >= 0 else None,
                "steps": int(n),
            }
            for k, (tok, sec, mem, n) in enumerate(rows)
        ]

    def on_fit_end(self, trainer, pl_module) -> None:
        dev = self.device  # not pl_module.device: the module is back on the CPU here
        self._read_marks()  # a fit that ended without on_train_end (interrupted)
        rank = pl_module.lora_config.rank
        shape = ModelShape.from_config(pl_module.lora_model.model.config, rank, pl_module.lora_config.targets)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        peak = self.peak_tflops * 1e12 if self.peak_tflops else (peak_flops(name) if dev.type == "cuda" else None)
        timed = self.records[self.warmup :]
        cfg = pl_module.train_config
        result = _summarise(timed, shape, float(cfg.lambda_shared), peak, dev, cfg.lambda_mode)
        total = time.perf_counter() - self.t_fit
        result.update(_phase_summary(timed))
        result.update(
            micro_batches=len(self.records),
            global_step=trainer.global_step,
            fit_seconds=total,
            other_seconds=total - sum(r["seconds"] for r in self.records),
            torch_threads=torch.get_num_threads(),  # the host pool the steps ran with (lragent.host_threads)
            host_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            timer=_timer_name(dev, self.sync_steps),
            provenance=provenance(device=dev.type),
        )
        Path(self.out).parent.mkdir(parents=True, exist_ok=True)
        if getattr(trainer, "world_size", 1) <= 1:
            write_json(self.out, result)
            return
        rank = trainer.global_rank
        out = Path(self.out)
        write_json(out.with_name(f"{out.stem}.rank{rank}{out.suffix}"), {**result, "rank": rank})
        if rank == 0:
            slowest = max((r["seconds"] for r in self.ranks), default=0.0)
            result.update(
                world_size=trainer.world_size,
                ranks=self.ranks,
                global_tokens=sum(r["tokens"] for r in self.ranks),
                global_tokens_per_s=sum(r["tokens"] for r in self.ranks) / slowest if slowest else None,
            )
            write_json(out, result)


def _phases(marks: list[tuple[str, float, Any]]) -> dict[str, tuple[float, float | None]]:
    """``{phase: (host seconds, GPU seconds or None)}`` of one micro-batch's marks ``(name, host clock, CUDA event or
    None)``, each phase named by the mark that ends it (the events readable: the device synced)."""
    out = {}
    for (_, h0, e0), (name, h1, e1) in zip(marks, marks[1:], strict=False):
        out[name] = (h1 - h0, e0.elapsed_time(e1) / 1e3 if e0 is not None else None)
    return out


def _phase_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """FitSpeed's ``phases_ms`` (mean host and GPU ms of each phase, and how many micro-batches had it) and, where
    synchronisations were counted, ``syncs_per_micro_batch`` and the 10 commonest ``sync_sites``."""
    host: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}
    for r in records:
        for name, (h, g) in (r.get("phases") or {}).items():
            host.setdefault(name, []).append(h)
            if g is not None:
                gpu.setdefault(name, []).append(g)
    out: dict[str, Any] = {
        "phases_ms": {
            "host": {k: 1e3 * sum(v) / len(v) for k, v in host.items()},
            "gpu": {k: 1e3 * sum(v) / len(v) for k, v in gpu.items()},
            "count": {k: len(v) for k, v in host.items()},
        }
    }
    counted = [r["syncs"] for r in records if "syncs" in r]
    if counted:
        sites = Counter(site for syncs in counted for site in syncs)
        out["syncs_per_micro_batch"] = sum(len(c) for c in counted) / len(counted)
        out["sync_sites"] = dict(sites.most_common(10))
    return out


def _summarise(
    steps: list[dict[str, Any]],
    shape: ModelShape,
    lam: float,
    peak: float | None,
    device: torch.device,
    lambda_mode: str = "weight",
) -> dict[str, Any]:
    seconds = sum(s["seconds"] for s in steps)
    tokens = sum(sum(s["lengths"]) for s in steps)
    flops = sum(step_flops(shape, s["lengths"], s["n_scored"], lam, lambda_mode) for s in steps)
    out = {
        "steps": len(steps),
        "seconds": seconds,
        "ms_per_step": 1e3 * seconds / max(1, len(steps)),
        "tokens": tokens,
        "padded_tokens": sum(s["padded"] for s in steps),
        "examples": sum(s["n_examples"] for s in steps),
        "tokens_per_s": tokens / seconds if seconds else None,
        "model_flops": flops,
        "tflops_per_s": flops / seconds / 1e12 if seconds else None,
        "mfu": flops / seconds / peak if seconds and peak else None,
        "step_seconds": [s["seconds"] for s in steps],
        "step_lengths": [s["lengths"] for s in steps],  # each step's sequence lengths, to read its time against
        "step_absorbed": [s.get("absorbed", 0) for s in steps],  # rows each step scored in the shared pass
        "absorbed_rows": sum(s.get("absorbed", 0) for s in steps),
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    else:
        out["peak_memory_gib"] = None
        out["peak_reserved_gib"] = None
    return out


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------------------------------- lragent
def time_lragent(
    module: Any,
    datamodule: Any,
    lam: float,
    checkpointing: bool,
    steps: int,
    warmup: int,
    precision: str,
    device: torch.device,
    root: str,
    lambda_mode: str = "weight",
) -> list[dict[str, Any]]:
    """Runs ``warmup + steps`` optimizer steps of ``module`` with a Lightning Trainer; returns every step's record."""
    from lightning.pytorch import Trainer

    module.train_config.lambda_shared = lam
    module.hparams.lambda_shared = lam
    module.train_config.lambda_mode = lambda_mode
    module.hparams.lambda_mode = lambda_mode
    if module.lora_model is not None:
        module.lora_model.decoder.gradient_checkpointing = checkpointing
    module.hparams.gradient_checkpointing = checkpointing
    timer = _StepTimer(device, warmup)
    trainer = Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_steps=warmup + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=[_lightning_timer(timer)],
    )
    # Lightning's teardown moves the module to the CPU after fit; the next setting would move it back (16 GB at 8B)
    module.cpu = lambda: module
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        del module.cpu
    return timer.steps


# ---------------------------------------------------------------------------------------------------------- peft
def build_peft(
    model: str, roles: list[str], rank: int, alpha: float, dropout: float, targets: list[str], dtype, device, kw
) -> Any:
    """The base model (same weights as lragent's: same name and seed) with one PEFT LoRA adapter per role."""
    from peft import LoraConfig, get_peft_model

    from lragent.models import load_model

    hf, _ = load_model(model, dtype=dtype, device=device, **kw)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none")
    peft_model = get_peft_model(hf, cfg, adapter_name=roles[0])
    for role in roles[1:]:
        peft_model.add_adapter(role, cfg)
    return peft_model


def time_peft(
    peft_model: Any,
    loader: Any,
    roles: list[str],
    checkpointing: bool,
    steps: int,
    warmup: int,
    precision: str,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Plain loop: per batch, one forward/backward per role present (its rows, ``set_adapter``), one AdamW step."""
    base = peft_model.get_base_model()
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_disable()
    peft_model.train()
    params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-5)
    timer = _StepTimer(device, warmup)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    for i, batch in enumerate(loader):
        if i == warmup + steps:
            break
        timer.begin(_batch_stats(batch))
        roles_host = batch["role_ids"].tolist()
        lengths = batch["lengths"].tolist()
        n_items = torch.tensor(int(batch["loss_index"].numel()), device=device)
        ids = batch["input_ids"].to(device, non_blocking=True)
        mask = batch["attention_mask"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        for rid in sorted(set(roles_host)):
            rows = [j for j, r in enumerate(roles_host) if r == rid]
            t = max(lengths[j] for j in rows)
            sel = torch.tensor(rows, device=device)
            peft_model.set_adapter(roles[rid])
            with autocast:
                out = peft_model(
                    input_ids=ids[sel, :t],
                    attention_mask=mask[sel, :t],
                    labels=labels[sel, :t],
                    num_items_in_batch=n_items,
                    use_cache=False,
                )
            out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.end()
    return timer.steps


# ---------------------------------------------------------------------------------------------------------- main
def train(
    model: str = "llama-3.1-8b",
    data: str = "hotpotqa",
    tokenizer: str | None = None,
    model_overrides: dict | None = None,
    seq_len: int = 2048,
    batch_size: int = 4,
    steps: int = 5,
    warmup_steps: int = 2,
    lambdas: list[float] | None = None,
    lambda_modes: list[str] | None = None,
    checkpointing: list[bool] | None = None,
    pack_prefixes: bool = True,
    peft_baseline: bool = True,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.05,
    targets: list[str] | None = None,
    precision: str = "bf16-mixed",
    device: str = "auto",
    peak_tflops: float | None = None,
    rounds: int = 1,
    warm_rounds: int = 0,
    max_tokens: int | None = None,
    cross_role_batches: bool = False,
    cross_role_min_share: float = CROSS_ROLE_MIN_SHARE,
    producer: str = "random",
    out: str = "bench_out/train",
) -> int:
    """Training-step speed of lragent's multi-LoRA LightningModule vs a plain transformers + peft loop.

    Args:
        model: a named random-weight architecture (``llama-3.1-8b``, ``tiny-llama`` ...), ``default`` (the embedded
            model) or a model name / directory.
        data: a benchmark under ``data/trajectories`` (``hotpotqa``, ``scienceqa``) or a directory with one
            ``<role>.jsonl[.gz]`` per role.
        tokenizer: tokenizer of the data; ``None``: the model's own, or ``byte`` for a random architecture.
        model_overrides: config fields changed for a named architecture (e.g. ``{"num_hidden_layers": 2}``).
        seq_len: most tokens per example (``max_length``; longer contexts are cut from the left).
        batch_size: examples per batch (sequences per step; packed sequences hold several examples).
        steps: timed optimizer steps per setting.
        warmup_steps: untimed steps before them.
        lambdas: weights λ of the cache-sharing-aware term to time (0: plain multi-LoRA).
        lambda_modes: how λ mixes the terms, each timed for every 0 < λ < 1: ``weight`` (both terms every step) and
            / or ``sample`` (one term per step, the shared one with probability λ); default ``[weight]``.
        checkpointing: gradient checkpointing settings to time (e.g. ``[true, false]``).
        pack_prefixes: also time λ = 0 (and the PEFT loop) on prefix-packed sequences.
        peft_baseline: also time the plain transformers + peft loop.
        rank: LoRA rank.
        alpha: LoRA alpha.
        dropout: LoRA dropout.
        targets: projections with adapters (default ``[q_proj, v_proj]``).
        precision: ``bf16-mixed`` (bfloat16 frozen base, float32 adapters, autocast) or ``32-true``.
        device: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.
        peak_tflops: the device's peak TFLOP/s for MFU; ``None``: the dense bf16 peak of a known GPU.
        rounds: times every lragent setting is measured, the settings taking turns round by round (a GPU's clock
            drifting over the run then moves every setting alike); a row pools its rounds, and its step time over
            λ = 0's is also given per round (each round's pair measured minutes apart at most). Every round runs
            the same batches, so a row's ratio also gets a 95% interval from resampling those batches (paired: each
            batch's time under the setting against its own time under λ = 0).
        warm_rounds: untimed rounds before the timed ones, over the same batches: each setting meets every batch's
            shape once before it is timed. Without them, when the lengths vary from batch to batch, whichever
            setting runs first in round 1 pays the first sight of each shape (kernel plans and Triton variants built,
            memory mapped): 1.83 against 2.04 in a warm round on an H100 at 4096 byte tokens. Their step times are
            kept in the JSON (``warm_ms_per_step``), not pooled.
        max_tokens: form batches by this padded-token budget (``rows x longest``) instead of ``batch_size``
            examples (``data.max_tokens``).
        cross_role_batches: batch each example with the other role's example that starts its context
            (``data.cross_role_batches``): every setting runs on those batches, and the weighted λ step scores such
            examples' plain terms inside the shared pass when the producer is their role. The λ > 0 rows still count
            the FLOPs of two whole passes, so their MFU is then an effective figure (the work is less).
        cross_role_min_share: link a source only into chains whose shortest example has at least this share of the
            longest's tokens (``data.cross_role_min_share``; 0: every pair).
        producer: the shared term's producer (``random``, ``next``, ``prefix``; ``model.producer``).
        out: output directory.
    """
    from datamodules.prefix_packing import pack_prefix_chains
    from datamodules.role_examples import RoleExampleDataModule, RoleExampleDataset
    from lit_modules.multi_lora_module import LAMBDA_MODES, PRODUCER_MODES, MultiLoraModule
    from lragent.models import NAMED_ARCHITECTURES, check_device
    from lragent.roles import DEFAULT_ROLES

    lambdas = [0.0, 0.5] if lambdas is None else [float(x) for x in lambdas]
    checkpointing = [True] if checkpointing is None else [bool(x) for x in checkpointing]
    targets = ["q_proj", "v_proj"] if targets is None else list(targets)
    if not lambdas or any(not 0 <= x <= 1 for x in lambdas):
        raise ValueError(f"lambdas must be values in [0, 1], got {lambdas}")
    if not checkpointing:
        raise ValueError("checkpointing: give at least one setting (true / false)")
    lambda_modes = ["weight"] if lambda_modes is None else list(lambda_modes)
    if not lambda_modes or any(m not in LAMBDA_MODES for m in lambda_modes):
        raise ValueError(f"lambda_modes must be among {', '.join(LAMBDA_MODES)}, got {lambda_modes}")
    if steps < 1 or warmup_steps < 0 or batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"steps >= 1, warmup_steps >= 0, batch_size >= 1, seq_len >= 2 needed, got {steps}, {warmup_steps}, "
            f"{batch_size}, {seq_len}"
        )
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if warm_rounds < 0:
        raise ValueError(f"warm_rounds must be 0 or more, got {warm_rounds}")
    if max_tokens is not None and max_tokens < seq_len:
        raise ValueError(f"max_tokens must be at least seq_len ({seq_len}) for every example to fit, got {max_tokens}")
    if producer not in PRODUCER_MODES:
        raise ValueError(f"producer {producer!r} not supported: allowed {', '.join(PRODUCER_MODES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} not supported: allowed {', '.join(PRECISIONS)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if tokenizer is None and model.lower() in NAMED_ARCHITECTURES:
        tokenizer = "byte"
    roles = list(DEFAULT_ROLES)
    files = _data_files(data, roles)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_dtype = "bfloat16" if precision == "bf16-mixed" else "float32"

    t0 = time.perf_counter()
    dm = RoleExampleDataModule(
        files, roles=roles, tokenizer=tokenizer or model, max_length=seq_len, batch_size=batch_size, val_fraction=0.0,
        cross_role_batches=cross_role_batches, cross_role_min_share=cross_role_min_share, max_tokens=max_tokens,
    )  # fmt: skip
    dm.setup("fit")
    dm_packed = None
    if pack_prefixes:
        dm_packed = RoleExampleDataModule(
            files, roles=roles, tokenizer=dm.tokenizer, max_length=seq_len, batch_size=batch_size, val_fraction=0.0,
            pack_prefixes=True,
        )  # fmt: skip
        dm_packed.train_set = RoleExampleDataset(pack_prefix_chains(dm.train_set.examples))
        dm_packed.val_set = RoleExampleDataset([])
    data_seconds = time.perf_counter() - t0
    print(f"data: {len(dm.train_set)} examples tokenised in {data_seconds:.1f} s", flush=True)

    module = MultiLoraModule(
        model_name=model, tokenizer_name=tokenizer, model_overrides=model_overrides, roles=roles, rank=rank,
        alpha=alpha, dropout=dropout, targets=targets, val_schemes=[], model_dtype=base_dtype, producer=producer,
    )  # fmt: skip
    t0 = time.perf_counter()
    with dev:  # build the model where it trains (what Lightning's init context does in fit)
        module.configure_model()
    load_seconds = time.perf_counter() - t0
    shape = ModelShape.from_config(module.lora_model.model.config, rank, targets)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = peak_tflops * 1e12 if peak_tflops else (peak_flops(dev_name) if dev.type == "cuda" else None)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root:
        for ckpt in checkpointing:
            settings = [
                ("lragent", lam, False, mode)
                for lam in lambdas
                for mode in (lambda_modes if 0 < lam < 1 else ["weight"])
            ]
            if dm_packed is not None and 0.0 in lambdas:
                settings.append(("lragent", 0.0, True, "weight"))
            measured: list[list[dict[str, Any]]] = []
            warm: list[list[dict[str, Any]]] = []
            for rnd in range(warm_rounds + rounds):
                this_round = []
                for impl, lam, packed, mode in settings:
                    _reset_memory(dev)
                    row = {"impl": impl, "lambda": lam, "lambda_mode": mode, "checkpointing": ckpt, "packed": packed}
                    row.update(
                        _measure(
                            lambda lam=lam, packed=packed, ckpt=ckpt, mode=mode, module=module: time_lragent(
                                module, dm_packed if packed else dm, lam, ckpt, steps, warmup_steps, precision, dev,
                                root, mode,
                            ),
                            warmup_steps, shape, lam, peak, dev, mode,
                        )
                    )  # fmt: skip
                    if rnd < warm_rounds:
                        print(f"warm round {rnd + 1}/{warm_rounds} (not timed): ", end="")
                    elif rounds > 1:
                        print(f"round {rnd + 1 - warm_rounds}/{rounds}: ", end="")
                    _print_row(row)
                    this_round.append(row)
                _compare(this_round)
                (warm if rnd < warm_rounds else measured).append(this_round)
            pooled = _pool_rounds(measured, peak)
            for row, *warm_rows in zip(pooled, *warm, strict=True):
                row["warm_ms_per_step"] = [w["ms_per_step"] for w in warm_rows]
            rows.extend(pooled)
    del module
    _reset_memory(dev)
    if peft_baseline:
        kw = {"overrides": model_overrides} if model_overrides else {}
        peft_model = build_peft(model, roles, rank, alpha, dropout, targets, base_dtype, dev, kw)
        for ckpt in checkpointing:
            for packed in [False, True] if dm_packed is not None else [False]:
                _reset_memory(dev)
                loader = (dm_packed if packed else dm).train_dataloader()
                row = {"impl": "peft", "lambda": 0.0, "lambda_mode": "weight", "checkpointing": ckpt, "packed": packed}
                row.update(
                    _measure(
                        lambda loader=loader, ckpt=ckpt: time_peft(
                            peft_model, loader, roles, ckpt, steps, warmup_steps, precision, dev
                        ),
                        warmup_steps, shape, 0.0, peak, dev,
                    )
                )  # fmt: skip
                rows.append(row)
                _print_row(row)
        del peft_model
        _reset_memory(dev)
    _compare(rows)
    prov = provenance(dtype=base_dtype, device=dev.type)
    result = {
        "model": model,
        "model_overrides": model_overrides,
        "data": data,
        "tokenizer": tokenizer,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "steps": steps,
        "rounds": rounds,
        "warm_rounds": warm_rounds,
        "max_tokens": max_tokens,
        "cross_role_batches": cross_role_batches,
        "cross_role_min_share": cross_role_min_share,
        "producer": producer,
        "cross_role_links": sum(len(g) - 1 for g in dm.train_groups) if dm.train_groups else 0,
        "warmup_steps": warmup_steps,
        "precision": precision,
        "rank": rank,
        "alpha": alpha,
        "dropout": dropout,
        "targets": targets,
        "shape": asdict(shape),
        "peak_flops": peak,
        "data_seconds": data_seconds,
        "model_load_seconds": load_seconds,
        "rows": rows,
        "provenance": prov,
    }
    write_json(out_dir / "bench_train.json", result)
    md = render_markdown(result)
    write_text(out_dir / "bench_train.md", md)
    print(md)
    return 0


def _measure(
    run, warmup: int, shape: ModelShape, lam: float, peak: float | None, dev: torch.device, mode: str = "weight"
) -> dict:
    """``run()``'s step records summarised; a CUDA out-of-memory error gives a row marked ``oom`` (with the memory
    allocated when it struck) instead of ending the benchmark."""
    try:
        return {"oom": False, **_summarise(run()[warmup:], shape, lam, peak, dev, mode)}
    except torch.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the failed step's tensors
    gib = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    _reset_memory(dev)
    keys = ("steps", "seconds", "ms_per_step", "tokens", "padded_tokens", "examples", "tokens_per_s", "model_flops")
    return {
        "oom": True,
        **dict.fromkeys(keys),
        **dict.fromkeys(("tflops_per_s", "mfu", "step_seconds", "step_lengths", "step_absorbed", "peak_reserved_gib")),
        "peak_memory_gib": gib,
    }


def _max_or_none(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _pool_rounds(measured: list[list[dict[str, Any]]], peak: float | None) -> list[dict[str, Any]]:
    """One row per setting from its rounds (``measured[round][setting]``): steps, seconds, tokens and FLOPs summed,
    peak memory the largest, and ``round_ms_per_step`` / ``round_vs_lambda0`` (each round's own λ = 0 pair)."""
    if len(measured) == 1:
        return measured[0]
    pooled = []
    for per_round in zip(*measured, strict=True):
        first = per_round[0]
        row = {k: first[k] for k in ("impl", "lambda", "lambda_mode", "checkpointing", "packed")}
        row["rounds"] = len(per_round)
        row["round_ms_per_step"] = [r["ms_per_step"] for r in per_round]
        row["round_vs_lambda0"] = [r["vs_lambda0"] for r in per_round]
        if any(r["oom"] for r in per_round):
            pooled.append({**first, **row, "oom": True})
            continue
        seconds = sum(r["seconds"] for r in per_round)
        flops = sum(r["model_flops"] for r in per_round)
        steps = sum(r["steps"] for r in per_round)
        tokens = sum(r["tokens"] for r in per_round)
        row.update(
            oom=False, steps=steps, seconds=seconds, ms_per_step=1e3 * seconds / max(1, steps), tokens=tokens,
            padded_tokens=sum(r["padded_tokens"] for r in per_round), examples=sum(r["examples"] for r in per_round),
            tokens_per_s=tokens / seconds if seconds else None, model_flops=flops,
            tflops_per_s=flops / seconds / 1e12 if seconds else None,
            mfu=flops / seconds / peak if seconds and peak else None,
            step_seconds=[x for r in per_round for x in r["step_seconds"]],
            step_lengths=[x for r in per_round for x in r.get("step_lengths", [])],
            step_absorbed=[x for r in per_round for x in r.get("step_absorbed", [])],
            absorbed_rows=sum(r.get("absorbed_rows", 0) for r in per_round),
            peak_memory_gib=_max_or_none(r["peak_memory_gib"] for r in per_round),
            peak_reserved_gib=_max_or_none(r["peak_reserved_gib"] for r in per_round),
        )  # fmt: skip
        pooled.append(row)
    return pooled


def _print_row(row: dict[str, Any]) -> None:
    if row["oom"]:
        print(f"{row['impl']} λ={row['lambda']} ckpt={row['checkpointing']}: out of memory", flush=True)
        return
    mem = f", peak {row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else ""
    mfu = f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] is not None else ""
    print(
        f"{row['impl']} λ={row['lambda']} ckpt={row['checkpointing']} packed={row['packed']}: "
        f"{row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s{mfu}{mem}",
        flush=True,
    )


def _compare(rows: list[dict[str, Any]]) -> None:
    """Adds ``vs_lambda0`` (step time over λ = 0's, same checkpointing, unpacked) and ``vs_peft`` (tokens/s over the
    PEFT loop's on the same batches) to every row."""
    for r in rows:
        same = [x for x in rows if x["checkpointing"] == r["checkpointing"] and x["packed"] == r["packed"]]
        zero = next((x for x in same if x["impl"] == "lragent" and x["lambda"] == 0.0), None)  # mode: weight
        peft = next((x for x in same if x["impl"] == "peft"), None)
        ok = not r["oom"] and r["impl"] == "lragent"
        r["vs_lambda0"] = r["ms_per_step"] / zero["ms_per_step"] if ok and zero and not zero["oom"] else None
        r["vs_lambda0_interval"] = (
            paired_ratio_interval(zero["step_seconds"], r["step_seconds"], r.get("rounds", 1))
            if r["vs_lambda0"] is not None and r is not zero
            else None
        )
        r["vs_peft"] = r["tokens_per_s"] / peft["tokens_per_s"] if ok and peft and not peft["oom"] else None
        # tokens/s over the loop's = the loop's time over this row's, per batch (the loop runs one round)
        r["vs_peft_interval"] = (
            paired_ratio_interval(_per_batch_mean(r["step_seconds"], r.get("rounds", 1)), peft["step_seconds"])
            if r["vs_peft"] is not None
            else None
        )


def _per_batch_mean(seconds: list[float], rounds: int) -> list[float]:
    """``(rounds * n,)`` round-major step times -> ``(n,)`` each batch's mean over the rounds."""
    if rounds <= 1 or len(seconds) % rounds:
        return list(seconds)
    return torch.tensor(seconds, dtype=torch.float64).reshape(rounds, -1).mean(0).tolist()


def paired_ratio_interval(
    zero_seconds: list[float] | None,
    seconds: list[float] | None,
    rounds: int = 1,
    level: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> list[float] | None:
    """Bootstrap interval of ``Σ seconds / Σ zero_seconds`` over the timed batches, paired per batch.

    Both lists hold ``rounds`` rounds of the same batches in the same order (round-major: ``[r0 b0, r0 b1, ...,
    r1 b0, ...]``); a batch's time is its mean over the rounds. Resampling whole batches (the same draw for both
    settings) keeps each batch's pair together, so the interval reflects which batches were drawn, not the two
    settings' independent spreads. ``None`` with fewer than 2 batches or lists that do not pair up.

    Args:
        zero_seconds: ``(rounds * n,)`` step times under λ = 0.
        seconds: ``(rounds * n,)`` step times under the setting.
        rounds: rounds the lists hold.
        level: coverage of the interval.
        n_boot: bootstrap resamples.
        seed: resampling seed (the interval is reproducible).

    Returns:
        ``[low, high]``, or ``None``.
    """
    if not zero_seconds or not seconds or len(zero_seconds) != len(seconds) or len(seconds) % rounds:
        return None
    n = len(seconds) // rounds
    if n < 2:
        return None
    zero = torch.tensor(_per_batch_mean(zero_seconds, rounds), dtype=torch.float64)
    other = torch.tensor(_per_batch_mean(seconds, rounds), dtype=torch.float64)
    draw = torch.randint(0, n, (n_boot, n), generator=torch.Generator().manual_seed(seed))
    ratios = other[draw].sum(1) / zero[draw].sum(1)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(ratios, q).tolist()
    return [low, high]


def _interval(bounds: list[float] | None) -> str:
    """`` (1.18–1.24)``, or nothing."""
    return f" ({bounds[0]:.2f}–{bounds[1]:.2f})" if bounds else ""


def _round_range(row: dict[str, Any]) -> str:
    """`` (1.97–1.99 in 3 rounds; 95% interval 1.95–2.01 over 8 batches)``: the per-round ratios' range, where a row
    has rounds, and the paired interval over the batches (:func:`paired_ratio_interval`), where it has one."""
    parts = []
    ratios = [x for x in row.get("round_vs_lambda0") or [] if x is not None]
    if len(ratios) >= 2:
        parts.append(f"{min(ratios):.3f}–{max(ratios):.3f} in {len(ratios)} rounds")
    interval = row.get("vs_lambda0_interval")
    if interval:
        n = len(row["step_seconds"]) // row.get("rounds", 1)
        parts.append(f"95% interval {interval[0]:.3f}–{interval[1]:.3f} over {n} batches")
    return f" ({'; '.join(parts)})" if parts else ""


def render_markdown(result: dict[str, Any]) -> str:
    """The result as a Markdown report (table, FLOP count, provenance)."""
    prov = result["provenance"]

    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    body = [
        [
            r["impl"],
            f"{r['lambda']:g}" + (" (sample)" if r.get("lambda_mode") == "sample" else ""),
            "on" if r["checkpointing"] else "off",
            "yes" if r["packed"] else "no",
            "out of memory" if r["oom"] else f"{r['ms_per_step']:.1f}",
            f(r["tokens_per_s"], ".0f"),
            f(r["tflops_per_s"], ".1f"),
            f(None if r["mfu"] is None else 100 * r["mfu"], ".1f"),
            f(r["peak_memory_gib"], ".1f"),
            f(r["vs_lambda0"], ".3f") + _round_range(r),
            f(r["vs_peft"], ".2f") + _interval(r.get("vs_peft_interval")),
        ]
        for r in result["rows"]
    ]
    shape = result["shape"]
    peak = result["peak_flops"]
    return (
        f"# Training-step speed ({prov['device']['name']})\n\n"
        f"{result['model']} (overrides {result['model_overrides'] or 'none'}: {shape['n_layers']} layers, width "
        f"{shape['hidden']}, vocab {shape['vocab']}), {result['precision']}, data {result['data']} "
        f"({result['tokenizer'] or 'the model'} tokenizer), examples cut to {result['seq_len']} tokens, batch "
        + (f"{result['max_tokens']} padded tokens" if result.get("max_tokens") else f"{result['batch_size']} sequences")
        + f", LoRA r={result['rank']} alpha={result['alpha']:g} dropout "
        f"{result['dropout']:g} on {', '.join(result['targets'])}; {result['steps']} timed steps after "
        f"{result['warmup_steps']} warm-up steps"
        + (
            f" per round, {result['rounds']} rounds taking turns over the lragent settings (pooled; the ratio's "
            "per-round range beside it)"
            if result.get("rounds", 1) > 1
            else ""
        )
        + (
            f", after {result['warm_rounds']} untimed round(s) over the same batches"
            if result.get("warm_rounds")
            else ""
        )
        + ", the same batches for every row with the same packing; the ratios' 95% intervals resample the timed "
        "batches, paired"
        + (
            f"; cross-role batches ({result.get('cross_role_links', 0)} source-consumer links kept in one batch, "
            f"producer {result.get('producer')}): absorbed rows (plain terms scored in the shared pass) per λ > 0 row: "
            + ", ".join(
                f"{r['absorbed_rows']} in {r['steps']} steps"
                for r in result["rows"]
                if r["impl"] == "lragent" and r["lambda"] > 0 and not r["oom"]
            )
            + " (their MFU counts two whole passes: an effective figure)"
            if result.get("cross_role_batches")
            else ""
        )
        + ". "
        f"MFU against {f(None if peak is None else peak / 1e12, '.1f')} TFLOP/s (dense bf16 peak).\n\n"
        + markdown_table(
            [
                "impl",
                "λ",
                "checkpointing",
                "packed",
                "ms/step",
                "tokens/s",
                "model TFLOP/s",
                "MFU %",
                "peak GiB",
                "step vs λ=0",
                "tokens/s vs peft",
            ],
            body,
        )
        + "\n\ntokens = real (non-padding) tokens of the batch's sequences; peak GiB = the most CUDA memory allocated "
        "during the setting (weights included; for an out-of-memory row, when it failed). Model FLOPs per step "
        "(eval_suite/bench/train.py): per layer "
        "4·P·T (frozen projections, forward + input gradient) + 6·R·T (LoRA) + 12·H_q·D·Σ L(L+1)/2 (causal "
        "attention), plus 4·d·V per scored position (LM head); the λ term counts as a second such pass (λ (sample): "
        "one term per step, so one pass); "
        "recomputation under checkpointing is not counted.\n" + provenance_footer(prov)
    )
