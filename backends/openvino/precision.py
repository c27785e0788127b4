"""Which inference and KV-cache precisions to ask the CPU plugin for, and why.

Both are always passed to ``compile_model``: optimum-intel writes ``KV_CACHE_PRECISION=f16`` into the
IR's runtime options, and that hint would otherwise silently beat the plugin default.
"""

from __future__ import annotations

import dataclasses

from pagedllm.backends.common import cpu_features
from pagedllm.errors import ConfigError

# --kv-cache-dtype spelling -> OpenVINO element type name
_KV_TYPES = {"u8": "u8", "bf16": "bf16", "fp16": "f16", "fp32": "f32"}


@dataclasses.dataclass(frozen=True)
class Precision:
    inference: str  # OpenVINO type name for INFERENCE_PRECISION_HINT: f32 | bf16 | f16
    kv_cache: str  # for KV_CACHE_PRECISION: f32 | bf16 | f16 | u8
    reason: str

    def compile_properties(self) -> dict[str, str]:
        return {"INFERENCE_PRECISION_HINT": self.inference, "KV_CACHE_PRECISION": self.kv_cache}


def cpu_capabilities(core) -> frozenset[str]:
    """The CPU device's OPTIMIZATION_CAPABILITIES, without BF16 when PAGEDLLM_CPU_ISA is below avx512_bf16."""
    capabilities = frozenset(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    if not cpu_features.has_native_bf16(cpu_features.kernel_level()):
        capabilities -= {"BF16"}
    return capabilities


def choose_precision(dtype: str, kv_cache_dtype: str, capabilities: frozenset[str]) -> Precision:
    """``capabilities`` is the CPU device's OPTIMIZATION_CAPABILITIES ("BF16" on AVX512_BF16/AMX CPUs)."""
    native_bf16 = "BF16" in capabilities
    if dtype == "float32":
        inference, why = "f32", "float32 as asked (exact mode)"
    elif dtype == "bfloat16":
        inference, why = "bf16", "bfloat16 as asked"
    elif dtype == "float16":
        inference, why = "f16", "float16 as asked"
    elif native_bf16:
        inference, why = "bf16", "auto: bf16, the CPU has AVX512_BF16/AMX"
    else:
        inference, why = "f32", "auto: f32, the CPU lacks AVX512_BF16/AMX"

    if kv_cache_dtype != "auto":
        kv, kv_why = _KV_TYPES[kv_cache_dtype], f"KV cache {_KV_TYPES[kv_cache_dtype]} as asked"
    elif dtype == "float32":
        kv, kv_why = "f32", "KV cache f32 with --dtype float32"
    elif dtype == "float16":
        kv, kv_why = "f16", "KV cache f16 with --dtype float16"
    elif native_bf16:
        kv, kv_why = "bf16", "KV cache bf16 (the CPU has native bf16)"
    else:
        kv, kv_why = "f16", "KV cache f16 (no native bf16 on this CPU)"

    if kv == "bf16" and not native_bf16:
        raise ConfigError(
            f"a bf16 KV cache needs a CPU with AVX512_BF16 or AMX (OpenVINO reports "
            f"{', '.join(sorted(capabilities))}); pass --kv-cache-dtype fp16, u8 or fp32")
    if kv == "f32" and inference != "f32":
        raise ConfigError(
            f"an fp32 KV cache needs float32 inference, but the inference precision is {inference} ({why}); "
            f"pass --dtype float32, or --kv-cache-dtype u8/fp16")
    return Precision(inference, kv, f"{why}; {kv_why}")
