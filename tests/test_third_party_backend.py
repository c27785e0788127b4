"""examples/third_party_backend: the `recording` backend, a separate package that registers itself through the
`pagedllm` entry-point group. In-process on a tiny model (what it records), then pip-installed for real into this
environment: listed by `pagedllm backends`, generating on the default model, uninstalled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.plugins.manager import get_backend_class, list_backends, register_plugin, unregister_plugin
from pagedllm.utils import cdiv

PACKAGE = Path(__file__).resolve().parent.parent / "examples" / "third_party_backend"
DISTRIBUTION = "pagedllm-recording"


@pytest.fixture
def recording(monkeypatch):
    """The package imported from its folder and registered by hand (as its entry point would)."""
    monkeypatch.syspath_prepend(str(PACKAGE))
    from pagedllm_recording import plugin

    register_plugin(plugin, name="recording", package=DISTRIBUTION)
    yield
    unregister_plugin("recording")
    for name in [m for m in sys.modules if m.startswith("pagedllm_recording")]:
        del sys.modules[name]


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_recording_wraps_the_cpu_backend_and_writes_every_step(recording, tiny_llama, tmp_path, monkeypatch):
    from pagedllm_recording.__main__ import summarize

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("PAGEDLLM_RECORDING_PATH", str(path))
    # A cpu backend whose default differs from Backend's 16 shows whose default the core read.
    monkeypatch.setattr(get_backend_class("cpu"), "default_block_size", 8)
    settings = dict(dtype="float32", kv_cache_space=0.01, max_num_batched_tokens=32, max_num_seqs=8)
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                            32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=6, ignore_eos=True)]
    recorded = LLM(str(tiny_llama), backend="recording", **settings)
    outputs = recorded.generate(prompts, params, use_tqdm=False)
    steps = recorded.engine.stats().steps
    recorded.shutdown()
    plain = LLM(str(tiny_llama), backend="cpu", **settings)
    expected = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[c.token_ids for c in o.outputs] for o in expected]

    events = read_events(path)
    start, end = events[0], events[-1]
    # The core read the block size and env names from the class: the wrapped cpu backend's 8, not Backend's 16.
    assert (start["event"], start["backend"], start["block_size"]) == ("start", "cpu", 8)
    assert start["max_num_batched_tokens"] == 32 and start["model_info"]["architecture"] == "llama"
    assert end == {"event": "end", "steps": steps}
    step_events = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in step_events] == list(range(1, steps + 1))
    assert step_events[0]["num_tokens"] == 32  # the 39 prompt tokens are cut into chunks of the 32-token budget
    for e in step_events:
        assert sum(e["query_lens"]) == e["num_tokens"] <= 32 and e["seconds"] > 0
        assert [a + q for a, q in zip(e["num_computed"], e["query_lens"])] == e["seq_lens"]
        assert [len(row) for row in e["block_table"]] == [cdiv(n, 8) for n in e["seq_lens"]]
        assert e["logits_shape"][0] == len(e["logits_indices"])
    # n=2 forks the second prompt after its prefill: its partial last block is copied for the sibling.
    copies = [e for e in events if e["event"] == "copy_blocks"]
    assert len(copies) == 1 and len(copies[0]["src"]) == 1
    summary = summarize(str(path))
    assert summary[0] == (f"cpu backend, model llama: {start['num_blocks']} blocks of 8 tokens, budget 32 tokens "
                          f"per step")
    assert summary[-1].startswith(f"{steps} steps in all;") and summary[-1].endswith("1 block copies; ended cleanly")


def test_a_wrapped_backend_that_is_unknown_or_itself_makes_recording_unavailable(recording, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_RECORDING_BACKEND", "nope")
    info = {i.name: i for i in list_backends()}["recording"]
    assert not info.available and "unknown backend 'nope'" in info.reason and info.package == DISTRIBUTION
    monkeypatch.setenv("PAGEDLLM_RECORDING_BACKEND", "recording")
    with pytest.raises(ValueError, match="the recording backend cannot wrap itself"):
        get_backend_class("recording")


def cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env_extra or {})})


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def installed(tmp_path):
    """`pip install` of the package (from a copy, so the build leaves nothing in the repo); uninstalled after, also
    when the test fails."""
    source = shutil.copytree(PACKAGE, tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    proc = pip("install", "--no-deps", "--no-build-isolation", str(source))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield
    pip("uninstall", "--yes", DISTRIBUTION)  # a no-op when the test uninstalled it


@pytest.mark.slow
def test_pip_install_lists_generates_and_uninstalls(installed, tmp_path):
    listing = cli("backends")
    assert listing.returncode == 0, listing.stderr
    assert "recording  (pagedllm-recording)  available" in listing.stdout.splitlines(), listing.stdout

    path = tmp_path / "steps.jsonl"
    env = {"PAGEDLLM_RECORDING_PATH": str(path), "PAGEDLLM_RECORDING_BACKEND": "cpu"}
    out = cli("generate", "--backend", "recording", "--max-tokens", "4", "--kv-cache-space", "0.1", "--max-model-len",
              "1024", "Tell me about Paris", env_extra=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
    events = read_events(path)
    assert events[0]["model"] == "SmolLM2-135M-Instruct" and events[-1]["event"] == "end"
    assert 1 <= events[-1]["steps"] <= 4  # the prompt's step and up to 3 decodes (4 tokens, or EOS sooner)
    summary = subprocess.run([sys.executable, "-m", "pagedllm_recording", str(path)], capture_output=True,
                             text=True, check=True).stdout
    assert "ended cleanly" in summary

    proc = pip("uninstall", "--yes", DISTRIBUTION)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listing = cli("backends")
    assert listing.returncode == 0 and "recording" not in listing.stdout, listing.stdout
