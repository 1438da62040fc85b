"""Several processes: DDP and FSDP (``lit_modules.strategies.LoraFSDPStrategy``) on two CPU processes (gloo) train
the same numbers as one process at the same global batch; every rank gets its own batches; validation scores every
example once with as many steps on every rank; checkpoints keep the one-device layout.

Sharded evaluation (``eval --devices N`` merged = one process) is pinned by
``tests/test_eval_runner.py::test_devices_shards_equal_one_process``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from safetensors.torch import load_file

from datamodules import BYTE_VOCAB_SIZE, RoleExampleDataModule, byte_tokenizer
from datamodules.role_examples import FILLER_SOURCE, LengthBucketBatchSampler, collate_examples
from lit_modules import MultiLoraModule
from lit_modules.cli import LRAgentCLI
from lit_modules.cli import export as export_command
from lit_modules.strategies import FrozenLeafPolicy, LoraFSDPStrategy, tied_parameter_ids

REPO = Path(__file__).resolve().parents[1]
ROLES = ["plan", "action", "reflect"]
TINY = {"vocab_size": BYTE_VOCAB_SIZE, "num_hidden_layers": 2}


def write_roles(tmp_path: Path, n: int = 10) -> dict[str, str]:
    """``n`` short agent-like examples per role (lengths vary with ``i``)."""
    files = {}
    for r, role in enumerate(ROLES):
        rows = [
            {"input": f"Question {i}: what is {i * 7} + {r}?\n### Response:\n", "output": f"{role} {i * 7 + r}"}
            for i in range(n)
        ]
        files[role] = str(tmp_path / f"{role}.jsonl")
        Path(files[role]).write_text("".join(json.dumps(x) + "\n" for x in rows))
    return files


# ------------------------------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("max_tokens", [None, 600])
@pytest.mark.parametrize("world", [2, 3])
def test_rank_batches_are_disjoint_and_step_k_is_the_accumulated_global_batch(world: int, max_tokens) -> None:
    lengths = torch.randint(5, 200, (101,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(batch_size=4, seed=1, pool_batches=5, max_tokens=max_tokens)
    one = list(LengthBucketBatchSampler(lengths, shuffle=True, **kw))
    ranks = [
        list(LengthBucketBatchSampler(lengths, shuffle=True, num_replicas=world, rank=r, **kw)) for r in range(world)
    ]
    steps = len(one) // world
    assert [len(b) for b in ranks] == [steps] * world  # as many steps on every rank
    for k in range(steps):  # step k of rank r = micro-batch r of step k with accumulate_grad_batches = world
        assert [ranks[r][k] for r in range(world)] == one[k * world : (k + 1) * world]
    seen = [i for rank in ranks for b in rank for i in b]
    assert len(seen) == len(set(seen))  # disjoint
    assert len(seen) >= len(lengths) - (world - 1) * max(len(b) for b in one)  # only the leftover batches dropped


@pytest.mark.parametrize("world", [2, 3, 4])
def test_validation_shards_score_every_example_once_with_equal_steps(world: int) -> None:
    lengths = [30, 12, 50, 7, 7, 19, 40]  # 4 batches of 2: not a multiple of 3 or of 4 ranks
    ranks = [
        list(LengthBucketBatchSampler(lengths, 2, shuffle=False, num_replicas=world, rank=r, fill=True))
        for r in range(world)
    ]
    assert len({len(b) for b in ranks}) == 1  # every rank runs as many validation steps (collectives need it)
    real = sorted(i for rank in ranks for b in rank for i in b if i < len(lengths))
    assert real == list(range(len(lengths)))  # every example exactly once
    fillers = [b for rank in ranks for b in rank if any(i >= len(lengths) for i in b)]
    assert len(fillers) == world * len(ranks[0]) - 4 and all(len(b) == 1 for b in fillers)


def test_filler_batch_scores_nothing(tmp_path: Path) -> None:
    dm = RoleExampleDataModule(write_roles(tmp_path, 4), roles=ROLES, tokenizer=byte_tokenizer(), max_length=96)
    dm.setup()
    n = len(dm.val_set)
    filler = dm.val_set[n + 1]
    assert filler.source == FILLER_SOURCE and filler.input_ids == dm.val_set[1].input_ids
    batch = collate_examples([filler], dm.pad_id)
    assert batch["loss_index"].numel() == 0 and batch["n_examples"] == 0
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY, val_schemes=None)
    m.configure_model()
    m.validation_step(batch, 0)
    assert all(float(s.sums.abs().sum()) == 0 for s in m.val_sums.values())


def test_lightning_distributed_sampler_is_refused(tmp_path: Path) -> None:
    """Lightning would rebuild the length-bucketed batch sampler around a DistributedSampler: a clear error instead."""
    dm = RoleExampleDataModule(write_roles(tmp_path, 4), roles=ROLES, tokenizer=byte_tokenizer(), max_length=96)
    dm.trainer = Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False)  # not launched
    with pytest.raises(ValueError, match="use_distributed_sampler must be false"):
        dm.train_dataloader()
    dm.trainer = Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False, use_distributed_sampler=False)
    assert len(dm.train_dataloader()) == len(dm.train_set) // 4 // 2  # this rank's half of the batches


# ------------------------------------------------------------------------------------------------------ configs


def test_overlays_parse_over_their_base_configs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(REPO)
    common = ["--trainer.default_root_dir", str(tmp_path), "--trainer.accelerator", "cpu"]
    cli = LRAgentCLI(
        run=False, args=["--config", "configs/embedded_hotpotqa.yaml", "--config", "configs/ddp.yaml", *common]
    )
    assert type(cli.trainer.strategy).__name__ == "DDPStrategy" and cli.trainer.num_devices == 2
    assert not cli.trainer._accelerator_connector.use_distributed_sampler
    cli = LRAgentCLI(run=False, args=["--config", "configs/hotpotqa.yaml", "--config", "configs/fsdp_8b.yaml", *common])
    assert isinstance(cli.trainer.strategy, LoraFSDPStrategy) and cli.trainer.num_devices == 2
    assert cli.model.hparams.model_name == "llama-3.1-8b" and cli.model.hparams.model_dtype == "bfloat16"
    assert cli.datamodule.hparams.tokenizer == "byte"  # linked from model.tokenizer_name
    assert not cli.trainer._accelerator_connector.use_distributed_sampler


def test_fsdp_wraps_frozen_leaves_and_keeps_adapters_and_tied_weights_in_the_root() -> None:
    m = MultiLoraModule(model_name="tiny-llama", tokenizer_name="byte", model_overrides=TINY)
    m.configure_model()
    hf = m.lora_model.model
    hf.lm_head.weight = hf.model.embed_tokens.weight  # tie them
    tied = tied_parameter_ids(m)
    policy = FrozenLeafPolicy(tied)
    layer = hf.model.layers[0]
    assert policy(layer.self_attn.q_proj.base) and policy(layer.self_attn.k_proj) and policy(layer.input_layernorm)
    q = layer.self_attn.q_proj
    assert not policy(q) and not policy(q.lora_A) and not policy(q.lora_B)  # the adapters: root unit
    assert not policy(layer) and not policy(hf.model.embed_tokens) and not policy(hf.lm_head)
    assert id(hf.lm_head.weight) in tied


# --------------------------------------------------------------------------------------- two CPU processes


def _config(tmp_path: Path, name: str, files: dict[str, str], callbacks: list[dict] | None = None) -> Path:
    run = tmp_path / name
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "32-true",
            "max_epochs": 2,
            "gradient_clip_val": 0.01,  # clips every step (the recipes clip; Lightning refuses it under FSDP)
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": str(run), "name": "csv", "version": 0},
                }
            ],
            "callbacks": [
                {
                    "class_path": "lit_modules.export.ExportAdapters",
                    "init_args": {"out_dir": f"{run}/adapters", "best": False},
                },
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": f"{run}/checkpoints", "save_top_k": -1, "every_n_epochs": 1},
                },
                *(callbacks or []),
            ],
        },
        "model": {
            "model_name": "tiny-llama",
            "tokenizer_name": "byte",
            "model_overrides": TINY,
            "roles": ROLES,
            "dropout": 0.0,  # no per-rank dropout masks
            "lr": 0.01,
            "role_lr": dict.fromkeys(ROLES, 0.01),
            "shared_a_lr": 0.01,
            "val_schemes": [],
        },
        "data": {"data_files": files, "max_length": 96, "batch_size": 2, "val_fraction": 0.25},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fit(config: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "cli.py"), "fit", "--config", str(config), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _val_losses(run: Path) -> list[float]:
    rows = (run / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    head = rows[0].split(",")
    col = head.index("val/loss")
    return [float(r.split(",")[col]) for r in rows[1:] if r.split(",")[col]]


def _adapters(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapters" / "lragent_adapters.safetensors"))


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The reference: one process with accumulate_grad_batches 2 (the two-process runs' global batch), 2 epochs.
    Shared by the DDP and FSDP tests (each under a minute on two CPU cores; together they once took 77 s)."""
    tmp_path = tmp_path_factory.mktemp("multi_cpu")
    files = write_roles(tmp_path)  # 24 training examples = 12 batches of 2 per epoch; 6 held out = 3 batches
    _fit(_config(tmp_path, "one", files), "--trainer.accumulate_grad_batches", "2")
    return tmp_path, files


def _assert_same_adapters_as_one_process(tmp_path: Path, run: str) -> dict[str, torch.Tensor]:
    """The export of a distributed run: the one-process run's files, keys, shapes and values."""
    a, b = _adapters(tmp_path / "one"), _adapters(tmp_path / run)
    assert max(float(a[k].abs().max()) for k in a) > 1e-3  # trained, not the B = 0 start
    assert sorted(b) == sorted(a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)
    assert sorted(p.name for p in (tmp_path / run / "adapters").iterdir()) == sorted(
        p.name for p in (tmp_path / "one" / "adapters").iterdir()
    )
    return a


def test_ddp_on_two_cpu_processes_trains_as_one_process(one_process_run: tuple[Path, dict[str, str]]) -> None:
    """Two processes (gloo, DDP from scratch) = one process at the same global batch: adapters and validation losses
    (every held-out example once: 3 validation batches over 2 ranks need a filler); FitSpeed writes one file per rank
    and the job's rate on rank 0."""
    tmp_path, files = one_process_run
    speed = {"class_path": "eval_suite.bench.train.FitSpeed", "init_args": {"out": f"{tmp_path}/fs.json"}}
    ddp = _config(tmp_path, "ddp", files, [speed])
    _fit(ddp, "--config", str(REPO / "configs" / "ddp.yaml"))
    fs = json.loads((tmp_path / "fs.json").read_text())
    per_rank = [json.loads((tmp_path / f"fs.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in per_rank] == [0, 1] and fs["world_size"] == 2
    assert [r["tokens"] for r in fs["ranks"]] == [r["tokens"] for r in per_rank] and per_rank[0]["tokens"] > 0
    assert per_rank[0]["tokens"] != per_rank[1]["tokens"]  # each rank timed its own batches
    assert fs["global_tokens"] == sum(r["tokens"] for r in per_rank)
    assert fs["global_tokens_per_s"] == pytest.approx(fs["global_tokens"] / max(r["seconds"] for r in fs["ranks"]))
    ref = _val_losses(tmp_path / "one")
    assert len(ref) == 2
    assert _val_losses(tmp_path / "ddp") == pytest.approx(ref, abs=1e-5)
    _assert_same_adapters_as_one_process(tmp_path, "ddp")


def test_fsdp_on_two_cpu_processes_trains_as_one_process(one_process_run: tuple[Path, dict[str, str]]) -> None:
    """FSDP on two processes, resumed from the one-process epoch-0 checkpoint (the layouts are one): validation
    loss, adapters, the checkpoint (one-device layout, optimizer state) and its export agree with one process."""
    tmp_path, files = one_process_run
    fsdp = _config(tmp_path, "fsdp", files)
    fsdp_overlay = tmp_path / "fsdp_overlay.yaml"
    fsdp_overlay.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "strategy": {"class_path": "lit_modules.strategies.LoraFSDPStrategy"},
                    "devices": 2,
                    "use_distributed_sampler": False,
                }
            }
        )
    )
    epoch0 = tmp_path / "one" / "checkpoints" / "epoch=0-step=6.ckpt"
    _fit(fsdp, "--config", str(fsdp_overlay), "--ckpt_path", str(epoch0))
    ref = _val_losses(tmp_path / "one")
    assert _val_losses(tmp_path / "fsdp") == pytest.approx(ref[1:], abs=1e-5)  # epoch 1, after the resume
    a = _assert_same_adapters_as_one_process(tmp_path, "fsdp")
    # the FSDP checkpoint has the one-device layout: export reads it and gives the same adapters
    c1 = torch.load(tmp_path / "one" / "checkpoints" / "epoch=1-step=12.ckpt", weights_only=False)
    c2 = torch.load(tmp_path / "fsdp" / "checkpoints" / "epoch=1-step=12.ckpt", weights_only=False)
    assert c2["global_step"] == c1["global_step"] == 12
    assert {k: v.shape for k, v in c2["state_dict"].items()} == {k: v.shape for k, v in c1["state_dict"].items()}
    o1, o2 = c1["optimizer_states"][0], c2["optimizer_states"][0]
    assert [g["params"] for g in o2["param_groups"]] == [g["params"] for g in o1["param_groups"]]
    for i, state in o1["state"].items():
        torch.testing.assert_close(o2["state"][i]["exp_avg"], state["exp_avg"], atol=1e-6, rtol=1e-4)
    export_command(str(tmp_path / "fsdp" / "checkpoints" / "epoch=1-step=12.ckpt"), str(tmp_path / "exported"))
    e = load_file(str(tmp_path / "exported" / "lragent_adapters.safetensors"))
    for k in a:
        torch.testing.assert_close(e[k], a[k], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--device 'tpu' not supported: allowed cpu, cuda, cuda:N"),
        ("cuda", "--device cuda: no CUDA device here"),
    ],
)
def test_export_device_is_checked_first(device: str, message: str, tmp_path: Path) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export_command(str(tmp_path / "missing.ckpt"), str(tmp_path / "out"), device=device)


SIGTERM_PROBE = '''
import json, os, signal

import torch.distributed as dist
from lightning.pytorch import Callback


class SigtermProbe(Callback):
    """SIGTERM to one rank's own process after its n-th training batch; on the way out each rank writes how many
    batches it finished and how many broadcasts went over the default group after setup."""

    def __init__(self, out: str, rank: int, after: int) -> None:
        self.out, self.rank, self.after = out, rank, after
        self.batches = self.default_broadcasts = 0

    def setup(self, trainer, pl_module, stage):
        original = dist.broadcast

        def counting(tensor, src=None, group=None, *args, **kwargs):
            if group is None or group is dist.group.WORLD:
                self.default_broadcasts += 1
            return original(tensor, src, group, *args, **kwargs)

        dist.broadcast = counting

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        if trainer.global_rank == self.rank and self.batches == self.after:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception):
        with open(f"{self.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump({"exception": type(exception).__name__, "batches": self.batches,
                       "default_broadcasts": self.default_broadcasts}, f)
'''


def _fit_with_sigterm(
    tmp_path: Path, signalled_rank: int, expect_stop: bool = False, **env_extra: str
) -> list[dict | None]:
    """A two-process DDP fit (gloo) whose rank ``signalled_rank`` gets SIGTERM after its second training batch; what
    each rank's probe wrote on the way out (None: it wrote nothing)."""
    (tmp_path / "sigterm_probe.py").write_text(SIGTERM_PROBE)
    out = tmp_path / "stop"
    probe = {"class_path": "sigterm_probe.SigtermProbe", "init_args": {"out": str(out), "rank": signalled_rank,
                                                                       "after": 2}}  # fmt: skip
    config = _config(tmp_path, "sig", write_roles(tmp_path), [probe])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", **env_extra}
    ddp = str(REPO / "configs" / "ddp.yaml")
    cmd = [sys.executable, str(REPO / "cli.py"), "fit", "--config", str(config), "--config", ddp]
    try:
        subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        if expect_stop:
            pytest.fail(
                f"the ranks did not stop together in 240 s (one waits in a collective): {str(e.stderr)[-2000:]}"
            )
    files = [out.with_name(f"stop.rank{r}.json") for r in (0, 1)]
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


@pytest.mark.parametrize(
    ("signalled_rank", "every", "stop_after"), [(1, "1", 2), (0, "1", 2), (1, "3", 3), (0, "", None)]
)
def test_a_sigterm_on_one_rank_stops_every_rank_at_the_same_batch_without_a_gpu_collective(
    tmp_path: Path, signalled_rank: int, every: str, stop_after: int | None
) -> None:
    """Two DDP processes (gloo, 6 training batches an epoch, 2 epochs); SIGTERM reaches one of them after its second
    training batch. Both stop at the next agreement with Lightning's SIGTERMException after the same number of batches
    (Lightning 2.6's own check left the other rank ending in a RuntimeError, either rank): with
    ``LRAGENT_SIGTERM_EVERY`` 1 after batch 2, at 3 after batch 3 (agreements at batch starts 1, 4, 7, ... counted
    across epochs); unset, the interval from the pace (1 to MAX_EVERY) puts the stop after batch 2 to 2 + MAX_EVERY - 1.
    No broadcast went over the default group during the fit (Lightning's per-batch check is one on the GPU under NCCL,
    whose read drains the GPU: lit_modules/sigterm_check.py)."""
    from lit_modules.sigterm_check import MAX_EVERY

    stops = _fit_with_sigterm(tmp_path, signalled_rank, expect_stop=True, LRAGENT_SIGTERM_EVERY=every)
    assert stops[0] is not None and stops == [stops[0]] * 2, stops  # the same stop on both ranks
    assert stops[0]["exception"] == "SIGTERMException" and stops[0]["default_broadcasts"] == 0
    if stop_after is not None:
        assert stops[0]["batches"] == stop_after
    else:
        assert 2 <= stops[0]["batches"] <= 2 + MAX_EVERY - 1


def test_agreement_interval_reads_the_variable_and_names_a_bad_value() -> None:
    from lit_modules.sigterm_check import agreement_interval

    assert agreement_interval({}) is None and agreement_interval({"LRAGENT_SIGTERM_EVERY": " "}) is None
    assert agreement_interval({"LRAGENT_SIGTERM_EVERY": "1"}) == 1
    assert agreement_interval({"LRAGENT_SIGTERM_EVERY": "32"}) == 32
    for bad in ("0", "-2", "2.5", "often"):
        with pytest.raises(ValueError, match=rf"LRAGENT_SIGTERM_EVERY='{re.escape(bad)}': expected a whole number"):
            agreement_interval({"LRAGENT_SIGTERM_EVERY": bad})


def test_the_interval_from_the_pace_fits_the_target_between_1_and_the_cap() -> None:
    """As many batches as fit in TARGET_S (1 s) at the last agreements' pace: the embedded model's 170 ms batches 5,
    an 8B step's seconds 1, millisecond batches the cap; nothing measured yet (the first agreement) 1."""
    from lit_modules.sigterm_check import MAX_EVERY, TARGET_S, next_interval

    assert TARGET_S == 1.0 and MAX_EVERY == 8
    assert next_interval(0.17 * 5, 5) == 5 and next_interval(0.17, 1) == 5
    assert next_interval(3.0, 1) == 1 and next_interval(12.0, 4) == 1
    assert next_interval(0.004, 1) == MAX_EVERY
    assert next_interval(0.0, 0) == 1 and next_interval(0.5, 0) == 1


def test_the_probe_sees_lightnings_own_per_batch_broadcast(tmp_path: Path) -> None:
    """The control of the test above: with Lightning's own check left in place (``LRAGENT_LIGHTNING_SIGTERM=1``) the
    same probe counts a default-group broadcast at each training batch start, so its 0 there is not a blind counter;
    Lightning stops rank 0 on its own signal."""
    stop0 = _fit_with_sigterm(tmp_path, 0, LRAGENT_LIGHTNING_SIGTERM="1")[0]
    assert stop0 is not None and stop0["exception"] == "SIGTERMException" and stop0["batches"] == 2
    assert stop0["default_broadcasts"] >= 2  # one at each of the two batch starts (and the handler's own)
