"""Prometheus metrics of the API server, named as vLLM's with a ``rackserve:`` prefix.

Each server builds its own ``CollectorRegistry`` (no process-global registry), so tests can
run several apps in one process. Every series carries a ``model_name`` label. Engine-side
counters arrive cumulative in ``SchedulerStats`` and are turned into counter increments.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-export)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rackserve.engine.output_processor import IterationStats
from rackserve.engine.outputs import SchedulerStats

PREFIX = "rackserve:"
# Bucket edges as vLLM uses them, so dashboards built for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                 50000, 100000, 200000, 500000, 1000000)  # fmt: skip


class ServerMetrics:
    """The server's metric families, bound to one ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        registry, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(PREFIX + name, doc, labels, registry=registry, buckets=buckets)
            return family.labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in model batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV cache usage (fraction of blocks in use, 1 = full)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens (cached included).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival to the moment the scheduler first admitted the request.",
            LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS
        )
        self._expert_balancedness = Gauge(
            PREFIX + "expert_balancedness",
            "Expert parallelism: mean / max rank load per MoE layer over the EPLB window; "
            "routing=uniform is the same batches routed uniformly at random (the ceiling).",
            ["model_name", "layer", "routing"],
            registry=registry,
        )
        self._last = SchedulerStats()

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        for routing, values in (
            ("real", stats.expert_balancedness),
            ("uniform", stats.expert_balancedness_uniform),
        ):
            for layer, value in enumerate(values or ()):
                self._expert_balancedness.labels(self.model_name, str(layer), routing).set(value)
        last = self._last
        for counter, now, before in (
            (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.num_preemptions, stats.num_preemptions, last.num_preemptions),
        ):
            if now > before:  # a smaller value would be a restarted engine: nothing to add
                counter.inc(now - before)
        self._last = stats

    def record_iteration(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens_s:
            self.time_to_first_token.observe(value)
        for value in stats.queue_times_s:
            self.request_queue_time.observe(value)
        for value in stats.inter_token_latencies_s:
            self.inter_token_latency.observe(value)
        for finished in stats.finished:
            self._request_success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
