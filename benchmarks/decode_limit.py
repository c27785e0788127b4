"""The bandwidth limit of batch-1 decode (W0): a decode step reads every weight once, so it cannot run faster than
the machine's read bandwidth divided by the bytes of weights per token. compare_vllm.py prints each GGUF engine's
bytes per token and the limit beside its W0.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

_HOLD = re.compile(r"quantized ones hold (\d+) MiB")


def read_bandwidth(threads: int, mib: int = 512, repeat: int = 5) -> float:
    """Bytes per second that ``threads`` threads read: the fastest of a few sums over a buffer far larger than any
    cache (torch.sum streams it once)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(mib << 18)  # float32: mib MiB
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.nbytes / best
    finally:
        torch.set_num_threads(previous)


def gguf_bytes_per_token(path: Path) -> int:
    """The bytes of a GGUF file's weights that one decode step reads: every tensor but the embedding table, which
    is read a row at a time unless it is the LM head too (no output.weight)."""
    from pagedllm.models.gguf_file import open_gguf

    tensors = {t.name: t.n_bytes for t in open_gguf(path, skip_prefixes=("tokenizer.",)).tensors}
    tied = "output.weight" not in tensors
    return sum(size for name, size in tensors.items() if tied or name != "token_embd.weight")


def logged_quantized_bytes(log: str) -> int | None:
    """What pagedllm's log says its quantized linears hold (the bytes a decode step reads of them)."""
    found = _HOLD.search(log)
    return None if found is None else int(found.group(1)) << 20


def describe(engine: str, bytes_per_token: int, bandwidth: float, tokens_per_second: float | None) -> str:
    limit = bandwidth / bytes_per_token
    reached = "" if tokens_per_second is None else f"; W0 at {100 * tokens_per_second / limit:.0f}% of it"
    return (f"W0 {engine}: {bytes_per_token / 1e9:.2f} GB of weights per token, read at {bandwidth / 1e9:.1f} GB/s: "
            f"at most {limit:.1f} tok/s{reached}")
