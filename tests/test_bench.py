"""The benchmark tools: workloads (random, shared prefix, ShareGPT, files), ``bench throughput`` on a tiny model,
and ``bench serve`` against a real ``pagedllm serve`` process."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from transformers import AutoTokenizer

from pagedllm.bench import add_bench_parser, main
from pagedllm.bench.serving import RequestResult, arrival_delays, summarize
from pagedllm.bench.workload import Workload, WorkloadError, ordinary_token_ids, random_workload, sharegpt_workload

TINY_ENGINE = ["--dtype", "float32", "--kv-cache-space", "0.01"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def run_bench(*argv: str) -> int:
    return main([str(a) for a in argv])


# -- workloads ------------------------------------------------------------------------------------------------
def test_random_workload_is_seeded_and_shares_its_prefix(tokenizer):
    a = random_workload(tokenizer, "tiny", 5, 12, 7, seed=3, prefix_len=20)
    assert a.requests == random_workload(tokenizer, "tiny", 5, 12, 7, seed=3, prefix_len=20).requests
    assert a.requests != random_workload(tokenizer, "tiny", 5, 12, 7, seed=4, prefix_len=20).requests
    assert all(len(r.prompt_token_ids) == 32 and r.output_len == 7 for r in a.requests)
    assert len({tuple(r.prompt_token_ids[:20]) for r in a.requests}) == 1
    assert len({tuple(r.prompt_token_ids[20:]) for r in a.requests}) == 5
    allowed = set(ordinary_token_ids(tokenizer))
    assert tokenizer.eos_token_id not in allowed
    assert all(set(r.prompt_token_ids) <= allowed for r in a.requests)
    assert (a.num_prompt_tokens, a.num_output_tokens, a.max_len) == (160, 35, 39)


def test_workload_file_round_trip(tokenizer, tmp_path):
    workload = random_workload(tokenizer, "tiny", 3, 4, 5, seed=1, prefix_len=2)
    workload.save(tmp_path / "w.json")
    loaded = Workload.load(tmp_path / "w.json")
    assert loaded == workload
    data = json.loads((tmp_path / "w.json").read_text())  # what another engine's runner reads
    assert data["requests"][0] == {"prompt_token_ids": workload.requests[0].prompt_token_ids, "output_len": 5}


def test_bad_workload_files_say_what_to_do(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"requests": []}))
    for path in (tmp_path / "missing.json", tmp_path / "other.json"):
        with pytest.raises(WorkloadError, match="--save-workload"):
            Workload.load(path)


def sharegpt_file(path):
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "Paris is the capital of France; tell me more."},
                                      {"from": "gpt", "value": "Berlin is the capital of Germany, as it happens."}]},
        # the first human turn comes after a system turn
        {"id": "b", "conversations": [{"from": "system", "value": "Be brief."},
                                      {"from": "human", "value": "The quick brown fox jumps over the lazy dog."},
                                      {"from": "gpt", "value": "A paged KV cache stores keys and values."}]},
        {"id": "short", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, "
                                                                                                       "friend!"}]},
        {"id": "no-reply", "conversations": [{"from": "human", "value": "Numbers like 12345 and 2026 appear."}]},
        {"id": "too-long", "conversations": [{"from": "human", "value": "def add(a, b): return a + b " * 400},
                                             {"from": "gpt", "value": "That adds two numbers together."}]},
    ]
    path.write_text(json.dumps(conversations))
    return path


def test_sharegpt_takes_the_first_human_turn_and_skips_what_vllm_skips(tokenizer, tmp_path):
    path = sharegpt_file(tmp_path / "sharegpt.json")
    workload = sharegpt_workload(path, tokenizer, "tiny", 2, seed=0)
    expected = {
        tuple(tokenizer("Paris is the capital of France; tell me more.").input_ids):
            len(tokenizer("Berlin is the capital of Germany, as it happens.").input_ids),
        tuple(tokenizer("The quick brown fox jumps over the lazy dog.").input_ids):
            len(tokenizer("A paged KV cache stores keys and values.").input_ids),
    }
    assert {tuple(r.prompt_token_ids): r.output_len for r in workload.requests} == expected
    assert [r.output_len for r in sharegpt_workload(path, tokenizer, "tiny", 2, output_len=9).requests] == [9, 9]
    with pytest.raises(WorkloadError, match="only 2 usable conversations.*--num-prompts 2"):
        sharegpt_workload(path, tokenizer, "tiny", 3)


# -- bench throughput -----------------------------------------------------------------------------------------
def test_bench_parser_plugs_into_a_cli():
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "throughput", "--num-prompts", "3", "--enable-prefix-caching",
                              "--max-num-batched-tokens", "64"])
    assert (args.num_prompts, args.enable_prefix_caching, args.max_num_batched_tokens) == (3, True, 64)
    args = parser.parse_args(["bench", "serve", "--request-rate", "2.5", "--max-concurrency", "4"])
    assert (args.request_rate, args.max_concurrency, args.base_url) == (2.5, 4, "http://127.0.0.1:8000")
    assert callable(args.func)


def test_throughput_random_counts_tokens_and_saves_its_workload(tiny_llama, tmp_path):
    out, saved = tmp_path / "out.json", tmp_path / "w.json"
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--num-prompts", 4, "--input-len", 12,
                     "--output-len", 8, "--output-json", out, "--save-workload", saved) == 0
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["total_prompt_tokens"], r["total_output_tokens"], r["total_num_tokens"]) == \
        (4, 48, 32, 80)
    assert r["output_tokens_per_second"] == pytest.approx(32 / r["elapsed_time"])
    assert r["tokens_per_second"] == pytest.approx(80 / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(4 / r["elapsed_time"])
    assert r["startup_seconds"] > 0
    # 4 sequences of 12 + 8 tokens = 2 blocks of 16 each at the end.
    assert r["peak_kv_blocks"] == 8 and r["kv_blocks_total"] >= 8
    assert 0 <= r["kv_waste_at_peak"] < 1
    assert r["prefix_cache_hit_rate"] == 0 and r["num_preemptions"] == 0  # on by default; nothing shared here
    assert r["engine"]["dtype"] == "float32" and r["engine"]["enable_prefix_caching"] is True
    assert Workload.load(saved).num_prompt_tokens == 48

    assert r["num_structured_requests"] == 0

    # The saved workload replays the same token ids; half the requests under the default JSON schema still make
    # their whole output length.
    again = tmp_path / "again.json"
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--workload", saved,
                     "--structured-fraction", 0.5, "--output-json", again) == 0
    r = json.loads(again.read_text())
    assert (r["total_num_tokens"], r["num_structured_requests"]) == (80, 2)


def test_throughput_shared_prefix_hits_the_prefix_cache(tiny_llama, tmp_path):
    out = tmp_path / "out.json"
    # Two sequences at a time: later requests are admitted after the prefix blocks are computed and cached.
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--num-prompts", 6, "--prefix-len", 32,
                     "--input-len", 8, "--output-len", 4, "--enable-prefix-caching", "--max-num-seqs", 2,
                     "--output-json", out) == 0
    r = json.loads(out.read_text())
    assert (r["total_prompt_tokens"], r["total_output_tokens"]) == (240, 24)
    # The 32-token prefix is two full blocks; the first requests find nothing cached, the later ones hit both.
    assert r["prefix_cache_queried_tokens"] == 240
    assert r["prefix_cache_hit_tokens"] in (4 * 32, 5 * 32)
    assert r["prefix_cache_hit_rate"] == pytest.approx(r["prefix_cache_hit_tokens"] / 240)
    assert 0 <= r["kv_waste_at_peak"] < 1


def test_throughput_on_a_sharegpt_file(tiny_llama, tokenizer, tmp_path):
    out = tmp_path / "out.json"
    path = sharegpt_file(tmp_path / "sharegpt.json")
    expected = sharegpt_workload(path, tokenizer, "tiny", 2)
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--dataset", path, "--num-prompts", 2,
                     "--output-json", out) == 0
    r = json.loads(out.read_text())
    assert r["total_prompt_tokens"] == expected.num_prompt_tokens
    assert r["total_output_tokens"] == expected.num_output_tokens


def test_throughput_bad_input_is_a_clear_error(tiny_llama, tmp_path, capsys):
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--workload", tmp_path / "none.json") == 2
    assert "cannot read the workload file" in capsys.readouterr().err
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--num-prompts", 1, "--input-len", 500,
                     "--output-len", 100) == 2
    assert "raise --max-model-len" in capsys.readouterr().err
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--structured-fraction", 2) == 2
    assert "--structured-fraction must be in [0, 1]" in capsys.readouterr().err
    assert run_bench("throughput", "--model", tiny_llama, *TINY_ENGINE, "--structured-fraction", 1,
                     "--json-schema", "{oops") == 2
    assert "--json-schema is not valid JSON" in capsys.readouterr().err


# -- bench serve ----------------------------------------------------------------------------------------------
def test_arrival_delays_are_seeded_poisson_gaps():
    assert arrival_delays(4, math.inf, 0) == [0.0] * 4
    gaps = arrival_delays(4000, 8.0, seed=1)
    assert gaps == arrival_delays(4000, 8.0, seed=1) != arrival_delays(4000, 8.0, seed=2)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.1)


def test_serving_summary_metrics():
    results = [RequestResult(10, 3, True, output_tokens=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
               RequestResult(10, 3, True, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.1, 0.3]),
               RequestResult(10, 3, False, error="HTTP 500: boom")]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 6)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 3.0, 13.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(200)
    assert s["itl_ms"]["mean"] == pytest.approx(200) and s["e2el_ms"]["p99"] == pytest.approx(698)


def test_serve_benchmark_against_pagedllm_serve(tiny_llama, tmp_path):
    from server_process import ServerProcess

    server = ServerProcess([str(tiny_llama), *TINY_ENGINE], tmp_path / "server.log")
    try:
        out, saved = tmp_path / "serve.json", tmp_path / "w.json"
        assert run_bench("serve", "--base-url", server.url, "--tokenizer", tiny_llama, "--num-prompts", 6,
                         "--input-len", 10, "--output-len", 5, "--request-rate", 20, "--max-concurrency", 3,
                         "--seed", 1, "--output-json", out, "--save-workload", saved) == 0
        s = json.loads(out.read_text())
        assert (s["completed"], s["failed"], s["requests_with_other_output_len"]) == (6, 0, 0)
        assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 30)
        assert s["model"] == tiny_llama.name
        assert 0 < s["ttft_ms"]["mean"] <= s["e2el_ms"]["mean"]
        assert s["itl_ms"]["p50"] > 0 and s["tpot_ms"]["mean"] > 0
        assert s["e2el_ms"]["p50"] <= s["e2el_ms"]["p90"] <= s["e2el_ms"]["p99"]
        replay = Workload.load(saved)
        assert (len(replay.requests), replay.num_prompt_tokens, replay.num_output_tokens) == (6, 60, 30)
    finally:
        server.stop()


def test_serve_benchmark_without_a_server_says_so(tmp_path, capsys):
    from server_process import free_port

    assert run_bench("serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", 1) == 2
    assert "is an OpenAI-compatible server running there?" in capsys.readouterr().err
