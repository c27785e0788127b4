"""The engine's pooling half: requests that need one forward pass and no decode (embeddings), queued in arrival order
and run in batches under the step's budget (max_num_batched_tokens, max_num_seqs), as prompt chunks are. Nothing is
kept after a step: no KV cache, no prefix cache. A prompt longer than the token budget runs alone in a step of its
own (a pooled prompt is not chunked)."""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import torch

from pagedllm.backend import Backend
from pagedllm.batch import EncodeBatch
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler import PoolerConfig, finish, pool


@dataclasses.dataclass
class PoolingRequest:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: PoolingParams
    arrival_time: float


class PoolingRunner:
    def __init__(self, backend: Backend, config: PoolerConfig, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        self.backend = backend
        self.config = config
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.OrderedDict[str, PoolingRequest] = collections.OrderedDict()

    def add(self, request: PoolingRequest) -> None:
        self.waiting[request.request_id] = request

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def schedule(self) -> list[PoolingRequest]:
        """The next step's requests: the oldest ones that fit the budget (at least one)."""
        picked, tokens = [], 0
        for request in self.waiting.values():
            if picked and (tokens + len(request.token_ids) > self.max_num_batched_tokens
                           or len(picked) == self.max_num_seqs):
                break
            picked.append(request)
            tokens += len(request.token_ids)
        for request in picked:
            del self.waiting[request.request_id]
        return picked

    def run(self, requests: list[PoolingRequest]) -> list[RequestOutput]:
        """One forward pass over the requests; each one's finished output with its vector."""
        start = time.time()
        lengths = [len(r.token_ids) for r in requests]
        starts = np.zeros(len(requests) + 1, dtype=np.int32)
        np.cumsum(lengths, out=starts[1:])
        batch = EncodeBatch(np.fromiter((t for r in requests for t in r.token_ids), dtype=np.int64,
                                        count=int(starts[-1])), starts)
        hidden = torch.as_tensor(self.backend.encode(batch)).float()
        pooled = pool(hidden, lengths, self.config.pooling_type)
        now = time.time()
        outputs = []
        for request, vector in zip(requests, pooled):
            params = request.params
            normalize = self.config.normalize if params.normalize is None else params.normalize
            embedding = finish(vector, normalize, params.dimensions).tolist()
            metrics = RequestMetrics(request.arrival_time, start, now, now)
            outputs.append(RequestOutput(request.request_id, request.prompt, request.token_ids, [], True, metrics,
                                         embedding=embedding))
        return outputs
