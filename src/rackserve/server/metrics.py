"""Prometheus metrics of the API server, named as vLLM's with a ``rackserve:`` prefix
(``--metrics-prefix vllm`` gives ``vllm:``, so vLLM dashboards and autoscalers read us
unchanged), and the periodic stats line vLLM logs.

Each server builds its own ``CollectorRegistry`` (no process-global registry), so tests can
run several apps in one process. Every series carries a ``model_name`` label. Engine-side
counters arrive cumulative in ``SchedulerStats`` and are turned into counter increments.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-export)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rackserve.engine.output_processor import IterationStats
from rackserve.engine.outputs import SchedulerStats
from rackserve.spec_decode.stats import SpecDecodingStats

# Buckets vLLM uses for these series.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
CACHE_CONFIG_LABELS = ("block_size", "gpu_memory_utilization", "kv_cache_memory_bytes",
                       "enable_prefix_caching", "cache_dtype")  # fmt: skip
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

    def __init__(self, model_name: str, prefix: str = "rackserve") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefix = f"{prefix}:"
        registry, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(self.prefix + name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(self.prefix + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(self.prefix + name, doc, labels, registry=registry, buckets=buckets)
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
        # The host KV pool (kv/offload): zero without one.
        self._hits_by_tier = Counter(
            self.prefix + "prefix_cache_hits_by_tier",
            "Prompt tokens found in the prefix cache, by tier: device (the KV cache) or pool "
            "(loaded back from the host KV pool); they sum to prefix_cache_hits.",
            ["model_name", "tier"],
            registry=registry,
        )
        self.kv_offload_bytes = counter(
            "kv_offload_bytes", "Bytes copied from the KV cache to the host KV pool."
        )
        self.kv_load_bytes = counter(
            "kv_load_bytes", "Bytes loaded from the host KV pool into the KV cache."
        )
        self.kv_pool_usage_perc = gauge(
            "kv_pool_usage_perc", "Host KV pool usage (fraction of its bytes in use, 1 = full)."
        )
        # P/D decode side (disagg/): requests whose prompt KV is on its way, bytes received
        self.num_requests_waiting_for_kv = gauge(
            "num_requests_waiting_for_remote_kv", "Requests waiting for KV from a prefill engine."
        )
        self.kv_transfer_bytes_received = counter(
            "kv_transfer_bytes_received", "KV bytes received from prefill engines."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens (cached included).")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        # speculative decoding, as vLLM names it (absent values stay 0 without speculation)
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Verified runs of draft tokens (one per request-step)."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_decode_per_pos = Counter(
            self.prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per position in the run (0-based).",
            ["model_name", "position"],
            registry=registry,
        )
        self._request_success = Counter(
            self.prefix + "request_success",
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
        # The series vLLM has beyond the ones above (issue 15).
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Per finished request: decode time / (generated tokens - 1).",
            TPOT_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduled to last token (prefill + decode).",
            LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine step (prompts that got their first token + generated).",
            ITERATION_TOKEN_BUCKETS,
        )
        self.request_params_n = histogram("request_params_n", "The n of requests.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of requests.", TOKEN_BUCKETS
        )
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        self._waiting_by_reason = Gauge(
            self.prefix + "num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (no room in the batch or the KV cache) "
            "or deferred (none here yet: P/D requests waiting for KV will be).",
            ["model_name", "reason"],
            registry=registry,
        )
        self._waiting_by_reason.labels(model_name, "deferred").set(0)
        self._cache_config_info = Gauge(
            self.prefix + "cache_config_info",
            "Information of the KV cache configuration (labels; the value is 1).",
            ["model_name", *CACHE_CONFIG_LABELS],
            registry=registry,
        )
        self.stats_log = StatsLogLine()
        self._expert_balancedness = Gauge(
            self.prefix + "expert_balancedness",
            "Expert parallelism: mean / max rank load per MoE layer over the EPLB window; "
            "routing=uniform is the same batches routed uniformly at random (the ceiling).",
            ["model_name", "layer", "routing"],
            registry=registry,
        )
        self._last = SchedulerStats()
        self._request_rejected = Counter(
            self.prefix + "request_rejected",
            "Requests refused before reaching the engine, by reason (a limit, bad input).",
            ["model_name", "reason"],
            registry=registry,
        )

    def set_cache_config_info(self, **labels: Any) -> None:
        """One ``cache_config_info`` series with the configuration as labels."""
        unknown = set(labels) - set(CACHE_CONFIG_LABELS)
        if unknown:
            raise ValueError(f"cache_config_info has no labels {sorted(unknown)}")
        values = {n: str(labels.get(n)) for n in CACHE_CONFIG_LABELS}
        self._cache_config_info.labels(model_name=self.model_name, **values).set(1)

    def record_request_params(self, n: int, max_tokens: int) -> None:
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)

    def record_abort(self, num_requests: int = 1) -> None:
        """Engine requests aborted before they finished (client gone, stop string): vLLM
        counts each as a ``request_success`` with ``finished_reason="abort"``."""
        self._request_success.labels(self.model_name, "abort").inc(num_requests)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self._waiting_by_reason.labels(self.model_name, "capacity").set(stats.num_waiting_reqs)
        self.stats_log.record_scheduler_stats(stats)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_pool_usage_perc.set(stats.kv_pool_usage)
        self.num_requests_waiting_for_kv.set(stats.num_waiting_for_remote_kv)
        for routing, values in (
            ("real", stats.expert_balancedness),
            ("uniform", stats.expert_balancedness_uniform),
        ):
            for layer, value in enumerate(values or ()):
                self._expert_balancedness.labels(self.model_name, str(layer), routing).set(value)
        last = self._last
        device_hits = stats.prefix_cache_hits - stats.prefix_cache_pool_hits
        tier = self._hits_by_tier
        for counter, now, before in (
            (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.num_preemptions, stats.num_preemptions, last.num_preemptions),
            (
                tier.labels(self.model_name, "device"),
                device_hits,
                last.prefix_cache_hits - last.prefix_cache_pool_hits,
            ),
            (
                tier.labels(self.model_name, "pool"),
                stats.prefix_cache_pool_hits,
                last.prefix_cache_pool_hits,
            ),
            (self.kv_offload_bytes, stats.kv_offload_bytes, last.kv_offload_bytes),
            (self.kv_load_bytes, stats.kv_load_bytes, last.kv_load_bytes),
            (self.kv_transfer_bytes_received, stats.kv_bytes_received, last.kv_bytes_received),
        ):
            if now > before:  # a smaller value would be a restarted engine: nothing to add
                counter.inc(now - before)
        spec, spec_before = stats.spec_decoding, last.spec_decoding or SpecDecodingStats()
        if spec is not None:
            for counter, now, before in (
                (self.spec_decode_num_drafts, spec.num_drafts, spec_before.num_drafts),
                (
                    self.spec_decode_num_draft_tokens,
                    spec.num_draft_tokens,
                    spec_before.num_draft_tokens,
                ),
                (
                    self.spec_decode_num_accepted_tokens,
                    spec.num_accepted_tokens,
                    spec_before.num_accepted_tokens,
                ),
            ):
                if now > before:
                    counter.inc(now - before)
            old = spec_before.num_accepted_tokens_per_pos
            for pos, now in enumerate(spec.num_accepted_tokens_per_pos):
                before = old[pos] if pos < len(old) else 0
                if now > before:
                    self._spec_decode_per_pos.labels(self.model_name, str(pos)).inc(now - before)
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
        if stats.num_cached_prompt_tokens:
            self.prompt_tokens_cached.inc(stats.num_cached_prompt_tokens)
        num_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        self.stats_log.record_iteration(stats)
        for finished in stats.finished:
            self._request_success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency_s)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.num_generation_tokens:
                self.request_prefill_time.observe(finished.prefill_time_s)
                self.request_decode_time.observe(finished.decode_time_s)
                self.request_inference_time.observe(
                    finished.prefill_time_s + finished.decode_time_s
                )
            if finished.num_generation_tokens > 1:
                self.request_time_per_output_token.observe(
                    finished.decode_time_s / (finished.num_generation_tokens - 1)
                )

    def record_rejected(self, reason: str) -> None:
        self._request_rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class StatsLogLine:
    """vLLM's periodic log line: throughputs since the last line, running/waiting, KV
    usage and the prefix-cache hit rate over the interval."""

    def __init__(self, now: float | None = None) -> None:
        self._since = time.monotonic() if now is None else now
        self._num_prompt = self._num_generation = 0
        self._stats = SchedulerStats()
        self._queries_then = self._hits_then = 0
        self._spec_then = SpecDecodingStats()

    def record_iteration(self, stats: IterationStats) -> None:
        self._num_prompt += stats.num_prompt_tokens
        self._num_generation += stats.num_generation_tokens

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self._stats = stats

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval that ends now (None when nothing ran or waited), and
        a new interval starts."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._since, 1e-9)
        s = self._stats
        queries = s.prefix_cache_queries - self._queries_then
        hits = s.prefix_cache_hits - self._hits_then
        busy = self._num_prompt or self._num_generation or s.num_running_reqs
        text = None
        if busy or s.num_waiting_reqs:
            text = (
                f"Avg prompt throughput: {self._num_prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._num_generation / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                f"GPU KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries > 0 else 0.0:.1f}%"
            )
            if s.spec_decoding is not None:
                text += spec_decoding_line(s.spec_decoding, self._spec_then)
        if s.spec_decoding is not None:
            self._spec_then = s.spec_decoding
        self._since, self._num_prompt, self._num_generation = now, 0, 0
        self._queries_then, self._hits_then = s.prefix_cache_queries, s.prefix_cache_hits
        return text


def spec_decoding_line(now: SpecDecodingStats, then: SpecDecodingStats) -> str:
    """vLLM's speculative-decoding part of the stats line, over the interval."""
    drafts = now.num_drafts - then.num_drafts
    drafted = now.num_draft_tokens - then.num_draft_tokens
    accepted = now.num_accepted_tokens - then.num_accepted_tokens
    if not drafts:
        return ""
    old = then.num_accepted_tokens_per_pos
    per_pos = [
        (n - (old[i] if i < len(old) else 0)) / drafts
        for i, n in enumerate(now.num_accepted_tokens_per_pos)
    ]
    return (
        f", SpecDecoding: Mean acceptance length: {1 + accepted / drafts:.2f}, "
        f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
        f"Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%, "
        f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}"
    )
