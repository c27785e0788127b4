"""The engine's interface as ``LLM`` uses it, and its two implementations: ``LLMEngine`` itself (in this process,
the default) and ``SyncEngineClient``, the same methods over an engine-core process (``LLM(engine_process=True)``:
scheduler and model there, detokenizing and stop strings here)."""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Protocol

from pagedllm.config import EngineArgs
from pagedllm.engine.core_client import ProcessCoreClient
from pagedllm.engine.front_end import AddDone, CoreEnded, FrontEnd, StepDone
from pagedllm.engine.input_processing import PromptType, tokenize_prompt
from pagedllm.engine.stats import EngineStats
from pagedllm.models.source import load_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class EngineClient(Protocol):
    """What ``LLM`` calls: add requests, step until none is left, abort."""

    tokenizer: object

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str: ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def release_thread(self) -> None: ...

    def shutdown(self) -> None: ...


def make_engine_client(args: EngineArgs, engine_process: bool) -> EngineClient:
    if engine_process:
        return SyncEngineClient(args)
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(args)


class SyncEngineClient:
    """``LLMEngine``'s methods over an engine-core process. An add the core refuses (a constraint that does not
    compile) raises from the next ``step``."""

    def __init__(self, args: EngineArgs) -> None:
        self.core = ProcessCoreClient(args)
        ready = self.core.ready
        self.config, self.model_info, self.source = ready.config, ready.model_info, ready.source
        self.tokenizer = load_tokenizer(self.source)
        self.front = FrontEnd(self.core, self.tokenizer)
        self._ids = itertools.count()

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        self.front.add([(request_id, text, token_ids, params)], time.time() if arrival_time is None else arrival_time,
                       priority=priority)
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        self.front.abort([request_ids] if isinstance(request_ids, str) else list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.front.requests_tracked > 0

    def get_num_unfinished_requests(self) -> int:
        return self.front.requests_tracked

    def step(self) -> list[RequestOutput]:
        """Wait for the core's next step and return its outputs, as ``LLMEngine.step`` does."""
        while True:
            event = self.front.handle(self.core.receive())
            if isinstance(event, StepDone):
                return event.outputs
            if isinstance(event, AddDone) and event.error is not None:
                raise event.error
            if isinstance(event, CoreEnded):
                self.front.clear()
                raise RuntimeError(event.message)

    def stats(self) -> EngineStats:
        return self.front.stats

    def release_thread(self) -> None:
        """Nothing to release: the core's threads are its own."""

    def shutdown(self) -> None:
        self.core.stop(timeout=60.0)
        self.core.close()
