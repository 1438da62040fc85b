"""``POST /v1/chat/completions``: the messages through the model's chat template, then a completion."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eval_suite.serve.engine_client import ClientGone, RequestEvents
from eval_suite.serve.protocol import (
    ALLOWED,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ProtocolError,
    new_id,
    now,
    parse_body,
    sse,
)
from eval_suite.serve.server_state import CLIENT_GONE, ServerState, failed_response
from lragent.serving.scheduler import Delta, Failed, Finished


def chat_prompt(tokenizer: object, request: ChatCompletionRequest) -> str:
    """The prompt text of the messages: the tokenizer's chat template with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ProtocolError(
            f"Invalid value for 'messages': this model has no chat template; use /v1/completions with a prompt. "
            f"Allowed: {ALLOWED['messages']}.",
            "messages",
        )
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in request.messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    """Serves a chat completions request (see :mod:`eval_suite.serve.api_server` for the errors)."""
    request = parse_body(ChatCompletionRequest, await raw.body())
    fields = state.sampling(request)
    prompt = chat_prompt(state.tokenizer, request)
    events = state.client.open(
        raw.is_disconnected, prompt=prompt, max_tokens=request.limit, prompt_field="messages", **fields
    )
    rid, created = new_id("chatcmpl"), now()
    try:
        first = await events.next()
        if isinstance(first, Failed):
            return failed_response(first)
        if not request.stream:
            done = await events.result()
            if isinstance(done, Failed):
                return failed_response(done)
            body = ChatCompletion(
                id=rid,
                created=created,
                model=request.model,
                choices=[ChatChoice(message=ChatMessageOut(content=done.text), finish_reason=done.finish_reason)],
                usage=state.usage(done),
                lragent=state.details(done),
            )
            return JSONResponse(body.model_dump())
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    return StreamingResponse(
        _stream(state, events, request, rid, created),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _stream(
    state: ServerState, events: RequestEvents, request: ChatCompletionRequest, rid: str, created: int
) -> AsyncIterator[str]:
    def chunk(delta: ChatDelta | None, reason: str | None = None, done: Finished | None = None) -> str:
        choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=reason)]
        body = ChatCompletionChunk(id=rid, created=created, model=request.model, choices=choices)
        if done is not None:
            body.usage, body.lragent = state.usage(done), state.details(done)
        return sse(body)

    try:
        yield chunk(ChatDelta(role="assistant", content=""))
        while True:
            event = await events.next()
            if isinstance(event, Delta):
                yield chunk(ChatDelta(content=event.text))
            elif isinstance(event, Finished):
                yield chunk(ChatDelta(), event.finish_reason)
                if request.include_usage:
                    yield chunk(None, None, event)
                yield "data: [DONE]\n\n"
                return
            elif isinstance(event, Failed):
                kind = "invalid_request_error" if event.status < 500 else "server_error"
                yield sse({"error": {"message": event.message, "type": kind, "param": event.param, "code": event.code}})
                yield "data: [DONE]\n\n"
                return
    except ClientGone:
        return
    finally:
        events.close()
