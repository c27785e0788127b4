"""pagedllm: LLM inference and serving on CPUs over a paged KV cache.

This package is the folder ``core/``; ``pagedllm.backends`` is ``backends/`` and ``pagedllm.plugins`` is
``plugins/`` (``package-dir`` in pyproject.toml). The names below load on first use, so that a backend importing
only the contract (``pagedllm.backend``, ``pagedllm.batch``, ``pagedllm.errors``) does not pull in the engine,
the scheduler or transformers.
"""

from __future__ import annotations

import importlib

from pagedllm.logger import configure_logging
from pagedllm.version import __version__ as __version__

configure_logging()

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "pagedllm.engine.llm",
    "AsyncLLM": "pagedllm.engine.async_llm",
    "AsyncEngineArgs": "pagedllm.config",
    "SamplingParams": "pagedllm.sampling_params",
    "LoRARequest": "pagedllm.lora_request",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "PoolingParams": "pagedllm.pooling.params",
    "RequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "EngineArgs": "pagedllm.config",
    "EngineConfig": "pagedllm.config",
    "Backend": "pagedllm.backend",
    "ModelInfo": "pagedllm.backend",
    "ModelSource": "pagedllm.models.source",
    "Batch": "pagedllm.batch",
    "EncodeBatch": "pagedllm.batch",
    "BackendNotFoundError": "pagedllm.errors",
    "ConfigError": "pagedllm.errors",
    "InvalidRequestError": "pagedllm.errors",
    "ModelNotFoundError": "pagedllm.errors",
    "UnsupportedModelError": "pagedllm.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
