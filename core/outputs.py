"""What the engine hands back: one ``RequestOutput`` per request that made progress in a step."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass
class Logprob:
    """One token's log probability, as vLLM's: ``rank`` is its place in the distribution (1 = most likely),
    ``decoded_token`` its text (None when the request does not detokenize)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token id: Logprob} for the token there and the top alternatives asked for.
PositionLogprobs = dict[int, Logprob]


def position_logprobs(token_id: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float],
                      decode: Callable[[int], str] | None = None) -> PositionLogprobs:
    """The entry of one position: the token there first, then the top alternatives by rank."""
    entry = {token_id: Logprob(logprob, rank, decode(token_id) if decode else None)}
    for i, (t, lp) in enumerate(zip(top_ids, top_logprobs)):
        if t not in entry:
            entry[t] = Logprob(lp, i + 1, decode(t) if decode else None)
    return entry


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence. ``text``/``token_ids`` are cumulative; ``delta_*`` hold this step's part."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None  # per generated token
    delta_logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when a step running this request failed: it ended there (its outputs hold what it made before).
    error: str | None = None
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first, which nothing predicts); set from
    # the output that carries the first generated token on.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    embedding: list[float] | None = None  # a pooling request's vector (it has no completions)

    # The first completion's fields, for the common n=1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's: one prompt's embedding, ``outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """vLLM's: one pair's score, ``outputs.score``."""

    request_id: str
    prompt_token_ids: list[int]  # the second text's (the first is shared or paired)
    outputs: ScoringOutput
    finished: bool = True
