"""The backend contract: what the core asks of a backend, and nothing more.

A backend owns tensors, kernels, threads and processes; the core owns scheduling, memory accounting,
tokenization, sampling and the API. Per step exactly one call crosses the line: ``execute(batch)``. This module,
``pagedllm.batch`` and ``pagedllm.errors`` are all a backend needs to import from the core; none of them imports
the engine, the scheduler or transformers.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.batch import Batch, EncodeBatch
    from pagedllm.config import EngineConfig, Setting
    from pagedllm.models.source import ModelSource


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the core needs to know about a loaded model."""

    architecture: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    max_model_len: int  # the model's own limit (max position embeddings)
    dtype: str  # what the weights run in: "float32", "bfloat16", ...
    hidden_size: int = 0  # width of the hidden states (what pooling requests get)
    decoder: bool = True  # causal (a decoder); False for an encoder such as BERT


class Backend(abc.ABC):
    #: Name users pass as ``--backend``.
    name: ClassVar[str]
    #: Block size when the user gives none.
    default_block_size: ClassVar[int] = 16
    #: Extra env var names this backend reads for engine settings, checked before ``PAGEDLLM_<NAME>``,
    #: e.g. ``{"kv_cache_space": ("PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")}``.
    env_vars: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Settings of the backend's own (``pagedllm.config.Setting``): each gets a flag, a ``PAGEDLLM_<NAME>`` env
    #: var plus the env names listed, and a keyword of ``LLM``/``EngineArgs``; the resolved values are in
    #: ``config.backend_options``.
    settings: ClassVar[tuple[Setting, ...]] = ()
    #: True if a forward pass writes every scheduled token's keys and values before any attention reads the
    #: cache: then requests admitted in the same step can share blocks another of them is computing.
    writes_kv_before_attention: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, "") if the backend can run here, else (False, why not)."""
        return True, ""

    def __init__(self, config: EngineConfig, model: ModelSource) -> None:
        self.config = config
        self.model = model

    @abc.abstractmethod
    def load_model(self) -> ModelInfo:
        """Load weights (showing progress when slow) and describe the model. With ``config.runner == "pooling"``
        load it for ``encode`` (no LM head, no KV cache), or raise ConfigError saying the backend cannot."""

    def check_block_size(self, block_size: int) -> None:
        """Raise ConfigError if the backend cannot use ``block_size``."""

    @abc.abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block costs across all layers, keys and values (``config.block_size`` tokens)."""

    def kv_caches_on_this_host(self) -> int:
        """How many caches of the KV space setting this machine holds: one, or one per tensor-parallel rank that
        runs here (the setting is per rank, as in vLLM), so that the core checks them all against its memory."""
        return 1

    @abc.abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache for ``num_blocks`` blocks of ``config.block_size`` tokens."""

    @abc.abstractmethod
    def execute(self, batch: Batch) -> torch.Tensor | np.ndarray:
        """Run one forward pass over the batch; return logits [len(batch.logits_indices), vocab]. They may live in the
        backend's own output buffer: the engine samples from them (and may change them in place) before it calls
        ``execute`` again, and keeps no reference after."""

    def encode(self, batch: EncodeBatch) -> torch.Tensor | np.ndarray:
        """The pooling runner's forward pass: the last hidden states of every token of the batch's prompts,
        [len(batch.input_ids), hidden_size]. Each prompt attends only within itself; nothing is cached."""
        raise NotImplementedError(f"backend {self.name!r} has no pooling runner")

    def warm_up(self, batch: Batch) -> None:
        """Run ``batch`` once before the first request, so that it does not pay one-time costs (kernels compiled,
        primitives created, memory touched on first use). The batch writes KV blocks that are free. Default:
        nothing."""

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the KV contents of blocks ``src[i]`` into ``dst[i]`` (copy-on-write of shared blocks)."""
        raise NotImplementedError(f"backend {self.name!r} cannot copy KV blocks")

    def add_lora(self, lora_id: int, path: str, max_rank: int) -> None:
        """Load the LoRA adapter in peft's format at ``path`` (``adapter_config.json`` and its safetensors) under
        ``lora_id``: later batches name it in ``Batch.lora_ids``. Raise ValueError saying what is wrong with an
        adapter this backend cannot run (a rank above ``max_rank``, a module it cannot adapt). Called only with
        ``config.enable_lora``; a backend that cannot serve adapters refuses that setting at ``load_model``."""
        raise NotImplementedError(f"backend {self.name!r} serves no LoRA adapters")

    def remove_lora(self, lora_id: int) -> None:
        """Unload an adapter no request runs with any more."""
        raise NotImplementedError(f"backend {self.name!r} serves no LoRA adapters")

    def describe(self) -> str:
        """One line for the start-up log: what was chosen (dtype, threads, kernels)."""
        return ""

    def bound_cpus(self) -> list[int] | None:
        """The CPUs the backend's threads are pinned to, if it pins them: a server's front end keeps off them."""
        return None

    def release_thread(self) -> None:
        """The thread that ran steps stops doing so for now (``LLM.generate`` returns to its caller): undo what
        was set on that thread for speed, such as pinning it to one CPU. The next ``execute`` may set it again."""

    def shutdown(self) -> None:
        """Release threads, processes and memory."""
