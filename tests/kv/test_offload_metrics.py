"""The host KV pool's Prometheus series: hits per tier, bytes each way, pool usage."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from rackserve.engine.dp_client import merge_stats
from rackserve.engine.outputs import SchedulerStats
from rackserve.server.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, s.labels.get("tier", ""))] = s.value
    return out


def stats(hits: int, pool_hits: int, offloaded: int, loaded: int, usage: float):
    return SchedulerStats(
        prefix_cache_queries=2 * hits,
        prefix_cache_hits=hits,
        prefix_cache_pool_hits=pool_hits,
        kv_offload_bytes=offloaded,
        kv_load_bytes=loaded,
        kv_pool_usage=usage,
    )


def test_pool_series_follow_the_cumulative_stats():
    metrics = ServerMetrics("m")
    metrics.record_scheduler_stats(stats(100, 30, 1000, 500, 0.25))
    metrics.record_scheduler_stats(stats(160, 50, 1500, 800, 0.5))
    s = samples(metrics)
    assert s[("rackserve:prefix_cache_hits_by_tier_total", "device")] == 110
    assert s[("rackserve:prefix_cache_hits_by_tier_total", "pool")] == 50
    assert s[("rackserve:prefix_cache_hits_total", "")] == 160  # the tiers sum to it
    assert s[("rackserve:kv_offload_bytes_total", "")] == 1500
    assert s[("rackserve:kv_load_bytes_total", "")] == 800
    assert s[("rackserve:kv_pool_usage_perc", "")] == 0.5


def test_dp_ranks_sum_pool_counters():
    merged = merge_stats([stats(10, 4, 100, 40, 0.2), None, stats(20, 6, 50, 10, 0.7)])
    assert (merged.prefix_cache_pool_hits, merged.kv_offload_bytes) == (10, 150)
    assert (merged.kv_load_bytes, merged.kv_pool_usage) == (50, 0.7)


def test_theoretical_rate_of_the_measured_requests():
    """The pool's figure compares a window's hit rate with the infinite-cache rate of the
    same requests (bench agentic), not of whole sessions."""
    from rackserve.bench.agentic import measured_requests_hit_rate
    from rackserve.bench.workloads import AgenticConfig

    workload = AgenticConfig(
        system_prompt_tokens=100, user_context_tokens=50, first_message_tokens=10,
        tool_output_tokens=20, output_tokens=10, turns=3, subagent_probability=0.0,
        length_jitter=0.0,
    )  # fmt: skip
    # session s0 alone: turn 0 (162 tokens: 100 + 52 + 10) hits nothing, turn 1 reuses
    # them and the reply (172 of 192)
    assert measured_requests_hit_rate(workload, range(1), ["s0.t0"]) == 0.0
    assert measured_requests_hit_rate(workload, range(1), ["s0.t1"]) == 172 / 192
    assert measured_requests_hit_rate(workload, range(1), ["s0.t0", "s0.t1"]) == 172 / 354
    assert measured_requests_hit_rate(workload, range(1), ["unknown"]) is None
