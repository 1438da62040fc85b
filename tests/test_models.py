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


def test_a_torch_dtype_outside_the_three_is_refused():
    from lragent.models import parse_dtype

    with pytest.raises(ValueError, match="dtype torch.int8 not supported: allowed float32, bfloat16, float16"):
        parse_dtype(torch.int8)
    assert parse_dtype(torch.float16) is torch.float16


def test_the_embedded_gguf_override_and_a_missing_package_or_file_are_named(tmp_path, monkeypatch):
    import lragent.models as models

    missing = tmp_path / "nothing.gguf"
    monkeypatch.setenv("LRAGENT_EMBEDDED_GGUF", str(missing))
    with pytest.raises(FileNotFoundError, match=f"LRAGENT_EMBEDDED_GGUF={missing} is not a file"):
        models.embedded_gguf_path()
    there = tmp_path / "model.gguf"
    there.write_bytes(b"GGUF")
    monkeypatch.setenv("LRAGENT_EMBEDDED_GGUF", str(there))
    assert models.embedded_gguf_path() == there
    monkeypatch.delenv("LRAGENT_EMBEDDED_GGUF")
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "lragent_no_such_package")
    with pytest.raises(FileNotFoundError, match="the embedded model is missing: install it with `pip install"):
        models.embedded_gguf_path()
    monkeypatch.setattr(models, "EMBEDDED_PACKAGE", "lragent")  # a package without the GGUF file in it
    monkeypatch.setattr(models, "EMBEDDED_GGUF", "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"lragent/absent.gguf is missing: reinstall with `pip install"):
        models.embedded_gguf_path()


def test_model_options_that_cannot_apply_are_named(tmp_path):
    from lragent.models import check_device, load_model, load_tokenizer

    with pytest.raises(ValueError, match="'tiny-llama' is a random-weight architecture without a tokenizer"):
        load_tokenizer("tiny-llama")
    with pytest.raises(ValueError, match="device 'meta' is not supported: allowed cpu, cuda, cuda:N, mps"):
        check_device("meta")
    with pytest.raises(ValueError, match=r"overrides are only for named architectures \(.*\), not 'default'"):
        load_model("default", overrides={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match=f"could not load model '{tmp_path}' .*: allowed default"):
        load_model(str(tmp_path))  # a directory without a config.json


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_on_a_machine_without_it_is_refused():
    from lragent.models import check_device

    with pytest.raises(ValueError, match="device 'cuda:1' asked for, but this machine has no CUDA GPU: use cpu"):
        check_device("cuda:1")
