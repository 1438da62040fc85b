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
