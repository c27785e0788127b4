"""The front end's side of the engine-core process: start it, talk to it, notice when it dies.

``EngineCoreProcess`` owns the process and two ZMQ sockets over IPC (PUSH of commands, PULL of outputs); it keeps
no request state. ``EngineCoreClient`` adds an ``OutputProcessor`` and the ``LLMEngine`` methods ``LLM`` uses
(add, step, abort), so ``LLM(..., engine_process=True)`` runs the same loop over a core in another process.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from pagedllm import errors
from pagedllm.config import EngineArgs
from pagedllm.core_messages import (Abort, Add, Added, AddRequest, Dead, Failed, Ready, Shutdown, Start, Step,
                                    StopSequence, core_decoder, encoder)
from pagedllm.engine import PromptType, tokenize_prompt
from pagedllm.model_source import load_tokenizer
from pagedllm.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.stats import EngineStats

logger = logging.getLogger("pagedllm.core_client")

_POLL_MS = 100  # how often process death is checked where no pidfd can be polled


@dataclasses.dataclass(frozen=True)
class CoreExited:
    """What ``receive`` returns once the core process has exited and everything it sent has been read."""

    returncode: int


class EngineCoreProcess:
    """An engine-core process, built from ``args``; the constructor returns once its engine is ready (or raises
    what building it raised)."""

    def __init__(self, args: EngineArgs) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._output = self._context.socket(zmq.PULL)
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never blocks the event loop
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._input.bind(input_address)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe; commands come from any thread
        self._encode = encoder().encode
        self._decode = core_decoder().decode
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedllm.engine_core", input_address, output_address])
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._pidfd = _pidfd(self.proc.pid)
        if self._pidfd is not None:
            self._poller.register(self._pidfd, zmq.POLLIN)  # readable once the process has exited
        try:
            self.ready = self._handshake(args)
        except BaseException:
            self.kill()
            raise

    def _handshake(self, args: EngineArgs) -> Ready:
        while not self._input.poll(_POLL_MS, zmq.POLLOUT):  # the core has not connected yet
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine core process exited with {self.proc.returncode} before starting")
        self.send(Start(args))
        message = self.receive()
        if isinstance(message, Failed):
            raise core_error(message.error_type, message.message)
        if not isinstance(message, Ready):
            raise RuntimeError(f"the engine core process exited with {getattr(message, 'returncode', '?')} while "
                               f"starting; its log above says why")
        return message

    def send(self, message) -> None:
        """Queue a message for the core (never blocks); dropped if the core is gone, which ``receive`` reports."""
        data = self._encode(message)
        with self._send_lock:
            try:
                self._input.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.debug("the engine core process is gone; %s not sent", type(message).__name__)

    def receive(self):
        """The next message, or ``CoreExited`` once the process is gone and all it sent has been read."""
        wait = None if self._pidfd is not None else _POLL_MS
        while True:
            events = dict(self._poller.poll(wait))
            if self._output in events:
                return self._decode(self._output.recv(copy=False).buffer)
            if self._pidfd in events or (self._pidfd is None and self.proc.poll() is not None):
                if self._output.poll(0):  # sent before it exited
                    continue
                return CoreExited(self.proc.wait())

    def shutdown(self, timeout: float | None = 60.0) -> int | None:
        """Ask the core to stop and wait for it (killed after ``timeout``); the process's exit code."""
        if self.proc.poll() is None:
            try:
                self.send(Shutdown())
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core process did not stop in %s s; killing it", timeout)
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self._context.destroy(linger=0)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        shutil.rmtree(self._dir, ignore_errors=True)
        return code

    def place_front_end(self) -> None:
        """Keep this process off the core's bound CPUs, if any are left; log where each runs."""
        core_cpus = self.ready.bound_cpus
        mine = os.sched_getaffinity(0)
        left = mine - set(core_cpus or ())
        where = f"engine core process (pid {self.proc.pid})"
        if core_cpus is None:
            logger.info("%s: threads not pinned; the front end shares CPUs %s with it", where, _cpus(mine))
            return
        if not left:
            logger.info("%s bound to CPUs %s; the front end shares them (no CPU is left)", where, _cpus(core_cpus))
            return
        for task in os.listdir("/proc/self/task"):  # every thread: the tokenizer's and ZMQ's too
            try:
                os.sched_setaffinity(int(task), left)
            except OSError:  # the thread ended meanwhile
                pass
        logger.info("%s bound to CPUs %s; the front end runs on CPUs %s", where, _cpus(core_cpus), _cpus(left))


class EngineCoreClient:
    """The ``LLMEngine`` methods that ``LLM`` calls, over an engine-core process. An add the core refuses (a
    constraint that does not compile) raises from the next ``step``."""

    def __init__(self, args: EngineArgs) -> None:
        self.core = EngineCoreProcess(args)
        ready = self.core.ready
        self.config, self.model_info, self.source = ready.config, ready.model_info, ready.source
        self.tokenizer = load_tokenizer(self.source)
        self.outputs = OutputProcessor(self.tokenizer, frozenset(ready.eos_token_ids))
        self._stats = ready.stats
        self._ids = itertools.count()
        self._add_ids = itertools.count()
        self._adding: dict[int, str] = {}  # add id -> request id, until the core acknowledges it

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.outputs:
            raise errors.InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        arrival_time = time.time() if arrival_time is None else arrival_time
        add_id = next(self._add_ids)
        self._adding[add_id] = request_id
        self.core.send(Add(add_id, [core_request(request_id, token_ids, params, arrival_time)]))
        self.outputs.add(request_id, text, token_ids, params, arrival_time)
        return request_id

    def abort_request(self, request_ids) -> None:
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.outputs.abort(request_ids)
        self.core.send(Abort(request_ids))

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs)

    def step(self) -> list[RequestOutput]:
        """Wait for the core's next step and return its outputs, as ``LLMEngine.step`` does."""
        while True:
            message = self.core.receive()
            if isinstance(message, Step):
                self._stats = message.stats
                outputs, stops = self.outputs.process(message.outputs, message.time)
                for request_id, index in stops:
                    self.core.send(StopSequence(request_id, index))
                return outputs
            if isinstance(message, Added):
                request_id = self._adding.pop(message.add_id)
                if message.error_type is not None:
                    self.outputs.abort([request_id])
                    raise core_error(message.error_type, message.message, message.param)
            elif isinstance(message, (Dead, CoreExited)):
                raise RuntimeError(getattr(message, "message", None)
                                   or f"the engine core process exited with {message.returncode}")

    def stats(self) -> EngineStats:
        return self._stats

    def release_thread(self) -> None:
        """Nothing to release: the core's threads are its own."""

    def shutdown(self) -> None:
        self.core.shutdown()


def core_request(request_id: str, token_ids: list[int], params: SamplingParams, arrival_time: float) -> AddRequest:
    """What the core gets of a request: no stop strings and no text (both are the front end's)."""
    core_params = dataclasses.replace(params, stop=None, detokenize=False) if params.stop or params.detokenize \
        else params
    return AddRequest(request_id, token_ids, core_params, arrival_time)


def core_error(error_type: str, message: str, param: str | None = None) -> Exception:
    cls = getattr(errors, error_type, None) if error_type in errors.__all__ else None
    if cls is errors.InvalidRequestError:
        return cls(message, param=param)
    return (cls or RuntimeError)(message)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _cpus(cpus) -> str:
    return ",".join(map(str, sorted(cpus)))
