"""Which model architectures the cpu backend runs: transformers' own model class runs each one, with the backend's
paged attention function registered in its place and the C++ kernels swapped into the layers whose code they
match. Adding one is a name here plus its equality test against transformers."""

from __future__ import annotations

from pagedllm.errors import UnsupportedModelError

# transformers model_type of each architecture the equality tests cover
SUPPORTED = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt2"})


def check_supported(config) -> str:
    """The config's model_type, or UnsupportedModelError naming it and what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        names = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise UnsupportedModelError(
            f"the cpu backend does not support model_type {model_type!r} ({names}); supported: "
            f"{', '.join(sorted(SUPPORTED))}")
    return model_type
