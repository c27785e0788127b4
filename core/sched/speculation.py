"""Speculative decoding's proposals: vLLM's ``--speculative-config`` and the n-gram (prompt lookup) proposer (a
draft model's proposals come from ``engine.draft_model``).

A request that decodes alone (or in a small batch) is bound by reading the weights once per token; verifying k
proposed tokens in the same forward pass reads them once for up to k + 1 tokens. The n-gram proposer looks for the
sequence's last n tokens earlier in the sequence (its prompt, mostly) and proposes what followed them there: free,
and right whenever the output repeats its input (code edits, summaries, extraction, RAG answers).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from pagedllm.errors import ConfigError

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
         "model", "quantization", "draft_tensor_parallel_size"}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int  # no proposals in a step with more running requests than this
    model: str | None = None  # a draft model (its path or Hub id) proposes, not the n-gram lookup
    quantization: str | None = None  # the draft's

    @classmethod
    def parse(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """vLLM's JSON: ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}``, or ``{"model": PATH, "num_speculative_tokens": 4}`` for a draft model."""
        if text is None or text == "":
            return None
        try:
            spec = json.loads(text) if isinstance(text, str) else dict(text)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--speculative-config is not a JSON object: {exc}") from None
        if not isinstance(spec, dict):
            raise ConfigError("--speculative-config is a JSON object, e.g. "
                              '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(spec) - _KEYS)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}")
        model = spec.get("model")
        method = spec.get("method", "ngram" if model is None else "draft_model")
        if method not in ("ngram", "[ngram]", "draft_model"):
            raise ConfigError(f"--speculative-config: method {method!r} is not supported; use \"ngram\" (prompt "
                              f"lookup) or a draft model (\"model\": its path or Hub id)")
        if (method == "draft_model") != (model is not None):
            raise ConfigError("--speculative-config: a draft model needs \"model\", and the n-gram method takes none")
        if model is not None and not isinstance(model, str):
            raise ConfigError(f"--speculative-config: model must be a path or Hub id, got {model!r}")
        if spec.get("draft_tensor_parallel_size", 1) != 1:
            raise ConfigError("--speculative-config: the draft model runs on one rank (draft_tensor_parallel_size 1)")
        quantization = spec.get("quantization")
        if quantization is not None and not isinstance(quantization, str):
            raise ConfigError(f"--speculative-config: quantization must be a string, got {quantization!r}")
        k = spec.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        high = spec.get("prompt_lookup_max", 4)
        low = spec.get("prompt_lookup_min", min(2, high) if isinstance(high, int) else 2)
        batch = spec.get("disable_by_batch_size", 4)
        for name, value in (("prompt_lookup_max", high), ("prompt_lookup_min", low),
                            ("disable_by_batch_size", batch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if low > high:
            raise ConfigError(f"--speculative-config: prompt_lookup_min ({low}) is more than prompt_lookup_max "
                              f"({high})")
        return cls(k, high, low, batch, model, quantization)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_speculative_tokens)`` tokens: what followed the latest earlier occurrence of the
        sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs."""
        k = min(limit, self.num_speculative_tokens)
        length = len(token_ids)
        if k <= 0 or length < self.prompt_lookup_min + 1:
            return []
        ids = np.asarray(token_ids)
        # where the sequence's last token occurred before: every match of a longer tail ends at one of these
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            for end in ends[::-1]:  # the latest earlier match: its continuation is the likeliest to be the next
                start = end - n + 1
                if start >= 0 and token_ids[start:end + 1] == token_ids[length - n:]:
                    return token_ids[end + 1:end + 1 + k]
        return []


def can_speculate(request) -> bool:
    """Whether each next token's distribution follows from its logits row and its grammar (temperature, top-k/top-p/
    min-p; a grammar masks each row as it stands after the proposals before it): none of what depends on the tokens
    before it otherwise (penalties, bias, bad words, min_tokens still pending)."""
    params = request.params
    return (not params.needs_penalties and not params.logit_bias and not params.allowed_token_ids
            and not request.bad_word_ids and request.num_output_tokens >= params.min_tokens)
