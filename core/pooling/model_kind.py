"""Which runner a model gets (``--runner``, ``--convert``, as vLLM's): generate, or pooling for embedding models."""

from __future__ import annotations

import json

from pagedllm.config import EngineConfig
from pagedllm.errors import ConfigError
from pagedllm.models.source import ModelSource

# transformers classes of encoders loaded without a head: what embedding models' configs name
_ENCODER_SUFFIXES = ("BertModel", "RobertaModel", "XLMRobertaModel", "DistilBertModel", "MPNetModel", "NomicBertModel",
                     "ModernBertModel", "DebertaV2Model", "ElectraModel")


def resolve_runner(config: EngineConfig, source: ModelSource) -> str:
    """``generate`` or ``pooling``. auto: pooling for a sentence-transformers folder (modules.json) or an encoder
    without a head (BertModel, ...); ``--convert embed`` makes any model a pooling one."""
    if config.convert == "embed":
        if config.runner == "generate":
            raise ConfigError("--convert embed makes an embedding model: it goes with --runner pooling (or auto)")
        return "pooling"
    if config.runner != "auto":
        return config.runner
    folder = source.config_dir
    if folder is None:
        return "generate"
    if (folder / "modules.json").is_file():
        return "pooling"
    try:
        architectures = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError):
        return "generate"
    return "pooling" if any(a.endswith(_ENCODER_SUFFIXES) for a in architectures) else "generate"
