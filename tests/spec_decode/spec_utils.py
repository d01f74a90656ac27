"""Helpers for the speculative-decoding tests: engines with a drafter on the tiny model."""

from __future__ import annotations

import time
from pathlib import Path

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.request import SamplingParams


def spec_engine(
    model_dir: Path,
    spec: SpecConfig | None,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 1024,
    kv_cache_memory: int | None = None,
    enable_prefix_caching: bool = True,
) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(
            kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        device="cpu",
        speculative=spec,
    )
    return EngineCore(config, log_stats=False)


def run(
    core: EngineCore,
    prompts: dict[str, list[int]],
    params: SamplingParams | dict[str, SamplingParams],
) -> dict[str, list[int]]:
    """Submit every prompt at once and step until all finish; output token ids."""
    for req_id, ids in prompts.items():
        p = params[req_id] if isinstance(params, dict) else params
        core.add_request(EngineCoreRequest(req_id, ids, p, time.time()))
    outputs: dict[str, list[int]] = {req_id: [] for req_id in prompts}
    for _ in range(100_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            outputs[out.request_id] += out.new_token_ids
    assert not core.has_unfinished_requests()
    return outputs
