"""An asyncio front to the synchronous ``LLMEngine``, whose step loop runs on a thread of its own.

The engine is not thread-safe, so every engine call (construction, add, abort, step, shutdown) happens on that one
thread. Callers on an event loop hand adds and aborts over through a thread-safe queue; the thread applies them
between steps and sends outputs back through per-caller asyncio queues with ``call_soon_threadsafe``. HTTP work
therefore never stalls a step and a step never blocks the event loop. With no work the thread sleeps on an event.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from pagedllm.config import EngineArgs
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.stats import EngineStats, StatsLogger

logger = logging.getLogger("pagedllm.async_engine")

RequestSpec = tuple[str, PromptType, SamplingParams]  # (request id, prompt, sampling params)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (a step failed, or it was shut down): no request can be served."""


@dataclasses.dataclass
class StepLatencies:
    """What one step tells about request latencies, for metrics; handed to ``on_step`` on the engine thread."""

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
    """Where a request's outputs go (engine thread only)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    last_output_time: float | None = None


@dataclasses.dataclass
class _Add:
    requests: list[RequestSpec]
    arrival_time: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    done: asyncio.Future


@dataclasses.dataclass
class _Abort:
    request_ids: list[str]


class _Stop:
    pass


class AsyncLLMEngine:
    """Builds an ``LLMEngine`` on its own thread and serves it to asyncio callers.

    ``engine`` may be read from other threads only for what is fixed once it is built (``config``, ``model_info``,
    ``source``); live counters are in ``stats``. ``on_step``, if set, is called on the engine thread with the
    step's ``StepLatencies``; it must be thread-safe and quick.
    """

    def __init__(self, args: EngineArgs | None = None,
                 on_step: Callable[[StepLatencies], None] | None = None) -> None:
        self.on_step = on_step
        self.stats = EngineStats()  # the engine's latest snapshot, taken on its thread after each step
        self._stats_log = StatsLogger(logger)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # orders _submit against the thread's death
        self._dead: EngineDeadError | None = None
        self._routes: dict[str, _Route] = {}
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(args or EngineArgs(), ready),
                                        name="pagedllm-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = ready.result()  # re-raises what the construction raised

    # -- the event-loop side --------------------------------------------------------------------
    async def add(self, requests: Sequence[RequestSpec], arrival_time: float | None = None) -> OutputStream:
        """Queue requests all or none: raises the first request's ``InvalidRequestError`` and queues nothing."""
        loop = asyncio.get_running_loop()
        stream = OutputStream(self, [request_id for request_id, _, _ in requests])
        done = loop.create_future()
        self._submit(_Add(list(requests), arrival_time or time.time(), loop, stream._queue, done))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (from any thread); unknown or finished ids are ignored."""
        try:
            self._submit(_Abort(list(request_ids)))
        except EngineDeadError:
            pass  # a dead engine has already ended every request

    @property
    def dead(self) -> EngineDeadError | None:
        return self._dead

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is in flight, shut the backend down and end the thread."""
        if self._thread.is_alive():
            with self._lock:
                self._commands.put(_Stop())
                self._wake.set()
            self._thread.join(timeout)

    def _submit(self, command) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._commands.put(command)
            self._wake.set()

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self, args: EngineArgs, ready: concurrent.futures.Future) -> None:
        try:
            engine = LLMEngine.from_engine_args(args, serving=True)  # backends may leave a core to the event loop
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(engine)
        try:
            self._loop(engine)
        except Exception as exc:
            logger.exception("the engine failed; no further request can be served")
            self._die(engine, EngineDeadError(f"the engine failed: {exc!r}"))
        finally:
            engine.shutdown()

    def _loop(self, engine: LLMEngine) -> None:
        while True:
            self._wake.clear()  # before draining: a command queued after this point sets it again
            if not self._apply_commands(engine):
                return
            if not engine.has_unfinished_requests():
                self._publish(engine)
                self._wake.wait()
                continue
            deliveries = self._route(engine.step(), time.time())
            self._publish(engine)  # counters first: a client that has its output sees them updated
            for loop, items in deliveries.items():
                _call_soon(loop, _deliver, items)

    def _apply_commands(self, engine: LLMEngine) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if isinstance(command, _Add):
                self._add(engine, command)
            elif isinstance(command, _Abort):
                engine.abort_request(command.request_ids)
                for request_id in command.request_ids:
                    self._routes.pop(request_id, None)
            else:
                self._die(engine, EngineDeadError("the engine was shut down"))
                return False

    def _add(self, engine: LLMEngine, command: _Add) -> None:
        added: list[str] = []
        try:
            for request_id, prompt, params in command.requests:
                engine.add_request(request_id, prompt, params, arrival_time=command.arrival_time)
                added.append(request_id)
        except Exception as exc:
            engine.abort_request(added)
            _resolve(command.loop, command.done, exc)
            return
        for request_id in added:
            self._routes[request_id] = _Route(command.loop, command.queue)
        _resolve(command.loop, command.done, None)

    def _route(self, outputs: list[RequestOutput], now: float) -> dict[asyncio.AbstractEventLoop, list]:
        """Group outputs by the event loop that waits for them, and hand the step's latencies to ``on_step``."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}
        latencies = StepLatencies([], [], [])
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
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
        if self.on_step is not None:
            try:
                self.on_step(latencies)
            except Exception:
                logger.exception("on_step failed; the step's outputs are delivered all the same")
        return deliveries

    def _publish(self, engine: LLMEngine) -> None:
        self.stats = engine.stats()
        self._stats_log.observe(self.stats, time.monotonic())

    def _die(self, engine: LLMEngine, error: EngineDeadError) -> None:
        """End every request and pending add with ``error``; later submissions raise it."""
        with self._lock:
            self._dead = error
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _resolve(command.loop, command.done, error)
        request_ids = list(self._routes)
        for route in self._routes.values():
            _call_soon(route.loop, _deliver, [(route.queue, error)])
        self._routes.clear()
        try:  # after a failed step the engine may be broken: the callers above are told first
            engine.abort_request(request_ids)
            self._publish(engine)
        except Exception:
            logger.exception("could not abort the requests in flight")


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
