"""POST /v1/chat/completions: messages rendered with the chat template, a reply out (whole or streamed)."""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import OutputStream
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, split_reasoning
from pagedllm.entrypoints.openai.serving import ServingContext, created, streaming_response, unless_disconnected, usage
from pagedllm.entrypoints.openai.tool_calls import ToolCalling


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServingContext):
    body.check_supported("/v1/chat/completions")
    model = ctx.check_model(body.model, adapters=True)
    max_tokens = body.requested_max_tokens
    tools = ToolCalling.for_request(body, ctx.tool_call_parser)
    constraint, constraint_field = body.structured_outputs_params()
    tool_constraint = tools.constraint() if tools is not None else None
    if tool_constraint is not None:
        if constraint is not None:
            raise OpenAIError(400, f"{constraint_field} cannot be combined with tool_choice "
                                   f"{body.tool_choice if isinstance(body.tool_choice, str) else 'naming a function'}",
                              param=constraint_field)
        constraint, constraint_field = tool_constraint, "tools"
    params = ctx.with_adapter(model, body.sampling_params(max_tokens, body.num_logprobs, constraint,
                                                          defaults=ctx.sampling_defaults))
    if tools is not None and tools.mode == "auto" and body.skip_special_tokens is None:
        params.skip_special_tokens = False  # as vLLM: hermes models may mark <tool_call> special, the parser needs it
    prompt = await ctx.prompts.run(ctx.prompts.chat_prompt, body.messages,
                                   tools.template_fields(body) if tools is not None else body)
    ctx.prompts.max_tokens(prompt, max_tokens, body.max_tokens_param)
    response_id, stream = await ctx.start("chatcmpl", [prompt], params, constraint_field,
                                          fields={"logprobs": "top_logprobs"}, priority=body.priority)
    num_prompt_tokens = len(prompt["prompt_token_ids"])
    header = {"id": response_id, "created": created(), "model": model,
              "system_fingerprint": ctx.system_fingerprint}
    if body.stream:
        header["object"] = "chat.completion.chunk"
        return streaming_response(_events(body, ctx, stream, num_prompt_tokens, header, tools), stream)
    header["object"] = "chat.completion"
    return await unless_disconnected(request, _collect(body, ctx, stream, num_prompt_tokens, header, tools), stream)


async def _collect(body: ChatCompletionRequest, ctx: ServingContext, stream: OutputStream, num_prompt_tokens: int,
                   header: dict, tools: ToolCalling | None) -> JSONResponse:
    finals = {}
    last = None
    async with stream:
        async for output in stream:
            last = output
            for completion in output.outputs:
                finals[completion.index] = completion
    choices = []
    for index in sorted(finals):
        completion = finals[index]
        logprobs = None
        if body.logprobs:
            logprobs = {"content": chat_logprobs(completion.token_ids, completion.logprobs, ctx.prompts.token_text,
                                                 body.num_logprobs)}
        reasoning, text = None, completion.text
        if ctx.reasoning_parser is not None:
            reasoning, text = split_reasoning(ctx.reasoning_parser, text)
        message, finish_reason = {"role": "assistant", "content": text}, completion.finish_reason
        if tools is not None:
            message, finish_reason = tools.message(text, finish_reason)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
            message["content"] = message["content"] or None
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                        "stop_reason": completion.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in finals.values())
    cached = last.num_cached_tokens if last is not None else 0
    body_out = {**header, "choices": choices, "usage": usage(num_prompt_tokens, completion_tokens, cached)}
    if body.prompt_logprobs is not None and last is not None:
        body_out["prompt_logprobs"] = vllm_prompt_logprobs(last.prompt_logprobs, ctx.prompts.token_text)
    return JSONResponse(body_out)


async def _events(body: ChatCompletionRequest, ctx: ServingContext, stream: OutputStream, num_prompt_tokens: int,
                  header: dict, tools: ToolCalling | None) -> AsyncIterator[dict]:
    extra = {"usage": None} if body.include_usage_in_stream else {}
    completion_tokens = 0

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        return {**header, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": stop_reason}], **extra,
                **({"usage": usage(num_prompt_tokens, completion_tokens)} if body.continuous_usage else {})}

    for index in range(body.num_choices):
        yield chunk(index, {"role": "assistant", "content": ""})
    cached = 0
    tool_streams = {index: tools.stream() for index in range(body.num_choices)} if tools is not None else {}
    reasoning_streams = {index: ReasoningStream(ctx.reasoning_parser) for index in range(body.num_choices)} \
        if ctx.reasoning_parser is not None else {}
    async for output in stream:
        cached = output.num_cached_tokens
        for completion in output.outputs:
            completion_tokens += len(completion.delta_token_ids)
            logprobs = None
            if body.logprobs and completion.delta_token_ids:
                logprobs = {"content": chat_logprobs(completion.delta_token_ids, completion.delta_logprobs,
                                                     ctx.prompts.token_text, body.num_logprobs)}
            content, calls, finish_reason = completion.delta_text, [], completion.finish_reason
            reasoning = ""
            reasoning_stream = reasoning_streams.get(completion.index)
            if reasoning_stream is not None:
                reasoning, content = _through(reasoning_stream, content, completion.finished)
            tool_stream = tool_streams.get(completion.index)
            if tool_stream is not None:
                content, calls = _through(tool_stream, content, completion.finished)
                if completion.finished:
                    finish_reason = tool_stream.finish_reason(finish_reason)
            if content or calls or reasoning or completion.finished or logprobs:
                delta = {"content": content} if content else {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if calls:
                    delta["tool_calls"] = calls
                yield chunk(completion.index, delta, logprobs, finish_reason, completion.stop_reason)
    if body.include_usage_in_stream:
        yield {**header, "choices": [], "usage": usage(num_prompt_tokens, completion_tokens, cached)}


def _through(stream, text: str, finished: bool) -> tuple:
    """A delta through a reasoning or tool-call stream: its two outputs, with what it held back at the end."""
    first, second = stream.feed(text)
    if finished:
        more_first, more_second = stream.finish()
        first, second = first + more_first, second + more_second
    return first, second
