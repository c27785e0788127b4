"""`pagedllm serve` with its engine core in a process of its own, on a tiny Llama: what the split adds to the server
suite (which runs against it unchanged). The core dying ends open requests with errors, /health says 503 and the
server exits 1; SIGTERM stops both processes; per-request log lines and where each process runs are logged."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

IGNORE_EOS = {"ignore_eos": True}


def server_args(tiny_llama_dir) -> list[str]:
    return [str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-space", "0.01"]


def start_streaming(start_server, tiny_llama_dir, max_tokens: int, *flags: str, env: dict[str, str] | None = None):
    """A server, its engine core's pid, and a streamed completion of which the first chunk has arrived."""
    server = start_server(*server_args(tiny_llama_dir), *flags, env=env)
    [core] = server.children()
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = api.completions.create(model="llama", prompt="Paris", max_tokens=max_tokens, stream=True,
                                    extra_body=IGNORE_EOS)
    return server, core, api, stream, [next(stream)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_core_dying_fails_open_requests_then_the_server_exits_1(start_server, tiny_llama_dir):
    server, core, api, stream, chunks = start_streaming(start_server, tiny_llama_dir, 500, "--shutdown-timeout", "2")
    os.kill(core, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine core process exited unexpectedly"):
        for chunk in stream:
            chunks.append(chunk)
    assert len(chunks) < 500
    assert httpx.get(server.url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as info:
        api.completions.create(model="llama", prompt="Paris", max_tokens=2)
    assert info.value.status_code == 503
    assert server.proc.wait(60) == 1, server.log()


def test_sigterm_stops_both_processes(start_server, tiny_llama_dir):
    """Both froze their start-up heap (what a stop would otherwise wait seconds to collect)."""
    server, core, _, stream, chunks = start_streaming(start_server, tiny_llama_dir, 100,
                                                      env={"PAGEDLLM_LOGGING_LEVEL": "DEBUG"})
    assert server.log().count("start-up heap frozen") == 2, server.log()
    server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(60) == 0, server.log()
    deadline = time.monotonic() + 10
    while alive(core):
        assert time.monotonic() < deadline, "the engine core outlived the server"
        time.sleep(0.05)


def test_a_sigint_to_the_whole_group_drains_too(start_server, tiny_llama_dir):
    """Ctrl-C reaches every process of the terminal's group: the core leaves stopping to the front end."""
    server, core, _, stream, chunks = start_streaming(start_server, tiny_llama_dir, 100)
    os.kill(core, signal.SIGINT)
    server.proc.send_signal(signal.SIGINT)
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(60) == 0, server.log()


@pytest.mark.parametrize("flags, logged", [
    (["--enable-log-requests", "--max-log-len", "5"], "prompt 'Paris'"),
])  # without the flag no prompt is logged: test_hostile_requests.py
def test_request_log_lines(start_server, tiny_llama_dir, flags, logged):
    server = start_server(*server_args(tiny_llama_dir), *flags, env={"PAGEDLLM_LOGGING_LEVEL": "INFO"})
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    api.completions.create(model="llama", prompt="Paris is the capital of", max_tokens=2)
    assert server.stop() == 0
    log = server.log()
    assert "engine in its own process" in log
    assert "the front end" in log  # where it runs beside the core's CPUs
    request_lines = [line for line in log.splitlines() if "pagedllm.server: request cmpl-" in line]
    if logged is None:
        assert request_lines == []
    else:
        assert len(request_lines) == 1 and logged in request_lines[0], request_lines
