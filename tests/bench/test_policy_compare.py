"""bench/policies.py: rows from agentic results, the table, and the plot (one bar per
policy in each panel) from a synthetic result, without servers."""

from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from rackserve.bench.agentic import AgenticRunConfig
from rackserve.bench.policies import (
    compare_policies,
    format_policy_report,
    plot_policies,
    policy_row,
)
from rackserve.bench.workloads import AgenticConfig


def agentic_result(hit: float, theoretical: float, p50: float, p90: float) -> dict:
    level = {
        "prefix_hit_rate": hit,
        "theoretical_prefix_hit_rate_measured": theoretical,
        "ttft_ms": {"mean": p50, "p50": p50, "p90": p90, "p95": p90, "p99": p90},
        "num_completed": 40,
        "num_failed": 0,
    }
    return {"levels": [level]}


ROWS = {
    "kv-aware": policy_row(agentic_result(0.80, 0.84, 300.0, 900.0)),
    "round-robin": policy_row(agentic_result(0.30, 0.83, 700.0, 2000.0)),
    "least-load": policy_row(agentic_result(0.35, 0.85, 650.0, 1500.0)),
}


def test_policy_row_and_report():
    row = ROWS["kv-aware"]
    assert row["fraction_of_theoretical"] == pytest.approx(0.80 / 0.84)
    assert (row["ttft_p50_ms"], row["ttft_p90_ms"]) == (300.0, 900.0)
    empty = policy_row({"levels": [{**agentic_result(0, 0, 0, 0)["levels"][0],
                                     "prefix_hit_rate": None}]})  # fmt: skip
    assert empty["fraction_of_theoretical"] is None
    lines = format_policy_report(ROWS).splitlines()
    assert len(lines) == 4 and lines[1].startswith("kv-aware") and "95.2%" in lines[1]


def test_plot_has_one_bar_per_policy(tmp_path):
    path = tmp_path / "policies.png"
    figure = plot_policies(ROWS, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    hits, ttft = figure.axes
    for ax, key in ((hits, "hit_rate"), (ttft, "ttft_p90_ms")):
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert [b.get_height() for b in bars] == [ROWS[name][key] for name in ROWS]
        assert [t.get_text() for t in ax.get_xticklabels()] == list(ROWS)


def test_compare_policies_refuses_bad_input():
    workload, run = AgenticConfig(), AgenticRunConfig(concurrency=(1,))
    with pytest.raises(ValueError, match="needs --engines"):
        compare_policies(workload, [], ["kv-aware"], run)
    with pytest.raises(ValueError, match="distinct"):
        compare_policies(workload, ["http://e"], ["kv-aware", "kv-aware"], run)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        compare_policies(workload, ["http://e"], ["kv-aware", "fastest"], run)
    with pytest.raises(ValueError, match=r"engine http://127\.0\.0\.1:1 cannot be reached"):
        compare_policies(workload, ["http://127.0.0.1:1"], ["kv-aware"], run)
