"""The front end's link to an engine core, wherever it runs (vLLM's ``core_client``): one small interface, two
implementations, and ``make_core_client`` to choose.

- ``ProcessCoreClient``: the core in a process of its own (``python -m pagedllm.engine.core``), over two ZMQ
  sockets on IPC (PUSH of commands, PULL of messages); notices the process's death through a pidfd.
- ``ThreadCoreClient``: the core on a thread of this process, over two queues; no encoding.

A client carries messages and nothing else: it keeps no request state (that is ``front_end.FrontEnd``'s).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from typing import Protocol

from pagedllm import errors
from pagedllm.config import EngineArgs
from pagedllm.engine.messages import CoreExited, Failed, Ready, Shutdown, Start
from pagedllm.utils import module_command, skip_unused_imports

logger = logging.getLogger("pagedllm.engine.core_client")

_POLL_MS = 100  # how often process death is checked where no pidfd can be polled


class CoreClient(Protocol):
    """What a front end needs of an engine core. ``ready`` is what the core said once its engine was built."""

    ready: Ready

    def send(self, message) -> None:
        """Queue a command for the core (never blocks, from any thread); dropped if the core is gone."""

    def receive(self):
        """The core's next message (blocks), or ``CoreExited`` once the core has ended and all it sent was read."""

    def stop(self, timeout: float | None) -> None:
        """Ask the core to stop and wait up to ``timeout`` for it to end, killing it then if it can be killed."""

    def close(self) -> None:
        """Release what the client holds, once ``receive`` has returned ``CoreExited``."""


def make_core_client(args: EngineArgs, engine_process: bool) -> CoreClient:
    """An engine core built from ``args`` in a process of its own or on a thread; returns once its engine is ready,
    or raises what building it raised."""
    return ProcessCoreClient(args) if engine_process else ThreadCoreClient(args)


def core_error(error_type: str, message: str, param: str | None = None) -> Exception:
    """The exception the core reported, rebuilt on this side (``pagedllm.errors`` classes keep their type)."""
    cls = getattr(errors, error_type, None) if error_type in errors.__all__ else None
    if cls is errors.InvalidRequestError:
        return cls(message, param=param)
    return (cls or RuntimeError)(message)


def _wait_ready(client: CoreClient) -> Ready:
    message = client.receive()
    if isinstance(message, Failed):
        raise core_error(message.error_type, message.message)
    if not isinstance(message, Ready):
        raise RuntimeError(f"the engine core exited with {getattr(message, 'returncode', '?')} while starting; "
                           f"its log above says why")
    return message


class ThreadCoreClient:
    """The engine core on a thread of this process (``pagedllm serve --no-engine-process``)."""

    def __init__(self, args: EngineArgs) -> None:
        from pagedllm.engine.core import run_on_thread  # the engine (torch, the backends) only when it runs here

        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=run_on_thread, args=(args, self._commands, self._messages),
                                        name="pagedllm-engine", daemon=True)
        self._thread.start()
        self.ready = _wait_ready(self)

    def send(self, message) -> None:
        self._commands.put(message)

    def receive(self):
        return self._messages.get()

    def stop(self, timeout: float | None) -> None:
        self.send(Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():  # a thread cannot be killed: it ends with the step it is in
            logger.warning("the engine thread did not stop in %s s", timeout)

    def close(self) -> None:
        self._thread.join()


class ProcessCoreClient:
    """An engine-core process, built from ``args``; owns the process and its two sockets."""

    def __init__(self, args: EngineArgs) -> None:
        import zmq

        from pagedllm.engine.messages import core_decoder, encoder

        self._zmq = zmq
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
        self.proc = subprocess.Popen(module_command("pagedllm.engine.core", input_address, output_address))
        # The front end needs transformers for its tokenizer: seconds of imports, paid while the core starts.
        threading.Thread(target=_import_tokenizer_modules, name="pagedllm-preload", daemon=True).start()
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._pidfd = _pidfd(self.proc.pid)
        if self._pidfd is not None:
            self._poller.register(self._pidfd, zmq.POLLIN)  # readable once the process has exited
        try:
            while not self._input.poll(_POLL_MS, zmq.POLLOUT):  # the core has not connected yet
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the engine core process exited with {self.proc.returncode} before "
                                       f"starting")
            self.send(Start(args))
            self.ready = _wait_ready(self)
        except BaseException:
            self.kill()
            raise

    def send(self, message) -> None:
        data = self._encode(message)
        with self._send_lock:
            try:
                self._input.send(data, self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:
                logger.debug("the engine core process is gone; %s not sent", type(message).__name__)

    def receive(self):
        wait = None if self._pidfd is not None else _POLL_MS
        while True:
            events = dict(self._poller.poll(wait))
            if self._output in events:
                return self._decode(self._output.recv(copy=False).buffer)
            if self._pidfd in events or (self._pidfd is None and self.proc.poll() is not None):
                if self._output.poll(0):  # sent before it exited
                    continue
                return CoreExited(self.proc.wait())

    def stop(self, timeout: float | None) -> None:
        if self.proc.poll() is None:
            self.send(Shutdown())
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core process did not stop in %s s; killing it", timeout)
                self.proc.kill()

    def close(self) -> None:
        try:
            self.proc.wait(10.0)  # a core that reported its death exits by itself
        except subprocess.TimeoutExpired:
            pass
        self.kill()

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
        place_front_end(self.ready.bound_cpus, f"engine core process (pid {self.proc.pid})")


def place_front_end(core_cpus, where: str) -> None:
    """Move every thread of this process off ``core_cpus`` (the engine cores' bound CPUs, None if not pinned), if
    any CPU is left; log where each runs. ``where`` names the cores in the log."""
    mine = os.sched_getaffinity(0)
    left = mine - set(core_cpus or ())
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


def _import_tokenizer_modules() -> None:
    try:
        skip_unused_imports()  # the tokenizer classes pull in the model classes' imports
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    except Exception:  # loading the tokenizer later says what is wrong
        pass


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _cpus(cpus) -> str:
    return ",".join(map(str, sorted(cpus)))
