"""The engine's side of tensor parallelism: N rank processes where ModelRunner would be, with its methods.

Each command goes to rank 0 over a pipe as a header and the batch's flat arrays (wire.py); rank 0 broadcasts it
to the other ranks over gloo and replies when the step is done, the logits in a shared buffer. While it waits, the
engine also watches every local rank's process, so a rank that dies (killed, out of memory) fails the step at
once with its rank and reason, and one that stays stopped fails it within seconds; once failed, the executor stops
the other ranks and every later call raises the same error.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import subprocess
import time
from multiprocessing import Pipe
from multiprocessing.connection import wait

import numpy as np
import torch

from pagedllm.backend import ModelInfo
from pagedllm.backends.common.cpu_binding import ThreadPlan, format_cpu_list
from pagedllm.backends.cpu.runner.sharding import check_shardable
from pagedllm.backends.cpu.tensor_parallel import wire
from pagedllm.backends.cpu.tensor_parallel.launch import exit_reason, remove_local_rendezvous, start_rank
from pagedllm.backends.cpu.tensor_parallel.worker import ERROR, OK
from pagedllm.batch import Batch
from pagedllm.errors import BackendDeadError

logger = logging.getLogger("pagedllm.cpu")
# After rank 0 reports a failed collective, how long to wait for the rank that caused it to be seen exiting.
_DEATH_GRACE_S = 1.0
_STOP_TIMEOUT_S = 10.0
_WATCH_INTERVAL_S = 0.5  # how often the ranks' processes are looked at while a step runs
STOPPED_LIMIT_S = 3.0  # a rank stopped this long (not running, not exited) ends the engine


class TensorParallelError(BackendDeadError):
    """A tensor-parallel rank failed or died; the ranks cannot run further steps."""


class TensorParallelExecutor:
    def __init__(self, model: dict, world_size: int, plans: list[ThreadPlan], init_method: str,
                 max_rows: int) -> None:
        self.model = model  # the settings every rank loads with (worker.Worker.load)
        self.world_size = world_size
        self.plans = plans  # this machine's ranks: 0 .. len(plans) - 1
        self.init_method = init_method
        self.max_rows = max_rows
        self.processes: list[subprocess.Popen] = []
        self.exit_fds: list[int] = []
        self.failed: TensorParallelError | None = None
        self.ranks: list[dict] = []
        self.bytes_per_block: dict[int, int] = {}

    def load(self) -> ModelInfo:
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(self.model["model_dir"]).get_text_config()
        check_shardable(text, self.world_size)  # before any process starts
        rows, vocab = self.max_rows, text.vocab_size
        logits_fd = os.memfd_create("pagedllm-tp-logits")
        os.ftruncate(logits_fd, rows * vocab * 4)
        self.logits = torch.frombuffer(mmap.mmap(logits_fd, rows * vocab * 4), dtype=torch.float32).view(rows, vocab)
        self.conn, child = Pipe()
        try:
            for rank, plan in enumerate(self.plans):
                extra = dict(model=self.model, driver_fd=child.fileno(), logits_fd=logits_fd,
                             logits_shape=(rows, vocab)) if rank == 0 else {}
                self.processes.append(start_rank(rank, self.world_size, self.init_method, plan, **extra))
                self.exit_fds.append(os.pidfd_open(self.processes[-1].pid))
        finally:
            child.close()
            os.close(logits_fd)
        started = json.loads(self._reply())
        self.ranks = started["ranks"]
        for r in self.ranks:
            logger.info("TP rank %d on %s: %s; weight shard %.1f MiB; %d KV heads", r["rank"], r["host"],
                        r["threads"], r["shard_bytes"] / 2**20, r["kv_heads"])
        self.info = ModelInfo(**started["info"])
        self.local_kv_heads = self.ranks[0]["kv_heads"]
        return self.info

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """One rank's share: the KV space setting is per rank, as in vLLM."""
        from pagedllm.backends.cpu.layers import kv_cache

        return kv_cache.bytes_per_block(self.model["cache_kind"], self.info.num_layers, self.local_kv_heads,
                                        block_size, self.info.head_size, _dtype(self.model["cache_dtype"]))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._command(wire.header(wire.ALLOCATE, num_blocks, block_size), b"")
        per_rank = num_blocks * self.kv_cache_bytes_per_block(block_size) / 2**30
        logger.info("KV cache on each of the %d TP ranks: %d blocks, %.2f GiB (%d of the model's %d KV heads)",
                    self.world_size, num_blocks, per_rank, self.local_kv_heads, self.info.num_kv_heads)

    def execute(self, batch: Batch) -> torch.Tensor:
        rows = len(batch.logits_indices)
        if rows > self.max_rows:
            raise ValueError(f"{rows} logits rows asked, the buffer holds {self.max_rows} (max_num_batched_tokens)")
        self._command(*wire.pack_batch(batch))
        return self.logits[:rows].clone()  # the buffer is rank 0's to overwrite in the next step

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._command(*wire.pack_copy_blocks(src.numpy(), dst.numpy()))

    def describe(self) -> str:
        cpus = "|".join(format_cpu_list(p.cpus) if p.cpus else "nobind" for p in self.plans)
        return f"tensor parallel: {self.world_size} ranks ({len(self.plans)} here, CPUs {cpus})"

    def shutdown(self) -> None:
        if self.processes and self.failed is None:
            try:
                self._command(wire.header(wire.SHUTDOWN), b"")
            except (TensorParallelError, OSError):
                pass
        self._stop_all()
        remove_local_rendezvous(self.init_method)

    # -- the pipe and the processes -----------------------------------------------------------
    def _command(self, head: np.ndarray, payload: bytes) -> int:
        if self.failed is not None:
            raise self.failed
        try:
            self.conn.send_bytes(head.tobytes() + payload)
        except OSError:
            pass  # rank 0 is gone: _reply names it
        return int(np.frombuffer(self._reply(), dtype=np.int64)[0])

    def _reply(self) -> bytes:
        """Rank 0's answer, or TensorParallelError as soon as a local rank exits, stays stopped for
        ``STOPPED_LIMIT_S`` (SIGSTOP, a frozen cgroup: its peers would wait in a collective for gloo's timeout) or
        rank 0 reports a failure."""
        stopped_since: dict[int, float] = {}
        while not (ready := wait([self.conn, *self.exit_fds], timeout=_WATCH_INTERVAL_S)):
            now = time.monotonic()
            for rank, process in enumerate(self.processes):
                if _is_stopped(process.pid):
                    if now - stopped_since.setdefault(rank, now) >= STOPPED_LIMIT_S:
                        self._fail(None, f"TP rank {rank} (pid {process.pid}) has been stopped for "
                                         f"{STOPPED_LIMIT_S:g} s (SIGSTOP or a frozen cgroup); its peers cannot go on")
                else:
                    stopped_since.pop(rank, None)
        message = None
        if self.conn in ready:
            try:
                raw = self.conn.recv_bytes()
            except (EOFError, OSError):
                raw = ERROR + b"its pipe closed"
            if raw[:1] == OK:
                return raw[1:]
            message = raw[1:].decode(errors="replace")
        self._fail(message)

    def _fail(self, rank0_message: str | None, stopped: str | None = None) -> None:
        # A collective that failed on rank 0 because a peer's connection closed is that peer's doing: give the
        # peer a moment to be seen exiting, and name it first.
        if stopped is not None:
            self.failed = TensorParallelError(f"a tensor-parallel worker failed, the engine cannot continue: {stopped}")
            self._stop_all()
            raise self.failed
        peer_failed = rank0_message is None or "peer" in rank0_message
        if peer_failed:
            wait(self.exit_fds[1:], timeout=_DEATH_GRACE_S)
        dead = {rank: p.returncode for rank, p in enumerate(self.processes) if p.poll() is not None}
        parts = [f"TP rank {rank} (pid {self.processes[rank].pid}) {exit_reason(code)}"
                 for rank, code in dead.items() if peer_failed and (rank or rank0_message is None)]
        if rank0_message is not None:
            parts.append(f"TP rank 0 {'reported' if parts else 'failed'}: {rank0_message}")
            if peer_failed and len(parts) == 1 and len(self.plans) < self.world_size:
                parts.append("no other rank on this machine exited: a rank on another node may have stopped")
        self.failed = TensorParallelError(f"a tensor-parallel worker failed, the engine cannot continue: "
                                          f"{'; '.join(parts)}")
        self._stop_all()
        raise self.failed

    def _stop_all(self) -> None:
        """Wait for the ranks to exit (after SHUTDOWN), or kill them at once after a failure."""
        for p in self.processes:
            try:
                p.wait(_STOP_TIMEOUT_S if self.failed is None else 0.1)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for fd in self.exit_fds:
            os.close(fd)
        self.exit_fds.clear()
        self.processes.clear()
        if hasattr(self, "conn"):
            self.conn.close()


def _is_stopped(pid: int) -> bool:
    """The process is stopped (state T or t in /proc: SIGSTOP, a debugger, a frozen cgroup)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
