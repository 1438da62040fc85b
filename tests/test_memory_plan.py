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


# ------------------------------------------------------------------------------------ the plan's parts, one by one
def test_describe_names_the_caches_the_model_and_the_rest_in_gib():
    plan = memory_plan.MemoryPlan("full_shared", 2, 64, GIB, GIB // 4, 3 * GIB // 2, GIB // 2)
    assert plan.total == 13 * GIB // 4
    assert plan.describe() == (
        "full_shared: caches 1.00 GiB for 2 episode(s) x 64 positions, model 1.50 GiB, "
        "decode state and workspace 0.75 GiB"
    )


def test_a_plan_records_its_scheme_batch_and_capacity_and_one_position_is_a_capacity():
    plan = plan_memory(model_shape("tiny-llama"), "base_shared", 3, 1, element_size=4)
    assert (plan.scheme, plan.batch, plan.capacity) == ("base_shared", 3, 1)
    assert all(type(v) is int and v > 0 for v in (plan.cache_bytes, plan.state_bytes, plan.model_bytes))


def test_decode_state_is_an_int64_per_position_and_a_bool_and_an_fp32_per_vocabulary_entry_per_row():
    """One more position adds a generated-token (int64) per row; one more vocabulary entry adds the stop mask's
    bool and the pending logits' fp32 per row, and one entry of the EOS mask the rows share."""
    import dataclasses

    shape = model_shape("tiny-llama")
    state = lambda shape, capacity: plan_memory(shape, "full_shared", 3, capacity, element_size=2).state_bytes
    assert state(shape, 65) - state(shape, 64) == 3 * 8
    wider = dataclasses.replace(shape, vocab=shape.vocab + 1)
    assert state(wider, 64) - state(shape, 64) == 3 * (1 + 4) + 1


def test_the_plan_of_the_embedded_model_at_32_episodes_of_8192_positions_in_bf16_is_pinned():
    """The figures ``--batch auto`` and the study's card packing (eval_suite/study/decide.py) are sized from, for
    every scheme: a change to any term of the plan (the decode state, the workspace's decode-step, prefill and fixed
    parts, the 3 % margin) shows up here and must be deliberate."""
    shape = model_shape("default")
    pinned = {  # scheme: (caches, decode state, model, workspace) in bytes
        "non_shared": (18308136960, 10013696, 270688896, 1761261024),
        "full_shared": (6228541440, 10013696, 270688896, 1398873158),
        "droidspeak": (6539968512, 10013696, 270688896, 1408215970),
        "base_shared": (6609960960, 10013696, 270688896, 1410315744),
        "base_lr_shared": (6358302720, 10013696, 270688896, 1402765996),
    }
    for scheme, figures in pinned.items():
        plan = plan_memory(shape, scheme, 32, 8192, element_size=2)
        assert (plan.cache_bytes, plan.state_bytes, plan.model_bytes, plan.workspace_bytes) == figures, scheme


def test_droidspeak_caches_follow_the_recompute_layers_given():
    """Two recompute groups (layers 0 and 2 of tiny-llama) hold twice the hidden states of the default one group:
    the plan is what an engine with those layers allocates, not the default's."""
    model = tiny_multi_lora("tiny-llama", rank=4)
    shape = ModelShape.from_config(model.model.config)
    plan = plan_memory(shape, "droidspeak", 2, 64, element_size=4, rank=4, droidspeak_layers=[0, 2])
    eng = Engine(model, "droidspeak", rows=2, capacity=64, eos_token_ids=[], droidspeak_layers=[0, 2])
    assert plan.cache_bytes == eng.pool.allocated_bytes()
    assert plan.cache_bytes > plan_memory(shape, "droidspeak", 2, 64, element_size=4, rank=4).cache_bytes


def test_model_bytes_count_one_a_per_role_without_shared_a():
    shared, own = tiny_multi_lora("tiny-llama", rank=4), tiny_multi_lora("tiny-llama", rank=4, shared_a=False)
    shape = ModelShape.from_config(shared.model.config)
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert shape.base_params() + shape.adapter_params(4, 3) == count(shared)  # shared A by default
    assert shape.base_params() + shape.adapter_params(4, 3, shared_a=False) == count(own) > count(shared)
    plan = plan_memory(shape, "full_shared", 1, 64, element_size=4, rank=4, shared_a=False)
    assert plan.model_bytes == 4 * count(own)


def test_base_lr_shared_without_shared_a_is_refused_by_the_plan():
    with pytest.raises(ValueError, match="^scheme base_lr_shared needs shared A"):
        plan_memory(model_shape("tiny-llama"), "base_lr_shared", 1, 64, element_size=4, shared_a=False)


# ------------------------------------------------------------------------------------------- shapes from configs
def _meta_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_a_head_dim_other_than_hidden_over_heads_is_read_from_the_config():
    """A LLaMA whose heads are wider than hidden / heads (head_dim 32, not 16): the shape reads it, and its parameter
    count is the model's."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip
    shape = ModelShape.from_config(config)
    assert (shape.head_dim, shape.qkv_bias) == (32, False)
    assert shape.base_params() == _meta_params(config)


def test_attention_biases_are_read_from_a_llama_config_and_implied_by_qwen2():
    from transformers import AutoConfig

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert ModelShape.from_config(AutoConfig.for_model("llama", attention_bias=True, **sizes)).qkv_bias is True
    assert ModelShape.from_config(AutoConfig.for_model("llama", attention_bias=False, **sizes)).qkv_bias is False
    assert model_shape("tiny-qwen2").qkv_bias is True  # Qwen2 configs carry no attention_bias field


@pytest.mark.parametrize(
    "biases", [dict(attention_bias=True), dict(mlp_bias=True), dict(attention_bias=True, mlp_bias=True)]
)
def test_a_llama_with_biases_counts_every_bias_it_has(biases):
    """LLaMA's attention_bias puts a bias on o_proj as well as q/k/v; mlp_bias on gate, up and down: the count
    from the config is the model's."""
    from transformers import AutoConfig

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    config = AutoConfig.for_model("llama", **sizes, **biases)
    assert ModelShape.from_config(config).base_params() == _meta_params(config)


def test_a_mistral_config_has_no_attention_bias_field_and_no_biases():
    config = memory_plan.model_config("tiny-mistral")
    assert not hasattr(config, "attention_bias")
    shape = memory_plan.model_shape("tiny-mistral")
    assert shape.qkv_bias is False and shape.base_params() == _meta_params(config)


def test_a_config_naming_only_the_sizes_is_multi_head_untied_and_without_biases():
    """A bare config (no head_dim, num_key_value_heads, tie_word_embeddings or attention_bias): one K/V head per
    query head, head_dim = hidden / heads as a whole number, untied embeddings, no q/k/v biases."""
    from transformers import PretrainedConfig

    config = PretrainedConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256
    )
    shape = ModelShape.from_config(config)
    assert shape == ModelShape(2, 64, 128, 4, 4, 16, 256, tied=False, qkv_bias=False)
    assert type(shape.head_dim) is int


def test_the_accuracy_models_config_is_its_architecture_without_any_download():
    from lragent import accuracy_model

    for name in accuracy_model.NAMES:
        config = memory_plan.model_config(name)
        assert config.model_type == "qwen2" and config.hidden_size == accuracy_model.ARCHITECTURE["hidden_size"]
        assert memory_plan.model_shape(name).n_layers == accuracy_model.ARCHITECTURE["num_hidden_layers"]


def test_an_unreadable_config_is_named_by_the_first_line_of_the_error_or_else_its_type(monkeypatch):
    import transformers

    errors = iter([OSError("no config.json in m\nsee the docs"), OSError(), ValueError("  \n ")])

    def unreadable(name, *args, **kwargs):
        raise next(errors)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", unreadable)
    for reason in ("no config.json in m", "OSError", "ValueError"):
        with pytest.raises(ValueError) as err:
            memory_plan.model_config("some/model")
        assert str(err.value) == f"could not read the config of model 'some/model' ({reason})"


def test_session_capacity_grows_as_the_engine_doubling_rounded_up_to_256():
    assert session_capacity(1024) == 1024  # exactly full: no growth
    assert session_capacity(2048) == 2048
    assert session_capacity(1000, initial=100) == 1024  # 100 -> 256 -> 512 -> 1024
    assert session_capacity(600, initial=257) == 768  # 2 x 257 = 514, rounded up to 768
    assert type(session_capacity(1000, initial=100)) is int


# -------------------------------------------------------------------------------------- choosing and refusing
@pytest.fixture
def free_on(monkeypatch):
    """Fakes the free-memory query per device (a query for any other device fails); returns the dict to fill."""
    sizes: dict[str, int | None] = {}
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: sizes[str(device)])
    return sizes


def test_a_batch_whose_need_is_exactly_what_is_free_fits(free_on):
    free_on["cpu"] = _need("non_shared", 40)
    args = dict(dtype="bfloat16", device="cpu")
    assert choose_batch("default", ["non_shared"], "auto", 8192, **args) == 40
    assert choose_batch("default", ["non_shared"], 40, 8192, **args) == 40


def test_refusing_a_batch_names_the_need_the_device_what_is_free_and_the_largest_that_fits(free_on):
    free_on["cpu"] = _need("non_shared", 40)
    plan = plan_memory(model_shape("default"), "non_shared", 41, 8192, element_size=2)
    with pytest.raises(ValueError) as err:
        choose_batch("default", ["non_shared"], 41, 8192, dtype="bfloat16", device="cpu")
    assert str(err.value) == (
        f"--batch 41 needs {plan.total / GIB:.2f} GiB on cpu ({plan.describe()}) but "
        f"{free_on['cpu'] / GIB:.2f} GiB is free: allowed --batch <= 40 or --batch auto"
    )


def test_an_option_that_takes_no_auto_is_offered_only_a_number(free_on):
    free_on["cpu"] = _need("non_shared", 40)
    with pytest.raises(ValueError, match=r"needs .*: allowed --rows <= 40$"):
        choose_batch(
            "default", ["non_shared"], 41, 8192, dtype="bfloat16", device="cpu", option="--rows", auto_ok=False
        )


def test_auto_refuses_when_not_even_one_episode_fits_naming_that_episodes_need(free_on):
    plan = plan_memory(model_shape("default"), "full_shared", 1, 8192, element_size=2)
    free_on["cpu"] = plan.total - 1
    with pytest.raises(ValueError) as err:
        choose_batch("default", ["full_shared"], "auto", 8192, dtype="bfloat16", device="cpu")
    assert str(err.value) == (
        f"--batch auto: even one episode needs {plan.total / GIB:.2f} GiB on cpu ({plan.describe()}) but "
        f"{(plan.total - 1) / GIB:.2f} GiB is free: allowed fewer positions per episode than 8192, a larger "
        "--memory_fraction or another device"
    )


def test_with_the_free_memory_unknown_the_batch_is_taken_as_given_and_auto_is_the_maximum(free_on):
    free_on["cpu"] = None
    args = dict(dtype="bfloat16", device="cpu")
    assert choose_batch("default", ["non_shared"], 10_000, 8192, **args) == 10_000
    assert choose_batch("default", ["non_shared"], "auto", 8192, max_batch=7, **args) == 7


def test_a_share_of_the_device_bounds_the_batch_and_the_refusal_says_so(free_on, monkeypatch):
    """80 GiB free of a 100 GiB device, a 0.1 share: the batch is sized to 10 GiB, and a refusal says the memory is
    this process's to take under that share."""
    from lragent import device_share

    free_on["cpu"] = 80 * GIB
    monkeypatch.setattr(device_share, "total_memory", lambda device: {"cpu": 100 * GIB}[str(device)])
    args = dict(dtype="bfloat16", device="cpu", memory_fraction=0.1)
    b = choose_batch("default", ["full_shared"], "auto", 8192, **args)
    assert _need("full_shared", b) <= 10 * GIB < _need("full_shared", b + 1)
    with pytest.raises(ValueError, match=r"GiB is this process's to take \(--memory_fraction 0.1\): allowed --batch"):
        choose_batch("default", ["full_shared"], b + 1, 8192, **args)


def test_with_the_model_loaded_its_bytes_are_left_out_of_the_need(free_on):
    plan = plan_memory(model_shape("default"), "full_shared", 8, 4096, element_size=2)
    args = dict(dtype="bfloat16", device="cpu", model_loaded=True)
    free_on["cpu"] = plan.total - plan.model_bytes
    assert choose_batch("default", ["full_shared"], 8, 4096, **args) == 8
    free_on["cpu"] -= 1
    with pytest.raises(ValueError, match="^--batch 8 needs"):
        choose_batch("default", ["full_shared"], 8, 4096, **args)


@pytest.mark.parametrize(
    "scheme, settings",
    [
        ("full_shared", dict(rank=32)),
        ("full_shared", dict(n_roles=5)),
        ("full_shared", dict(shared_a=False)),
        ("droidspeak", dict(droidspeak_layers=[0, 10, 20])),
    ],
)
def test_the_batch_is_sized_with_the_rank_roles_a_sharing_and_droidspeak_layers_given(free_on, scheme, settings):
    """Each setting here needs more than the default; the batch fits exactly the plan made with it, not one byte
    less."""
    plan = plan_memory(model_shape("default"), scheme, 6, 4096, element_size=2, **settings)
    args = dict(dtype="bfloat16", device="cpu", **settings)
    free_on["cpu"] = plan.total
    assert choose_batch("default", [scheme], 6, 4096, **args) == 6
    free_on["cpu"] = plan.total - 1
    with pytest.raises(ValueError, match="^--batch 6 needs"):
        choose_batch("default", [scheme], 6, 4096, **args)


def test_a_session_fits_exactly_its_grown_cache_at_batch_one(free_on):
    """A session of 3000 bytes grows to 4096 positions: it fits in exactly its one-episode plan (rank 8, shared A by
    default) and is refused one byte below, in one line naming the session."""
    plan = plan_memory(model_shape("tiny-llama"), "full_shared", 1, 4096, element_size=4)
    args = dict(dtype="float32", device="cpu")
    free_on["cpu"] = plan.total
    assert memory_plan.check_session("tiny-llama", "full_shared", 3000, **args) is None
    free_on["cpu"] = plan.total - 1
    with pytest.raises(ValueError) as err:
        memory_plan.check_session("tiny-llama", "full_shared", 3000, **args)
    assert str(err.value) == (
        f"the session (batch 1) 1 needs {plan.total / GIB:.2f} GiB on cpu ({plan.describe()}) but "
        f"{(plan.total - 1) / GIB:.2f} GiB is free: allowed fewer positions per episode than 4096"
    )


def test_a_session_is_sized_with_its_dtype_rank_a_sharing_and_droidspeak_layers(free_on):
    settings = dict(rank=16, shared_a=False, droidspeak_layers=[0, 2])
    plan = plan_memory(model_shape("tiny-llama"), "droidspeak", 1, 2048, element_size=2, **settings)
    args = dict(dtype="bfloat16", device="cpu", **settings)
    free_on["cpu"] = plan.total
    memory_plan.check_session("tiny-llama", "droidspeak", 1500, **args)
    free_on["cpu"] = plan.total - 1
    with pytest.raises(ValueError, match=r"^the session \(batch 1\) 1 needs"):
        memory_plan.check_session("tiny-llama", "droidspeak", 1500, **args)


def test_free_memory_is_the_cards_free_figure_or_memavailable_on_the_cpu(monkeypatch):
    import io

    from lragent import device_share

    free = {0: 7 * GIB, 1: 5 * GIB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], 80 * GIB))
    assert [memory_plan.free_memory(d) for d in ("cuda:0", "cuda")] == [7 * GIB, 5 * GIB]

    def meminfo(path, *args, **kwargs):
        if path != "/proc/meminfo":
            raise FileNotFoundError(path)
        return io.StringIO("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")

    monkeypatch.setattr(device_share, "open", meminfo, raising=False)
    assert memory_plan.free_memory("cpu") == 8192 * 1024
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory_plan.free_memory("cuda:0") is None


def test_the_transformers_baseline_is_its_dynamic_cache_its_logits_and_one_layers_activations():
    """Against a real prefill of tiny-llama (fp32, 2 x 16 tokens): the DynamicCache and the logits are exactly the
    tensors transformers makes; the rest is one layer's activations, 1024 elements a token (8 x hidden 64, q/k/v
    128, 3 x intermediate 128); the figure depends on batch x context only."""
    from lragent.models import load_model

    model = load_model("tiny-llama")[0]
    with torch.no_grad():
        out = model(input_ids=torch.arange(32).reshape(2, 16), use_cache=True)
    cache = sum(
        t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)
    )
    logits = out.logits.numel() * out.logits.element_size()
    shape = model_shape("tiny-llama")
    total = memory_plan.transformers_baseline_bytes(shape, 2, 16, 4)
    assert total - cache - logits == 2 * 16 * 1024 * 4
    assert memory_plan.transformers_baseline_bytes(shape, 1, 32, 4) == total
    assert memory_plan.transformers_baseline_bytes(shape, 2, 16, 2) == total // 2


def test_a_qwen2_config_carrying_attention_bias_still_has_no_o_proj_bias():
    """Qwen2's q/k/v carry biases and its o_proj none, whatever an attention_bias attribute says (a config may carry
    it from elsewhere): the count is the model's."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, attention_bias=True)  # fmt: skip
    shape = ModelShape.from_config(config)
    assert (shape.qkv_bias, shape.o_bias) == (True, False)
    assert shape.base_params() == _meta_params(config)


def test_the_shape_of_a_model_directory_is_read_from_its_config(tmp_path):
    """A name that is no known architecture is read as a directory (or hub id) holding config.json."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.save_pretrained(tmp_path)
    shape = memory_plan.model_shape(str(tmp_path))
    assert (shape.n_layers, shape.hidden, shape.n_kv_heads) == (3, 64, 2)
    assert shape.base_params() == _meta_params(config)
