"""Benchmarks: ``bench throughput`` (offline, on the engine) and ``bench serve`` (an OpenAI-compatible server).

``add_bench_parser(subparsers)`` adds ``bench`` with both commands to a CLI; ``python -m pagedllm.bench`` runs
them on their own.
"""

from __future__ import annotations

import argparse
import sys


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench throughput`` and ``bench serve`` to an argparse subparsers object; each sets ``func``."""
    from pagedllm.bench.serving import add_serve_args
    from pagedllm.bench.throughput import add_throughput_args

    bench = subparsers.add_parser("bench", help="measure throughput and serving latency",
                                  description="Benchmarks on token-id workloads that other engines can replay.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    p = sub.add_parser("throughput", help="offline throughput of the engine on a workload",
                       description="Run a whole workload through the engine (greedy, EOS ignored) and report "
                                   "requests/s, tokens/s, start-up time and KV cache numbers.")
    add_throughput_args(p)
    p.set_defaults(func=_run_throughput)
    p = sub.add_parser("serve", help="latency and throughput of an OpenAI-compatible server",
                       description="Stream completions from a running server (pagedllm, vLLM, llama.cpp) and "
                                   "report TTFT, TPOT, ITL and end-to-end latency.")
    add_serve_args(p)
    p.set_defaults(func=_run_serving)
    return bench


def _run_throughput(args: argparse.Namespace) -> int:
    from pagedllm.bench.throughput import run_throughput

    run_throughput(args)
    return 0


def _run_serving(args: argparse.Namespace) -> int:
    from pagedllm.bench.serving import run_serving

    run_serving(args)
    return 0


def main(argv: list[str] | None = None, prog: str = "pagedllm") -> int:
    """``pagedllm bench ...`` on its own: ``argv`` starts after ``bench``; known errors print one line, exit 2."""
    from pagedllm.bench.serving import ServerError
    from pagedllm.bench.workload import WorkloadError
    from pagedllm.errors import (
        BackendNotFoundError,
        ConfigError,
        InvalidRequestError,
        ModelNotFoundError,
        UnsupportedModelError,
    )

    parser = argparse.ArgumentParser(prog=prog)
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (BackendNotFoundError, ConfigError, InvalidRequestError, ModelNotFoundError, UnsupportedModelError,
            ServerError, WorkloadError) as exc:
        print(f"{prog} bench: error: {exc}", file=sys.stderr)
        return 2
