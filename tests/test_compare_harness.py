"""benchmarks/compare_vllm.py end to end on a tiny model: each engine runs in its own process, the openvino backend
beside OpenVINO GenAI on the same IR, and the summary pairs them (its numbers mean nothing at this size)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.backends.openvino.backend import OpenVINOBackend

OPENVINO, WHY_NOT = OpenVINOBackend.is_available()
ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "benchmarks" / "compare_vllm.py"


@pytest.mark.skipif(not OPENVINO, reason=f"openvino backend unavailable: {WHY_NOT}")
@pytest.mark.skipif(importlib.util.find_spec("openvino_genai") is None, reason="openvino-genai is not installed")
def test_smoke_run_pairs_the_openvino_backend_with_openvino_genai(tiny_llama, tmp_path, isolated_cache_dir):
    engines = ["pagedllm", "pagedllm-openvino", "openvino-genai"]
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(HARNESS), "--smoke", "--workloads", "W1", "--engines", ",".join(engines),
         "--openvino-kv-cache", "fp32", "--dtype", "float32", "--model", str(tiny_llama), "--work-dir", str(work),
         "--plot", str(tmp_path / "smoke.png")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PAGEDLLM_CACHE_DIR": str(isolated_cache_dir)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((work / "summary.json").read_text())
    assert summary["engines"] == engines and not summary["unavailable"] and not summary["failures"]
    throughput = summary["rows"][0]
    assert throughput["metric"] == "W1 output tok/s" and all(throughput[e] > 0 for e in engines)
    assert summary["results"]["W1-openvino-genai-nopc"][0]["total_output_tokens"] == 8 * 32
    # Same IR, fp32 inference and KV cache, the same token ids: the same greedy tokens.
    assert "W1 first request, first 16 greedy tokens: pagedllm-ov and OV GenAI agree" in summary["notes"]
    assert "pagedllm-ov/OV GenAI" in proc.stdout
    # --plot draws the run's own summary (test_compare_plot checks charts drawn from a summary file)
    assert proc.stdout.strip().endswith(f"chart: {tmp_path / 'smoke.png'}")
    assert (tmp_path / "smoke.png").stat().st_size > 0


def test_an_fp32_openvino_kv_cache_without_float32_inference_is_refused_before_any_run():
    proc = subprocess.run([sys.executable, str(HARNESS), "--engines", "pagedllm-openvino", "--openvino-kv-cache",
                           "fp32", "--dtype", "bfloat16"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--openvino-kv-cache fp32 needs float32 inference, and --dtype bfloat16 is bfloat16" in proc.stderr


def test_unknown_engines_are_refused_with_the_choices():
    proc = subprocess.run([sys.executable, str(HARNESS), "--engines", "pagedllm,sglang"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "--engines: unknown sglang; choose from pagedllm, vllm, transformers" in proc.stderr


def test_engines_take_turns_going_first_from_round_to_round():
    sys.path.insert(0, str(HARNESS.parent))
    try:
        import compare_vllm
    finally:
        sys.path.remove(str(HARNESS.parent))
    engines = ["pagedllm-openvino", "openvino-genai"]
    assert [compare_vllm.round_order(engines, r) for r in (1, 2, 3)] == [engines, engines[::-1], engines]
    assert engines == ["pagedllm-openvino", "openvino-genai"]  # the caller's list is left as it was


def test_served_workloads_pair_pagedllm_on_the_gguf_file_with_llama_server():
    """W3 serves the GGUF file from pagedllm and from llama-server; llama.cpp has no prefix cache to turn off, and
    its slots share one context, each as long as pagedllm's longest sequence."""
    sys.path.insert(0, str(HARNESS.parent))
    try:
        import compare_vllm
        import serving_case
    finally:
        sys.path.remove(str(HARNESS.parent))
    cases = compare_vllm.cases_for("W3", ["pagedllm-gguf", "llama.cpp", "transformers"])
    assert cases == [compare_vllm.Case("W3", "pagedllm-gguf", False), compare_vllm.Case("W3", "llama.cpp", None)]
    cmd = serving_case.server_command("llama.cpp", Path("m.gguf"), "float32", 2048, 8001, Path("llama-server"), [],
                                      threads=2, slots=32)
    assert cmd == ["llama-server", "--model", "m.gguf", "--host", "127.0.0.1", "--port", "8001", "--threads", "2",
                   "--threads-batch", "2", "--parallel", "32", "--ctx-size", str(32 * 2048)]


def test_the_w0_limit_counts_the_weights_a_decode_step_reads():
    """SmolLM2's GGUF ties its head to the embedding table, which a step then reads whole: every tensor counts."""
    import gguf

    from pagedllm.models.source import default_model_path

    sys.path.insert(0, str(HARNESS.parent))
    try:
        import decode_limit
    finally:
        sys.path.remove(str(HARNESS.parent))
    path = default_model_path()
    tensors = gguf.GGUFReader(str(path)).tensors
    assert "output.weight" not in {t.name for t in tensors}
    assert decode_limit.gguf_bytes_per_token(path) == sum(int(t.n_bytes) for t in tensors)
    line = "... quantized ones hold 835 MiB instead of 2357 MiB dense and dot ..."
    assert decode_limit.logged_quantized_bytes(line) == 835 << 20
    assert decode_limit.logged_quantized_bytes("linear layers: 30 packed for oneDNN") is None
    line = decode_limit.describe("llama.cpp", 10**9, 20e9, 15.0)
    assert line == ("W0 llama.cpp: 1.00 GB of weights per token, read at 20.0 GB/s: at most 20.0 tok/s; W0 at 75% "
                    "of it")
    assert decode_limit.read_bandwidth(threads=1, mib=64, repeat=1) > 0
