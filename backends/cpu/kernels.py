"""The backend's C++ kernels (csrc/: paged attention for decodes and prompt chunks, RMSNorm, SwiGLU's
silu(gate) * up, rotary embedding, thread pinning), compiled once per machine by torch's extension loader.

The build is cached under the pagedllm cache directory, keyed by the sources, torch's version and the CPU's
flags (it is built with -march=native). ``PAGEDLLM_CPU_ATTENTION=torch`` skips it; ``=kernel`` makes a build
failure an error instead of a fallback to the pure torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from pagedllm.backends.cpu.cpu_features import cpu_flags
from pagedllm.errors import ConfigError
from pagedllm.model_source import cache_dir

logger = logging.getLogger("pagedllm.cpu")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))
MODES = ("auto", "kernel", "torch")


@functools.lru_cache(maxsize=None)
def load_kernels(mode: str = "auto"):
    """(module or None, description of the attention path in use)."""
    if mode not in MODES:
        raise ConfigError(f"PAGEDLLM_CPU_ATTENTION={mode!r}: use one of {', '.join(MODES)}")
    if mode == "torch":
        return None, "pure torch (PAGEDLLM_CPU_ATTENTION=torch)"
    source = b"".join(path.name.encode() + path.read_bytes() for path in _SOURCES + _HEADERS)
    key = hashlib.sha256(source + torch.__version__.encode() + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    build_dir = cache_dir() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.info("compiling the C++ kernels once for this machine (about a minute) in %s",
                    build_dir)
    start = time.time()
    try:
        from torch.utils.cpp_extension import load

        module = load(name=f"pagedllm_cpu_kernels_{key}", sources=[str(path) for path in _SOURCES],
                      build_directory=str(build_dir),
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], extra_ldflags=["-fopenmp"],
                      verbose=False)
    except Exception as exc:
        if mode == "kernel":
            raise
        logger.warning("the C++ kernels could not be built (%s); using pure torch attention", exc)
        return None, f"pure torch (the C++ kernel could not be built: {type(exc).__name__})"
    if fresh:
        logger.info("compiled the C++ kernels in %.0f s", time.time() - start)
    return module, "C++ kernels (paged attention for decodes and prompts, RMSNorm, SiLU-and-multiply, RoPE)"


def attention_mode() -> str:
    return os.environ.get("PAGEDLLM_CPU_ATTENTION", "auto").strip().lower() or "auto"
