"""Prefix caching: questions about one long document, with the document's KV blocks computed once and reused.

Runs the same questions with prefix caching off, then on, and prints the speed-up and the hit rate.

    python examples/prefix_caching.py
    python examples/prefix_caching.py --backend openvino
"""

import argparse
import time

from pagedllm import LLM, SamplingParams

FRAMES = ("steel", "aluminium", "carbon", "titanium")


def document(num_bikes: int) -> str:
    """A catalogue; 48 bikes make ~1,700 tokens."""
    return "You answer questions about Northwind Bikes' catalogue, using only this list.\n" + "\n".join(
        f"- NW-{100 + i}: {FRAMES[i % 4]} frame, {3 + (i * 7) % 22} gears, {7 + (i * 37) % 130 / 10} kg, "
        f"{500 + (i * 263) % 3900} euros, {2 + i % 9} years of warranty." for i in range(num_bikes))


QUESTIONS = ["Which bike is the lightest?", "How many gears does the NW-103 have?", "What does the NW-105 cost?",
             "Which frame does the NW-108 have?", "How long is the warranty of the NW-111?"]


def run(args, caching: bool, params: SamplingParams) -> tuple[list[str], float, float | None]:
    """Answers to QUESTIONS[1:], their seconds, and the prefix-cache hit rate of their prompt tokens."""
    llm = LLM(args.model, backend=args.backend, enable_prefix_caching=caching, kv_cache_space=1)
    chats = [[{"role": "system", "content": document(args.bikes)}, {"role": "user", "content": q}] for q in QUESTIONS]
    llm.chat(chats[0], params, use_tqdm=False)  # the first question computes the document's blocks
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = llm.chat(chats[1:], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hit_rate = (after.prefix_cache_hits - before.prefix_cache_hits) / queries if caching and queries else None
    llm.shutdown()
    return [o.text for o in outputs], seconds, hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--backend", default=None, help="cpu (default), openvino, ...")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--bikes", type=int, default=48, help="catalogue entries (the shared prefix's length)")
    args = parser.parse_args()

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    answers_off, seconds_off, _ = run(args, False, params)
    answers_on, seconds_on, hit_rate = run(args, True, params)
    for question, answer in zip(QUESTIONS[1:], answers_on):
        print(f"Q: {question}\nA: {answer.strip()}\n")
    n = len(QUESTIONS) - 1
    print(f"prefix caching off: {seconds_off:.2f} s for {n} questions")
    print(f"prefix caching on:  {seconds_on:.2f} s for {n} questions, hit rate {100 * hit_rate:.1f}% of their "
          f"prompt tokens")
    print(f"speed-up: {seconds_off / seconds_on:.2f}x; same answers: {'yes' if answers_on == answers_off else 'no'}")


if __name__ == "__main__":
    main()
