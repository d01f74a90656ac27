"""Metric functions on synthetic timelines whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from rackserve.bench.client import RequestTimeline
from rackserve.bench.metrics import (
    agentic_metrics,
    inter_token_latencies,
    mean_in_flight,
    measured_hit_rate,
    serve_metrics,
    summarize,
    time_per_output_token,
    token_counts,
)


def timeline(
    send: float,
    gaps: list[float],
    prompt: int = 100,
    cached: int | None = None,
    ttft: float = 0.1,
    error: str | None = None,
) -> RequestTimeline:
    """A request sent at ``send`` whose first chunk comes after ``ttft``, then ``gaps``."""
    times = list(np.cumsum([send + ttft, *gaps]))
    return RequestTimeline(
        tag="t",
        send_time=send,
        end_time=times[-1],
        chunk_times=tuple(times),
        prompt_tokens=prompt,
        completion_tokens=len(times),
        cached_tokens=cached,
        usage_reported=True,
        error=error,
    )


def test_ttft_itl_tpot_of_one_request() -> None:
    t = timeline(send=1.0, gaps=[0.1, 0.1, 0.2])
    assert t.ttft == pytest.approx(0.1)
    assert t.e2el == pytest.approx(0.5)
    assert inter_token_latencies(t) == pytest.approx([0.1, 0.1, 0.2])  # first token excluded
    assert time_per_output_token(t) == pytest.approx(0.4 / 3)
    assert time_per_output_token(timeline(0.0, [])) is None  # one token: no TPOT


def test_p90_itl_and_interactivity() -> None:
    gaps = [i / 1000 for i in range(1, 11)]  # ITLs of 1..10 ms
    metrics = agentic_metrics([timeline(0.0, gaps)], 0.0, 10.0, num_gpus=1)
    assert metrics["itl_ms"]["p90"] == pytest.approx(9.1)  # numpy linear interpolation
    assert metrics["itl_ms"]["p50"] == pytest.approx(5.5)
    assert metrics["itl_ms"]["mean"] == pytest.approx(5.5)
    assert metrics["interactivity_tok_s"] == pytest.approx(1000 / 9.1)
    # One request of 11 tokens: (E2EL - TTFT) / 10 = 5.5 ms per token, 1 / that tok/s.
    assert metrics["tpot_ms"]["p50"] == pytest.approx(5.5)
    assert metrics["per_request_tok_s"]["p50"] == pytest.approx(1000 / 5.5)


def test_token_classes_and_throughput_per_gpu() -> None:
    requests = [
        timeline(0.0, [0.1] * 9, prompt=100, cached=80),  # 10 output tokens, ends at 1.0
        timeline(1.0, [0.1] * 4, prompt=50, cached=0),  # 5 output tokens, ends at 1.5
        timeline(2.0, [0.1] * 4, prompt=40, cached=None),  # server did not report a hit
        timeline(9.5, [0.1] * 9, prompt=70, cached=70),  # ends at 10.5: outside the window
    ]
    counts = token_counts(requests[:3])
    assert (counts.cached_input, counts.uncached_input, counts.output) == (80, 110, 20)
    metrics = agentic_metrics(requests, 0.0, 10.0, num_gpus=2)
    assert metrics["num_completed"] == 3
    assert metrics["tokens"] == {
        "cached_input": 80,
        "uncached_input": 110,
        "output": 20,
        "total": 210,
    }
    per_gpu = metrics["throughput_per_gpu"]
    assert per_gpu["total"] == pytest.approx(210 / 10 / 2)
    assert per_gpu["cached_input"] + per_gpu["uncached_input"] + per_gpu["output"] == pytest.approx(
        per_gpu["total"]
    )
    assert metrics["output_throughput"] == pytest.approx(20 / 10)
    # The hit rate counts only requests whose server reported cached tokens.
    assert metrics["prefix_hit_rate"] == pytest.approx(80 / 150)


def test_hit_rate_is_none_without_reports_and_capped_at_the_prompt() -> None:
    assert measured_hit_rate([timeline(0.0, [0.1], cached=None)]) is None
    assert measured_hit_rate([timeline(0.0, [0.1], prompt=10, cached=99)]) == 1.0


def test_failures_are_counted_and_excluded_from_latencies() -> None:
    ok = timeline(0.0, [0.1])
    failed = RequestTimeline("t", send_time=0.5, end_time=0.6, error="HTTP 500: boom")
    metrics = agentic_metrics([ok, failed], 0.0, 5.0, num_gpus=1)
    assert (metrics["num_completed"], metrics["num_failed"]) == (1, 1)
    assert metrics["failure_examples"] == ["HTTP 500: boom"]
    assert metrics["ttft_ms"]["mean"] == pytest.approx(100.0)


def test_summarize_and_in_flight() -> None:
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    assert summarize([1.0, 3.0], percentiles=(50, 99.9))["p99.9"] == pytest.approx(2.998)
    requests = [timeline(0.0, [0.9]), timeline(0.5, [0.4])]  # busy 0-1.0 and 0.5-1.0
    assert mean_in_flight(requests, 0.0, 2.0) == pytest.approx(1.5 / 2.0)


def test_serve_metrics_use_vllm_names() -> None:
    requests = [timeline(0.0, [0.01] * 3), timeline(0.0, [0.02] * 3, ttft=0.3)]
    failed = RequestTimeline("t", send_time=0.0, end_time=0.1, error="boom")
    result = serve_metrics([*requests, failed], duration=2.0, percentiles=(50, 99))
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["total_input_tokens"] == 200 and result["total_output_tokens"] == 8
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(4.0)
    assert result["total_token_throughput"] == pytest.approx(104.0)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["std_ttft_ms"] == pytest.approx(100.0)
    assert result["mean_itl_ms"] == pytest.approx(15.0)
    assert result["mean_tpot_ms"] == pytest.approx(15.0)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{name}_ms", f"p50_{name}_ms", f"p99_{name}_ms"} <= result.keys()
