"""Which model architectures the cpu backend runs. Adding one is one entry here plus its test.

transformers' own model class runs each architecture; the backend only swaps in its paged attention
function. An entry lists the transformers ``model_type`` and any keyword its attention call needs.
"""

from __future__ import annotations

import dataclasses

from pagedllm.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_type: str
    example: str  # a well-known checkpoint of this architecture, for docs and errors


SUPPORTED: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("llama", "meta-llama/Llama-3.2-1B, HuggingFaceTB/SmolLM2-135M-Instruct"),
        Architecture("mistral", "mistralai/Mistral-7B-Instruct-v0.3"),
        Architecture("qwen2", "Qwen/Qwen2.5-0.5B-Instruct"),
        Architecture("qwen3", "Qwen/Qwen3-0.6B"),
        Architecture("phi3", "microsoft/Phi-3-mini-4k-instruct"),
        Architecture("gemma", "google/gemma-2b-it"),
        Architecture("opt", "facebook/opt-125m"),
        Architecture("gpt2", "openai-community/gpt2"),
    )
}


def check_supported(config) -> Architecture:
    model_type = getattr(config, "model_type", None)
    arch = SUPPORTED.get(model_type)
    if arch is None:
        names = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise UnsupportedModelError(
            f"the cpu backend does not support model_type {model_type!r} ({names}); supported: "
            f"{', '.join(sorted(SUPPORTED))}")
    return arch
