"""The adapter sets shipped in ``data/adapters`` (the embedded-model recipe's stage-2 runs) load through PEFT.

For every set and role: ``peft.PeftModel.from_pretrained`` on the embedded model gives the same logits as the toolkit's
multi-LoRA model with the set as the toolkit loads it (the PEFT directories alone: a native checkpoint would only
repeat their weights); shared-A sets really share A across roles, independent-A sets do not; and B is trained
(non-zero)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lragent.adapters_io import adapter_config_of, load_adapter_dir
from lragent.lora_model import MultiLoraModel

pytestmark = pytest.mark.model

ADAPTERS = Path(__file__).resolve().parent.parent / "data" / "adapters"
SETS = ["hotpotqa_sharedA", "hotpotqa_indepA", "scienceqa_sharedA", "scienceqa_indepA"]


def _loaded(load_embedded, adapter_dir: Path) -> MultiLoraModel:
    hf, _ = load_embedded()
    model = MultiLoraModel(hf, adapter_config_of(adapter_dir)).eval()
    load_adapter_dir(model, adapter_dir)
    return model


@pytest.mark.parametrize("name", SETS)
def test_shipped_set_loads_through_peft(name, load_embedded):
    from peft import PeftModel

    d = ADAPTERS / name
    # every set ships the PEFT directories alone; the toolkit reads shared A from them (the same A in every role)
    assert not (d / "lragent_adapters.safetensors").exists(), f"{d}: not as shipped"
    assert all((d / role / "adapter_model.safetensors").is_file() for role in ("plan", "action", "reflect")), d
    model = _loaded(load_embedded, d)
    cfg = model.lora_config
    assert cfg.shared_a == name.endswith("_sharedA")
    ids = torch.tensor([[1, 504, 3158, 282, 253, 5866, 30, 199, 13149, 42]])
    with torch.no_grad():
        for role in cfg.roles:
            base, _ = load_embedded()
            peft_model = PeftModel.from_pretrained(base, str(d / role)).eval()
            ours = model(ids, [role])
            diff = (peft_model(ids).logits - ours).abs().max().item()
            assert diff <= 1e-4, f"{name}/{role}: PEFT and lragent logits differ by {diff:.2e}"
    a = model.state_dict()
    # trained B, and A shared exactly when the set says so
    lora_b = [v for k, v in a.items() if ".lora_B" in k]
    assert lora_b and all(float(v.abs().max()) > 0 for v in lora_b), f"{name}: an untrained (zero) B"
    per_module: dict[str, list[torch.Tensor]] = {}
    for k, v in a.items():
        if ".lora_A" in k:
            per_module.setdefault(k.split(".lora_A")[0], []).append(v)
    n_roles = len(cfg.roles)
    for module, tensors in per_module.items():
        if cfg.shared_a:
            assert len(tensors) == 1, f"{name}: {module} has {len(tensors)} A matrices, shared A expects 1"
        else:
            assert len(tensors) == n_roles and not torch.equal(tensors[0], tensors[1]), f"{name}: {module}"
