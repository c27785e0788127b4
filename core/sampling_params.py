"""Sampling parameters of one request, checked when made so a bad value never reaches a step."""

from __future__ import annotations

import dataclasses
import json

from pagedllm.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
# A seed seeds a torch.Generator and crosses to the engine core as MessagePack: both take a signed 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


STRUCTURED_OUTPUTS_PARAM = "structured_outputs"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``regex``, ``choice`` (the output is one of
    these strings), ``grammar`` (EBNF as xgrammar and llama.cpp's GBNF write it, or Lark), ``json_object=True``
    (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs need exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}", param=STRUCTURED_OUTPUTS_PARAM)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise InvalidRequestError("a JSON schema is a JSON object or its text", param=STRUCTURED_OUTPUTS_PARAM)
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise InvalidRequestError(f"{kind} must be a non-empty string", param=STRUCTURED_OUTPUTS_PARAM)
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError("choice must be a non-empty list of strings", param=STRUCTURED_OUTPUTS_PARAM)
            object.__setattr__(self, "choice", list(value))
        if kind == "json_object" and value is not True:
            raise InvalidRequestError("json_object must be true", param=STRUCTURED_OUTPUTS_PARAM)
        if kind == "json" and isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                          param=STRUCTURED_OUTPUTS_PARAM) from None
            if not isinstance(parsed, dict):
                raise InvalidRequestError("a JSON schema must be a JSON object", param=STRUCTURED_OUTPUTS_PARAM)

    @classmethod
    def from_dict(cls, value: dict) -> "StructuredOutputsParams":
        """vLLM's ``structured_outputs`` request field: {"json" | "regex" | "choice" | "grammar" | "json_object"}."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("structured_outputs must be an object", param=STRUCTURED_OUTPUTS_PARAM)
        unknown = sorted(set(value) - set(_KINDS))
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unsupported key(s) {', '.join(unknown)}; pagedllm "
                                      f"supports {', '.join(_KINDS)}", param=STRUCTURED_OUTPUTS_PARAM)
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: equal keys compile once."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            # property order kept: it is the output's
            value = json.dumps(json.loads(value) if isinstance(value, str) else value)
        elif kind == "choice":
            value = json.dumps(value)
        return kind, str(value)


@dataclasses.dataclass
class SamplingParams:
    """What to generate and how; field names and meanings follow vLLM's ``SamplingParams``."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is taken too

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._check()

    def _check(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if not self.temperature >= 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", f"must be greater than 0, got {self.repetition_penalty}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", f"must be a non-negative integer, got {self.logprobs}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1)

    @property
    def needs_truncation(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
