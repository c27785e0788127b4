"""The short soak of CI: benchmarks/soak.py's mixed requests (streams, disconnects, n > 1, stop strings, seeds, bad
parameters, oversize prompts, aborts while queued, scoring and prompt logprobs) through a real server that names its
model by Hub id (a Hub cache on disk) and speculates in every step, then nothing held and nothing leaked; then the
fairness probe: a small request is not held behind a long prompt or a slow grammar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hub_cache import HUB_REPO, OFFLINE

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"
# n-gram speculation in steps of up to 64 running requests: every step of the soak verifies proposals
SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64}'


def test_soak_leaves_nothing_behind_and_no_request_waits_behind_a_heavy_one(tiny_llama_hub_cache, tmp_path):
    summary_path = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), HUB_REPO, "--requests", "800", "--concurrency", "24", "--fairness",
         "--max-prompts", "8", "--grammar-choices", "5000", "--output-json", str(summary_path), "--",
         "--dtype", "float32", "--max-model-len", "512", "--kv-cache-space", "0.05", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--max-prompts-per-request", "8", "--structured-outputs-max-bytes",
         "1000000", "--structured-outputs-compile-timeout", "120", "--speculative-config", SPECULATIVE],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, **OFFLINE, "HF_HUB_CACHE": str(tiny_llama_hub_cache)})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] == 800 and summary["failed_checks"] == [] and summary["unexpected"] == {}
    assert set(summary["by_kind"]) == {"stream", "complete", "chat_stream", "chat", "n", "stop", "seeded", "score",
                                       "prompt_logprobs", "drop_mid_stream", "drop_before_first_token", "bad_params",
                                       "oversize"}
    assert set(summary["statuses"]) == {"200", "400"}
    assert all(value == 0 for value in summary["after"].values()) and len(summary["after"]) == 5
    assert summary["speculated_tokens"] > 0
    fairness = summary["fairness"]
    assert fairness["slow_grammar"]["heavy_status"] == 200 and fairness["huge_body"]["heavy_status"] == 400
    assert {probe["heavy_status"] for probe in fairness.values()} <= {None, 200, 400}


def test_soak_of_an_embedding_server_leaves_nothing_behind(tmp_path):
    summary_path = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), "--mix", "pooling", "--requests", "300", "--concurrency", "16", "--output-json",
         str(summary_path), "--", "--runner", "pooling", "--dtype", "float32", "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=600)  # the default embedding model, all-MiniLM-L6-v2
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["failed_checks"] == [] and summary["unexpected"] == {}
    assert set(summary["by_kind"]) == {"embed", "embed_list", "embed_base64", "embed_dimensions", "pair_score",
                                       "rerank", "bad_embed", "oversize_embed"}
    assert set(summary["statuses"]) == {"200", "400"}
