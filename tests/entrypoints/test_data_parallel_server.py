"""``pagedllm serve --data-parallel-size 2``: two engine replicas, each in its own process on its own CPU, behind one
API server; prompts sharing a prefix go to the replica that holds it, and both replicas serve. The router alone,
without a model; a replica that dies ends the server as a dead core does."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM
from pagedllm.engine.data_parallel import BUSY_SLACK, PrefixRouter
from pagedllm.errors import ConfigError

BLOCK = 4


def test_a_shared_prefix_goes_to_the_replica_that_holds_it():
    router = PrefixRouter(2, BLOCK)
    alive = [True, True]
    first = router.choose(list(range(100, 120)), [0, 0], alive)
    other = router.choose(list(range(500, 520)), [1 if first == 0 else 0, 1 if first == 1 else 0], alive)
    assert other != first  # no shared prefix: the least busy replica
    load = [0, 0]
    load[first] = 2
    assert router.choose(list(range(100, 116)) + [7, 7, 7, 7], load, alive) == first  # 4 blocks in common
    load[first] = BUSY_SLACK
    assert router.choose(list(range(100, 120)), load, alive) != first  # the holder is too busy: balanced instead
    alive[other] = False
    assert router.choose(list(range(500, 520)), [0, 0], alive) == first  # a dead replica gets nothing


def test_llm_refuses_data_parallelism_with_a_clear_error(tiny_llama_dir):
    with pytest.raises(ConfigError, match="pagedllm serve"):
        LLM(str(tiny_llama_dir), data_parallel_size=2)


def per_engine(server) -> dict[str, dict[str, float]]:
    """/metrics by replica: {engine label: {sample name or name[table]: value}}."""
    readings: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if "engine" in sample.labels and "le" not in sample.labels:
                table = sample.labels.get("table")
                readings.setdefault(sample.labels["engine"], {})[sample.name + (f"[{table}]" if table else "")] = \
                    sample.value
    return readings


def test_two_replicas_serve_and_a_shared_prefix_stays_on_one(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-space",
                          "0.02", "--data-parallel-size", "2", env={"PAGEDLLM_LOGGING_LEVEL": "INFO"})
    assert "2 engine replicas bound to CPUs 0,1" in server.log() or os.cpu_count() < 2
    prefixes = [" ".join(f"w{p}x{i}" for i in range(40)) for p in range(6)]

    def complete(i: int) -> httpx.Response:
        body = {"prompt": f"{prefixes[i % 6]} and then {i}", "max_tokens": 4, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(complete, range(36)))
    assert {a.status_code for a in answers} == {200}
    texts = {}
    for i, answer in enumerate(answers):  # float32 greedy: a prompt's text does not depend on its replica
        texts.setdefault(f"{prefixes[i % 6]} and then {i}", set()).add(answer.json()["choices"][0]["text"])
    assert all(len(t) == 1 for t in texts.values())
    deadline = time.monotonic() + 30
    while True:
        engines = per_engine(server)
        idle = all(e["pagedllm:requests_tracked[engine]"] == 0 and e["pagedllm:requests_tracked[front_end]"] == 0
                   for e in engines.values())
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(engines) == {"0", "1"} and idle, engines
    assert all(e["vllm:generation_tokens_total"] > 0 for e in engines.values())  # both replicas served
    queried = sum(e["vllm:prefix_cache_queries_total"] for e in engines.values())
    hits = sum(e["vllm:prefix_cache_hits_total"] for e in engines.values())
    # 6 prefixes on 2 replicas: routed by prefix, each prefix is computed about once; scattered, up to twice
    assert hits / queried > 0.6, engines


def test_a_dead_replica_ends_the_server_for_its_supervisor(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-space",
                          "0.01", "-dp", "2", "--shutdown-timeout", "1")
    cores = server.children()
    assert len(cores) == 2
    os.kill(cores[1], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while httpx.get(server.url + "/health", timeout=5).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.proc.wait(30) == 1
    assert "engine core process exited unexpectedly" in server.log()
