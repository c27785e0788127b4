"""POST /v1/chat/completions: messages rendered with the chat template, a reply out (whole or streamed)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.async_engine import OutputStream
from pagedllm.entrypoints.openai.logprobs import chat_logprobs
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving import (ServingContext, created, streaming_response, unless_disconnected,
                                                 usage)


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServingContext):
    body.check_supported("/v1/chat/completions")
    model = ctx.check_model(body.model)
    max_tokens = body.requested_max_tokens
    params = body.sampling_params(max_tokens, body.num_logprobs)
    prompt = ctx.prompts.chat_prompt(body.messages, body)
    ctx.prompts.max_tokens(prompt, max_tokens, body.max_tokens_param)
    response_id, stream = await ctx.start("chatcmpl", [prompt], params)
    num_prompt_tokens = len(prompt["prompt_token_ids"])
    header = {"id": response_id, "created": created(), "model": model}
    if body.stream:
        header["object"] = "chat.completion.chunk"
        return streaming_response(_events(body, ctx, stream, num_prompt_tokens, header), stream)
    header["object"] = "chat.completion"
    return await unless_disconnected(request, _collect(body, ctx, stream, num_prompt_tokens, header), stream)


async def _collect(body: ChatCompletionRequest, ctx: ServingContext, stream: OutputStream, num_prompt_tokens: int,
                   header: dict) -> JSONResponse:
    finals = {}
    async with stream:
        async for output in stream:
            for completion in output.outputs:
                finals[completion.index] = completion
    choices = []
    for index in sorted(finals):
        completion = finals[index]
        logprobs = None
        if body.logprobs:
            logprobs = {"content": chat_logprobs(completion.token_ids, completion.logprobs, ctx.prompts.token_text,
                                                 body.num_logprobs)}
        choices.append({"index": index, "message": {"role": "assistant", "content": completion.text},
                        "logprobs": logprobs, "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in finals.values())
    return JSONResponse({**header, "choices": choices, "usage": usage(num_prompt_tokens, completion_tokens)})


async def _events(body: ChatCompletionRequest, ctx: ServingContext, stream: OutputStream, num_prompt_tokens: int,
                  header: dict) -> AsyncIterator[dict]:
    extra = {"usage": None} if body.include_usage_in_stream else {}

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        return {**header, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": stop_reason}], **extra}

    for index in range(body.num_choices):
        yield chunk(index, {"role": "assistant", "content": ""})
    completion_tokens = 0
    async for output in stream:
        for completion in output.outputs:
            completion_tokens += len(completion.delta_token_ids)
            logprobs = None
            if body.logprobs and completion.delta_token_ids:
                logprobs = {"content": chat_logprobs(completion.delta_token_ids, completion.delta_logprobs,
                                                     ctx.prompts.token_text, body.num_logprobs)}
            if completion.delta_text or completion.finished or logprobs:
                delta = {"content": completion.delta_text} if completion.delta_text else {}
                yield chunk(completion.index, delta, logprobs, completion.finish_reason, completion.stop_reason)
    if body.include_usage_in_stream:
        yield {**header, "choices": [], "usage": usage(num_prompt_tokens, completion_tokens)}
