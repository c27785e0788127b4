"""One immutable snapshot of the engine's state and counters: what the metrics endpoint, the benchmarks and the
logs read, so none of them reaches into the scheduler or the KV manager."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int = 0  # sequences in the running set
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # held by requests (cached blocks no request holds count as free)
    peak_kv_blocks: int = 0
    kv_waste_at_peak: float = 0.0  # allocated slots holding no token, over allocated slots, at the peak
    prefix_caching: bool = False
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    batched_tokens: int = 0  # tokens computed in steps, prompts and outputs
    steps: int = 0
    finished_requests: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: tokens proposed
    spec_accepted_tokens: int = 0  # of those, tokens the model agreed with
    requests_tracked: int = 0  # entries of the engine's per-request tables; above 0 when idle means a leak

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if not self.prefix_caching:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class StatsLogger:
    """A log line of throughput and occupancy every ``interval`` seconds while the engine works (vLLM's cadence)."""

    def __init__(self, logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: EngineStats | None = None
        self._last_time = 0.0

    def observe(self, stats: EngineStats, now: float) -> None:
        last = self._last
        if last is None:
            self._last, self._last_time = stats, now
            return
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        if stats.steps != last.steps:
            hit_rate = stats.prefix_cache_hit_rate
            drafts = stats.spec_draft_tokens - last.spec_draft_tokens
            accepted = stats.spec_accepted_tokens - last.spec_accepted_tokens
            self.logger.info(
                "%.1f prompt tok/s, %.1f generation tok/s; running %d, waiting %d; KV cache %.1f%% used%s; "
                "%d preemptions%s", (stats.prompt_tokens - last.prompt_tokens) / elapsed,
                (stats.generation_tokens - last.generation_tokens) / elapsed, stats.num_running, stats.num_waiting,
                100 * stats.kv_cache_usage,
                "" if hit_rate is None else f", prefix cache hit rate {100 * hit_rate:.1f}%", stats.num_preemptions,
                f"; speculation: {accepted} of {drafts} proposed tokens accepted ({100 * accepted / drafts:.0f}%)"
                if drafts else "")
        self._last, self._last_time = stats, now
