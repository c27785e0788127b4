"""Offline throughput of vLLM on a pagedllm workload file; runs inside vLLM's own venv (no pagedllm there).

The requests go in as token ids (``TokensPrompt``), greedy with EOS ignored, exactly as ``pagedllm bench
throughput --workload`` runs them, and the results JSON uses the same field names.

    python vllm_offline.py --model HF_FOLDER --workload W.json --output-json out.json [--enable-prefix-caching]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rates import rate_fields, write_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--workload", required=True, help="pagedllm workload file (pagedllm bench --save-workload)")
    parser.add_argument("--output-json", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workload = json.loads(Path(args.workload).read_text())
    requests = workload["requests"]
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=args.enable_prefix_caching,
              seed=args.seed, disable_log_stats=False)
    startup = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start

    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    counters = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    queries = counters.get("vllm:prefix_cache_queries")
    hits = counters.get("vllm:prefix_cache_hits")
    import vllm

    results = {
        **rate_fields(workload["name"], len(outputs), num_prompt, num_output, elapsed, startup),
        "prefix_cache_queried_tokens": queries,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "num_preemptions": counters.get("vllm:num_preemptions"),
        "first_output_token_ids": list(outputs[0].outputs[0].token_ids[:16]),
        "engine": {"name": "vllm", "version": vllm.__version__, "model": args.model,
                   "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
                   "enable_prefix_caching": args.enable_prefix_caching},
    }
    write_results(args.output_json, results, f"vLLM {vllm.__version__}")


if __name__ == "__main__":
    main()
