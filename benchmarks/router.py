"""Replicas behind a router (examples/router/serve_behind_router.py): the prefix-cache hit rate of a shared-prefix
workload under each routing policy, and what a replica that dies mid-workload costs.

The workload: P prefixes (a long shared start, as a system prompt or a few-shot block) x R requests each, in a
seeded shuffled order, C in flight. The hit rate is the replicas' prefix-cache hits over the prompt tokens they
looked up (their /metrics, before and after). With ``--kill-one``, replica 1 is killed (SIGKILL) after a third of
the requests: the requests that fail must be at most those that were in flight on it.

    python benchmarks/router.py --replicas 2 --policies round_robin cache_aware          # SmolLM2
    python benchmarks/router.py MODEL --kill-one -- --dtype float32 --max-model-len 512
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import tempfile
import threading
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "router"))
from rates import print_summary  # noqa: E402
from serve_behind_router import free_port, start_replicas, start_router, stop  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which have were are this be one city "
         "river music science history water light north south story").split()


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hits, queried tokens) summed over the replicas that answer."""
    hits = queries = 0.0
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=10).text
        except httpx.TransportError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
                elif sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
    return hits, queries


def workload(prefixes: int, per_prefix: int, prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    starts = [" ".join(rng.choices(WORDS, k=prefix_words)) for _ in range(prefixes)]
    prompts = [f"{starts[p]} question {i}:" for p in range(prefixes) for i in range(per_prefix)]
    rng.shuffle(prompts)
    return prompts


def send_all(router_url: str, prompts: list[str], concurrency: int, on_sent=None) -> list[int | str]:
    """Each prompt as a completion through the router: its status, or the transport error's name."""
    def one(index: int) -> int | str:
        if on_sent is not None:
            on_sent(index)
        try:
            body = {"prompt": prompts[index], "max_tokens": 8, "temperature": 0}
            return httpx.post(router_url + "/v1/completions", json=body, timeout=300).status_code
        except httpx.TransportError as exc:
            return type(exc).__name__

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))


def measure_policy(kind: str, policy: str, urls: list[str], prompts: list[str], concurrency: int,
                   log_dir: Path) -> dict:
    port = free_port()
    router = start_router(kind, policy, urls, port, log_dir)
    try:
        hits0, queries0 = cache_counters(urls)
        statuses = send_all(f"http://127.0.0.1:{port}", prompts, concurrency)
        hits1, queries1 = cache_counters(urls)
    finally:
        stop([router])
    return {"policy": policy, "ok": statuses.count(200), "requests": len(prompts),
            "hit_rate": round((hits1 - hits0) / max(queries1 - queries0, 1), 4)}


def measure_kill(kind: str, replicas, prompts: list[str], concurrency: int, log_dir: Path) -> dict:
    """Kill replica 1 after a third of the prompts were sent; count the requests that failed."""
    urls = [url for url, _ in replicas]
    port = free_port()
    router = start_router(kind, "cache_aware", urls, port, log_dir)
    killed = threading.Event()

    def on_sent(index: int) -> None:
        if index == len(prompts) // 3 and not killed.is_set():
            killed.set()
            replicas[1][1].kill()

    try:
        statuses = send_all(f"http://127.0.0.1:{port}", prompts, concurrency, on_sent)
    finally:
        stop([router])
    failed = [s for s in statuses if s != 200]
    return {"requests": len(prompts), "failed": len(failed), "failures": sorted(set(map(str, failed))),
            "in_flight_bound": concurrency, "after_kill_ok": all(s == 200 for s in statuses[len(prompts) // 2:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--router", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--per-prefix", type=int, default=16)
    parser.add_argument("--prefix-words", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-one", action="store_true", help="then kill replica 1 mid-workload")
    parser.add_argument("--output-json", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    log_dir = Path(tempfile.mkdtemp(prefix="pagedllm-router-"))
    replicas = start_replicas(args.model, args.replicas, argv[split + 1:], log_dir)
    summary: dict = {"router": args.router, "replicas": args.replicas, "logs": str(log_dir), "policies": []}
    try:
        urls = [url for url, _ in replicas]
        for i, policy in enumerate(args.policies):  # fresh prefixes per policy: no policy inherits a warm cache
            prompts = workload(args.prefixes, args.per_prefix, args.prefix_words, args.seed + i)
            summary["policies"].append(measure_policy(args.router, policy, urls, prompts, args.concurrency, log_dir))
        if args.kill_one:
            prompts = workload(args.prefixes, args.per_prefix, args.prefix_words, args.seed + 100)
            summary["kill_one"] = measure_kill(args.router, replicas, prompts, args.concurrency, log_dir)
    finally:
        stop([proc for _, proc in replicas])
    print_summary(summary, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
