"""The scheduler's text encoder: the ids ``tokenizer(text, add_special_tokens=False)`` gives, through the fast
backend's single-text ``encode``, which keeps the interpreter lock (the embedded model's tokenizer)."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest

from lragent.serving.text_encoder import text_encoder

pytestmark = pytest.mark.model

TEXTS = [
    "",
    "hello",
    " leading and  double  spaces ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "é中文 — tabs\tand\nnewlines\n\n",
    "Thought 1: I need to search Paris.\nAction 1: Search[Paris]\nObservation 1: Paris is the capital of France.",
    "x" * 3000,
]


@pytest.fixture()
def tokenizer():
    from lragent.models import load_tokenizer

    return load_tokenizer("default")


def _called(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def test_the_encoder_gives_the_tokenizers_ids(tokenizer):
    """Every text, special tokens and non-ASCII included, gives what the tokenizer's own call gives."""
    encode = text_encoder(tokenizer)
    for text in TEXTS:
        assert encode(text) == _called(tokenizer, text), text
    assert encode("<|im_start|>") == [1]  # a special token stays one token


def test_the_encoder_follows_what_another_caller_set_on_the_shared_backend(tokenizer):
    """A backend left truncating, or left splitting special tokens, still gives the tokenizer's own ids (its call
    switches truncation off and splits special tokens as the tokenizer's ``split_special_tokens`` says)."""
    encode = text_encoder(tokenizer)
    text = TEXTS[3]
    whole = _called(tokenizer, text)
    tokenizer.backend_tokenizer.enable_truncation(3)
    assert encode(text) == whole and len(whole) > 3
    tokenizer.backend_tokenizer.encode_special_tokens = True  # the tokenizer says False
    assert encode(text) == whole and encode("<|im_start|>") == [1]
    tokenizer.split_special_tokens = True
    assert encode(text) == _called(tokenizer, text) != whole
    assert len(encode("<|im_start|>")) > 1  # split into its pieces, as the tokenizer's call does


def test_the_encoder_adds_no_special_token_where_the_tokenizer_would(tokenizer):
    """A backend whose post-processor puts a token before each text (as a BOS-adding model's does): the encoder adds
    none, as ``add_special_tokens=False`` says."""
    from tokenizers.processors import TemplateProcessing

    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    assert tokenizer.backend_tokenizer.encode("hello").ids[0] == 1
    assert text_encoder(tokenizer)("hello") == _called(tokenizer, "hello") == [28120]


def test_the_encoder_calls_a_tokenizer_without_a_backend():
    """A tokenizer without a fast backend is called as itself."""
    calls: list[str] = []

    def slow(text: str, add_special_tokens: bool = True) -> dict:
        calls.append(text)
        assert add_special_tokens is False
        return {"input_ids": [len(text)]}

    encode = text_encoder(slow)
    assert encode("abc") == [3] and encode("") == [] and calls == ["abc"]


class _Backend:
    """A backend as the encoder reads it, in the state a tokenizer's call leaves it; ``encode`` gives byte ids."""

    truncation = padding = None
    encode_special_tokens = False

    def encode(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        return SimpleNamespace(ids=list(text.encode()))


class _Recorded:
    """A tokenizer whose own call is recorded; ``backend`` is its ``backend_tokenizer``."""

    def __init__(self, backend: object) -> None:
        self.backend_tokenizer = backend
        self.calls: list[str] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.calls.append(text)
        return {"input_ids": list(text.encode())}


def test_the_encoder_calls_the_tokenizer_where_its_backend_cannot_encode():
    """A ``backend_tokenizer`` without ``encode`` (not a tokenizers backend) leaves the tokenizer's own call."""
    tok = _Recorded(SimpleNamespace())
    assert text_encoder(tok)("ab") == [97, 98] and tok.calls == ["ab"]


def test_the_encoder_takes_a_tokenizer_without_split_special_tokens_as_not_splitting():
    """A tokenizer that has no ``split_special_tokens`` (transformers' default: False) with a backend that does not
    split goes through the backend, not its own call."""
    tok = _Recorded(_Backend())
    assert text_encoder(tok)("ab") == [97, 98] and tok.calls == []


def test_the_encoder_keeps_the_interpreter_lock_while_another_thread_runs(tokenizer):
    """A thread that counts without pause gets no count in while an encode runs: the encode never gave the interpreter
    lock up (one that did would let the counter run on the other core, and wait to get the lock back). The switch
    interval is 0.1 s and the encodes start on a fresh slice, so no forced switch falls between two reads."""
    encode = text_encoder(tokenizer)
    texts = [f"Observation {i}: " + "Paris is the capital and largest city of France. " * 120 for i in range(20)]
    expected = [_called(tokenizer, t) for t in texts]
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.1)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        while count[0] == 0:
            time.sleep(0.001)  # the spinner runs
        moved, got = [], []
        time.sleep(0)  # back with a fresh slice: the 20 encodes (about 20 ms) fit in it
        for text in texts:
            before = count[0]
            got.append(encode(text))
            moved.append(count[0] - before)
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(old)
    assert got == expected
    assert moved == [0] * len(texts), moved
