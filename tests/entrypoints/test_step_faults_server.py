"""`pagedllm serve` on the test-only ``faulty`` backend (the cpu backend raising on command; an entry point on
PYTHONPATH registers it in both the server and its engine-core process): a failed step answers its requests with a
500 in OpenAI's format (an error event in a stream) and the server goes on; failures in a row kill the engine,
/health says 503 and serve exits 1."""

from __future__ import annotations

import concurrent.futures
import time

import faulty_backend
import httpx
import openai
import pytest

IGNORE_EOS = {"ignore_eos": True}
MODES = {"engine-process": [], "engine-thread": ["--no-engine-process"]}


@pytest.fixture
def start_faulty(start_server, tiny_llama_dir, tmp_path):
    """Start a server on the faulty backend; returns it, an openai client and the file that arms the fault."""
    faults = tmp_path / "faults"
    env = {"PYTHONPATH": faulty_backend.plugin_path(tmp_path / "plugin"), faulty_backend.FAULTS_ENV: str(faults)}

    def start(*flags: str, env_extra: dict | None = None):
        server = start_server(str(tiny_llama_dir), "--backend", faulty_backend.NAME, "--dtype", "float32",
                              "--max-model-len", "512", "--kv-cache-space", "0.01", *flags,
                              env={**env, **(env_extra or {})})
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return server, api, faults

    return start


def complete(api, max_tokens: int = 8, **kwargs):
    return api.completions.create(model="llama", prompt="Paris is", max_tokens=max_tokens, temperature=0,
                                  extra_body=IGNORE_EOS, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, text: str) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert text in error["message"]


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_step_fails_its_request_and_the_server_goes_on(start_faulty, mode):
    server, api, faults = start_faulty(*MODES[mode])
    expected = complete(api).choices[0].text

    faulty_backend.arm(faults)
    response = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Paris is", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert_openai_error(response, 500, "InjectedFault")
    assert complete(api).choices[0].text == expected  # the same request again

    stream = complete(api, max_tokens=450, stream=True)  # long enough to be running when the fault is armed
    first = next(stream)
    faulty_backend.arm(faults)
    with pytest.raises(openai.APIError, match="InjectedFault"):
        list(stream)
    assert first.choices[0].text == expected[:len(first.choices[0].text)]

    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(api).choices[0].text == expected
    metrics = server.wait_idle()
    assert metrics["vllm:kv_cache_usage_perc"] == 0 and metrics["vllm:num_requests_running"] == 0
    assert metrics["pagedllm:requests_tracked[engine]"] == metrics["pagedllm:requests_tracked[front_end]"] == 0
    assert metrics["pagedllm:requests_failed_total"] == 2


@pytest.mark.parametrize("mode", MODES)
def test_failures_in_a_row_kill_the_engine_and_serve_exits_1(start_faulty, mode):
    server, api, faults = start_faulty("--max-consecutive-step-failures", "2", "--shutdown-timeout", "2",
                                       *MODES[mode])
    faulty_backend.arm(faults, 2)
    with pytest.raises(openai.InternalServerError) as first:
        complete(api)
    assert first.value.status_code == 500
    with pytest.raises(openai.InternalServerError) as second:  # in flight as the engine dies
        complete(api)
    assert second.value.status_code == 503
    assert_openai_error(httpx.get(server.url + "/health"), 503, "InjectedFault")
    assert server.proc.wait(60) == 1
    log = server.log()
    assert "a step failed (2 in a row, the engine stops at 2) running requests cmpl-" in log
    assert "InjectedFault: injected fault" in log


def test_health_turns_503_while_a_step_hangs_and_back_after(start_faulty, tmp_path):
    server, api, faults = start_faulty(env_extra={"VLLM_ENGINE_ITERATION_TIMEOUT_S": "1"})
    faulty_backend.hang(faults, 5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, api)
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health").status_code == 200:
            assert time.monotonic() < deadline, "/health never said the engine is stalled"
            time.sleep(0.2)
        stalled = httpx.get(server.url + "/health")
        assert stalled.status_code == 503 and "no progress" in stalled.json()["error"]["message"]
        assert pending.result().choices[0].finish_reason == "length"  # the step ends; the request is served
    assert httpx.get(server.url + "/health").status_code == 200
