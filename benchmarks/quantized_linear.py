"""One linear layer of the Llama-3.2-1B shape on quantized weights against the dense layer the cpu backend runs in
the same dtype, by row count, as ratios (dense time / quantized time: above 1 is faster than dense).

bf16 paths: ``int8`` (csrc/quantized_linear.cpp: activations quantized to int8 per 32 inputs, integer dot
products), ``bf16`` (csrc/quantized_linear_bf16.cpp: weights dequantized to bf16 tiles for brgemm), ``gemv_bf16``
(its few-row kernel). float32 paths (any x86-64 CPU): ``int16`` (csrc/quantized_linear.cpp's streaming kernel with
int16 activations) and ``tiles_f32`` (csrc/quantized_linear_f32.cpp: float32 blocks for the GEMM).
Both: ``dequantize`` (the whole weight dequantized per call, then torch's GEMM), for reference. Run on a quiet
machine:

    python benchmarks/quantized_linear.py [--dtype bfloat16|float32] [--formats q4_0,q8_0] [--rows 1,4,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm.backends.common.cpu_features import describe as describe_cpu
from pagedllm.backends.cpu.layers.packed_linear import use_packed_linears
from pagedllm.backends.cpu.layers.quant_formats import quantize, to_panels
from pagedllm.backends.cpu.runner.kernels import load_kernels

# (name, out_features, in_features) of the 1B shape's linears (q/k/v and gate/up fused, as the backend runs them)
SHAPES = (("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192))


def best_seconds(paths: dict, repeat: int, rounds: int = 7) -> dict[str, float]:
    """The fastest of ``rounds`` timings of each path, the paths taking turns in every round: a noisy neighbour
    slows a round of every path alike, and the minimum keeps the quiet moments."""
    for fn in paths.values():
        fn()
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(rounds):
        for path, fn in paths.items():
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            best[path] = min(best[path], (time.perf_counter() - start) / repeat)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="q4_0,q8_0")
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--shapes", default=",".join(name for name, _, _ in SHAPES))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels, _ = load_kernels("kernel")
    torch.set_num_threads(torch.get_num_threads())
    print(describe_cpu(), flush=True)
    results = []
    for name, n, k in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        weight = torch.randn(n, k) * 0.02
        dense = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(dtype)
        dense[0].weight.data.copy_(weight)
        use_packed_linears(dense, kernels)
        for fmt in args.formats.split(","):
            panels = to_panels(quantize(weight, fmt))
            quantized = (*panels.arguments, None)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k).to(dtype)
                repeat = max(1, int(4e8 / (2 * m * n * k + n * k * 8)))
                paths = {"dense": lambda: dense(x)}
                if dtype == torch.bfloat16:
                    paths.update({
                        "int8": lambda: kernels.quantized_linear(x, *quantized, False, 8),
                        "bf16": lambda: kernels.quantized_linear_bf16(x, *quantized, False),
                        "gemv_bf16": lambda: kernels.quantized_gemv_bf16(x, *quantized, False)})
                else:
                    paths.update({
                        "int16": lambda: kernels.quantized_linear(x, *quantized, False, 16),
                        "tiles_f32": lambda: kernels.quantized_linear_tiles_f32(x, *quantized, False)})
                paths["dequantize"] = lambda: torch.nn.functional.linear(
                    x, kernels.dequantize_weight(*quantized[:8], dtype == torch.bfloat16))
                with torch.inference_mode():
                    times = best_seconds(paths, repeat)
                tiles = "bf16" if dtype == torch.bfloat16 else "tiles_f32"
                row = {"shape": name, "format": fmt, "rows": m, "dense_ms": round(times["dense"] * 1e3, 3),
                       **{f"{p}_vs_dense": round(times["dense"] / t, 3) for p, t in times.items() if p != "dense"},
                       f"{tiles}_weight_GBps": round(panels.nbytes / times[tiles] / 1e9, 1)}
                results.append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
