"""`pagedllm serve -tp 2`: a rank killed mid-stream ends the open request with an error and turns /health 503; a clean
stop logs no traceback from any rank."""

import json
import os
import signal
import time
from pathlib import Path

import httpx


def rank_pid(root: int, rank: int) -> int:
    """The pid of a tensor-parallel rank started (directly or not) by process ``root``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            parents[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    for pid, (_, cmdline) in parents.items():
        if b"pagedllm.backends.cpu.tensor_parallel.worker" in cmdline and json.loads(cmdline[-2])["rank"] == rank:
            ancestor = pid
            while ancestor in parents and ancestor != root:
                ancestor = parents[ancestor][0]
            if ancestor == root:
                return pid
    raise LookupError(f"no rank {rank} under pid {root}")


def test_a_killed_rank_ends_open_requests_and_health_turns_503(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "-tp", "2", "--kv-cache-space", "0.05",
                          "--max-model-len", "512", "--served-model-name", "tiny", "--shutdown-timeout", "2")
    assert httpx.get(server.url + "/health").status_code == 200
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 400, "ignore_eos": True,
            "stream": True, "temperature": 0}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                killed_at = time.monotonic()
                os.kill(rank_pid(server.proc.pid, 1), signal.SIGKILL)
    assert time.monotonic() - killed_at < 10
    error = json.loads(next(e for e in events if '"error"' in e))["error"]
    assert error["type"] == "server_error" and "TP rank 1" in error["message"] and "SIGKILL" in error["message"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and "TP rank 1" in health.text


def test_a_clean_stop_logs_no_traceback_from_any_rank(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "-tp", "2", "--kv-cache-space", "0.05",
                          "--max-model-len", "256", env={"PAGEDLLM_LOGGING_LEVEL": "INFO"})
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert server.stop() == 0
    log = server.log()
    assert "Traceback" not in log and "Connection closed" not in log, log[-3000:]
