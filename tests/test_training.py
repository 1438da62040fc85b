"""Multi-LoRA training: parameter groups, the cache-sharing-aware loss, configs, resume, export, a tiny fit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from datamodules import BYTE_VOCAB_SIZE, RoleExampleDataModule, byte_tokenizer, collate_examples
from lit_modules import ExportAdapters, MultiLoraModule
from lit_modules.cli import LRAgentCLI, run_lightning_cli
from lit_modules.multi_lora_module import token_loss, warmup_cosine
from lit_modules.run_status import RunStatus
from lit_modules.time_budget import TimeBudget
from lragent.cli_main import main as cli_main

REPO = Path(__file__).resolve().parents[1]
OVERLAYS = ("ddp", "fsdp_8b")  # strategy overlays, parsed over their base configs in tests/test_multi_gpu.py
CONFIGS = sorted(c for c in (REPO / "configs").glob("*.yaml") if c.stem not in OVERLAYS)
ROLES = ["plan", "action", "reflect"]
TINY = {"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": 2}


def tiny_module(**kwargs) -> MultiLoraModule:
    """A 2-layer, hidden-64 random LLaMA with the byte tokenizer; adapters built."""
    args = dict(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, dropout=0.0)
    m = MultiLoraModule(**{**args, **kwargs})
    m.configure_model()
    return m


def write_data(tmp_path: Path, n: int = 8) -> dict[str, str]:
    """Small agent-like role files: a prompt with an earlier response, a last prompt piece, a short output."""
    files = {}
    for r, role in enumerate(ROLES):
        rows = [
            {
                "input": f"Question {i}: what is {i} + {r}?\nThought: \n### Response:\nI add them.\n"
                f"{role.capitalize()}: \n### Response:\n",
                "output": f"{role} {i + r}",
            }
            for i in range(n)
        ]
        path = tmp_path / f"{role}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in rows))
        files[role] = str(path)
    return files


def tiny_data(tmp_path: Path, n: int = 8, **kwargs) -> RoleExampleDataModule:
    args = dict(tokenizer=byte_tokenizer(), max_length=96, batch_size=4, val_fraction=0.0)
    dm = RoleExampleDataModule(write_data(tmp_path, n), roles=ROLES, **{**args, **kwargs})
    dm.setup()
    return dm


def tiny_trainer(tmp_path: Path, **kwargs) -> Trainer:
    args = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )  # fmt: skip
    return Trainer(**{**args, **kwargs})


# --------------------------------------------------------------------------------------------- parameter groups


@pytest.mark.parametrize("shared_a", [True, False])
def test_per_role_lr_groups(shared_a: bool) -> None:
    m = tiny_module(shared_a=shared_a, role_lr={"plan": 1e-4, "action": 2e-4, "reflect": 3e-4}, shared_a_lr=5e-4)
    groups = {g["name"]: g for g in m.param_groups()}
    assert set(groups) == ({"shared_a"} if shared_a else set()) | set(ROLES)
    assert [groups[r]["lr"] for r in ROLES] == [1e-4, 2e-4, 3e-4]
    if shared_a:
        assert groups["shared_a"]["lr"] == 5e-4
    # Every adapter parameter is in exactly one group, the base is in none, and each B sits with its own role.
    grouped = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in m.lora_model.lora_parameters())
    assert len(set(grouped)) == len(grouped)
    n_layers = 2
    for rid, role in enumerate(ROLES):
        mods = m.lora_model.lora_modules().values()
        expected = {id(mod.lora_B[rid]) for mod in mods} | (
            set() if shared_a else {id(mod.lora_A[rid]) for mod in mods}
        )
        assert {id(p) for p in groups[role]["params"]} == expected
        assert len(groups[role]["params"]) == 2 * n_layers * (1 if shared_a else 2)  # q_proj and v_proj per layer
    assert all(not p.requires_grad for p in m.lora_model.model.parameters() if id(p) not in set(grouped))


def test_paper_learning_rates_are_the_default() -> None:
    m = MultiLoraModule(model_name="tiny-llama")
    assert m.train_config.role_lr == {"plan": 5e-5, "action": 6e-5, "reflect": 6e-5}


def test_optimizer_groups_follow_the_schedule(tmp_path: Path) -> None:
    m = tiny_module(role_lr={"plan": 1e-3, "action": 2e-3, "reflect": 3e-3}, shared_a_lr=4e-3, warmup_ratio=0.25)
    dm = tiny_data(tmp_path)
    seen = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append({g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups})

    tiny_trainer(tmp_path, max_steps=8, callbacks=[Record()]).fit(m, dm)
    peak = {"shared_a": 4e-3, "plan": 1e-3, "action": 2e-3, "reflect": 3e-3}
    assert len(seen) == 8
    for step, lrs in enumerate(seen):
        factor = warmup_cosine(step, 8, 2)  # 8 optimizer steps, warmup ceil(0.25 * 8)
        assert lrs == pytest.approx({k: v * factor for k, v in peak.items()})


# ------------------------------------------------------------------------------------------------------- losses


def test_lambda_zero_is_plain_multi_lora_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = tiny_module(lambda_shared=0.0)
    m.lora_model.init_adapters("random", seed=1, b_std=0.5)
    batch = next(iter(tiny_data(tmp_path).train_dataloader()))
    for name in ("shared_context_forward", "shared_sequence_forward"):
        monkeypatch.setattr(m.lora_model, name, lambda *a, **k: pytest.fail("shared path ran at λ=0"))
    loss = m.compute_loss(batch)["loss"]
    # Reference: each sequence through a plain transformers model with its role's adapter merged in.
    total, count = 0.0, 0
    for i, rid in enumerate(batch["role_ids"].tolist()):
        n = int(batch["lengths"][i])
        logits = m.lora_model.merged_model(rid)(batch["input_ids"][i : i + 1, :n]).logits
        loss_i, n_i = token_loss(logits, batch["labels"][i : i + 1, :n])
        total, count = total + loss_i * n_i, count + n_i
    assert torch.allclose(loss, total / count, atol=1e-5, rtol=0)


def test_shared_term_with_one_role_equals_plain(tmp_path: Path) -> None:
    """One role: the producer is the consumer, so the shared-cache path changes nothing."""
    files = write_data(tmp_path)
    m = tiny_module(roles=["plan"], lambda_shared=1.0)
    m.lora_model.init_adapters("random", seed=2, b_std=0.5)
    dm = RoleExampleDataModule({"plan": files["plan"]}, tokenizer=byte_tokenizer(), max_length=96, val_fraction=0.0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert (batch["prefix_len"] > 0).all()  # the context really goes through the cache
    shared = m.compute_loss(batch)["shared"]
    m.train_config.lambda_shared = 0.0
    assert torch.allclose(shared, m.compute_loss(batch)["plain"], atol=1e-5, rtol=0)


def test_shared_term_differs_across_roles_and_mixes_linearly(tmp_path: Path) -> None:
    m = tiny_module(lambda_shared=0.3, producer="next")
    m.lora_model.init_adapters("random", seed=3, b_std=0.5)
    dm = tiny_data(tmp_path)
    batch = collate_examples([dm.train_set[i] for i in (0, 9, 17, 20)], pad_id=257)  # every role present
    assert set(batch["role_ids"].tolist()) == {0, 1, 2}
    out = m.compute_loss(batch)
    assert not torch.allclose(out["plain"], out["shared"], atol=1e-4)  # another role's cache is not the same
    assert torch.allclose(out["loss"], 0.7 * out["plain"] + 0.3 * out["shared"])
    out["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.lora_model.lora_parameters())


def test_sample_mode_takes_one_term_per_step_the_shared_one_with_probability_lambda(tmp_path: Path) -> None:
    """``lambda_mode: sample``: each step's loss is exactly the weighted mode's plain or shared term at that step
    (only that one is computed), the shared one in a share λ of the steps (the same loss in expectation)."""
    weighted = tiny_module(lambda_shared=0.25)
    sampled = tiny_module(lambda_shared=0.25, lambda_mode="sample")
    sampled.load_state_dict(weighted.state_dict())
    dm = tiny_data(tmp_path)
    batch = collate_examples([dm.train_set[i] for i in (0, 9, 17, 20)], pad_id=257)
    n_shared, n_steps = 0, 24
    with torch.no_grad():
        for seed in range(n_steps):
            both, one = weighted.compute_loss(batch, seed=seed), sampled.compute_loss(batch, seed=seed)
            assert len(set(one) - {"loss"}) == 1  # one pass per step
            term = "shared" if "shared" in one else "plain"
            assert torch.allclose(one["loss"], both[term], atol=1e-6, rtol=0)
            n_shared += term == "shared"
    # 24 fair draws at λ = 0.25: 6 expected; [1, 12] holds with probability > 0.99 (and excludes 1 - λ's 18)
    assert 1 <= n_shared <= 12, n_shared
    draws = [  # the draw is a function of the step's seed: the same on every rank and after a resume
        "shared" in sampled.compute_loss(batch, seed=s) for s in range(4)
    ]
    assert draws == ["shared" in sampled.compute_loss(batch, seed=s) for s in range(4)]
    for lam in (0.0, 1.0):  # nothing to draw at the ends
        m = tiny_module(lambda_shared=lam, lambda_mode="sample")
        assert set(m.compute_loss(batch, seed=0)) == {"loss", "plain" if lam == 0 else "shared"}


def test_producer_is_always_another_role() -> None:
    m = MultiLoraModule(model_name="tiny-llama")
    consumers = torch.tensor([0, 1, 2] * 50)
    for seed in range(5):
        producers = m.draw_producers(consumers, seed)
        assert (producers != consumers).all() and producers.max() < 3
        assert torch.equal(producers, m.draw_producers(consumers, seed))  # seeded


# --------------------------------------------------------------------------------------------------- validation


def test_validation_logs_per_role_and_scheme(tmp_path: Path) -> None:
    dm = tiny_data(tmp_path, val_fraction=0.25)
    fresh = tiny_module()  # B = 0: every scheme is the base model, so sharing costs nothing
    metrics = tiny_trainer(tmp_path, limit_val_batches=None).validate(fresh, dm, verbose=False)[0]
    for role in ROLES:
        for scheme in ("base_lr_shared", "full_shared"):
            assert metrics[f"val/{role}/{scheme}/kl"] == pytest.approx(0.0, abs=1e-6)
            assert metrics[f"val/{role}/{scheme}/loss"] == pytest.approx(metrics[f"val/{role}/loss"], abs=1e-5)
            assert 0 <= metrics[f"val/{role}/{scheme}/acc"] <= 1
    trained = tiny_module()
    trained.lora_model.init_adapters("random", seed=4, b_std=0.5)
    metrics = tiny_trainer(tmp_path, limit_val_batches=None).validate(trained, dm, verbose=False)[0]
    assert all(metrics[f"val/{role}/full_shared/kl"] > 1e-4 for role in ROLES)
    assert all(metrics[f"val/{role}/base_lr_shared/kl"] >= 0 for role in ROLES)


# ------------------------------------------------------------------------------------------------ configs + CLI


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_parses(config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)  # data paths in configs are relative to the repository root
    cli = LRAgentCLI(run=False, args=["--config", str(config), "--trainer.default_root_dir", str(tmp_path)])
    model, data = cli.model, cli.datamodule
    assert isinstance(model, MultiLoraModule) and isinstance(data, RoleExampleDataModule)
    assert data.roles == list(model.lora_config.roles) == ROLES  # linked
    expected_model = "qwen2.5-coder-1.5b" if config.stem.startswith("qwen_") else "default"
    assert data.hparams.tokenizer == model.hparams.model_name == expected_model  # linked
    assert model.lora_config.rank == 8 and model.lora_config.alpha == 16.0
    assert model.lora_config.targets == ("q_proj", "v_proj")
    assert any(isinstance(c, ModelCheckpoint) and c.save_last for c in cli.trainer.callbacks)
    assert any(isinstance(c, ExportAdapters) for c in cli.trainer.callbacks)
    if config.stem.startswith("embedded_"):  # the embedded model's recipe
        assert config.stem.removeprefix("embedded_") in data.data_files["plan"]
        assert set(model.train_config.role_lr.values()) == {model.train_config.shared_a_lr}  # one lr for all
        assert model.train_config.val_schemes == ()  # plain validation each epoch
        assert data.max_tokens == 16384 and data.max_length == 4096 and cli.trainer.accumulate_grad_batches == 1
        stop = [c for c in cli.trainer.callbacks if isinstance(c, EarlyStopping)]
        export = next(c for c in cli.trainer.callbacks if isinstance(c, ExportAdapters))
        assert model.lora_config.shared_a and export.dtype == "bfloat16"
        if config.stem == "embedded_scienceqa":  # the sharing study's shipped λ = 0.5 set (results/study)
            assert model.train_config.lambda_shared == 0.5 and model.train_config.shared_scheme == "base_lr_shared"
            assert not data.pack_prefixes and data.option_variants == [2, 3]
            assert cli.trainer.max_epochs == 2 and not stop and not export.best  # equal steps, last weights
        else:
            assert model.train_config.lambda_shared == 0.0 and data.pack_prefixes
            assert cli.trainer.max_epochs == 10 and export.best
            assert len(stop) == 1 and stop[0].monitor == "val/loss" and stop[0].patience == 2
        assert any(isinstance(c, RunStatus) for c in cli.trainer.callbacks)
        assert any(isinstance(c, TimeBudget) and c.deadline is None for c in cli.trainer.callbacks)
        assert {type(lg).__name__ for lg in cli.trainer.loggers} == {"CSVLogger"}
        return
    if config.stem.startswith("qwen_"):  # the accuracy model: the sharing study's form (unpacked, fixed epochs)
        assert config.stem.removeprefix("qwen_") in data.data_files["plan"]
        assert set(model.train_config.role_lr.values()) == {model.train_config.shared_a_lr}  # one lr for all
        assert model.hparams.model_dtype == "bfloat16" and model.hparams.gradient_checkpointing
        assert not data.pack_prefixes and data.max_tokens == 16384 and data.max_length == 4096
        assert data.option_variants == ([2, 3] if config.stem == "qwen_scienceqa" else None)
        export = next(c for c in cli.trainer.callbacks if isinstance(c, ExportAdapters))
        assert not export.best and export.dtype == "bfloat16"
        assert not any(isinstance(c, EarlyStopping) for c in cli.trainer.callbacks)
        assert all(str(tmp_path) not in str(d) for d in data.data_files.values())
        return
    if config.stem != "smoke":  # the paper's settings (8B models)
        assert model.train_config.role_lr == {"plan": 5e-5, "action": 6e-5, "reflect": 6e-5}
        assert model.lora_config.dropout == 0.05 and model.train_config.warmup_ratio == 0.05
        assert cli.trainer.max_epochs == 10
        assert data.batch_size * cli.trainer.accumulate_grad_batches == 32
        assert model.lora_config.shared_a == (config.stem != "multi_lora")
    assert {type(lg).__name__ for lg in cli.trainer.loggers} == {"TensorBoardLogger", "CSVLogger"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.rank", "0"], "rank must be a positive integer, got 0"),
        (["--model.lr=-1e-4"], "lr must be > 0, got -0.0001"),
        (["--model.role_lr", "{plan: 0.0}"], "learning rate of role 'plan' must be > 0, got 0.0"),
        (["--model.role_lr", "{critic: 1e-4}"], "unknown role 'critic' in role_lr"),
        (["--data.data_files", "{plan: a.jsonl.gz, critic: b.jsonl.gz}"], "unknown role 'critic' in data_files"),
        (["--data.data_files.plan", "nope/plan.jsonl.gz"], "data file not found: nope/plan.jsonl.gz"),
        (["--model.targets", "[q_proj, w_proj]"], "targets ['w_proj'] not supported"),
        (["--model.lambda_shared", "1.5"], "lambda_shared must be in [0, 1], got 1.5"),
        (["--model.lambda_mode", "probability"], "lambda_mode 'probability' not supported: allowed weight, sample"),
    ],
)
def test_bad_values_stop_before_training(override, message, monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.chdir(REPO)
    args = ["fit", "--config", str(REPO / "configs/smoke.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        run_lightning_cli([*args, *override])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_target_module_the_model_lacks_stops_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    from lragent import models

    real = models.load_model

    def without_gate_proj(*args, **kwargs):  # a LLaMA variant whose MLP has no gate_proj
        hf, tok = real(*args, **kwargs)
        for layer in hf.model.layers:
            del layer.mlp.gate_proj
        return hf, tok

    monkeypatch.setattr(models, "load_model", without_gate_proj)
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, targets=["gate_proj"])
    with pytest.raises(ValueError, match=r"target modules \['gate_proj'\] not found in the model"):
        m.configure_model()  # the first hook of fit, before any step


# ------------------------------------------------------------------------------------------------ resume, export


class _Kill(Callback):
    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            raise RuntimeError("killed")


class _AtStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.optimizer_state = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.lr = [g["lr"] for g in trainer.optimizers[0].param_groups]


def test_killed_run_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    kw = dict(lambda_shared=0.5, role_lr={"plan": 1e-2, "action": 1e-2, "reflect": 1e-2}, shared_a_lr=1e-2)

    def run(ckpt_dir: Path, callbacks, ckpt_path=None) -> tuple[MultiLoraModule, Trainer]:
        m, dm = tiny_module(**kw), tiny_data(tmp_path)
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1)
        trainer = tiny_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, callbacks=[ckpt, *callbacks])
        try:
            trainer.fit(m, dm, ckpt_path=ckpt_path)
        except RuntimeError as e:
            assert str(e) == "killed"
        return m, trainer

    reference, ref_trainer = run(tmp_path / "ref", [])
    assert ref_trainer.global_step == 12  # 2 epochs x 6 steps
    _, killed = run(tmp_path / "run", [_Kill(at_step=8)])  # dies mid epoch 2; the last checkpoint is after epoch 1
    assert killed.global_step == 8
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 6
    assert not any(k.endswith("base.weight") for k in saved["state_dict"])  # adapters only, the base is reloaded
    probe = _AtStart()
    resumed, trainer = run(tmp_path / "run", [probe], ckpt_path="last")
    assert probe.step == 6
    restored, stored = probe.optimizer_state, saved["optimizer_states"][0]
    assert restored["param_groups"] == stored["param_groups"]
    for i, state in stored["state"].items():
        for k, v in state.items():
            assert torch.equal(restored["state"][i][k], v), (i, k)
    assert trainer.global_step == 12
    for (name, a), b in zip(resumed.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name  # the same run as without the kill


def test_export_writes_peft_dirs_that_match_the_model(tmp_path: Path) -> None:
    from peft import PeftModel

    from lragent.models import load_model

    m, dm = tiny_module(), tiny_data(tmp_path)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[ExportAdapters(str(tmp_path / "fit_adapters"))])
    trainer.fit(m, dm)
    m.lora_model.init_adapters("random", seed=5, b_std=0.5)  # distinct, non-zero B per role
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert (tmp_path / "fit_adapters" / "plan" / "adapter_config.json").is_file()  # written at the end of fit
    assert cli_main(["export", "--ckpt", str(tmp_path / "model.ckpt"), "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    config = json.loads((out / "train_config.json").read_text())
    assert config["model"]["model_name"] == "tiny-llama" and config["lora_config"]["roles"] == ROLES
    assert config["data"]["max_length"] == 96
    assert (out / "lragent_adapters.safetensors").is_file()
    batch = next(iter(dm.train_dataloader()))
    m.eval()
    for rid, role in enumerate(ROLES):
        base, _ = load_model("tiny-llama", overrides=TINY)
        peft_model = PeftModel.from_pretrained(base, out / role).eval()
        ids = batch["input_ids"][:1, : int(batch["lengths"][0])]
        with torch.no_grad():
            expected = m(ids, torch.tensor([rid]))
            assert torch.allclose(peft_model(ids).logits, expected, atol=1e-5, rtol=0), role
    assert cli_main(["export", "--ckpt", str(tmp_path / "missing.ckpt"), "--out", str(out)]) == 2


# --------------------------------------------------------------------------------------------------- tiny fit


def test_tiny_trainer_run_loss_falls(tmp_path: Path) -> None:
    m = tiny_module(role_lr={"plan": 3e-2, "action": 3e-2, "reflect": 3e-2}, shared_a_lr=3e-2, lambda_shared=0.5)
    dm = tiny_data(tmp_path, n=16)
    losses = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    tiny_trainer(tmp_path, max_epochs=3, gradient_clip_val=1.0, callbacks=[Record()]).fit(m, dm)
    assert len(losses) == 36
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.25, (first, last)  # measured: 5.51 -> 5.12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shared_a_lr": 0.0}, "shared_a_lr must be > 0, got 0.0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0, got -0.1"),
        ({"betas": (0.9, 1.0)}, "betas must be two values in [0, 1), got (0.9, 1.0)"),
        ({"betas": (0.9,)}, "betas must be two values in [0, 1), got (0.9,)"),
        ({"warmup_ratio": 1.0}, "warmup_ratio must be in [0, 1), got 1.0"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio must be in [0, 1], got 1.5"),
        ({"shared_scheme": "non_shared"}, "scheme 'non_shared' cannot be trained or validated through the shared"),
        ({"val_schemes": ("droidspeak",)}, "scheme 'droidspeak' cannot be trained or validated through the shared"),
        ({"producer": "previous"}, "producer 'previous' not supported: allowed random, next, prefix"),
        ({"shared_split": "middle"}, "shared_split 'middle' not supported: allowed piece, last_token"),
    ],
)
def test_training_config_refuses_bad_values_naming_them(kwargs, message) -> None:
    import re

    from lit_modules.multi_lora_module import TrainingConfig

    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        TrainingConfig(**{"role_lr": {"plan": 1e-4}, "shared_a_lr": 1e-4, **kwargs})


def test_independent_a_refuses_base_lr_shared_and_a_small_vocabulary_is_named() -> None:
    with pytest.raises(ValueError, match="^scheme base_lr_shared needs shared A: set shared_a: true or use full_sh"):
        MultiLoraModule(model_name="tiny-llama", shared_a=False, val_schemes=["full_shared", "base_lr_shared"])
    MultiLoraModule(model_name="tiny-llama", shared_a=False, val_schemes=["full_shared"])  # full_shared: allowed
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides={"vocab_size": 100})
    with pytest.raises(ValueError, match=f"^tokenizer has {BYTE_VOCAB_SIZE} tokens but model 'tiny-llama' only 100"):
        m.configure_model()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"seconds": 0}, "seconds must be > 0 or null, got 0"), ({"safety": 0.5}, "safety must be >= 1, got 0.5")],
)
def test_time_budget_refuses_bad_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        TimeBudget(**kwargs)


def test_export_refuses_a_dtype_and_a_file_that_is_no_checkpoint(tmp_path: Path, capsys) -> None:
    not_ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, not_ckpt)
    out = tmp_path / "export"
    assert cli_main(["export", "--ckpt", str(not_ckpt), "--out", str(out), "--dtype", "int8"]) == 2
    assert capsys.readouterr().err.startswith("error: --dtype 'int8' not supported: allowed float32, bfloat16, float16")
    assert cli_main(["export", "--ckpt", str(not_ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {not_ckpt} is not a Lightning checkpoint written by fit (no state_dict and hyper")
    assert not out.exists()
