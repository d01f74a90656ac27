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
