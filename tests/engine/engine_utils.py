"""Helpers for engine tests: configs, a KV budget for a target capacity, a driving loop."""

from __future__ import annotations

import time
from pathlib import Path

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import cache_groups_for, plan_num_blocks
from rackserve.request import SamplingParams


def budget_for_tokens(
    model_dir: Path, tokens: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """KV bytes whose full-history groups hold about ``tokens`` tokens (fp32 cache)."""
    groups = cache_groups_for(ModelConfig.from_pretrained(model_dir), dtype_bytes=4)
    minimum = plan_num_blocks(groups, 1 << 40, max_num_seqs, max_num_batched_tokens)
    sliding = sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
    full = [g for g in groups if not g.is_sliding]
    return int(
        sliding
        + sum(2 * g.bytes_per_block for g in full)
        + tokens * sum(g.bytes_per_token for g in full)
    )


def make_engine(
    model_dir: Path,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 2048,
    kv_tokens: int | None = None,
    **cache_kwargs,
) -> EngineCore:
    kv = None
    if kv_tokens is not None:
        kv = budget_for_tokens(model_dir, kv_tokens, max_num_seqs, max_num_batched_tokens)
    config = EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=kv, **cache_kwargs),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        device="cpu",
    )
    return EngineCore(config, log_stats=False)


def run_to_completion(
    core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Submit every prompt at once and step until all finish; returns output token ids."""
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    outputs: dict[str, list[int]] = {req_id: [] for req_id in prompts}
    for _ in range(100_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            outputs[out.request_id] += out.new_token_ids
    assert not core.has_unfinished_requests()
    return outputs
