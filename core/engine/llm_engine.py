"""The engine: requests in, one scheduled forward pass per step, outputs out.

``step()`` is schedule → build batch → backend.execute → sample → update requests. Everything a
backend sees per step is the ``Batch``; everything else (memory accounting, tokenization,
sampling, stop conditions) happens here.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import time
from typing import Iterable

import numpy as np
import torch

from pagedllm.backend import Backend, ModelInfo
from pagedllm.batch import Batch, EncodeBatch
from pagedllm.config import EngineArgs, EngineConfig, resolve, resolve_backend_name
from pagedllm.engine.arg_utils import setting_owners
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.draft_model import DraftModel, draft_config
from pagedllm.engine.input_processing import PromptType, tokenize_prompt
from pagedllm.engine.lora_adapters import LoadedAdapters
from pagedllm.engine.stats import EngineStats
from pagedllm.errors import BackendDeadError, ConfigError, InvalidRequestError, QueueFullError, client_message
from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.kv.sizing import num_kv_blocks
from pagedllm.logger import configure_logging
from pagedllm.models.source import ModelSource, default_embedding_model_path, load_tokenizer, resolve_model
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput, position_logprobs
from pagedllm.plugins.manager import get_backend_class
from pagedllm.pooling.model_kind import resolve_runner
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler import PoolerConfig, pooler_config
from pagedllm.pooling.runner import PoolingRequest, PoolingRunner
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling.sampler import Sampler
from pagedllm.sampling.structured_output import StructuredOutputManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.batch_builder import BatchBuilder, PromptLogprobRows, ProposalRows
from pagedllm.sched.scheduler import Scheduler, SchedulerOutput
from pagedllm.sched.speculation import SpeculativeConfig
from pagedllm.utils import cdiv, skip_unused_imports

logger = logging.getLogger("pagedllm.engine.llm_engine")

GiB = 1 << 30


class LLMEngine:
    def __init__(self, config: EngineConfig, backend: Backend, model_info: ModelInfo, source: ModelSource,
                 tokenizer, num_blocks: int, draft: DraftModel | None = None,
                 pooler: PoolerConfig | None = None) -> None:
        self.config = config
        self.backend = backend
        self.draft = draft
        self.model_info = model_info
        self.source = source
        self.tokenizer = tokenizer
        self.num_blocks = num_blocks
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                         cache_on_allocate=backend.writes_kv_before_attention)
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy, self.speculative,
                                   config.max_model_len, config.long_prefill_token_threshold,
                                   config.max_loras if config.enable_lora else None)
        self.batch_builder = BatchBuilder(config.max_num_seqs, config.max_model_len, config.block_size)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = _eos_token_ids(tokenizer, source)
        self.structured_outputs = StructuredOutputManager(
            tokenizer, model_info.vocab_size, self.eos_token_ids,
            compile_timeout=config.structured_outputs_compile_timeout, max_bytes=config.structured_outputs_max_bytes)
        # requests whose grammar is compiling, kept from the scheduler until it is: request id -> (request, future,
        # deadline)
        self._compiling: dict[str, tuple[Request, concurrent.futures.Future, float]] = {}
        self._ids = itertools.count()
        self._groups: dict[str, _Group] = {}
        self._counters = _Counters()
        self._consecutive_failures = 0
        # the pooling runner (--runner pooling): the engine serves pooling requests only, with no KV cache
        self.pooling = None if pooler is None else PoolingRunner(backend, pooler, config.max_num_batched_tokens,
                                                                 config.max_num_seqs)
        self.adapters = LoadedAdapters(backend, config)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_engine_args(cls, args: EngineArgs | None = None, serving: bool = False) -> "LLMEngine":
        configure_logging()
        start = time.time()
        skip_unused_imports()
        args = args or EngineArgs()
        backend_name = resolve_backend_name(args)
        backend_cls = get_backend_class(backend_name)
        config = resolve(args, backend_cls.env_vars, backend_settings=backend_cls.settings,
                         setting_owners=setting_owners())
        config.backend = backend_name
        config.serving = serving
        speculative = SpeculativeConfig.parse(config.speculative_config)  # a bad one is refused before loading
        if speculative is not None and speculative.model is not None:
            draft_config(config, speculative)  # the same: what a draft model cannot run with
        if config.model is None and (config.runner == "pooling" or config.convert == "embed"):
            config.model = str(default_embedding_model_path())
        source = resolve_model(config.model, config.revision, config.download_dir, config.tokenizer,
                               config.trust_remote_code)
        tokenizer = load_tokenizer(source)
        config.runner = resolve_runner(config, source)
        if config.runner == "pooling":
            return cls._pooling_engine(config, backend_cls, source, tokenizer, start)
        backend = backend_cls(config, source)
        draft = None
        try:
            info = backend.load_model()
            config.finalize(info.max_model_len, backend_cls.default_block_size)
            backend.check_block_size(config.block_size)
            if speculative is not None and speculative.model is not None:
                draft = DraftModel.load(backend_cls, config, speculative, tokenizer, info.vocab_size)
            backends = [backend] + ([draft.backend] if draft else [])  # the draft's cache has the target's blocks
            num_blocks = num_kv_blocks(config, sum(b.kv_cache_bytes_per_block() for b in backends),
                                       backend.kv_caches_on_this_host())
            warm_up_tokens = min(WARM_UP_TOKENS, config.max_model_len, num_blocks * config.block_size)
            for b in backends:
                b.allocate_kv_cache(num_blocks)
                _warm_up(b, config.block_size, warm_up_tokens)
        except BaseException:
            backend.shutdown()
            if draft is not None:
                draft.backend.shutdown()
            raise
        engine = cls(config, backend, info, source, tokenizer, num_blocks, draft)
        engine._log_start(time.time() - start)
        return engine

    @classmethod
    def _pooling_engine(cls, config: EngineConfig, backend_cls: type[Backend], source: ModelSource, tokenizer,
                        start: float) -> "LLMEngine":
        """An engine of the pooling runner: the model loaded for ``encode``, no KV cache."""
        if config.speculative_config:
            raise ConfigError("--speculative-config does not go with --runner pooling (nothing is decoded)")
        backend = backend_cls(config, source)
        try:
            info = backend.load_model()
            config.finalize(info.max_model_len, backend_cls.default_block_size)
            pooler = pooler_config(source.config_dir, info.decoder, config.pooler_config)
            backend.encode(EncodeBatch(np.arange(min(8, info.max_model_len), dtype=np.int64),
                                       np.array([0, min(8, info.max_model_len)], dtype=np.int32)))  # warm-up
            backend.release_thread()  # the loading thread need not be the one that encodes
        except BaseException:
            backend.shutdown()
            raise
        engine = cls(config, backend, info, source, tokenizer, 0, pooler=pooler)
        logger.info("model %s (%s, %s) from %s", source.name, info.architecture, source.kind, source.path)
        logger.info("backend %s: dtype %s; %s", config.backend, info.dtype, backend.describe() or "-")
        logger.info("runner pooling: %s pooling%s of hidden size %d (%s); max_model_len %d, max_num_seqs %d, "
                    "max_num_batched_tokens %d per step; ready in %.1f s", pooler.pooling_type,
                    ", normalized," if pooler.normalize else "", info.hidden_size, pooler.source,
                    config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens, time.time() - start)
        return engine

    def _log_start(self, seconds: float) -> None:
        c, m = self.config, self.model_info
        gib = self.num_blocks * self.kv_cache_bytes_per_block() / GiB
        src = c.sources.get("kv_cache_space", "default")
        logger.info("model %s (%s, %s) from %s", self.source.name, m.architecture, self.source.kind, self.source.path)
        logger.info("backend %s: dtype %s; %s", c.backend, m.dtype, self.backend.describe() or "-")
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB (kv_cache_space %.2f GiB from %s)",
                    self.num_blocks, c.block_size, self.num_blocks * c.block_size, gib, c.kv_cache_space, src)
        logger.info("max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, chunked prefill %s, "
                    "prefix caching %s; ready in %.1f s", c.max_model_len, c.max_num_seqs,
                    c.max_num_batched_tokens, "on" if c.enable_chunked_prefill else "off",
                    "on" if c.enable_prefix_caching else "off", seconds)
        s = self.speculative
        if s is not None and s.model is not None:
            logger.info("speculative decoding: draft model %s proposes up to %d tokens per step, in steps of at most "
                        "%d running requests; its KV cache shares the blocks above", s.model, s.num_speculative_tokens,
                        s.disable_by_batch_size)
        elif s is not None:
            logger.info("speculative decoding: n-gram prompt lookup of %d-%d tokens, up to %d proposed per step, in "
                        "steps of at most %d running requests", s.prompt_lookup_min,
                        s.prompt_lookup_max, s.num_speculative_tokens, s.disable_by_batch_size)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, wait_for_grammar: bool = True, priority: int = 0) -> str:
        """Queue a request; raises InvalidRequestError (and queues nothing) if it cannot be served.

        A structured-output constraint compiles on a thread of its own. ``wait_for_grammar`` waits for it here
        (up to the compile timeout); otherwise the request is held back until ``poll_grammars`` says its grammar
        is ready and ``admit`` queues it, and other requests step meanwhile (the engine core does that)."""
        if isinstance(params, PoolingParams) or self.pooling is not None:
            return self._add_pooling_request(request_id, prompt, params, arrival_time)
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._groups or request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests); try again later")
        text, token_ids = self.tokenize(prompt)
        self._check_request(token_ids, params)
        self._check_priority(priority)
        if params.lora_request is not None:
            self.adapters.ensure(params.lora_request, self._adapters_in_use())
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        future = None
        if params.structured_outputs is not None and not wait_for_grammar:
            future = self.structured_outputs.compile_async(params.structured_outputs)
        request = self._new_sequence(request_id, token_ids, params, text, arrival_time, stop_ids, request_id, 0,
                                     compile_now=future is None, priority=priority)
        self._groups[request_id] = _Group(params.n, [request])
        if future is not None and not future.done():
            deadline = time.monotonic() + self.structured_outputs.compile_timeout
            self._compiling[request_id] = (request, future, deadline)
        else:
            if future is not None:
                self._attach_grammar(request, future)  # compiled before: ready now, or raises
            self.scheduler.add_request(request)
        self._counters.prompt_tokens += len(token_ids)
        return request_id

    def _adapters_in_use(self) -> set[int]:
        in_use = {r.lora_id for r in self.scheduler.requests.values() if r.lora_id}
        return in_use | {r.lora_id for r, _, _ in self._compiling.values() if r.lora_id}

    def _add_pooling_request(self, request_id: str | None, prompt: PromptType, params,
                             arrival_time: float | None) -> str:
        if self.pooling is None:
            raise InvalidRequestError("this model runs as a text generator: pooling requests (embeddings, scores) "
                                      "need a model served with --runner pooling")
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("this model runs as an embedding model (--runner pooling): it answers pooling "
                                      "requests (embeddings, scores), not text generation")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.pooling.waiting:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.pooling.waiting) >= limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests); try again later")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("the input is empty", param="input")
        if len(token_ids) > self.config.max_model_len:
            raise InvalidRequestError(f"the input has {len(token_ids)} tokens, more than max_model_len "
                                      f"{self.config.max_model_len}", param="input")
        hidden = self.model_info.hidden_size
        if params.dimensions is not None and params.dimensions > hidden:
            raise InvalidRequestError(f"dimensions {params.dimensions} is more than the model's {hidden}",
                                      param="dimensions")
        self.pooling.add(PoolingRequest(request_id, text, token_ids, params,
                                        time.time() if arrival_time is None else arrival_time))
        self._counters.prompt_tokens += len(token_ids)
        return request_id

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._compiling

    def poll_grammars(self) -> dict[str, Exception | None]:
        """Requests whose grammar is ready (None) or failed (the error: it did not compile, or not in time), each
        said once. Ready ones wait for ``admit``; failed ones should be aborted."""
        resolved: dict[str, Exception | None] = {}
        now = time.monotonic()
        for request_id, (request, future, deadline) in list(self._compiling.items()):
            if not future.done() and now < deadline:
                continue
            del self._compiling[request_id]
            try:
                if not future.done():
                    raise self.structured_outputs.timeout_error()
                self._attach_grammar(request, future)
                resolved[request_id] = None
            except InvalidRequestError as exc:
                resolved[request_id] = exc
        return resolved

    def admit(self, request_ids: Iterable[str]) -> None:
        """Queue requests whose grammar ``poll_grammars`` said is ready."""
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is not None:
                self.scheduler.add_request(group.members[0])

    def _attach_grammar(self, request: Request, future: concurrent.futures.Future) -> None:
        compiled = self.structured_outputs.compiled(future)
        request.grammar = self.structured_outputs.state_for(compiled, request.stop_ids)

    def _new_sequence(self, seq_id: str, token_ids: list[int], params: SamplingParams, text: str | None,
                      arrival_time: float | None, stop_ids: frozenset[int], group_id: str, index: int,
                      compile_now: bool = True, priority: int = 0) -> Request:
        request = Request(seq_id, token_ids, params, prompt=text, arrival_time=arrival_time, stop_ids=stop_ids,
                          group_id=group_id, index=index, priority=priority)
        if params.bad_words:
            request.bad_word_ids = self._bad_word_ids(tuple(params.bad_words))
        if params.structured_outputs is not None and compile_now:  # once per distinct constraint; a bad one raises
            request.grammar = self.structured_outputs.new_state(params.structured_outputs, stop_ids)
        if params.detokenize:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.skip_special_tokens, params.stop,
                params.include_stop_str_in_output)
        return request

    @functools.lru_cache(maxsize=256)
    def _bad_word_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """Each bad word's token ids as the tokenizer writes it alone and after a space, as vLLM bans them."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip(" ")):
                ids = self.tokenizer(text, add_special_tokens=False).input_ids
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
            raise InvalidRequestError(f"priority must be a 64-bit integer, got {priority!r}", param="priority")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority {priority} needs the server started with --scheduling-policy "
                                      f"priority", param="priority")

    def _check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        vocab = self.model_info.vocab_size
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(token_ids) > max_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len {max_len}", param="prompt")
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n ({params.n}) is more than max_num_seqs ({self.config.max_num_seqs})",
                                      param="n")
        if params.allowed_token_ids and any(not 0 <= t < vocab for t in params.allowed_token_ids):
            raise InvalidRequestError(f"allowed_token_ids must be in [0, {vocab})", param="allowed_token_ids")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        config = self.config
        if params.structured_outputs is not None:
            self.structured_outputs.check_size(params.structured_outputs)
        for param in ("logprobs", "prompt_logprobs"):
            value = getattr(params, param)
            if value is not None and value > min(config.max_logprobs, vocab):
                raise InvalidRequestError(f"{param} {value} is more than the {min(config.max_logprobs, vocab)} this "
                                          f"server allows (--max-logprobs)", param=param)
        for param, count, limit, flag in (
                ("stop", len(params.stop), config.max_stop_strings, "--max-stop-strings"),
                ("stop_token_ids", len(params.stop_token_ids), config.max_stop_token_ids, "--max-stop-token-ids"),
                ("bad_words", len(params.bad_words or ()), config.max_stop_strings, "--max-stop-strings"),
                ("logit_bias", len(params.logit_bias or ()), config.max_logit_bias, "--max-logit-bias")):
            if count > limit:
                raise InvalidRequestError(f"{param} has {count} entries, more than the {limit} allowed ({flag})",
                                          param=param)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (all n sequences of each) now and free their KV blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        if self.pooling is not None:
            self.pooling.abort(request_ids)
            return
        for request_id in request_ids:
            self._compiling.pop(request_id, None)
            group = self._groups.pop(request_id, None)
            if group is not None:
                for request in group.members:
                    self.scheduler.abort(request.request_id)
        self._drop_released_rows()

    def stop_sequence(self, request_id: str, index: int) -> None:
        """End sequence ``index`` of a request as stopped (a stop string found outside the engine); its siblings
        go on. Unknown or finished ones are ignored."""
        group = self._groups.get(request_id)
        member = next((m for m in group.members if m.index == index), None) if group is not None else None
        if member is None or member.status.finished:
            return
        member.stop_reason = None
        self.scheduler.finish(member, RequestStatus.FINISHED_STOPPED)
        group.unfinished -= 1
        if group.unfinished == 0:
            del self._groups[request_id]
            self._counters.finished_requests += 1
        self._drop_released_rows()

    def has_unfinished_requests(self) -> bool:
        if self.pooling is not None:
            return bool(self.pooling.waiting)
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.pooling.waiting) if self.pooling is not None else len(self._groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.pooling.waiting) if self.pooling is not None else list(self._groups)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass. Returns an output for every request that made progress; its
        ``outputs`` hold the sequences that progressed in this step (cumulative, with their deltas)."""
        if self.pooling is not None:
            return self._pooling_step()
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:  # no request to blame: it counts against the engine as a failed step
            self._consecutive_failures += 1
            logger.error("scheduling a step failed (%d in a row, the engine stops at %d)", self._consecutive_failures,
                         self.config.max_consecutive_step_failures, exc_info=exc)
            if self._consecutive_failures >= self.config.max_consecutive_step_failures:
                raise
            return []
        self.batch_builder.release(sched.released_ids)
        if sched.empty:
            return []
        try:
            outputs = self._run_step(sched)
            self._consecutive_failures = 0
        except Exception as exc:
            outputs = self._fail_step(sched, exc)
        self._drop_released_rows()
        return outputs

    def _pooling_step(self) -> list[RequestOutput]:
        """One batch of pooling requests; a failure ends only them (counted against the engine as a failed step)."""
        requests = self.pooling.schedule()
        if not requests:
            return []
        try:
            outputs = self.pooling.run(requests)
            self._consecutive_failures = 0
        except Exception as exc:
            self._consecutive_failures += 1
            logger.error("a pooling step failed (%d in a row, the engine stops at %d); its %d requests end with an "
                         "error", self._consecutive_failures, self.config.max_consecutive_step_failures,
                         len(requests), exc_info=exc)
            if self._consecutive_failures >= self.config.max_consecutive_step_failures:
                raise
            now = time.time()
            return [RequestOutput(r.request_id, r.prompt, r.token_ids, [], True,
                                  RequestMetrics(r.arrival_time, now, None, now), step_error_message(exc))
                    for r in requests]
        self._counters.steps += 1
        self._counters.batched_tokens += sum(len(r.token_ids) for r in requests)
        self._counters.finished_requests += len(requests)
        return outputs

    def _drop_released_rows(self) -> None:
        """Free the batch rows of requests that ended, now rather than at the next step: there may be none."""
        self.batch_builder.release(self.scheduler.take_released())

    def kv_cache_bytes_per_block(self) -> int:
        """What a block costs: the target's keys and values, and a draft model's if one proposes."""
        draft = self.draft.backend.kv_cache_bytes_per_block() if self.draft is not None else 0
        return self.backend.kv_cache_bytes_per_block() + draft

    def _run_step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        if self.draft is not None:
            self.draft.propose(sched)
        batch, order, rows = self.batch_builder.build(sched)
        logits = torch.as_tensor(self.backend.execute(batch))
        self.scheduler.update_after_step(sched)
        self._counters.on_step(sched.num_batched_tokens, self.kv_manager, self.scheduler.running)
        verified = self._verify_proposals(logits, rows.proposals) if rows.proposals else []
        if rows.prompt:
            for part in rows.prompt:
                part.request.prompt_logprobs += self._prompt_logprobs(logits, part)
        if rows.prompt or rows.proposals:
            logits = logits[rows.sample_rows]
        requests = [order[i].request for i in rows.sampling]
        if any(r.num_pending_forks for r in requests):
            requests, rows = self._fork_groups(requests)
            logits = logits[rows]
        requests, token_ids, logprobs, failed = self._sample(logits, requests)
        now = time.time()
        progressed: dict[str, list[CompletionOutput]] = {}
        for request, token_id, token_logprobs in zip(requests, token_ids, logprobs):
            completion = self._append_token(request, token_id, token_logprobs, now)
            progressed.setdefault(request.group_id, []).append(completion)
        for request, new_tokens, token_logprobs, num_proposed, num_accepted in verified:
            for token_id, entry in zip(new_tokens, token_logprobs):
                progressed.setdefault(request.group_id, []).append(self._append_token(request, token_id, entry, now))
                if request.status.finished:
                    break
            self.scheduler.accept_proposals(request, num_proposed, num_accepted)
        outputs = [self._group_output(group_id, completions, now) for group_id, completions in progressed.items()]
        return outputs + self._fail_requests(failed, now)

    def _verify_proposals(self, logits: torch.Tensor, parts: list[ProposalRows]) -> list[tuple]:
        """Per request with proposals: (its new tokens, their logprobs or Nones, how many proposals were right), from
        the sampler's verification (argmax for greedy requests, rejection sampling for sampled ones)."""
        verified = []
        for part in parts:
            proposals, request = part.item.spec_tokens, part.item.request
            rows = logits[part.first_row:part.first_row + len(proposals) + 1]
            new_tokens, accepted = self.sampler.verify(rows, request, proposals)
            logprobs = self.sampler.token_logprobs(rows, new_tokens, request.params.logprobs) \
                if request.params.logprobs is not None else [None] * len(new_tokens)
            verified.append((request, new_tokens, logprobs, len(proposals), accepted))
            self._counters.proposed_tokens += len(proposals)
            self._counters.accepted_tokens += accepted
        return verified

    @torch.inference_mode()
    def _prompt_logprobs(self, logits: torch.Tensor, part: PromptLogprobRows) -> list[PositionLogprobs]:
        """Each prompt token's logprob and rank under the logits of the position before it, and the top
        ``prompt_logprobs`` alternatives, from the raw distribution (no penalties, bias or temperature, as vLLM)."""
        request = part.request
        rows = torch.log_softmax(logits[part.first_row:part.first_row + part.count].to(torch.float32), dim=-1)
        targets = torch.tensor(request.prompt_token_ids[part.first_token:part.first_token + part.count])
        chosen = rows.gather(1, targets[:, None])
        ranks = ((rows > chosen).sum(dim=1) + 1).tolist()
        k = request.params.prompt_logprobs
        top_vals, top_ids = rows.topk(k, dim=1) if k else (rows[:, :0], targets[:, None][:, :0])
        decode = self._token_text if request.params.detokenize else None
        return [position_logprobs(t, lp, rank, ids, vals, decode)
                for t, lp, rank, ids, vals in zip(targets.tolist(), chosen[:, 0].tolist(), ranks, top_ids.tolist(),
                                                  top_vals.tolist())]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _sample(self, logits: torch.Tensor, requests: list[Request]):
        """(requests, token ids, logprobs, failed groups) of the step. If sampling the batch raises, each request
        is sampled alone: one whose own parameters make it fail ends with an error, the others go on."""
        try:
            sampled = self.sampler(logits, requests)
            return requests, sampled.token_ids, sampled.logprobs, {}
        except Exception as exc:
            logger.warning("sampling the step's batch failed (%s); sampling each request alone", exc)
        kept, token_ids, logprobs, failed = [], [], [], {}
        for row, request in enumerate(requests):
            if request.group_id in failed:
                continue
            try:
                one = self.sampler(logits[row:row + 1], [request])
            except Exception as exc:
                logger.error("sampling failed for request %s", request.group_id, exc_info=exc)
                failed[request.group_id] = exc
                continue
            kept.append(request)
            token_ids += one.token_ids
            logprobs += one.logprobs
        survivors = [(r, t, lp) for r, t, lp in zip(kept, token_ids, logprobs) if r.group_id not in failed]
        return [s[0] for s in survivors], [s[1] for s in survivors], [s[2] for s in survivors], failed

    def _fail_requests(self, failed: dict[str, Exception], now: float) -> list[RequestOutput]:
        """End these requests (groups) with an error: their step failed because of them; free what they hold."""
        outputs = []
        for group_id, exc in failed.items():
            group = self._groups.get(group_id)
            if group is None:
                continue
            first = group.members[0]
            metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time, now)
            outputs.append(RequestOutput(group_id, first.prompt, first.prompt_token_ids, [], True, metrics,
                                         step_error_message(exc)))
        self.abort_request(list(failed))
        return outputs

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """A step raised: end the requests it ran with an error and free their blocks, so the others go on. What it
        published in the prefix cache is withdrawn: those blocks may be half written. Re-raises (the engine is
        dead) once ``max_consecutive_step_failures`` steps in a row have failed, or when the backend is dead."""
        self._consecutive_failures += 1
        group_ids = list(dict.fromkeys(item.request.group_id for item in sched.scheduled))
        limit = self.config.max_consecutive_step_failures
        logger.error("a step failed (%d in a row, the engine stops at %d) running requests %s",
                     self._consecutive_failures, limit, ", ".join(group_ids), exc_info=exc)
        if self._consecutive_failures >= limit or isinstance(exc, BackendDeadError):
            raise exc
        for item in sched.scheduled:
            self.kv_manager.unpublish_step(item.request)
        return self._fail_requests({group_id: exc for group_id in group_ids}, time.time())

    def _fork_groups(self, requests: list[Request]) -> tuple[list[Request], list[int]]:
        """Sequence 0 of an n > 1 request has its prompt computed: create its n - 1 siblings, which the scheduler
        admits sharing the prompt's blocks. Those admitted sample from the same logits row in this step."""
        expanded: list[Request] = []
        rows: list[int] = []
        copies: list[tuple[int, int]] = []
        for row, request in enumerate(requests):
            expanded.append(request)
            rows.append(row)
            if not request.num_pending_forks:
                continue
            siblings = [self._new_sequence(f"{request.group_id}:{index}", request.prompt_token_ids, request.params,
                                           request.prompt, request.arrival_time, request.stop_ids, request.group_id,
                                           index, priority=request.priority)
                        for index in range(1, request.num_pending_forks + 1)]
            self._groups[request.group_id].members.extend(siblings)
            admitted, block_copies = self.scheduler.fork(request, siblings)
            copies += block_copies
            expanded += admitted
            rows += [row] * len(admitted)
        if copies:
            src, dst = zip(*copies)
            self.backend.copy_blocks(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))
        return expanded, rows

    def _append_token(self, request: Request, token_id: int, logprobs, now: float) -> CompletionOutput:
        params = request.params
        request.append_token(token_id)
        self._counters.generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None:
            sampled_lp, rank, top_ids, top_lps = logprobs
            request.logprobs.append(position_logprobs(token_id, sampled_lp, rank, top_ids, top_lps,
                                                      self._token_text if params.detokenize else None))
            request.cumulative_logprob += sampled_lp

        status = None
        if request.grammar is not None and not request.grammar.accept(token_id):
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (or, by its stop token, ended)
        may_stop = request.num_output_tokens >= params.min_tokens
        stopped_by_token = may_stop and token_id in request.stop_ids
        if stopped_by_token:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None if token_id in self.eos_token_ids and token_id not in params.stop_token_ids \
                else token_id
        detok = request.detokenizer
        if detok is not None and (not stopped_by_token or params.include_stop_str_in_output):
            stop_str = detok.add_token(token_id)
            if stop_str is not None and may_stop and status is None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        if status is None and (
                (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)
                or request.num_tokens >= self.config.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(request, status)
            self._groups[request.group_id].unfinished -= 1
        return self._completion(request, token_id)

    @staticmethod
    def _completion(request: Request, token_id: int) -> CompletionOutput:
        finished = request.status.finished
        detok = request.detokenizer
        logprobs = request.logprobs
        delta_text = detok.take_delta(finished) if detok is not None else ""  # first: a finish completes the text
        return CompletionOutput(
            index=request.index,
            text=detok.text if detok is not None else "",
            token_ids=list(request.output_token_ids) if finished else request.output_token_ids,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            delta_text=delta_text,
            delta_token_ids=[token_id],
            logprobs=logprobs,
            delta_logprobs=logprobs[-1:] if logprobs else None,
            cumulative_logprob=request.cumulative_logprob if logprobs is not None else None)

    def _group_output(self, group_id: str, completions: list[CompletionOutput], now: float) -> RequestOutput:
        group = self._groups[group_id]
        first = group.members[0]
        finished = group.unfinished == 0
        if finished:
            del self._groups[group_id]
            self._counters.finished_requests += 1
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time,
                                 min(m.first_token_time or now for m in group.members), now if finished else None)
        return RequestOutput(group_id, first.prompt, first.prompt_token_ids, completions, finished, metrics,
                             prompt_logprobs=first.prompt_logprobs, num_cached_tokens=first.num_cached_tokens)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state and counters (immutable: safe to hand to another thread)."""
        kv, cache, c = self.kv_manager, self.kv_manager.prefix_cache, self._counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + (len(self.pooling.waiting) if self.pooling is not None else 0),
            kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.allocator.num_used, peak_kv_blocks=c.peak_blocks_used,
            kv_waste_at_peak=c.peak_waste, prefix_caching=cache is not None,
            prefix_cache_queries=cache.queries if cache is not None else 0,
            prefix_cache_hits=cache.hits if cache is not None else 0, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens, batched_tokens=c.batched_tokens,
            steps=c.steps, finished_requests=c.finished_requests, spec_draft_tokens=c.proposed_tokens,
            spec_accepted_tokens=c.accepted_tokens,
            requests_tracked=len(self.scheduler.requests) + len(self._groups) + self.batch_builder.rows_in_use
            + (len(self.pooling.waiting) if self.pooling is not None else 0))

    def release_thread(self) -> None:
        """The calling thread is done stepping for now; the backend undoes its per-thread settings."""
        self.backend.release_thread()
        if self.draft is not None:
            self.draft.backend.release_thread()

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.backend.shutdown()
        if self.draft is not None:
            self.draft.backend.shutdown()


def step_error_message(exc: Exception) -> str:
    """What a client is told of a failed step: the kind of error, not its text (which may name files or
    internals); the server's log has the traceback."""
    return f"the engine step running this request failed: {client_message(exc)}"


class _Group:
    """The n sequences of one request, and how many of them are still running."""

    __slots__ = ("members", "unfinished")

    def __init__(self, n: int, members: list[Request]) -> None:
        self.members = members
        self.unfinished = n


class _Counters:
    """The engine's running totals behind ``stats()``; O(1) per step but when the KV peak rises."""

    def __init__(self) -> None:
        self.steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.batched_tokens = 0
        self.peak_blocks_used = 0
        self.peak_waste = 0.0
        self.finished_requests = 0
        self.proposed_tokens = 0  # speculative decoding: tokens proposed, and of them accepted
        self.accepted_tokens = 0

    def on_step(self, num_batched_tokens: int, kv_manager: KVCacheManager, running: list[Request]) -> None:
        self.steps += 1
        self.batched_tokens += num_batched_tokens
        used = kv_manager.allocator.num_used
        if used > self.peak_blocks_used:
            self.peak_blocks_used = used
            self.peak_waste = KVCacheManager.waste(running, kv_manager.block_size)


def _eos_token_ids(tokenizer, source: ModelSource) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    folder = source.config_dir or source.tokenizer_dir
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(str(folder)).eos_token_id
    except Exception:
        eos = None
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return frozenset(ids)


WARM_UP_TOKENS = 16  # a short prompt meets the first step's one-time costs in a fraction of a real prompt's time


def _warm_up(backend: Backend, block_size: int, n: int) -> None:
    """An ``n``-token prompt through the backend at start-up, into the first (free) blocks; its logits are dropped."""
    start = time.perf_counter()
    num_blocks = cdiv(n, block_size)
    backend.warm_up(Batch(
        input_ids=np.zeros(n, dtype=np.int64), positions=np.arange(n, dtype=np.int64),
        query_start_loc=np.array([0, n], dtype=np.int32), num_computed=np.zeros(1, dtype=np.int32),
        seq_lens=np.array([n], dtype=np.int32), block_table=np.arange(num_blocks, dtype=np.int32)[None, :],
        slot_mapping=np.arange(n, dtype=np.int64), logits_indices=np.array([n - 1], dtype=np.int64), num_decodes=0,
        block_size=block_size))
    backend.release_thread()  # the loading thread need not be the one that steps
    logger.debug("warm-up step of %d tokens: %.0f ms", n, 1e3 * (time.perf_counter() - start))
