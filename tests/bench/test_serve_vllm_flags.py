"""``bench serve`` with `vllm bench serve`'s flags and result fields; exact prompt lengths."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rackserve.bench.client import RequestTimeline
from rackserve.bench.serve import (
    ServeConfig,
    exact_text,
    goodput_ok,
    max_concurrent_requests,
    max_output_tokens_per_s,
)
from rackserve.bench.workloads import HFTokenCounter
from rackserve.cli import main


def test_exact_prompt_lengths_with_a_real_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from rackserve.model.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, 1000)
    counter = HFTokenCounter(AutoTokenizer.from_pretrained(tmp_path))
    rng = random.Random(0)
    for n in (1, 2, 7, 33, 128, 501):
        text = exact_text(rng, n, str(n), counter)
        assert counter.count(text) == n, n


def timeline(send: float, ttft: float, end: float, tokens: int) -> RequestTimeline:
    step = (end - send - ttft) / max(tokens - 1, 1)
    chunks = tuple(send + ttft + k * step for k in range(tokens))
    return RequestTimeline("t", send, end, chunks, 10, tokens)


def test_goodput_concurrency_and_peak_rate() -> None:
    fast = timeline(0.0, 0.1, 1.0, 10)  # ttft 100 ms, tpot 100 ms
    slow = timeline(0.5, 0.9, 2.0, 10)
    assert goodput_ok(fast, [("ttft", 200), ("tpot", 150)])
    assert not goodput_ok(slow, [("ttft", 200)])
    assert max_concurrent_requests([fast, slow, timeline(3.0, 0.1, 4.0, 2)]) == 2
    assert max_output_tokens_per_s([fast]) == 9.0  # 9 of 10 chunks in second 0


def test_vllm_flags_and_fields(fake_server, tmp_path: Path) -> None:
    argv = [
        "bench", "serve", "--base-url", fake_server.base_url, "--backend", "openai",
        "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "20",
        "--random-output-len", "4", "--max-concurrency", "2", "--ignore-eos",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
        "--goodput", "ttft:60000", "e2el:60000", "--num-warmups", "2", "--label", "run-a",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["endpoint_type"] == "openai" and result["label"] == "run-a"
    assert result["tokenizer_id"] == "fake-model"
    assert result["completed"] == 6 and result["request_goodput"] > 0
    assert result["max_concurrent_requests"] == 2 and result["max_output_tokens_per_s"] > 0
    assert "p99_ttft_ms" in result and "p50_e2el_ms" in result and "p99_itl_ms" not in result
    assert len(fake_server.state.payloads) == 6 + 2  # the warmups were sent too


def test_default_result_filename(fake_server, tmp_path: Path) -> None:
    argv = [
        "bench", "serve", "--base-url", fake_server.base_url, "--num-prompts", "1",
        "--random-input-len", "5", "--random-output-len", "2", "--save-result",
        "--result-dir", str(tmp_path), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("openai-chat-infqps-fake-model-")


def test_bad_goodput_is_refused() -> None:
    import pytest

    from rackserve.config import ConfigError

    with pytest.raises(ConfigError, match="goodput"):
        ServeConfig(goodput=(("latency", 5.0),))
