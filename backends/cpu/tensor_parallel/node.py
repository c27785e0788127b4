"""A machine other than node 0 of a multi-machine tensor-parallel run: it starts its ranks and waits for them.

    python -m pagedllm.backends.cpu.tensor_parallel.node -tp 4 --nnodes 2 --node-rank 1 --distributed-init-method tcp://HOST:PORT

The ranks take the model and its settings from rank 0 (the engine's node), so the model must be at the same path
here. They run until the engine stops them; the command exits 0 then, or 1 naming a rank that failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from multiprocessing.connection import wait

from pagedllm.backends.common.cpu_binding import TENSOR_PARALLEL_SIZE, THREADS_BIND
from pagedllm.backends.cpu.tensor_parallel.launch import (
    DISTRIBUTED_INIT_METHOD,
    NNODES,
    NODE_RANK,
    exit_reason,
    local_ranks,
    start_rank,
)
from pagedllm.config import EngineArgs, resolve
from pagedllm.errors import ConfigError
from pagedllm.logger import configure_logging

logger = logging.getLogger("pagedllm.cpu")
SETTINGS = (TENSOR_PARALLEL_SIZE, DISTRIBUTED_INIT_METHOD, NNODES, NODE_RANK, THREADS_BIND)


def parse(argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.backends.cpu.tensor_parallel.node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for s in SETTINGS:
        flags = (s.flag, s.short_flag) if s.short_flag else (s.flag,)
        parser.add_argument(*flags, dest=s.name, type=s.type, default=None,
                            help=f"{s.help} [env {', '.join((*s.env_aliases, s.env))}]")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    return resolve(EngineArgs(backend_options=given), backend_settings=SETTINGS).backend_options


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    try:
        options = parse(argv)
        if options["nnodes"] < 2 or options["node_rank"] == 0:
            raise ConfigError("this command runs the ranks of a node other than 0 (--nnodes 2 or more, --node-rank "
                              "1 or more); node 0 runs the engine: `pagedllm serve ... --node-rank 0`")
        ranks, plans = local_ranks(options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    processes = {rank: start_rank(rank, options["tensor_parallel_size"], options["distributed_init_method"], plan)
                 for rank, plan in zip(ranks, plans)}
    for rank, plan in zip(ranks, plans):
        logger.info("TP rank %d started (pid %d): %s", rank, processes[rank].pid, plan.describe())
    exits = {os.pidfd_open(p.pid): rank for rank, p in processes.items()}
    status = 0
    try:
        while exits:
            for fd in wait(list(exits)):
                rank = exits.pop(fd)
                os.close(fd)
                code = processes[rank].wait()
                if code:
                    logger.error("TP rank %d %s", rank, exit_reason(code))
                    status = 1
    except KeyboardInterrupt:
        status = 130
    finally:
        for p in processes.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return status


if __name__ == "__main__":
    sys.exit(main())
