"""Data parallelism (``pagedllm serve --data-parallel-size N``): N engine replicas, each an ``AsyncLLMEngine`` with
its engine core in a process of its own on its own CPU set, behind one API server.

Each add goes whole to one replica. The router prefers the replica that last served the longest run of the
prompt's leading blocks (whose KV it likely still caches), unless that replica is much busier than the least busy
one; otherwise the least busy replica (fewest requests in flight) takes it. A replica that dies is the engine's
death, as a dead core is for one engine: the server answers 503 and exits for its supervisor to restart it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import threading
from typing import Callable, Sequence

import numpy as np

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLMEngine, EngineDeadError, OutputStream, RequestSpec, StepLatencies
from pagedllm.engine.core_client import place_front_end
from pagedllm.engine.input_processing import needs_tokenizing, tokenize_prompt
from pagedllm.engine.stats import EngineStats

logger = logging.getLogger("pagedllm.engine.data_parallel")

ROUTED_BLOCKS = 64  # leading blocks of a prompt the router remembers
ROUTER_ENTRIES = 1 << 16  # block hashes remembered (least recently routed forgotten first)
BUSY_SLACK = 4  # a replica holding the prefix is passed over once it has this many more requests than the least busy


class PrefixRouter:
    """Which replica serves a prompt: the one that last served the longest run of its leading blocks (chained
    hashes, as the prefix cache keys them), else the least busy."""

    def __init__(self, replicas: int, block_size: int) -> None:
        self.replicas = replicas
        self.block_size = block_size
        self._owner: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        hashes, previous = [], b""
        full = min(len(token_ids) // self.block_size, ROUTED_BLOCKS)
        ids = np.asarray(token_ids[:full * self.block_size], dtype=np.int64)
        for i in range(full):
            previous = hashlib.blake2b(previous + ids[i * self.block_size:(i + 1) * self.block_size].tobytes(),
                                       digest_size=16).digest()
            hashes.append(previous)
        return hashes

    def choose(self, token_ids: list[int], load: Sequence[int], alive: Sequence[bool]) -> int:
        hashes = self.block_hashes(token_ids)
        least = min((i for i in range(self.replicas) if alive[i]), key=lambda i: load[i])
        holder = None
        for block in reversed(hashes):  # the longest run first
            owner = self._owner.get(block)
            if owner is not None and alive[owner]:
                holder = owner
                break
        chosen = holder if holder is not None and load[holder] - load[least] < BUSY_SLACK else least
        for block in hashes:
            self._owner[block] = chosen
            self._owner.move_to_end(block)
        while len(self._owner) > ROUTER_ENTRIES:
            self._owner.popitem(last=False)
        return chosen


class DataParallelEngine:
    """What the server needs of an engine (``add``, ``abort``, ``stats``, ``dead``, ...) over N replicas."""

    def __init__(self, args: EngineArgs, size: int, engine_process: bool = True) -> None:
        self.on_step: Callable[[StepLatencies, int], None] | None = None  # with the replica's rank
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._lock = threading.Lock()
        self._replica_of: dict[str, int] = {}  # request id -> its replica, while in flight
        self._in_flight = [0] * size
        logger.info("data parallel: starting %d engine replicas", size)
        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            futures = [pool.submit(AsyncLLMEngine, dataclasses.replace(args, data_parallel_size=size,
                                                                       data_parallel_rank=rank),
                                   engine_process=engine_process, place_front_end=False) for rank in range(size)]
            concurrent.futures.wait(futures)
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for future in futures:
                if future.exception() is None:
                    future.result().shutdown()
            raise failed[0]
        self.replicas: list[AsyncLLMEngine] = [f.result() for f in futures]
        for rank, replica in enumerate(self.replicas):
            replica.on_step = self._step_hook(rank)
            replica.on_dead = self._dead_hook
        if engine_process:
            self._place_front_end()
        self.engine = self.replicas[0].engine
        self.router = PrefixRouter(size, self.engine.config.block_size)

    # -- what the server reads -------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        """The replicas' snapshots summed (per-replica figures: ``replica_stats``)."""
        return sum_stats([r.stats for r in self.replicas])

    @property
    def dead(self) -> EngineDeadError | None:
        return next((r.dead for r in self.replicas if r.dead is not None), None)

    @property
    def requests_tracked(self) -> int:
        with self._lock:
            own = len(self._replica_of)
        return own + sum(r.requests_tracked for r in self.replicas)

    def routed_to(self, rank: int) -> int:
        """Requests in flight on replica ``rank`` that the router still counts."""
        with self._lock:
            return self._in_flight[rank]

    def stalled_for(self, bound: float) -> float | None:
        stalled = [s for s in (r.stalled_for(bound) for r in self.replicas) if s is not None]
        return max(stalled) if stalled else None

    # -- requests ---------------------------------------------------------------------------------------------
    async def add(self, requests: Sequence[RequestSpec], arrival_time: float | None = None, priority: int = 0,
                  snapshot: bool = False) -> OutputStream:
        requests = [(rid, self._with_token_ids(prompt), params) for rid, prompt, params in requests]
        _, first_ids = tokenize_prompt(None, requests[0][1])
        with self._lock:
            alive = [r.dead is None for r in self.replicas]
            if not any(alive):
                raise self.dead
            rank = self.router.choose(first_ids, self._in_flight, alive)
            for rid, _, _ in requests:
                self._replica_of[rid] = rank
            self._in_flight[rank] += len(requests)
        replica = self.replicas[rank]
        try:
            stream = await replica.add(requests, arrival_time, priority, snapshot)
        except BaseException:
            self._forget([rid for rid, _, _ in requests])
            raise
        return _ReplicaStream(stream, self)

    def abort(self, request_ids: Sequence[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                rank = self._replica_of.get(rid)
                if rank is not None:
                    by_replica.setdefault(rank, []).append(rid)
        for rank, ids in by_replica.items():
            self.replicas[rank].abort(ids)
        self._forget(list(request_ids))

    def shutdown(self, timeout: float | None = None) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.shutdown(timeout), self.replicas))

    # -- internals --------------------------------------------------------------------------------------------
    def _forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                rank = self._replica_of.pop(rid, None)
                if rank is not None:
                    self._in_flight[rank] -= 1

    def _with_token_ids(self, prompt):
        """Text prompts tokenized here (the router needs their ids); the replica then takes the ids as they are."""
        if not needs_tokenizing(prompt):
            return prompt
        text, token_ids = tokenize_prompt(self.replicas[0]._tokenizer, prompt)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _step_hook(self, rank: int):
        def on_step(latencies: StepLatencies) -> None:
            self._forget([o.request_id for o in latencies.finished])
            if self.on_step is not None:
                self.on_step(latencies, rank)
        return on_step

    def _dead_hook(self, error: EngineDeadError) -> None:
        on_dead, self.on_dead = self.on_dead, None  # once: the first replica to die is the engine's death
        if on_dead is not None:
            on_dead(error)

    def _place_front_end(self) -> None:
        bound = [replica._client.ready.bound_cpus for replica in self.replicas]
        cpus = None if any(b is None for b in bound) else {cpu for b in bound for cpu in b}
        place_front_end(cpus, f"{len(self.replicas)} engine replicas")


class _ReplicaStream:
    """A replica's output stream; the requests it ends are forgotten by the router's load count."""

    def __init__(self, stream: OutputStream, owner: DataParallelEngine) -> None:
        self._stream, self._owner = stream, owner
        self.request_ids = stream.request_ids

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._owner._forget(self.request_ids)
            raise

    def abort(self) -> None:
        self._stream.abort()
        self._owner._forget(self.request_ids)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()


def sum_stats(snapshots: list[EngineStats]) -> EngineStats:
    """The replicas' snapshots as one: counts added, flags or-ed, ratios at their largest."""
    fields = {}
    for field in dataclasses.fields(EngineStats):
        values = [getattr(s, field.name) for s in snapshots]
        fields[field.name] = any(values) if field.type == "bool" else max(values) if field.type == "float" \
            else sum(values)
    return EngineStats(**fields)
