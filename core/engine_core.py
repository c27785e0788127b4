"""The engine-core process: an ``LLMEngine`` (scheduler, KV cache, backend) stepping as fast as it can, driven over
ZMQ by a front end (``core_client.EngineCoreClient``) that does the HTTP, tokenizing, detokenizing and stop strings.

Between steps it applies what the front end sent (without waiting when there is work); after each step it sends
the step's token deltas and the engine's stats in one message. ZMQ's I/O thread does the socket work, so a send
costs the step only its encoding. With no work it sleeps in ``poll``. It lives exactly as long as its front end:
SIGINT and SIGTERM are the front end's to handle (it drains, then sends ``Shutdown``), and if the front end dies
the core exits.

Run as ``python -m pagedllm.engine_core INPUT_ADDRESS OUTPUT_ADDRESS``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from pagedllm import errors
from pagedllm.core_messages import (Abort, Add, Added, Dead, Failed, Ready, RequestDelta, SequenceDelta, Shutdown,
                                    Start, Step, StopSequence, encoder, front_end_decoder)
from pagedllm.engine import LLMEngine
from pagedllm.logger import configure_logging
from pagedllm.outputs import RequestOutput
from pagedllm.stats import StatsLogger

logger = logging.getLogger("pagedllm.engine_core")

IDLE_POLL_MS = 1000  # how often an idle core checks that its front end still runs (without a pidfd)


class EngineCore:
    def __init__(self, engine: LLMEngine, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 parent_fd: int | None) -> None:
        self.engine = engine
        self.input = input_socket
        self.output = output_socket
        self.encode = encoder().encode
        self.decode = front_end_decoder().decode
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.parent_fd = parent_fd
        if parent_fd is not None:
            self.poller.register(parent_fd, zmq.POLLIN)  # readable once the front end has exited
        self.parent_pid = os.getppid()
        self.stats_log = StatsLogger(logger)
        self.last_stats = None

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            if not self._apply_commands(0 if busy else IDLE_POLL_MS):
                return
            if not engine.has_unfinished_requests():
                self._send_stats_if_changed()
                continue
            outputs = engine.step()
            now = time.time()
            stats = engine.stats()
            self.output.send(self.encode(Step(now, [request_delta(o) for o in outputs], stats)), copy=False)
            self.last_stats = stats
            self.stats_log.observe(stats, time.monotonic())

    def _apply_commands(self, timeout_ms: int) -> bool:
        """Apply what has arrived, waiting up to ``timeout_ms`` for the first; False once told to stop."""
        while True:
            events = dict(self.poller.poll(timeout_ms))
            if self._front_end_gone(events):
                logger.error("the front end has exited; the engine core stops")
                return False
            if self.input not in events:
                return True
            if not self._apply(self.decode(self.input.recv(copy=False).buffer)):
                return False
            timeout_ms = 0

    def _front_end_gone(self, events: dict) -> bool:
        if self.parent_fd is not None:
            return self.parent_fd in events
        return os.getppid() != self.parent_pid

    def _apply(self, command) -> bool:
        engine = self.engine
        if isinstance(command, Add):
            self.output.send(self.encode(self._add(command)))
        elif isinstance(command, Abort):
            engine.abort_request(command.request_ids)
        elif isinstance(command, StopSequence):
            engine.stop_sequence(command.request_id, command.index)
        elif isinstance(command, Shutdown):  # the last stats say what it freed
            engine.abort_request(engine.unfinished_request_ids())
            self._send_stats_if_changed()
            return False
        return True

    def _add(self, command: Add) -> Added:
        added: list[str] = []
        try:
            for r in command.requests:
                self.engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, r.params,
                                        arrival_time=r.arrival_time)
                added.append(r.request_id)
        except Exception as exc:
            self.engine.abort_request(added)
            return Added(command.add_id, _error_type(exc), str(exc), getattr(exc, "param", None))
        return Added(command.add_id)

    def _send_stats_if_changed(self) -> None:
        stats = self.engine.stats()
        if stats != self.last_stats:  # an abort freed blocks, a request left the queue: metrics readers see it
            self.output.send(self.encode(Step(time.time(), [], stats)))
            self.last_stats = stats


def request_delta(output: RequestOutput) -> RequestDelta:
    sequences = []
    for c in output.outputs:
        sequences.append(SequenceDelta(c.index, c.delta_token_ids[-1], c.delta_logprobs[-1] if c.delta_logprobs
                                       else None, c.cumulative_logprob, c.finish_reason, c.stop_reason))
    m = output.metrics
    return RequestDelta(output.request_id, sequences, m.first_scheduled_time, m.first_token_time, output.error)


def _error_type(exc: BaseException) -> str:
    name = type(exc).__name__
    return name if name in errors.__all__ else "RuntimeError"


def main(input_address: str, output_address: str) -> int:
    # The front end owns the signals: a Ctrl-C or a group-wide SIGTERM must not cut a step; the front end drains,
    # then sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging()
    parent_fd = _parent_fd()
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a step never waits on the front end reading
    output_socket.connect(output_address)
    encode = encoder().encode
    start = front_end_decoder().decode(input_socket.recv())
    assert isinstance(start, Start)
    try:
        engine = LLMEngine.from_engine_args(start.args, serving=True)
    except Exception as exc:
        logger.debug("the engine could not be built", exc_info=True)
        output_socket.send(encode(Failed(_error_type(exc), str(exc))))
        _close(context)
        return 1
    output_socket.send(encode(Ready(engine.config, engine.model_info, engine.source, sorted(engine.eos_token_ids),
                                    engine.backend.bound_cpus(), engine.stats())))
    status = 0
    try:
        EngineCore(engine, input_socket, output_socket, parent_fd).run()
    except Exception as exc:
        logger.exception("the engine failed; no further request can be served")
        output_socket.send(encode(Dead(f"the engine failed: {exc!r}")))
        status = 1
    finally:
        engine.shutdown()
        _close(context)
    return status


def _parent_fd() -> int | None:
    """A pidfd of the front end, readable once it exits (Linux 5.3+), else None (then polled by its pid)."""
    try:
        return os.pidfd_open(os.getppid())
    except (AttributeError, OSError):
        return None


def _close(context: zmq.Context) -> None:
    context.destroy(linger=1000)  # let the last messages (Dead, Failed) reach the front end


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
