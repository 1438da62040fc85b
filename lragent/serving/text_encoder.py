"""Text to token ids for the server's scheduler thread, without giving up the interpreter lock.

The scheduler tokenises each request's new text while the HTTP event loop runs in another thread of the same
process. ``tokenizer(text)`` on a fast (Rust) tokenizer goes through ``encode_batch``, which releases the
interpreter lock while it works; getting the lock back waits for the event loop's thread to give it up, up to
``sys.getswitchinterval()`` (5 ms by default), several times a request's own tokenisation. ``Tokenizer.encode``
keeps the lock for its own short work, so the scheduler never waits for it.
"""

from __future__ import annotations

from collections.abc import Callable

Encode = Callable[[str], list[int]]


def text_encoder(tokenizer: object) -> Encode:
    """``text -> ids`` equal to ``list(tokenizer(text, add_special_tokens=False)["input_ids"])``.

    A fast tokenizer is called through its backend's single-text ``encode`` while the backend is as
    ``tokenizer(...)`` would set it (no truncation, no padding, special tokens split as the tokenizer's
    ``split_special_tokens`` says); otherwise, and for tokenizers without a backend, through ``tokenizer(...)``.

    Args:
        tokenizer: a transformers tokenizer (or anything callable as one).

    Returns:
        the encoding function; ``""`` gives ``[]``.
    """

    def through_call(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []  # type: ignore[operator]

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "encode", None)):
        return through_call

    def encode(text: str) -> list[int]:
        if not text:
            return []
        # what tokenizer(...) would set first; another caller may have changed the shared backend
        split = bool(getattr(tokenizer, "split_special_tokens", False))
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens != split:
            return through_call(text)
        return backend.encode(text, add_special_tokens=False).ids

    return encode
