"""Benchmark metrics as pure functions of recorded request timelines and planned traces.

Definitions (all client-side, per request unless noted)::

    send ──── first chunk ── chunk ── chunk ── ... ── last chunk ── end
         TTFT              ITL      ITL                             (E2EL = end - send)
    TPOT = (E2EL - TTFT) / (output_tokens - 1)      ITL excludes the first token
    interactivity (tok/s per user) = 1 / P90(ITL over all chunks of all requests)
    throughput per GPU = (cached input + uncached input + output tokens) / duration / GPUs

A request belongs to a measurement window when it *ends* inside it; in steady state the
tokens of requests completing in a window estimate the tokens served in it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rackserve.bench.workloads import (
    AgenticConfig,
    PlannedRequest,
    TokenCounter,
    generate_session,
    plan_requests,
)

if TYPE_CHECKING:
    from rackserve.bench.client import RequestTimeline

PERCENTILES = (50, 90, 95, 99)
# For speeds the slow tail is the low percentiles.
SPEED_PERCENTILES = (1, 5, 10, 50, 90)


def summarize(
    values: Sequence[float], percentiles: Sequence[float] = PERCENTILES, scale: float = 1.0
) -> dict[str, float | None]:
    """``{"mean", "p50", ...}`` of ``values * scale``; every entry is None when empty."""
    keys = ["mean", *(f"p{_percentile_name(p)}" for p in percentiles)]
    if len(values) == 0:
        return dict.fromkeys(keys)
    array = np.asarray(values, dtype=np.float64) * scale
    stats = [float(array.mean()), *(float(v) for v in np.percentile(array, percentiles))]
    return dict(zip(keys, stats, strict=True))


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def inter_token_latencies(timeline: RequestTimeline) -> list[float]:
    """Gaps between consecutive output chunks (the first token's latency is TTFT, not ITL)."""
    times = timeline.chunk_times
    return [b - a for a, b in itertools.pairwise(times)]


def time_per_output_token(timeline: RequestTimeline) -> float | None:
    """``(E2EL - TTFT) / (output_tokens - 1)``; None for replies of fewer than 2 tokens."""
    if timeline.completion_tokens < 2 or not timeline.chunk_times:
        return None
    return (timeline.e2el - timeline.ttft) / (timeline.completion_tokens - 1)


@dataclass(frozen=True)
class TokenCounts:
    """Tokens served, by class. ``cached_input`` counts prefix-cache hits the server reported."""

    cached_input: int
    uncached_input: int
    output: int

    @property
    def input(self) -> int:
        return self.cached_input + self.uncached_input

    @property
    def total(self) -> int:
        return self.input + self.output


def token_counts(timelines: Iterable[RequestTimeline]) -> TokenCounts:
    """Sum token classes; a server that reports no ``cached_tokens`` counts all input uncached."""
    cached = uncached = output = 0
    for t in timelines:
        hit = min(t.cached_tokens or 0, t.prompt_tokens)
        cached += hit
        uncached += t.prompt_tokens - hit
        output += t.completion_tokens
    return TokenCounts(cached, uncached, output)


def measured_hit_rate(timelines: Iterable[RequestTimeline]) -> float | None:
    """Cached / prompt tokens over requests whose server reported ``cached_tokens``."""
    reported = [t for t in timelines if t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in reported)
    if not reported or prompt == 0:
        return None
    return sum(min(t.cached_tokens or 0, t.prompt_tokens) for t in reported) / prompt


def ended_in_window(
    timelines: Iterable[RequestTimeline], start: float, end: float
) -> list[RequestTimeline]:
    return [t for t in timelines if start <= t.end_time <= end]


def mean_in_flight(timelines: Iterable[RequestTimeline], start: float, end: float) -> float:
    """Time-averaged number of requests in flight during ``[start, end]``."""
    busy = sum(max(0.0, min(t.end_time, end) - max(t.send_time, start)) for t in timelines)
    return busy / (end - start)


def ttft_cdf_ms(timelines: Iterable[RequestTimeline], num_points: int = 101) -> list[float]:
    """TTFT quantiles (ms) at ``num_points`` evenly spaced levels 0..100: a CDF of fixed size."""
    ttfts = [t.ttft * 1e3 for t in timelines if t.success]
    if not ttfts:
        return []
    return [float(v) for v in np.percentile(ttfts, np.linspace(0, 100, num_points))]


def agentic_metrics(
    timelines: Sequence[RequestTimeline], window_start: float, window_end: float, num_gpus: int
) -> dict[str, Any]:
    """Metrics of one concurrency level over requests that ended in the window."""
    duration = window_end - window_start
    if duration <= 0 or num_gpus < 1:
        raise ValueError("the window must be non-empty and num_gpus >= 1")
    window = ended_in_window(timelines, window_start, window_end)
    done = [t for t in window if t.success]
    failed = [t for t in window if not t.success]
    counts = token_counts(done)
    itls = [gap for t in done for gap in inter_token_latencies(t)]
    tpots = [v for v in map(time_per_output_token, done) if v is not None]
    p90_itl = float(np.percentile(itls, 90)) if itls else None
    return {
        "duration_s": duration,
        "num_completed": len(done),
        "num_failed": len(failed),
        "failure_examples": sorted({t.error or "" for t in failed})[:5],
        "tokens": {
            "cached_input": counts.cached_input,
            "uncached_input": counts.uncached_input,
            "output": counts.output,
            "total": counts.total,
        },
        "throughput_per_gpu": {
            "total": counts.total / duration / num_gpus,
            "cached_input": counts.cached_input / duration / num_gpus,
            "uncached_input": counts.uncached_input / duration / num_gpus,
            "output": counts.output / duration / num_gpus,
        },
        "output_throughput": counts.output / duration,
        "request_throughput": len(done) / duration,
        "ttft_ms": summarize([t.ttft for t in done], scale=1e3),
        "tpot_ms": summarize(tpots, scale=1e3),
        "itl_ms": summarize(itls, scale=1e3),
        "e2el_ms": summarize([t.e2el for t in done], scale=1e3),
        "interactivity_tok_s": 1.0 / p90_itl if p90_itl else None,
        "per_request_tok_s": summarize([1.0 / v for v in tpots if v > 0], SPEED_PERCENTILES),
        "ttft_cdf_ms": ttft_cdf_ms(done),
        "mean_in_flight": mean_in_flight(timelines, window_start, window_end),
        "prefix_hit_rate": measured_hit_rate(done),
        "cached_tokens_reported": any(t.cached_tokens is not None for t in done),
    }


def serve_metrics(
    timelines: Sequence[RequestTimeline], duration: float, percentiles: Sequence[float] = (99,)
) -> dict[str, Any]:
    """``vllm bench serve`` result fields (same names and units), from all timelines."""
    done = [t for t in timelines if t.success]
    total_input = sum(t.prompt_tokens for t in done)
    total_output = sum(t.completion_tokens for t in done)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(timelines) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    series = {
        "ttft": [t.ttft for t in done],
        "tpot": [v for v in map(time_per_output_token, done) if v is not None],
        "itl": [gap for t in done for gap in inter_token_latencies(t)],
        "e2el": [t.e2el for t in done],
    }
    for name, values in series.items():
        # vLLM reports 0 for an empty series; keep that so result files diff cleanly.
        ms = np.asarray(values or [0.0], dtype=np.float64) * 1e3
        result[f"mean_{name}_ms"] = float(ms.mean())
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            result[f"p{_percentile_name(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return result


def prefix_hits(requests: Iterable[PlannedRequest]) -> list[int]:
    """Tokens each request could reuse from an infinite prefix cache, in issue order.

    A trie over segment keys holds every earlier prompt *and its reply* (servers cache the
    KV of generated tokens too); a request reuses its longest matching segment prefix.
    """
    trie: dict[str, dict] = {}
    hits = []
    for request in requests:
        node, hit = trie, 0
        for key, num_tokens in request.prompt:
            if key not in node:
                break
            node, hit = node[key], hit + num_tokens
        hits.append(hit)
        node = trie
        for key, _ in (*request.prompt, request.output):
            node = node.setdefault(key, {})
    return hits


def theoretical_hit_rate(requests: Sequence[PlannedRequest]) -> float:
    """Cacheable input tokens / all input tokens of a trace, given an infinite cache."""
    total = sum(num for r in requests for _, num in r.prompt)
    return sum(prefix_hits(requests)) / total if total else 0.0


def trace_stats(
    config: AgenticConfig, num_sessions: int, start: int = 0, counter: TokenCounter | None = None
) -> dict[str, Any]:
    """Size and theoretical prefix-hit rate of sessions ``start .. start + num_sessions - 1``."""
    requests: list[PlannedRequest] = []
    for index in range(start, start + num_sessions):
        requests += plan_requests(generate_session(config, index, counter))
    input_tokens = [sum(num for _, num in r.prompt) for r in requests]
    return {
        "num_sessions": num_sessions,
        "num_requests": len(requests),
        "num_subagent_requests": sum("." in r.session_id for r in requests),
        "mean_input_tokens": float(np.mean(input_tokens)) if requests else 0.0,
        "max_input_tokens": max(input_tokens, default=0),
        "mean_output_tokens": float(np.mean([r.output[1] for r in requests])) if requests else 0.0,
        "theoretical_prefix_hit_rate": theoretical_hit_rate(requests),
    }


def summary_row(level: Mapping[str, Any]) -> dict[str, Any]:
    """The few numbers of one concurrency level that a table or a plot shows."""
    return {
        "concurrency": level["concurrency"],
        "tok_s_per_gpu": level["throughput_per_gpu"]["total"],
        "output_tok_s": level["output_throughput"],
        "interactivity": level["interactivity_tok_s"],
        "ttft_p50_ms": level["ttft_ms"]["p50"],
        "ttft_p90_ms": level["ttft_ms"]["p90"],
        "itl_p90_ms": level["itl_ms"]["p90"],
        "hit_rate": level["prefix_hit_rate"],
        "completed": level["num_completed"],
        "failed": level["num_failed"],
    }
