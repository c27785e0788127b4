"""The cpu backend: picks the dtype, owns a ModelRunner, and answers the core's questions.

torch and the runner are imported when a model loads, not with this module: the CLI reads the backend's settings
from it, and ``pagedllm --help`` or a server's front end should not wait for torch to get them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.backend import Backend, ModelInfo
from pagedllm.backends.common import cpu_features
from pagedllm.backends.common.cpu_binding import TENSOR_PARALLEL_SIZE, THREADS_BIND, replica_plans
from pagedllm.backends.common.quantization import INT8_ACTIVATIONS, QUANTIZATION
from pagedllm.backends.cpu.tensor_parallel.launch import (
    DISTRIBUTED_INIT_METHOD,
    NNODES,
    NODE_COMMAND,
    NODE_RANK,
    local_init_method,
    local_ranks,
)
from pagedllm.batch import Batch, EncodeBatch
from pagedllm.config import EngineConfig, Setting
from pagedllm.errors import ConfigError
from pagedllm.models.source import ModelSource

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.backends.cpu.runner.model_runner import ModelRunner
    from pagedllm.backends.cpu.tensor_parallel.executor import TensorParallelExecutor

logger = logging.getLogger("pagedllm.cpu")
# The attention kernels hold a block's softmax weights on the stack (csrc/paged_attention.cpp, block_accumulate).
MAX_BLOCK_SIZE = 1024


def choose_dtype(requested: str, native_bf16: bool) -> tuple[torch.dtype, str]:
    """(dtype, why) for the user's --dtype."""
    import torch

    if requested == "float32":
        return torch.float32, "float32 as asked"
    if requested == "bfloat16":
        return torch.bfloat16, "bfloat16 as asked" + ("" if native_bf16 else " (no native bf16 on this CPU: slow)")
    if requested == "float16":
        return torch.bfloat16, "float16 asked: the cpu backend runs it as bfloat16"
    if native_bf16:
        return torch.bfloat16, "auto: bfloat16, the CPU has AVX512_BF16/AMX"
    return torch.float32, "auto: float32, the CPU lacks AVX512_BF16/AMX"


def choose_kv_cache(requested: str, model_dtype: torch.dtype) -> tuple[str, torch.dtype, str]:
    """(kind, dtype, description) of the KV cache for --kv-cache-dtype."""
    import torch

    if requested == "u8":
        return "u8", torch.uint8, "u8 with a float32 scale and minimum per token and head"
    if requested == "fp32":
        return "plain", torch.float32, "float32"
    if requested in ("bf16", "fp16"):
        note = " (fp16 asked: run as bfloat16)" if requested == "fp16" else ""
        return "plain", torch.bfloat16, "bfloat16" + note
    return "plain", model_dtype, str(model_dtype).removeprefix("torch.") + " (the model's)"


RESIDUAL_DTYPE = Setting(
    "residual_dtype", str, "float32", "dtype of the residual stream between fused decoder layers under bf16 weights: "
    "float32 (as llama.cpp; bf16 rounding touches only GEMM inputs) or model (as vLLM and transformers)",
    ("float32", "model"))


class CPUBackend(Backend):
    name = "cpu"
    # 16 as vLLM's GPU default: the decode kernel reads a block per (sequence, KV head) at a time, and longer
    # blocks cost fewer scattered reads; half a block per sequence is what the cache wastes.
    default_block_size = 16
    writes_kv_before_attention = True  # see attention.paged_attention: write, then attend
    env_vars = {
        "kv_cache_space": ("PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"),
        "kv_cache_dtype": ("PAGEDLLM_CPU_KV_CACHE_PRECISION", "VLLM_CPU_KV_CACHE_PRECISION"),
    }
    settings = (QUANTIZATION, INT8_ACTIVATIONS, THREADS_BIND, RESIDUAL_DTYPE, TENSOR_PARALLEL_SIZE,
                DISTRIBUTED_INIT_METHOD, NNODES, NODE_RANK)

    def __init__(self, config: EngineConfig, model: ModelSource) -> None:
        super().__init__(config, model)
        options = config.backend_options
        self.dtype, self.dtype_reason = choose_dtype(config.dtype, cpu_features.has_native_bf16())
        self.cache_kind, self.cache_dtype, self.cache_reason = choose_kv_cache(config.kv_cache_dtype, self.dtype)
        self.tensor_parallel = options["tensor_parallel_size"] > 1 or options["nnodes"] > 1
        if self.tensor_parallel:
            ranks, self.rank_plans = local_ranks(options, reserve_for_server=config.serving,
                                                 replica=config.data_parallel_rank,
                                                 replicas=config.data_parallel_size)
            if ranks.start:
                raise ConfigError(f"--node-rank {options['node_rank']} runs tensor-parallel ranks only, no engine: "
                                  f"start it with `{NODE_COMMAND} --node-rank {options['node_rank']} ...` (see "
                                  f"`{NODE_COMMAND} --help`)")
            self.thread_plan = self.rank_plans[0]
        else:
            self.thread_plan = replica_plans(options["cpu_omp_threads_bind"], 1, config.data_parallel_rank,
                                             config.data_parallel_size, reserve_for_server=config.serving)[0]
        from pagedllm.backends.cpu.runner.kernels import attention_mode

        self.quantization = _quantization(options["quantization"], model.kind, attention_mode() != "torch")
        # int8 weights of a bf16 model are W8A8; a float32 model's decode steps keep int16 activations over them
        self.int8_activations = options["int8_activations"] or (self.quantization == "int8"
                                                                and _name(self.dtype) == "bfloat16")
        self.runner: ModelRunner | TensorParallelExecutor | None = None

    def load_model(self) -> ModelInfo:
        import torch

        from pagedllm.backends.cpu.runner.allocator import loading_weights
        from pagedllm.backends.cpu.runner.kernels import attention_mode, load_kernels
        from pagedllm.backends.cpu.runner.model_runner import ModelRunner
        from pagedllm.backends.cpu.runner.threads import ThreadBinder

        if self.model.config_dir is None:
            raise ConfigError(
                f"{self.model.path} is an OpenVINO export; run it with --backend openvino, or give the cpu "
                f"backend a Hugging Face folder or a GGUF file")
        logger.info("CPU: %s", cpu_features.describe())
        logger.info("dtype: %s; KV cache: %s", self.dtype_reason, self.cache_reason)
        residual = torch.float32 if self.config.backend_options["residual_dtype"] == "float32" else self.dtype
        if self.config.runner == "pooling":
            return self._load_encoder()
        if self.config.enable_lora and self.tensor_parallel:
            raise ConfigError("--enable-lora runs on one rank here: drop --tensor-parallel-size (adapters are not "
                              "sharded over tensor-parallel ranks)")
        if self.tensor_parallel:
            return self._start_ranks(residual)
        logger.info("threads: %s", self.thread_plan.describe())
        for warning in self.thread_plan.warnings:
            logger.warning("%s", warning)
        kernels, self.attention_path = load_kernels(attention_mode())
        logger.info("attention: %s", self.attention_path)
        if kernels is None and self.quantization != "none" and self.config.backend_options["quantization"] == "auto":
            logger.warning("the C++ kernels are not in use, and quantized weights need them: running dense weights")
            self.quantization = "none"
        self.runner = ModelRunner(self._model_dir(), self.dtype, self.cache_kind, self.cache_dtype,
                                  ThreadBinder(self.thread_plan, kernels), kernels, residual,
                                  quantization=self.quantization, gguf_file=self._gguf_file(),
                                  batch_invariant=self.config.batch_invariant,
                                  int8_activations=self.int8_activations, enable_lora=self.config.enable_lora)
        with loading_weights():
            info = self.runner.load()
        return info

    def _load_encoder(self) -> ModelInfo:
        """The pooling runner: transformers' base model on this process's threads (see encoder_runner.py)."""
        from pagedllm.backends.cpu.runner.encoder_runner import EncoderRunner
        from pagedllm.backends.cpu.runner.kernels import attention_mode, load_kernels
        from pagedllm.backends.cpu.runner.threads import ThreadBinder

        if self.tensor_parallel:
            raise ConfigError("--runner pooling runs on one rank: drop --tensor-parallel-size")
        if self.config.backend_options["quantization"] not in ("auto", "none"):
            raise ConfigError("--runner pooling runs dense weights: drop --quantization")
        self.quantization = "none"
        logger.info("threads: %s", self.thread_plan.describe())
        kernels, _ = load_kernels(attention_mode())  # for pinning the threads
        self.attention_path = "transformers' sdpa (pooling runner)"
        self.runner = EncoderRunner(self._model_dir(), self.dtype, ThreadBinder(self.thread_plan, kernels),
                                    self.config.trust_remote_code)
        return self.runner.load()

    def encode(self, batch: EncodeBatch) -> torch.Tensor:
        return self.runner.encode(batch)

    def _start_ranks(self, residual: torch.dtype) -> ModelInfo:
        from pagedllm.backends.cpu.runner.kernels import attention_mode
        from pagedllm.backends.cpu.tensor_parallel.executor import TensorParallelExecutor

        options = self.config.backend_options
        for plan in self.rank_plans:
            for warning in plan.warnings:
                logger.warning("%s", warning)
        model = {"model_dir": self._model_dir(), "dtype": _name(self.dtype), "cache_kind": self.cache_kind,
                 "cache_dtype": _name(self.cache_dtype), "residual_dtype": _name(residual),
                 "attention_mode": attention_mode(), "quantization": self.quantization,
                 "gguf_file": self._gguf_file(), "batch_invariant": self.config.batch_invariant,
                 "int8_activations": self.int8_activations}
        # a step's logits rows: one per sequence, more with prompt logprobs or proposals to verify (each a token of
        # the step's budget, 2048 unless set; the buffer is paged in as it is used)
        max_rows = max(self.config.max_num_seqs, self.config.max_num_batched_tokens or 2048)
        self.runner = TensorParallelExecutor(model, options["tensor_parallel_size"], self.rank_plans,
                                             options["distributed_init_method"] or local_init_method(), max_rows)
        info = self.runner.load()
        self.attention_path = self.runner.ranks[0]["attention"]
        return info

    def _model_dir(self) -> str:
        """The folder the runner loads: a GGUF file's config folder when its quantized tensors run (the weights come
        from the file), else a folder with dense weights."""
        return str(self.model.config_dir if self.quantization == "gguf" else self.model.hf_dir)

    def _gguf_file(self) -> str | None:
        return str(self.model.path) if self.model.kind == "gguf" else None

    def check_block_size(self, block_size: int) -> None:
        if block_size > MAX_BLOCK_SIZE:
            raise ConfigError(f"block size {block_size} is too large for the cpu backend (at most {MAX_BLOCK_SIZE})")

    def kv_cache_bytes_per_block(self) -> int:
        return self.runner.kv_cache_bytes_per_block(self.config.block_size)

    def kv_caches_on_this_host(self) -> int:
        return len(self.rank_plans) if self.tensor_parallel else 1

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, self.config.block_size)

    def warm_up(self, batch: Batch) -> None:
        self.execute(batch)

    def execute(self, batch: Batch) -> torch.Tensor:
        return self.runner.execute(batch)

    def add_lora(self, lora_id: int, path: str, max_rank: int) -> None:
        self.runner.add_lora(lora_id, path, max_rank)

    def remove_lora(self, lora_id: int) -> None:
        self.runner.remove_lora(lora_id)

    def bound_cpus(self) -> list[int] | None:
        return list(self.thread_plan.cpus) if self.thread_plan.cpus is not None else None

    def release_thread(self) -> None:
        if self.runner is not None and not self.tensor_parallel:
            self.runner.binder.release()

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        import torch

        self.runner.copy_blocks(torch.as_tensor(src, dtype=torch.long), torch.as_tensor(dst, dtype=torch.long))

    def describe(self) -> str:
        from pagedllm.backends.cpu.runner.ipex import ipex_status

        threads = self.runner.describe() if self.tensor_parallel else self.thread_plan.describe()
        cache = "no KV cache (pooling runner)" if self.config.runner == "pooling" else f"KV cache {self.cache_reason}"
        return f"{cache}; {threads}; attention: {self.attention_path} (IPEX: {ipex_status()})"

    def shutdown(self) -> None:
        self.release_thread()
        if self.runner is not None and self.tensor_parallel:
            self.runner.shutdown()
        self.runner = None


def _quantization(requested: str, model_kind: str, kernels: bool) -> str:
    """--quantization resolved for the cpu backend (see runner/quantization.py). auto runs a GGUF file's quantized
    tensors as they are wherever the C++ kernels run: bf16 models on their bf16 kernels, float32 ones (CPUs without
    AVX512_BF16) on the float32 kernels, a decode step's rows streamed and prompts in dequantized tiles (see
    docs/quantization.md). int4 is q4_0."""
    if requested == "auto":
        return "gguf" if model_kind == "gguf" and kernels else "none"
    if requested == "gguf" and model_kind != "gguf":
        raise ConfigError("--quantization gguf keeps a GGUF file's quantized tensors, and this model is a Hugging "
                          "Face folder: use --quantization q8_0, q4_0 or int8 to quantize it at load")
    if requested == "int4":
        logger.info("--quantization int4: the cpu backend's 4-bit weights are q4_0 (GGUF's blocks of 32)")
        return "q4_0"
    return requested


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
