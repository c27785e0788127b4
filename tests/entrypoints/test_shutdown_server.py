"""SIGTERM while 100 streams run: every stream ends complete or with an error event, never cut silently, and
`pagedllm serve` exits 0. Requests in flight get --shutdown-timeout to finish; those still running then end with
an error event."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

STREAMS = 100


async def stream_completion(http: httpx.AsyncClient, max_tokens: int, started: asyncio.Event,
                            running: set, index: int) -> dict:
    """One streamed completion, read to its end: what it ended with, as the client saw it."""
    body = {"prompt": "Paris is", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    finish_reason = error = None
    done = False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"status": response.status_code, "body": (await response.aread()).decode()}
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    continue
                running.add(index)
                if len(running) == STREAMS:
                    started.set()
                finish_reason = event["choices"][0]["finish_reason"] or finish_reason
    except httpx.TransportError as exc:
        return {"status": 200, "cut": repr(exc)}
    return {"status": 200, "finish_reason": finish_reason, "error": error, "done": done}


async def run_streams_and_terminate(server, max_tokens: int) -> list[dict]:
    started = asyncio.Event()
    running: set = set()  # the streams that have had a chunk
    limits = httpx.Limits(max_connections=STREAMS + 10)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        tasks = [asyncio.ensure_future(stream_completion(http, max_tokens, started, running, i))
                 for i in range(STREAMS)]
        await asyncio.wait_for(started.wait(), 120)  # every stream has had a chunk: all 100 are running
        server.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks)


def ended_cleanly(result: dict) -> bool:
    if result.get("status") != 200 or "cut" in result or not result["done"]:
        return False
    return result["finish_reason"] == "length" or result["error"] is not None


@pytest.mark.parametrize("timeout, max_tokens", [(30, 48), (1, 450)], ids=["streams-finish", "timeout-passes"])
def test_sigterm_under_100_streams(start_server, tiny_llama_dir, timeout, max_tokens):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-space",
                          "0.05", "--max-num-seqs", str(STREAMS), "--shutdown-timeout", str(timeout))
    results = asyncio.run(run_streams_and_terminate(server, max_tokens))
    assert server.proc.wait(60) == 0, server.log()
    assert [r for r in results if not ended_cleanly(r)] == []
    completed = sum(r["finish_reason"] == "length" and r["error"] is None for r in results)
    errors = [r["error"] for r in results if r["error"] is not None]
    if timeout == 30:
        assert completed == STREAMS  # they had time to finish
    else:
        assert errors, "the streams all finished within a second: the timeout path went untested"
        assert all(e["type"] == "server_error" for e in errors), errors
        assert all("shut down" in e["message"] for e in errors), errors
