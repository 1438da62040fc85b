"""Request fields the server refuses, naming the field (eval_suite/serve/protocol.py)."""

from __future__ import annotations

import json
import re
import time

import pytest

from eval_suite.serve.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    CompletionRequest,
    ProtocolError,
    error_body,
    invalid,
    new_id,
    now,
    parse_body,
    sse,
)


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


def _refusal(kind, body: dict | bytes) -> ProtocolError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ProtocolError) as exc:
        parse_body(kind, raw)
    assert exc.value.status == 400
    return exc.value


def test_error_body_is_openai_error_object_with_invalid_request_error_as_default_type():
    assert error_body("bad") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert error_body("m", "server_error", param="seed", code="c1") == {
        "error": {"message": "m", "type": "server_error", "param": "seed", "code": "c1"}
    }


def test_invalid_message_names_field_the_json_value_given_the_reason_and_what_is_allowed():
    err = invalid("seed", "7", "Input should be a valid integer")
    assert str(err) == "Invalid value for 'seed': got \"7\" (Input should be a valid integer). Allowed: an integer."
    assert err.param == "seed" and err.code is None and err.status == 400
    assert str(invalid("n", 2)) == "Invalid value for 'n': got 2. Allowed: 1."  # no reason: no parentheses
    assert str(invalid("n", 2, "")) == "Invalid value for 'n': got 2. Allowed: 1."
    assert str(invalid("user", None)) == "Invalid value for 'user': got null. Allowed: a string."


def test_invalid_shows_at_most_80_characters_of_the_value_given():
    value = "a" * 200
    expected = json.dumps(value)[:80]
    assert len(expected) == 80
    assert str(invalid("suffix", value)) == f"Invalid value for 'suffix': got {expected}. Allowed: null."


def test_a_missing_required_field_is_reported_as_required_without_pydantic_wording():
    err = _refusal(CompletionRequest, {"model": "plan"})
    assert str(err) == (
        "Invalid value for 'prompt': is required. Allowed: a non-empty string, or a list holding one non-empty string."
    )
    assert err.param == "prompt" and err.code is None
    err = _refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert str(err) == "Invalid value for 'model': is required. Allowed: one of the served models (GET /v1/models)."


def test_a_field_refused_by_its_validator_shows_its_value_and_reason_without_value_error_prefix():
    err = _refusal(CompletionRequest, {"model": "plan", "prompt": "x", "temperature": 3})
    assert str(err) == (
        "Invalid value for 'temperature': got 3 (out of range). Allowed: a number in [0, 2] (0: greedy)."
    )
    err = _refusal(CompletionRequest, {"model": "plan", "prompt": "x", "seed": "7"})
    assert str(err) == "Invalid value for 'seed': got \"7\" (Input should be a valid integer). Allowed: an integer."
    assert err.param == "seed"


def test_a_stop_list_over_the_limit_is_refused_with_the_shown_value_cut_at_80_characters():
    stops = ["a" * 30] * 5
    err = _refusal(CompletionRequest, {"model": "plan", "prompt": "x", "stop": stops})
    shown = json.dumps(stops)[:80]
    assert str(err) == (
        f"Invalid value for 'stop': got {shown} (5 strings). Allowed: a non-empty string, or a list of at most 4 "
        "non-empty strings."
    )


def test_a_body_that_is_not_json_is_invalid_json_with_the_decoder_error_on_one_line():
    err = _refusal(CompletionRequest, b"{")
    assert str(err) == (
        "We could not parse the JSON body of your request (JSONDecodeError: Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)). Allowed: a JSON object."
    )
    assert err.param is None and err.code == "invalid_json"
    err = _refusal(ChatCompletionRequest, b"\xff")
    assert str(err) == (
        "We could not parse the JSON body of your request (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff "
        "in position 0: invalid start byte). Allowed: a JSON object."
    )
    assert err.param is None and err.code == "invalid_json"


@pytest.mark.parametrize("raw, name", [(b"[1]", "list"), (b'"x"', "str"), (b"3", "int"), (b"null", "NoneType")])
def test_a_json_body_that_is_not_an_object_is_invalid_json_naming_its_type(raw, name):
    err = _refusal(CompletionRequest, raw)
    assert str(err) == f"The request body must be a JSON object, got {name}."
    assert err.param is None and err.code == "invalid_json"


@pytest.mark.parametrize(
    "kind, field, value, allowed",
    [
        (CompletionRequest, "echo", True, "false"),
        (CompletionRequest, "best_of", 2, "null or 1"),
        (CompletionRequest, "suffix", "s", "null"),
        (CompletionRequest, "logprobs", 0, "null or false (log probabilities are not returned)"),
        (ChatCompletionRequest, "logprobs", True, "null or false (log probabilities are not returned)"),
        (ChatCompletionRequest, "logprobs", 0, "null or false (log probabilities are not returned)"),
        (ChatCompletionRequest, "top_logprobs", 0, "null"),
        (ChatCompletionRequest, "tool_choice", "auto", "null or none"),
        (ChatCompletionRequest, "tools", [{"type": "function"}], "null (tools are not supported)"),
        (ChatCompletionRequest, "response_format", {"type": "json_object"}, "null or {type: text}"),
    ],
)
def test_unimplemented_openai_options_away_from_their_neutral_value_are_refused_naming_the_field(
    kind, field, value, allowed
):
    """A neutral value counts only with the neutral's own type: logprobs 0 is not false, best_of 2 is not 1."""
    body = {"model": "plan", field: value}
    body.update({"prompt": "x"} if kind is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]})
    err = _refusal(kind, body)
    assert str(err) == f"Invalid value for '{field}': got {json.dumps(value)} (not supported). Allowed: {allowed}."
    assert err.param == field and err.code is None


@pytest.mark.parametrize(
    "kind, field, value",
    [
        (CompletionRequest, "echo", False),
        (CompletionRequest, "best_of", 1),
        (CompletionRequest, "logprobs", None),
        (ChatCompletionRequest, "logprobs", False),
        (ChatCompletionRequest, "tool_choice", "none"),
        (ChatCompletionRequest, "tools", []),
        (ChatCompletionRequest, "response_format", {"type": "text"}),
    ],
)
def test_unimplemented_openai_options_at_their_neutral_value_are_accepted(kind, field, value):
    body = {"model": "plan", field: value}
    body.update({"prompt": "x"} if kind is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]})
    assert getattr(parse_body(kind, json.dumps(body).encode()), field) == value


def test_stream_options_without_stream_is_refused_naming_stream_options():
    err = _refusal(CompletionRequest, {"model": "plan", "prompt": "x", "stream_options": {"include_usage": True}})
    assert err.param == "stream_options"
    assert str(err) == (
        "Invalid value for 'stream_options': got {\"include_usage\": true}. Allowed: an object {include_usage: true "
        "or false}, with stream true."
    )


def test_chat_limit_field_names_max_completion_tokens_when_given_else_max_tokens():
    def chat(**fields):
        body = {"model": "plan", "messages": [{"role": "user", "content": "hi"}], **fields}
        return parse_body(ChatCompletionRequest, json.dumps(body).encode())

    assert chat().limit_field() == "max_tokens" and chat().limit is None
    assert chat(max_tokens=5).limit_field() == "max_tokens" and chat(max_tokens=5).limit == 5
    both = chat(max_tokens=5, max_completion_tokens=7)
    assert both.limit_field() == "max_completion_tokens" and both.limit == 7


def test_new_id_is_the_prefix_then_24_hex_digits_and_differs_per_call():
    a, b = new_id("chatcmpl"), new_id("chatcmpl")
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", a) and re.fullmatch(r"chatcmpl-[0-9a-f]{24}", b)
    assert a != b


def test_now_is_the_current_unix_time_in_whole_seconds():
    before = int(time.time())
    t = now()
    assert type(t) is int and before <= t <= int(time.time())


def test_sse_frames_a_model_with_its_null_fields_a_dict_as_json_and_a_string_as_is():
    chunk = ChatCompletionChunk(
        id="c-1", created=5, model="plan", choices=[ChatChunkChoice(delta=ChatDelta(content="hi"))]
    )
    event = sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: ") :]) == {
        "id": "c-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "plan",
        "choices": [{"index": 0, "delta": {"role": None, "content": "hi"}, "logprobs": None, "finish_reason": None}],
        "usage": None,
        "lragent": None,
    }
    assert sse({"a": [1, None]}) == 'data: {"a": [1, null]}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"
