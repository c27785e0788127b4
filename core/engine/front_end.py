"""The front end's request tables over an engine core: what was added and not yet acknowledged, each request's text
state (``OutputProcessor``: detokenizing, stop strings), and what each message from the core means for them.

One class serves both front ends, ``sync_client.SyncEngineClient`` (for ``LLM``) and ``async_llm.AsyncLLMEngine``
(for the server). It is not thread-safe: its owner calls it from one thread at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from pagedllm.engine.core_client import CoreClient, core_error
from pagedllm.engine.messages import Abort, Add, Added, AddRequest, CoreExited, Dead, Step, StopSequence
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

PromptSpec = tuple[str, "str | None", list[int], SamplingParams]  # (request id, text, token ids, params)


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

    def tracks(self, request_id: str) -> bool:
        return request_id in self.outputs or any(request_id == p[0] for add in self._pending.values()
                                                 for p in add.prompts)

    @property
    def requests_tracked(self) -> int:
        """Requests in the tables (pending adds included); above 0 when idle means a leak."""
        return self.outputs.num_requests + sum(len(add.prompts) for add in self._pending.values())

    def pending_contexts(self) -> list[Any]:
        return [add.context for add in self._pending.values()]

    def add(self, prompts: list[PromptSpec], arrival_time: float, context: Any = None) -> None:
        """Send prompts (already tokenized) to the core, all or none; the answer comes back as an ``AddDone``."""
        add_id = next(self._add_ids)
        self._pending[add_id] = _PendingAdd(prompts, arrival_time, context)
        self.client.send(Add(add_id, [core_request(rid, ids, params, arrival_time) for rid, _, ids, params in prompts]))

    def abort(self, request_ids: list[str]) -> None:
        """Forget requests now (later outputs for them are dropped) and tell the core; unknown ids are ignored."""
        self.outputs.abort(request_ids)
        for add in self._pending.values():
            add.aborted.update(set(request_ids).intersection(p[0] for p in add.prompts))
        self.client.send(Abort(list(request_ids)))

    def handle(self, message) -> StepDone | AddDone | CoreEnded:
        if isinstance(message, Step):
            self.stats = message.stats
            outputs, stops = self.outputs.process(message.outputs, message.time)
            for request_id, index in stops:
                self.client.send(StopSequence(request_id, index))
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
        self.outputs.abort(list(self.outputs.request_ids()))

    def _added(self, message: Added) -> AddDone:
        add = self._pending.pop(message.add_id)
        if message.error_type is not None:
            return AddDone(add.context, core_error(message.error_type, message.message, message.param), [])
        accepted = []
        for request_id, text, token_ids, params in add.prompts:
            if request_id not in add.aborted:
                self.outputs.add(request_id, text, token_ids, params, add.arrival_time)
                accepted.append(request_id)
        return AddDone(add.context, None, accepted)


def core_request(request_id: str, token_ids: list[int], params: SamplingParams, arrival_time: float) -> AddRequest:
    """What the core gets of a request: no stop strings and no text (both are the front end's)."""
    core_params = dataclasses.replace(params, stop=None, detokenize=False) if params.stop or params.detokenize \
        else params
    return AddRequest(request_id, token_ids, core_params, arrival_time)
