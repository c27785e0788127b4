"""Tensor parallelism against one process on the same CPUs: W1 (64 requests x 256 prompt tokens -> 128 output
tokens, greedy) with ``-tp 2`` (ranks bound to ``0|1``, one core each) and with ``-tp 1`` (one process bound to
``0-1``), alternating within each round; prints each one's median output tok/s and the ratio TP2 / TP1.

Then the all-reduce's share of a TP=2 decode step: the median decode step of W1 (64 sequences) timed at the
engine, and the median time of the collectives one such step makes (two all-reduces of [64, hidden] per layer, one
for the embedding, the gather of the logits), run alone by two ranks bound as above.

The model is a random one of Qwen2.5-0.5B's shape (model_shapes.py): SmolLM2-135M's 9 heads do not split in two.

    python benchmarks/tensor_parallel.py --runs 3
    python benchmarks/tensor_parallel.py --smoke      # tiny version, to check the script works (numbers mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import model_shapes

from pagedllm.utils import cdiv

W1 = (64, 256, 128)
SMOKE = (8, 32, 16)
BINDS = {1: "0-1", 2: "0|1"}


def throughput(model: Path, tp: int, workload: tuple[int, int, int], dtype: str) -> float:
    prompts, input_len, output_len = workload
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput", "--model", str(model),
                        "--num-prompts", str(prompts), "--input-len", str(input_len), "--output-len", str(output_len),
                        "--dtype", dtype, "--kv-cache-space", "2", "--tensor-parallel-size", str(tp),
                        "--cpu-omp-threads-bind", BINDS[tp], "--output-json", str(out)], check=True)
        return json.loads(out.read_text())["output_tokens_per_second"]


def decode_step_seconds(model: Path, workload: tuple[int, int, int], dtype: str) -> float:
    """Median time of the TP=2 engine's steps in which all sequences of W1 decode."""
    from pagedllm import LLM, SamplingParams

    prompts, input_len, output_len = workload
    llm = LLM(str(model), dtype=dtype, kv_cache_space=2, tensor_parallel_size=2, cpu_omp_threads_bind=BINDS[2])
    backend, times = llm.engine.backend, []
    execute = backend.execute

    def timed(batch):
        start = time.perf_counter()
        logits = execute(batch)
        if batch.num_decodes == batch.num_seqs == prompts:
            times.append(time.perf_counter() - start)
        return logits

    backend.execute = timed
    ids = [[(7 * i + j) % 5000 + 10 for j in range(input_len)] for i in range(prompts)]
    llm.generate(ids, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return statistics.median(times)


def _collectives(rank: int, init: str, rows: int, hidden: int, vocab: int, layers: int, dtype: str, queue) -> None:
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = torch.randn(rows, hidden).to(getattr(torch, dtype))
    logits = torch.randn(1, rows, cdiv(vocab, 2)).to(getattr(torch, dtype))
    parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
    times = []
    for _ in range(30):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(2 * layers + 1):
            dist.all_reduce(x)
        dist.gather(logits, parts, dst=0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(statistics.median(times))
    dist.destroy_process_group()


def collectives_seconds(rows: int, hidden: int, vocab: int, layers: int, dtype: str) -> float:
    import torch.multiprocessing as mp

    from pagedllm.backends.cpu.tensor_parallel.launch import local_init_method, rank_env

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = local_init_method()  # as the engine's ranks meet on one machine
    os.environ.update(rank_env(init))
    procs = [ctx.Process(target=_collectives, args=(r, init, rows, hidden, vocab, layers, dtype, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="rounds; medians are taken (default 1)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()

    from pagedllm.backends.common.cpu_features import describe
    from pagedllm.models.source import cache_dir, resolve_model

    shape = model_shapes.SHAPES["qwen2.5-0.5b"]
    model = model_shapes.shaped_model("qwen2.5-0.5b", resolve_model(None).hf_dir, cache_dir())
    workload = SMOKE if args.smoke else W1
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.runs):
        for tp in (2, 1):
            rates[tp].append(throughput(model, tp, workload, args.dtype))
            print(f"TP={tp}: {rates[tp][-1]:.1f} output tok/s", flush=True)
    step = decode_step_seconds(model, workload, args.dtype)
    dtype = "bfloat16" if args.dtype == "auto" and "avx512_bf16 yes" in describe() else (
        "float32" if args.dtype == "auto" else args.dtype)
    comm = collectives_seconds(workload[0], shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"],
                               dtype)
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"\nCPU: {describe()}; workload {workload}; {args.runs} round(s); dtype {args.dtype}")
    print(f"TP=1 (0-1): {one:.1f} output tok/s; TP=2 (0|1): {two:.1f}; TP2/TP1 = {two / one:.2f}")
    print(f"TP=2 decode step ({workload[0]} sequences): {step * 1e3:.1f} ms; its collectives alone "
          f"({2 * shape['num_hidden_layers'] + 1} all-reduces of [{workload[0]}, {shape['hidden_size']}] {dtype} and "
          f"the logits gather): {comm * 1e3:.1f} ms = {comm / step:.0%} of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
