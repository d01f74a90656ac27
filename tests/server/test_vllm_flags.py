"""`rackserve serve` accepts `vllm serve`'s flags, spelled and meant as vLLM does, and
applies them (metrics prefix, max logprobs, request log, chat template, stats line)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import pytest
import torch
from test_api import AUTH

from rackserve.cli import build_parser
from rackserve.config import CacheConfig
from rackserve.engine.kv_budget import kv_budget_bytes
from rackserve.engine.output_processor import FinishedRequestStats, IterationStats
from rackserve.engine.outputs import SchedulerStats
from rackserve.server.metrics import ServerMetrics, StatsLogLine
from rackserve.server.options import (
    build_engine_config,
    check_block_size,
    load_chat_template,
    parse_count,
    resolve_options,
)

from conftest import API_KEY, MODEL_NAME, run_server


def options(*argv: str) -> dict:
    return resolve_options(build_parser().parse_args(["serve", *argv]))


def test_counts_as_vllm_reads_them() -> None:
    assert parse_count("8192") == 8192 and parse_count("32k") == 32000
    assert parse_count("32K") == 32768 and parse_count("1M") == 1 << 20
    assert parse_count("1m") == 10**6 and parse_count("25.6k") == 25600
    for bad in ("1.5K", "12x", "-3", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_count(bad)
    resolved = options("m", "--max-model-len", "32k", "--max-num-batched-tokens", "16K",
                       "--long-prefill-token-threshold", "1K")  # fmt: skip
    assert resolved["max_model_len"] == 32000 and resolved["max_num_batched_tokens"] == 16384
    assert resolved["long_prefill_token_threshold"] == 1024


@pytest.mark.parametrize(
    ("given", "dtype"),
    [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
     ("float", "float32"), ("float32", "float32"), ("auto", "auto")],
)  # fmt: skip
def test_dtype_names(given: str, dtype: str) -> None:
    assert options("m", "--dtype", given)["dtype"] == dtype


def test_bad_dtype_refused_at_parse_time(capsys) -> None:
    with pytest.raises(SystemExit):
        options("m", "--dtype", "float8")
    assert "invalid dtype 'float8'" in capsys.readouterr().err


def test_spellings_and_aliases(tmp_path: Path) -> None:
    resolved = options("m", "--max_model_len", "64", "--kv-cache-memory-bytes", "1G")
    assert resolved["max_model_len"] == 64 and resolved["kv_cache_memory"] == 1 << 30
    assert options("m", "--kv-cache-memory", "2M")["kv_cache_memory"] == 2 << 20
    assert options("m", "--gpu_memory_utilization", "0.5")["gpu_memory_utilization"] == 0.5
    config = tmp_path / "c.yaml"
    config.write_text("model: m\nkv-cache-memory-bytes: 8M\nmax_model_len: 4k\ndtype: half\n")
    resolved = options("--config", str(config))
    assert resolved["kv_cache_memory"] == 8 << 20 and resolved["max_model_len"] == 4000
    assert resolved["dtype"] == "float16"


def test_refused_combinations() -> None:
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        options("m", "--enable-auto-tool-choice")
    assert options("m", "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v4")
    with pytest.raises(ValueError, match="--max-logprobs"):
        options("m", "--max-logprobs", "50")
    with pytest.raises(ValueError, match="--metrics-prefix"):
        options("m", "--metrics-prefix", "prom")


def test_block_size_is_the_prefix_granularity(tiny_model: Path) -> None:
    config = build_engine_config(options(str(tiny_model)))
    granularity = check_block_size(options(str(tiny_model)), config.model_config)
    assert granularity >= 1
    assert check_block_size(
        options(str(tiny_model), "--block-size", str(granularity)), config.model_config
    )
    with pytest.raises(ValueError, match=f"multiples of {granularity} tokens"):
        build_engine_config(options(str(tiny_model), "--block-size", str(granularity + 1)))


def test_chat_template_file_or_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_gpu_memory_utilization_is_a_share_of_total(monkeypatch) -> None:
    """A per-instance share of the GPU's total memory, as in vLLM: memory other processes
    held before this instance loaded comes off neither its share nor its KV budget."""
    from rackserve.config import EngineConfig

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 100 * gib))
    config = EngineConfig.__new__(EngineConfig)
    object.__setattr__(config, "cache", CacheConfig(gpu_memory_utilization=0.9))
    # alone on the GPU: 90 GiB for the instance, 40 GiB in use (its weights): 50 GiB of KV
    assert kv_budget_bytes(config, torch.device("cuda")) == 50 * gib
    # a second engine beside one holding 30 GiB: 0.45 of 100 GiB, less its 10 GiB of weights
    object.__setattr__(config, "cache", CacheConfig(gpu_memory_utilization=0.45))
    assert kv_budget_bytes(config, torch.device("cuda"), in_use_at_start=30 * gib) == 35 * gib
    with pytest.raises(ValueError, match="were free at start"):  # 45 GiB asked, 40 free
        kv_budget_bytes(config, torch.device("cuda"), in_use_at_start=60 * gib)
    # the largest step's activations and the CUDA graphs come off the share too
    assert kv_budget_bytes(config, torch.device("cuda"), 30 * gib, reserve=4 * gib) == 31 * gib
    object.__setattr__(config, "cache", CacheConfig(gpu_memory_utilization=0.3))
    with pytest.raises(ValueError, match=r"weights take 40\.0 GiB"):
        kv_budget_bytes(config, torch.device("cuda"))
    object.__setattr__(config, "cache", CacheConfig(gpu_memory_utilization=0.45))
    with pytest.raises(ValueError, match=r"draft model 36\.0 GiB.*max-num-batched"):
        kv_budget_bytes(config, torch.device("cuda"), 30 * gib, reserve=36 * gib)


def test_stats_log_line() -> None:
    line = StatsLogLine(now=0.0)
    assert line.line(now=10.0) is None  # idle: quiet
    line.record_iteration(IterationStats(num_prompt_tokens=100, num_generation_tokens=50))
    line.record_scheduler_stats(
        SchedulerStats(2, 1, 0.25, prefix_cache_queries=200, prefix_cache_hits=150)
    )
    text = line.line(now=20.0)
    assert text == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
        "Prefix cache hit rate: 75.0%"
    )


def test_new_metric_series() -> None:
    metrics = ServerMetrics("m", prefix="vllm")
    metrics.set_cache_config_info(block_size=256, gpu_memory_utilization=0.9)
    metrics.record_request_params(2, 64)
    metrics.record_abort()
    metrics.record_scheduler_stats(SchedulerStats(1, 3))
    finished = FinishedRequestStats("stop", 10, 5, 2.0, prefill_time_s=0.5, decode_time_s=1.2)
    metrics.record_iteration(
        IterationStats(num_prompt_tokens=10, num_generation_tokens=5, num_cached_prompt_tokens=8,
                       finished=[finished])
    )  # fmt: skip
    text = metrics.render().decode()
    for series in (
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 1.0',
        'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 3.0',
        'vllm:prompt_tokens_cached_total{model_name="m"} 8.0',
        'vllm:request_params_n_sum{model_name="m"} 2.0',
        'vllm:request_params_max_tokens_sum{model_name="m"} 64.0',
        'vllm:iteration_tokens_total_sum{model_name="m"} 15.0',
        'vllm:request_prefill_time_seconds_sum{model_name="m"} 0.5',
        'vllm:request_decode_time_seconds_sum{model_name="m"} 1.2',
        'vllm:request_inference_time_seconds_sum{model_name="m"} 1.7',
        'vllm:request_time_per_output_token_seconds_sum{model_name="m"} 0.3',
    ):
        assert series in text, series
    assert 'vllm:cache_config_info{block_size="256"' in text
    assert "rackserve:" not in text


def test_flags_applied_by_a_server(tiny_model: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(
        "{{ bos_token }}CUSTOM{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    extra = (
        "--api-key", API_KEY, "--metrics-prefix", "vllm", "--max-logprobs", "2",
        "--enable-log-requests", "--chat-template", str(template), "--disable-log-stats",
    )  # fmt: skip
    with run_server(tiny_model, tmp_path, *extra) as server:
        base = server.base_url
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "logprobs": 3}
        response = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 400 and "--max-logprobs 2" in response.text
        body["logprobs"] = 2
        response = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=30)
        assert response.status_code == 200
        tokenized = httpx.post(
            f"{base}/tokenize",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "abc"}]},
            headers=AUTH,
        ).json()
        detokenized = httpx.post(
            f"{base}/detokenize", json={"tokens": tokenized["tokens"]}, headers=AUTH
        ).json()["prompt"]
        assert detokenized.endswith("CUSTOMabc")
        metrics = httpx.get(f"{base}/metrics").text
        assert "vllm:request_success_total" in metrics and "rackserve:" not in metrics
        assert httpx.head(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ping").status_code == 200
        card = httpx.get(f"{base}/v1/models/{MODEL_NAME}", headers=AUTH).json()
        assert card["id"] == MODEL_NAME and card["object"] == "model"
        assert httpx.get(f"{base}/v1/models/nope", headers=AUTH).status_code == 404
        assert httpx.head(f"{base}/v1/models", headers=AUTH).status_code == 200
        deadline = time.monotonic() + 5
        while "Received request" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "Received request cmpl-" in server.log()
