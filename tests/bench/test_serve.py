"""``bench serve``: request generation, arrivals, and a run with vLLM-named results."""

from __future__ import annotations

import math

import pytest

from rackserve.bench.serve import ServeConfig, arrival_offsets, random_requests, run_serve
from rackserve.config import ConfigError

VLLM_FIELDS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "request_rate",
    "max_concurrency",
    "num_prompts",
    "model_id",
)


def test_random_requests_are_seeded_and_in_range() -> None:
    config = ServeConfig(num_prompts=50, input_len=40, output_len=10, range_ratio=0.5)
    requests = random_requests(config)
    assert requests == random_requests(config)
    assert requests != random_requests(ServeConfig(**{**config.__dict__, "seed": 1}))
    for i, request in enumerate(requests):
        words = request.messages[0]["content"].split()
        assert words[0] == str(i)  # unique first token: no shared prefixes
        assert 20 <= len(words) <= 60 and 5 <= request.max_tokens <= 15
    fixed = random_requests(ServeConfig(num_prompts=3, input_len=40, output_len=10))
    assert {len(r.messages[0]["content"].split()) for r in fixed} == {40}


def test_poisson_arrivals() -> None:
    assert arrival_offsets(ServeConfig(num_prompts=4)) == [0.0] * 4
    offsets = arrival_offsets(ServeConfig(num_prompts=4000, request_rate=50.0))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(1 / 50, rel=0.06)


def test_run_serve_against_the_fake_server(fake_server) -> None:
    config = ServeConfig(
        num_prompts=12,
        input_len=30,
        output_len=6,
        max_concurrency=3,
        percentiles=(50, 99),
        save_detailed=True,
        progress=False,
    )
    result = run_serve(config, fake_server.base_url)
    assert set(VLLM_FIELDS) <= result.keys()
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 6
    # chat prompts count one <role> marker per message and the <assistant> generation prompt
    assert result["total_input_tokens"] == 12 * (30 + 2)
    assert result["request_rate"] == "inf" and result["model_id"] == "fake-model"
    assert fake_server.state.max_in_flight <= 3
    assert len(result["itls"]) == 12 and all(len(itl) == 5 for itl in result["itls"])
    assert result["p50_ttft_ms"] <= result["p99_ttft_ms"]


def test_request_rate_paces_the_run(fake_server) -> None:
    config = ServeConfig(
        num_prompts=10, input_len=8, output_len=2, request_rate=20.0, progress=False
    )
    result = run_serve(config, fake_server.base_url, model="fake-model")
    assert result["completed"] == 10
    assert result["duration"] >= arrival_offsets(config)[-1]
    assert "itls" not in result  # only with save_detailed


@pytest.mark.parametrize(
    "change",
    [{"num_prompts": 0}, {"range_ratio": 1.0}, {"request_rate": 0.0}, {"max_concurrency": 0}],
)
def test_invalid_serve_configs(change: dict) -> None:
    with pytest.raises(ConfigError):
        ServeConfig(**change)
    assert math.isinf(ServeConfig().request_rate)
