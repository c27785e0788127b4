"""The openvino backend: the core's scheduler and paged KV cache over OpenVINO's CPU plugin.

Load: HF folder -> cached stateful IR (optimum-intel; NNCF int8 weights when asked) or an optimum-cli
folder as is -> paged-attention transformation -> Gather before the LM head -> compile on CPU with the
inference and KV-cache precisions passed explicitly -> KV tensors shaped as the compiled model says.
"""

from __future__ import annotations

import importlib.util
import logging
import time

import numpy as np

from pagedllm.backend import Backend, ModelInfo
from pagedllm.backends.common import cpu_features
from pagedllm.backends.common.cpu_binding import TENSOR_PARALLEL_SIZE, THREADS_BIND
from pagedllm.backends.common.memory import tcmalloc_loaded
from pagedllm.backends.common.quantization import QUANTIZATION
from pagedllm.backends.openvino.precision import Precision, choose_precision, cpu_capabilities
from pagedllm.batch import Batch
from pagedllm.config import EngineConfig, Setting
from pagedllm.errors import ConfigError
from pagedllm.models.source import ModelSource

logger = logging.getLogger("pagedllm.openvino")

INSTALL_HINT = ('run `make install`, or `pip install -e ".[openvino]"` then '
                '`pip install --no-deps optimum-intel==2.2.0` (its torchvision requirement breaks the CPU torch)')
_REQUIRED = (("openvino", "openvino"), ("optimum.intel", "optimum-intel"), ("nncf", "nncf"))
_TYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


QUANTIZE_WEIGHTS = Setting(
    "quantize_weights", str, "none", "weight compression: int8 (or ON) = NNCF int8 weights", ("none", "int8"),
    aliases={"on": "int8", "1": "int8", "true": "int8", "yes": "int8", "off": "none", "0": "none", "false": "none",
             "no": "none"},
    env_aliases=("PAGEDLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS", "VLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS"))


class OpenVINOBackend(Backend):
    name = "openvino"
    default_block_size = 32  # the CPU plugin's paged attention fixes it
    env_vars = {
        "kv_cache_space": ("PAGEDLLM_OPENVINO_KVCACHE_SPACE", "VLLM_OPENVINO_KVCACHE_SPACE"),
        "kv_cache_dtype": ("PAGEDLLM_OPENVINO_CPU_KV_CACHE_PRECISION", "VLLM_OPENVINO_CPU_KV_CACHE_PRECISION"),
    }
    settings = (QUANTIZATION, QUANTIZE_WEIGHTS, THREADS_BIND, TENSOR_PARALLEL_SIZE)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        missing = [package for module, package in _REQUIRED if not _importable(module)]
        if missing:
            return False, f"{', '.join(missing)} not installed: {INSTALL_HINT}"
        if tcmalloc_loaded():  # OpenVINO's CPU plugin segfaults on its first Core() under a preloaded TCMalloc
            return False, "OpenVINO crashes with TCMalloc preloaded: start without LD_PRELOAD=...tcmalloc..."
        return True, ""

    def __init__(self, config: EngineConfig, model: ModelSource) -> None:
        super().__init__(config, model)
        if config.batch_invariant:
            raise ConfigError("--batch-invariant is not available on the openvino backend: OpenVINO's CPU plugin "
                              "picks its GEMM and attention kernels by the batch's shape and exposes no setting that "
                              "fixes their summation order; use --backend cpu")
        self.quantize_weights = _weight_compression(config.backend_options["quantization"],
                                                    config.backend_options["quantize_weights"])
        if model.kind == "openvino" and self.quantize_weights != "none":
            raise ConfigError(
                f"{model.path} is an OpenVINO export, used as is: its weights cannot be compressed again. Drop "
                f"--quantization/--quantize-weights (and VLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS), or export it with "
                f"`optimum-cli export openvino --weight-format int8`")
        self.precision: Precision | None = None
        self.inference_precision = ""
        self.threads_applied = ""
        self.kv_cache = None
        self.request = None

    def load_model(self) -> ModelInfo:
        if self.config.runner == "pooling":
            # its model is optimum-intel's text-generation export turned into a paged one: no hidden-state output
            raise ConfigError("the openvino backend has no pooling runner (embeddings): run the model with "
                              "--backend cpu")
        if self.config.enable_lora:
            # optimum-intel's export bakes the weights into the graph as constants; OpenVINO GenAI's adapters patch
            # its own pipeline's graph, not the paged-attention model this backend compiles
            raise ConfigError("the openvino backend serves no LoRA adapters: its exported graph holds the weights "
                              "as constants; run --enable-lora with --backend cpu")
        import openvino as ov
        from transformers import AutoConfig

        from pagedllm.backends.openvino.export_cache import MODEL_XML
        from pagedllm.backends.openvino.kv_cache import PagedKVCache
        from pagedllm.backends.openvino.logits_gather import gather_before_lm_head
        from pagedllm.backends.openvino.paged_attention import to_paged_attention
        from pagedllm.backends.openvino.threads import distribution_properties, thread_properties

        core = ov.Core()
        distribution = distribution_properties(self.config.backend_options["tensor_parallel_size"],
                                               core.get_property("CPU", "SUPPORTED_PROPERTIES"))
        ir_dir = self._ir_dir()
        model = core.read_model(ir_dir / MODEL_XML)
        to_paged_attention(model)
        gather_before_lm_head(model)

        capabilities = cpu_capabilities(core)
        self.precision = choose_precision(self.config.dtype, self.config.kv_cache_dtype, capabilities)
        threads, self.threads_applied = thread_properties(self.config.backend_options["cpu_omp_threads_bind"],
                                                                 self.config.serving, self.config.data_parallel_rank,
                                                                 self.config.data_parallel_size)
        compiled = core.compile_model(model, "CPU", {**self.precision.compile_properties(), **threads, **distribution})
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self.request = compiled.create_infer_request()
        self.kv_cache = PagedKVCache(compiled)
        logger.info("CPU: %s", cpu_features.describe())
        logger.info("precision: %s; the compiled model runs %s with a %s KV cache", self.precision.reason,
                    self.inference_precision, self.kv_cache.element_type)
        if self.inference_precision != self.precision.inference:
            logger.warning("inference precision %s was asked, but OpenVINO's CPU plugin runs %s on this CPU "
                           "(capabilities %s)", self.precision.inference, self.inference_precision,
                           ", ".join(sorted(capabilities)))

        text = AutoConfig.from_pretrained(ir_dir).get_text_config()
        head_size = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return ModelInfo(
            architecture=text.model_type,
            vocab_size=compiled.output("logits").get_partial_shape()[-1].get_length(),
            num_layers=self.kv_cache.num_layers,
            num_kv_heads=self.kv_cache.num_kv_heads,
            head_size=head_size,
            max_model_len=text.max_position_embeddings,
            dtype=_TYPE_NAMES.get(self.inference_precision, self.inference_precision),
        )

    def _ir_dir(self):
        if self.model.kind == "openvino":
            logger.info("using the OpenVINO export %s as is", self.model.path)
            return self.model.path
        from pagedllm.backends.openvino.export_cache import exported_model

        weight_format = self.quantize_weights if self.quantize_weights in ("int8", "int4") else "fp32"
        return exported_model(self.model.hf_dir, self.model.name, weight_format)

    def check_block_size(self, block_size: int) -> None:
        if block_size != self.kv_cache.block_size:
            raise ConfigError(f"OpenVINO's CPU plugin uses KV blocks of {self.kv_cache.block_size} tokens; pass "
                              f"--block-size {self.kv_cache.block_size} or leave it unset")

    def kv_cache_bytes_per_block(self) -> int:
        return self.kv_cache.bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        committed = self.kv_cache.allocate(num_blocks, self.request)
        logger.info("KV cache: the first %d of %d blocks committed to memory in %.2f s", committed, num_blocks,
                    time.perf_counter() - start)

    def warm_up(self, batch: Batch) -> None:
        self.execute(batch)

    def execute(self, batch: Batch) -> np.ndarray:
        from pagedllm.backends.openvino.step_inputs import paged_inputs

        inputs = paged_inputs(batch, self.kv_cache.num_blocks, self.kv_cache.block_size)
        self.request.infer(inputs, share_inputs=True)
        return self.request.get_tensor("logits").data[:, 0, :]  # the plugin's buffer: used before the next infer

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.kv_cache.copy_blocks(src, dst)

    def describe(self) -> str:
        if self.model.kind == "openvino":
            weights = "weights as in the export folder"
        else:
            weights = (f"{self.quantize_weights} weights (NNCF)" if self.quantize_weights in ("int8", "int4")
                       else "fp32 weights")
        return (f"OpenVINO CPU, inference {self.inference_precision}, KV cache {self.kv_cache.element_type} "
                f"(blocks of {self.kv_cache.block_size}), {weights}, {self.threads_applied}")

    def shutdown(self) -> None:
        self.request = None
        self.kv_cache = None


def _weight_compression(quantization: str, quantize_weights: str) -> str:
    """NNCF's weight compression for --quantization (int8, int4), else --quantize-weights."""
    if quantization in ("auto", "none"):
        return quantize_weights if quantization == "auto" else "none"
    if quantization in ("int8", "int4"):
        return quantization
    raise ConfigError(f"--quantization {quantization} is a cpu-backend format (GGUF blocks); the openvino backend "
                      f"compresses weights with NNCF: use --quantization int8 or int4, or --backend cpu")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is missing
        return False
