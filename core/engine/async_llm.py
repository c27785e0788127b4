"""An asyncio front to an engine core that runs in a process of its own (``engine_process=True``, what ``pagedllm
serve`` uses) or on a thread of this one.

Callers on an event loop hand adds and aborts to the core through its client (``core_client``); a receiving thread
of this process takes the core's messages, makes each output's text (``front_end.FrontEnd``: detokenizing, stop
strings) and routes outputs back through per-caller asyncio queues with ``call_soon_threadsafe``, so one engine serves
several event loops and a step never blocks the event loop. One lock guards the request tables, which the callers'
threads and the receiving thread share. With a core process, HTTP work and steps do not share a GIL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Sequence

from pagedllm.backend import ModelInfo
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core_client import make_core_client
from pagedllm.engine.front_end import AddDone, CoreEnded, FrontEnd
from pagedllm.engine.input_processing import PromptType, needs_tokenizing, tokenize_prompt
from pagedllm.engine.stats import EngineStats
from pagedllm.errors import client_message
from pagedllm.models.source import ModelSource, load_tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.engine.async_llm")

RequestSpec = tuple[str, PromptType, SamplingParams]  # (request id, prompt, sampling params)


class EngineDeadError(RuntimeError):
    """The engine has stopped (too many steps in a row failed, its process died, or it was shut down): no request
    can be served."""


class RequestFailedError(RuntimeError):
    """The engine step running this request raised: the request ended there; the engine serves the others."""


@dataclasses.dataclass
class StepLatencies:
    """What one step tells about request latencies, for metrics; handed to ``on_step`` on the receiving thread."""

    time_to_first_token: list[float]  # seconds from arrival, for requests that got their first token
    inter_token_latency: list[float]  # seconds since the request's previous output, for the others
    finished: list[RequestOutput]  # requests that finished in this step


class OutputStream:
    """Outputs of requests added together, in the order the engine produced them; ends when all have finished.

    Leaving ``async with`` early, or calling ``abort()``, aborts the unfinished ones (their KV blocks are freed
    before the next step).
    """

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if item.error is not None:
                raise RequestFailedError(item.error)
        return item

    def abort(self) -> None:
        """Abort what has not finished; safe to call more than once."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()

    async def __aenter__(self) -> "OutputStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()


@dataclasses.dataclass
class _Route:
    """Where a request's outputs go."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_output_time: float | None = None
    snapshot: bool = False  # hand out copies of the growing token lists (the caller may read outputs late)


@dataclasses.dataclass
class _Add:
    """An add waiting for the core's answer: whom to tell."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    done: asyncio.Future
    snapshot: bool = False


class AsyncLLMEngine:
    """Serves an engine to asyncio callers: in an engine-core process (``engine_process=True``) or on a thread.

    ``engine`` holds what is fixed once the engine is built (``config``, ``model_info``, ``source``); live counters
    are in ``stats``. ``on_step``, if set, is called on the receiving thread with each step's ``StepLatencies``; it
    must be thread-safe and quick. ``on_dead``, if set, is called once, on that thread, if the engine dies other than
    by ``shutdown``.
    """

    def __init__(self, args: EngineArgs | None = None,
                 on_step: Callable[[StepLatencies], None] | None = None, engine_process: bool = False,
                 place_front_end: bool = True) -> None:
        """``place_front_end``: move this process off the core's CPUs (a data-parallel front does it once for
        all its replicas instead)."""
        self.on_step = on_step
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._client = make_core_client(args or EngineArgs(), engine_process)
        if engine_process and place_front_end:
            self._client.place_front_end()
        ready = self._client.ready
        self.engine = EngineDescription(ready.config, ready.model_info, ready.source)
        self.stats: EngineStats = ready.stats  # the engine's latest snapshot, as of its latest step
        self._lock = threading.Lock()  # guards what follows, shared by the callers' threads and the receiver
        self._front = FrontEnd(self._client, load_tokenizer(ready.source))
        self._routes: dict[str, _Route] = {}
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._last_progress = time.monotonic()  # the core's latest message, or when work began after idling
        self._receiver = threading.Thread(target=self._receive, name="pagedllm-front-end", daemon=True)
        self._receiver.start()

    # -- the callers' side ------------------------------------------------------------------------------------
    async def add(self, requests: Sequence[RequestSpec], arrival_time: float | None = None,
                  priority: int = 0, snapshot: bool = False) -> OutputStream:
        """Queue requests all or none: raises the first request's ``InvalidRequestError`` and queues nothing.
        ``priority`` (all of them) matters under the priority scheduling policy; with ``snapshot`` every output
        holds its own copy of the token ids and logprobs so far (they are the engine's growing lists otherwise)."""
        loop = asyncio.get_running_loop()
        stream = OutputStream(self, [request_id for request_id, _, _ in requests])
        prompts = []
        for request_id, prompt, params in requests:
            text, token_ids = tokenize_prompt(self._tokenizer if needs_tokenizing(prompt) else None, prompt)
            prompts.append((request_id, text, token_ids, params))
        done = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if not self._routes and not self._front.requests_tracked:
                self._last_progress = time.monotonic()  # the watch starts with the work, not at the last step
            self._front.add(prompts, arrival_time or time.time(), _Add(loop, stream._queue, done, snapshot),
                            priority)
        try:
            await done
        except asyncio.CancelledError:
            self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (from any thread); unknown or finished ids are ignored."""
        with self._lock:
            if self._dead is not None:
                return  # a dead engine has already ended every request
            for request_id in request_ids:
                self._routes.pop(request_id, None)
            self._front.abort(list(request_ids))

    @property
    def dead(self) -> EngineDeadError | None:
        return self._dead

    def stalled_for(self, bound: float) -> float | None:
        """Seconds since the core last said anything while requests are in flight, if more than ``bound`` (a step
        or a tensor-parallel collective that hangs); None otherwise."""
        with self._lock:
            busy = bool(self._routes) or self._front.requests_tracked > 0
            quiet = time.monotonic() - self._last_progress
        return quiet if busy and quiet > bound else None

    @property
    def requests_tracked(self) -> int:
        """Entries of this front's per-request tables (read from any thread); above 0 when idle means a leak."""
        with self._lock:
            return len(self._routes) + self._front.requests_tracked

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is in flight, shut the engine down and end its thread (and process)."""
        with self._lock:
            self._stopping = True
        self._client.stop(60.0 if timeout is None else timeout)
        self._receiver.join(10.0)

    @functools.cached_property
    def _tokenizer(self):
        """For prompts given as text (the server sends token ids): the callers' own, not the receiver's (a Hugging
        Face tokenizer must not be shared between threads)."""
        return load_tokenizer(self.engine.source)

    # -- the receiving thread ---------------------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            error = self._serve_messages()
        except Exception as exc:  # its death is the engine's: nothing would answer the requests in flight
            logger.exception("the front end's receiving thread failed")
            with self._lock:
                error = self._die(CoreEnded(f"the front end failed: {client_message(exc)}"))
            self._client.stop(10.0)
        self._client.close()
        if not self._stopping and self.on_dead is not None:
            try:
                self.on_dead(error)
            except Exception:
                logger.exception("on_dead failed")

    def _serve_messages(self) -> EngineDeadError:
        """Handle the core's messages until it ends; the error later submissions get."""
        while True:
            message = self._client.receive()
            with self._lock:
                self._last_progress = time.monotonic()
                event = self._front.handle(message)
                if isinstance(event, CoreEnded):
                    return self._die(event)
                if isinstance(event, AddDone):
                    self._added(event)
                    continue
                self.stats = event.stats  # counters first: a client that has its output sees them updated
                deliveries, latencies = self._route(event.outputs, event.time)
            on_step = self.on_step
            if on_step is not None and event.outputs:  # before the outputs: a caller that has them sees the metrics
                try:
                    on_step(latencies)
                except Exception:
                    logger.exception("on_step failed; the step's outputs are delivered all the same")
            for loop, items in deliveries.items():
                _call_soon(loop, _deliver, items)

    def _added(self, event: AddDone) -> None:
        add: _Add = event.context
        for request_id in event.accepted:
            self._routes[request_id] = _Route(add.loop, add.queue, snapshot=add.snapshot)
        _resolve(add.loop, add.done, event.error)

    def _route(self, outputs: list[RequestOutput], now: float):
        """Group outputs by the event loop that waits for them, with the step's latencies for ``on_step``."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        latencies = StepLatencies([], [], [])
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            if route.snapshot:
                for completion in output.outputs:
                    completion.token_ids = list(completion.token_ids)
                    if completion.logprobs is not None:
                        completion.logprobs = list(completion.logprobs)
            deliveries.setdefault(route.loop, []).append((route.queue, output))
            metrics = output.metrics
            if route.last_output_time is None and metrics.first_token_time is not None:
                latencies.time_to_first_token.append(metrics.first_token_time - metrics.arrival_time)
            elif route.last_output_time is not None:
                latencies.inter_token_latency.append(now - route.last_output_time)
            route.last_output_time = now
            if output.finished:
                latencies.finished.append(output)
                del self._routes[output.request_id]
        return deliveries, latencies

    def _die(self, event: CoreEnded) -> EngineDeadError:
        """End every request and pending add; later submissions raise the error, which is returned."""
        if self._stopping:
            error = EngineDeadError("the engine was shut down")
        else:
            error = EngineDeadError(event.message)
            logger.error("%s; no further request can be served", error)
        self._dead = error
        for add in self._front.pending_contexts():
            _resolve(add.loop, add.done, error)
        for route in self._routes.values():
            _call_soon(route.loop, _deliver, [(route.queue, error)])
        self._routes.clear()
        self._front.clear()
        return error


@dataclasses.dataclass(frozen=True)
class EngineDescription:
    """What the server reads of an engine that runs in another process."""

    config: EngineConfig
    model_info: ModelInfo
    source: ModelSource


def _deliver(items) -> None:
    for q, item in items:
        q.put_nowait(item)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():  # the caller was cancelled; add() aborts what it queued
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    _call_soon(loop, settle)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass


class AsyncLLM:
    """vLLM's asyncio API over ``AsyncLLMEngine``: ``generate(prompt, sampling_params, request_id)`` is an async
    iterator of the request's outputs (cumulative text and token ids, as vLLM's default output kind, each output a
    snapshot); leaving it early aborts the request. The engine core runs in a process of its own, as in
    ``pagedllm serve``."""

    def __init__(self, args: EngineArgs | None = None, engine_process: bool = True) -> None:
        self.engine = AsyncLLMEngine(args, engine_process=engine_process)
        self.model_config = self.engine.engine  # config, model_info, source

    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, engine_process: bool = True) -> "AsyncLLM":
        return cls(args, engine_process)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str,
                       priority: int = 0):
        stream = await self.engine.add([(request_id, prompt, sampling_params or SamplingParams())],
                                       priority=priority, snapshot=True)
        async with stream:
            async for output in stream:
                yield output

    async def abort(self, request_id: str | Sequence[str]) -> None:
        self.engine.abort([request_id] if isinstance(request_id, str) else list(request_id))

    async def get_tokenizer(self):
        return self.engine._tokenizer

    @property
    def errored(self) -> bool:
        return self.engine.dead is not None

    def shutdown(self) -> None:
        self.engine.shutdown()
