"""A real ``pagedllm serve`` process on 127.0.0.1 and a free port, for tests that drive it over HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT = 180.0
PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """/metrics parsed with prometheus-client's parser, histogram buckets left out: {sample name: value}, with a
    label beyond the model and engine ones as 'name[value]' (finished_reason, table)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            extra = [value for label, value in sample.labels.items() if label not in ("model_name", "engine")]
            samples[sample.name + (f"[{','.join(extra)}]" if extra else "")] = sample.value
    return samples


class ServerProcess:
    """``python -m pagedllm.entrypoints.cli serve ...``, its stderr in a file (shown when it fails to start)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, scheme: str = "http",
                 verify: bool | str = True) -> None:
        """``scheme`` https with ``verify`` (the CA file to trust) for a server started with TLS flags."""
        self.log_path = log_path
        self.verify = verify
        env = {**os.environ, "PAGEDLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
        # A free port is free only until someone binds it: while the server loads, other processes (tensor-parallel
        # ranks' gloo sockets, other tests) may take it, and then the server starts again on another.
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self.url = f"{scheme}://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *args, "--port", str(self.port)]
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                self._wait_ready()
                return
            except RuntimeError:
                if "address already in use" not in self.log() or attempt == PORT_ATTEMPTS - 1:
                    raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not start in {START_TIMEOUT} s:\n{self.log()}")

    def children(self) -> list[int]:
        """Pids of the server's child processes (its engine core)."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits, the KV cache is empty and no table holds a request; returns
        the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = (metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
                    and metrics["vllm:kv_cache_usage_perc"] == 0 and metrics["pagedllm:requests_tracked[engine]"] == 0
                    and metrics["pagedllm:requests_tracked[front_end]"] == 0)
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
