"""What this CPU can do, read at run time, and the ISA level the backends act on.

Levels, each including the ones before it: generic < avx2 < avx512 < avx512_bf16 < amx. ``PAGEDLLM_CPU_ISA``
names another level: a lower one makes the backends take the paths of an older CPU (its kernels, float32 for
``--dtype auto``), which is how one machine tests both kinds; a higher one changes only the cpu backend's
``--dtype auto``, since no kernel may use instructions the CPU lacks.
"""

from __future__ import annotations

import functools
import os
import platform

from pagedllm.errors import ConfigError

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
ENV = "PAGEDLLM_CPU_ISA"
# The /proc/cpuinfo flags each level adds to the one below it.
_ADDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
# The same caps for torch's own kernels and MKL, for a process that should run as the lower level throughout
# (read when torch loads, so set before that). Not ONEDNN_MAX_CPU_ISA: OpenVINO's CPU plugin reads it too and
# then fails to build some of its primitives.
_LIBRARY_CAPS = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {},
    "amx": {},
}


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


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's name, family and model from /proc/cpuinfo ("AMD EPYC ..., family 26 model 2"): the ISA level alone
    cannot tell Zen 4 from Zen 5, whose speeds differ by 2x, so logs and benchmark results name the model."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields:
        return f"{name}, family {fields['cpu family']} model {fields.get('model', '?')}"
    return name


def detected_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags this CPU (or ``flags``) has, every lower level's included."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    level = "generic"
    for name in LEVELS[1:]:
        if not set(_ADDS[name]) <= flags:
            break
        level = name
    return level


def requested_level(environ=None) -> str | None:
    """PAGEDLLM_CPU_ISA, checked; None when unset."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in LEVELS:
        raise ConfigError(f"{ENV}={raw!r}: use one of {', '.join(LEVELS)}")
    return raw


def rank(level: str) -> int:
    return LEVELS.index(level)


def kernel_level() -> str:
    """The level kernels may use: the CPU's, or a lower one asked for with PAGEDLLM_CPU_ISA."""
    detected, asked = detected_level(), requested_level()
    return asked if asked is not None and rank(asked) < rank(detected) else detected


def dtype_level() -> str:
    """The level ``--dtype auto`` follows: PAGEDLLM_CPU_ISA when set (higher or lower), else the CPU's."""
    return requested_level() or detected_level()


def has_native_bf16(level: str | None = None) -> bool:
    """AVX512_BF16 or AMX-BF16: bf16 matmuls run natively, so bf16 is the faster default."""
    return rank(dtype_level() if level is None else level) >= rank("avx512_bf16")


def library_caps(level: str) -> dict[str, str]:
    """Env vars that hold torch's own kernels and MKL to ``level`` (set before torch is imported)."""
    return dict(_LIBRARY_CAPS[level])


def describe() -> str:
    """One line for logs and test headers: the CPU's level, what PAGEDLLM_CPU_ISA asked, what kernels use."""
    flags = cpu_flags()
    have = ", ".join(f"{name} {'yes' if set(_ADDS[name]) <= flags else 'no'}" for name in LEVELS[1:])
    line = f"{cpu_model()}: ISA level {detected_level()} ({have})"
    asked = requested_level()
    if asked is not None:
        line += f"; {ENV}={asked}: kernels {kernel_level()}, --dtype auto as {dtype_level()}"
    return line
