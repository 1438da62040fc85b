"""The served model (lragent/serving/model.py): the adapter set's roles plus the base model as one more role, loaded
from a native checkpoint or from PEFT role directories alike; a role named like the base model, a model without a
tokenizer and adapters of other shapes are refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_multi_lora

from lragent.adapters_io import NATIVE_FILE, export_peft
from lragent.serving import model as served

TOKENIZER = object()  # stands in for a tokenizer: the tiny architectures have none


@pytest.fixture(scope="module")
def source():
    return tiny_multi_lora("tiny-llama", rank=4, b_std=0.3)


@pytest.fixture(scope="module")
def export(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    export_peft(source, out)
    return out


@pytest.fixture
def with_tokenizer(monkeypatch):
    """The real model loader, with a tokenizer given to the tiny architectures."""
    load = served.load_model
    monkeypatch.setattr(served, "load_model", lambda name, **kw: (load(name, **kw)[0], TOKENIZER))


def test_a_role_named_like_the_base_model_is_refused(export: Path) -> None:
    """A stored role with the base model's role name is refused (two roles would share one name)."""
    with pytest.raises(ValueError) as info:
        served.load_served_model(model="tiny-llama", adapters=str(export), base_name="action", device="cpu")
    assert str(info.value) == f"--adapters {export}: a role is named 'action', the base model's name; rename it"


def test_a_model_without_a_tokenizer_cannot_be_served(export: Path) -> None:
    """A random-weights architecture (no tokenizer) is refused: a server turns text into tokens."""
    with pytest.raises(ValueError, match="^--model 'tiny-llama' has random weights and no tokenizer: a server needs"):
        served.load_served_model(model="tiny-llama", adapters=str(export), device="cpu")


def test_adapters_of_other_shapes_are_refused_naming_the_tensor(export: Path, with_tokenizer) -> None:
    """tiny-mistral's v_proj is 16 wide (1 KV head), the tiny-llama set's B is 32."""
    path = export / NATIVE_FILE
    with pytest.raises(ValueError) as info:
        served.load_served_model(model="tiny-mistral", adapters=str(export), device="cpu")
    assert str(info.value) == (
        f"{path}: model.layers.0.self_attn.v_proj.lora_B.0 has shape (32, 4), the model expects (16, 4)"
    )


@pytest.mark.parametrize("layout", ["native", "peft"])
def test_every_stored_role_is_loaded_and_the_base_role_is_the_base_model(
    source, export: Path, tmp_path: Path, with_tokenizer, layout: str
) -> None:
    """From the native checkpoint or (without it) the PEFT role directories: each stored role's A and B as saved, the
    base-model role last with B = 0."""
    adapters = export
    if layout == "peft":
        adapters = Path(shutil.copytree(export, tmp_path / "peft"))
        (adapters / NATIVE_FILE).unlink()
    lm, tok = served.load_served_model(model="tiny-llama", adapters=str(adapters), device="cpu")
    assert tok is TOKENIZER and lm.lora_config.roles == ("plan", "action", "reflect", "tiny-llama")
    mods, want = lm.lora_modules(), source.lora_modules()
    assert mods.keys() == want.keys()
    for name, module in mods.items():
        assert torch.equal(module.lora_A[0], want[name].lora_A[0]), name
        for i in range(3):
            assert torch.equal(module.lora_B[i], want[name].lora_B[i]), (name, i)
        assert not module.lora_B[3].any(), name


@pytest.mark.parametrize(
    "model, name",
    [
        ("default", "SmolLM2-135M-Instruct"),
        ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
        ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"),
        ("/models/my-llamaX/", "my-llamaX"),  # a directory: its last part, the trailing slash dropped
        ("org/model ", "model "),  # only slashes are stripped, not spaces
        ("tiny-llama", "tiny-llama"),
        ("/", "/"),  # no last part: the name as given
    ],
)
def test_the_base_model_is_served_under_its_last_name_part(model: str, name: str) -> None:
    assert served.base_model_name(model) == name


def test_the_default_adapters_are_the_models_shipped_hotpotqa_shared_a_set() -> None:
    from lragent.paths import DATA_DIR

    for model in ("default", "tiny-llama", "Qwen/Qwen2.5-Coder-1.5B"):
        assert served.default_serve_adapters(model) == str(DATA_DIR / "adapters" / "hotpotqa_sharedA")
    for model in ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct"):
        assert served.default_serve_adapters(model) == str(DATA_DIR / "adapters" / "qwen_hotpotqa_sharedA")
    assert Path(served.default_serve_adapters("default")).is_dir()
    assert Path(served.default_serve_adapters("qwen2.5-coder-1.5b")).is_dir()


def test_a_set_with_one_a_per_role_is_served_with_every_roles_own_a(tmp_path: Path, with_tokenizer) -> None:
    """A native set without shared A: each stored role gets its own A back, the base role keeps B = 0."""
    source = tiny_multi_lora("tiny-llama", rank=2, shared_a=False, roles=("plan", "action"))
    export_peft(source, tmp_path)
    lm, _ = served.load_served_model(model="tiny-llama", adapters=str(tmp_path), device="cpu", dtype="bf16")
    assert lm.lora_config.roles == ("plan", "action", "tiny-llama") and lm.lora_config.shared_a is False
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16} and not lm.training
    mods, want = lm.lora_modules(), source.lora_modules()
    for name, module in mods.items():
        assert len(module.lora_A) == 3, name
        for i in range(2):
            assert torch.equal(module.lora_A[i], want[name].lora_A[i].to(torch.bfloat16)), (name, i)
            assert torch.equal(module.lora_B[i], want[name].lora_B[i].to(torch.bfloat16)), (name, i)
        assert not module.lora_B[2].any(), name
    assert not torch.equal(mods[name].lora_A[0], mods[name].lora_A[1])


def test_a_stored_a_of_another_shape_is_refused_naming_it(export: Path, tmp_path: Path, with_tokenizer) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(export / NATIVE_FILE), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 (not a dict)
    bad = "model.layers.1.self_attn.q_proj.lora_A.0"
    tensors[bad] = tensors[bad][:, :32].contiguous()
    save_file(tensors, str(tmp_path / NATIVE_FILE), metadata=metadata)
    with pytest.raises(ValueError) as info:
        served.load_served_model(model="tiny-llama", adapters=str(tmp_path), device="cpu")
    assert str(info.value) == f"{tmp_path / NATIVE_FILE}: {bad} has shape (4, 32), the model expects (4, 64)"


def test_a_gpu_index_picks_that_gpu_before_loading(export: Path, monkeypatch) -> None:
    """CUDA cannot be real here: the machine says it has GPUs, set_device records its argument, and the model is
    built on the CPU while load_model is told the device it was asked for."""
    picked, asked = [], []
    load = served.load_model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)

    def load_on_cpu(name, dtype, device):
        asked.append((name, dtype, device))
        return load(name, dtype=dtype, device="cpu")[0], TOKENIZER

    monkeypatch.setattr(served, "load_model", load_on_cpu)
    served.load_served_model(model="tiny-llama", adapters=str(export), device="cuda:1")
    assert picked == [torch.device("cuda:1")] and asked == [("tiny-llama", torch.float32, "cuda:1")]
    served.load_served_model(model="tiny-llama", adapters=str(export))  # None: CUDA, as there is one
    assert picked == [torch.device("cuda:1")] and asked[-1] == ("tiny-llama", torch.float32, "cuda")
