"""Data parallelism against one engine and against tensor parallelism on the same CPUs, served: ``dp1`` (one
engine on all cores), ``dp2`` (``-dp 2``: two replicas, a core set each) and ``tp2`` (``-tp 2``: two ranks, a core
set each), each with ``pagedllm bench serve`` on W1 served (64 x 256 prompt tokens -> 128, all sent at once: a
throughput) and W3 (32 x 256 -> 64 at 3.5 requests/s: latencies). Configurations alternate within each run; the
medians of output tok/s and TPOT are printed with their ratios to dp1.

The model is a random one of Qwen2.5-0.5B's shape (model_shapes.py): SmolLM2-135M's 9 heads do not split in two.

    python benchmarks/data_parallel.py --runs 3
    python benchmarks/data_parallel.py --smoke        # tiny workloads, to check the script works
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import model_shapes
from rates import print_summary
from serving_case import free_port, run_serving_case

CONFIGS = {"dp1": [], "dp2": ["--data-parallel-size", "2"], "tp2": ["--tensor-parallel-size", "2"]}
WORKLOADS = {"W1": (64, 256, 128, "inf"), "W3": (32, 256, 64, "3.5")}
SMOKE = {"W1": (8, 32, 16, "inf"), "W3": (8, 32, 8, "3.5")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", help="a Hugging Face folder (default: the Qwen2.5-0.5B shape, random weights)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    from pagedllm.backends.common.cpu_features import describe
    from pagedllm.bench.workload import random_workload
    from pagedllm.models.source import cache_dir, load_tokenizer, resolve_model

    source = resolve_model(args.model or str(model_shapes.shaped_model("qwen2.5-0.5b", resolve_model(None).config_dir,
                                                                          cache_dir())))
    tokenizer = load_tokenizer(source)
    work = Path(tempfile.mkdtemp(prefix="pagedllm-dp-"))
    print(f"CPU: {describe()}; model {source.hf_dir}; logs in {work}", flush=True)
    paths = {}
    for name, (n, input_len, output_len, _) in (SMOKE if args.smoke else WORKLOADS).items():
        paths[name] = work / f"{name}.json"
        random_workload(tokenizer, source.name, n, input_len, output_len, seed=0).save(paths[name])
    results: dict = {name: {config: [] for config in CONFIGS} for name in paths}
    for run in range(args.runs):
        for config, flags in CONFIGS.items():
            for name, path in paths.items():
                port = free_port()
                rate = (SMOKE if args.smoke else WORKLOADS)[name][3]
                cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(source.hf_dir), "--port",
                       str(port), "--dtype", args.dtype, "--max-model-len", "1024", "--kv-cache-space", "1",
                       "--no-enable-prefix-caching", *flags]
                out = run_serving_case(cmd, dict(os.environ), port, path, float(rate), 2,
                                       work / f"{name}-{config}.json", work / f"{name}-{config}-{run}.log",
                                       timeout=1800)
                results[name][config].append({"output_tok_s": out["output_throughput"],
                                              "tpot_ms": out["tpot_ms"]["p50"]})
                print(f"run {run} {name} {config}: {out['output_throughput']:.1f} output tok/s, TPOT "
                      f"{out['tpot_ms']['p50']:.1f} ms", flush=True)
    summary = {"cpu": describe(), "model": str(source.hf_dir), "workloads": {}}
    for name, by_config in results.items():
        medians = {c: {k: statistics.median(r[k] for r in runs) for k in ("output_tok_s", "tpot_ms")}
                   for c, runs in by_config.items()}
        base = medians["dp1"]
        summary["workloads"][name] = {c: {**m, "tok_s_vs_dp1": round(m["output_tok_s"] / base["output_tok_s"], 3),
                                          "tpot_vs_dp1": round(m["tpot_ms"] / base["tpot_ms"], 3)}
                                      for c, m in medians.items()}
    print_summary(summary, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
