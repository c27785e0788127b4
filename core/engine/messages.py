"""What the front end and the engine-core process say to each other: msgspec structs, sent as MessagePack over ZMQ.

Front end -> core: ``Add`` (prompts already tokenized), ``Abort``, ``StopSequence`` (a stop string the front end
found), ``Shutdown``. Core -> front end: ``Ready`` or ``Failed`` once, then ``Step``s (outputs of one step with the
engine's stats snapshot) and ``Added`` acknowledgements, then ``Dead`` if the engine fails. Outputs carry only what a
step adds (token, logprobs, finish); the front end keeps the cumulative state and the text. A core on a thread of
the front end's process gets and sends the same structs, unencoded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Union

import msgspec

from pagedllm.backend import ModelInfo
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.stats import EngineStats
from pagedllm.models.source import ModelSource
from pagedllm.outputs import Logprob
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings left to the front end, detokenize off
    arrival_time: float
    priority: int = 0
    pooling: PoolingParams | None = None  # a pooling request (``params`` unused)


class Add(msgspec.Struct, tag=True, array_like=True):
    """Requests added all or none; answered by one ``Added`` with the same ``add_id``."""

    add_id: int
    requests: list[AddRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopSequence(msgspec.Struct, tag=True, array_like=True):
    """Sequence ``index`` of a request hit a stop string: end it as stopped (its siblings go on)."""

    request_id: str
    index: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Start(msgspec.Struct, tag=True, array_like=True):
    """The first message: what engine to build."""

    args: EngineArgs


FrontEndMessage = Union[Start, Add, Abort, StopSequence, Shutdown]


class SequenceDelta(msgspec.Struct, array_like=True):
    index: int
    token_id: int
    logprobs: dict[int, Logprob] | None  # the sampled token's and the top ones' when logprobs were asked
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    sequences: list[SequenceDelta]
    first_scheduled_time: float | None
    first_token_time: float | None
    error: str | None = None  # the step running it failed: it ended (no sequences)
    # with the first generated token, when prompt logprobs were asked
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # a pooling request's vector (it has no sequences)


class Ready(msgspec.Struct, tag=True, array_like=True):
    config: EngineConfig
    model_info: ModelInfo
    source: ModelSource
    eos_token_ids: list[int]
    bound_cpus: list[int] | None  # where the backend's threads run, if pinned
    stats: EngineStats


class Failed(msgspec.Struct, tag=True, array_like=True):
    """Building the engine raised: the error's class name (from ``pagedllm.errors``, else RuntimeError) and text."""

    error_type: str
    message: str


class Added(msgspec.Struct, tag=True, array_like=True):
    add_id: int
    error_type: str | None = None
    message: str = ""
    param: str | None = None


class Step(msgspec.Struct, tag=True, array_like=True):
    time: float  # when the step's tokens were sampled
    outputs: list[RequestDelta]
    stats: EngineStats


class Dead(msgspec.Struct, tag=True, array_like=True):
    message: str


CoreMessage = Union[Ready, Failed, Added, Step, Dead]


@dataclasses.dataclass(frozen=True)
class CoreExited:
    """The last thing a core client's ``receive`` returns: the core (process or thread) has ended and everything it
    sent has been read. Never encoded: the client makes it."""

    returncode: int


def _enc_hook(obj):
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot send a {type(obj).__name__}")


def _dec_hook(type_, obj):
    if type_ is Path:
        return Path(obj)
    raise NotImplementedError(f"cannot receive a {type_}")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def front_end_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the front end sends (used by the core)."""
    return msgspec.msgpack.Decoder(FrontEndMessage, dec_hook=_dec_hook)


def core_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the core sends (used by the front end)."""
    return msgspec.msgpack.Decoder(CoreMessage, dec_hook=_dec_hook)
