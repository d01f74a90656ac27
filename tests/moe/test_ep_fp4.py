"""Expert parallelism with FP4 experts (2 gloo ranks, fp32 compute, CPU): each rank holds
its slots' packed e2m1 weights and their scales, the logits equal the single-rank FP4
model's, and an EPLB rearrangement moves a slot's packed bytes and scales together (the
logits stay equal after experts crossed ranks). Both scale formats: ue8m0 (uint8, like the
packed bytes) and float32 (the move carries mixed dtypes as raw bytes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rackserve.config import EPLBConfig, QuantConfig
from rackserve.model.create import create_checkpoint
from rackserve.model.generate import ContiguousCache
from rackserve.model.loader import load_model
from rackserve.model.presets import tiny_config
from rackserve.moe.ep import ExpertParallel, expert_tensors
from rackserve.moe.rearrange import _rows
from rackserve.parallel.groups import ParallelGroups
from rackserve.parallel.launch import run_ranks

NUM_EXPERTS = 8
NUM_LAYERS = 2


def fp4_checkpoint(tmp_path: Path, scale_fmt: str) -> str:
    cfg = tiny_config(num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, vocab_size=512)
    cfg = dataclasses.replace(cfg, quantization=QuantConfig(scale_fmt=scale_fmt))
    return str(create_checkpoint(cfg, tmp_path, seed=5, with_mtp=False))


def _logits(model) -> torch.Tensor:
    """Logits [T, V] of a fixed 24-token prefill."""
    ids = torch.randint(2, 512, (24,), generator=torch.Generator().manual_seed(1))
    cache = ContiguousCache(model, 1, 25)
    with torch.inference_mode():
        hidden, _ = model(ids, cache.batch([0], [24], [0]), cache.tensors)
        return model.compute_logits(hidden)


def _held_as_single_rank(ep: ExpertParallel, model, single) -> bool:
    """Every local slot's packed weights and scales are its logical expert's (single rank)."""
    for layer in range(NUM_LAYERS):
        mine = expert_tensors(model.model.layers[layer].ffn.experts)
        full = expert_tensors(single.model.layers[layer].ffn.experts)
        for slot, expert in enumerate(ep.local_experts(layer)):
            if not all(torch.equal(m[slot], f[expert]) for m, f in zip(mine, full, strict=True)):
                return False
    return True


def fp4_worker(groups: ParallelGroups, model_dir: str) -> dict:
    eplb = EPLBConfig(window_size=4, step_interval=10_000)
    ep = ExpertParallel(NUM_LAYERS, NUM_EXPERTS, NUM_EXPERTS, groups, eplb=eplb)
    model = load_model(model_dir, expert_parallel=ep)
    single = load_model(model_dir)
    experts = model.model.layers[0].ffn.experts
    before = _logits(model)
    held_before = _held_as_single_rank(ep, model, single)
    # experts 0 and 1 (both on rank 0 by default) take nearly every token: the
    # rebalance splits them, so packed rows and scales cross ranks
    ids = torch.tensor([[0], [1]] * 20 + [[2], [3]])
    for layer in range(NUM_LAYERS):
        ep.recorder.record(layer, ids, ids, ep.placement)
    ep.end_step()
    ep.rebalance()
    while ep.rearranging:
        ep.end_step()
    return {
        "fp4": experts.fp4,
        "packed": (experts.w13.dtype, tuple(experts.w13.shape)),
        "scale_dtype": experts.w13_scale.dtype,
        "held_before": held_before,
        "held_after": _held_as_single_rank(ep, model, single),
        "local_after": [ep.local_experts(layer) for layer in range(NUM_LAYERS)],
        "before": before.numpy(),  # numpy: a tensor crosses processes by a shared fd
        "after": _logits(model).numpy(),
        "single": _logits(single).numpy(),
    }


# float32 scales take the byte path of the move (also unit-tested below): slow only
@pytest.mark.parametrize("scale_fmt", ["ue8m0", pytest.param("float", marks=pytest.mark.slow)])
def test_fp4_experts_sharded_and_rearranged(tmp_path, scale_fmt):
    results = run_ranks(fp4_worker, 2, fp4_checkpoint(tmp_path, scale_fmt))
    for rank, got in enumerate(results):
        assert got["fp4"] and got["packed"][0] == torch.uint8
        assert got["packed"][1][0] == NUM_EXPERTS // 2  # half the slots per rank
        assert got["scale_dtype"] == (torch.uint8 if scale_fmt == "ue8m0" else torch.float32)
        single = torch.from_numpy(got["single"])
        for when in ("before", "after"):
            torch.testing.assert_close(torch.from_numpy(got[when]), single, rtol=1e-5, atol=1e-5)
        assert got["held_before"] and got["held_after"], rank
    # the hot experts 0 and 1 now live on different ranks in every layer
    for layer in range(NUM_LAYERS):
        homes = [set(r["local_after"][layer]) for r in results]
        assert not {0, 1} <= homes[0] and not {0, 1} <= homes[1], homes


def test_mixed_dtype_rows_travel_as_bytes():
    """A slot's fp32 scales beside its uint8 bytes: one row of raw bytes, split back exact."""
    packed = torch.randint(0, 256, (3, 4, 6), dtype=torch.uint8)
    scale = torch.randn(3, 4, 2)
    rows = _rows([packed, scale], [2, 0])
    assert rows.dtype == torch.uint8 and rows.shape == (2, 4 * 6 + 4 * 2 * 4)
    assert torch.equal(rows[0, :24], packed[2].flatten())
    assert torch.equal(rows[1, 24:].contiguous().view(torch.float32), scale[0].flatten())
    same = _rows([packed, packed], [1])  # one dtype: rows as they are
    assert same.dtype == torch.uint8 and same.shape == (1, 48)
    assert _rows([packed, scale], []).shape == (0, 56)


def test_expert_tensors_lists_scales_with_fp4(tmp_path: Path):
    cfg = tiny_config(num_layers=1, num_experts=4, vocab_size=512)
    cfg = dataclasses.replace(cfg, quantization=QuantConfig())
    from rackserve.model.moe import Experts
    from rackserve.ops import kernels

    fp4 = Experts(cfg, kernels("reference"))
    assert [t.dtype for t in expert_tensors(fp4)] == [torch.uint8] * 4
    plain = Experts(dataclasses.replace(cfg, quantization=None), kernels("reference"))
    assert [tuple(t.shape[1:]) for t in expert_tensors(plain)] == [
        tuple(plain.w13.shape[1:]),
        tuple(plain.w2.shape[1:]),
    ]
