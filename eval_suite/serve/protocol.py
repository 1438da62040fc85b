"""The OpenAI API's request and response bodies as the server speaks them, and its error object.

Requests are parsed strictly (a string where a number belongs is an error, not a conversion): anything the server
cannot honour is a :class:`ProtocolError` that names the field and what it allows, answered as OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with status 400. Fields the server does not know are ignored;
known OpenAI options it does not implement (``n`` > 1, ``logprobs``, ``echo``, penalties, tools) are refused unless
they hold their neutral value.

Responses follow OpenAI's completions and chat completions objects, ``usage.prompt_tokens_details.cached_tokens``
included, plus one field of this server's own, ``lragent`` (ignored by OpenAI clients; ``model_extra`` in the
``openai`` package): the step's prefill and recomputed positions, the trajectory's length after it, and its seconds.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP = 4
"""Stop strings a request may give (OpenAI's limit)."""

ALLOWED: dict[str, str] = {
    "body": "a JSON object",
    "model": "one of the served models (GET /v1/models)",
    "prompt": "a non-empty string, or a list holding one non-empty string",
    "messages": "a non-empty list of {role: system|user|assistant, content: a string or a list of text parts}",
    "max_tokens": "an integer >= 1; the prompt's tokens plus max_tokens must fit in the context",
    "max_completion_tokens": "an integer >= 1; the prompt's tokens plus it must fit in the context",
    "temperature": "a number in [0, 2] (0: greedy)",
    "top_p": "a number in (0, 1]",
    "stop": f"a non-empty string, or a list of at most {MAX_STOP} non-empty strings",
    "seed": "an integer",
    "stream": "true or false",
    "stream_options": "an object {include_usage: true or false}, with stream true",
    "n": "1",
    "echo": "false",
    "logprobs": "null or false (log probabilities are not returned)",
    "top_logprobs": "null",
    "best_of": "null or 1",
    "suffix": "null",
    "presence_penalty": "0",
    "frequency_penalty": "0",
    "logit_bias": "null or {}",
    "tools": "null (tools are not supported)",
    "tool_choice": "null or none",
    "response_format": "null or {type: text}",
    "user": "a string",
}


class ProtocolError(ValueError):
    """A request the server refuses with status 400, naming the field at fault.

    Args:
        message: one line.
        param: the field (None for a body that is not JSON).
        code: a machine-readable code, if any.
        status: the HTTP status.
    """

    def __init__(self, message: str, param: str | None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(field: str, value: Any, why: str | None = None) -> ProtocolError:
    """The error for an invalid ``field``: what was given, why, and what is allowed."""
    shown = json.dumps(value)[:80] if not isinstance(value, _Missing) else None
    got = "is required" if shown is None else f"got {shown}"
    reason = f" ({why})" if why else ""
    return ProtocolError(f"Invalid value for '{field}': {got}{reason}. Allowed: {ALLOWED[field]}.", field)


class _Missing:
    pass


def _neutral(value: Any, *neutral: Any) -> bool:
    return value is None or any(value == n and type(value) is type(n) for n in neutral)


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = 1
    logprobs: Any = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 2:
            raise ValueError("out of range")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError("out of range")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"{len(stops)} strings")
        if any(not s for s in stops):
            raise ValueError("an empty string")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("one choice per request")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError("not supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("not supported")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> SamplingFields:
        if self.stream_options is not None:
            if not self.stream or set(self.stream_options) - {"include_usage", "continuous_usage_stats"}:
                raise ProtocolError(
                    f"Invalid value for 'stream_options': got {json.dumps(self.stream_options)[:80]}. Allowed: "
                    f"{ALLOWED['stream_options']}.",
                    "stream_options",
                )
            if not isinstance(self.stream_options.get("include_usage", False), bool):
                raise ProtocolError(f"Invalid value for 'stream_options': include_usage must be true or false. "
                                    f"Allowed: {ALLOWED['stream_options']}.", "stream_options")  # fmt: skip
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str]
    max_tokens: int | None = 16
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError(f"a list of {len(v)} prompts; one request serves one")
        if not (v if isinstance(v, str) else v[0]):
            raise ValueError("empty")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be at least 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        for name, neutral in (("echo", (False,)), ("best_of", (1,)), ("suffix", ()), ("logprobs", ())):
            value = getattr(self, name)
            if not _neutral(value, *neutral):
                raise invalid(name, value, "not supported")
        return self

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    """One message of a chat request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("a content part that is not text")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("an empty list")
        for m in v:
            m.text  # noqa: B018 (checks the parts)
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError("must be at least 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        checks = (("logprobs", (False,)), ("top_logprobs", ()), ("tools", ()), ("tool_choice", ("none",)))
        for name, neutral in checks:
            value = getattr(self, name)
            if not _neutral(value, *neutral) and value != []:
                raise invalid(name, value, "not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise invalid("response_format", self.response_format, "not supported")
        return self

    @property
    def limit(self) -> int | None:
        """The generation bound asked (``max_completion_tokens`` before the older ``max_tokens``), None: the rest
        of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


Request = CompletionRequest | ChatCompletionRequest


def parse_body(kind: type[Request], body: bytes) -> Request:
    """Parses a request body; raises :class:`ProtocolError` naming the first field at fault."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(
            f"We could not parse the JSON body of your request ({exc.__class__.__name__}: {' '.join(str(exc).split())}"
            "). Allowed: a JSON object.",
            None,
            "invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise ProtocolError(f"The request body must be a JSON object, got {type(data).__name__}.", None, "invalid_json")
    try:
        return kind.model_validate(data)
    except ProtocolError:
        raise
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "body"
        if field not in ALLOWED:
            field = "body"
        value = data.get(field, _Missing()) if field != "body" else data
        why = str(err["msg"]).removeprefix("Value error, ")
        if isinstance(err.get("ctx", {}).get("error"), ProtocolError):
            raise err["ctx"]["error"] from None
        if err["type"] == "missing":
            why = None
        raise invalid(field, value, why) from None


# ---- responses ---------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ServerDetails(BaseModel):
    """This server's own figures of one request (the ``lragent`` field of a response)."""

    scheme: str
    prefill_tokens: int
    recomputed_tokens: int
    trajectory_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    lragent: ServerDetails | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    lragent: ServerDetails | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    lragent: ServerDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lragent"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None  # positions a prompt and its completion may take together (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def sse(obj: BaseModel | dict | str) -> str:
    """One server-sent event (``data: ...``)."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump_json(exclude_none=False)
    elif isinstance(obj, dict):
        obj = json.dumps(obj)
    return f"data: {obj}\n\n"
