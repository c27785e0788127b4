"""Errors in OpenAI's format, ``{"error": {"message", "type", "param", "code"}}``, for every failure path; ``code`` is
the HTTP status as an integer, as vLLM answers."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_llm import EngineDeadError, RequestFailedError
from pagedllm.errors import InvalidRequestError, client_message

logger = logging.getLogger("pagedllm.server")
RETRY_AFTER_SECONDS = 1  # a queue drains at the pace of steps: soon worth another try

class OpenAIError(Exception):
    """A request failure the client should see with this status, message and parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "server_error" if status >= 500 else "invalid_request_error"  # the two types OpenAI's API uses here
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def queue_full(message: str) -> JSONResponse:
    """503 and when to retry, as Text Generation Inference answers its --max-concurrent-requests limit."""
    response = error_response(503, message)
    response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


def body_too_large_message(max_bytes: int) -> str:
    return (f"the request body is larger than this server's limit of {max_bytes} bytes "
            f"(pagedllm serve --max-request-size)")


def body_too_large(max_bytes: int) -> JSONResponse:
    return error_response(413, body_too_large_message(max_bytes))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first field at fault and what is wrong with it: 'max_tokens: Input should be a valid integer'."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc:
        return f"the request body is invalid: {first.get('msg')}", None
    same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if len(same_field) > 1:  # a union: say every shape it could have taken
        messages = list(dict.fromkeys(e.get("msg", "") for e in same_field))
        return f"{loc[0]}: " + " or ".join(messages), loc[0]
    return f"{'.'.join(loc)}: {first.get('msg')}", loc[0]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"internal server error: {client_message(exc)}")
