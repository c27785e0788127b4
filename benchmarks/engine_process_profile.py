"""Where a step's time goes when the engine core runs in a process of its own: the core's step, the core's
encoding of the step's outputs, and the front end's decoding and output processing (detokenizing, stop strings).

Runs W3's shape (32 requests, 256 random prompt tokens -> 64 tokens, greedy) in this process, all requests added
at once, and times each part per step; HTTP work (pydantic, SSE) is not in it: the serving case W3 of
compare_vllm.py measures the whole. Set VLLM_CPU_OMP_THREADS_BIND as for the server.

    python benchmarks/engine_process_profile.py [--model PATH] [--dtype auto] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedllm.bench.workload import random_workload
from pagedllm.config import EngineArgs
from pagedllm.engine.core import request_delta
from pagedllm.engine.core_client import core_request
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.messages import Step, core_decoder, encoder
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=args.dtype, max_model_len=2048),
                                        serving=True)
    workload = random_workload(engine.tokenizer, engine.source.name, args.num_prompts, args.input_len,
                               args.output_len, seed=0)
    processor = OutputProcessor(engine.tokenizer, frozenset(engine.eos_token_ids))
    encode, decode = encoder().encode, core_decoder().decode
    now = time.time()
    for i, request in enumerate(workload.requests):
        params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
        core = core_request(str(i), request.prompt_token_ids, params, now)
        engine.add_request(core.request_id, {"prompt_token_ids": core.prompt_token_ids}, core.params, now)
        processor.add(str(i), None, request.prompt_token_ids, params, now)

    times: dict[str, list[float]] = {"step": [], "encode": [], "decode": [], "process": []}
    sizes: list[int] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        data = encode(Step(time.time(), [request_delta(o) for o in outputs], engine.stats()))
        t2 = time.perf_counter()
        message = decode(data)
        t3 = time.perf_counter()
        processor.process(message.outputs, message.time)
        t4 = time.perf_counter()
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[key].append(seconds * 1000)
        sizes.append(len(data))
    engine.shutdown()

    total_step = sum(times["step"])
    print(f"{len(sizes)} steps of {engine.source.name} ({engine.model_info.dtype}); message size median "
          f"{statistics.median(sizes)} bytes")
    print(f"{'part':<40}{'median ms':>12}{'total ms':>12}{'of step time':>14}")
    for key, label in (("step", "core: LLMEngine.step"), ("encode", "core: outputs -> message (msgspec)"),
                       ("decode", "front end: message -> structs"),
                       ("process", "front end: detokenize, stop strings")):
        total = sum(times[key])
        print(f"{label:<40}{statistics.median(times[key]):>12.3f}{total:>12.1f}{100 * total / total_step:>13.2f}%")


if __name__ == "__main__":
    main()
