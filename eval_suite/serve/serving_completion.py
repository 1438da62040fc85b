"""``POST /v1/completions``: one role's turn on the trajectory the prompt holds."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from eval_suite.serve.engine_client import ClientGone, RequestEvents
from eval_suite.serve.protocol import Completion, CompletionChoice, CompletionRequest, new_id, now, parse_body, sse
from eval_suite.serve.server_state import CLIENT_GONE, ServerState, failed_response
from lragent.serving.scheduler import Delta, Failed, Finished


async def create_completion(state: ServerState, raw: Request) -> Response:
    """Serves a completions request (see :mod:`eval_suite.serve.api_server` for the errors)."""
    request = parse_body(CompletionRequest, await raw.body())
    fields = state.sampling(request)
    events = state.client.open(
        raw.is_disconnected, prompt=request.prompt_text, max_tokens=request.max_tokens, prompt_field="prompt", **fields
    )
    rid, created = new_id("cmpl"), now()
    try:
        first = await events.next()  # admitted (prefilled) or refused: the status is known before a byte is sent
        if isinstance(first, Failed):
            return failed_response(first)
        if not request.stream:
            done = await events.result()
            if isinstance(done, Failed):
                return failed_response(done)
            body = Completion(
                id=rid,
                created=created,
                model=request.model,
                choices=[CompletionChoice(text=done.text, finish_reason=done.finish_reason)],
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
    state: ServerState, events: RequestEvents, request: CompletionRequest, rid: str, created: int
) -> AsyncIterator[str]:
    def chunk(text: str, reason: str | None, done: Finished | None = None, usage: bool = False) -> str:
        choices = [] if usage else [CompletionChoice(text=text, finish_reason=reason)]
        body = Completion(id=rid, created=created, model=request.model, choices=choices)
        if done is not None and usage:
            body.usage, body.lragent = state.usage(done), state.details(done)
        return sse(body)

    try:
        while True:
            event = await events.next()
            if isinstance(event, Delta):
                yield chunk(event.text, None)
            elif isinstance(event, Finished):
                yield chunk("", event.finish_reason)
                if request.include_usage:
                    yield chunk("", None, event, usage=True)
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
        events.close()  # a client that went away mid-stream: its row stops generating
