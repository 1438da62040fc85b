"""Two small shared pieces, exactly: where the last appended prompt piece of a trajectory starts
(lragent/prompt_pieces.py), and the offline byte tokenizer whose token ids are the UTF-8 bytes
(datamodules/tiny_tokenizer.py)."""

from __future__ import annotations

import pytest

from datamodules.tiny_tokenizer import BYTE_VOCAB_SIZE, _bytes_to_unicode, byte_tokenizer
from lragent.prompt_pieces import RESPONSE_MARKER, last_piece_start

M = "### Response:\n"


@pytest.mark.parametrize(
    "text, start",
    [
        ("", 0),
        ("no marker at all", 0),
        (M, 0),  # the only marker is the one the text ends with: nothing before it
        ("Q" + M, 0),
        (f"Q{M}out\nAction: \n{M}", len(f"Q{M}out")),  # the docstring's example: the piece is "\nAction: \n" + M
        (f"Q{M}out\nobs", len(f"Q{M}out")),  # no closing marker: the piece still starts at the output's newline
        (f"Q{M}out", len(f"Q{M}out")),  # an output without its newline yet: the piece is empty
        (f"{M}a\n{M}b\nc{M}", len(f"{M}a\n{M}b")),  # the last output before the closing marker counts
        (f"{M}\nx{M}", len(M)),  # an empty output: the piece starts right after the marker
    ],
)
def test_the_last_piece_starts_at_the_newline_ending_the_previous_output(text, start):
    assert RESPONSE_MARKER == M
    assert last_piece_start(text) == start


def test_another_marker_cuts_the_same_way():
    text = "sys>>>first\nnext>>>"
    assert last_piece_start(text, ">>>") == len("sys>>>first")
    assert last_piece_start(text) == 0  # the default marker is not in it
    assert last_piece_start("x>>>\n>>>", ">>>") == len("x>>>")


def test_the_byte_map_is_gpt2s_printable_bijection():
    table = _bytes_to_unicode()
    assert len(table) == 256 and sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert table[ord("!")] == "!" and table[ord("~")] == "~" and table[0xA1] == "¡" and table[0xAC] == "¬"
    assert table[0xAE] == "®" and table[0xFF] == "ÿ"
    # the bytes outside the printable ranges take 256, 257, ... in byte order
    assert table[0] == chr(256) and table[ord(" ")] == chr(256 + 32) and table[0x7F] == chr(256 + 33)
    assert table[0x80] == chr(256 + 34) and table[0xA0] == chr(256 + 66) and table[0xAD] == chr(256 + 67)
    assert all(table[b] == chr(b) for b in range(0x21, 0x7F))


def test_the_byte_tokenizer_ids_are_the_utf8_bytes():
    tok = byte_tokenizer()
    text = "Hé llo\n\t~!\x00ÿ日"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<eos>", 256, "<pad>", 257)
    assert len(tok) == BYTE_VOCAB_SIZE == 258
    assert tok("  a  b")["input_ids"] == [32, 32, 97, 32, 32, 98]  # no prefix space added, no merges
    assert tok("ab cd\nef").word_ids() == [0] * 8  # no pre-split into words: the text is one piece
    assert tok.decode([104, 105, 256], skip_special_tokens=True) == "hi"
    assert tok.convert_ids_to_tokens([0, 32, 65]) == [chr(256), chr(256 + 32), "A"]
