"""Adapter sets that cannot be loaded, each refused with one line naming the file and what is wrong
(lragent/adapters_io.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_multi_lora
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lragent.adapters_io import (
    NATIVE_FILE,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_config_of,
    export_peft,
    load_adapter_dir,
    load_native,
    load_peft_role,
    read_peft_config,
)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    export_peft(tiny_multi_lora("tiny-llama", rank=4, b_std=0.3), out)
    return out


def _peft_only(export: Path, dst: Path) -> Path:
    shutil.copytree(export, dst)
    (dst / NATIVE_FILE).unlink()
    return dst


def test_a_peft_config_that_is_not_usable_is_named(tmp_path: Path) -> None:
    path = tmp_path / PEFT_CONFIG
    path.write_text("{r: 4")
    with pytest.raises(ValueError, match=f"^{path} is not a readable PEFT adapter config"):
        read_peft_config(path)
    for field, value, message in (
        ("lora_alpha", 0, "lora_alpha must be a positive number, got 0"),
        ("lora_alpha", True, "lora_alpha must be a positive number, got True"),
        ("target_modules", [], "target_modules must be a non-empty list of module names, got []"),
    ):
        path.write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], field: value}))
        with pytest.raises(ValueError, match=f"^{path}: " + message.replace("[", r"\[").replace("]", r"\]")):
            read_peft_config(path)


def test_a_native_checkpoint_missing_or_of_another_layout_is_refused(export: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"^adapter checkpoint {tmp_path / 'none'} does not exist$"):
        load_native(tiny_multi_lora(rank=4), tmp_path / "none")
    with pytest.raises(ValueError, match=f"^adapter checkpoint {export / NATIVE_FILE} has rank=4, the model has 8$"):
        load_native(tiny_multi_lora(rank=8), export / NATIVE_FILE)
    with pytest.raises(FileNotFoundError, match="has no adapter for roles \\['critic'\\]$"):
        adapter_config_of(export, roles=["plan", "critic"])


def test_peft_role_directories_that_do_not_fit_the_model_are_refused(export: Path, tmp_path: Path) -> None:
    model = tiny_multi_lora(rank=4)
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path} is not a PEFT adapter directory \\(no {PEFT_CONFIG}\\)$"):
        load_peft_role(model, tmp_path, "plan")
    with pytest.raises(ValueError, match=f"^{export / 'plan'}: r=4, lora_alpha=.* differ from the model's r=8"):
        load_peft_role(tiny_multi_lora(rank=8), export / "plan", "plan")
    partial = _peft_only(export, tmp_path / "partial")
    weights = load_file(str(partial / "plan" / PEFT_WEIGHTS))
    dropped = sorted(weights)[0]
    save_file({k: v for k, v in weights.items() if k != dropped}, str(partial / "plan" / PEFT_WEIGHTS))
    name = dropped.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
    with pytest.raises(ValueError, match=f"^{partial / 'plan'} has no adapter for {name}$"):
        load_peft_role(model, partial / "plan", "plan")
    other = tmp_path / "other"
    export_peft(tiny_multi_lora("tiny-llama", rank=4, b_std=0.3, seed=5), other)  # another shared A
    load_peft_role(model, export / "plan", "plan")  # the first role sets the shared A
    with pytest.raises(ValueError, match=f"^{other / 'action'}: lora_A of .* differs from the shared A"):
        load_peft_role(model, other / "action", "action")


def test_adapter_directories_without_every_piece_are_named(export: Path, tmp_path: Path) -> None:
    model = tiny_multi_lora(rank=4)
    with pytest.raises(FileNotFoundError, match=f"^adapter directory {tmp_path / 'none'} does not exist$"):
        load_adapter_dir(model, tmp_path / "none")
    no_action = _peft_only(export, tmp_path / "no_action")
    shutil.rmtree(no_action / "action")
    with pytest.raises(FileNotFoundError, match=f"no {NATIVE_FILE} and no PEFT directory for \\['action'\\]$"):
        load_adapter_dir(model, no_action)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"^adapter directory {empty} has neither {NATIVE_FILE} nor PEFT"):
        adapter_config_of(empty)
    differ = _peft_only(export, tmp_path / "differ")
    cfg = json.loads((differ / "reflect" / PEFT_CONFIG).read_text())
    (differ / "reflect" / PEFT_CONFIG).write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 2}))
    with pytest.raises(ValueError, match=f"^{differ / 'reflect' / PEFT_CONFIG}: r, lora_alpha or target_modules"):
        adapter_config_of(differ)
    no_weights = _peft_only(export, tmp_path / "no_weights")
    (no_weights / "action" / PEFT_WEIGHTS).unlink()
    with pytest.raises(
        FileNotFoundError, match=f"^PEFT adapter directory {no_weights / 'action'} has no {PEFT_WEIGHTS}"
    ):
        adapter_config_of(no_weights)


def test_adapters_of_another_architectures_shapes_are_refused_naming_the_tensor(export: Path) -> None:
    """Same roles, rank and targets, but v_proj is narrower (tiny-mistral: 1 KV head, tiny-llama's set: 2)."""
    narrow = tiny_multi_lora("tiny-mistral", rank=4)
    shapes = r"has shape \(32, 4\), the model expects \(16, 4\)$"
    path = export / NATIVE_FILE
    with pytest.raises(ValueError, match=rf"^{path}: model\.layers\.0\.self_attn\.v_proj\.lora_B\.0 {shapes}"):
        load_native(narrow, path)
    with pytest.raises(ValueError, match=rf"^{export / 'plan'}: model\.layers\.0\.self_attn\.v_proj lora_B {shapes}"):
        load_peft_role(narrow, export / "plan", "plan")


# ------------------------------------------------------------------------------------- what an export writes, read back


def _model(shared_a: bool, roles=("plan", "action", "reflect"), seed: int = 0):
    """A tiny model with random adapters, dropout 0.1 (not PEFT's default) and targets other than the default ones,
    listed unsorted."""
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model("tiny-llama", seed=seed)
    cfg = MultiLoraConfig(
        roles=roles, rank=4, alpha=8.0, dropout=0.1, shared_a=shared_a, targets=("v_proj", "o_proj", "q_proj")
    )
    model = MultiLoraModel(hf, cfg)
    model.init_adapters("random", seed=seed + 1, b_std=0.3)
    return model.eval()


def _adapters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for layer in model.lora_modules().values() for p in (*layer.lora_A, *layer.lora_B)]


@pytest.mark.parametrize("shared_a", [True, False])
def test_export_peft_writes_each_roles_own_a_and_b_in_the_requested_dtype_and_a_complete_peft_config(
    shared_a: bool, tmp_path: Path
) -> None:
    """Into a directory whose parents do not exist yet: each role's PEFT weights (its own A without shared A),
    safetensors tagged format=pt, a LoraConfig with rank, alpha, dropout, the targets (PEFT keeps them as a set, in
    no fixed order), the base model's name and the causal-LM task; the native file holds every A and B and the
    ``meta`` given, all in ``dtype``."""
    model = _model(shared_a)
    out = tmp_path / "a" / "b" / "export"
    paths = export_peft(model, out, base_model_name="tiny-llama", meta={"run": 7}, dtype=torch.bfloat16)
    assert paths == {role: out / role for role in ("plan", "action", "reflect")}
    for rid, role in enumerate(("plan", "action", "reflect")):
        with safe_open(str(out / role / PEFT_WEIGHTS), "pt") as f:
            assert f.metadata() == {"format": "pt"}
        weights = load_file(str(out / role / PEFT_WEIGHTS))
        assert len(weights) == 2 * len(model.lora_modules())
        for name, layer in model.lora_modules().items():
            a = weights[f"base_model.model.{name}.lora_A.weight"]
            b = weights[f"base_model.model.{name}.lora_B.weight"]
            assert a.dtype == b.dtype == torch.bfloat16
            assert torch.equal(a, layer.lora_A[0 if shared_a else rid].detach().bfloat16())
            assert torch.equal(b, layer.lora_B[rid].detach().bfloat16())
        peft = json.loads((out / role / PEFT_CONFIG).read_text())
        assert (peft["r"], peft["lora_alpha"], peft["lora_dropout"]) == (4, 8.0, 0.1)
        assert sorted(peft["target_modules"]) == ["o_proj", "q_proj", "v_proj"] and peft["bias"] == "none"
        assert peft["task_type"] == "CAUSAL_LM" and peft["base_model_name_or_path"] == "tiny-llama"
    with safe_open(str(out / NATIVE_FILE), "pt") as f:
        assert json.loads(f.metadata()["meta"]) == {"run": 7}
        assert json.loads(f.metadata()["lragent_config"]) == model.lora_config.to_dict()
        native = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    n_a = 1 if shared_a else 3
    assert len(native) == (n_a + 3) * len(model.lora_modules())
    for name, layer in model.lora_modules().items():
        for i in range(n_a):
            assert torch.equal(native[f"{name}.lora_A.{i}"], layer.lora_A[i].detach().bfloat16())
        for i in range(3):
            assert torch.equal(native[f"{name}.lora_B.{i}"], layer.lora_B[i].detach().bfloat16())


def test_export_peft_without_a_base_name_or_meta_records_none_and_an_empty_meta_and_can_export_again(
    tmp_path: Path,
) -> None:
    """Exporting into the same directory a second time overwrites it (the role directories already exist)."""
    model = _model(True)
    export_peft(model, tmp_path)
    export_peft(model, tmp_path)
    assert json.loads((tmp_path / "plan" / PEFT_CONFIG).read_text())["base_model_name_or_path"] is None
    with safe_open(str(tmp_path / NATIVE_FILE), "pt") as f:
        assert json.loads(f.metadata()["meta"]) == {}
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())  # noqa: SIM118


def test_a_role_name_with_a_slash_is_exported_into_a_nested_directory(tmp_path: Path) -> None:
    paths = export_peft(_model(False, roles=("plan", "team/critic")), tmp_path)
    assert paths["team/critic"] == tmp_path / "team" / "critic"
    assert (tmp_path / "team" / "critic" / PEFT_CONFIG).is_file()


@pytest.mark.parametrize("shared_a", [True, False])
def test_adapter_config_of_peft_directories_recovers_the_layout_with_the_agent_roles_first(
    shared_a: bool, tmp_path: Path
) -> None:
    """Roles: plan, action, reflect in that order, then the others (sorted); shared A exactly when every role
    directory carries the same A; targets sorted; a config without lora_dropout means 0."""
    model = _model(shared_a, roles=("reflect", "zeta", "action", "critic", "plan"))
    export_peft(model, tmp_path)
    (tmp_path / NATIVE_FILE).unlink()
    cfg = adapter_config_of(tmp_path, roles=["plan", "critic"])
    assert cfg.roles == ("plan", "action", "reflect", "critic", "zeta")
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.shared_a) == (4, 8.0, 0.1, shared_a)
    assert cfg.targets == ("o_proj", "q_proj", "v_proj")
    assert type(cfg.rank) is int and type(cfg.alpha) is float
    for role in cfg.roles:
        pc = json.loads((tmp_path / role / PEFT_CONFIG).read_text())
        (tmp_path / role / PEFT_CONFIG).write_text(json.dumps({k: v for k, v in pc.items() if k != "lora_dropout"}))
    assert adapter_config_of(tmp_path).dropout == 0.0


def test_adapter_config_of_a_single_peft_role_is_that_role_with_shared_a(tmp_path: Path) -> None:
    export_peft(_model(False, roles=("plan",)), tmp_path)
    (tmp_path / NATIVE_FILE).unlink()
    cfg = adapter_config_of(tmp_path)
    assert cfg.roles == ("plan",) and cfg.shared_a is True and cfg.rank == 4


def test_adapter_config_of_names_missing_roles_and_missing_directories_in_full(export: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        adapter_config_of(tmp_path / "none")
    assert str(err.value) == f"adapter directory {tmp_path / 'none'} does not exist"
    peft = _peft_only(export, tmp_path / "peft")
    with pytest.raises(FileNotFoundError) as err:
        adapter_config_of(peft, roles=["plan", "critic", "judge"])
    assert (
        str(err.value) == f"adapter directory {peft} has no {NATIVE_FILE} and no PEFT directory for ['critic', 'judge']"
    )
    assert adapter_config_of(peft, roles=["reflect", "plan"]).roles == ("plan", "action", "reflect")


def test_adapter_config_of_refuses_differing_role_configs_naming_the_first_role_compared_to(
    export: Path, tmp_path: Path
) -> None:
    differ = _peft_only(export, tmp_path / "differ")
    cfg = json.loads((differ / "reflect" / PEFT_CONFIG).read_text())
    (differ / "reflect" / PEFT_CONFIG).write_text(json.dumps({**cfg, "r": 8}))
    with pytest.raises(ValueError) as err:
        adapter_config_of(differ)
    assert str(err.value) == f"{differ / 'reflect' / PEFT_CONFIG}: r, lora_alpha or target_modules differ from action's"


def _rewrite(path: Path, change) -> None:
    weights = load_file(str(path))
    save_file(change(weights), str(path), metadata={"format": "pt"})


def test_adapter_config_of_refuses_peft_weights_not_of_the_configured_rank_naming_the_tensor(
    export: Path, tmp_path: Path
) -> None:
    """A B of another rank, an A with a third dimension (its first still r) and an unreadable file are refused;
    a tensor that is neither A nor B (e.g. a saved module) is not rank-checked."""
    extra = _peft_only(export, tmp_path / "extra")
    _rewrite(extra / "plan" / PEFT_WEIGHTS, lambda w: {**w, "base_model.model.lm_head.weight": torch.zeros(3, 5)})
    assert adapter_config_of(extra).rank == 4
    key_b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    key_a = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
    for key, bad in ((key_b, lambda t: t[:, :3]), (key_a, lambda t: t.unsqueeze(-1))):
        broken = _peft_only(export, tmp_path / key.split(".")[-2])
        path = broken / "action" / PEFT_WEIGHTS
        _rewrite(path, lambda w, key=key, bad=bad: {**w, key: bad(w[key]).contiguous()})
        shape = tuple(bad(load_file(str(export / "action" / PEFT_WEIGHTS))[key]).shape)
        with pytest.raises(ValueError) as err:
            adapter_config_of(broken)
        assert str(err.value) == f"{path}: {key} has shape {shape}, not rank r=4"
    damaged = _peft_only(export, tmp_path / "damaged")
    (damaged / "reflect" / PEFT_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=f"^{damaged / 'reflect' / PEFT_WEIGHTS} is not a readable adapter weights"):
        adapter_config_of(damaged)


def test_a_damaged_native_checkpoint_is_refused_naming_its_file(export: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(export, damaged)
    (damaged / NATIVE_FILE).write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=f"^{damaged / NATIVE_FILE} is not a readable adapter weights file"):
        adapter_config_of(damaged)


@pytest.mark.parametrize("native", [True, False])
def test_load_adapter_dir_gives_a_fresh_model_the_exported_adapters_from_native_or_peft_files(
    native: bool, tmp_path: Path
) -> None:
    source = _model(False, seed=0)
    export_peft(source, tmp_path)
    if not native:
        (tmp_path / NATIVE_FILE).unlink()
    fresh = _model(False, seed=4)
    assert not all(torch.equal(a, b) for a, b in zip(_adapters(fresh), _adapters(source), strict=True))
    load_adapter_dir(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_adapters(fresh), _adapters(source), strict=True))


def test_peft_configs_that_cannot_be_read_or_are_not_a_mapping_are_named_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / PEFT_CONFIG
    path.write_text("{r: 4")
    with pytest.raises(ValueError) as err:
        read_peft_config(path)
    reason = "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    assert str(err.value) == f"{path} is not a readable PEFT adapter config ({reason})"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError) as err:
        read_peft_config(path)
    assert str(err.value) == f"{path} is not a PEFT adapter config: a JSON mapping is needed, got list"

    def unreadable(self, *args, **kwargs):
        raise OSError()  # a read error without a message (e.g. from a network filesystem)

    monkeypatch.setattr(Path, "read_text", unreadable)
    with pytest.raises(ValueError) as err:
        read_peft_config(path)
    assert str(err.value) == f"{path} is not a readable PEFT adapter config (OSError)"


def test_peft_config_rank_must_be_a_positive_non_bool_integer_and_alpha_any_positive_number(tmp_path: Path) -> None:
    path = tmp_path / PEFT_CONFIG
    for r, alpha in ((1, 0.5), (4, 8)):
        path.write_text(json.dumps({"r": r, "lora_alpha": alpha, "target_modules": ["q_proj"]}))
        assert read_peft_config(path)["r"] == r
    for r in (0, -2, True, 2.0, "4"):
        path.write_text(json.dumps({"r": r, "lora_alpha": 8, "target_modules": ["q_proj"]}))
        with pytest.raises(ValueError) as err:
            read_peft_config(path)
        assert str(err.value) == f"{path}: r must be a positive integer, got {r!r}"
