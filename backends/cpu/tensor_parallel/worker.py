"""One tensor-parallel rank, as its own process: ``python -m pagedllm.backends.cpu.tensor_parallel.worker SPEC_JSON``.

It joins the ranks' gloo process group, takes the model settings rank 0 broadcasts (so a rank on another machine
needs only the group's address), binds its threads, loads its shard and then runs commands until told to stop.
Rank 0 reads each command from the engine's pipe and broadcasts it to the others as two buffers (wire.py); its
replies go back on the pipe, the logits into a shared memory buffer the engine reads. Any error ends the process:
the engine names the rank, and the other ranks' collectives fail when its connections close.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import mmap
import signal
import socket
import sys
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.backends.common.cpu_binding import ThreadPlan
from pagedllm.backends.cpu.runner.allocator import loading_weights
from pagedllm.backends.cpu.runner.kernels import load_kernels
from pagedllm.backends.cpu.runner.model_runner import ModelRunner
from pagedllm.backends.cpu.runner.sharding import Rank, parameter_bytes
from pagedllm.backends.cpu.runner.threads import ThreadBinder
from pagedllm.backends.cpu.tensor_parallel import wire
from pagedllm.logger import configure_logging
from pagedllm.utils import freeze_startup_heap, skip_unused_imports

logger = logging.getLogger("pagedllm.cpu")
# Collectives inside a step wait only for the other ranks' share of the same work; this bounds a rank that is
# alive but stuck. Loading falls under it too (ranks load at the same time). Commands wait for the next step, which
# may come after any idle time.
STEP_TIMEOUT = datetime.timedelta(minutes=10)
IDLE_TIMEOUT = datetime.timedelta(days=365)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
OK, ERROR = b"K", b"E"


def _prefix_logs(rank: int) -> None:
    class Prefix(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg = f"[TP rank {rank}] {record.msg}"
            return True

    configure_logging()
    root = logging.getLogger("pagedllm")
    for handler in root.handlers:
        handler.addFilter(Prefix())
    if rank:  # rank 0 speaks for the model; the others only warn
        root.setLevel(max(root.level, logging.WARNING))


class Worker:
    def __init__(self, spec: dict) -> None:
        self.rank = spec["rank"]
        self.world_size = spec["world_size"]
        self.plan = ThreadPlan(**{**spec["plan"], "warnings": tuple(spec["plan"]["warnings"])})
        self.conn = Connection(spec["driver_fd"]) if self.rank == 0 else None
        self.logits = None
        if self.rank == 0:
            rows, vocab = spec["logits_shape"]
            region = mmap.mmap(spec["logits_fd"], rows * vocab * 4)
            self.logits = torch.frombuffer(region, dtype=torch.float32).view(rows, vocab)
        dist.init_process_group("gloo", init_method=spec["init_method"], rank=self.rank,
                                world_size=self.world_size, timeout=STEP_TIMEOUT)
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.model = wire.broadcast_json(spec.get("model"), src=0, group=self.commands)

    def load(self) -> None:
        m = self.model
        kernels, attention_path = load_kernels(m["attention_mode"])
        binder = ThreadBinder(self.plan, kernels)
        binder.ensure_bound()  # loading and packing already run on this rank's CPUs
        self.runner = ModelRunner(m["model_dir"], DTYPES[m["dtype"]], m["cache_kind"], DTYPES[m["cache_dtype"]],
                                  binder, kernels, DTYPES[m["residual_dtype"]], Rank(self.rank, self.world_size),
                                  quantization=m["quantization"], gguf_file=m["gguf_file"],
                                  batch_invariant=m["batch_invariant"], int8_activations=m["int8_activations"])
        with loading_weights():
            info = self.runner.load()
        report = {"rank": self.rank, "host": socket.gethostname(), "threads": self.plan.describe(),
                  "shard_bytes": parameter_bytes(self.runner.model), "kv_heads": self.runner.local_kv_heads,
                  "attention": attention_path}
        reports = wire.all_gather_json(report)
        if self.rank == 0:  # once, at start
            self.conn.send_bytes(OK + json.dumps({"info": dataclasses.asdict(info), "ranks": reports}).encode())

    def serve(self) -> None:
        """Run commands until SHUTDOWN."""
        head = torch.zeros(wire.HEADER_LEN, dtype=torch.int64)
        while True:
            payload = b""
            if self.rank == 0:
                raw = self.conn.recv_bytes()
                head.copy_(torch.frombuffer(bytearray(raw[:wire.HEADER_LEN * 8]), dtype=torch.int64))
                payload = raw[wire.HEADER_LEN * 8:]
            dist.broadcast(head, src=0, group=self.commands)
            size = int(head[7])
            data = torch.empty(size, dtype=torch.uint8)
            if size:
                if self.rank == 0:
                    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                dist.broadcast(data, src=0, group=self.commands)
            reply = self.run(head.numpy(), data.numpy())
            if self.rank == 0:
                self.conn.send_bytes(OK + np.int64(reply).tobytes())
            if int(head[0]) == wire.SHUTDOWN:
                return

    def run(self, head: np.ndarray, payload: np.ndarray) -> int:
        command = int(head[0])
        if command == wire.EXECUTE:
            logits = self.runner.execute(wire.unpack_batch(head, payload))
            if self.rank == 0:
                self.logits[:logits.shape[0]].copy_(logits)
            return logits.shape[0]
        if command == wire.COPY_BLOCKS:
            src, dst = wire.unpack_copy_blocks(head, payload)
            self.runner.copy_blocks(torch.from_numpy(src), torch.from_numpy(dst))
        elif command == wire.ALLOCATE:
            self.runner.allocate_kv_cache(int(head[1]), int(head[2]))
        return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it stops the ranks
    spec = json.loads(argv[1])
    _prefix_logs(spec["rank"])
    skip_unused_imports()
    worker = None
    try:
        worker = Worker(spec)
        worker.load()
        freeze_startup_heap()
        worker.serve()
    except EOFError:  # the engine's end of the pipe closed: it is gone
        return 1
    except BaseException as exc:
        logger.exception("failed")
        if worker is not None and worker.conn is not None:
            try:
                worker.conn.send_bytes(ERROR + f"{type(exc).__name__}: {exc}".encode())
            except OSError:
                pass
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
