"""POST /v1/completions: prompts in, text out (whole, or streamed as server-sent events)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import OutputStream
from pagedllm.entrypoints.openai.logprobs import completion_logprobs, vllm_prompt_logprobs
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving import (
    ServingContext,
    created,
    prompt_index,
    streaming_response,
    unless_disconnected,
    usage,
)
from pagedllm.outputs import RequestOutput


async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext):
    body.check_supported("/v1/completions")
    model = ctx.check_model(body.model, adapters=True)
    constraint, constraint_field = body.structured_outputs_params()
    # max_tokens 0 with echo scores the prompt only (what lm-eval's loglikelihood asks): as vLLM, one token is
    # generated and left out of the answer.
    max_tokens = 1 if body.prompt_only else body.max_tokens
    params = body.sampling_params(max_tokens, body.logprobs, constraint,
                                  prompt_logprobs=body.logprobs if body.echo else None, defaults=ctx.sampling_defaults)
    params = ctx.with_adapter(model, params)
    prompts = await ctx.prompts.run(ctx.prompts.completion_prompts, body.prompt)
    if not body.prompt_only:
        for prompt in prompts:
            ctx.prompts.max_tokens(prompt, body.max_tokens, "max_tokens")
    fields = {"prompt_logprobs": "logprobs"} if body.echo and body.logprobs is not None else None
    response_id, stream = await ctx.start("cmpl", prompts, params, constraint_field, fields=fields,
                                          priority=body.priority)
    header = {"id": response_id, "object": "text_completion", "created": created(), "model": model,
              "system_fingerprint": ctx.system_fingerprint}
    if body.stream:
        return streaming_response(_events(body, ctx, stream, prompts, header), stream)
    return await unless_disconnected(request, _collect(body, ctx, stream, prompts, header), stream)


async def _collect(body: CompletionRequest, ctx: ServingContext, stream: OutputStream, prompts: list[dict],
                   header: dict) -> JSONResponse:
    n = body.num_choices
    finals = {}
    scored: dict[int, RequestOutput] = {}  # per prompt: its last output (prompt logprobs, cached tokens)
    async with stream:
        async for output in stream:
            base = prompt_index(output.request_id)
            scored[base] = output
            for completion in output.outputs:
                finals[base * n + completion.index] = completion
    choices = []
    for index in sorted(finals):
        completion, output = finals[index], scored[index // n]
        token_ids, text = completion.token_ids, completion.text
        entries = completion.logprobs
        if body.prompt_only:
            token_ids, text, entries = [], "", []
        if body.echo:
            text = prompts[index // n]["prompt"] + text
        logprobs = None
        if body.logprobs is not None:
            if body.echo:
                token_ids = output.prompt_token_ids + token_ids
                entries = output.prompt_logprobs + entries
            logprobs, _ = completion_logprobs(token_ids, entries, ctx.prompts.token_text)
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                        "prompt_logprobs": vllm_prompt_logprobs(output.prompt_logprobs, ctx.prompts.token_text)
                        if body.prompt_logprobs is not None else None})
    completion_tokens = 0 if body.prompt_only else sum(len(c.token_ids) for c in finals.values())
    cached = sum(o.num_cached_tokens for o in scored.values())
    return JSONResponse({**header, "choices": choices,
                         "usage": usage(_prompt_tokens(prompts), completion_tokens, cached)})


async def _events(body: CompletionRequest, ctx: ServingContext, stream: OutputStream, prompts: list[dict],
                  header: dict) -> AsyncIterator[dict]:
    n = body.num_choices
    extra = {"usage": None} if body.include_usage_in_stream else {}
    completion_tokens = 0

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        return {**header, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": stop_reason}], **extra,
                **({"usage": usage(_prompt_tokens(prompts), completion_tokens)} if body.continuous_usage else {})}

    echo_logprobs = body.echo and body.logprobs is not None
    if body.echo and not echo_logprobs:  # the prompt's logprobs come with its first output: the echo waits for them
        for i, prompt in enumerate(prompts):
            for j in range(n):
                yield chunk(i * n + j, prompt["prompt"])
    text_offsets: dict[int, int] = {}
    cached: dict[int, int] = {}
    async for output in stream:
        base = prompt_index(output.request_id) * n
        cached[base] = output.num_cached_tokens
        for completion in output.outputs:
            index = base + completion.index
            if echo_logprobs and index not in text_offsets:
                logprobs, text_offsets[index] = completion_logprobs(
                    output.prompt_token_ids, output.prompt_logprobs, ctx.prompts.token_text)
                yield chunk(index, prompts[base // n]["prompt"], logprobs)
            if body.prompt_only:
                if completion.finished:
                    yield chunk(index, "", None, completion.finish_reason, completion.stop_reason)
                continue
            completion_tokens += len(completion.delta_token_ids)
            logprobs = None
            if body.logprobs is not None and completion.delta_token_ids:
                logprobs, text_offsets[index] = completion_logprobs(
                    completion.delta_token_ids, completion.delta_logprobs, ctx.prompts.token_text,
                    text_offsets.get(index, 0))
            if completion.delta_text or completion.finished or logprobs:
                yield chunk(index, completion.delta_text, logprobs, completion.finish_reason, completion.stop_reason)
    if body.include_usage_in_stream:
        yield {**header, "choices": [], "usage": usage(_prompt_tokens(prompts), completion_tokens,
                                                       sum(cached.values()))}


def _prompt_tokens(prompts: list[dict]) -> int:
    return sum(len(p["prompt_token_ids"]) for p in prompts)
