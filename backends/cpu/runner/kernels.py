"""The backend's C++ kernels (csrc/: paged attention for decodes and prompt chunks, bf16 linear layers, RMSNorm,
SwiGLU's silu(gate) * up, rotary embedding, LoRA products, thread pinning), compiled by torch's extension loader once
per ISA level.

Each level (see cpu_features) is its own build with that level's instruction set, cached under the pagedllm cache
directory keyed by the sources, torch's version and the level, so a cache built on one machine serves any machine
of the same level. The build for the level in use is made on first use. ``PAGEDLLM_CPU_ATTENTION=torch`` skips the
kernels; ``=kernel`` makes a build failure an error instead of a fallback to the pure torch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import time
from pathlib import Path

import torch

from pagedllm.backends.common.cpu_features import kernel_level
from pagedllm.errors import ConfigError
from pagedllm.models.source import cache_dir

logger = logging.getLogger("pagedllm.cpu")

_CSRC = Path(__file__).parents[1] / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))
MODES = ("auto", "kernel", "torch")
# Compiler flags of each ISA level's build. AMX is reached through oneDNN's brgemm inside torch, so the amx level
# shares the avx512_bf16 build.
ISA_FLAGS = {
    "generic": ["-march=x86-64"] if platform.machine().lower() in ("x86_64", "amd64") else [],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
}
ISA_FLAGS["amx"] = ISA_FLAGS["avx512_bf16"]


def build_key(level: str) -> str:
    """Sources, their folder (ninja records absolute paths: two checkouts must not rebuild each other's folder),
    torch's version and the level's flags."""
    source = b"".join(path.name.encode() + path.read_bytes() for path in _SOURCES + _HEADERS)
    flags = " ".join(ISA_FLAGS[level]).encode()
    return hashlib.sha256(source + str(_CSRC).encode() + torch.__version__.encode() + flags).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def load_kernels(mode: str = "auto", level: str | None = None):
    """(module or None, description of the kernels in use) for the ISA level (default: the one in use here)."""
    if mode not in MODES:
        raise ConfigError(f"PAGEDLLM_CPU_ATTENTION={mode!r}: use one of {', '.join(MODES)}")
    if mode == "torch":
        return None, "pure torch (PAGEDLLM_CPU_ATTENTION=torch)"
    level = level or kernel_level()
    build = "avx512_bf16" if level == "amx" else level
    key = build_key(level)
    # resolved: torch builds a module again whenever its build folder's name changes in a process, and a test's own
    # cache folder links to the shared kernels
    build_dir = (cache_dir() / "kernels").resolve() / f"{build}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    name = f"pagedllm_cpu_kernels_{build}_{key}"
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.info("compiling the C++ kernels once for ISA level %s (about a minute) in %s", build, build_dir)
    start = time.time()
    try:
        from torch.utils.cpp_extension import load

        module = _built(name, build_dir) or load(
            name=name, sources=[str(path) for path in _SOURCES], build_directory=str(build_dir),
            extra_cflags=["-O3", *ISA_FLAGS[level], "-fopenmp", "-fno-math-errno"], extra_ldflags=["-fopenmp"],
            verbose=False)
    except Exception as exc:
        if mode == "kernel":
            raise
        logger.warning("the C++ kernels could not be built (%s); using pure torch attention", exc)
        return None, f"pure torch (the C++ kernel could not be built: {type(exc).__name__})"
    if fresh:
        logger.info("compiled the C++ kernels in %.0f s", time.time() - start)
    return module, (f"C++ kernels built for {build} (paged attention for decodes and prompts, RMSNorm, "
                    f"SiLU-and-multiply, RoPE{', bf16 linear layers' if module.linear_bf16_available() else ''})")


def _built(name: str, build_dir: Path):
    """The module already built under this key (which covers the sources' contents), imported without asking ninja:
    ninja compares file times, and a fresh checkout's sources are newer than every build, so it would compile them
    all again. None if there is none, or it does not load (a build cut short)."""
    library = build_dir / f"{name}.so"
    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def attention_mode() -> str:
    return os.environ.get("PAGEDLLM_CPU_ATTENTION", "auto").strip().lower() or "auto"


def main(argv: list[str] | None = None) -> None:
    """``python -m pagedllm.backends.cpu.runner.kernels [--isa LEVEL]``: build the kernels ahead of first use (a Docker
    image's portable build, or a cache volume's)."""
    import argparse

    from pagedllm.backends.common.cpu_features import LEVELS
    from pagedllm.logger import configure_logging

    parser = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    parser.add_argument("--isa", choices=LEVELS, default=None, help="ISA level to build for (default: this CPU's)")
    args = parser.parse_args(argv)
    configure_logging()
    module, description = load_kernels("kernel", args.isa)
    print(f"{description}: {module.__file__}")


if __name__ == "__main__":
    main()
