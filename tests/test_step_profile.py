"""benchmarks/step_profile.py's per-kernel timer on a tiny model: every part of a real step is accounted for, and the
kernels are left as they were."""

import importlib.util
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.runner.kernels import load_kernels

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(load_kernels("auto")[0] is None, reason="the C++ kernels could not be built here")


def _step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "benchmarks" / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_times_cover_the_step(tiny_llama):
    step_profile = _step_profile()
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01)
    backend = llm.engine.backend
    seen = []
    execute = backend.execute
    backend.execute = lambda batch: seen.append(batch) or execute(batch)
    llm.generate([[5, 9, 33, 71, 100, 7, 8]] * 2, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    backend.execute = execute
    kernels = backend.runner.kernels
    before = kernels.paged_decode_attention
    rows = dict((part, (ms, calls)) for part, ms, calls in step_profile.kernel_times(llm, seen[-1], repeat=2))
    layers = llm.engine.model_info.num_layers
    assert rows["paged_decode_attention"][1] == layers
    assert any(part.startswith("linear ") for part in rows)
    assert rows["step"][0] > 0 and all(ms >= 0 for part, (ms, _) in rows.items() if part != "rest (Python, torch ops)")
    assert kernels.paged_decode_attention is before  # restored
    llm.shutdown()
