"""An asyncio front to the synchronous ``LLMEngine``: its step loop runs on a thread of its own, or in an engine-core
process of its own (``engine_process=True``, what ``pagedllm serve`` uses).

The engine is not thread-safe, so every engine call happens on one thread. Callers on an event loop hand adds and
aborts over (through a queue to the engine thread, or over ZMQ to the core process); outputs come back through
per-caller asyncio queues with ``call_soon_threadsafe``, so one engine serves several event loops. A step never
blocks the event loop. In a thread, HTTP work and steps share this process's GIL; with a core process they do not,
and the text of each output (detokenizing, stop strings) is made here, by the thread that receives the core's steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Sequence

from pagedllm.backend import ModelInfo
from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core_client import EngineCoreProcess, core_error, core_request
from pagedllm.core_messages import Abort, Add, Added, Dead, Shutdown, Step, StopSequence
from pagedllm.engine import LLMEngine, PromptType, tokenize_prompt
from pagedllm.model_source import ModelSource, load_tokenizer
from pagedllm.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.stats import EngineStats, StatsLogger

logger = logging.getLogger("pagedllm.async_engine")

RequestSpec = tuple[str, PromptType, SamplingParams]  # (request id, prompt, sampling params)


class EngineDeadError(RuntimeError):
    """The engine has stopped (too many steps in a row failed, its process died, or it was shut down): no request
    can be served."""


class RequestFailedError(RuntimeError):
    """The engine step running this request raised: the request ended there; the engine serves the others."""


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
    """Serves an engine to asyncio callers: built on a thread of its own (default), or in an engine-core process
    (``engine_process=True``: scheduler and model in another process, detokenizing and stop strings here).

    ``engine`` may be read from other threads only for what is fixed once it is built (``config``, ``model_info``,
    ``source``); live counters are in ``stats``. ``on_step``, if set, is called on the thread that receives steps
    with the step's ``StepLatencies``; it must be thread-safe and quick. ``on_dead``, if set, is called once, on that
    thread, if the engine dies other than by ``shutdown``.
    """

    def __init__(self, args: EngineArgs | None = None,
                 on_step: Callable[[StepLatencies], None] | None = None, engine_process: bool = False) -> None:
        self.on_step = on_step
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self.stats = EngineStats()  # the engine's latest snapshot, as of its latest step
        self._lock = threading.Lock()  # orders submissions against the engine's death
        self._dead: EngineDeadError | None = None
        self._routes: dict[str, _Route] = {}  # the receiving thread's only
        self._core = (_ProcessCore if engine_process else _ThreadCore)(args or EngineArgs(), self)
        self.engine = self._core.engine  # an LLMEngine, or for a core process what is fixed of it

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

    @property
    def requests_tracked(self) -> int:
        """Entries of this front's per-request tables (read from any thread); above 0 when idle means a leak."""
        return len(self._routes) + self._core.requests_tracked

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort what is in flight, shut the engine down and end its thread (and process)."""
        self._core.stop(timeout)

    def _submit(self, command) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._core.submit(command)

    # -- the receiving thread ---------------------------------------------------------------------
    def _accept(self, command: "_Add", aborted: set[str] = frozenset()) -> None:
        for request_id, _, _ in command.requests:
            if request_id not in aborted:
                self._routes[request_id] = _Route(command.loop, command.queue)
        _resolve(command.loop, command.done, None)

    def _publish_step(self, outputs: list[RequestOutput], now: float, stats: EngineStats) -> None:
        deliveries = self._route(outputs, now)
        self.stats = stats  # counters first: a client that has its output sees them updated
        for loop, items in deliveries.items():
            _call_soon(loop, _deliver, items)

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
        if self.on_step is not None and outputs:
            try:
                self.on_step(latencies)
            except Exception:
                logger.exception("on_step failed; the step's outputs are delivered all the same")
        return deliveries

    def _die(self, error: EngineDeadError, pending: list["_Add"], expected: bool) -> list[str]:
        """End every request and pending add with ``error``; later submissions raise it. Returns the ids that were
        in flight. ``expected``: by ``shutdown`` (``on_dead`` is not called)."""
        with self._lock:
            self._dead = error
        for command in pending:
            _resolve(command.loop, command.done, error)
        request_ids = list(self._routes)
        for route in self._routes.values():
            _call_soon(route.loop, _deliver, [(route.queue, error)])
        self._routes.clear()
        if not expected and self.on_dead is not None:
            try:
                self.on_dead(error)
            except Exception:
                logger.exception("on_dead failed")
        return request_ids


class _ThreadCore:
    """The engine on a thread of this process: commands through a queue, applied between steps."""

    def __init__(self, args: EngineArgs, front: AsyncLLMEngine) -> None:
        self.front = front
        self._stats_log = StatsLogger(logger)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(args, ready), name="pagedllm-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = ready.result()  # re-raises what the construction raised

    requests_tracked = 0  # the engine's tables are in its stats

    def submit(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    def stop(self, timeout: float | None) -> None:
        if self._thread.is_alive():
            with self.front._lock:
                self.submit(_Stop())
            self._thread.join(timeout)

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
            self._die(engine, EngineDeadError(f"the engine failed: {exc!r}"), expected=False)
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
            outputs = engine.step()
            self.front._publish_step(outputs, time.time(), engine.stats())
            self._stats_log.observe(self.front.stats, time.monotonic())

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
                    self.front._routes.pop(request_id, None)
            else:
                self._die(engine, EngineDeadError("the engine was shut down"), expected=True)
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
        self.front._accept(command)

    def _publish(self, engine: LLMEngine) -> None:
        self.front.stats = engine.stats()
        self._stats_log.observe(self.front.stats, time.monotonic())

    def _die(self, engine: LLMEngine, error: EngineDeadError, expected: bool) -> None:
        with self.front._lock:  # nothing is queued behind the adds collected here
            self.front._dead = error
        pending = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                pending.append(command)
        request_ids = self.front._die(error, pending, expected)
        try:  # after a failed step the engine may be broken: the callers above are told first
            engine.abort_request(request_ids)
            self._publish(engine)
        except Exception:
            logger.exception("could not abort the requests in flight")


class _ProcessCore:
    """The engine in an engine-core process. Commands are sent as they come (from any thread); a thread of this
    process receives the core's messages, detokenizes and checks stop strings (``OutputProcessor``) and routes the
    outputs. Local state (routes, the processor) is that thread's only: aborts reach it through a queue."""

    def __init__(self, args: EngineArgs, front: AsyncLLMEngine) -> None:
        self.front = front
        self.process = EngineCoreProcess(args)
        self.process.place_front_end()
        ready = self.process.ready
        self.engine = EngineDescription(ready.config, ready.model_info, ready.source)
        front.stats = ready.stats
        self.outputs = OutputProcessor(load_tokenizer(ready.source), frozenset(ready.eos_token_ids))
        self._add_ids = itertools.count()
        self._pending: dict[int, tuple[_Add, list]] = {}  # add id -> (command, its token ids), until acknowledged
        self._aborted: queue.SimpleQueue = queue.SimpleQueue()  # request ids, from the callers' threads
        self._aborted_early: set[str] = set()  # aborted before the core acknowledged their add
        self._stopping = False
        self._thread = threading.Thread(target=self._receive, name="pagedllm-front-end", daemon=True)
        self._thread.start()

    @property
    def requests_tracked(self) -> int:
        return self.outputs.num_requests + len(self._pending)

    def submit(self, command) -> None:
        """Called under the front's lock, which orders it against ``_die``."""
        if isinstance(command, _Abort):
            self._aborted.put(command.request_ids)
            self.process.send(Abort(command.request_ids))
            return
        prompts = []
        requests = []
        for request_id, prompt, params in command.requests:
            text, token_ids = tokenize_prompt(self._tokenizer if _has_text_only(prompt) else None, prompt)
            prompts.append((text, token_ids))
            requests.append(core_request(request_id, token_ids, params, command.arrival_time))
        add_id = next(self._add_ids)
        self._pending[add_id] = (command, prompts)
        self.process.send(Add(add_id, requests))

    @functools.cached_property
    def _tokenizer(self):
        """For prompts given as text (the server sends token ids): a tokenizer of the callers' threads, not shared
        with the receiving thread's."""
        return load_tokenizer(self.process.ready.source)

    def stop(self, timeout: float | None) -> None:
        """Ask the core to stop; the receiving thread sees it exit, ends what was in flight and cleans up."""
        with self.front._lock:
            self._stopping = True
            if self.front._dead is None:
                self.process.send(Shutdown())
        self._thread.join(60.0 if timeout is None else timeout)
        if self._thread.is_alive():
            logger.warning("the engine core process did not stop; killing it")
            self.process.proc.kill()
            self._thread.join()

    def _receive(self) -> None:
        process, outputs = self.process, self.outputs
        while True:
            message = process.receive()
            self._drop_aborted()
            if isinstance(message, Step):
                results, stops = outputs.process(message.outputs, message.time)
                for request_id, index in stops:
                    process.send(StopSequence(request_id, index))
                self.front._publish_step(results, message.time, message.stats)
            elif isinstance(message, Added):
                self._added(message)
            else:
                self._die(message)
                return

    def _drop_aborted(self) -> None:
        """Forget aborted requests; those whose add the core has not acknowledged yet are kept from registering."""
        while not self._aborted.empty():
            request_ids = self._aborted.get()
            self.outputs.abort(request_ids)
            for request_id in request_ids:
                self.front._routes.pop(request_id, None)
            pending = {request_id for command, _ in self._pending.values() for request_id, _, _ in command.requests}
            self._aborted_early.update(pending.intersection(request_ids))

    def _added(self, message: Added) -> None:
        self._drop_aborted()  # while the add is still pending
        command, prompts = self._pending.pop(message.add_id)
        aborted = {request_id for request_id, _, _ in command.requests} & self._aborted_early
        self._aborted_early -= aborted
        if message.error_type is not None:
            _resolve(command.loop, command.done, core_error(message.error_type, message.message, message.param))
            return
        for (request_id, _, params), (text, token_ids) in zip(command.requests, prompts):
            if request_id not in aborted:
                self.outputs.add(request_id, text, token_ids, params, command.arrival_time)
        self.front._accept(command, aborted)

    def _die(self, message) -> None:
        if self._stopping:
            error = EngineDeadError("the engine was shut down")
        elif isinstance(message, Dead):
            error = EngineDeadError(message.message)
        else:
            error = EngineDeadError(f"the engine core process exited unexpectedly (exit code {message.returncode})")
            logger.error("%s; no further request can be served", error)
        with self.front._lock:
            self.front._dead = error
        pending = [command for command, _ in self._pending.values()]
        self._pending.clear()
        self.front._die(error, pending, expected=self._stopping)
        self.process.shutdown(timeout=10.0)


def _has_text_only(prompt: PromptType) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)


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
