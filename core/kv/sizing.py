"""How many KV blocks fit: the KV cache space setting checked against the memory this process can still use (the
kernel's MemAvailable, capped by a cgroup limit), read after the weights are loaded."""

from __future__ import annotations

import logging
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.errors import ConfigError
from pagedllm.utils import cdiv

logger = logging.getLogger("pagedllm.kv")

GiB = 1 << 30


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or the v1 equivalent."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60):
            return max(0, int(limit) - usage)
    return None


def available_memory_bytes() -> int | None:
    """Bytes that can still be allocated (None if unknown). Called after the weights are loaded, so
    it is the machine's free memory minus the weights."""
    values = [v for v in (_meminfo_available(), _cgroup_headroom()) if v is not None]
    return min(values) if values else None



def num_kv_blocks(config: EngineConfig, bytes_per_block: int, caches_here: int = 1) -> int:
    """Blocks for the KV cache space (each of ``caches_here`` caches on this machine holds that much); the default
    never takes more than the memory left after the weights, and an explicit size larger than that is refused (the
    OOM kill users meet otherwise)."""
    src = config.sources.get("kv_cache_space", "default")
    src = "--kv-cache-space" if src == "flag" else src
    available = available_memory_bytes()
    if available is not None:
        usable_gib = 0.9 * available / GiB / caches_here  # headroom for activations and the rest of the process
        each = f" for each of the {caches_here} tensor-parallel ranks on this machine" if caches_here > 1 else ""
        if config.kv_cache_space > usable_gib:
            if src != "default":
                raise ConfigError(
                    f"the KV cache space {config.kv_cache_space:g} GiB (from {src}) is more than the "
                    f"{usable_gib:.2f} GiB of memory available{each} after loading the model; lower it")
            logger.info("KV cache space: the default %g GiB is more than the %.2f GiB available%s: using %.2f GiB",
                        config.kv_cache_space, usable_gib, each, usable_gib)
            config.kv_cache_space = usable_gib
    num_blocks = int(config.kv_cache_space * GiB) // bytes_per_block
    needed = cdiv(config.max_model_len, config.block_size)
    if num_blocks < needed:
        need_gib = needed * bytes_per_block / GiB
        raise ConfigError(
            f"the KV cache is too small: {config.kv_cache_space:g} GiB (from {src}) holds {num_blocks} blocks of "
            f"{config.block_size} tokens ({bytes_per_block} bytes each), but one sequence of max_model_len "
            f"{config.max_model_len} needs {needed} blocks ({need_gib:.3g} GiB). Raise --kv-cache-space to at "
            f"least {need_gib:.3g} or lower --max-model-len")
    return num_blocks
