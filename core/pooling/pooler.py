"""How a sequence's hidden states become one vector: the pooling type (MEAN over its tokens, its CLS (first) token,
or its LAST token) and whether to L2-normalize, read from the model's sentence-transformers config when it has one
(``modules.json``: a Pooling module's config, a Normalize module), else vLLM's defaults (CLS for encoders, LAST for
decoders, normalized), and ``--pooler-config`` over either."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from pagedllm.errors import ConfigError

logger = logging.getLogger("pagedllm.pooling")

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# a sentence-transformers Pooling module's flags -> our pooling type
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str
    normalize: bool
    source: str  # where it came from, for the log


def pooler_config(model_dir: Path | None, decoder: bool, override: str | None) -> PoolerConfig:
    """The model's pooler config: its sentence-transformers files, else the default for its kind; ``override``
    (``--pooler-config`` JSON: ``{"pooling_type": "MEAN", "normalize": false}``) wins field by field."""
    config = _sentence_transformers_config(model_dir) if model_dir is not None else None
    if config is None:
        config = PoolerConfig("LAST" if decoder else "CLS", True,
                              f"the default for {'a decoder' if decoder else 'an encoder'} (no modules.json)")
    if not override:
        return config
    try:
        fields = json.loads(override)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--pooler-config is not valid JSON: {exc}") from None
    if not isinstance(fields, dict) or set(fields) - {"pooling_type", "normalize"}:
        raise ConfigError(f"--pooler-config takes {{\"pooling_type\": one of {', '.join(POOLING_TYPES)}, "
                          f"\"normalize\": true|false}}, got {override}")
    pooling_type = str(fields.get("pooling_type", config.pooling_type)).upper()
    if pooling_type not in POOLING_TYPES:
        raise ConfigError(f"--pooler-config: pooling_type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
    normalize = fields.get("normalize", config.normalize)
    if not isinstance(normalize, bool):
        raise ConfigError(f"--pooler-config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(pooling_type, normalize, f"{config.source}, with --pooler-config")


def _sentence_transformers_config(model_dir: Path) -> PoolerConfig | None:
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
        pooling = kinds.get("Pooling")
        if pooling is None:
            return None
        flags = json.loads((model_dir / pooling["path"] / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{modules_file} (sentence-transformers' module list) cannot be read: {exc}") from None
    chosen = [kind for flag, kind in _ST_MODES.items() if flags.get(flag)]
    others = [flag for flag, value in flags.items() if flag.startswith("pooling_mode") and value
              and flag not in _ST_MODES]
    if len(chosen) != 1 or others:
        raise ConfigError(f"{model_dir}: its sentence-transformers pooling ({', '.join(chosen + others) or 'none'}) "
                          f"is not one of {', '.join(POOLING_TYPES)} alone; pass --pooler-config")
    return PoolerConfig(chosen[0], "Normalize" in kinds, "the model's sentence-transformers config")


def pool(hidden: torch.Tensor, lengths: list[int], pooling_type: str) -> torch.Tensor:
    """[num_seqs, hidden] from the flattened [tokens, hidden] states of sequences of ``lengths`` tokens."""
    lens = torch.tensor(lengths)
    ends = torch.cumsum(lens, 0)
    if pooling_type == "CLS":
        return hidden[ends - lens]
    if pooling_type == "LAST":
        return hidden[ends - 1]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=hidden.dtype).index_add_(0, seq, hidden)
    return sums / lens.unsqueeze(1).to(hidden.dtype)


def finish(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """The first ``dimensions`` entries (all if None), then L2-normalized if asked."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
