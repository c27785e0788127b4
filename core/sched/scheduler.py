"""Continuous batching, first come first served, under a per-step token budget.

Each step: running requests first (decodes, then unfinished prompt chunks), then waiting ones in
arrival order (or, with the priority policy, by priority, then arrival). With chunked prefill a prompt that does
not fit the remaining budget is cut; without it a prompt runs whole. While requests wait, a prompt in progress
takes at most ``long_prefill_token_threshold`` tokens a step, so that a long prompt does not hold a short one
that arrives after it for more than a step. When the block pool runs dry, the most
recently admitted running request (with the priority policy: the lowest in priority) is preempted: its blocks are
freed and it is recomputed later (its output does not change).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from pagedllm.kv.kv_cache_manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.speculation import SpeculativeConfig, can_speculate


def _rank(request: Request) -> tuple[int, float]:
    """Priority order: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival_time


PROMPT_LOGPROBS_CHUNK = 512
# speculative decoding backs off for a request past this many proposed tokens with fewer than this share accepted
LOW_ACCEPTANCE_AFTER, LOW_ACCEPTANCE = 32, 0.1  # most prompt tokens per step of a request that wants their logprobs


@dataclasses.dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # with proposals: the last token and the proposed ones
    new_block_ids: list[int]  # appended to the request's block table this step
    spec_tokens: list[int] = dataclasses.field(default_factory=list)  # proposed tokens to verify this step


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    released_ids: list[str]  # requests whose blocks were freed since the last step (rows to drop)
    num_batched_tokens: int
    preempted: list[Request]

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool, policy: str = "fcfs", speculative: SpeculativeConfig | None = None,
                 max_model_len: int | None = None, long_prefill_token_threshold: int | None = None,
                 max_loras: int | None = None) -> None:
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.by_priority = policy == "priority"
        self.speculative = speculative
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.max_loras = max_loras  # most adapters among the running requests (None: no bound)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self._released: list[str] = []
        self.num_preemptions = 0

    # -- bookkeeping ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._queue(request)

    def _queue(self, request: Request) -> None:
        """Into the waiting queue: at its end (fcfs), or after the requests that go before it (priority)."""
        if not self.by_priority:
            self.waiting.append(request)
            return
        key = _rank(request)
        at = len(self.waiting)
        while at > 0 and _rank(self.waiting[at - 1]) > key:
            at -= 1
        self.waiting.insert(at, request)

    def fork(self, parent: Request, children: list[Request]) -> tuple[list[Request], list[tuple[int, int]]]:
        """Admit the other sequences of ``parent``'s group (n > 1) once its prompt is computed, sharing its KV
        blocks. Returns the children now running, and the (source, destination) blocks the backend must copy
        (each child's own copy of the partial last block); a child that finds no free block for that copy waits
        at the front of the queue and recomputes its prompt."""
        admitted: list[Request] = []
        copies: list[tuple[int, int]] = []
        for child in children:
            child.first_scheduled_time = parent.first_scheduled_time
            self.requests[child.request_id] = child
            copy = self.kv.fork(parent, child)
            if copy is None:
                self.waiting.appendleft(child)
                continue
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            admitted.append(child)
            if copy[0] >= 0:
                copies.append(copy)
        parent.num_pending_forks = 0
        return admitted, copies

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length, aborted) and free its blocks at once."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request)
        request.status = status
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def take_released(self) -> list[str]:
        """The requests whose blocks were freed since the last call (their batch rows are to be dropped)."""
        released, self._released = self._released, []
        return released

    def _release(self, request: Request) -> None:
        if request.block_ids:
            self.kv.free(request)
        self._released.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_draft_computed = 0  # its blocks go to others: a draft model's KV in them is gone too
        self.num_preemptions += 1
        if self.by_priority:
            self._queue(request)
        else:
            self.waiting.appendleft(request)

    # -- the step ------------------------------------------------------------------------------
    def _chunk(self, request: Request, num_new: int) -> int:
        """A prompt whose logprobs are asked for has a logits row per token: with chunked prefill its chunks are
        capped, so that a step's logits stay a bounded size."""
        if self.chunked_prefill and request.needs_prompt_logprobs:
            return min(num_new, PROMPT_LOGPROBS_CHUNK)
        return num_new

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        speculate = self.speculative is not None and len(self.running) <= self.speculative.disable_by_batch_size
        for request in decoding + prefilling:
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens)
            if num_new > 1 and self.chunked_prefill and self.waiting:  # leave room for the newcomers' prompts
                num_new = min(num_new, self.long_prefill_token_threshold)
            proposals = self._proposals(request) if speculate and num_new == 1 else []
            if proposals and 1 + len(proposals) <= budget:
                num_new += len(proposals)
            else:
                proposals = []
            if num_new > budget and not self.chunked_prefill:
                continue
            num_new = min(num_new, budget)
            if num_new <= 0:
                break
            while True:
                new_blocks = self.kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = max(self.running, key=_rank) if self.by_priority else self.running[-1]
                if victim.request_id in scheduled:  # already given a slot this step: take it back
                    budget += scheduled.pop(victim.request_id).num_new_tokens
                    self.kv.unpublish_step(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue
            scheduled[request.request_id] = ScheduledRequest(request, num_new, new_blocks, proposals)
            budget -= num_new

        # seats: running sequences, and the siblings that running n > 1 requests will fork once their prompt is in
        seats = len(self.running) + sum(r.num_pending_forks for r in self.running)
        adapters = {r.lora_id for r in self.running if r.lora_id} if self.max_loras is not None else set()
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting[0]
            if seats + 1 + request.num_pending_forks > self.max_num_seqs:
                break
            if (self.max_loras is not None and request.lora_id and request.lora_id not in adapters
                    and len(adapters) >= self.max_loras):
                break  # another adapter would exceed max_loras: it waits for one to finish
            cached = self.kv.get_computed_blocks(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = self._chunk(request, request.num_tokens - num_cached_tokens)
            if num_new > budget:
                if not self.chunked_prefill:
                    break
                num_new = budget
            new_blocks = self.kv.allocate_slots(request, num_new, cached)
            if new_blocks is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                request.num_cached_tokens = num_cached_tokens
            self.running.append(request)
            if request.lora_id:
                adapters.add(request.lora_id)
            seats += 1 + request.num_pending_forks
            scheduled[request.request_id] = ScheduledRequest(request, num_new, new_blocks)
            budget -= num_new

        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            released_ids=self.take_released(),
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted=preempted,
        )

    def update_after_step(self, output: SchedulerOutput) -> None:
        """The step ran: its tokens are now in the cache (of proposed ones, only those the engine accepts count:
        ``accept_proposals``)."""
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens - len(item.spec_tokens)
            self.kv.cache_full_blocks(request)

    def accept_proposals(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """``num_accepted`` proposed tokens were right (and appended): their keys and values, written by the step,
        are the request's; those of the rejected ones are overwritten later (they never reach the prefix cache)."""
        request.num_computed_tokens += num_accepted
        request.num_proposed += num_proposed
        request.num_accepted += num_accepted
        if not request.status.finished:
            self.kv.cache_full_blocks(request)

    @staticmethod
    def _stops_paying(request: Request) -> bool:
        """A request whose proposals are mostly wrong proposes once per 8 steps only: each wrong one costs a query
        token of the step's budget and its compute (text that does not repeat its prompt)."""
        if request.num_proposed < LOW_ACCEPTANCE_AFTER:
            return False
        low = request.num_accepted < LOW_ACCEPTANCE * request.num_proposed
        return low and request.num_output_tokens % 8 != 0

    def _proposals(self, request: Request) -> list[int]:
        """Tokens to verify after the request's next one, within its max_tokens and max_model_len. None for its
        first token: that comes from the prompt's last position, where n > 1 forks and prompt logprobs end."""
        if request.num_output_tokens == 0 or not can_speculate(request) or self._stops_paying(request):
            return []
        params = request.params
        limit = self.speculative.num_speculative_tokens
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - request.num_tokens - 1)
        if self.speculative.model is not None:  # slots the draft model fills before the step
            return [0] * max(limit, 0)
        proposals = self.speculative.propose(request.all_token_ids, limit)
        if proposals and request.grammar is not None:  # what the grammar would refuse is not worth verifying
            proposals = request.grammar.allowed_prefix(proposals)
        return proposals
