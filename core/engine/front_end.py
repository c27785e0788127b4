"""The front end's request tables over an engine core: what was added and not yet acknowledged, each request's text
state (``OutputProcessor``: detokenizing, stop strings), and what each message from the core means for them.

One class serves both front ends, ``sync_client.SyncEngineClient`` (for ``LLM``) and ``async_llm.AsyncLLMEngine``
(for the server). It is not thread-safe: its owner calls it from one thread at a time.

The core knows each request by an id of its own (the caller's id and a counter), so a caller may reuse an id as
soon as it has aborted the request: what the core sent for the old one before the abort reached it is dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from pagedllm.engine.core_client import CoreClient, core_error
from pagedllm.engine.messages import Abort, Add, Added, AddRequest, CoreExited, Dead, Step, StopSequence
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats
from pagedllm.errors import InvalidRequestError
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# (request id, text, token ids, params): sampling params, or pooling params for a pooling request
PromptSpec = tuple[str, "str | None", list[int], "SamplingParams | PoolingParams"]


@dataclasses.dataclass
class StepDone:
    """The core ran a step (or only its stats changed, with no outputs)."""

    outputs: list[RequestOutput]
    time: float
    stats: EngineStats


@dataclasses.dataclass
class AddDone:
    """The core answered an add: ``error`` if it refused it (nothing was kept), else the requests now tracked
    (those aborted meanwhile left out). ``context`` is what the caller passed to ``add``."""

    context: Any
    error: Exception | None
    accepted: list[str]


@dataclasses.dataclass
class CoreEnded:
    """The core has gone: ``message`` says why (the engine died, or the process exited)."""

    message: str
    returncode: int | None = None


@dataclasses.dataclass
class _PendingAdd:
    prompts: list[PromptSpec]
    core_ids: list[str]
    arrival_time: float
    context: Any
    aborted: set[str] = dataclasses.field(default_factory=set)


class FrontEnd:
    def __init__(self, client: CoreClient, tokenizer) -> None:
        self.client = client
        ready = client.ready
        self.eos_token_ids = frozenset(ready.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids)
        self.stats: EngineStats = ready.stats  # the core's latest snapshot
        self._add_ids = itertools.count()
        self._pending: dict[int, _PendingAdd] = {}  # add id -> the add, until the core answers it
        self._core_ids: dict[str, str] = {}  # caller's request id -> the core's, while the request is tracked
        self._counter = itertools.count()

    def tracks(self, request_id: str) -> bool:
        return request_id in self._core_ids

    @property
    def requests_tracked(self) -> int:
        """Requests in the tables (pending adds included); above 0 when idle means a leak."""
        return self.outputs.num_requests + sum(len(add.prompts) for add in self._pending.values())

    def pending_contexts(self) -> list[Any]:
        return [add.context for add in self._pending.values()]

    def add(self, prompts: list[PromptSpec], arrival_time: float, context: Any = None, priority: int = 0) -> None:
        """Send prompts (already tokenized) to the core, all or none; the answer comes back as an ``AddDone``."""
        config = self.client.ready.config
        for _, _, _, params in prompts:  # the core never sees stop strings: their bound is checked here
            if isinstance(params, SamplingParams) and len(params.stop) > config.max_stop_strings:
                raise InvalidRequestError(f"stop has {len(params.stop)} entries, more than the "
                                          f"{config.max_stop_strings} allowed (--max-stop-strings)", param="stop")
        ids = [rid for rid, _, _, _ in prompts]
        for rid in ids:
            if rid in self._core_ids or ids.count(rid) > 1:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        core_ids = [f"{rid}#{next(self._counter)}" for rid in ids]
        add_id = next(self._add_ids)
        message = Add(add_id, [core_request(core_id, token_ids, params, arrival_time, priority)
                               for core_id, (_, _, token_ids, params) in zip(core_ids, prompts)])
        try:
            self.client.send(message)
        except Exception as exc:  # a value the engine's messages cannot carry: refused before it is tracked
            raise InvalidRequestError(f"the request cannot be passed to the engine: {exc}") from None
        self._pending[add_id] = _PendingAdd(prompts, core_ids, arrival_time, context)
        self._core_ids.update(zip(ids, core_ids))

    def abort(self, request_ids: list[str]) -> None:
        """Forget requests now (later outputs for them are dropped) and tell the core; unknown ids are ignored."""
        core_ids = [self._core_ids.pop(rid) for rid in request_ids if rid in self._core_ids]
        if not core_ids:
            return
        self.outputs.abort(core_ids)
        for add in self._pending.values():
            add.aborted.update(set(core_ids).intersection(add.core_ids))
        self.client.send(Abort(core_ids))

    def handle(self, message) -> StepDone | AddDone | CoreEnded:
        if isinstance(message, Step):
            self.stats = message.stats
            outputs, stops = self.outputs.process(message.outputs, message.time)
            for core_id, index in stops:
                self.client.send(StopSequence(core_id, index))
            for output in outputs:
                if output.finished:
                    del self._core_ids[output.request_id]
            return StepDone(outputs, message.time, message.stats)
        if isinstance(message, Added):
            return self._added(message)
        if isinstance(message, Dead):
            return CoreEnded(message.message)
        if isinstance(message, CoreExited):
            return CoreEnded(f"the engine core process exited unexpectedly (exit code {message.returncode})",
                             message.returncode)
        raise TypeError(f"unexpected message from the engine core: {type(message).__name__}")

    def clear(self) -> None:
        """Forget everything (the core is gone)."""
        self._pending.clear()
        self._core_ids.clear()
        self.outputs.abort(list(self.outputs.request_ids()))

    def _added(self, message: Added) -> AddDone:
        add = self._pending.pop(message.add_id)
        if message.error_type is not None:
            for (request_id, _, _, _), core_id in zip(add.prompts, add.core_ids):
                if self._core_ids.get(request_id) == core_id:
                    del self._core_ids[request_id]
            return AddDone(add.context, core_error(message.error_type, message.message, message.param), [])
        accepted = []
        for (request_id, text, token_ids, params), core_id in zip(add.prompts, add.core_ids):
            if core_id not in add.aborted:
                self.outputs.add(core_id, text, token_ids, params, add.arrival_time, output_id=request_id)
                accepted.append(request_id)
        return AddDone(add.context, None, accepted)


def core_request(request_id: str, token_ids: list[int], params: SamplingParams | PoolingParams, arrival_time: float,
                 priority: int = 0) -> AddRequest:
    """What the core gets of a request: no stop strings and no text (both are the front end's)."""
    if isinstance(params, PoolingParams):
        return AddRequest(request_id, token_ids, _NO_SAMPLING, arrival_time, priority, pooling=params)
    core_params = dataclasses.replace(params, stop=None, detokenize=False) if params.stop or params.detokenize \
        else params
    return AddRequest(request_id, token_ids, core_params, arrival_time, priority)


_NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)  # what a pooling request's unused params say
