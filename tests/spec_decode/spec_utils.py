"""Helpers for the speculative-decoding tests: engines with a drafter on the tiny model, and
the checkpoints (fixtures, imported by the test modules: a conftest.py here would shadow
tests/server's, which its tests import by name)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from rackserve.engine.core import EngineCore
from rackserve.engine.outputs import EngineCoreRequest
from rackserve.kv.spec import plan_num_blocks
from rackserve.model.create import create_checkpoint
from rackserve.model.presets import tiny_config
from rackserve.request import SamplingParams
from rackserve.spec_decode.checkpoint import spec_cache_groups


def spec_engine(
    model_dir: Path,
    spec: SpecConfig | None,
    max_num_seqs: int = 32,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 1024,
    kv_cache_memory: int | None = None,
    enable_prefix_caching: bool = True,
    device: str = "cpu",
    enforce_eager: bool = False,
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
        device=device,
        dtype="float32",
        enforce_eager=enforce_eager,
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


def mixed_params_prompts() -> tuple[dict[str, list[int]], dict[str, SamplingParams]]:
    """Three requests: greedy, seeded top-k, seeded top-p (lengths that end apart)."""
    prompts = {"a": [5, 9, 300, 4, 71], "b": list(range(20, 60)), "c": [8] * 12}
    params = {
        "a": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        "b": SamplingParams(temperature=0.9, top_k=40, seed=3, max_tokens=30, ignore_eos=True),
        "c": SamplingParams(temperature=1.2, top_p=0.9, seed=4, max_tokens=18, ignore_eos=True),
    }
    return prompts, params


VOCAB = 512


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """The tiny target, with its MTP layer (fp32)."""
    return create_checkpoint(
        tiny_config(vocab_size=VOCAB), tmp_path_factory.mktemp("target"), seed=3
    )


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory) -> Path:
    """An unrelated draft of other sizes (3 layers, 4 experts): it agrees with the target
    about as often as chance."""
    cfg = tiny_config(num_layers=3, num_experts=4, vocab_size=VOCAB)
    return create_checkpoint(cfg, tmp_path_factory.mktemp("random_draft"), seed=9, with_mtp=False)


@pytest.fixture(scope="session")
def close_draft_dir(target_dir, tmp_path_factory) -> Path:
    """The target with noise on its head: accepts some drafts, rejects others."""
    return perturbed_copy(target_dir, tmp_path_factory.mktemp("close_draft"), scale=0.6)
