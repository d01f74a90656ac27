"""bench replay: the request set, the copies' start times, and the summary (no server)."""

import pytest

from rackserve.bench.client import RequestTimeline
from rackserve.bench.replay import ReplayConfig, request_set, summarize_replay


def test_copies_start_together_or_lagged():
    mirror = ReplayConfig(mode="mirror", num_ranks=4, lag_s=5)
    lag = ReplayConfig(mode="lag", num_ranks=4, lag_s=5)
    assert [mirror.start_offset(r) for r in range(4)] == [0, 0, 0, 0]
    assert [lag.start_offset(r) for r in range(4)] == [0, 5, 10, 15]
    with pytest.raises(ValueError, match="--mode"):
        ReplayConfig(mode="burst")
    with pytest.raises(ValueError, match="--lag-s"):
        ReplayConfig(lag_s=-1)


def test_every_copy_replays_the_same_requests():
    config = ReplayConfig(num_prompts=3, input_len=20, output_len=4, seed=7)
    first, again = request_set(config), request_set(config)
    assert first == again and len(first) == 3
    assert len({r.messages[0]["content"] for r in first}) == 3  # distinct prompts
    assert all(r.max_tokens == 4 for r in first)


def test_summary_counts_tokens_over_the_wall_time():
    config = ReplayConfig(mode="lag", num_ranks=2, lag_s=1.0)

    def timeline(end: float, ok: bool = True) -> RequestTimeline:
        return RequestTimeline(
            tag="p",
            send_time=0.0,
            end_time=end,
            chunk_times=(end,) if ok else (),
            prompt_tokens=10,
            completion_tokens=5,
        )

    result = summarize_replay(config, [[timeline(2.0)], [timeline(4.0), timeline(3, False)]], 0.0)
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["total_tokens"] == 30
    assert result["throughput_tok_s"] == pytest.approx(30 / 4.0)
    assert [c["duration_s"] for c in result["copies"]] == [2.0, 3.0]  # copy 1 began at 1 s
