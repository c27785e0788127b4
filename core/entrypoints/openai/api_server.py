"""``pagedllm serve``: the OpenAI-compatible FastAPI app over an ``AsyncLLMEngine``, run by uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm.engine.arg_utils import from_cli_args
from pagedllm.config import setting_value
from pagedllm.engine.async_llm import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.data_parallel import DataParallelEngine
from pagedllm.entrypoints.openai.chat import create_chat_completion
from pagedllm.entrypoints.openai.cli_args import ServerConfig, merge_model_args
from pagedllm.entrypoints.openai.completions import create_completion
from pagedllm.entrypoints.openai.embeddings import (
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    create_embedding,
    create_rerank,
    create_score,
)
from pagedllm.entrypoints.openai.errors import OpenAIError, install_error_handlers, queue_full
from pagedllm.entrypoints.openai.lora_modules import RUNTIME_UPDATES_ENV, LoRAModules
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from pagedllm.entrypoints.openai.prompts import PromptBuilder
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    check_text_fields,
)
from pagedllm.entrypoints.openai.serving import ServingContext, system_fingerprint
from pagedllm.errors import ConfigError, QueueFullError
from pagedllm.models.generation_defaults import generation_defaults
from pagedllm.models.source import load_tokenizer
from pagedllm.utils import freeze_startup_heap
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm.server")

# After --shutdown-timeout, the requests still in flight are ended with an error event; this is how long their
# responses then have to be written before uvicorn cuts the connections.
FLUSH_SECONDS = 5.0


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    source, engine_config = engine.engine.source, engine.engine.config
    model_names = config.served_model_names or [source.name]
    adapters = lora_modules(engine_config, config, model_names)
    prompts = PromptBuilder(lambda: load_tokenizer(source), engine_config.max_model_len,
                            engine.engine.model_info.vocab_size, config.chat_template,
                            config.max_prompts_per_request)
    ctx = ServingContext(engine, prompts, model_names, config.max_log_len, config.tool_call_parser,
                         log_requests=config.log_requests,
                         sampling_defaults=generation_defaults(source, engine_config.generation_config),
                         system_fingerprint=system_fingerprint(__version__, engine_config.backend,
                                                               engine.engine.model_info.dtype, source.path,
                                                               sorted(engine_config.backend_options.items())),
                         reasoning_parser=config.reasoning_parser, adapters=adapters)
    metrics = ServerMetrics(engine, model_names[0])
    engine.on_step = metrics.observe
    started = int(time.time())

    app = FastAPI(title="pagedllm", version=__version__)
    install_error_handlers(app)

    @app.exception_handler(QueueFullError)
    async def rejected(request: Request, exc: QueueFullError) -> JSONResponse:
        metrics.rejected.inc()
        return queue_full(str(exc))

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_size)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_key)
    if config.cors is not None:  # added last: runs first, so that preflight requests need no key
        app.add_middleware(CORSMiddleware, **config.cors)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            raise engine.dead
        stalled = engine.stalled_for(config.iteration_timeout)
        if stalled is not None:
            raise OpenAIError(503, f"the engine has made no progress for {stalled:.0f} s with requests in flight "
                                   f"(a step or a tensor-parallel collective hangs; VLLM_ENGINE_ITERATION_TIMEOUT_S "
                                   f"is {config.iteration_timeout:g})")
        return Response(status_code=200)

    @app.get("/ping", include_in_schema=False)
    @app.post("/ping", include_in_schema=False)
    async def ping() -> Response:  # vLLM's (SageMaker's) liveness route: /health's answer, and no input
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "pagedllm", "root": source.name,
             "parent": None, "max_model_len": engine_config.max_model_len} for name in model_names] + [
            {"id": name, "object": "model", "created": started, "owned_by": "pagedllm", "root": name,
             "parent": model_names[0], "max_model_len": engine_config.max_model_len}
            for name in (adapters.names() if adapters is not None else [])]}

    if adapters is not None and os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true"):
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            check_text_fields(body)
            adapters.add(body.lora_name, body.lora_path)
            logger.info("LoRA adapter %r added from %s", body.lora_name, body.lora_path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            check_text_fields(body)
            adapters.remove(body.lora_name)  # its weights leave the engine when another adapter needs the room
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                            media_type="text/plain")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, ctx)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await create_embedding(body, request, ctx)

    @app.post("/v1/score")
    @app.post("/score", include_in_schema=False)
    async def score(body: ScoreRequest, request: Request):
        return await create_score(body, request, ctx)

    @app.post("/v1/rerank")
    @app.post("/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    async def rerank(body: RerankRequest, request: Request):
        return await create_rerank(body, request, ctx)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        check_text_fields(body)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            prompts.check_length(body.prompt, "prompt")
            prompt = await prompts.run(prompts.encode, body.prompt, add_special_tokens=add_special)
        else:
            prompt = await prompts.run(prompts.chat_prompt, body.messages, body,
                                       add_special_tokens=bool(body.add_special_tokens))
        token_ids = prompt["prompt_token_ids"]
        return JSONResponse({"count": len(token_ids), "max_model_len": engine_config.max_model_len,
                             "tokens": token_ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        ctx.check_model(body.model)
        vocab = engine.engine.model_info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        if len(body.tokens) > engine_config.max_model_len:
            raise OpenAIError(400, f"tokens has {len(body.tokens)} token ids, more than max_model_len "
                                   f"{engine_config.max_model_len}", param="tokens")
        return JSONResponse({"prompt": await prompts.run(lambda: prompts.tokenizer.decode(body.tokens))})

    return app


def lora_modules(engine_config, config: ServerConfig, model_names: list[str]) -> LoRAModules | None:
    """The adapters of --lora-modules (None without --enable-lora, which run_server checks before loading)."""
    if not engine_config.enable_lora:
        return None
    adapters = LoRAModules(model_names)
    for name, path in config.lora_modules:
        try:
            adapters.add(name, path)
        except OpenAIError as exc:
            raise ConfigError(f"--lora-modules {name}={path}: {exc.message}") from None
    return adapters


def run_server(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 once drained) or the engine dies (exit 1, for a supervisor to restart)."""
    merge_model_args(args)
    config = ServerConfig.from_cli_args(args)  # checked before the model loads
    engine_args = from_cli_args(args)
    if config.lora_modules and not setting_value(engine_args, "enable_lora"):
        raise ConfigError("--lora-modules needs --enable-lora")  # before minutes of loading
    replicas = setting_value(engine_args, "data_parallel_size")
    if replicas > 1 and not config.engine_process:
        raise ConfigError("--data-parallel-size runs each replica's engine in a process of its own: drop "
                          "--no-engine-process")
    engine = DataParallelEngine(engine_args, replicas) if replicas > 1 else \
        AsyncLLMEngine(engine_args, engine_process=config.engine_process)
    died: list[EngineDeadError] = []
    try:
        app = build_app(engine, config)
        log_level = config.uvicorn_log_level or os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").lower()
        server = _DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                                timeout_graceful_shutdown=config.shutdown_timeout + FLUSH_SECONDS,
                                                limit_concurrency=config.limit_concurrency,
                                                timeout_keep_alive=config.timeout_keep_alive,
                                                root_path=config.root_path, **config.ssl),
                                 engine, config.shutdown_timeout)

        def engine_died(error: EngineDeadError) -> None:
            died.append(error)
            logger.error("the engine is dead (%s): answering 503 for %g s (--shutdown-timeout), then exiting with "
                         "status 1", error, config.shutdown_timeout)
            _daemon_timer(config.shutdown_timeout, lambda: setattr(server, "should_exit", True))

        engine.on_dead = engine_died
        _exit_zero_after_graceful_stop()
        names = ", ".join(config.served_model_names or [engine.engine.source.name])
        logger.info("serving %s at %s://%s:%d (OpenAI API under /v1; API key %s; requests up to %d bytes; engine "
                    "%s)", names, "https" if config.ssl else "http", config.host, config.port,
                    "required" if config.api_key else "off", config.max_request_size,
                    f"{replicas} replicas, each in its own process" if replicas > 1 else
                    "in its own process" if config.engine_process else "on a thread of this process")
        if not config.api_key and not _is_loopback(config.host):
            logger.warning("listening on %s without an API key: anyone who can reach this port can use the model; "
                           "pass --api-key (or PAGEDLLM_API_KEY) unless a proxy in front checks who calls",
                           config.host)
        freeze_startup_heap()
        server.run()
    finally:
        engine.shutdown()
    return 0 if server.started and not died else 1


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, uvicorn stops accepting connections and waits for those open; requests in flight get
    ``drain_seconds`` to finish, then the engine is shut down, so each ends with an error event (or a 503) instead
    of a connection cut mid-stream."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, drain_seconds: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_seconds = drain_seconds

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            logger.info("%s: requests in flight have %g s (--shutdown-timeout) to finish",
                        signal.Signals(sig).name, self.drain_seconds)
            _daemon_timer(self.drain_seconds, self._end_requests_in_flight)
        super().handle_exit(sig, frame)

    def _end_requests_in_flight(self) -> None:
        in_flight = self.engine.requests_tracked
        if in_flight:
            logger.warning("--shutdown-timeout passed: ending the %d requests still in flight with an error",
                           in_flight)
        self.engine.shutdown()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _daemon_timer(seconds: float, action) -> None:
    timer = threading.Timer(seconds, action)
    timer.daemon = True  # a server that stopped sooner does not wait for it
    timer.start()


def _exit_zero_after_graceful_stop() -> None:
    """uvicorn re-raises the SIGTERM/SIGINT that stopped it once it has shut down gracefully; under the default
    actions that would kill the process (status 143) or raise KeyboardInterrupt. Handlers that log instead make a
    graceful stop exit 0."""
    def stopped(signum, frame) -> None:
        logger.info("stopped by %s", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
