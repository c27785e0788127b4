"""Starting tensor-parallel rank processes on this machine, and saying why one ended.

Ranks are fresh interpreters (``python -m pagedllm.backends.cpu.tensor_parallel.worker``), not multiprocessing
children: no re-import of the user's script, and nothing of the engine's process (threads, OpenMP teams) is inherited.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys

from pagedllm.backends.common.cpu_binding import ThreadPlan, plan_ranks
from pagedllm.config import Setting
from pagedllm.errors import ConfigError

DISTRIBUTED_INIT_METHOD = Setting(
    "distributed_init_method", str, None, "where the tensor-parallel ranks meet, tcp://HOST:PORT on node 0 "
    "(needed with --nnodes above 1)", shown_default="a free port on 127.0.0.1")
NNODES = Setting("nnodes", int, 1, "machines the tensor-parallel ranks span (each runs tensor-parallel-size / "
                 "nnodes ranks)")
NODE_RANK = Setting("node_rank", int, 0, "this machine's place among --nnodes: 0 runs the engine, the others "
                    "`python -m pagedllm.backends.cpu.tensor_parallel.node`")
NODE_COMMAND = "python -m pagedllm.backends.cpu.tensor_parallel.node"


def local_ranks(options: dict, *, reserve_for_server: bool = False) -> tuple[range, list[ThreadPlan]]:
    """This machine's ranks and a thread plan for each, from the backend options; ConfigError if they do not fit."""
    world, nnodes, node = options["tensor_parallel_size"], options["nnodes"], options["node_rank"]
    if world < 1 or nnodes < 1:
        raise ConfigError(f"--tensor-parallel-size ({world}) and --nnodes ({nnodes}) must be at least 1")
    if world % nnodes:
        raise ConfigError(f"--tensor-parallel-size {world} is not a multiple of --nnodes {nnodes}: every node "
                          f"runs the same number of ranks")
    if not 0 <= node < nnodes:
        raise ConfigError(f"--node-rank {node} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    if nnodes > 1 and not options["distributed_init_method"]:
        raise ConfigError(f"--nnodes {nnodes} needs --distributed-init-method tcp://HOST:PORT, HOST being node 0's "
                          f"address the other nodes reach")
    per_node = world // nnodes
    plans = plan_ranks(options["cpu_omp_threads_bind"], per_node, reserve_for_server=reserve_for_server)
    return range(node * per_node, (node + 1) * per_node), plans


def free_local_init_method() -> str:
    """A tcp:// address on this machine that nothing listens on yet (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_rank(rank: int, world_size: int, init_method: str, plan: ThreadPlan, *, model: dict | None = None,
               driver_fd: int | None = None, logits_fd: int | None = None,
               logits_shape: tuple[int, int] | None = None) -> subprocess.Popen:
    """Start one rank; rank 0 also gets the model settings, the engine's pipe and the logits buffer."""
    spec = {"rank": rank, "world_size": world_size, "init_method": init_method, "plan": dataclasses.asdict(plan),
            "model": model, "driver_fd": driver_fd, "logits_fd": logits_fd, "logits_shape": logits_shape}
    fds = tuple(fd for fd in (driver_fd, logits_fd) if fd is not None)
    return subprocess.Popen([sys.executable, "-m", "pagedllm.backends.cpu.tensor_parallel.worker", json.dumps(spec)],
                            pass_fds=fds, env=dict(os.environ))


def exit_reason(returncode: int) -> str:
    """How a rank process ended, in words."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGKILL:
            return f"was killed by {name} (the kernel's out-of-memory killer sends it, as does kill -9)"
        return f"was killed by {name}"
    return f"exited with code {returncode} (its error is logged above)"
