"""GET /metrics in Prometheus' text format, with vLLM's current (v1 engine) metric names and labels.

Gauges and counters are read at scrape time from the snapshot the engine thread publishes after each step;
latency histograms are observed on the engine thread through ``AsyncLLMEngine.on_step`` (prometheus-client's
metrics are thread-safe).
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedllm.engine.async_llm import AsyncLLMEngine, StepLatencies

LABELS = ("model_name", "engine")

# vLLM's buckets, so dashboards built for it read these the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector:
    """Scheduler and cache state from an engine's latest snapshot (one per data-parallel replica)."""

    def __init__(self, engine: AsyncLLMEngine, label_values: list[str], routed=lambda: 0) -> None:
        self.engine = engine
        self.label_values = label_values
        self.routed = routed  # requests the data-parallel router holds for this replica

    def collect(self):
        stats = self.engine.stats
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)):
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self.label_values, value)
            yield gauge
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 stats.prefix_cache_hits),
                ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", stats.num_preemptions),
                ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
                ("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.spec_accepted_tokens)):
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self.label_values, value)
            yield counter
        tracked = GaugeMetricFamily("pagedllm:requests_tracked", "Entries of the per-request tables of the engine "
                                    "and of the server's front end; above 0 when idle means a leak.",
                                    labels=LABELS + ("table",))
        tracked.add_metric(self.label_values + ["engine"], stats.requests_tracked)
        tracked.add_metric(self.label_values + ["front_end"], self.engine.requests_tracked + self.routed())
        yield tracked


class ServerMetrics:
    def __init__(self, engine, model_name: str) -> None:
        """``engine``: an ``AsyncLLMEngine``, or a ``DataParallelEngine`` whose replicas get an ``engine`` label
        each ("0", "1", ...), as vLLM labels its data-parallel engines."""
        disable_created_metrics()  # as vLLM does: the *_created samples only add noise to every scrape
        self.registry = CollectorRegistry()
        replicas = getattr(engine, "replicas", [engine])
        self._labels = [[model_name, str(rank)] for rank in range(len(replicas))]
        for rank, replica in enumerate(replicas):
            routed = functools.partial(engine.routed_to, rank) if replica is not engine else (lambda: 0)
            self.registry.register(_EngineStatsCollector(replica, self._labels[rank], routed))

        def histogram(name: str, doc: str, buckets) -> list:
            family = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            return [family.labels(*labels) for labels in self._labels]

        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", _TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds",
                                     "Histogram of e2e request latency in seconds.", _REQUEST_LATENCY_BUCKETS)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                LABELS + ("finished_reason",), registry=self.registry)
        self.rejected = Counter("pagedllm:requests_rejected", "Requests refused because --max-waiting-requests "
                                "were already queued.", LABELS, registry=self.registry).labels(*self._labels[0])
        self.failed = Counter("pagedllm:requests_failed", "Requests ended by an engine step that raised.", LABELS,
                              registry=self.registry)
        for labels in self._labels:  # each replica's counter exists from the start, at 0
            self.failed.labels(*labels)

    def observe(self, step: StepLatencies, rank: int = 0) -> None:
        """``on_step`` of the engine (of replica ``rank``): runs on its receiving thread."""
        labels = self._labels[rank]
        for seconds in step.time_to_first_token:
            self.time_to_first_token[rank].observe(seconds)
        for seconds in step.inter_token_latency:
            self.inter_token_latency[rank].observe(seconds)
        for output in step.finished:
            if output.error is not None:  # its step failed: not a success, no latency to speak of
                self.failed.labels(*labels).inc()
                continue
            metrics = output.metrics
            self.e2e_latency[rank].observe(metrics.finished_time - metrics.arrival_time)
            num_tokens = max(len(c.token_ids) for c in output.outputs)
            if num_tokens > 1 and metrics.first_token_time is not None:
                self.time_per_output_token[rank].observe((metrics.finished_time - metrics.first_token_time)
                                                         / (num_tokens - 1))
            self._success.labels(*labels, output.outputs[0].finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
