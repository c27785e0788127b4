"""`pagedllm serve --max-waiting-requests`: a request beyond the queue's bound gets a 503 with Retry-After in
OpenAI's error format, /metrics counts it, and the server serves again once the queue drains."""

from __future__ import annotations

import httpx
import openai

IGNORE_EOS = {"ignore_eos": True}
BODY = {"prompt": "Paris is", "max_tokens": 4, "ignore_eos": True}


def test_requests_beyond_the_queue_bound_get_503_with_retry_after(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-space",
                          "0.01", "--max-num-seqs", "1", "--max-waiting-requests", "1")
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def stream(max_tokens: int):
        return api.completions.create(model="llama", prompt="Paris", max_tokens=max_tokens, stream=True,
                                      extra_body=IGNORE_EOS)

    running = stream(450)
    next(running)  # it holds the only running slot
    waiting = stream(4)  # queued behind it: the queue is full
    response = httpx.post(server.url + "/v1/completions", json=BODY, timeout=60)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json() == {"error": {
        "message": "1 requests are already waiting (max_waiting_requests); try again later",
        "type": "server_error", "param": None, "code": 503}}
    metrics = server.metrics()
    assert metrics["pagedllm:requests_rejected_total"] == 1
    # the running and the waiting request, in the engine's tables, and in the front end's routes and text state
    assert metrics["pagedllm:requests_tracked[engine]"] > 0 and metrics["pagedllm:requests_tracked[front_end]"] == 4

    running.close()
    assert [c.choices[0].finish_reason for c in waiting][-1] == "length"
    assert httpx.post(server.url + "/v1/completions", json=BODY, timeout=60).status_code == 200
    assert server.wait_idle()["pagedllm:requests_rejected_total"] == 1
