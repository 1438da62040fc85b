"""Memory-aware batching: the plan's figures are the engine's real allocations, and the commands refuse (or size) a
batch from a free-memory figure before the model loads (the free-memory query is faked here)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_multi_lora

import cli
from lragent import memory_plan
from lragent.engine import Engine
from lragent.memory_plan import GIB, ModelShape, choose_batch, model_shape, plan_memory, session_capacity
from lragent.schemes import SCHEMES


@pytest.mark.parametrize("scheme", SCHEMES)
def test_plan_is_what_the_engine_allocates(scheme):
    """Cache bytes equal the pool an engine of that many rows allocates; model bytes equal the parameters."""
    model = tiny_multi_lora("tiny-llama", rank=4)
    shape = ModelShape.from_config(model.model.config)
    for rows, capacity in ((1, 64), (3, 96)):
        eng = Engine(model, scheme, rows=rows, capacity=capacity, eos_token_ids=[], droidspeak_layers=[1, 2])
        plan = plan_memory(shape, scheme, rows, capacity, element_size=4, rank=4, droidspeak_layers=[1, 2])
        assert plan.cache_bytes == eng.pool.allocated_bytes(), (scheme, rows)
        state = [eng.d_tok, eng.d_pos, eng.d_gen, eng.d_stop, eng.d_logits, eng.d_eos]
        assert plan.state_bytes >= sum(t.numel() * t.element_size() for t in state)
    params = sum(p.numel() for p in model.parameters())
    assert plan.model_bytes == params * 4
    assert plan.total > plan.cache_bytes + plan.model_bytes


@pytest.mark.parametrize("arch", ["smollm2-135m", "llama-3.1-8b", "tiny-qwen2"])
def test_base_params_from_the_config_alone(arch):
    """The parameter count computed from the config equals the model's (built on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lragent.models import NAMED_ARCHITECTURES

    fields = dict(NAMED_ARCHITECTURES[arch])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    assert model_shape(arch).base_params() == sum(p.numel() for p in hf.parameters())
    assert model_shape("default") == model_shape("smollm2-135m")


def test_non_shared_caches_scale_with_roles():
    """DESIGN.md's memory accounting, in the plan: non_shared ~ roles x full_shared; base_lr_shared adds V_lr only."""
    shape = model_shape("smollm2-135m")
    plan = {s: plan_memory(shape, s, 32, 8192, element_size=2).cache_bytes for s in SCHEMES}
    kv_slot = plan["full_shared"] / 33  # 32 rows + the scratch slot
    assert plan["non_shared"] == pytest.approx(kv_slot * (3 * 32 + 1))
    assert 0 < plan["base_lr_shared"] - plan["full_shared"] < 0.05 * plan["full_shared"]


@pytest.fixture
def free(monkeypatch):
    """Fakes the free-memory query; returns a setter."""
    box = {"bytes": 0}
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: box["bytes"])

    def set_free(n: int) -> None:
        box["bytes"] = int(n)

    return set_free


def _need(scheme: str, batch: int, capacity: int = 8192) -> int:
    return plan_memory(model_shape("default"), scheme, batch, capacity, element_size=2).total


def test_choose_batch_refuses_and_sizes(free):
    free(_need("non_shared", 40) + 1)
    args = dict(dtype="bfloat16", device="cpu")  # the free figure is faked: any device
    assert choose_batch("default", ["non_shared"], 40, 8192, **args) == 40
    with pytest.raises(ValueError) as err:
        choose_batch("default", ["full_shared", "non_shared"], 96, 8192, **args)
    msg = str(err.value)
    assert "\n" not in msg and "--batch 96 needs" in msg and "non_shared" in msg and "GiB is free" in msg
    assert "allowed --batch <= 40 or --batch auto" in msg
    # auto: the largest batch that fits, for the hungriest of the schemes
    assert choose_batch("default", ["full_shared", "non_shared"], "auto", 8192, **args) == 40
    assert choose_batch("default", ["full_shared"], "auto", 8192, **args) > 40
    assert choose_batch("default", ["full_shared"], "auto", 8192, max_batch=7, **args) == 7
    free(_need("full_shared", 1) - 1)
    with pytest.raises(ValueError, match="even one episode needs"):
        choose_batch("default", ["full_shared"], "auto", 8192, **args)
    with pytest.raises(ValueError, match="invalid: allowed a positive integer or auto"):
        choose_batch("default", ["full_shared"], "many", 8192, **args)


def test_concurrent_schemes_need_every_schemes_caches_at_once(free):
    """With every scheme's engine alive at once, the need is the model once plus each scheme's caches and workspace:
    a batch that fits the hungriest scheme alone is refused, and auto sizes for the sum."""
    shape = model_shape("default")
    plans = [plan_memory(shape, s, 24, 8192, element_size=2) for s in ("non_shared", "full_shared")]
    together = plans[0].model_bytes + sum(p.total - p.model_bytes for p in plans)
    args = dict(dtype="bfloat16", device="cpu")
    free(together + 1)
    assert choose_batch("default", ["non_shared", "full_shared"], 24, 8192, concurrent=True, **args) == 24
    assert choose_batch("default", ["non_shared", "full_shared"], "auto", 8192, concurrent=True, **args) == 24
    free(together - 1)
    assert choose_batch("default", ["non_shared", "full_shared"], 24, 8192, **args) == 24  # one at a time: fits
    with pytest.raises(ValueError, match="non_shared\\+full_shared"):
        choose_batch("default", ["non_shared", "full_shared"], 24, 8192, concurrent=True, **args)
    assert choose_batch("default", ["non_shared", "full_shared"], "auto", 8192, concurrent=True, **args) == 23


def test_session_capacity_follows_the_engine_growth():
    assert session_capacity(10) == 1024
    assert session_capacity(1025) == 2048
    assert session_capacity(5000) == 8192
    assert session_capacity(3000, initial=1024) == 4096


def test_eval_refuses_a_batch_that_does_not_fit_before_loading(tmp_path, capsys, free, monkeypatch):
    """``eval --batch 96`` with too little free memory: one line naming the need and what is free, exit 2, and the
    model is never loaded; ``--batch auto`` picks, once the model is loaded, the batch that fits in what is free then
    and hands it to the executor."""
    import eval_suite.evaluate.run_eval as re_

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(re_, "load_lora_model", no_load)
    free(_need("non_shared", 12, 4096) + GIB // 100)
    argv = ["eval", "--adapter_init", "zero", "--limit", "20", "--dtype", "bfloat16", "--device", "cpu"]
    argv += ["--capacity", "4096", "--quiet", "true"]
    assert cli.main([*argv, "--batch", "96", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --batch 96 needs"), err
    assert "allowed --batch <= 12 or --batch auto" in err[0]
    assert not (tmp_path / "a").exists()

    chosen = {}

    class Stop(Exception):
        pass

    def fake_executor(lm, tok, *, batch, **kwargs):
        chosen["batch"] = batch
        raise Stop

    import eval_suite.evaluate.batched_executor as be

    def load_takes_the_models_memory(**kwargs):  # after loading, the model's bytes are no longer free
        plan = plan_memory(model_shape("default"), "non_shared", 12, 4096, element_size=2)
        free(plan.total + GIB // 100 - plan.model_bytes)
        return None, None

    monkeypatch.setattr(re_, "load_lora_model", load_takes_the_models_memory)
    monkeypatch.setattr(be, "BatchedExecutor", fake_executor)
    with pytest.raises(Stop):
        cli.main([*argv, "--batch", "auto", "--out", str(tmp_path / "b")])
    assert chosen == {"batch": 12}
    assert "eval: --batch auto: 12 episodes at once" in capsys.readouterr().err  # the user sees what was chosen


def test_sizes_below_one_are_refused_naming_them():
    shape = model_shape("tiny-llama")
    with pytest.raises(ValueError, match="^batch and capacity must be >= 1, got 0 and 64$"):
        plan_memory(shape, "full_shared", 0, 64, element_size=4)
    with pytest.raises(ValueError, match="^batch and capacity must be >= 1, got 2 and 0$"):
        plan_memory(shape, "full_shared", 2, 0, element_size=4)
    with pytest.raises(ValueError, match="^--batch must be >= 1 or auto, got 0$"):
        choose_batch("tiny-llama", ["full_shared"], 0, 64, dtype="float32", device="cpu")


def test_extra_memory_beside_the_engine_counts_where_it_is_larger(free):
    """``extra_bytes`` (memory needed next to the model at another time than the engine): the need is the model plus
    the larger of the engine's memory and it, so a batch that fits the engine alone is refused for a larger extra."""
    plan = plan_memory(model_shape("default"), "full_shared", 8, 4096, element_size=2)
    beside = plan.total - plan.model_bytes
    args = dict(dtype="bfloat16", device="cpu")
    free(plan.total)
    assert choose_batch("default", ["full_shared"], 8, 4096, extra_bytes=beside, **args) == 8
    with pytest.raises(ValueError, match="^--batch 8 needs .* allowed fewer positions per episode than 4096$"):
        choose_batch("default", ["full_shared"], 8, 4096, extra_bytes=beside + GIB // 10, **args)  # any batch
    extra = 3 * beside
    free(plan.model_bytes + extra)  # room for the extra: every batch whose engine needs less fits too
    assert choose_batch("default", ["full_shared"], 8, 4096, extra_bytes=extra, **args) == 8
    free(plan.model_bytes + extra - 1)
    with pytest.raises(ValueError, match=f"^--batch 8 needs {(plan.model_bytes + extra) / GIB:.2f} GiB"):
        choose_batch("default", ["full_shared"], 8, 4096, extra_bytes=extra, **args)


def test_a_model_whose_config_cannot_be_read_is_named(tmp_path):
    """A model folder whose config.json is broken is refused in one line naming the model."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"^could not read the config of model '{tmp_path}' \\(.+\\)$"):
        memory_plan.model_config(str(tmp_path))
