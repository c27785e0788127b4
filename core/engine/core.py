"""The engine core: an ``LLMEngine`` (scheduler, KV cache, backend) stepping as fast as it can, driven by a front end
(``front_end.FrontEnd``) that does the HTTP, tokenizing, detokenizing and stop strings.

Between steps it applies what the front end sent (without waiting when there is work); after each step it sends
the step's token deltas and the engine's stats in one message. With no work it sleeps in ``receive``. The messages
are ``pagedllm.engine.messages``' structs, over either of two channels:

- in an engine-core process of its own (``main``, what ``pagedllm serve`` runs): MessagePack over ZMQ, whose I/O
  thread does the socket work, so a send costs a step only its encoding. It lives exactly as long as its front end:
  SIGINT and SIGTERM are the front end's to handle (it drains, then sends ``Shutdown``), and if the front end dies
  the core exits.
- on a thread of the front end's process (``run_on_thread``, ``--no-engine-process``): the same structs through
  queues, unencoded.

Run as ``python -m pagedllm.engine.core INPUT_ADDRESS OUTPUT_ADDRESS``.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import time
from typing import Protocol

from pagedllm import errors
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import (
    Abort,
    Add,
    Added,
    CoreExited,
    Dead,
    Failed,
    Ready,
    RequestDelta,
    SequenceDelta,
    Shutdown,
    Start,
    Step,
    StopSequence,
    encoder,
    front_end_decoder,
)
from pagedllm.engine.stats import StatsLogger
from pagedllm.errors import client_message
from pagedllm.logger import configure_logging
from pagedllm.outputs import RequestOutput
from pagedllm.utils import freeze_startup_heap

logger = logging.getLogger("pagedllm.engine.core")

IDLE_POLL_MS = 1000  # how often an idle core checks that its front end still runs
GRAMMAR_POLL_MS = 5  # how often a core with nothing to step looks for grammars compiled meanwhile


class FrontEndGone(Exception):
    """The front end's process has exited: nobody is left to serve."""


class CoreChannel(Protocol):
    """The core's side of its link to the front end."""

    def receive(self, timeout_ms: int):
        """The next command, or None if none came within ``timeout_ms``; raises ``FrontEndGone``."""

    def send(self, message) -> None:
        """Hand a message to the front end (never blocks)."""


class EngineCore:
    def __init__(self, engine: LLMEngine, channel: CoreChannel) -> None:
        self.engine = engine
        self.channel = channel
        self.stats_log = StatsLogger(logger)
        self.last_stats = None
        # adds answered once their requests' grammars have compiled: add id -> its request ids
        self._deferred: dict[int, list[str]] = {}
        self._grammar_results: dict[str, Exception | None] = {}
        self._prompt_logprobs_sent: set[str] = set()  # requests whose prompt logprobs went out (once each)

    def run(self) -> None:
        """Serve until told to stop; raises what a step raised once the engine gives up (the caller says so)."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            wait = 0 if busy else GRAMMAR_POLL_MS if engine.num_compiling else IDLE_POLL_MS
            if not self._apply_commands(wait):
                return
            if self._deferred:
                self._answer_compiled_adds()
            if not engine.has_unfinished_requests():
                self._send_stats_if_changed()
                continue
            outputs = engine.step()
            stats = engine.stats()
            self.channel.send(Step(time.time(), [self._delta(o) for o in outputs], stats))
            self.last_stats = stats
            self.stats_log.observe(stats, time.monotonic())

    def fail(self, exc: Exception) -> Dead:
        """After ``run`` raised: free what the engine held, so its last stats say so, and say why it died."""
        logger.error("the engine failed; no further request can be served", exc_info=exc)
        try:
            self.engine.abort_request(self.engine.unfinished_request_ids())
            self._send_stats_if_changed()
        except Exception:
            logger.exception("could not abort the requests in flight")
        return Dead(f"the engine failed: {client_message(exc)}")

    def _apply_commands(self, timeout_ms: int) -> bool:
        """Apply what has arrived, waiting up to ``timeout_ms`` for the first; False once told to stop."""
        while True:
            try:
                command = self.channel.receive(timeout_ms)
            except FrontEndGone:
                logger.error("the front end has exited; the engine core stops")
                return False
            if command is None:
                return True
            if not self._apply(command):
                return False
            timeout_ms = 0

    def _apply(self, command) -> bool:
        engine = self.engine
        if isinstance(command, Add):
            answer = self._add(command)
            if answer is not None:
                self.channel.send(answer)
        elif isinstance(command, Abort):
            engine.abort_request(command.request_ids)
            self._prompt_logprobs_sent.difference_update(command.request_ids)
        elif isinstance(command, StopSequence):
            engine.stop_sequence(command.request_id, command.index)
        elif isinstance(command, Shutdown):  # the last stats say what it freed
            engine.abort_request(engine.unfinished_request_ids())
            self._send_stats_if_changed()
            return False
        return True

    def _add(self, command: Add) -> Added | None:
        """Add requests all or none; the answer, or None while grammars compile (then it comes later)."""
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids},
                                        r.pooling if r.pooling is not None else r.params,
                                        arrival_time=r.arrival_time, wait_for_grammar=False, priority=r.priority)
                added.append(r.request_id)
        except Exception as exc:
            self.engine.abort_request(added)
            return Added(command.add_id, error_type(exc), str(exc), getattr(exc, "param", None))
        if any(self.engine.is_compiling(rid) for rid in added):
            self._deferred[command.add_id] = added
            return None
        return Added(command.add_id)

    def _answer_compiled_adds(self) -> None:
        """Answer the adds whose grammars have all compiled (or failed to): queue them, or refuse them whole. The
        answer goes out before any step runs them, so the front end knows them when their first token comes."""
        self._grammar_results.update(self.engine.poll_grammars())
        for add_id, request_ids in list(self._deferred.items()):
            if any(self.engine.is_compiling(rid) for rid in request_ids):
                continue
            del self._deferred[add_id]
            errors = [e for e in (self._grammar_results.pop(rid, None) for rid in request_ids) if e is not None]
            if errors:
                self.engine.abort_request(request_ids)
                self.channel.send(Added(add_id, error_type(errors[0]), str(errors[0]), errors[0].param))
            else:
                self.channel.send(Added(add_id))
                self.engine.admit(request_ids)

    def _delta(self, output: RequestOutput) -> RequestDelta:
        """The output as the front end gets it; a request's prompt logprobs go with its first output only."""
        sent = self._prompt_logprobs_sent
        first = output.prompt_logprobs is not None and output.request_id not in sent
        if output.finished:
            sent.discard(output.request_id)
        elif first:
            sent.add(output.request_id)
        return request_delta(output, first)

    def _send_stats_if_changed(self) -> None:
        stats = self.engine.stats()
        if stats != self.last_stats:  # an abort freed blocks, a request left the queue: metrics readers see it
            self.channel.send(Step(time.time(), [], stats))
            self.last_stats = stats


def request_delta(output: RequestOutput, with_prompt_logprobs: bool = False) -> RequestDelta:
    sequences = []
    for c in output.outputs:
        sequences.append(SequenceDelta(c.index, c.delta_token_ids[-1], c.delta_logprobs[-1] if c.delta_logprobs
                                       else None, c.cumulative_logprob, c.finish_reason, c.stop_reason))
    m = output.metrics
    return RequestDelta(output.request_id, sequences, m.first_scheduled_time, m.first_token_time, output.error,
                        output.prompt_logprobs if with_prompt_logprobs else None, output.num_cached_tokens,
                        output.embedding)


def error_type(exc: BaseException) -> str:
    """The name the front end rebuilds the error from: a ``pagedllm.errors`` class, else RuntimeError."""
    name = type(exc).__name__
    return name if name in errors.__all__ else "RuntimeError"


def ready_message(engine: LLMEngine) -> Ready:
    return Ready(engine.config, engine.model_info, engine.source, sorted(engine.eos_token_ids),
                 engine.backend.bound_cpus(), engine.stats())


# -- on a thread ------------------------------------------------------------------------------------------------
class QueueChannel:
    """The core's side of a thread's link: commands in one queue, messages out through another."""

    def __init__(self, commands: queue.SimpleQueue, messages: queue.SimpleQueue) -> None:
        self.commands = commands
        self.messages = messages

    def receive(self, timeout_ms: int):
        try:
            return self.commands.get(timeout=timeout_ms / 1000) if timeout_ms else self.commands.get_nowait()
        except queue.Empty:
            return None

    def send(self, message) -> None:
        self.messages.put(message)


def run_on_thread(engine_args, commands: queue.SimpleQueue, messages: queue.SimpleQueue) -> None:
    """The body of an engine-core thread: ``Ready`` (or ``Failed``), the core's messages, ``CoreExited`` last."""
    status = 1
    try:
        try:
            engine = LLMEngine.from_engine_args(engine_args, serving=True)
        except Exception as exc:
            messages.put(Failed(error_type(exc), str(exc)))
            return
        messages.put(ready_message(engine))
        status = _serve(engine, QueueChannel(commands, messages))
    finally:  # whatever ended the thread, the front end hears of it
        messages.put(CoreExited(status))


def _serve(engine: LLMEngine, channel: CoreChannel) -> int:
    """Run the core until it stops; its exit status (1 if the engine died)."""
    core = EngineCore(engine, channel)
    try:
        core.run()
        return 0
    except Exception as exc:
        channel.send(core.fail(exc))
        return 1
    finally:
        engine.shutdown()


# -- in a process ---------------------------------------------------------------------------------------------
class ZmqChannel:
    """The core's side of a process's link: commands from a PULL socket, messages to a PUSH socket, in
    MessagePack. The front end's exit is seen through a pidfd where the kernel has them, else by its pid."""

    def __init__(self, input_socket, output_socket) -> None:
        import zmq

        self.input, self.output = input_socket, output_socket
        self.encode = encoder().encode
        self.decode = front_end_decoder().decode
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.parent_pid = os.getppid()
        self.parent_fd = _parent_fd()
        if self.parent_fd is not None:
            self.poller.register(self.parent_fd, zmq.POLLIN)  # readable once the front end has exited

    def receive(self, timeout_ms: int):
        events = dict(self.poller.poll(timeout_ms))
        if (self.parent_fd in events) if self.parent_fd is not None else os.getppid() != self.parent_pid:
            raise FrontEndGone
        if self.input not in events:
            return None
        return self.decode(self.input.recv(copy=False).buffer)

    def send(self, message) -> None:
        self.output.send(self.encode(message), copy=False)


def main(input_address: str, output_address: str) -> int:
    import zmq

    # The front end owns the signals: a Ctrl-C or a group-wide SIGTERM must not cut a step; the front end drains,
    # then sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging()
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a step never waits on the front end reading
    output_socket.connect(output_address)
    channel = ZmqChannel(input_socket, output_socket)
    start = front_end_decoder().decode(input_socket.recv())
    assert isinstance(start, Start)
    try:
        engine = LLMEngine.from_engine_args(start.args, serving=True)
    except Exception as exc:
        logger.debug("the engine could not be built", exc_info=True)
        channel.send(Failed(error_type(exc), str(exc)))
        status = 1
    else:
        freeze_startup_heap()
        channel.send(ready_message(engine))
        status = _serve(engine, channel)
    context.destroy(linger=1000)  # let the last messages (Dead, Failed) reach the front end
    return status


def _parent_fd() -> int | None:
    """A pidfd of the front end, readable once it exits (Linux 5.3+), else None (then polled by its pid)."""
    try:
        return os.pidfd_open(os.getppid())
    except (AttributeError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
