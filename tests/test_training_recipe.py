"""The embedded-model recipe's training machinery: early stopping, best-checkpoint export, time budget and resume,
the run status record, compact export, logits at supervised positions only, and no host syncs (GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from safetensors.torch import load_file

from datamodules import RoleExampleDataModule, byte_tokenizer, collate_examples
from lit_modules import ExportAdapters, MultiLoraModule
from lit_modules.run_status import RunStatus
from lit_modules.time_budget import TimeBudget, TimeBudgetExceeded
from lragent.adapters_io import NATIVE_FILE
from tests.conftest import SetClock
from tests.test_prefix_packing import write_trajectories
from tests.test_time_budget import Tick

ROLES = ["plan", "action", "reflect"]
TINY = {"vocab_size": 258, "num_hidden_layers": 2}
LR = {"role_lr": {r: 2e-2 for r in ROLES}, "shared_a_lr": 2e-2}


def module(**kwargs) -> MultiLoraModule:
    args = dict(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, dropout=0.0, val_schemes=[], **LR)
    return MultiLoraModule(**{**args, **kwargs})


def data(tmp_path: Path, **kwargs) -> RoleExampleDataModule:
    args = dict(
        tokenizer=byte_tokenizer(), max_length=512, val_fraction=0.25, pack_prefixes=True, max_tokens=1024, seed=1
    )
    return RoleExampleDataModule(write_trajectories(tmp_path), roles=ROLES, **{**args, **kwargs})


def trainer(tmp_path: Path, callbacks: list[Callback], **kwargs) -> Trainer:
    args = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tmp_path, max_epochs=3,
    )  # fmt: skip
    return Trainer(**{**args, **kwargs}, callbacks=callbacks)


def adapters(m: MultiLoraModule) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.lora_model.lora_parameters()]


def native(path: Path, m: MultiLoraModule) -> list[torch.Tensor]:
    """The native checkpoint's tensors in the order of ``lora_parameters``."""
    stored = load_file(str(path / NATIVE_FILE))
    out = []
    for name, mod in m.lora_model.lora_modules().items():
        out += [stored[f"{name}.lora_A.{i}"] for i in range(len(mod.lora_A))]
        out += [stored[f"{name}.lora_B.{i}"] for i in range(len(mod.lora_B))]
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class ScriptedValLoss(MultiLoraModule):
    """Logs a scripted ``val/loss`` per epoch (the adapters still train for real)."""

    script = (3.0, 2.0, 2.5, 2.6, 2.7, 2.8, 2.9)

    def on_validation_epoch_end(self) -> None:
        for metric in self.val_sums.values():
            metric.reset()
        self.log("val/loss", self.script[self.current_epoch])


class Snapshots(Callback):
    """The adapter weights at every epoch end (where ModelCheckpoint saves)."""

    def __init__(self) -> None:
        self.weights: list[list[torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.weights.append(adapters(pl_module))


# ------------------------------------------------------------------------------------ early stopping + best export


def test_early_stopping_on_rising_val_loss_exports_the_best_epoch(tmp_path: Path) -> None:
    args = dict(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, dropout=0.0, **LR)
    m = ScriptedValLoss(**args, val_schemes=[])
    snaps, status = Snapshots(), RunStatus(str(tmp_path / "status.jsonl"))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/loss", mode="min", save_top_k=1, save_last=True)
    stop = EarlyStopping(monitor="val/loss", mode="min", patience=2)
    export = ExportAdapters(str(tmp_path / "adapters"))  # best=True, float32
    t = trainer(tmp_path, [snaps, ckpt, stop, export, status], max_epochs=7)
    t.fit(m, data(tmp_path))
    assert t.current_epoch == 4 and len(snaps.weights) == 4  # 2.0 at epoch 1, then 2 epochs without improvement
    assert Path(ckpt.best_model_path).name.startswith("epoch=1-")
    exported = native(tmp_path / "adapters", m)
    assert all(torch.equal(a, b) for a, b in zip(exported, snaps.weights[1], strict=True))  # the best epoch's
    assert not all(torch.equal(a, b) for a, b in zip(exported, adapters(m), strict=True))  # not the last weights
    assert all(torch.equal(a, b) for a, b in zip(adapters(m), snaps.weights[3], strict=True))  # restored after
    config = json.loads((tmp_path / "adapters" / "train_config.json").read_text())
    assert config["exported_from"]["epoch"] == 1 and config["exported_from"]["score"] == 2.0
    (record,) = records(tmp_path / "status.jsonl")
    assert record["reason"] == "early_stopping" and record["finished"] and record["epochs_done"] == 4
    assert record["best_score"] == 2.0 and record["train_tokens"] > 0 and record["device"] == "cpu"


def test_a_fit_stopped_by_max_steps_is_recorded_as_finished_for_that_reason(tmp_path: Path) -> None:
    """The step limit reached exactly (global_step == max_steps) is a finished run, and says so."""
    status = RunStatus(str(tmp_path / "status.jsonl"))
    t = trainer(tmp_path, [status], max_epochs=50, max_steps=2, enable_checkpointing=False, limit_val_batches=0)
    t.fit(module(), data(tmp_path))
    (record,) = records(tmp_path / "status.jsonl")
    assert t.global_step == 2 and record["global_step"] == 2 and record["epochs_done"] < 50
    assert record["reason"] == "max_steps" and record["finished"]


def test_bf16_export_halves_the_size_and_loads_back(tmp_path: Path) -> None:
    from lit_modules.export import export_adapters

    m = module()
    m.configure_model()
    m.lora_model.init_adapters("random", seed=3, b_std=0.5)
    export_adapters(m, tmp_path / "fp32")
    export_adapters(m, tmp_path / "bf16", dtype="bfloat16")
    for f in ("lragent_adapters.safetensors", "plan/adapter_model.safetensors"):
        small, full = (tmp_path / "bf16" / f).stat().st_size, (tmp_path / "fp32" / f).stat().st_size
        assert small < 0.55 * full
    loaded = module(adapters_path=str(tmp_path / "bf16"))
    loaded.configure_model()
    for a, b in zip(adapters(loaded), adapters(m), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16).float())  # exactly the rounded weights, as float32
    with pytest.raises(FileNotFoundError, match="adapters_path"):
        module(adapters_path=str(tmp_path / "missing"))


# -------------------------------------------------------------------------------------------- time budget + resume


def budgeted_fit(
    tmp_path: Path, run: str, deadline_after: float | None, max_epochs: int, ckpt_path=None, slow_step: int = -1
):
    clock = SetClock()
    budget = TimeBudget(deadline=None if deadline_after is None else clock.now + deadline_after)
    budget.clock = clock
    status = RunStatus(str(tmp_path / run / "status.jsonl"))
    ckpt = ModelCheckpoint(dirpath=tmp_path / run, monitor="val/loss", save_last=True)
    m = module()
    t = trainer(tmp_path, [Tick(clock, slow_step, 1000.0), budget, ckpt, status], max_epochs=max_epochs)
    error = None
    try:
        t.fit(m, data(tmp_path), ckpt_path=ckpt_path)
    except TimeBudgetExceeded as e:
        error = e
    return m, t, budget, error


def test_time_budget_stops_at_an_epoch_end_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    reference, ref_trainer, _, _ = budgeted_fit(tmp_path, "ref", None, 4)
    per_epoch = ref_trainer.global_step // 4
    # Deadline 7.5 epochs of 10-s batches away... 2.5 epochs: after epoch 1 the next would not fit (1.2 x safety).
    _, t, budget, error = budgeted_fit(tmp_path, "run", 25.0 * per_epoch, 4)
    assert error is None and budget.stopped and t.current_epoch == 2 and t.global_step == 2 * per_epoch
    (record,) = records(tmp_path / "run" / "status.jsonl")
    assert record["reason"] == "time_budget" and not record["finished"] and record["epochs_done"] == 2
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2 * per_epoch  # the end of epoch 1
    resumed, t2, _, _ = budgeted_fit(tmp_path, "run", None, 4, ckpt_path=str(tmp_path / "run" / "last.ckpt"))
    assert t2.global_step == ref_trainer.global_step
    for a, b in zip(adapters(resumed), adapters(reference), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)  # the same run as without the stop
    second = records(tmp_path / "run" / "status.jsonl")[1]
    assert second["reason"] == "max_epochs" and second["finished"] and second["start_epoch"] == 2


def test_a_deadline_passed_mid_epoch_drops_the_partial_epoch(tmp_path: Path) -> None:
    probe = module()
    probe_trainer = trainer(tmp_path, [], max_epochs=1, enable_checkpointing=False)
    probe_trainer.fit(probe, data(tmp_path))
    per_epoch = probe_trainer.global_step
    assert per_epoch >= 2
    # After epoch 0 the next epoch fits (10 s per batch, 1.2 x safety), but epoch 1's first batch takes 1000 s.
    deadline = 10.0 * per_epoch * 2.2 + 5
    _, t, budget, error = budgeted_fit(tmp_path, "run", deadline, 3, slow_step=per_epoch + 1)
    assert isinstance(error, TimeBudgetExceeded) and budget.stopped
    (record,) = records(tmp_path / "run" / "status.jsonl")
    assert record["reason"] == "time_budget" and not record["finished"]
    assert "TimeBudgetExceeded" in record["error"]
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == per_epoch  # what a resumed run continues from: the last full epoch


# ------------------------------------------------------------------------------------ the step's efficiency paths


def test_logits_at_supervised_positions_equal_the_full_forward(tmp_path: Path) -> None:
    m = module()
    m.configure_model()
    m.lora_model.init_adapters("random", seed=4, b_std=0.5)
    dm = data(tmp_path)
    dm.setup()
    batch = collate_examples(dm.train_set.examples[:4], pad_id=257)
    full = m(batch["input_ids"], batch["role_ids"], batch["attention_mask"])  # (B, T, V)
    selected = m.plain_logits(batch)  # (N, V)
    assert selected.shape == (batch["loss_index"].numel(), full.shape[-1])
    assert torch.allclose(selected, full.flatten(0, 1)[batch["loss_index"]], atol=1e-5, rtol=0)


def test_validation_metrics_per_role_match_a_direct_computation(tmp_path: Path) -> None:
    m = module()
    m.configure_model()
    m.lora_model.init_adapters("random", seed=5, b_std=0.5)
    dm = data(tmp_path, max_tokens=700)  # several validation batches, mixed roles
    dm.setup()
    metrics = trainer(tmp_path, []).validate(m, dm, verbose=False)[0]
    nll_sum, correct_sum, count = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    with torch.no_grad():
        for e in dm.val_set.examples:  # one example at a time, full logits
            ids = torch.tensor([e.input_ids])
            logp = m(ids, torch.tensor([e.role_id]))[0, e.context_len - 1 : -1].log_softmax(-1)
            target = ids[0, e.context_len :]
            nll_sum[e.role_id] += -logp.gather(-1, target[:, None]).sum()
            correct_sum[e.role_id] += (logp.argmax(-1) == target).sum()
            count[e.role_id] += len(target)
    assert (count > 0).all() and len(list(dm.val_dataloader())) > 1
    for rid, role in enumerate(ROLES):
        assert metrics[f"val/{role}/loss"] == pytest.approx(float(nll_sum[rid] / count[rid]), abs=1e-4)
        assert metrics[f"val/{role}/acc"] == pytest.approx(float(correct_sum[rid] / count[rid]), abs=1e-6)
    assert metrics["val/loss"] == pytest.approx(float(nll_sum.sum() / count.sum()), abs=1e-4)  # token-weighted


def test_shared_loss_with_packed_data_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    m = module(lambda_shared=0.5)
    with pytest.raises(ValueError, match="needs one example per sequence: set data.pack_prefixes false"):
        trainer(tmp_path, []).fit(m, data(tmp_path))
    assert m.lora_model is None  # refused before configure_model


def test_a_gpu_fit_narrows_the_host_thread_pool_unless_the_user_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, fit/validate take at most GPU_HOST_THREADS torch threads, as an eval does; OMP_NUM_THREADS set by the
    user (or by Lightning for DDP ranks) holds; a CPU fit keeps its pool."""
    from types import SimpleNamespace

    from lragent.host_threads import GPU_HOST_THREADS

    set_to: list[int] = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for device, stage in (("cuda", "fit"), ("cpu", "fit"), ("cuda:1", "validate")):
        m = module()
        m._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), datamodule=None)
        m.setup(stage)
    assert set_to == [GPU_HOST_THREADS, GPU_HOST_THREADS] and GPU_HOST_THREADS == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "32")
    m.setup("fit")
    assert set_to == [4, 4]


@pytest.mark.gpu
def test_the_plain_causal_attention_takes_no_cudnn_kernel() -> None:
    """The training forward's plain causal attention (SDPA) runs FlashAttention, not cuDNN: torch puts cuDNN first on
    Hopper, and cuDNN builds a plan for every new sequence length (120-240 ms forward + backward on an H200,
    results/ddp_embedded_h200x4_2026-11-28/), which length-bucketed training batches kept paying (the embedded fit
    ran 2x slower). Forward and backward at two new lengths (GQA, bf16), profiled: no cuDNN kernel."""
    from torch.profiler import ProfilerActivity, profile

    from lragent.attention import plain_attention

    names: set[str] = set()
    for t in (333, 1029):
        q = torch.randn(2, 9, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 3, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            plain_attention(q, k, v).float().square().sum().backward()
            torch.cuda.synchronize()
        names |= {e.name for e in prof.events()}
    assert any("flash" in n.lower() for n in names), sorted(names)[:20]
    assert not any("cudnn" in n.lower() for n in names), sorted(n for n in names if "cudnn" in n.lower())


@pytest.mark.gpu
def test_training_and_validation_steps_do_not_sync_the_host() -> None:
    """On CUDA: a bf16-autocast training step (forward, backward, clipping, AdamW) and a plain validation step run
    under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host-device synchronisation."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dm = data(Path(tmp), pin_memory=True)
        dm.setup()
        cpu_batch = collate_examples(dm.train_set.examples[:6], pad_id=257)
    pinned = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in cpu_batch.items()}  # as the loader pins
    m = module(val_schemes=[])
    m.configure_model()
    m = m.cuda()
    opt = torch.optim.AdamW(m.param_groups())

    def step() -> None:
        batch = {k: v.cuda(non_blocking=True) if torch.is_tensor(v) else v for k, v in pinned.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m.compute_loss(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(m.lora_model.lora_parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            m.validation_step(batch, 0)

    step()  # warm-up: lazy initialisations may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_fit_speed_counts_the_host_syncs_of_a_micro_batch(tmp_path: Path) -> None:
    """FitSpeed(sync_debug=True) counts the host-device synchronisations of each timed micro-batch and names their
    source lines: a micro-batch that reads a device scalar (``.item()``) has one at that line; one that does not has
    none. A first, untimed micro-batch takes the one-time syncs of a first use (an H100 run of the version without it
    counted two for one read, not all at that line)."""
    from types import SimpleNamespace

    from eval_suite.bench.train import FitSpeed, _phase_summary

    cb = FitSpeed(str(tmp_path / "speed.json"), warmup=1, sync_debug=True)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    batch = {"input_ids": torch.zeros(1, 4), "loss_index": torch.zeros(2), "n_examples": 1, "host": {"lengths": [4]}}
    x = torch.ones(8, device="cuda")
    for read in (True, True, False):  # warm-up (not counted), then a read and none
        cb.on_train_batch_start(None, module, batch, 0)
        y = (x * 2).sum()
        if read:
            y.item()  # the sync
        cb.on_train_batch_end(None, module, None, batch, 0)
    cb.on_train_end(SimpleNamespace(world_size=1), module)
    assert "syncs" not in cb.records[0]
    read, quiet = (r["syncs"] for r in cb.records[1:])
    here = [site for site in read if site.startswith("test_training_recipe.py:")]
    assert here and not quiet, (read, quiet)
    assert _phase_summary(cb.records[1:])["syncs_per_micro_batch"] == len(read) / 2


def test_the_fused_adamw_is_taken_on_cuda_without_a_gradient_scaler() -> None:
    """``fused_adamw_ok``: every adapter on a CUDA device and no gradient scaler (``16-mixed``'s scaler would make
    Lightning refuse to clip the gradients of an optimizer that unscales them itself); a CPU adapter, a scaler, or no
    adapters at all: torch's default step."""
    from types import SimpleNamespace

    from lit_modules.multi_lora_module import fused_adamw_ok

    gpu, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    bf16, fp16, fp32 = SimpleNamespace(scaler=None), SimpleNamespace(scaler=object()), SimpleNamespace()
    assert fused_adamw_ok([gpu, gpu], bf16) and fused_adamw_ok([gpu], fp32)
    assert not fused_adamw_ok([gpu, cpu], bf16)
    assert not fused_adamw_ok([gpu], fp16)
    assert not fused_adamw_ok([], bf16)


class _ClipCheck(Callback):
    """The global gradient norm of the adapters after clipping (read at the batch's end: Lightning zeroes them at the
    start of the next step)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.fused: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        grads = [p.grad for p in pl_module.lora_model.lora_parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.fused.append(all(g.get("fused") for g in trainer.optimizers[0].param_groups))


def test_a_bf16_mixed_fit_clips_the_gradients_of_the_fused_adamw(tmp_path: Path, monkeypatch) -> None:
    """Lightning's mixed-precision plugin refuses any clipping with a fused optimizer ("does not allow for gradient
    clipping ... Are you using a 'fused' optimizer?", bf16 included: a GPU fit once stopped at its first step);
    ``MultiLoraModule.configure_gradient_clipping`` clips them itself when there is no gradient scaler. Here on the CPU
    (torch has the fused step there too, forced on): two optimizer steps of a bf16-mixed fit with
    ``gradient_clip_val`` 1e-3, each clipped to that global norm."""
    import lit_modules.multi_lora_module as mlm

    monkeypatch.setattr(mlm, "fused_adamw_ok", lambda params, plugin: True)
    dm = data(tmp_path)
    check = _ClipCheck()
    t = trainer(tmp_path, [check], max_epochs=1, max_steps=2, precision="bf16-mixed", gradient_clip_val=1e-3)
    t.fit(module(), datamodule=dm)
    assert check.fused == [True, True]
    assert len(check.norms) == 2 and all(n <= 1e-3 * (1 + 1e-4) for n in check.norms), check.norms


@pytest.mark.gpu
def test_a_gpu_fit_takes_the_fused_adamw_and_clips(tmp_path: Path) -> None:
    """On CUDA the default optimizer is the fused AdamW, and a bf16-mixed fit with ``gradient_clip_val`` runs and
    clips (Lightning alone stops such a fit at its first optimizer step)."""
    dm = data(tmp_path, pin_memory=True)
    check = _ClipCheck()
    t = trainer(tmp_path, [check], accelerator="gpu", max_epochs=1, max_steps=2, precision="bf16-mixed",
                gradient_clip_val=1e-3)  # fmt: skip
    t.fit(module(), datamodule=dm)
    assert check.fused == [True, True]
    assert all(n <= 1e-3 * (1 + 1e-4) for n in check.norms), check.norms
