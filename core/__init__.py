"""pagedllm: LLM inference and serving on CPUs over a paged KV cache."""

from pagedllm.logger import configure_logging

configure_logging()

from pagedllm.backend import Backend, ModelInfo  # noqa: E402
from pagedllm.batch import Batch  # noqa: E402
from pagedllm.config import EngineArgs, EngineConfig  # noqa: E402
from pagedllm.engine import LLMEngine  # noqa: E402
from pagedllm.errors import (  # noqa: E402
    BackendNotFoundError,
    ConfigError,
    InvalidRequestError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from pagedllm.llm import LLM  # noqa: E402
from pagedllm.model_source import ModelSource  # noqa: E402
from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LLMEngine",
    "EngineArgs",
    "EngineConfig",
    "Backend",
    "ModelInfo",
    "ModelSource",
    "Batch",
    "BackendNotFoundError",
    "ConfigError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "UnsupportedModelError",
]
