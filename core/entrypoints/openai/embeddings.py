"""POST /v1/embeddings (OpenAI's), /v1/score and /v1/rerank (vLLM's, Jina's and Cohere's shape) for a model served
with the pooling runner. Scores are the cosine similarity of embeddings (an embedding model; cross-encoders are not
built yet)."""

from __future__ import annotations

import base64
import uuid
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import check_text_fields
from pagedllm.entrypoints.openai.serving import ServingContext, created, prompt_index, unless_disconnected
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.scoring import pair_scores, score_pairs, unique_texts

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=2**31 - 1)
    user: str | None = None
    normalize: bool | None = None  # vLLM's


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0, le=2**31 - 1)


def check_pooling_model(ctx: ServingContext, endpoint: str) -> None:
    if ctx.engine.engine.config.runner != "pooling":
        raise OpenAIError(400, f"{endpoint} needs an embedding model: this server's model generates text (serve an "
                               f"embedding model, or this one with --runner pooling --convert embed)")


async def embed_texts(ctx: ServingContext, request: Request, kind: str, inputs: list, params: PoolingParams,
                      param: str) -> tuple[list[list[float]], int]:
    """Embeddings of strings or token-id lists, in order, and their prompt tokens."""
    if not inputs:
        raise OpenAIError(400, f"{param} is empty", param=param)
    if len(inputs) > ctx.prompts.max_prompts:
        raise OpenAIError(400, f"{param} has {len(inputs)} entries, more than the {ctx.prompts.max_prompts} allowed "
                               f"(--max-prompts-per-request)", param=param)
    for item in inputs:
        ctx.prompts.check_length(item, param)
    prompts = await ctx.prompts.run(lambda: [ctx.prompts.encode(i, add_special_tokens=True) if isinstance(i, str)
                                             else ctx.prompts.from_ids(i) for i in inputs])
    _, stream = await ctx.start(kind, prompts, params)

    async def collect() -> list[list[float]]:
        vectors: dict[int, list[float]] = {}
        async with stream:
            async for output in stream:
                vectors[prompt_index(output.request_id)] = output.embedding
        return [vectors[i] for i in range(len(prompts))]

    vectors = await unless_disconnected(request, collect(), stream)
    if not isinstance(vectors, list):
        return vectors, 0  # the client has gone: the 499 response
    return vectors, sum(len(p["prompt_token_ids"]) for p in prompts)


async def create_embedding(body: EmbeddingRequest, request: Request, ctx: ServingContext):
    check_pooling_model(ctx, "/v1/embeddings")
    model = ctx.check_model(body.model)
    check_text_fields(body)
    inputs = body.input
    if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]
    params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    vectors, tokens = await embed_texts(ctx, request, "embd", list(inputs), params, "input")
    if not isinstance(vectors, list):
        return vectors
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 encoding: the float32 array's little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_score(body: ScoreRequest, request: Request, ctx: ServingContext):
    check_pooling_model(ctx, "/v1/score")
    model = ctx.check_model(body.model)
    check_text_fields(body)
    try:
        first, second = score_pairs(body.text_1, body.text_2)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="text_2") from None
    scores, tokens = await _scores(ctx, request, first, second)
    if not isinstance(scores, list):
        return scores
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created(), "model": model,
                         "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def create_rerank(body: RerankRequest, request: Request, ctx: ServingContext):
    check_pooling_model(ctx, "/v1/rerank")
    model = ctx.check_model(body.model)
    check_text_fields(body)
    if not body.documents:
        raise OpenAIError(400, "documents is empty", param="documents")
    scores, tokens = await _scores(ctx, request, [body.query] * len(body.documents), body.documents)
    if not isinstance(scores, list):
        return scores
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n is not None:
        ranked = ranked[:body.top_n]
    results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]} for i in ranked]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
                         "results": results})


async def _scores(ctx: ServingContext, request: Request, first: list[str], second: list[str]):
    unique = unique_texts(first, second)
    vectors, tokens = await embed_texts(ctx, request, "score", unique, PoolingParams(), "text_1")
    if not isinstance(vectors, list):
        return vectors, 0
    return pair_scores(first, second, dict(zip(unique, vectors))), tokens
