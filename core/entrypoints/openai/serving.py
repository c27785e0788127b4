"""What the completions and chat endpoints share: model check, starting requests, SSE, usage, disconnects."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.async_llm import AsyncLLMEngine, EngineDeadError, OutputStream, RequestFailedError
from pagedllm.entrypoints.openai.errors import OpenAIError, error_body
from pagedllm.entrypoints.openai.lora_modules import LoRAModules
from pagedllm.entrypoints.openai.prompts import PromptBuilder
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import STRUCTURED_OUTPUTS_PARAM, SamplingParams

logger = logging.getLogger("pagedllm.server")

SSE_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


@dataclasses.dataclass
class ServingContext:
    engine: AsyncLLMEngine
    prompts: PromptBuilder
    model_names: list[str]
    max_log_len: int | None = None
    tool_call_parser: str | None = None  # set when auto tool choice is on
    log_requests: bool = False
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # the model's generation config's
    system_fingerprint: str = ""
    reasoning_parser: str | None = None
    adapters: LoRAModules | None = None  # with --enable-lora: the adapters requests may name as their model

    def check_model(self, requested: str | None, adapters: bool = False) -> str:
        """The name to answer with; 404 for a model this server does not serve (an adapter's name counts where
        ``adapters``: the endpoints that generate)."""
        if requested is None or requested in self.model_names:
            return requested or self.model_names[0]
        if adapters and self.adapters is not None and self.adapters.get(requested) is not None:
            return requested
        served = self.model_names + (self.adapters.names() if adapters and self.adapters is not None else [])
        raise OpenAIError(404, f"the model {requested!r} does not exist; this server serves "
                               f"{', '.join(map(repr, served))}", param="model")

    def with_adapter(self, model: str, params: SamplingParams) -> SamplingParams:
        """``params`` to run with the adapter named ``model`` (unchanged for the base model)."""
        lora = self.adapters.get(model) if self.adapters is not None else None
        return params if lora is None else dataclasses.replace(params, lora_request=lora)

    async def start(self, kind: str, prompts: list[dict], params: SamplingParams,
                    constraint_field: str | None = None, fields: dict[str, str] | None = None,
                    priority: int = 0) -> tuple[str, OutputStream]:
        """Queue one engine request per prompt (all or none); ``InvalidRequestError`` if the engine refuses one
        (a constraint that does not compile is blamed on ``constraint_field``, the request field it came from;
        ``fields`` renames other engine parameters to the request's own fields)."""
        response_id = f"{kind}-{uuid.uuid4().hex}"
        self._log(response_id, prompts, params)
        try:
            stream = await self.engine.add([(f"{response_id}-{i}", p, params) for i, p in enumerate(prompts)],
                                           priority=priority)
        except InvalidRequestError as exc:
            if constraint_field is not None and exc.param == STRUCTURED_OUTPUTS_PARAM:
                raise OpenAIError(400, f"{constraint_field}: {exc}", param=constraint_field) from None
            if fields and exc.param in fields:  # the request's own name of the engine's parameter
                raise OpenAIError(400, str(exc), param=fields[exc.param]) from None
            raise
        return response_id, stream

    def _log(self, response_id: str, prompts: list[dict], params: SamplingParams) -> None:
        if not self.log_requests or not logger.isEnabledFor(logging.INFO):
            return
        limit = self.max_log_len
        for i, prompt in enumerate(prompts):
            text, ids = prompt["prompt"], prompt["prompt_token_ids"]
            logger.info("request %s-%d: %d prompt tokens, %s, prompt %r, token ids %s", response_id, i, len(ids),
                        params, text[:limit] if limit is not None else text, ids[:limit] if limit is not None else ids)


def system_fingerprint(*parts) -> str:
    """OpenAI's ``system_fingerprint``: changes when what produces the answers does (version, backend, dtype,
    model), so a client can tell why the same seed gave another text."""
    return "fp_" + hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:10]


def prompt_index(request_id: str) -> int:
    """Which prompt of the response an engine request id ('<response id>-<i>') belongs to."""
    return int(request_id.rsplit("-", 1)[1])


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens`` counts prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# Characters that JSON leaves raw but that line readers built on str.splitlines (httpx's aiter_lines, for one) take
# for line ends: escaped, so that a token's text never splits an event.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKERS)}\n\n"


def created() -> int:
    return int(time.time())


async def sse_events(events: AsyncIterator[dict], stream: OutputStream) -> AsyncIterator[str]:
    """Server-sent events of ``events``, then ``[DONE]``; an engine failure mid-stream is sent as an error event."""
    try:
        async for event in events:
            yield sse(event)
    except EngineDeadError as exc:
        yield sse(error_body(503, str(exc)))
    except RequestFailedError as exc:
        yield sse(error_body(500, str(exc)))
    finally:
        stream.abort()
    yield SSE_DONE


def streaming_response(events: AsyncIterator[dict], stream: OutputStream) -> StreamingResponse:
    # The background abort also covers a client gone before the first event (the generator never ran).
    return StreamingResponse(sse_events(events, stream), media_type="text/event-stream",
                             background=BackgroundTask(stream.abort))


async def unless_disconnected(request: Request, work: Awaitable[T], stream: OutputStream) -> T | Response:
    """Run ``work``; if the client disconnects first, cancel it and abort its requests (their blocks are freed)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
    if task in done:
        return task.result()
    logger.info("client disconnected: aborted %s", ", ".join(stream.request_ids))
    return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
