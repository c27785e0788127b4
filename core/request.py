"""A request's state as it moves through the engine: tokens, blocks, status, sampling state."""

from __future__ import annotations

import enum
import time

import torch

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    """One sequence to generate. ``all_token_ids`` is prompt + output; KV state lives in ``block_ids``."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None,
                 stop_ids: frozenset[int] = frozenset(), group_id: str | None = None, index: int = 0,
                 priority: int = 0) -> None:
        self.request_id = request_id
        # With n > 1, the n sequences are requests of one group; sequence 0 forks the others once its
        # prompt is computed, so they share the prompt's KV blocks.
        self.group_id = request_id if group_id is None else group_id
        self.index = index
        self.num_pending_forks = params.n - 1 if index == 0 else 0
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.stop_ids = stop_ids  # EOS ids (unless ignore_eos) plus stop_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # with the priority scheduling policy: lower runs first
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        # KV cache state, owned by KVCacheManager.
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks of all_token_ids
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_published_blocks = 0  # of those, how many were computed before the current step

        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed + index)

        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.detokenizer = None  # set by the engine when text is wanted
        self.grammar = None  # a structured_output.GrammarState, set by the engine for constrained output
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None  # of outputs.Logprob
        self.cumulative_logprob = 0.0
        # Per prompt token so far, the first None (nothing predicts it); sequence 0 of a group computes them.
        self.prompt_logprobs: list[dict | None] | None = \
            [None] if params.prompt_logprobs is not None and index == 0 else None
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held at first admission
        self.bad_word_ids: list[list[int]] = []  # params.bad_words as token ids, set by the engine
        self.num_proposed = 0  # speculative decoding: this request's proposed tokens, and of them accepted
        self.num_accepted = 0
        self.num_draft_computed = 0  # positions whose draft-model KV is in the cache (engine.draft_model)
        lora = params.lora_request
        self.lora_id = 0 if lora is None else lora.lora_int_id  # 0: the base model
        self.cache_root: int | None = None  # where its prefix-cache chain starts (the KV manager's to set)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: the prompt's logits are needed, so no prefix-cache hit."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
