"""Defaults are written once: the serve CLI, the config dataclasses and docs/serving.md agree."""

from __future__ import annotations

import re
from pathlib import Path

from rackserve.config import CPU_KV_CACHE_MEMORY, CacheConfig, EngineConfig, SchedulerConfig
from rackserve.server.options import SERVE_DEFAULTS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def flag_defaults() -> dict[str, str]:
    """docs/serving.md's flag table: ``--flag`` -> its default cell."""
    rows = re.findall(r"^\| `(--[a-z-]+)`[^|]* \| ([^|]*) \|", DOCS.read_text(), re.MULTILINE)
    return {flag: default.strip() for flag, default in rows}


def test_serve_defaults_are_the_config_defaults():
    cache, scheduler, engine = CacheConfig(), SchedulerConfig(), EngineConfig.__dataclass_fields__
    assert SERVE_DEFAULTS["kv_cache_memory"] == cache.kv_cache_memory
    assert SERVE_DEFAULTS["gpu_memory_utilization"] == cache.gpu_memory_utilization
    assert SERVE_DEFAULTS["enable_prefix_caching"] == cache.enable_prefix_caching
    assert SERVE_DEFAULTS["max_num_seqs"] == scheduler.max_num_seqs
    assert SERVE_DEFAULTS["max_num_batched_tokens"] == scheduler.max_num_batched_tokens
    assert SERVE_DEFAULTS["scheduling_policy"] == scheduler.policy
    assert SERVE_DEFAULTS["seed"] == engine["seed"].default
    timeout = engine["structured_output_timeout_s"].default
    assert SERVE_DEFAULTS["structured_output_timeout_s"] == timeout
    assert flag_defaults()["--structured-output-timeout-s"] == f"{timeout:g}"


def test_docs_state_the_defaults():
    docs = flag_defaults()
    assert docs["--max-num-seqs"] == str(SchedulerConfig().max_num_seqs)
    assert docs["--max-num-batched-tokens"] == str(SchedulerConfig().max_num_batched_tokens)
    utilization = CacheConfig().gpu_memory_utilization
    assert docs["--gpu-memory-utilization"] == str(utilization)
    kv = docs["--kv-cache-memory"]
    assert f"{round(utilization * 100)}% of the GPU's total memory" in kv
    assert f"CPU: {CPU_KV_CACHE_MEMORY >> 20} MiB" in kv
    assert "sha256" in DOCS.read_text() and CacheConfig().prefix_caching_hash_algo == "sha256"
