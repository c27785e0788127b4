"""Batch-1 decode with and without speculative decoding (n-gram, or ``--draft-model``), in one process, as ratios.

- SmolLM2 (the default model) on prompts whose answers repeat spans of the prompt (an edit, a quoting summary, a
  code rewrite: ``COPY_PROMPTS``): what n-gram proposals are for.
- ``--model-shape llama-1b``: random weights never repeat, so two bounds instead: every proposal wrong (the cost of
  verifying k extra tokens for nothing) and every proposal right (the model's own greedy continuation proposed:
  what a step of k + 1 rows gains over k + 1 steps of one row when decode is bound by memory bandwidth).

- ``--draft-model PATH`` proposes with a draft model instead; ``--draft-model self`` with the target itself, which
  checks the verifier (nearly every proposal must be accepted) rather than gains anything.

Run on a quiet machine:
``python benchmarks/speculative_decoding.py [--model-shape llama-1b] [--k 4] [--draft-model PATH|self]``.
"""

from __future__ import annotations

import argparse
import json
import time

import model_shapes
from pagedllm import LLM, SamplingParams
from pagedllm.models.source import cache_dir, default_model_path, gguf_to_hf

TEXT = ("The paged KV cache stores keys and values in fixed-size blocks, so memory is allocated as sequences grow "
        "and almost none is wasted. One CPU box then serves many requests at once with continuous batching, and a "
        "prefix cache lets requests that share a system prompt reuse its blocks instead of computing them again.")
CODE = ("def total_price(items, tax):\n    total = 0\n    for item in items:\n        total += item.price * "
        "item.count\n    return total * (1 + tax)\n")
# Requests whose answers repeat spans of their prompts: an edit, a quoting summary, a code rewrite.
COPY_PROMPTS = (
    f"Repeat this text, writing 'CPU' in capitals as 'processor':\n\n{TEXT}",
    f"Quote the sentence of this text that says how memory is allocated, word for word:\n\n{TEXT}",
    f"Rewrite this Python function with the variable 'total' renamed to 'amount'. Answer with the code only."
    f"\n\n{CODE}",
)


class _Oracle:
    """Proposes ``continuation`` (the right tokens) or a token no continuation has (all wrong)."""

    model = None  # proposes itself

    def __init__(self, k: int, prompt: list[int], continuation: list[int], right: bool) -> None:
        self.num_speculative_tokens, self.disable_by_batch_size = k, 4
        self.prompt, self.continuation, self.right = prompt, continuation, right

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        done = len(token_ids) - len(self.prompt)
        proposal = self.continuation[done:done + min(limit, self.num_speculative_tokens)]
        return proposal if self.right else [3] * len(proposal)


def timed(llm: LLM, prompt, params: SamplingParams) -> tuple[float, list[int], int]:
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    steps = llm.engine._counters.steps
    start = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    return len(out.token_ids) / seconds, out.token_ids, llm.engine._counters.steps - steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-shape", choices=sorted(model_shapes.SHAPES), default=None)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-model", help="a draft model's path, or 'self' for the target itself")
    parser.add_argument("--batch-invariant", action="store_true", help="bf16 logits the same at any batch shape")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    model = None if args.model_shape is None else \
        str(model_shapes.shaped_model(args.model_shape, gguf_to_hf(default_model_path()), cache_dir()))
    if args.draft_model:
        draft = args.draft_model if args.draft_model != "self" else model or str(default_model_path())
        spec = {"model": draft, "num_speculative_tokens": args.k}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.model_shape is not None)
    settings = dict(dtype=args.dtype, max_model_len=1024, kv_cache_space=0.5, batch_invariant=args.batch_invariant)
    results = {}
    if args.model_shape is None:
        plain = LLM(model, **settings)
        prompts = [plain.apply_chat_template([{"role": "user", "content": text}]) for text in COPY_PROMPTS]
        baseline = [timed(plain, prompt, params) for prompt in prompts]
        plain.shutdown()
        fast = LLM(model, **settings, speculative_config=spec)
        counters = fast.engine._counters
        for i, (prompt, (rate, reference, steps)) in enumerate(zip(prompts, baseline)):
            proposed, accepted = counters.proposed_tokens, counters.accepted_tokens
            fast_rate, tokens, fast_steps = timed(fast, prompt, params)
            # equal in float32; in bf16 a k + 1-row GEMM sums in another order than a 1-row one (the precision
            # issue's batch-invariant mode is what makes them equal), so the texts may part after a while
            same = next((j for j, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                        min(len(tokens), len(reference)))
            results[f"prompt{i}"] = {
                "tokens": len(reference), "plain_tok_s": rate, "spec_tok_s": fast_rate, "ratio": fast_rate / rate,
                "steps": [steps, fast_steps], "same_tokens": same,
                "acceptance": (counters.accepted_tokens - accepted) / max(1, counters.proposed_tokens - proposed)}
        runs = [v for k, v in results.items() if k.startswith("prompt")]
        seconds_plain = sum(r["tokens"] / r["plain_tok_s"] for r in runs)
        seconds_spec = sum(r["tokens"] / r["spec_tok_s"] for r in runs)
        results["ratio_all_prompts"] = seconds_plain / seconds_spec  # the same token counts both ways
        results["acceptance_all_prompts"] = counters.accepted_tokens / max(1, counters.proposed_tokens)
    else:
        prompt = {"prompt_token_ids": list(range(100, 228))}
        plain = LLM(model, **settings)
        results["plain"], reference, _ = timed(plain, prompt, params)
        plain.shutdown()
        llm = LLM(model, **settings, speculative_config=spec)
        if args.draft_model:
            counters = llm.engine._counters
            results["draft"], tokens, results["draft_steps"] = timed(llm, prompt, params)
            results["draft_ratio"] = results["draft"] / results["plain"]
            results["draft_acceptance"] = counters.accepted_tokens / max(1, counters.proposed_tokens)
        for right in (False, True) if not args.draft_model else ():
            # "right" proposes what the wrong-proposal run generated: in bf16 a k + 1-row step's tokens may part from
            # a one-row step's, and the proposals must be the speculating engine's own greedy tokens
            llm.engine.scheduler.speculative = _Oracle(args.k, prompt["prompt_token_ids"], reference, right)
            name = "all_right" if right else "all_wrong"
            results[name], reference, results[name + "_steps"] = timed(llm, prompt, params)
            results[name + "_ratio"] = results[name] / results["plain"]
    def rounded(value):
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        return round(value, 3) if isinstance(value, float) else value

    print(json.dumps(rounded(results), indent=1))


if __name__ == "__main__":
    main()
