"""The two forms of a role example: the raw record as read, and its tokenised form (what prefix packing and the
collate functions consume). Their own module so that every datamodule can use them without importing the reader."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoleRecord:
    """One raw role example and where it came from."""

    input: str
    """Prompt text; ends with the response marker (e.g. ``"\\n### Response:\\n"``)."""
    output: str
    """Text the role must produce; the loss is on its tokens."""
    source: str
    """``file:line`` (or ``dataset:split row N``) for error messages."""


@dataclass(frozen=True)
class TokenizedExample:
    """One tokenised example: ``input_ids = context + output + [EOS]``."""

    input_ids: list[int]
    """All token ids, at most ``max_length`` of them."""
    context_len: int
    """How many leading ids are the (possibly left-truncated) input; the rest are output + EOS."""
    prefix_len: int
    """How many leading ids precede the input's last prompt piece (see
    :func:`~lragent.prompt_pieces.last_piece_start`); 0 when the whole input is one piece. Always ``< context_len``."""
    role_id: int
    """Index of the role in the role list."""
    source: str
    """``file:line`` of the record."""
    segments: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """Prefix packing (:func:`~datamodules.prefix_packing.pack_prefix_chains`): the outputs of other examples whose
    tokens are a prefix of this context, as ``(context_len, output ids + EOS)``; their labels go at unshifted
    positions ``context_len ...``. Empty for an unpacked example."""

    @property
    def n_examples(self) -> int:
        """How many role examples this sequence scores (1 + packed ones)."""
        return 1 + len(self.segments)
