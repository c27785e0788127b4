"""Online serving latency against any OpenAI-compatible server (pagedllm's, vLLM's, llama.cpp's).

Requests are streamed completions whose prompts are token ids (so every server gets the same input), sent at
Poisson arrival times (seeded) or all at once, optionally under a concurrency cap. Per request it records the
time to the first token (TTFT), the gaps between streamed chunks (ITL), the time per output token after the
first (TPOT) and the end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time

import numpy as np

from pagedllm.bench.report import print_report, write_json
from pagedllm.bench.workload import BenchRequest, Workload, add_workload_args, workload_from_args

PERCENTILES = (50, 90, 99)


class ServerError(RuntimeError):
    """The server cannot be reached or answered nothing usable; the message says what to check."""


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's root URL (default http://127.0.0.1:8000)")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions path (default /v1/completions)")
    parser.add_argument("--model", help="model name to send (default: the first one GET /v1/models lists)")
    parser.add_argument("--tokenizer", help="local HF folder or GGUF file whose tokenizer makes the prompts "
                                            "(default: --model if it is a local path, else SmolLM2-135M-Instruct)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals; inf (default) sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token, if the server wants one (default: $OPENAI_API_KEY)")
    parser.add_argument("--output-json", metavar="PATH", help="write the results as JSON")
    add_workload_args(parser)


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


def run_serving(args: argparse.Namespace) -> dict:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ServerError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ServerError(f"--request-rate must be more than 0 (inf: all at once), got {args.request_rate}")
    base_url = args.base_url.rstrip("/")
    model = args.model or _first_model(base_url, args.api_key)
    workload = _workload(args, model)
    if args.save_workload:
        workload.save(args.save_workload)
    results, duration = asyncio.run(_benchmark(base_url + args.endpoint, model, workload, args))
    summary = summarize(results, duration)
    summary.update({"base_url": base_url, "model": model, "workload": workload.name,
                    "request_rate": args.request_rate, "max_concurrency": args.max_concurrency})
    print_report("serving benchmark", _report_lines(summary))
    if args.output_json:
        write_json(args.output_json, summary)
    if summary["completed"] == 0:
        raise ServerError(f"every request failed; the first error: {summary['errors'][0]}")
    return summary


def _workload(args: argparse.Namespace, model: str) -> Workload:
    if args.workload:
        return Workload.load(args.workload)
    from pagedllm.models.source import load_tokenizer, resolve_model

    name = args.tokenizer or (model if os.path.exists(model) else None)
    source = resolve_model(name)
    return workload_from_args(args, load_tokenizer(source), source.name, args.seed)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    try:
        response = httpx.get(f"{base_url}/v1/models", headers=_headers(api_key), timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot list the models of {base_url} ({exc}): is an OpenAI-compatible server running "
                          f"there? Start one or pass --base-url (and --model)") from None
    except (KeyError, IndexError, ValueError):
        raise ServerError(f"{base_url}/v1/models lists no model; pass --model") from None


async def _benchmark(url: str, model: str, workload: Workload, args) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    limit = args.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    bar = tqdm(total=len(workload.requests), desc="Requests", dynamic_ncols=True)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=_headers(args.api_key)) as client:
        async def one(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await _send(client, url, model, request)
            else:
                async with semaphore:
                    result = await _send(client, url, model, request)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request, delay in zip(workload.requests, arrival_delays(len(workload.requests), args.request_rate,
                                                                    args.seed)):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Waits before each request: exponential gaps (a Poisson process) at ``rate`` per second, none if inf."""
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n).tolist()


async def _send(client, url: str, model: str, request: BenchRequest) -> RequestResult:
    import httpx

    result = RequestResult(len(request.prompt_token_ids), request.output_len)
    payload = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
               "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if not any(choice.get("text") for choice in event.get("choices") or []):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.success = chunks > 0
    if not result.success:
        result.error = "the stream held no text"
    return result


def _stats(values_s: list[float]) -> dict:
    """Mean and percentiles in milliseconds (zeros when there are no values)."""
    ms = np.asarray(values_s, dtype=float) * 1000 if values_s else np.zeros(1)
    out = {"mean": float(ms.mean())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    errors = list(dict.fromkeys(r.error for r in results if not r.success))
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requests_with_other_output_len": sum(1 for r in done if r.output_tokens != r.expected_output_len),
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([gap for r in done for gap in r.itl]),
        "e2el_ms": _stats([r.latency for r in done]),
    }


def _report_lines(s: dict) -> list[tuple[str, str]]:
    rate = "all at once" if math.isinf(s["request_rate"]) else f"{s['request_rate']:g}/s Poisson"
    lines = [
        ("server", f"{s['base_url']} ({s['model']})"),
        ("workload", f"{s['workload']}; {rate}, max concurrency {s['max_concurrency'] or 'none'}"),
        ("requests", f"{s['completed']} completed, {s['failed']} failed in {s['duration']:.2f} s"),
        ("throughput", f"{s['request_throughput']:.2f} requests/s, {s['output_throughput']:.1f} output tokens/s, "
                       f"{s['total_token_throughput']:.1f} total tokens/s"),
        ("tokens", f"{s['total_input_tokens']} input, {s['total_output_tokens']} output"),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        st = s[key]
        lines.append((f"{label} ms", f"mean {st['mean']:.1f}, " + ", ".join(f"p{p} {st[f'p{p}']:.1f}"
                                                                           for p in PERCENTILES)))
    if s["requests_with_other_output_len"]:
        lines.append(("note", f"{s['requests_with_other_output_len']} requests got another output length than "
                              f"asked (does the server honour ignore_eos?)"))
    for error in s["errors"]:
        lines.append(("error", error))
    return lines
