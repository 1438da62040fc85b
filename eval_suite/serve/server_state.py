"""What every handler of the server reads: the scheduler, the served names, and how a request's sampling options
become a scheduler request."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from eval_suite.serve.engine_client import EngineClient
from eval_suite.serve.protocol import (
    ALLOWED,
    PromptTokensDetails,
    ProtocolError,
    SamplingFields,
    ServerDetails,
    Usage,
    error_body,
)
from lragent.serving.scheduler import Failed, Finished, Scheduler

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default sampling temperature (a request that gives none samples)."""


@dataclass
class ServerState:
    """The served model and its scheduler.

    Attributes:
        scheduler: the running scheduler (its engine's roles are the served models).
        scheme: the sharing scheme's name.
        base_name: the role that is the base model (B = 0).
        tokenizer: the model's tokenizer (the chat template).
        api_key: the key every ``/v1`` request must carry (None: no key).
    """

    scheduler: Scheduler
    scheme: str
    base_name: str
    tokenizer: object
    api_key: str | None = None

    def __post_init__(self) -> None:
        self.client = EngineClient(self.scheduler)

    @property
    def models(self) -> tuple[str, ...]:
        """The served model names: the roles, then the base model."""
        return self.scheduler.roles

    def check_model(self, name: str) -> str:
        if name not in self.models:
            raise ProtocolError(
                f"The model `{name}` does not exist. Allowed: {', '.join(self.models)}.", "model", "model_not_found"
            )
        return name

    def sampling(self, request: SamplingFields) -> dict:
        """The scheduler request's sampling fields of an API request (OpenAI's defaults where it gives none; a
        sampling request without a seed gets a random one)."""
        temperature = DEFAULT_TEMPERATURE if request.temperature is None else float(request.temperature)
        seed = request.seed
        if seed is None:
            seed = 0 if temperature == 0 else secrets.randbits(31)
        if not -(2**63) <= seed < 2**63:
            raise ProtocolError(f"Invalid value for 'seed': got {seed}. Allowed: {ALLOWED['seed']} in 64 bits.", "seed")
        return {
            "role": self.check_model(request.model),
            "temperature": temperature,
            "top_p": 1.0 if request.top_p is None else float(request.top_p),
            "stop": request.stop_list,
            "seed": int(seed),
            "stream": bool(request.stream),
        }

    def usage(self, done: Finished) -> Usage:
        return Usage(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            total_tokens=done.prompt_tokens + done.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
        )

    def details(self, done: Finished) -> ServerDetails:
        return ServerDetails(
            scheme=self.scheme,
            prefill_tokens=done.prefill_tokens,
            recomputed_tokens=done.recomputed_tokens,
            trajectory_tokens=done.trajectory_tokens,
            prefill_s=done.prefill_s,
            decode_s=done.decode_s,
            ttft_s=done.ttft_s,
        )


def failed_response(failed: Failed) -> JSONResponse:
    """OpenAI's error object for a request the scheduler could not serve."""
    kind = "invalid_request_error" if failed.status < 500 else "server_error"
    return JSONResponse(error_body(failed.message, kind, failed.param, failed.code), status_code=failed.status)


CLIENT_GONE = 499
"""The status logged for a request whose client disconnected (nginx's convention; the client never reads it)."""
