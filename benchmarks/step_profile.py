"""Times single engine steps of W1's and W3's shapes, and compares variants of the backend in paired steps.

W1's batches are recorded from a real run (64 requests x 256 random prompt tokens, greedy): a 2048-token prefill
step and decode steps of 64 sequences. ``mixed16`` is the step that serves a W3 request its first token: 16
sequences decoding at context ~300 and one new 256-token prompt. Each chosen step is then re-run many times through
``backend.execute``, with ``--profile`` under torch.profiler (its op table, by self CPU time).

Paired steps compare variants on the same batches in one process: each ``--variant NAME:ENV=VALUE,...`` builds an
engine with those env vars set while it loads, and the variants run each step in turn, alternating, so a slow
phase of the machine hits them alike. The summary gives each variant's median and its ratio to the first.

    python benchmarks/step_profile.py --dtype bfloat16
    python benchmarks/step_profile.py --dtype bfloat16 --profile --steps decode64
    python benchmarks/step_profile.py --dtype bfloat16 --kernel-times --steps prefill2048,decode64,mixed16,decode1
    python benchmarks/step_profile.py --backend openvino --kv-cache-dtype fp16 --steps decode64,prefill2048
    python benchmarks/step_profile.py --variant base: --variant fused:PAGEDLLM_CPU_FUSED_QKV=1 --repeat 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

STEPS = ("prefill2048", "decode64", "decode1", "mixed16")
MIXED_DECODES = 16


def record_batches(llm, num_prompts: int, input_len: int, decode_steps: int) -> dict:
    """Run W1's start and keep the batches the backend saw: the first full prefill step and a decode step."""
    import numpy as np

    from pagedllm import SamplingParams

    backend = llm.engine.backend
    seen = []
    execute = backend.execute

    def recording(batch):
        seen.append(batch)
        return execute(batch)

    backend.execute = recording
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_info.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, input_len).tolist()} for _ in range(num_prompts)]
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True),
                     use_tqdm=False)
    finally:
        backend.execute = execute
    prefill = next(b for b in seen if b.num_decodes == 0 and b.num_tokens >= 2048)
    decodes = [b for b in seen if b.num_decodes == b.num_seqs == num_prompts]
    one = _first_row(decodes[-1])
    return {"prefill2048": prefill, "decode64": decodes[-1], "decode1": one,
            "mixed16": record_mixed_step(llm, prompts[:MIXED_DECODES + 1], decode_steps)}


def record_mixed_step(llm, prompts: list[dict], decode_steps: int):
    """The batch of the step that admits the last prompt while the others decode."""
    from pagedllm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 16, ignore_eos=True)
    ids = [engine.add_request(f"mixed-{i}", prompt, params) for i, prompt in enumerate(prompts[:-1])]
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(decode_steps):
        engine.step()
    seen = []
    execute = engine.backend.execute
    engine.backend.execute = lambda batch: seen.append(batch) or execute(batch)
    try:
        ids.append(engine.add_request("mixed-new", prompts[-1], params))
        engine.step()
    finally:
        engine.backend.execute = execute
        engine.abort_request(ids)
    return seen[0]


def _first_row(batch):
    """The decode batch cut to its first sequence."""
    import dataclasses

    return dataclasses.replace(
        batch, input_ids=batch.input_ids[:1], positions=batch.positions[:1], query_start_loc=batch.query_start_loc[:2],
        num_computed=batch.num_computed[:1], seq_lens=batch.seq_lens[:1], block_table=batch.block_table[:1],
        slot_mapping=batch.slot_mapping[:1], logits_indices=batch.logits_indices[:1], num_decodes=1)


def make_llm(args, env: dict[str, str]):
    from pagedllm import LLM

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        extra = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
        if args.quantization:
            extra["quantization"] = args.quantization
        return LLM(args.model, backend=args.backend, dtype=args.dtype, max_model_len=2048,
                   kv_cache_space=args.kv_cache_space, max_num_seqs=args.num_prompts, **extra)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def kernel_times(llm, batch, repeat: int) -> list[tuple[str, float, int]]:
    """(part, ms per step, calls per step) for each C++ kernel and each packed linear shape of the cpu backend, and
    the rest of the step: torch.profiler does not see the pybind kernels."""
    from collections import defaultdict

    from pagedllm.backends.cpu.layers import packed_linear

    kernels = getattr(getattr(llm.engine.backend, "runner", None), "kernels", None)
    if kernels is None:
        return []
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(name, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1
        return call

    names = [n for n in dir(kernels) if not n.startswith("_") and callable(getattr(kernels, n)) and n != "bind_threads"]
    originals = {n: getattr(kernels, n) for n in names}
    linear_classes = (packed_linear.PackedLinear, packed_linear.BrgemmLinear, packed_linear.BrgemmSiluAndMul)
    linear_forwards = {cls: cls.forward for cls in linear_classes}

    def timed_linear(forward):
        def linear(self, x):
            silu = " + SiLU-and-multiply" if getattr(self, "fuses_silu_and_mul", False) else ""
            return timed(f"linear {self.in_features}x{self.out_features}{silu}", forward)(self, x)
        return linear

    try:
        for n in names:
            setattr(kernels, n, timed(n, originals[n]))
        for cls, forward in linear_forwards.items():
            cls.forward = timed_linear(forward)
        llm.engine.backend.execute(batch)
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        for _ in range(repeat):
            llm.engine.backend.execute(batch)
        total = (time.perf_counter() - start) / repeat
    finally:
        for n in names:
            setattr(kernels, n, originals[n])
        for cls, forward in linear_forwards.items():
            cls.forward = forward
    rows = sorted(((n, 1e3 * t / repeat, calls[n] // repeat) for n, t in spent.items()), key=lambda r: -r[1])
    return rows + [("rest (Python, torch ops)", 1e3 * (total - sum(spent.values()) / repeat), 0),
                   ("step", 1e3 * total, 1)]


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    env = dict(item.split("=", 1) for item in settings.split(",") if item)
    return name or "base", env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--backend", default="cpu", help="cpu or openvino")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--kv-cache-space", type=float, default=1.0)
    parser.add_argument("--quantization", default=None, help="e.g. int8, q4_0 (default: the model's own)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=48, help="decode steps before the recorded one")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"which of {', '.join(STEPS)}")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:ENV=VALUE,... an engine loaded with these env vars (repeatable; default: one "
                             "engine as configured)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler's op table for each step (first "
                                                                "variant)")
    parser.add_argument("--kernel-times", action="store_true",
                        help="time in each C++ kernel and each linear layer shape per step (cpu backend, first "
                             "variant)")
    args = parser.parse_args()
    import torch

    variants = [parse_variant(v) for v in args.variant] or [("base", {})]
    llms = {name: make_llm(args, env) for name, env in variants}
    first = next(iter(llms.values()))
    # Each variant runs the same requests into its own cache (block sizes may differ) and replays its own batches.
    batches = {name: record_batches(llm, args.num_prompts, args.input_len, args.decode_steps)
               for name, llm in llms.items()}
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    for step in steps:
        batch = batches[variants[0][0]][step]
        times: dict[str, list[float]] = {name: [] for name in llms}
        for name, llm in llms.items():  # warm-up
            llm.engine.backend.execute(batches[name][step])
        order = list(llms.items())
        for round_ in range(args.repeat):
            # Each round starts at the next variant, so that no variant always runs right after the same one.
            for name, llm in order[round_ % len(order):] + order[:round_ % len(order)]:
                start = time.perf_counter()
                llm.engine.backend.execute(batches[name][step])
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times[variants[0][0]])
        print(f"{step} ({batch.num_seqs} sequences, {batch.num_tokens} tokens, context up to {batch.max_seq_len}):")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:>12}: {1e3 * median:8.1f} ms median ({1e3 * min(values):.1f}-{1e3 * max(values):.1f})"
                  f"   {base / median:5.3f}x the first")
        if args.profile:
            llm = first
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    llm.engine.backend.execute(batch)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if args.kernel_times:
            for part, ms, calls in kernel_times(first, batch, args.repeat):
                print(f"  {part:>28}: {ms:8.2f} ms" + (f"  ({calls} calls)" if calls > 1 else ""))
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
