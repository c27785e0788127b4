"""The cpu backend: picks the dtype, owns a ModelRunner, and answers the core's questions."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm import Backend, Batch, ConfigError, EngineConfig, ModelInfo, ModelSource
from pagedllm.backends.cpu.cpu_features import has_native_bf16
from pagedllm.backends.cpu.model_runner import ModelRunner

logger = logging.getLogger("pagedllm.cpu")


def choose_dtype(requested: str, native_bf16: bool) -> tuple[torch.dtype, str]:
    """(dtype, why) for the user's --dtype."""
    if requested == "float32":
        return torch.float32, "float32 as asked"
    if requested == "bfloat16":
        return torch.bfloat16, "bfloat16 as asked" + ("" if native_bf16 else " (no native bf16 on this CPU: slow)")
    if requested == "float16":
        return torch.bfloat16, "float16 asked: the cpu backend runs it as bfloat16"
    if native_bf16:
        return torch.bfloat16, "auto: bfloat16, the CPU has AVX512_BF16/AMX"
    return torch.float32, "auto: float32, the CPU lacks AVX512_BF16/AMX"


class CPUBackend(Backend):
    name = "cpu"
    default_block_size = 16
    env_vars = {
        "kv_cache_space": ("PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"),
        "cpu_omp_threads_bind": ("VLLM_CPU_OMP_THREADS_BIND",),
    }

    def __init__(self, config: EngineConfig, model: ModelSource) -> None:
        super().__init__(config, model)
        if config.quantize_weights != "none":
            raise ConfigError(f"the cpu backend has no {config.quantize_weights} weight compression; use "
                              f"--backend openvino for it, or --quantize-weights none")
        if config.kv_cache_dtype != "auto":
            raise ConfigError(f"the cpu backend keeps its KV cache in the model dtype for now: "
                              f"--kv-cache-dtype {config.kv_cache_dtype} is not available")
        self.dtype, self.dtype_reason = choose_dtype(config.dtype, has_native_bf16())
        self.runner: ModelRunner | None = None

    def load_model(self) -> ModelInfo:
        if self.model.hf_dir is None:
            raise ConfigError(
                f"{self.model.path} is an OpenVINO export; run it with --backend openvino, or give the cpu "
                f"backend a Hugging Face folder or a GGUF file")
        logger.info("dtype: %s", self.dtype_reason)
        self.runner = ModelRunner(str(self.model.hf_dir), self.dtype)
        return self.runner.load()

    def check_block_size(self, block_size: int) -> None:
        if block_size > 1024:
            raise ConfigError(f"block size {block_size} is too large for the cpu backend (at most 1024)")

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block(self.config.block_size)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, self.config.block_size)

    def execute(self, batch: Batch) -> torch.Tensor:
        return self.runner.execute(batch)

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.runner.copy_blocks(torch.as_tensor(src, dtype=torch.long), torch.as_tensor(dst, dtype=torch.long))

    def describe(self) -> str:
        return f"{torch.get_num_threads()} torch threads, pure torch paged attention"

    def shutdown(self) -> None:
        self.runner = None
