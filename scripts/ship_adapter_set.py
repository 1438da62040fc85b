"""Ships a study adapter set as a bundled set: the PEFT role directories, the native checkpoint and train_config.json.

The study packs only the native checkpoint of each set (``eval_suite/study/driver.py``); this re-creates the PEFT
directories from it on the set's base model (its ``train_config.json`` names it), so that ``data/adapters/<name>``
has the layout ``lragent export`` writes.

    python scripts/ship_adapter_set.py STUDY_ROOT/train/scienceqa_lam0.5/adapters data/adapters/scienceqa_sharedA
    python scripts/ship_adapter_set.py STUDY_ROOT/train/scienceqa_lam0/adapters data/adapters/qwen_scienceqa_sharedA
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lragent, whatever is installed


def ship(source: str, target: str) -> int:
    """Ships a study adapter set as a bundled set.

    Args:
        source: a study set's adapters directory (lragent_adapters.safetensors, train_config.json).
        target: the bundled set's directory (replaced).

    Returns:
        the exit status.
    """
    import torch

    from lragent.adapters_io import NATIVE_FILE, adapter_config_of, export_peft, load_adapter_dir
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model

    src, dst = Path(source), Path(target)
    if not (src / NATIVE_FILE).is_file():
        raise FileNotFoundError(f"{src / NATIVE_FILE} not found")
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


def main(argv: list[str] | None = None) -> int:
    """``python scripts/ship_adapter_set.py SOURCE TARGET`` (:func:`ship`)."""
    from lragent.command import run_command

    return run_command(ship, argv, "scripts/ship_adapter_set.py", positional=["source", "target"])


if __name__ == "__main__":
    sys.exit(main())
