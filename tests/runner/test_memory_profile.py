"""``runner/memory_profile.py``: what the KV budget leaves for a runner's steps and graphs."""

from __future__ import annotations

import gc

import pytest
import torch

from rackserve.kv.spec import cache_groups_for
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.memory_profile import (
    graph_capture_bytes,
    graph_outputs_bytes,
    run_synthetic_prefill,
    runner_reserve_bytes,
    step_peak_bytes,
)


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> DeepseekV4ForCausalLM:
    with torch.device(device):
        model = DeepseekV4ForCausalLM(preset_config("tiny"), with_mtp=False)
    init_model_(model.cast(dtype), seed=0)
    return model.eval()


def _groups(model: DeepseekV4ForCausalLM):
    size = model.head.weight.element_size()
    return cache_groups_for(model.cfg, size, size)


def test_synthetic_prefill_runs_the_runner_step():
    """The profiled step is a real one: a prefill of that many tokens through its sampled
    row's logits, with model-dtype and fp8 caches; nothing to measure off a GPU."""
    model = _model()
    for kv_dtype in (None, torch.float8_e4m3fn):
        logits = run_synthetic_prefill(model, 37, kv_dtype)
        assert logits.shape == (1, model.cfg.vocab_size) and logits.isfinite().all()
    assert step_peak_bytes(model, 37) == 0
    assert graph_capture_bytes(model, _groups(model), 8, 256, 128) == (0, 0)
    assert runner_reserve_bytes(model, _groups(model), 8, 256, 128, graphs=True) == 0


def test_graph_outputs_bytes():
    """Prefill graphs (every 256 tokens up to the step's size) keep their hidden states per
    context bucket they serve (up to 65536); the decode graphs one [largest size, V] fp32."""
    model = _model()
    cfg = model.cfg
    hidden = (256 + 512) * cfg.hidden_size * 4  # fp32 weights: 4-byte hidden states
    logits = 16 * cfg.vocab_size * 4  # graph sizes for 12 requests: ..., 16
    # context buckets 4096 and 8192: both served
    assert graph_outputs_bytes(model, 12, 8192, 400) == 2 * hidden + logits
    # 4096, 16384, 65536 served; 100000 (max_model_len) not
    assert graph_outputs_bytes(model, 12, 100_000, 400) == 3 * hidden + logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_step_peak_grows_with_the_step_and_repeats():
    """On a GPU the peak is measured: larger for a larger step, the same when repeated."""
    model = _model("cuda", torch.bfloat16)
    small, large = step_peak_bytes(model, 256), step_peak_bytes(model, 2048)
    assert 0 < small < large
    assert abs(step_peak_bytes(model, 2048) - large) <= 0.05 * large
    eager_only = runner_reserve_bytes(model, _groups(model), 64, 4096, 2048, graphs=False)
    assert abs(eager_only - large) <= 0.05 * large


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reserve_covers_the_runners_graphs():
    """The graphs' capture is measured, and freed: the runner's own graphs (on its real
    cache: its memory less an eager runner's) keep no more than the profile measured, and
    the reserve covers them beside the eager step's peak."""
    from rackserve.runner.model_runner import ModelRunner

    model = _model("cuda", torch.bfloat16)
    groups = _groups(model)

    def reserved() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    start = reserved()
    held, peak = graph_capture_bytes(model, groups, 64, 4096, 2048)
    assert 0 < held <= peak
    # freed, but for cuBLAS's workspaces of the warm-up and capture streams (32 MiB each,
    # and a 2 MiB segment each for its small blocks)
    assert reserved() - start <= (64 + 8) << 20, "the profile's capture was not freed"
    eager = step_peak_bytes(model, 2048)
    reserve = runner_reserve_bytes(model, groups, 64, 4096, 2048, graphs=True)
    want = max(peak, held + eager)
    assert abs(reserve - want) <= 0.05 * want, (reserve / 2**20, want / 2**20)

    def runner_bytes(enforce_eager: bool) -> int:
        before = reserved()
        runner = ModelRunner(
            model, groups, {g.name: 64 for g in groups}, 64, 4096, (0,), log=False,
            enforce_eager=enforce_eager, max_num_batched_tokens=2048,
        )  # fmt: skip
        assert (runner.graphs is None) == enforce_eager
        used = reserved() - before
        del runner
        gc.collect()
        return used

    graphs = runner_bytes(False) - runner_bytes(True)
    assert graphs <= 1.05 * held + (8 << 20), (graphs / 2**20, held / 2**20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captures_into_one_pool_reserve_one_region_twice():
    """Six captures of a region with a 64 MB temporary into one pool: the pool holds one
    temporary (each capture reuses the last one's), the warm-ups another (one stream for
    all of them; a new stream a warm-up kept six), and release_warm_up_memory gives the
    warm-ups' back."""
    from rackserve.runner.cuda_graph import capture_region, release_warm_up_memory

    size = 64 << 20

    def region() -> torch.Tensor:
        tmp = torch.ones(size, dtype=torch.uint8, device="cuda")
        return tmp[:4096].float()

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool, graphs = None, []
    for _ in range(6):
        graph, out = capture_region(region, pool)
        pool = pool or graph.pool()
        graphs.append((graph, out))
    grown = torch.cuda.memory_reserved() - before
    assert grown <= 2 * size + (16 << 20), grown / 2**20
    release_warm_up_memory()
    assert torch.cuda.memory_reserved() - before <= size + (16 << 20)
    graphs[-1][0].replay()
    assert torch.equal(graphs[-1][1], torch.ones(4096, device="cuda"))
