"""Every script in examples/ runs on the default model (SmolLM2-135M-Instruct), a few tokens each; the two client
examples share one server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import ServerProcess

from pagedllm.plugins import list_backends

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
OPENVINO = any(i.name == "openvino" and i.available for i in list_backends())
pytestmark = pytest.mark.slow


def run_example(name: str, *args: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("backend", [None])  # backend_selection.py runs the same model on openvino too
def test_offline_inference(backend):
    out = run_example("offline_inference.py", "--max-tokens", "4", *(["--backend", backend] if backend else []))
    lines = out.splitlines()
    assert len([line for line in lines if re.search(r" -> .* \([1-4] tokens, (length|stop)\)$", line)]) == 4, out
    assert lines[-1].startswith("chat -> "), out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-space", "0.1"],
                           tmp_path_factory.mktemp("examples-server") / "server.log")
    yield server
    server.stop()


def test_openai_completion_client(server):
    out = run_example("openai_completion_client.py", "--max-tokens", "4", env={"OPENAI_BASE_URL": server.url + "/v1"})
    assert re.search(r"^\[0\] '.*' \(finish_reason length, first token logprob -?\d+\.\d+\)$", out, re.M), out
    assert re.search(r"^\[1\] ", out, re.M), out
    assert re.search(r"^model SmolLM2-135M-Instruct: \d+ prompt \+ 8 completion tokens$", out, re.M), out


def test_openai_chat_client_streams(server):
    out = run_example("openai_chat_client.py", "What is the capital of France?", "--max-tokens", "12",
                      env={"OPENAI_BASE_URL": server.url + "/v1"})
    assert "Paris" in out
    streamed = int(re.search(r"\[(\d+) tokens streamed\]$", out.strip()).group(1))
    assert 1 <= streamed <= 12


def test_prefix_caching_prints_the_speed_up_and_the_hit_rate():
    out = run_example("prefix_caching.py", "--bikes", "12", "--max-tokens", "2")
    hit_rate = float(re.search(r"hit rate ([\d.]+)% of their prompt tokens", out).group(1))
    assert hit_rate > 80  # the ~450-token catalogue is cached; only each question's ~20 tokens are not
    assert re.search(r"^speed-up: \d+\.\d\dx; same answers: (yes|no)$", out, re.M), out


def test_backend_selection_runs_every_available_backend_and_compares_them():
    out = run_example("backend_selection.py", "--max-tokens", "4")
    assert re.search(r"^cpu: ready in ", out, re.M), out
    if OPENVINO:  # float32 with a float32 KV cache on both: the same greedy tokens
        assert "openvino vs cpu: 12 of 12 greedy tokens agree" in out, out
    else:
        assert "fewer than two backends ran" in out
