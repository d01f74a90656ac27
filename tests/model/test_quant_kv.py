"""``kv_cache_dtype = "fp8"``: the KV caches (window rows, compressed entries with their
indexer keys) stored in float8 e4m3 (unscaled, as vLLM's default), the compressor state in
the model dtype. Its accuracy effect on the tiny model (fp32, CPU): the logits of a prefill
and decode steps against the same model with model-dtype caches."""

from __future__ import annotations

import pytest
import torch

from rackserve.config import CacheConfig, ConfigError
from rackserve.model.batch import KVCacheTensors
from rackserve.model.create import create_checkpoint
from rackserve.model.generate import ContiguousCache
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config

# Measured (tiny, fp32, 100-token prefill + 40 decode steps, seed 2/3): mean |logit diff|
# 2.7e-2 of the mean |logit|; max over all positions 0.25 of the logit scale (median per
# position 1.2e-2): the outliers are indexer top-k picks that flip when the keys are
# rounded; argmax agrees at 93.6% of positions. For scale, bf16 caches: 1.5e-3 mean,
# 0.064 max, 99.3% agreement. Bounds with headroom:
FP8_KV_MEAN_ERROR = 5e-2
FP8_KV_MAX_ERROR = 0.35
FP8_KV_ARGMAX_AGREEMENT = 0.85


def run(model, ids: torch.Tensor, kv_dtype: torch.dtype | None) -> torch.Tensor:
    """A 100-token prefill, then one token per step; logits [len(ids), V]."""
    cache = ContiguousCache(model, 1, len(ids))
    blocks = {name: 1 + t.numel() for name, t in cache.block_tables.items()}  # + null block
    cache.tensors = KVCacheTensors(cache.groups, blocks, torch.float32, "cpu", kv_dtype)
    logits, done = [], 0
    with torch.inference_mode():
        for n in [100] + [1] * (len(ids) - 100):
            hidden, _ = model(ids[done : done + n], cache.batch([done], [n], [0]), cache.tensors)
            logits.append(model.compute_logits(hidden))
            done += n
    if kv_dtype is not None:
        assert cache.tensors.tensors["swa"][0].dtype == kv_dtype
        assert cache.tensors.tensors["csa_state"][1].dtype == torch.float32
    return torch.cat(logits)


def test_fp8_kv_cache_logit_error(tmp_path):
    model = load_model(create_checkpoint(tiny_config(vocab_size=512), tmp_path, seed=2))
    ids = torch.randint(2, 512, (140,), generator=torch.Generator().manual_seed(3))
    ref = run(model, ids, None)
    fp8 = run(model, ids, torch.float8_e4m3fn)
    diff = (fp8 - ref).abs()
    mean, worst = (diff.mean() / ref.abs().mean()).item(), (diff.max() / ref.abs().max()).item()
    agree = (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"fp8 KV: mean {mean:.2e}, max {worst:.2e} of the logit scale, argmax {agree:.3f}")
    assert 0 < mean <= FP8_KV_MEAN_ERROR and worst <= FP8_KV_MAX_ERROR
    assert agree >= FP8_KV_ARGMAX_AGREEMENT


def test_kv_cache_dtype_is_checked():
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")


def test_llm_with_fp8_kv_cache(tmp_path):
    from rackserve.llm import LLM
    from rackserve.request import SamplingParams

    path = create_checkpoint(tiny_config(num_layers=3, vocab_size=512), tmp_path, seed=1)
    llm = LLM(str(path), kv_cache_dtype="fp8", max_num_seqs=2, max_model_len=256)
    caches = llm.engine.runner.caches.tensors
    assert caches["swa"][0].dtype == torch.float8_e4m3fn
    out = llm.generate("hello there", SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
