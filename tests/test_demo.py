"""The demo's wording on a CPU run."""

from __future__ import annotations

from rackserve.demo import format_cpu_report


def test_cpu_report_has_no_gpu_wording_and_explains_hit_rates() -> None:
    level = {
        "concurrency": 4, "throughput_per_gpu": {"total": 812.5}, "output_throughput": 40.0,
        "interactivity_tok_s": 12.0, "ttft_ms": {"p50": 30.0, "p90": 80.0},
        "itl_ms": {"p90": 70.0}, "prefix_hit_rate": 0.81, "num_completed": 20, "num_failed": 0,
    }  # fmt: skip
    result = {
        "model": "tiny", "base_url": "http://127.0.0.1:1", "duration_s": 15, "num_gpus": 1,
        "trace": {"num_requests": 40, "num_sessions": 8, "mean_input_tokens": 300.0,
                  "theoretical_prefix_hit_rate": 0.93},
        "levels": [level],
    }  # fmt: skip
    text = format_cpu_report(result)
    assert "GPU(s)" not in text and "tok/s/GPU" not in text
    assert "812.5" in text and "0.810" in text and "0.930" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("hit rate:")]
    assert "measured" in line and "theoretical" in line
