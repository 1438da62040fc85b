"""The cache of converted weights: a GGUF dequantised once into safetensors (and its tokenizer), shared by processes.

The embedded model (:mod:`lragent.models`) and the accuracy model (:mod:`lragent.accuracy_model`) are GGUF files;
transformers dequantises them (``gguf_file=``), which takes 20-90 s, so each is converted once into a directory under
:func:`cache_dir` and later loads read safetensors. Processes that start together convert once (a file lock) and never
remove a copy another process may be reading.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where converted weights are kept (``$LRAGENT_CACHE`` or ``~/.cache/lragent``)."""
    return Path(os.environ.get("LRAGENT_CACHE", Path.home() / ".cache" / "lragent"))


def is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def publish_converted(tmp: Path, target: Path) -> None:
    """Moves a finished conversion ``tmp`` to ``target`` unless another process got there first.

    A complete ``target`` is kept as it is (a process may be loading from it: removing it under that reader made a
    GPU test fail with "no file named model.safetensors" when 12 test workers converted at once); an incomplete one
    (a crash mid-copy) is replaced. ``tmp`` is gone afterwards either way.
    """
    try:
        if is_converted(target):
            return
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not is_converted(target):  # not a racing process's finished copy: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf_once(gguf: Path, target: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantises ``gguf`` once into ``target`` (safetensors + tokenizer) and returns ``target``.

    Processes starting together convert once (a file lock beside ``target``) and never remove a copy another one may
    be reading (:func:`publish_converted`). ``dtype`` is the dtype the weights are stored in.
    """
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_converted(target):  # converted while this process waited
            return target
        log.info("converting the GGUF %s into %s (first use only)", gguf, target)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        tokenizer = tokenizer_from(gguf.parent, gguf_file=gguf.name)
        # transformers' GGUF conversion gives the tokenizer another EOS (<|im_start|> for SmolLM2, <|endoftext|> for
        # Qwen2.5) than the models, which end a turn with <|im_end|>, the GGUF's own eos_token_id. Use the model's.
        eos_id = model.generation_config.eos_token_id
        if isinstance(eos_id, int) and tokenizer.eos_token_id != eos_id:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        # The dequantised model is an ordinary model; drop the GGUF marker so it can be saved.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        del model
        publish_converted(tmp, target)
    return target


def tokenizer_from(source: str | Path, **kwargs: Any) -> object:
    """``AutoTokenizer.from_pretrained(source)``, with the space clean-up switched off where transformers ignores it.

    transformers skips ``clean_up_tokenization_spaces`` for BPE tokenizers (it would strip spaces before
    punctuation) and warns about it at the first decode of every process. Setting it to False on a BPE tokenizer
    decodes exactly the same text without the warning; other tokenizers keep their setting.
    """
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    is_bpe = type(getattr(backend, "model", None)).__name__ == "BPE"
    if is_bpe and getattr(tokenizer, "clean_up_tokenization_spaces", False):
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer
