"""Model loading: named architectures, supported families, the embedded model's location."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from lragent.models import NAMED_ARCHITECTURES, check_supported, embedded_gguf_path, load_model, parse_dtype


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_tiny_architectures_load(arch):
    model, tok = load_model(arch, dtype="bf16")
    assert tok is None
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config.model_type == NAMED_ARCHITECTURES[arch]["model_type"]


def test_qwen2_has_qkv_bias():
    model, _ = load_model("tiny-qwen2")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.v_proj.bias is not None and attn.o_proj.bias is None


@pytest.mark.parametrize("arch", ["llama-3.1-8b", "mistral-7b", "ministral-8b", "qwen2.5-7b", "smollm2-135m"])
def test_named_configs_are_the_published_shapes(arch):
    fields = dict(NAMED_ARCHITECTURES[arch])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    check_supported(cfg)
    if arch == "llama-3.1-8b":
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers) == (
            32,
            8,
            128,
            32,
        )


def test_overrides_shrink_a_named_architecture():
    model, _ = load_model("smollm2-135m", overrides={"num_hidden_layers": 2})
    assert len(model.model.layers) == 2 and model.config.num_key_value_heads == 3


def test_unsupported_family_is_refused():
    cfg = AutoConfig.for_model("gpt2")
    with pytest.raises(ValueError, match="'gpt2' is not supported: supported families are llama, mistral, qwen2"):
        check_supported(cfg)


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype 'int8' not supported"):
        parse_dtype("int8")


def test_embedded_gguf_is_installed():
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 90_000_000


@pytest.mark.model
def test_embedded_tokenizer_turns_off_the_bpe_space_clean_up():
    """transformers ignores ``clean_up_tokenization_spaces=True`` on a BPE tokenizer and warns at the first decode of
    every process; the loaded tokenizer carries False (same text, no warning), both through ``load_tokenizer`` and
    ``load_model``."""
    from lragent.models import embedded_model_missing, load_tokenizer

    missing = embedded_model_missing()
    if missing is not None:
        pytest.skip(f"needs the embedded model: {missing}")
    text = "Hello , world . It 's a test ?"
    for tokenizer in (load_tokenizer("default"), load_model("default")[1]):
        assert tokenizer.clean_up_tokenization_spaces is False
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text  # spaces before punctuation kept: the BPE decode is unchanged
