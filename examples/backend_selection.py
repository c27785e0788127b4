"""The same prompts on every available backend (or those named), and how far their greedy tokens agree.

In float32 with a float32 KV cache (the default here) the backends compute the same model exactly, so their
greedy tokens should agree; with --dtype auto each runs its fastest precision and may drift apart after a while.

    python examples/backend_selection.py
    python examples/backend_selection.py --backends cpu,openvino --dtype auto
"""

import argparse
import time

from pagedllm import LLM, SamplingParams
from pagedllm.plugins import list_backends

PROMPTS = ["The capital of France is", "Water boils at", "The three primary colours are"]


def agreement(a: list[int], b: list[int]) -> int:
    """How many tokens the two continuations share before they first differ."""
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--backends", default=None, help="comma-separated (default: every available one)")
    parser.add_argument("--dtype", default="float32", help="float32 (default: exact), auto, bfloat16")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    infos = list_backends()
    for info in infos:
        print(f"{info.name:<10} {info.package:<20} {'available' if info.available else info.reason}")
    names = args.backends.split(",") if args.backends else [i.name for i in infos if i.available]

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    for name in names:
        start = time.perf_counter()
        try:
            llm = LLM(args.model, backend=name, dtype=args.dtype,
                      kv_cache_dtype="fp32" if args.dtype == "float32" else "auto", kv_cache_space=1)
        except Exception as exc:  # a backend that cannot load this model is reported, not fatal
            print(f"\n{name}: could not start: {exc}")
            continue
        loaded = time.perf_counter() - start
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        print(f"\n{name}: ready in {loaded:.1f} s, generated in {time.perf_counter() - start - loaded:.2f} s")
        for prompt, output in zip(PROMPTS, outputs):
            print(f"  {prompt!r} -> {output.text!r}")
        tokens[name] = [o.token_ids for o in outputs]
        llm.shutdown()

    if len(tokens) < 2:
        print("\nfewer than two backends ran: nothing to compare")
        return
    first, *others = tokens
    print()
    for name in others:
        same = [agreement(a, b) for a, b in zip(tokens[first], tokens[name])]
        total = sum(len(t) for t in tokens[first])
        print(f"{name} vs {first}: {sum(same)} of {total} greedy tokens agree before the first difference "
              f"(per prompt: {', '.join(map(str, same))})")


if __name__ == "__main__":
    main()
