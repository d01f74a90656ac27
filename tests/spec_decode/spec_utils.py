"""Helpers for the speculative-decoding tests: engines with a drafter on the tiny model."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import plan_num_blocks
from rackserve.request import SamplingParams
from rackserve.spec_decode.proposer import spec_cache_groups


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


def kv_budget(
    model_dir: Path,
    spec: SpecConfig | None,
    tokens: int,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 1024,
) -> int:
    """KV bytes whose full-history groups (target and drafter) hold about ``tokens``."""
    groups = spec_cache_groups(spec, ModelConfig.from_pretrained(model_dir), 4)
    minimum = plan_num_blocks(groups, 1 << 40, max_num_seqs, max_num_batched_tokens)
    sliding = sum(minimum[g.name] * g.bytes_per_block for g in groups if g.is_sliding)
    full = [g for g in groups if not g.is_sliding]
    per_token = sum(g.bytes_per_token for g in full)
    return int(sliding + sum(2 * g.bytes_per_block for g in full) + tokens * per_token)


def perturbed_copy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A draft close to the target: its checkpoint with noise on the output head."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    head = tensors["head.weight"]
    g = torch.Generator().manual_seed(seed)
    tensors["head.weight"] = head + scale * head.std() * torch.randn(head.shape, generator=g)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
