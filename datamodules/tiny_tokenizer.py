"""A byte-level tokenizer built offline: 256 byte tokens plus ``<eos>`` and ``<pad>``; for tests and tiny runs."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BYTE_VOCAB_SIZE = 258
"""Vocabulary size of :func:`byte_tokenizer` (256 bytes, ``<eos>`` = 256, ``<pad>`` = 257)."""


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character map that the ``ByteLevel`` pre-tokenizer uses."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Returns a tokenizer whose token id is the UTF-8 byte value (no merges), EOS id 256 and pad id 257.

    Deterministic and needs no files or hub: token count = byte count, which makes lengths easy to reason about.
    """
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab["<eos>"] = 256
    vocab["<pad>"] = 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
