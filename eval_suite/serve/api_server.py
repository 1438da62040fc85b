"""The OpenAI-compatible HTTP server: the app, its routes and error handlers, and how it is run.

Routes: ``GET /v1/models``, ``POST /v1/completions`` (:mod:`eval_suite.serve.serving_completion`), ``POST
/v1/chat/completions`` (:mod:`eval_suite.serve.serving_chat`), ``GET /health`` and ``GET /metrics`` (Prometheus text,
:class:`~lragent.serving.metrics.ServeMetrics`). Every error is OpenAI's error object, never a traceback: a request
the server cannot honour is a 400 naming its field (:class:`~eval_suite.serve.protocol.ProtocolError`), a missing or
wrong API key a 401, an unknown route a 404, running out of device memory a 503 (one line; the server goes on), any
other failure a 500 whose details go to the server's log only.

The scheduler (:class:`~lragent.serving.scheduler.Scheduler`) runs in its own thread; the app's lifespan stops it
once uvicorn has finished the requests in flight (SIGTERM: uvicorn stops accepting connections, serves the open ones
to their end, then the app shuts down).
"""

from __future__ import annotations

import hmac
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eval_suite.serve.protocol import ModelCard, ModelList, ProtocolError, error_body, now
from eval_suite.serve.server_state import ServerState
from eval_suite.serve.serving_chat import create_chat_completion
from eval_suite.serve.serving_completion import create_completion


def build_app(state: ServerState) -> FastAPI:
    """The app serving ``state``'s scheduler (started here if it is not running; stopped at shutdown)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        yield
        state.scheduler.stop()

    app = FastAPI(title="lragent serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.middleware("http")
    async def api_key(request: Request, call_next: Callable) -> Response:
        if state.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                body = error_body("Incorrect or missing API key: send the header 'Authorization: Bearer KEY'.",
                                  "invalid_request_error", None, "invalid_api_key")  # fmt: skip
                return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, exc: ProtocolError) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return JSONResponse(error_body(str(exc), kind, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(f"Invalid request: {exc.errors()[0].get('msg', 'invalid')}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        print(f"lragent serve: internal error on {request.url.path}: {exc!r}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        body = error_body("internal error while serving this request (logged by the server)", "server_error")
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.scheduler.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        created = now()
        cards = [
            ModelCard(
                id=name,
                created=created,
                root=name,
                parent=None if name == state.base_name else state.base_name,
                max_model_len=state.scheduler.context,
            )
            for name in state.models
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(state, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(state, request)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); raises ``ValueError`` in one line when the
    address cannot be taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; allowed: a free port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _config(app: FastAPI, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_keep_alive=30)


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM or SIGINT it shut down on gracefully is not raised again afterwards
    (the process then ends with the command's own status and line, not killed by the signal). A second SIGINT
    still forces the exit."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def serve_until_stopped(app: FastAPI, sock: socket.socket, log_level: str = "warning") -> None:
    """Runs the app on ``sock`` in this thread until SIGINT or SIGTERM, after which the requests in flight are served
    to their end and the scheduler stopped."""
    _Server(_config(app, log_level)).run(sockets=[sock])


class ServerThread:
    """The app on a free port of ``host`` in a background thread (tests, ``bench serve``).

    Args:
        app: the app (:func:`build_app`).
        host: the address to bind (127.0.0.1).
        port: the port (0: a free one).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(_config(app, "warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        for _ in range(int(timeout / 0.01)):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError(f"the server on {self.url} did not start")

    def stop(self, timeout: float = 60.0) -> None:
        """Stops as SIGTERM does: the open requests are served to their end, then the scheduler stops."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
