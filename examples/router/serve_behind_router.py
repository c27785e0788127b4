"""Several `pagedllm serve` replicas behind vLLM's router (vllm-router, cache-aware routing), on one machine, with one
command. Each replica runs on its own CPU set; the router sends a prompt to the replica whose prefix cache most
likely holds its start, and moves on from a replica that dies.

    pip install vllm-router                      # or sglang-router, with --router sglang
    python examples/router/serve_behind_router.py --replicas 2            # SmolLM2, router on :8000
    python examples/router/serve_behind_router.py MODEL --replicas 2 -- --dtype bfloat16   # flags after -- go to serve

On several machines, start `pagedllm serve --host 0.0.0.0 --api-key KEY` on each and point the router at them
(docker-compose.yml and kubernetes.yaml beside this script).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROUTERS = {"vllm": ["vllm-router"], "sglang": [sys.executable, "-m", "sglang_router.launch_router"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_sets(replicas: int) -> list[str]:
    """This process's CPUs cut into ``replicas`` contiguous runs, one per replica (VLLM_CPU_OMP_THREADS_BIND)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < replicas:
        raise SystemExit(f"{replicas} replicas need a CPU each; this process has {len(cpus)}")
    size = len(cpus) // replicas
    return [",".join(map(str, cpus[i * size:(i + 1) * size])) for i in range(replicas)]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


def start_replicas(model: str | None, replicas: int, serve_args: list[str], log_dir: Path,
                   env: dict | None = None) -> list[tuple[str, subprocess.Popen]]:
    """``replicas`` servers on 127.0.0.1, each bound to its CPU set: [(url, process)] once all are healthy."""
    started = []
    for rank, cpus in enumerate(cpu_sets(replicas)):
        port = free_port()
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([model] if model else []),
               "--port", str(port), *serve_args]
        with open(log_dir / f"replica-{rank}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {}), "VLLM_CPU_OMP_THREADS_BIND": cpus})
        started.append((f"http://127.0.0.1:{port}", proc))
    for url, proc in started:
        wait_healthy(url, proc)
    return started


def start_router(kind: str, policy: str, worker_urls: list[str], port: int, log_dir: Path) -> subprocess.Popen:
    cmd = [*ROUTERS[kind], "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--health-check-interval-secs", "1"]
    with open(log_dir / f"router-{kind}-{policy}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=60)
    return proc


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("model", nargs="?", help="what `pagedllm serve` takes (default: SmolLM2)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router", choices=ROUTERS, default="vllm")
    parser.add_argument("--policy", default="cache_aware", help="the router's policy (cache_aware, round_robin, ...)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--log-dir", type=Path, default=Path("."))
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    replicas = start_replicas(args.model, args.replicas, argv[split + 1:], args.log_dir)
    procs = [proc for _, proc in replicas]
    try:
        procs.append(start_router(args.router, args.policy, [url for url, _ in replicas], args.port, args.log_dir))
        print(f"serving at http://127.0.0.1:{args.port}/v1 ({args.router}-router, {args.policy}) over "
              f"{', '.join(url for url, _ in replicas)}; Ctrl-C stops all", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # to wait for them, not die
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
