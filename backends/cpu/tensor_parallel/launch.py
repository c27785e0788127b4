"""Starting tensor-parallel rank processes on this machine, and saying why one ended.

Ranks are fresh interpreters (``python -m pagedllm.backends.cpu.tensor_parallel.worker``), not multiprocessing
children: no re-import of the user's script, and nothing of the engine's process (threads, OpenMP teams) is inherited.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from pagedllm.backends.common.cpu_binding import ThreadPlan, replica_plans
from pagedllm.config import Setting
from pagedllm.errors import ConfigError
from pagedllm.utils import module_command

DISTRIBUTED_INIT_METHOD = Setting(
    "distributed_init_method", str, None, "where the tensor-parallel ranks meet, tcp://HOST:PORT on node 0 "
    "(needed with --nnodes above 1)", shown_default="a file on this machine (no port)")
NNODES = Setting("nnodes", int, 1, "machines the tensor-parallel ranks span (each runs tensor-parallel-size / "
                 "nnodes ranks)")
NODE_RANK = Setting("node_rank", int, 0, "this machine's place among --nnodes: 0 runs the engine, the others "
                    "`python -m pagedllm.backends.cpu.tensor_parallel.node`")
NODE_COMMAND = "python -m pagedllm.backends.cpu.tensor_parallel.node"
LOCAL_RENDEZVOUS_PREFIX = "pagedllm-tp-"


def local_ranks(options: dict, *, reserve_for_server: bool = False, replica: int = 0,
                replicas: int = 1) -> tuple[range, list[ThreadPlan]]:
    """This machine's ranks and a thread plan for each, from the backend options; ConfigError if they do not fit.
    ``replica`` of ``replicas`` (data parallelism) takes its own run of the CPU sets."""
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
    plans = replica_plans(options["cpu_omp_threads_bind"], per_node, replica, replicas,
                          reserve_for_server=reserve_for_server)
    return range(node * per_node, (node + 1) * per_node), plans


def local_init_method() -> str:
    """The rendezvous of ranks that all run on this machine: a file in a folder of their own (torch's FileStore),
    so no port is opened for it; the ranks' gloo links stay on loopback (``rank_env``)."""
    return f"file://{tempfile.mkdtemp(prefix=LOCAL_RENDEZVOUS_PREFIX)}/rendezvous"


def remove_local_rendezvous(init_method: str) -> None:
    folder = Path(init_method.removeprefix("file://")).parent
    if init_method.startswith("file://") and folder.name.startswith(LOCAL_RENDEZVOUS_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def rank_env(init_method: str) -> dict[str, str]:
    """A rank's environment: gloo binds loopback when every rank is on this machine."""
    env = dict(os.environ)
    if init_method.startswith("file://"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def start_rank(rank: int, world_size: int, init_method: str, plan: ThreadPlan, *, model: dict | None = None,
               driver_fd: int | None = None, logits_fd: int | None = None,
               logits_shape: tuple[int, int] | None = None) -> subprocess.Popen:
    """Start one rank; rank 0 also gets the model settings, the engine's pipe and the logits buffer."""
    spec = {"rank": rank, "world_size": world_size, "init_method": init_method, "plan": dataclasses.asdict(plan),
            "model": model, "driver_fd": driver_fd, "logits_fd": logits_fd, "logits_shape": logits_shape}
    fds = tuple(fd for fd in (driver_fd, logits_fd) if fd is not None)
    return subprocess.Popen(module_command("pagedllm.backends.cpu.tensor_parallel.worker", json.dumps(spec)),
                            pass_fds=fds, env=rank_env(init_method))


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
