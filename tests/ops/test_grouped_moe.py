"""The grouped-GEMM routed experts (``ops/grouped_moe.py``, the prefill path on a GPU)
against ``reference.moe_experts``, on the CPU (``F.grouped_mm`` runs there in fp32)."""

from __future__ import annotations

import pytest
import torch

from rackserve.ops import grouped_moe, reference
from rackserve.ops.grouped_moe import moe_experts_grouped

from kernel_checks import assert_fp32_close


@pytest.mark.parametrize("by_token", [False, True])
@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (7, 8, 3), (33, 8, 2), (64, 16, 6)])
def test_grouped_moe_matches_reference(t, e, k, by_token, monkeypatch):
    """Both ways to the gate-up's rows (``PERMUTE_BY_TOKEN``)."""
    monkeypatch.setattr(grouped_moe, "PERMUTE_BY_TOKEN", by_token)
    g = torch.Generator().manual_seed(t * 100 + e)
    d, inter = 64, 32
    x = torch.randn(t, d, generator=g)
    # k distinct experts per token from the lower half only: the upper half gets no tokens
    hot = max(k, e // 2)
    ids = torch.stack([torch.randperm(hot, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    w13 = torch.randn(e, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(e, d, inter, generator=g) / inter**0.5
    got = moe_experts_grouped(x, ids, weights, w13, w2, 7.0)
    assert got.shape == (t, d)
    assert_fp32_close(got, reference.moe_experts(x, ids, weights, w13, w2, 7.0))


@pytest.mark.parametrize("apart", [None, "series", "beside"])
@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (33, 8, 2), (64, 16, 6)])
def test_shared_expert_apart_matches_reference(t, e, k, apart, monkeypatch):
    """``route_fused``'s layout, the shared expert (E - 1) every token's last pick at
    weight 1: run as one more group or apart (``SHARED_APART``: dense GEMMs over x, added
    as the combine's last slot), the reference's output."""
    monkeypatch.setattr(grouped_moe, "SHARED_APART", apart)
    monkeypatch.setattr(grouped_moe, "SHARED_APART_MIN_TOKENS", 1)
    g = torch.Generator().manual_seed(t * 10 + e)
    d, inter = 64, 32
    x = torch.randn(t, d, generator=g)
    routed = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])
    ids = torch.cat([routed, torch.full((t, 1), e - 1)], dim=1)
    weights = torch.cat([torch.rand(t, k, generator=g), torch.ones(t, 1)], dim=1)
    w13 = torch.randn(e, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(e, d, inter, generator=g) / inter**0.5
    expected = reference.moe_experts(x, ids, weights, w13, w2, 7.0)
    got = moe_experts_grouped(x, ids, weights, w13, w2, 7.0, shared_last=True)
    assert_fp32_close(got, expected)
    folded = moe_experts_grouped(x, ids, weights, w13, w2, 7.0)
    assert_fp32_close(got, folded)
    # the picks without the shared expert's column give another result: the apart path
    # does add it
    alone = moe_experts_grouped(x, routed, weights[:, :-1], w13, w2, 7.0)
    assert (got - alone).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_expert_apart_on_gpu(monkeypatch):
    """bf16 on the GPU: the shared expert apart (cuBLAS) within the bf16 rule of the fp32
    reference, as the folded group is; beside the routed experts (side stream) bitwise the
    same as in series."""
    monkeypatch.setattr(grouped_moe, "SHARED_APART_MIN_TOKENS", 1)
    g = torch.Generator().manual_seed(5)
    t, e, k, d, inter = 600, 9, 3, 512, 256
    routed = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])
    ids = torch.cat([routed, torch.full((t, 1), e - 1)], dim=1).cuda()
    weights = torch.cat([torch.rand(t, k, generator=g), torch.ones(t, 1)], dim=1).cuda()
    x32 = torch.randn(t, d, generator=g).cuda()
    w13_32 = (torch.randn(e, 2 * inter, d, generator=g) / d**0.5).cuda()
    w2_32 = (torch.randn(e, d, inter, generator=g) / inter**0.5).cuda()
    x, w13, w2 = (a.bfloat16() for a in (x32, w13_32, w2_32))
    exact = reference.moe_experts(x32, ids, weights, w13_32, w2_32, 7.0)
    own = (reference.moe_experts(x, ids, weights, w13, w2, 7.0).float() - exact).norm()
    out = {}
    for apart in (None, "series", "beside"):
        monkeypatch.setattr(grouped_moe, "SHARED_APART", apart)
        out[apart] = moe_experts_grouped(x, ids, weights, w13, w2, 7.0, shared_last=True)
        torch.cuda.synchronize()
        assert (out[apart].float() - exact).norm() <= 2 * own, apart
    assert torch.equal(out["series"], out["beside"])
