"""POST /v1/completions: prompts in, text out (whole, or streamed as server-sent events)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import OutputStream
from pagedllm.entrypoints.openai.logprobs import completion_logprobs
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving import (
    ServingContext,
    created,
    prompt_index,
    streaming_response,
    unless_disconnected,
    usage,
)


async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext):
    body.check_supported("/v1/completions")
    model = ctx.check_model(body.model)
    constraint, constraint_field = body.structured_outputs_params()
    params = body.sampling_params(body.max_tokens, body.logprobs, constraint)
    prompts = await ctx.prompts.run(ctx.prompts.completion_prompts, body.prompt)
    for prompt in prompts:
        ctx.prompts.max_tokens(prompt, body.max_tokens, "max_tokens")
    response_id, stream = await ctx.start("cmpl", prompts, params, constraint_field)
    header = {"id": response_id, "object": "text_completion", "created": created(), "model": model}
    if body.stream:
        return streaming_response(_events(body, ctx, stream, prompts, header), stream)
    return await unless_disconnected(request, _collect(body, ctx, stream, prompts, header), stream)


async def _collect(body: CompletionRequest, ctx: ServingContext, stream: OutputStream, prompts: list[dict],
                   header: dict) -> JSONResponse:
    n = body.num_choices
    finals = {}
    async with stream:
        async for output in stream:
            base = prompt_index(output.request_id) * n
            for completion in output.outputs:
                finals[base + completion.index] = completion
    choices = []
    for index in sorted(finals):
        completion = finals[index]
        text = prompts[index // n]["prompt"] + completion.text if body.echo else completion.text
        logprobs = None
        if body.logprobs is not None:
            logprobs, _ = completion_logprobs(completion.token_ids, completion.logprobs, ctx.prompts.token_text)
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in finals.values())
    return JSONResponse({**header, "choices": choices, "usage": usage(_prompt_tokens(prompts), completion_tokens)})


async def _events(body: CompletionRequest, ctx: ServingContext, stream: OutputStream, prompts: list[dict],
                  header: dict) -> AsyncIterator[dict]:
    n = body.num_choices
    extra = {"usage": None} if body.include_usage_in_stream else {}

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        return {**header, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": stop_reason}], **extra}

    if body.echo:
        for i, prompt in enumerate(prompts):
            for j in range(n):
                yield chunk(i * n + j, prompt["prompt"])
    text_offsets: dict[int, int] = {}
    completion_tokens = 0
    async for output in stream:
        base = prompt_index(output.request_id) * n
        for completion in output.outputs:
            index = base + completion.index
            completion_tokens += len(completion.delta_token_ids)
            logprobs = None
            if body.logprobs is not None and completion.delta_token_ids:
                logprobs, text_offsets[index] = completion_logprobs(
                    completion.delta_token_ids, completion.delta_logprobs, ctx.prompts.token_text,
                    text_offsets.get(index, 0))
            if completion.delta_text or completion.finished or logprobs:
                yield chunk(index, completion.delta_text, logprobs, completion.finish_reason, completion.stop_reason)
    if body.include_usage_in_stream:
        yield {**header, "choices": [], "usage": usage(_prompt_tokens(prompts), completion_tokens)}


def _prompt_tokens(prompts: list[dict]) -> int:
    return sum(len(p["prompt_token_ids"]) for p in prompts)
