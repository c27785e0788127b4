"""Two `pagedllm serve` replicas behind vLLM's router (vllm-router), as examples/router/serve_behind_router.py starts
them, driven by benchmarks/router.py: a shared-prefix workload (8 prefixes x 4 requests, shuffled) hits the prefix
cache more under cache-aware routing than under round-robin, and killing one replica mid-workload loses no request
that was not on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm_router")
ROUTER_BENCH = Path(__file__).parents[2] / "benchmarks" / "router.py"


def test_cache_aware_routing_beats_round_robin_and_a_dead_replica_costs_only_its_requests(tiny_llama_dir, tmp_path):
    summary_path = tmp_path / "router.json"
    done = subprocess.run(
        [sys.executable, str(ROUTER_BENCH), str(tiny_llama_dir), "--prefixes", "8", "--per-prefix", "4",
         "--kill-one", "--output-json", str(summary_path), "--", "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-space", "0.02"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    by_policy = {p["policy"]: p for p in summary["policies"]}
    assert all(p["ok"] == p["requests"] == 32 for p in by_policy.values()), summary
    assert by_policy["cache_aware"]["hit_rate"] > by_policy["round_robin"]["hit_rate"] + 0.05, summary
    kill = summary["kill_one"]
    assert kill["failed"] <= kill["in_flight_bound"] and kill["after_kill_ok"], summary


def test_the_example_serves_through_the_router_with_one_command(tiny_llama_dir, tmp_path):
    import signal

    import openai
    from server_process import free_port

    port = free_port()
    example = Path(__file__).parents[2] / "examples" / "router" / "serve_behind_router.py"
    proc = subprocess.Popen([sys.executable, str(example), str(tiny_llama_dir), "--replicas", "2", "--port", str(port),
                             "--log-dir", str(tmp_path), "--", "--dtype", "float32", "--max-model-len", "256",
                             "--kv-cache-space", "0.01"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving at http://127.0.0.1:{port}/v1"), line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="llama", prompt="Paris is", max_tokens=4)
        assert reply.usage.completion_tokens == 4
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
