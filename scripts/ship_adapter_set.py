"""Ships a study adapter set as a bundled set: the PEFT role directories, the native checkpoint and train_config.json.

The study packs only the native checkpoint of each set (``eval_suite/study.py``); this re-creates the PEFT directories
from it on the set's base model (its ``train_config.json`` names it), so that ``data/adapters/<name>`` has the layout
``lragent export`` writes.

    python scripts/ship_adapter_set.py STUDY_ROOT/train/scienceqa_lam0.5/adapters data/adapters/scienceqa_sharedA
    python scripts/ship_adapter_set.py STUDY_ROOT/train/scienceqa_lam0/adapters data/adapters/qwen_scienceqa_sharedA
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from lragent.adapters_io import NATIVE_FILE, adapter_config_of, export_peft, load_adapter_dir
from lragent.lora_model import MultiLoraModel
from lragent.models import load_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a study set's adapters directory (lragent_adapters.safetensors, train_config.json)")
    p.add_argument("target", help="the bundled set's directory (replaced)")
    args = p.parse_args(argv)
    src, dst = Path(args.source), Path(args.target)
    if not (src / NATIVE_FILE).is_file():
        print(f"error: {src / NATIVE_FILE} not found", file=sys.stderr)
        return 2
    train_config = json.loads((src / "train_config.json").read_text())
    train_config["shipped_from"] = str(src)
    hf, _ = load_model(train_config["model"].get("model_name") or "default", dtype=torch.float32, device="cpu")
    model = MultiLoraModel(hf, adapter_config_of(src)).eval()
    load_adapter_dir(model, src)
    if dst.exists():
        shutil.rmtree(dst)
    dtype = getattr(torch, train_config.get("dtype") or "float32")
    with torch.no_grad():
        export_peft(model, dst, base_model_name=train_config["model"].get("model_name", ""), meta=train_config,
                    dtype=dtype)  # fmt: skip
    (dst / "train_config.json").write_text(json.dumps(train_config, indent=2) + "\n")
    print(f"{src} -> {dst}: {sorted(x.name for x in dst.iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
