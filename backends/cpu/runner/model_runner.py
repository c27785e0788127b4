"""The worker: one model replica (or one tensor-parallel rank's shard of it) and its KV cache, executing batches.

Tensor parallelism puts N of these, each in a worker process with a shard of the weights and the cache, where the
backend otherwise has one (tensor_parallel.executor), without touching the core.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from pagedllm.backend import ModelInfo
from pagedllm.backends.common.memory import blocks_to_commit, checkpoint_mappings, drop_checkpoint_pages
from pagedllm.backends.cpu.layers import attention, kv_cache
from pagedllm.backends.cpu.layers.fused_layers import use_fused_decoder_layers
from pagedllm.backends.cpu.layers.lora import StepAdapters, load_adapter, wrap_projections
from pagedllm.backends.cpu.layers.packed_linear import check_batch_invariant, float32_logits, use_packed_linears
from pagedllm.backends.cpu.layers.quantized_embedding import embed_from_head
from pagedllm.backends.cpu.layers.quantized_linear import (GEMV_ROWS, INT8_ROWS, SMALL_ROWS, quantized_bytes,
                                                        quantized_path)
from pagedllm.backends.cpu.layers.rms_norm import use_fused_rms_norms
from pagedllm.backends.cpu.layers.rotary import use_fused_rotary
from pagedllm.backends.cpu.layers.swiglu import use_fused_swiglu
from pagedllm.backends.cpu.runner.architectures import check_supported
from pagedllm.backends.cpu.runner.huge_pages import weights_on_huge_pages
from pagedllm.backends.cpu.runner import panel_cache
from pagedllm.backends.cpu.runner.gguf_loading import load_gguf_model
from pagedllm.backends.cpu.runner.quantization import describe_quantized, quantize_linears
from pagedllm.backends.cpu.runner.shard_loading import has_safetensors, meta_model_over_files, to_dtype
from pagedllm.backends.cpu.runner.sharding import Rank, check_shardable, shard_model
from pagedllm.backends.cpu.runner.threads import ThreadBinder
from pagedllm.batch import Batch
from pagedllm.errors import ConfigError

logger = logging.getLogger("pagedllm.cpu")
LINEAR_KINDS = {"quantized": "on quantized weights",
                "brgemm": "bf16 through brgemm tiles",
                "brgemm+silu": "SwiGLU gate/up through brgemm tiles with SiLU-and-multiply",
                "oneDNN": "packed for oneDNN"}
# How the quantized linears take their dot products (QuantizedLinear.path), for the log.
QUANTIZED_PATHS = {
    "bf16": f"dot their values with bf16 activations as they stream by up to {GEMV_ROWS[4]} rows ({GEMV_ROWS[8]} for "
            f"8-bit values), unrounded, and dequantize them to bf16 tiles for brgemm above (as the dense model)",
    "int8 and bf16 tiles": f"quantize their activations to int8 per 32 inputs up to {INT8_ROWS} rows (int8 dot "
                           f"products, as llama.cpp), and dequantize their weights to bf16 tiles for brgemm above",
    "int8": f"quantize their activations to int8 per 32 inputs up to {SMALL_ROWS} rows (int8 dot products, as "
            f"llama.cpp), and dequantize their weights to float32 blocks for the GEMM above",
    "int16": f"quantize their activations to int16 per 32 inputs up to {SMALL_ROWS} rows (integer dot products, "
             f"activations to 1 part in 65534 of each chunk's largest), and dequantize their weights to float32 "
             f"blocks for the GEMM above (float32 dot products)",
    "int8 GEMM": "quantize their activations to int8 per row and take oneDNN's int8 GEMM (W8A8, as vLLM CPU)"}


class ModelRunner:
    """One model replica and its KV cache. It runs on the calling thread (the engine's), whose OpenMP team is
    pinned to the plan's CPUs from its first step until the engine releases it (see threads.py for why not a
    thread of its own)."""

    def __init__(self, model_dir: str, dtype: torch.dtype, cache_kind: str, cache_dtype: torch.dtype,
                 binder: ThreadBinder, kernels=None, residual_dtype: torch.dtype | None = None,
                 rank: Rank | None = None, quantization: str = "none", gguf_file: str | None = None,
                 batch_invariant: bool = False, int8_activations: bool = False, enable_lora: bool = False) -> None:
        self.model_dir = model_dir
        self.enable_lora = enable_lora
        self.lora_step = StepAdapters()
        self.lora_targets: dict = {}  # projection as peft names it -> (its LoRA layer, columns)
        self.quantization = quantization  # resolved: "none", "gguf", "q8_0", "q4_0" or "int8"
        self.gguf_file = gguf_file
        self.batch_invariant = batch_invariant
        self.int8_activations = int8_activations  # quantized weights of a bf16 model: int8 dot products for decodes
        self.dtype = dtype
        self.residual_dtype = residual_dtype or dtype
        self.cache_kind = cache_kind  # "plain" or "u8"
        self.cache_dtype = cache_dtype
        self.binder = binder
        self.kernels = kernels
        self.lora_step.kernels = kernels
        self.rank = rank  # None: the whole model in this process
        self.model = None
        self.kv_caches: list[tuple] = []

    def load(self) -> ModelInfo:
        cache = panel_cache.open_panel_cache(*self._weight_sources(), self.quantization, self.dtype, self.rank,
                                             self.enable_lora)
        try:
            return self._load(cache)
        except panel_cache.StalePanels as exc:
            logger.warning("the cached quantized panels in %s do not fit this model (%s): converting it again",
                           cache.path, exc)
            panel_cache.drop(cache)
            return self._load(cache.missed())

    def _weight_sources(self) -> tuple[str, list[Path]]:
        """A name for the weights and the files they come from (the panel cache's key)."""
        if self.quantization == "gguf":
            return Path(self.gguf_file).stem, [Path(self.gguf_file)]
        folder = Path(self.model_dir)
        return folder.name, sorted(path for path in folder.iterdir() if path.is_file())

    def _load(self, cache: panel_cache.PanelCache) -> ModelInfo:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.batch_invariant and self.kernels is None:
            raise ConfigError("--batch-invariant needs the C++ kernels (its attention and linear layers sum in one "
                              "order whatever the batch), and they are not in use here")
        config = AutoConfig.from_pretrained(self.model_dir)
        model_type = check_supported(config)
        if self.rank is not None:
            check_shardable(config.get_text_config(), self.rank.world_size)
        attention.register()
        quantization = self.quantization
        if quantization != "none" and self.kernels is None:
            raise ConfigError(f"--quantization {quantization}: quantized weights need the C++ kernels, which are not "
                              f"in use here (PAGEDLLM_CPU_ATTENTION=torch, or their build failed); use "
                              f"--quantization none")
        if quantization == "gguf":
            self.model, weights = load_gguf_model(self.model_dir, self.gguf_file, self.dtype,
                                                  attention.ATTENTION_NAME, embedding_from_head=True, rank=self.rank,
                                                  placeholders=cache.hit)
        elif self.rank is not None and has_safetensors(self.model_dir):
            # this rank's shard read (and quantized) out of the memory-mapped files: the whole model is never in this
            # process
            self.model = meta_model_over_files(self.model_dir, self.dtype, attention.ATTENTION_NAME)
            weights = quantize_linears(self.model, quantization, self.dtype, self.rank, cache.hit)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=self.dtype, attn_implementation=attention.ATTENTION_NAME)
            self.model.eval()
            weights = quantize_linears(self.model, quantization, placeholders=cache.hit)
        logger.info("%s", describe_quantized(self.model, quantization, weights))
        del weights  # the layers hold them: kept here, every one would outlive its fused and packed forms
        if self.rank is not None:
            shard_model(self.model, self.rank)
            to_dtype(self.model, self.dtype)
        layers = use_fused_decoder_layers(self.model, self.kernels, self.residual_dtype,
                                          fuse_silu=not self.enable_lora)
        if layers:
            logger.info("%d decoder layers fused (q/k/v and gate/up as one GEMM each; residual stream in %s)",
                        layers, str(self.residual_dtype).removeprefix("torch."))
        if self.enable_lora:
            if self.batch_invariant:
                raise ConfigError("--batch-invariant does not go with --enable-lora: the adapters' low-rank products "
                                  "are not computed in one order whatever the batch")
            self.lora_targets = wrap_projections(self.model, self.lora_step)
            logger.info("LoRA: %d projections take adapters (each adapter's low-rank product on its own rows after "
                        "the base GEMM, %s)", len(self.lora_targets),
                        "in the C++ kernel" if self.kernels is not None else "in torch's bmm")
        packed = use_packed_linears(self.model, self.kernels, self.batch_invariant, self.int8_activations)
        if cache.hit:
            panel_cache.restore(cache, self.model)
        elif cache.path is not None:
            panel_cache.store(cache, self.model)
        if embed_from_head(self.model, self.kernels):
            logger.info("token embedding: rows dequantized from the tied LM head's quantized weight per step (no "
                        "dense table)")
        head_in_float32 = float32_logits(self.model)
        held, dense = quantized_bytes(self.model)
        logger.info("linear layers: %s%s%s", ", ".join(f"{count} {LINEAR_KINDS[kind]}" for kind, count in packed.items()
                                                       if count) or "nn.Linear",
                    "; the LM head returns float32 logits" if head_in_float32 else "",
                    f"; quantized ones hold {held / 2**20:.0f} MiB instead of {dense / 2**20:.0f} MiB dense and "
                    f"{QUANTIZED_PATHS[quantized_path(self.model)]}" if packed["quantized"] else "")
        fused = (use_fused_rms_norms(self.model, self.kernels), use_fused_swiglu(self.model, self.kernels),
                 use_fused_rotary(self.model, self.kernels))
        if self.batch_invariant:
            check_batch_invariant(self.model)
            logger.info("batch-invariant: every linear layer sums a row in one order whatever the rows beside it, "
                        "and every token attends through the one-row kernel")
        logger.info("C++ kernels in the other layers: %d RMSNorm layers, %d SwiGLU MLPs, %d attention layers' RoPE",
                    *fused)
        drop_checkpoint_pages(checkpoint_mappings())  # what still views the files faults in only what it reads
        logger.info(weights_on_huge_pages(self.model))
        text = self.model.config.get_text_config()
        num_heads = text.num_attention_heads
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        # This process's cache holds its share of the KV heads.
        self.local_kv_heads = self.num_kv_heads // (self.rank.world_size if self.rank else 1)
        self.head_size = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        self.num_layers = text.num_hidden_layers
        return ModelInfo(
            architecture=model_type,
            vocab_size=text.vocab_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            max_model_len=text.max_position_embeddings,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return kv_cache.bytes_per_block(self.cache_kind, self.num_layers, self.local_kv_heads, block_size,
                                        self.head_size, self.cache_dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_caches = [kv_cache.make_layer_caches(self.cache_kind, num_blocks, self.local_kv_heads, block_size,
                                                     self.head_size, self.cache_dtype)
                          for _ in range(self.num_layers)]
        start = time.perf_counter()
        first = blocks_to_commit(num_blocks, self.kv_cache_bytes_per_block(block_size))
        committed = first if kv_cache.commit_first_blocks(self.kv_caches, first) else 0
        logger.info("KV cache: the first %d of %d blocks committed to memory in %.2f s", committed, num_blocks,
                    time.perf_counter() - start)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        self.binder.ensure_bound()
        metadata = attention.PagedAttentionMetadata(batch, self.kv_caches, self.kernels, self.batch_invariant)
        if self.enable_lora:
            self.lora_step.set(batch.lora_ids, batch.query_start_loc)
        out = self.model(
            input_ids=torch.from_numpy(batch.input_ids).unsqueeze(0),
            position_ids=torch.from_numpy(batch.positions).unsqueeze(0),
            use_cache=False,
            logits_to_keep=torch.from_numpy(batch.logits_indices),
            paged_metadata=metadata,
        )
        return out.logits[0].float()

    def add_lora(self, lora_id: int, path: str, max_rank: int) -> None:
        parts: dict = {}
        for wrapper, part in load_adapter(path, self.lora_targets, max_rank, self.dtype):  # checked before any change
            parts.setdefault(wrapper, []).append(part)
        slots = self.lora_step.slots
        slots[lora_id] = min(set(range(len(slots) + 1)) - set(slots.values()))
        try:
            for wrapper in self._lora_layers():
                wrapper.set_adapter(lora_id, parts.get(wrapper, []), self.dtype)
        except BaseException:
            self.remove_lora(lora_id)
            raise

    def remove_lora(self, lora_id: int) -> None:
        self.lora_step.slots.pop(lora_id, None)  # first: the stacks are rebuilt for the slots that remain
        for wrapper in self._lora_layers():
            wrapper.set_adapter(lora_id, None, self.dtype)

    def _lora_layers(self) -> list:
        return list({id(w): w for w, _, _ in self.lora_targets.values()}.values())

    @torch.inference_mode()
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for keys, values in self.kv_caches:
            keys.copy_blocks(src, dst)
            values.copy_blocks(src, dst)

