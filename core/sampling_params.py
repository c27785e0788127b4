"""Sampling parameters of one request, checked when made so a bad value never reaches a step."""

from __future__ import annotations

import dataclasses
import json
import math

from pagedllm.errors import InvalidRequestError
from pagedllm.lora_request import LoRARequest

_GREEDY_EPS = 1e-5
# Every integer crosses to the engine core as MessagePack and into torch tensors: both take a signed 64-bit one.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
INT64_MAX = SEED_MAX
MAX_N = 2**31 - 1  # the engine also caps n at max_num_seqs
MAX_STOP_STRING_CHARS = 4096  # a stop string is looked for in the text of every step


def check_text(value, param: str) -> None:
    """Refuse text that UTF-8 cannot carry (a lone surrogate such as "\\ud800", which JSON allows): neither the
    engine core's messages nor the tokenizer take it. Strings inside lists and dicts are checked too."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(f"{param} holds text that is not valid Unicode (a lone surrogate)",
                                          param=param) from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        check_text([getattr(self, kind) for kind in _KINDS], STRUCTURED_OUTPUTS_PARAM)
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
    prompt_logprobs: int | None = None  # top alternatives per prompt token, beside the token itself
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a dict of its fields is taken too
    allowed_token_ids: list[int] | None = None  # only these may be generated
    bad_words: list[str] | None = None  # words never generated (each as the tokenizer writes it, with or without
    # a leading space)
    lora_request: LoRARequest | None = None  # the adapter to run with: set by generate(lora_request=...) and by the
    # server from a request's model name

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias maps token ids to numbers", param="logit_bias") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._check()

    def _check(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be at least 1 (and at most {MAX_N}), got {self.n!r}")
        if not self.temperature >= 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise bad("top_k", f"must be 0 or -1 (off) or a positive 64-bit integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            raise bad("max_tokens", f"must be a positive 64-bit integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise bad("min_tokens", f"must be a non-negative 64-bit integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", f"must be a finite number greater than 0, got {self.repetition_penalty}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= INT64_MAX):
            raise bad("logprobs", f"must be a non-negative integer, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= INT64_MAX):
            raise bad("prompt_logprobs", f"must be a non-negative integer, got {self.prompt_logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative 64-bit integers")
        if self.logit_bias and any(not 0 <= k <= INT64_MAX or not math.isfinite(v) for k, v in self.logit_bias.items()):
            raise bad("logit_bias", "maps non-negative token ids to finite numbers")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not _is_int(t) or not 0 <= t <= INT64_MAX
                                                  for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w for w in self.bad_words)):
            raise bad("bad_words", "must be a list of non-empty strings")
        if self.bad_words and any(len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
            raise bad("bad_words", f"must be at most {MAX_STOP_STRING_CHARS} characters long each")
        check_text(self.bad_words, "bad_words")
        check_text(self.stop, "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters long")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1)

    @property
    def needs_truncation(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
