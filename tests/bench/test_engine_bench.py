"""`bench scheduler` times exactly schedule + input preparation + update."""

from __future__ import annotations

from rackserve.bench.engine_bench import scheduler_step_times


def test_scheduler_step_times_reports_the_three_phases():
    r = scheduler_step_times(num_requests=16, context=64, num_steps=5)
    assert r["num_requests"] == 16 and r["context"] == 64
    phases = r["schedule_ms"] + r["prepare_ms"] + r["update_ms"]
    assert all(r[k] > 0 for k in ("schedule_ms", "prepare_ms", "update_ms"))
    # the median of sums is within the sum of medians' neighbourhood (same 5 steps)
    assert 0.5 * phases <= r["median_ms"] <= 2.0 * phases
