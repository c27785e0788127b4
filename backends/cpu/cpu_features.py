"""What this CPU can do, read at run time from the kernel."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512_BF16 or AMX-BF16: bf16 matmuls run natively, so bf16 is the faster default."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags
