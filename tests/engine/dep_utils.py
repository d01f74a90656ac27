"""Helpers for the DEP engine tests: a tiny 2-layer checkpoint, configs, prompts, and the
one-rank reference."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rackserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams

KV_BYTES = 24 << 20
MAX_TOKENS = 6


def create_model(out: Path) -> Path:
    # 2 layers (one hash MoE, one learned), 8 experts: the smallest model with both routers.
    cfg = tiny_config(num_layers=2, num_experts=8, vocab_size=512)
    return create_checkpoint(cfg, out, seed=3, with_mtp=False)


def engine_config(model_dir: Path, parallel: ParallelConfig) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        model_config=ModelConfig.from_pretrained(model_dir),
        cache=CacheConfig(kv_cache_memory=KV_BYTES),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
        device="cpu",
        parallel=parallel,
    )


def prompts(num: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"r{i}": torch.randint(2, 512, (int(5 + 7 * i),), generator=gen).tolist()
        for i in range(num)
    }


def collect(core: EngineCore, requests: dict[str, list[int]], run) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    for req_id, ids in requests.items():
        core.add_request(EngineCoreRequest(req_id, ids, params, time.time()))
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    logprobs: dict[str, list[list[float]]] = {r: [] for r in requests}
    for step in run():
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprobs for lp in out.new_logprobs or []]
    return {"tokens": tokens, "logprobs": logprobs}


def single_rank(model_dir: Path, requests: dict[str, list[int]]) -> dict:
    core = EngineCore(engine_config(model_dir, ParallelConfig()), log_stats=False)

    def run():
        while core.has_unfinished_requests():
            yield core.step()

    return collect(core, requests, run)
