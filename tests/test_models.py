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


@pytest.mark.parametrize(
    "name, path",
    [
        ("/abs/model", True), ("/model", True), ("./local", True), ("../up", True), ("~/home/model", True),
        (".\\win", True), ("dir\\model", True), ("a/b/c", True), ("org/model", False), ("default", False),
        ("Qwen/Qwen2.5-1.5B", False), (".hidden", False), ("~", True), ("a/b/", True),
    ],
)  # fmt: skip
def test_a_local_path_is_told_from_a_hub_id(name, path):
    from lragent.models import _looks_like_path

    assert _looks_like_path(name) is path


@pytest.mark.parametrize(
    "device, message",
    [
        ("gpu", "device 'gpu' is not a device: allowed cpu, cuda, cuda:N, mps"),
        (3.5, "device 3.5 is not a device: allowed cpu, cuda, cuda:N, mps"),
        ("meta", "device 'meta' is not supported: allowed cpu, cuda, cuda:N, mps"),
        (torch.device("meta"), "device device(type='meta') is not supported: allowed cpu, cuda, cuda:N, mps"),
    ],
)
def test_a_bad_device_is_one_line_naming_it(device, message):
    from lragent.models import check_device

    with pytest.raises(ValueError) as info:
        check_device(device)
    assert str(info.value) == message


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="for a CPU-only machine")
def test_devices_this_machine_lacks_are_refused_and_cpu_is_taken():
    from lragent.models import check_device

    assert check_device("cpu") == torch.device("cpu") and check_device(torch.device("cpu")) == torch.device("cpu")
    for device, what in (("cuda", "no CUDA GPU"), ("cuda:0", "no CUDA GPU"), ("mps", "no MPS (Apple GPU) device")):
        with pytest.raises(ValueError) as info:
            check_device(device)
        assert str(info.value) == f"device {device!r} asked for, but this machine has {what}: use cpu"


def test_embedded_model_missing_says_why_or_nothing(monkeypatch, tmp_path):
    from lragent import models

    def absent():
        raise FileNotFoundError("the GGUF is missing: reinstall")

    monkeypatch.setattr(models, "embedded_gguf_path", absent)
    assert models.embedded_model_missing() == "the GGUF is missing: reinstall"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(models, "embedded_gguf_path", lambda: gguf)
    monkeypatch.setattr(models, "_converted_target", lambda g: tmp_path / f"conv-{g.name}")
    converted = {"now": False}
    monkeypatch.setattr(models, "is_converted", lambda t: converted["now"] and t == tmp_path / "conv-model.gguf")
    spec = {"gguf": None}
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec.get(name, object()))
    expected = f"{gguf} is not converted yet and the gguf package that converts it is not installed"
    assert models.embedded_model_missing() == expected
    spec["gguf"] = object()  # the converter is there: it can be converted on first use
    assert models.embedded_model_missing() is None
    spec["gguf"], converted["now"] = None, True  # converted already: no converter needed
    assert models.embedded_model_missing() is None


def test_an_unloadable_model_is_one_line_naming_it_and_what_is_allowed(tmp_path, monkeypatch):
    from lragent import models

    named = ", ".join(models.NAMED_ARCHITECTURES)
    allowed = f"default, {models.ACCURACY_MODEL}, a named architecture ({named}), a hub name or a local directory"
    with pytest.raises(ValueError) as info:
        models.load_model(str(tmp_path / "absent"))
    assert str(info.value) == f"model directory {str(tmp_path / 'absent')!r} does not exist: allowed {allowed}"
    with pytest.raises(ValueError) as info:
        models.load_model("default", overrides={"num_hidden_layers": 2})
    assert str(info.value) == f"overrides are only for named architectures ({named}), not 'default'"

    def refuse(message):
        def from_pretrained(path):
            assert path == str(tmp_path)  # the source itself is read
            raise OSError(message)

        monkeypatch.setattr(models.AutoConfig, "from_pretrained", from_pretrained)
        with pytest.raises(ValueError) as info:
            models.load_model(str(tmp_path))
        return str(info.value)

    # the first line of the loader's own message, or its type where it says nothing
    assert refuse("  no config.json here\nsecond line") == (
        f"could not load model {str(tmp_path)!r} (no config.json here): allowed {allowed}"
    )
    assert refuse("   ") == f"could not load model {str(tmp_path)!r} (OSError): allowed {allowed}"


def test_a_named_architecture_is_seeded_and_leaves_the_callers_random_state(monkeypatch):
    from lragent.models import load_model

    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, tok = load_model("tiny-llama")
    assert tok is None and torch.equal(torch.random.get_rng_state(), before)
    b, _ = load_model("tiny-llama", seed=0)
    c, _ = load_model("tiny-llama", seed=1)
    wa, wb, wc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)  # seed 0 by default; another seed, other weights


def test_a_saved_model_directory_loads_in_the_dtype_asked_with_its_weights(tmp_path, monkeypatch):
    from lragent import models
    from lragent.models import load_model, parse_dtype

    tiny, _ = load_model("tiny-llama")
    tiny.save_pretrained(tmp_path)
    monkeypatch.setattr(models, "tokenizer_from", lambda source: ("tokenizer of", source))  # none was saved
    back, tok = load_model(str(tmp_path), dtype="bfloat16")
    assert tok == ("tokenizer of", str(tmp_path))
    assert next(back.parameters()).dtype == torch.bfloat16 and not back.training
    for (name, p), (_, q) in zip(tiny.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(p.to(torch.bfloat16), q), name
    with pytest.raises(ValueError) as info:
        parse_dtype("float8")
    assert str(info.value) == "dtype 'float8' not supported: allowed float32, fp32, bfloat16, bf16, float16, fp16"


def test_a_model_directory_without_its_tokenizer_is_one_line_naming_it(tmp_path):
    from lragent.models import load_model

    tiny, _ = load_model("tiny-llama")
    tiny.save_pretrained(tmp_path)  # weights and config, no tokenizer files
    with pytest.raises(ValueError) as info:
        load_model(str(tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"could not load the tokenizer of model {str(tmp_path)!r} (")
    assert message.endswith("): a model directory needs its tokenizer files (tokenizer.json or tokenizer_config.json "
                            "beside config.json)")  # fmt: skip


def test_the_tokenizer_refusal_names_the_loaders_first_line_or_its_type(tmp_path, monkeypatch):
    from lragent import models

    tiny, _ = models.load_model("tiny-llama")
    tiny.save_pretrained(tmp_path)
    tail = ": a model directory needs its tokenizer files (tokenizer.json or tokenizer_config.json beside config.json)"
    cases = ((ValueError("  no tokenizer here\nsecond line"), "no tokenizer here"), (OSError("  "), "OSError"))
    for raised, said in cases:

        def refuse(source, raised=raised):
            raise raised

        monkeypatch.setattr(models, "tokenizer_from", refuse)
        with pytest.raises(ValueError) as info:
            models.load_model(str(tmp_path))
        assert str(info.value) == f"could not load the tokenizer of model {str(tmp_path)!r} ({said}){tail}"
