"""Offline throughput: start an engine, run a whole workload through it at once, report rates and KV numbers.

Greedy, EOS ignored, so every request produces exactly its output length and two engines do the same work.
``--structured-fraction`` puts that share of the requests under a JSON schema (structured outputs); the default
schema cannot be finished within any output length here, so those requests make exactly their length too.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from pagedllm.bench.report import print_report, write_json
from pagedllm.bench.workload import Workload, WorkloadError, add_workload_args, workload_from_args
from pagedllm.engine.arg_utils import add_cli_args, from_cli_args

# An array of at least 1000 people: always valid JSON so far, never complete within a benchmark's output length.
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"]}}


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--output-json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--structured-fraction", type=float, default=0.0, metavar="F",
                        help="share of the requests (spread evenly) held to --json-schema (default 0)")
    parser.add_argument("--json-schema", metavar="SCHEMA",
                        help="a JSON schema file or text for --structured-fraction (default: an array of at least "
                             "1000 {name, age, city} objects, which no request finishes)")
    add_cli_args(parser)


def run_throughput(args: argparse.Namespace) -> dict:
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    workload = Workload.load(args.workload) if args.workload else None  # a bad file fails before the start-up
    schema = _structured_schema(args)
    engine_args = from_cli_args(args)
    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup = time.perf_counter() - start
    engine = llm.engine
    try:
        workload = workload or workload_from_args(args, engine.tokenizer, engine.source.name, engine.config.seed)
        if args.save_workload:
            workload.save(args.save_workload)
        if engine.config.runner == "pooling":
            return _run_pooling(llm, workload, startup, args)
        if workload.max_len > engine.config.max_model_len:
            raise WorkloadError(f"the workload has a request of {workload.max_len} tokens (prompt + output), more "
                                f"than max_model_len {engine.config.max_model_len}; shorten it or raise "
                                f"--max-model-len")
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        fraction = args.structured_fraction
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True,
                                 structured_outputs={"json": schema} if int((i + 1) * fraction) > int(i * fraction)
                                 else None)
                  for i, r in enumerate(workload.requests)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    results = _results(engine, workload, outputs, elapsed, startup)
    results["num_structured_requests"] = sum(p.structured_outputs is not None for p in params)
    print_report("pagedllm throughput", _report_lines(results))
    if args.output_json:
        write_json(args.output_json, results)
    return results


def _run_pooling(llm, workload: Workload, startup: float, args: argparse.Namespace) -> dict:
    """An embedding model's throughput: the workload's prompts embedded (their output lengths unused)."""
    engine = llm.engine
    longest = max(len(r.prompt_token_ids) for r in workload.requests)
    if longest > engine.config.max_model_len:
        raise WorkloadError(f"the workload has a prompt of {longest} tokens, more than max_model_len "
                            f"{engine.config.max_model_len}; shorten it with --input-len")
    start = time.perf_counter()
    outputs = llm.embed([{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests])
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    e = engine.config
    results = {"workload": workload.name, "num_requests": len(outputs), "elapsed_time": elapsed,
               "total_prompt_tokens": tokens, "requests_per_second": len(outputs) / elapsed,
               "prompt_tokens_per_second": tokens / elapsed, "startup_seconds": startup,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "embedding_size": len(outputs[0].outputs.embedding) if outputs else 0,
               "engine": {"model": engine.source.name, "backend": e.backend, "dtype": engine.model_info.dtype,
                          "runner": "pooling", "max_num_seqs": e.max_num_seqs,
                          "max_num_batched_tokens": e.max_num_batched_tokens}}
    print_report("pagedllm embedding throughput", [
        ("workload", results["workload"]),
        ("engine", f"{e.model or engine.source.name} on {e.backend}, {engine.model_info.dtype}, pooling runner"),
        ("requests", f"{len(outputs)} prompts ({tokens} tokens) in {elapsed:.2f} s"),
        ("throughput", f"{results['requests_per_second']:.1f} sentences/s, {results['prompt_tokens_per_second']:.0f} "
                       f"tokens/s"),
        ("start-up (load to ready)", f"{startup:.1f} s")])
    if args.output_json:
        write_json(args.output_json, results)
    return results


def _results(engine, workload: Workload, outputs, elapsed: float, startup: float) -> dict:
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = engine.stats()
    config = engine.config
    return {
        "workload": workload.name,
        "num_requests": len(outputs),
        "elapsed_time": elapsed,
        "total_prompt_tokens": num_prompt,
        "total_output_tokens": num_output,
        "total_num_tokens": num_prompt + num_output,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (num_prompt + num_output) / elapsed,
        "output_tokens_per_second": num_output / elapsed,
        "startup_seconds": startup,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # the engine's process (Linux)
        "kv_blocks_total": engine.num_blocks,
        "kv_block_size": config.block_size,
        "peak_kv_blocks": stats.peak_kv_blocks,
        "kv_waste_at_peak": stats.kv_waste_at_peak,
        "prefix_cache_queried_tokens": stats.prefix_cache_queries if stats.prefix_caching else None,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits if stats.prefix_caching else None,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate if stats.prefix_cache_queries else None,
        "num_preemptions": stats.num_preemptions,
        "num_steps": stats.steps,
        "first_output_token_ids": list(outputs[0].outputs[0].token_ids[:16]) if outputs else [],
        "engine": {"model": engine.source.name, "backend": config.backend, "dtype": engine.model_info.dtype,
                   "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "enable_chunked_prefill": config.enable_chunked_prefill,
                   "enable_prefix_caching": config.enable_prefix_caching, "kv_cache_space": config.kv_cache_space},
    }


def _report_lines(r: dict) -> list[tuple[str, str]]:
    e = r["engine"]
    hit_rate = r["prefix_cache_hit_rate"]
    return [
        ("workload", r["workload"]),
        ("engine", f"{e['model']} on {e['backend']}, {e['dtype']}, prefix caching "
                   f"{'on' if e['enable_prefix_caching'] else 'off'}, chunked prefill "
                   f"{'on' if e['enable_chunked_prefill'] else 'off'}"),
        ("requests", f"{r['num_requests']} ({r['total_prompt_tokens']} prompt + {r['total_output_tokens']} output "
                     f"tokens) in {r['elapsed_time']:.2f} s"),
        ("throughput", f"{r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.1f} total tokens/s, "
                       f"{r['output_tokens_per_second']:.1f} output tokens/s"),
        ("start-up (load to ready)", f"{r['startup_seconds']:.1f} s"),
        ("peak KV blocks", f"{r['peak_kv_blocks']} of {r['kv_blocks_total']} ({r['kv_block_size']} tokens each)"),
        ("KV waste at peak", f"{100 * r['kv_waste_at_peak']:.2f}% of allocated slots"),
        ("prefix cache hit rate", "off" if r["prefix_cache_queried_tokens"] is None else
         f"{100 * (hit_rate or 0):.1f}% ({r['prefix_cache_hit_tokens']} of {r['prefix_cache_queried_tokens']} "
         f"prompt tokens)"),
        ("preemptions", str(r["num_preemptions"])),
        ("structured outputs", f"{r['num_structured_requests']} requests under a JSON schema"),
    ]


def _structured_schema(args: argparse.Namespace) -> dict | None:
    if not 0 <= args.structured_fraction <= 1:
        raise WorkloadError(f"--structured-fraction must be in [0, 1], got {args.structured_fraction}")
    if args.json_schema is None:
        return BENCH_SCHEMA
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as exc:
            raise WorkloadError(f"--json-schema {args.json_schema!r} is neither a JSON object nor a readable file: "
                                f"{exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"--json-schema is not valid JSON: {exc}") from None
