"""Soak: many mixed requests through a real ``pagedllm serve``, then checks that nothing leaked.

The mix (seeded): streamed and whole completions and chats, n > 1, stop strings, scoring (prompt logprobs, as
lm-eval asks for them, and vLLM's prompt_logprobs field), seeded sampling (each seeded request is sent twice and
must come back the same), streams dropped at a random point, streams dropped before their first token (most of them
still queued), bad sampling parameters and prompts longer than the model (both must get a 400 in OpenAI's error
format). No request may get a 5xx. In bf16 the logits depend slightly on the batch's shape, so a seeded pair may
differ: those are counted, and fail the soak only when the server runs ``--dtype float32``.

Afterwards: the KV cache is empty, the engine's and the front end's request tables are empty (``/metrics``), every
valid request was answered, and the server's peak RSS (its engine-core process included) grew by less than
``--max-rss-growth`` between the first and the last quarter of the requests after warm-up.

With ``--fairness``, benchmarks/fairness.py's probe runs on the same server afterwards: a small request beside one
heavy request of each kind (a prompt at the model's length, scored or not, a slow grammar, a huge body, a long list
of prompts). The soak fails if a small request beside a long prompt or a slow grammar (one taking a second or more)
waited half as long as that heavy request took: it was held behind it.

With ``--mix pooling`` the requests are an embedding model's (``-- --runner pooling``): embeddings of one input or
several, base64, Matryoshka dimensions, scores, reranking, bad fields and inputs too long.

    python benchmarks/soak.py --requests 2000                   # the embedded SmolLM2
    python benchmarks/soak.py MODEL --requests 300 -- --dtype float32 --max-num-seqs 8

Prints a JSON summary (``--output-json`` keeps it) and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from fairness import run_probes  # noqa: E402
from proc_status import process_tree, status_kib  # noqa: E402
from rates import print_summary  # noqa: E402
from serving_case import free_port, log_tail, wait_ready  # noqa: E402

# What each request of the mix is, with its weight.
KINDS = {"stream": 20, "complete": 12, "chat_stream": 12, "chat": 6, "n": 8, "stop": 8, "seeded": 8,
         "score": 6, "prompt_logprobs": 4, "drop_mid_stream": 10, "drop_before_first_token": 6, "bad_params": 6,
         "oversize": 4}
BAD_PARAMS = [{"temperature": -1}, {"top_p": 1.5}, {"max_tokens": -5}, {"n": 0}, {"presence_penalty": 5},
              {"top_k": -5}, {"seed": 2 ** 80}, {"logprobs": -1}, {"stop": 5}]
WORDS = ("the of and to in is was for on that with as by at from his her an which have were are this be one "
         "city river paris london music science history water light north south story").split()
# Heavy requests a small one must not wait behind (a list of prompts is served first come, first served, as vLLM).
HELD_KINDS = ("long_prompt", "scored_long_prompt", "slow_grammar")
HELD_MIN_SECONDS = 1.0  # a heavy request shorter than this is not judged: HTTP and tokenizing overheads dominate
# The mix for an embedding model (--mix pooling): /v1/embeddings with one input or several, float or base64,
# Matryoshka dimensions; /v1/score; /v1/rerank; bad parameters and inputs too long, which must get a 400.
POOLING_KINDS = {"embed": 25, "embed_list": 15, "embed_base64": 10, "embed_dimensions": 8, "pair_score": 12,
                 "rerank": 12, "bad_embed": 10, "oversize_embed": 8}
BAD_EMBED = [{"dimensions": 0}, {"encoding_format": "hex"}, {"input": []}, {"input": [[]]}, {"dimensions": 2 ** 40},
             {"input": 5}]
# A bounded KV cache: its pages are faulted in as blocks are first used, which is growth by design, not a leak.
DEFAULT_SERVER_ARGS = ["--max-num-seqs", "16", "--enable-prefix-caching", "--kv-cache-space", "0.5"]
# oneDNN's primitive cache and ideep's descriptor cache keep ~0.27 MB per linear shape and token count, up to 1024
# entries each by default (~420 MB on SmolLM2), which takes thousands of steps to fill. Bounded is not a leak:
# smaller caps let them fill within warm-up, so that what grows after it is what leaks.
SHAPE_CACHE_CAPS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


@dataclasses.dataclass
class Outcome:
    kind: str
    ok: bool
    status: int | None = None
    problem: str | None = None
    seconds: float = 0.0
    diverged: bool = False  # a seeded pair that came back as two texts


class RSSSampler:
    """Samples the server's resident size (its process and descendants) every ``interval`` s, tagged with how
    many requests had finished."""

    def __init__(self, pid: int, progress, interval: float = 0.1) -> None:
        self.pid, self.progress, self.interval = pid, progress, interval
        self.samples: list[tuple[int, int]] = []  # (requests finished, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = sum(status_kib(pid, "VmRSS") * 1024 for pid in process_tree(self.pid))
            self.samples.append((self.progress(), rss))


def rss_growth(samples: list[tuple[int, int]], warmup: int, total: int) -> dict:
    """Peak RSS in the first and the last quarter of the requests after warm-up, and the growth between them."""
    span = (total - warmup) / 4
    first = [rss for done, rss in samples if warmup <= done < warmup + span]
    last = [rss for done, rss in samples if done >= total - span]
    tenths = [[rss for done, rss in samples if total * i / 10 <= done < total * (i + 1) / 10] for i in range(10)]
    trace = [round(max(t) / 2 ** 20, 1) if t else None for t in tenths]
    if not first or not last:
        return {"first_quarter_peak_mib": None, "last_quarter_peak_mib": None, "growth": None,
                "peak_mib_by_tenth": trace}
    return {"first_quarter_peak_mib": round(max(first) / 2 ** 20, 1),
            "last_quarter_peak_mib": round(max(last) / 2 ** 20, 1), "growth": round(max(last) / max(first) - 1, 4),
            "peak_mib_by_tenth": trace}


class Soak:
    def __init__(self, http: httpx.AsyncClient, model: str, max_model_len: int, seed: int,
                 kinds: dict[str, int] = KINDS) -> None:
        self.http, self.model, self.max_model_len = http, model, max_model_len
        self.rng = random.Random(seed)
        self.kinds = kinds

    def prompt(self) -> str:
        return " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, 40)))

    def plan(self, count: int) -> list[tuple[str, dict]]:
        """The requests, in order: (kind, its arguments), drawn from the seeded generator."""
        kinds = self.rng.choices(list(self.kinds), weights=list(self.kinds.values()), k=count)
        return [(kind, {"prompt": self.prompt(), "max_tokens": self.rng.randint(1, 32),
                        "drop_after": self.rng.randint(1, 4), "bad": self.rng.choice(BAD_PARAMS),
                        "n": self.rng.randint(2, 3), "seed": self.rng.randint(0, 2 ** 31),
                        "stop": self.rng.choice(WORDS[:10]), "inputs": [self.prompt() for _ in range(8)],
                        "bad_embed": self.rng.choice(BAD_EMBED)}) for kind in kinds]

    async def run(self, kind: str, spec: dict) -> Outcome:
        start = time.monotonic()
        try:
            outcome = await getattr(self, f"_{kind}")(spec)
        except (httpx.TransportError, ValueError, KeyError) as exc:
            outcome = Outcome(kind, False, problem=f"{type(exc).__name__}: {exc}")
        outcome.kind, outcome.seconds = kind, time.monotonic() - start
        return outcome

    # -- the kinds ---------------------------------------------------------------------------------
    def _completion(self, spec: dict, **extra) -> dict:
        return {"model": self.model, "prompt": spec["prompt"], "max_tokens": spec["max_tokens"], **extra}

    def _chat_body(self, spec: dict, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": spec["prompt"]}],
                "max_tokens": spec["max_tokens"], **extra}

    async def _stream(self, spec: dict) -> Outcome:
        return await self._read_stream("/v1/completions", self._completion(spec, stream=True))

    async def _chat_stream(self, spec: dict) -> Outcome:
        return await self._read_stream("/v1/chat/completions", self._chat_body(spec, stream=True))

    async def _complete(self, spec: dict) -> Outcome:
        response = await self.http.post("/v1/completions", json=self._completion(spec))
        return _answered(response, choices=1)

    async def _chat(self, spec: dict) -> Outcome:
        response = await self.http.post("/v1/chat/completions", json=self._chat_body(spec))
        return _answered(response, choices=1)

    async def _n(self, spec: dict) -> Outcome:
        body = self._completion(spec, n=spec["n"], temperature=0.9, seed=spec["seed"])
        return _answered(await self.http.post("/v1/completions", json=body), choices=spec["n"])

    async def _stop(self, spec: dict) -> Outcome:
        body = self._completion(spec, stop=[spec["stop"]], temperature=0.9)
        response = await self.http.post("/v1/completions", json=body)
        outcome = _answered(response, choices=1)
        if outcome.ok and spec["stop"] in response.json()["choices"][0]["text"]:
            return Outcome("", False, 200, "the stop string is in the text")
        return outcome

    async def _seeded(self, spec: dict) -> Outcome:
        body = self._completion(spec, temperature=1.0, top_p=0.9, seed=spec["seed"])
        first, second = [await self.http.post("/v1/completions", json=body) for _ in range(2)]
        outcome = _answered(first, choices=1)
        outcome.diverged = outcome.ok and first.json()["choices"][0]["text"] != second.json()["choices"][0]["text"]
        return outcome

    async def _score(self, spec: dict) -> Outcome:
        """What lm-eval's loglikelihood tasks send: the prompt scored (echo, logprobs), nothing generated."""
        body = self._completion(spec, max_tokens=0, echo=True, logprobs=1)
        response = await self.http.post("/v1/completions", json=body)
        outcome = _answered(response, choices=1)
        if outcome.ok:
            logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
            if not logprobs or logprobs[0] is not None or None in logprobs[1:]:
                return Outcome("", False, 200, f"prompt logprobs {logprobs[:3]}...")
        return outcome

    async def _prompt_logprobs(self, spec: dict) -> Outcome:
        """vLLM's prompt_logprobs field beside generated tokens: an entry per prompt token, None for the first."""
        body = self._completion(spec, prompt_logprobs=2, temperature=0)
        response = await self.http.post("/v1/completions", json=body)
        outcome = _answered(response, choices=1)
        if outcome.ok:
            entries = response.json()["choices"][0]["prompt_logprobs"]
            if not entries or entries[0] is not None or any(not e for e in entries[1:]):
                return Outcome("", False, 200, f"prompt_logprobs {str(entries)[:200]}")
        return outcome

    async def _drop_mid_stream(self, spec: dict) -> Outcome:
        body = self._completion(spec, stream=True, max_tokens=64, ignore_eos=True)
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome("", False, response.status_code, "refused")
            events = 0
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events >= spec["drop_after"]:
                    break  # leaving the block closes the connection: the server must abort the request
        return Outcome("", True, 200)

    async def _drop_before_first_token(self, spec: dict) -> Outcome:
        body = self._completion(spec, stream=True, max_tokens=64, ignore_eos=True)
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            return Outcome("", response.status_code == 200, response.status_code)

    async def _bad_params(self, spec: dict) -> Outcome:
        outcome = _refused(await self.http.post("/v1/completions", json=self._completion(spec, **spec["bad"])))
        if not outcome.ok:
            outcome.problem = f"{spec['bad']}: {outcome.problem}"
        return outcome

    async def _oversize(self, spec: dict) -> Outcome:
        body = self._completion(spec, prompt=" ".join(["word"] * (self.max_model_len + 10)))
        return _refused(await self.http.post("/v1/completions", json=body))

    # -- the pooling kinds (an embedding model) -------------------------------------------------------
    async def _embedded(self, body: dict, count: int) -> Outcome:
        response = await self.http.post("/v1/embeddings", json={"model": self.model, **body})
        if response.status_code != 200:
            return Outcome("", False, response.status_code, response.text[:200])
        data = response.json()["data"]
        if len(data) != count or any(not d["embedding"] for d in data):
            return Outcome("", False, 200, f"{len(data)} embeddings for {count} inputs")
        return Outcome("", True, 200)

    async def _embed(self, spec: dict) -> Outcome:
        return await self._embedded({"input": spec["prompt"]}, 1)

    async def _embed_list(self, spec: dict) -> Outcome:
        inputs = spec["inputs"][:spec["n"] + 2]
        return await self._embedded({"input": inputs}, len(inputs))

    async def _embed_base64(self, spec: dict) -> Outcome:
        return await self._embedded({"input": spec["inputs"][:2], "encoding_format": "base64"}, 2)

    async def _embed_dimensions(self, spec: dict) -> Outcome:
        return await self._embedded({"input": spec["prompt"], "dimensions": 32}, 1)

    async def _pair_score(self, spec: dict) -> Outcome:
        body = {"model": self.model, "text_1": spec["prompt"], "text_2": spec["inputs"][:3]}
        return _answered_data(await self.http.post("/v1/score", json=body), 3)

    async def _rerank(self, spec: dict) -> Outcome:
        body = {"model": self.model, "query": spec["prompt"], "documents": spec["inputs"][:4]}
        response = await self.http.post("/v1/rerank", json=body)
        if response.status_code != 200:
            return Outcome("", False, response.status_code, response.text[:200])
        return Outcome("", len(response.json()["results"]) == 4, 200, "results")

    async def _bad_embed(self, spec: dict) -> Outcome:
        body = {"model": self.model, "input": spec["prompt"], **spec["bad_embed"]}
        outcome = _refused(await self.http.post("/v1/embeddings", json=body))
        if not outcome.ok:
            outcome.problem = f"{spec['bad_embed']}: {outcome.problem}"
        return outcome

    async def _oversize_embed(self, spec: dict) -> Outcome:
        body = {"model": self.model, "input": " ".join(["word"] * (self.max_model_len + 10))}
        return _refused(await self.http.post("/v1/embeddings", json=body))

    async def _read_stream(self, path: str, body: dict) -> Outcome:
        finish_reason = None
        done = False
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return Outcome("", False, response.status_code, (await response.aread()).decode()[:200])
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return Outcome("", False, 200, f"error event: {event['error']['message']}")
                finish_reason = event["choices"][0]["finish_reason"] if event["choices"] else finish_reason
        if not done or finish_reason not in ("stop", "length"):
            return Outcome("", False, 200, f"the stream ended with finish_reason {finish_reason}, [DONE] {done}")
        return Outcome("", True, 200)


def _answered(response: httpx.Response, choices: int) -> Outcome:
    if response.status_code != 200:
        return Outcome("", False, response.status_code, response.text[:200])
    got = response.json()["choices"]
    if len(got) != choices or any(c["finish_reason"] not in ("stop", "length") for c in got):
        return Outcome("", False, 200, f"choices {[c['finish_reason'] for c in got]}")
    return Outcome("", True, 200)


def _answered_data(response: httpx.Response, count: int) -> Outcome:
    if response.status_code != 200:
        return Outcome("", False, response.status_code, response.text[:200])
    got = len(response.json()["data"])
    return Outcome("", got == count, 200, None if got == count else f"{got} scores for {count}")


def _refused(response: httpx.Response) -> Outcome:
    if response.status_code != 400:
        return Outcome("", False, response.status_code, f"expected 400: {response.text[:200]}")
    error = response.json().get("error", {})
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return Outcome("", False, 400, f"not OpenAI's error format: {response.text[:200]}")
    return Outcome("", True, 400)


async def drive(base_url: str, requests: int, concurrency: int, seed: int, outcomes: list,
                kinds: dict[str, int] = KINDS) -> None:
    """Send the plan, ``concurrency`` at a time, appending each request's outcome as it ends."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]
        soak = Soak(http, model["id"], model["max_model_len"], seed, kinds)
        plan = collections.deque(soak.plan(requests))

        async def worker() -> None:
            while plan:
                kind, spec = plan.popleft()
                outcomes.append(await soak.run(kind, spec))

        await asyncio.gather(*(worker() for _ in range(concurrency)))


IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "pagedllm:requests_tracked")


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits, holds KV blocks or sits in a request table; the last readings."""
    deadline = time.monotonic() + timeout
    while True:
        readings = idle_readings(httpx.get(base_url + "/metrics", timeout=10).text)
        if all(v == 0 for v in readings.values()) or time.monotonic() > deadline:
            return readings
        time.sleep(0.1)


def counter(base_url: str, name: str) -> float:
    """A counter's value summed over its samples (0 when the server does not have it)."""
    families = text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=10).text)
    return sum(s.value for f in families if f.name == name for s in f.samples if s.name.endswith("_total"))


def idle_readings(text: str) -> dict[str, float]:
    """The gauges that are 0 on an idle server that leaks nothing: {name or name[table]: value}."""
    readings = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in IDLE_GAUGES:
                table = sample.labels.get("table")
                readings[sample.name + (f"[{table}]" if table else "")] = sample.value
    return readings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("model", nargs="?", help="what `pagedllm serve` takes (default: the embedded SmolLM2)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=None, help="requests before RSS is watched (default 10%%)")
    parser.add_argument("--default-shape-caches", action="store_true",
                        help=f"leave oneDNN's shape caches at their defaults (else: {SHAPE_CACHE_CAPS})")
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--mix", choices=("generate", "pooling"), default="generate",
                        help="the requests: a text model's (default) or an embedding model's (serve --runner pooling)")
    parser.add_argument("--fairness", action="store_true", help="run the fairness probe after the soak")
    parser.add_argument("--max-prompts", type=int, default=1024,
                        help="the server's --max-prompts-per-request, for the probe's list of prompts")
    parser.add_argument("--grammar-choices", type=int, default=1300, help="choices of the probe's slow grammar")
    parser.add_argument("--output-json", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    server_args = argv[split + 1:] or DEFAULT_SERVER_ARGS  # after --: flags for `pagedllm serve`
    warmup = args.warmup if args.warmup is not None else max(20, args.requests // 10)

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="pagedllm-soak-")) / "server.log"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--disable-log-requests", *server_args]
    print(f"soak: {' '.join(cmd[1:])} (log: {log_path})", file=sys.stderr)
    with open(log_path, "w") as log:
        env = os.environ if args.default_shape_caches else {**SHAPE_CACHE_CAPS, **os.environ}
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(server, port, log_path)
        outcomes: list[Outcome] = []
        start = time.monotonic()
        with RSSSampler(server.pid, lambda: len(outcomes)) as rss:
            asyncio.run(drive(base_url, args.requests, args.concurrency, args.seed, outcomes,
                              POOLING_KINDS if args.mix == "pooling" else KINDS))
        duration = time.monotonic() - start
        idle = wait_idle(base_url)
        speculated = counter(base_url, "vllm:spec_decode_num_draft_tokens")
        probes = None
        if args.fairness:
            probes = asyncio.run(run_probes(base_url, args.max_prompts, args.grammar_choices))
            idle = wait_idle(base_url)
        server.terminate()
        exit_code = server.wait(120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()

    summary = summarize(outcomes, idle, rss_growth(rss.samples, warmup, args.requests), duration, exit_code)
    summary["speculated_tokens"] = speculated
    if probes is not None:
        summary["fairness"] = {p.kind: dataclasses.asdict(p) for p in probes}
    float32 = any(a == "--dtype" and b == "float32" for a, b in zip(server_args, server_args[1:]))
    failures = checks(summary, args.max_rss_growth, seeds_must_match=float32)
    summary["failed_checks"] = failures
    print_summary(summary, args.output_json)
    if failures:
        print(f"soak: FAILED: {'; '.join(failures)}\nserver log tail:\n{log_tail(log_path)}", file=sys.stderr)
        return 1
    return 0


def summarize(outcomes: list[Outcome], idle: dict, rss: dict, duration: float, exit_code: int) -> dict:
    by_kind = collections.Counter(o.kind for o in outcomes)
    problems = collections.defaultdict(list)
    for outcome in outcomes:
        if not outcome.ok:
            problems[outcome.kind].append(f"{outcome.status}: {outcome.problem}")
    statuses = collections.Counter(str(o.status) for o in outcomes)
    return {"requests": len(outcomes), "duration_s": round(duration, 1),
            "requests_per_s": round(len(outcomes) / duration, 2), "by_kind": dict(sorted(by_kind.items())),
            "statuses": dict(sorted(statuses.items())),
            "median_latency_s": round(statistics.median(o.seconds for o in outcomes), 3) if outcomes else None,
            "unexpected": {kind: {"count": len(p), "first": p[:3]} for kind, p in problems.items()},
            "seeded_pairs": {"sent": by_kind["seeded"], "diverged": sum(o.diverged for o in outcomes)},
            "after": idle, "rss": rss, "server_exit_code": exit_code}


def checks(summary: dict, max_rss_growth: float, seeds_must_match: bool) -> list[str]:
    failures = []
    if seeds_must_match and summary["seeded_pairs"]["diverged"]:
        failures.append(f"seeded pairs gave two texts in float32: {summary['seeded_pairs']}")
    if summary["unexpected"]:
        failures.append(f"unexpected outcomes: {summary['unexpected']}")
    if any(status.startswith("5") for status in summary["statuses"]):
        failures.append(f"5xx answers: {summary['statuses']}")
    if any(value != 0 for value in summary["after"].values()) or len(summary["after"]) != 5:
        failures.append(f"not idle afterwards: {summary['after']}")
    growth = summary["rss"]["growth"]
    if growth is None or growth >= max_rss_growth:
        failures.append(f"peak RSS grew by {growth} (limit {max_rss_growth})")
    for kind, probe in summary.get("fairness", {}).items():
        if probe["heavy_status"] is not None and probe["heavy_status"] >= 500:
            failures.append(f"fairness probe {kind}: the heavy request got {probe['heavy_status']}")
        if (kind in HELD_KINDS and probe["overlapped"] and probe["heavy_seconds"] >= HELD_MIN_SECONDS
                and probe["small_seconds"] >= probe["heavy_seconds"] / 2):
            failures.append(f"fairness probe {kind}: a small request waited {probe['small_seconds']} s beside a "
                            f"heavy one of {probe['heavy_seconds']} s")
    if summary["server_exit_code"] != 0:
        failures.append(f"the server exited with {summary['server_exit_code']} on SIGTERM")
    return failures


if __name__ == "__main__":
    sys.exit(main())
