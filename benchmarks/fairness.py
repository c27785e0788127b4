"""Fairness probe: how many engine steps a small request waits while one heavy request of each kind is in flight.

A "pacer" stream decodes one token per engine step beside everything else. A probe's steps waited is the larger of
two readings: the pacer tokens that arrive between sending the small request and its first token (a request held
in the queue while steps go on), and the small request's wait over the pacer's median step time before the heavy
one came (steps that stop or slow down). Alone it waits about 2 (the step in progress when it arrives, then its own
prefill); a heavy request that holds it shows as more.

The heavy kinds: a prompt at the model's length (chunked over several steps), the same prompt scored for its
logprobs (what lm-eval sends), a slow-compiling grammar (thousands of choices), a body of megabytes refused by its
length, and a list of prompts as long as the server takes. A probe counts only if the heavy request was still in
flight when the small one got its first token.

    python benchmarks/fairness.py --base-url http://127.0.0.1:8000     # a running server
    python benchmarks/soak.py MODEL --fairness -- ...                   # after a soak, on the soak's server
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

import httpx
from rates import print_summary

SMALL_PROMPT = "The capital of France is"
HUGE_BODY_BYTES = 9 * 1024 * 1024  # the size one probe of issue 40 sent four times
LEAD_SECONDS = 0.02  # between sending the heavy request and the small one: the heavy one is on its way
PACER_WARMUP_TOKENS = 6  # pacer tokens seen before a probe: five gaps give its median step on a slow box too


@dataclasses.dataclass
class Probe:
    kind: str
    steps_waited: float  # the larger of the two readings (module docstring)
    steps_counted: int  # pacer tokens between sending the small request and its first token
    heavy_status: int | None
    overlapped: bool  # the heavy request was still in flight when the small one got its first token
    small_seconds: float  # from sending the small request to its first token
    heavy_seconds: float | None  # from sending the heavy request to its answer


class Pacer:
    """A greedy stream that never stops early: the time of each of its tokens, one per engine step."""

    def __init__(self, http: httpx.AsyncClient, model: str, max_tokens: int) -> None:
        self.http, self.model, self.max_tokens = http, model, max_tokens
        self.token_times: list[float] = []
        self.warmed_up = asyncio.Event()

    async def run(self) -> None:
        body = {"model": self.model, "prompt": "a", "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    self.token_times.append(time.monotonic())
                    if len(self.token_times) >= PACER_WARMUP_TOKENS:
                        self.warmed_up.set()

    def steps_between(self, start: float, end: float) -> int:
        return sum(start < t <= end for t in self.token_times)

    def median_step(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.token_times, self.token_times[1:]))
        return gaps[len(gaps) // 2]


async def first_token_time(http: httpx.AsyncClient, model: str) -> float:
    body = {"model": model, "prompt": SMALL_PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return time.monotonic()
    raise RuntimeError("the small request's stream ended without a token")


def heavy_requests(model: str, max_model_len: int, max_prompts: int, choices: int,
                   words: list[int]) -> dict[str, dict | None]:
    """Each kind's request body (None: the small request alone, the baseline). ``words``: token ids of some text,
    repeated into a prompt of exactly the length wanted."""
    long_prompt = [words[i % len(words)] for i in range(max_model_len - 8)]
    return {
        "alone": None,
        "long_prompt": {"model": model, "prompt": long_prompt, "max_tokens": 1},
        "scored_long_prompt": {"model": model, "prompt": long_prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
        "slow_grammar": {"model": model, "prompt": "Pick one:", "max_tokens": 4, "structured_outputs": {
            # a new text each run: compiled grammars are cached
            "choice": [f"choice {i} of the list {time.time_ns()}" for i in range(choices)]}},
        "huge_body": {"model": model, "prompt": "word " * (HUGE_BODY_BYTES // 5), "max_tokens": 1},
        "prompt_list": {"model": model, "prompt": [f"story number {i}" for i in range(max_prompts)],
                        "max_tokens": 16, "ignore_eos": True},
    }


async def probe_kind(http: httpx.AsyncClient, model: str, kind: str, heavy: dict | None, max_tokens: int) -> Probe:
    pacer = Pacer(http, model, max_tokens)
    pacer_task = asyncio.create_task(pacer.run())
    await asyncio.wait_for(pacer.warmed_up.wait(), 120)
    step = pacer.median_step()
    heavy_done: list[float] = []
    heavy_task = None
    heavy_sent = time.monotonic()
    if heavy is not None:
        async def send_heavy() -> httpx.Response:
            response = await http.post("/v1/completions", json=heavy)
            heavy_done.append(time.monotonic())
            return response
        heavy_task = asyncio.create_task(send_heavy())
        await asyncio.sleep(LEAD_SECONDS)
    sent = time.monotonic()
    first = await first_token_time(http, model)
    status = (await heavy_task).status_code if heavy_task is not None else None
    await http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1})  # one more step
    pacer_task.cancel()
    try:
        await pacer_task
    except (asyncio.CancelledError, httpx.HTTPError):
        pass
    overlapped = heavy is None or (bool(heavy_done) and heavy_done[0] > first)
    counted = pacer.steps_between(sent, first)
    return Probe(kind, round(max(counted, (first - sent) / step), 1), counted, status, overlapped,
                 round(first - sent, 4), round(heavy_done[0] - heavy_sent, 4) if heavy_done else None)


async def run_probes(base_url: str, max_prompts: int, choices: int = 1300) -> list[Probe]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]
        max_model_len = model["max_model_len"]
        words = (await http.post("/tokenize", json={"model": model["id"], "prompt": "the story of a city by a river",
                                                    "add_special_tokens": False})).json()["tokens"]
        requests = heavy_requests(model["id"], max_model_len, max_prompts, choices, words)
        return [await probe_kind(http, model["id"], kind, heavy, max_model_len - 4) for kind, heavy in requests.items()]


def summarize(probes: list[Probe]) -> dict:
    return {p.kind: dataclasses.asdict(p) for p in probes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--max-prompts", type=int, default=1024,
                        help="the server's --max-prompts-per-request (the prompt list's length)")
    parser.add_argument("--grammar-choices", type=int, default=1300,
                        help="choices of the slow grammar (1300 stay under the default --structured-outputs-max-bytes)")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    probes = asyncio.run(run_probes(args.base_url, args.max_prompts, args.grammar_choices))
    print_summary(summarize(probes), args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
