"""Default sampling settings from the model's ``generation_config.json`` (vLLM's ``--generation-config auto``): a
request that leaves temperature, top_p, ... out gets the values the model's authors chose."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pagedllm.errors import ConfigError
from pagedllm.models.source import ModelSource

logger = logging.getLogger("pagedllm.model")

# generation_config.json key -> SamplingParams field, as vLLM reads them
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty"}


def generation_defaults(source: ModelSource, setting: str = "auto") -> dict:
    """SamplingParams field -> default, for the fields the config sets; empty for ``vllm``."""
    if setting == "vllm":
        return {}
    folder = Path(setting) if setting != "auto" else (source.config_dir or source.tokenizer_dir)
    path = folder / "generation_config.json"
    if setting != "auto" and not path.is_file():
        raise ConfigError(f"--generation-config {setting!r}: no generation_config.json there")
    try:
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s, which cannot be read: %s", path, exc)
        return {}
    defaults = {field: raw[key] for key, field in _FIELDS.items()
                if isinstance(raw.get(key), (int, float)) and not isinstance(raw.get(key), bool)}
    if defaults:
        logger.info("default sampling settings from %s: %s (--generation-config vllm ignores them)", path.name,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults
