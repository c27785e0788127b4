"""Peak memory of loading a model with ``-tp 1`` and with ``-tp 2``: per process that holds weights, the kernel's
peak resident size (VmHWM, file-backed pages of the memory-mapped checkpoint included) and the peak of its own
anonymous memory (RssAnon, sampled every 20 ms: what loading costs the machine's RAM). TP ranks read only their
shard of each weight from the memory-mapped safetensors files (backends/cpu/runner/shard_loading.py).

    python benchmarks/tensor_parallel_load_memory.py                    # the Llama-3.2-1B shape, random weights
    python benchmarks/tensor_parallel_load_memory.py --model FOLDER
    python benchmarks/tensor_parallel_load_memory.py --quantization int8      # quantized at load
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import model_shapes
from proc_status import process_tree, status_kib

from pagedllm.models.source import cache_dir, resolve_model


def measure(model: str, tp: int, dtype: str, quantization: str | None) -> dict:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model", model, "-tp", str(tp),
           "--dtype", dtype, "--kv-cache-space", "0.05", "--max-model-len", "256", "--max-tokens", "1", "Hi"]
    cmd += ["--quantization", quantization] if quantization else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_anon: dict[int, int] = {}
    peak_hwm: dict[int, int] = {}
    while proc.poll() is None:
        for pid in process_tree(proc.pid):
            peak_anon[pid] = max(peak_anon.get(pid, 0), status_kib(pid, "RssAnon"))
            peak_hwm[pid] = max(peak_hwm.get(pid, 0), status_kib(pid, "VmHWM"))
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
    # the processes that held weights: the largest tp of them
    holders = sorted(peak_anon, key=peak_anon.get, reverse=True)[:tp]
    return {"tp": tp, "peak_anon_mib": [round(peak_anon[p] / 1024) for p in holders],
            "peak_rss_mib": [round(peak_hwm[p] / 1024) for p in holders]}


# What a process holds before any weight: torch, transformers and the C++ kernels loaded (a rank's floor)
FLOOR = """
import transformers, transformers.models.llama.modeling_llama
from pagedllm.backends.cpu.runner.kernels import load_kernels
load_kernels("auto")
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")))
"""


def floor_mib() -> int:
    out = subprocess.run([sys.executable, "-c", FLOOR], capture_output=True, text=True, check=True).stdout
    return round(int(out.split()[-1]) / 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder (default: a random model of the Llama-3.2-1B shape)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", help="as pagedllm's flag (int8, q4_0, q8_0; a GGUF file's own by default)")
    args = parser.parse_args()
    model = args.model or str(model_shapes.shaped_model("llama-1b", resolve_model(None).tokenizer_dir, cache_dir()))
    one, two = (measure(model, tp, args.dtype, args.quantization) for tp in (1, 2))
    summary = {"model": model, "quantization": args.quantization, "tp1": one, "tp2": two,
               "anon_ratio_per_rank": round(max(two["peak_anon_mib"]) / one["peak_anon_mib"][0], 3),
               "rss_ratio_per_rank": round(max(two["peak_rss_mib"]) / one["peak_rss_mib"][0], 3)}
    # the same ratio for the memory loading adds above a process's floor (which a larger model makes small)
    floor = summary["process_floor_mib"] = floor_mib()
    above = (max(two["peak_anon_mib"]) - floor) / (one["peak_anon_mib"][0] - floor)
    summary["anon_ratio_above_floor"] = round(above, 3)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
