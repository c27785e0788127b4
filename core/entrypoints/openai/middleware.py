"""ASGI guards that run before a body is parsed: the API key on /v1 endpoints, and the request size limit."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import body_too_large, body_too_large_message, error_response

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the model's endpoints: under /v1, /tokenize and /detokenize
    (/health, /metrics and /version stay open, as vLLM's do: supervisors and scrapers poll them)."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route(scope).startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            # every key compared, so the time taken does not tell which one nearly matched
            if not sum(hmac.compare_digest(given, expected) for expected in self.expected):
                message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not given
                           else "incorrect API key provided")
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _route(scope: Scope) -> str:
    """The path the app routes on: uvicorn puts --root-path in front of the request's path."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BodySizeLimitMiddleware:
    """A 413 for a body over ``max_bytes``: at once when Content-Length says so, else as soon as the chunks read
    pass the limit (FastAPI's own limit answers in plain text, not in OpenAI's format)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await body_too_large(self.max_bytes)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # raised while the app reads the body: its handler answers
                    raise HTTPException(413, body_too_large_message(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)
