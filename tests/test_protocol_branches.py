"""Request fields the server refuses, naming the field (eval_suite/serve/protocol.py)."""

from __future__ import annotations

import json

import pytest

from eval_suite.serve.protocol import ChatMessage, CompletionRequest, ProtocolError, parse_body


@pytest.mark.parametrize(
    "field, value",
    [("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("logit_bias", {"50256": -100})],
)
def test_unsupported_sampling_fields_are_refused_naming_them(field, value):
    body = {"model": "plan", "prompt": "x", field: value}
    with pytest.raises(ProtocolError, match="not supported") as exc:
        parse_body(CompletionRequest, json.dumps(body).encode())
    assert exc.value.param == field and exc.value.status == 400
    neutral = {"model": "plan", "prompt": "x", field: {} if field == "logit_bias" else 0}
    assert parse_body(CompletionRequest, json.dumps(neutral).encode()).prompt_text == "x"


def test_a_chat_content_part_that_is_not_text_is_refused():
    assert ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).text
    with pytest.raises(ValueError, match="a content part that is not text"):
        _ = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]).text


@pytest.mark.parametrize(
    "field, value, ok",
    [("temperature", 0, True), ("temperature", 2, True), ("temperature", -0.01, False), ("temperature", 2.01, False),
     ("top_p", 1, True), ("top_p", 0.01, True), ("top_p", 0, False), ("top_p", 1.01, False)],
)  # fmt: skip
def test_sampling_ranges_take_their_ends_as_openai_defines_them(field, value, ok):
    """temperature in [0, 2] (0: greedy), top_p in (0, 1]: each end taken or refused naming the field."""
    body = json.dumps({"model": "plan", "prompt": "x", field: value}).encode()
    if ok:
        assert getattr(parse_body(CompletionRequest, body), field) == value
    else:
        with pytest.raises(ProtocolError) as exc:
            parse_body(CompletionRequest, body)
        assert exc.value.param == field and exc.value.status == 400
