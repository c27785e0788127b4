"""The rate fields every runner's results JSON shares (named as ``pagedllm bench throughput`` names them), and
how a runner hands its results over.

Standard library only, so the runners that live in other environments (vllm_offline.py in vLLM's venv) can
use it too: the script's own folder is on their import path.
"""

import json
import os
import resource
import sys
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak resident memory (the model, its KV cache and everything else it held at once), plus the
    peaks of its live child processes (vLLM's engine core runs in one): summed, though they may not coincide."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    own = peak if sys.platform == "darwin" else peak * 1024
    return own + sum(_peak_of(pid) for pid in _descendants(os.getpid()))


def _descendants(root: int) -> list[int]:
    """Live processes below ``root``, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def _peak_of(pid: int) -> int:
    """A process's peak resident memory (VmHWM), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def rate_fields(workload: str, num_requests: int, num_prompt: int, num_output: int, elapsed: float,
                startup: float) -> dict:
    return {
        "peak_rss_bytes": peak_rss_bytes(),
        "workload": workload,
        "num_requests": num_requests,
        "elapsed_time": elapsed,
        "total_prompt_tokens": num_prompt,
        "total_output_tokens": num_output,
        "total_num_tokens": num_prompt + num_output,
        "requests_per_second": num_requests / elapsed,
        "tokens_per_second": (num_prompt + num_output) / elapsed,
        "output_tokens_per_second": num_output / elapsed,
        "startup_seconds": startup,
    }


def write_results(path: str, results: dict, engine: str) -> None:
    """The results JSON for the harness, and one line for the log."""
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
    print(f"{engine}: {results['requests_per_second']:.2f} requests/s, {results['output_tokens_per_second']:.1f} "
          f"output tokens/s; start-up {results['startup_seconds']:.1f} s")


def print_summary(summary: dict, path: str | Path | None = None) -> None:
    """A benchmark's summary as JSON on stdout, and in ``path`` too when given."""
    text = json.dumps(summary, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
