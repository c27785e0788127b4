"""The front end's half of a step: the engine core's token deltas -> ``RequestOutput``s, with text and stop strings.

The core (``engine_core``) runs requests without detokenizing; here each sequence gets the same
``IncrementalDetokenizer`` the in-process engine uses, fed by the same rules (a stop token adds no text unless
``include_stop_str_in_output``; stop strings count from ``min_tokens`` on and lose to a stop token, beat the length
limit), so text, finish and stop reasons equal the in-process engine's. A stop string found here ends the sequence
at once on this side; the caller tells the core (``stops``), whose tokens for it after that are dropped.
"""

from __future__ import annotations

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.messages import RequestDelta, SequenceDelta
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class _Sequence:
    __slots__ = ("index", "token_ids", "detokenizer", "logprobs", "cumulative_logprob", "finish_reason",
                 "stop_reason")

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer | None, logprobs: bool) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.detokenizer = detokenizer
        self.logprobs: list[PositionLogprobs] | None = [] if logprobs else None
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class _Request:
    __slots__ = ("request_id", "output_id", "prompt", "prompt_token_ids", "params", "arrival_time", "stop_ids",
                 "sequences", "unfinished", "prompt_logprobs", "num_cached_tokens")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams | PoolingParams, arrival_time: float, eos_token_ids: frozenset[int],
                 output_id: str) -> None:
        self.request_id = request_id
        self.output_id = output_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        pooling = isinstance(params, PoolingParams)
        self.stop_ids = frozenset() if pooling else \
            frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self.sequences: dict[int, _Sequence] = {}
        self.unfinished = 1 if pooling else params.n
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._requests: dict[str, _Request] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, output_id: str | None = None) -> None:
        """``output_id``: the id its outputs carry, when the core knows the request by another (``request_id``)."""
        self._requests[request_id] = _Request(request_id, prompt, prompt_token_ids, params, arrival_time,
                                              self.eos_token_ids, request_id if output_id is None else output_id)

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, deltas: list[RequestDelta], now: float) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """(outputs, sequences a stop string ended that the core still runs, as (request id, index))."""
        outputs: list[RequestOutput] = []
        stops: list[tuple[str, int]] = []
        for delta in deltas:
            request = self._requests.get(delta.request_id)
            if request is None:  # aborted here, and the abort had not reached the core yet
                continue
            if delta.error is not None:  # its step failed in the core: it ended there
                del self._requests[request.request_id]
                metrics = RequestMetrics(request.arrival_time, delta.first_scheduled_time, delta.first_token_time, now)
                outputs.append(RequestOutput(request.output_id, request.prompt, request.prompt_token_ids, [], True,
                                             metrics, delta.error))
                continue
            if delta.embedding is not None:  # a pooling request: its vector ends it
                del self._requests[request.request_id]
                metrics = RequestMetrics(request.arrival_time, delta.first_scheduled_time, delta.first_token_time, now)
                outputs.append(RequestOutput(request.output_id, request.prompt, request.prompt_token_ids, [], True,
                                             metrics, embedding=delta.embedding))
                continue
            if delta.prompt_logprobs is not None:
                request.prompt_logprobs = delta.prompt_logprobs
                request.num_cached_tokens = delta.num_cached_tokens
                if request.params.detokenize:
                    for entry in delta.prompt_logprobs[1:]:
                        self._decode(entry)
            completions = [c for c in (self._advance(request, s, stops) for s in delta.sequences) if c is not None]
            if not completions:
                continue
            finished = request.unfinished == 0
            if finished:
                del self._requests[request.request_id]
            metrics = RequestMetrics(request.arrival_time, delta.first_scheduled_time, delta.first_token_time,
                                     now if finished else None)
            outputs.append(RequestOutput(request.output_id, request.prompt, request.prompt_token_ids, completions,
                                         finished, metrics, prompt_logprobs=request.prompt_logprobs,
                                         num_cached_tokens=request.num_cached_tokens))
        return outputs, stops

    def _decode(self, entry: PositionLogprobs) -> None:
        """The core does not detokenize: each logprob's token text is filled in here."""
        for token_id, logprob in entry.items():
            logprob.decoded_token = self.tokenizer.decode([token_id])

    def _advance(self, request: _Request, delta: SequenceDelta, stops: list) -> CompletionOutput | None:
        params = request.params
        seq = request.sequences.get(delta.index)
        if seq is None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                                 params.stop, params.include_stop_str_in_output) \
                if params.detokenize else None
            seq = request.sequences[delta.index] = _Sequence(delta.index, detokenizer, params.logprobs is not None)
        elif seq.finish_reason is not None:  # a stop string ended it here
            return None
        token_id = delta.token_id
        seq.token_ids.append(token_id)
        if seq.logprobs is not None and delta.logprobs is not None:
            if params.detokenize:
                self._decode(delta.logprobs)
            seq.logprobs.append(delta.logprobs)
        seq.cumulative_logprob = delta.cumulative_logprob
        finish, stop_reason = delta.finish_reason, delta.stop_reason
        may_stop = len(seq.token_ids) >= params.min_tokens
        stopped_by_token = may_stop and token_id in request.stop_ids
        detok = seq.detokenizer
        if detok is not None and (not stopped_by_token or params.include_stop_str_in_output):
            stop_str = detok.add_token(token_id)
            if stop_str is not None and may_stop and finish != "stop":
                if finish is None:
                    stops.append((request.request_id, delta.index))
                finish, stop_reason = "stop", stop_str
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            request.unfinished -= 1
        finished = finish is not None
        logprobs = seq.logprobs
        delta_text = detok.take_delta(finished) if detok is not None else ""  # first: a finish completes the text
        return CompletionOutput(
            index=seq.index, text=detok.text if detok is not None else "",
            token_ids=list(seq.token_ids) if finished else seq.token_ids, finish_reason=finish,
            stop_reason=stop_reason, delta_text=delta_text,
            delta_token_ids=[token_id], logprobs=logprobs, delta_logprobs=logprobs[-1:] if logprobs else None,
            cumulative_logprob=delta.cumulative_logprob)
