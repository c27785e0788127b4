"""The short soak of CI: benchmarks/soak.py's mixed requests (streams, disconnects, n > 1, stop strings, seeds, bad
parameters, oversize prompts, aborts while queued) through a real server, then nothing held and nothing leaked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"


def test_soak_leaves_nothing_behind(tiny_llama_dir, tmp_path):
    summary_path = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(SOAK), str(tiny_llama_dir), "--requests", "800", "--concurrency", "24",
         "--output-json", str(summary_path), "--", "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-space", "0.05", "--max-num-seqs", "8", "--enable-prefix-caching"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] == 800 and summary["failed_checks"] == [] and summary["unexpected"] == {}
    assert set(summary["by_kind"]) == {"stream", "complete", "chat_stream", "chat", "n", "stop", "seeded", "score",
                                       "drop_mid_stream", "drop_before_first_token", "bad_params", "oversize"}
    assert set(summary["statuses"]) == {"200", "400"}
    assert all(value == 0 for value in summary["after"].values()) and len(summary["after"]) == 5
