"""Dispatch / combine: one rank and all-to-all over 2 and 4 gloo processes equal the
reference expert computation of one rank (fp32, 1e-5), for several placements."""

import pytest
import torch

from rackserve import ops
from rackserve.moe.dispatch import (
    AllToAllDispatcher,
    LocalDispatcher,
    run_local_experts,
)
from rackserve.moe.eplb import rebalance_experts
from rackserve.moe.placement import ExpertPlacement
from rackserve.moe.stats import ExpertLoadRecorder
from rackserve.parallel.launch import run_ranks

E, D, WIDTH, K, LIMIT = 8, 16, 8, 3, 7.0


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * WIDTH, D, generator=gen) * 0.3, torch.randn(
        E, D, WIDTH, generator=gen
    ) * 0.3


def _batch(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, D, generator=gen)
    ids = torch.rand(num_tokens, E, generator=gen).topk(K, dim=1).indices
    weights = torch.rand(num_tokens, K, generator=gen)
    return x, ids, weights


def _placements(num_ranks: int) -> list[ExpertPlacement]:
    """Default, rebalanced with one redundant copy per rank, and a shuffled one (2 layers)."""
    load = torch.tensor([[50.0, 1, 1, 30, 2, 2, 9, 5], [1.0, 1, 1, 1, 1, 1, 1, 40]])
    shuffled = torch.stack(
        [torch.randperm(E, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    )
    return [
        ExpertPlacement.default(2, E, num_ranks),
        rebalance_experts(load, E + num_ranks, 1, 1, num_ranks),
        ExpertPlacement.from_physical_to_logical(shuffled, E, num_ranks),
    ]


def _local_weights(placement, layer, rank, w13, w2):
    slots = placement.physical_to_logical[layer].view(placement.num_ranks, -1)[rank]
    return w13[slots], w2[slots]


def test_local_dispatch_equals_reference():
    w13, w2 = _weights()
    x, ids, weights = _batch(37, seed=1)
    expected = ops.moe_experts(x, ids, weights, w13, w2, LIMIT)
    load = torch.tensor([[9.0, 1, 1, 1, 1, 1, 1, 1]])
    for placement in (ExpertPlacement.default(1, E, 1), rebalance_experts(load, E + 3, 1, 1, 1)):
        dispatcher = LocalDispatcher(placement)
        routed = dispatcher.dispatch(0, x, ids, weights)
        assert routed.hidden.shape == (37 * K, D)
        out = dispatcher.combine(
            run_local_experts(routed, *_local_weights(placement, 0, 0, w13, w2), LIMIT), routed
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bad_input_is_a_clear_error():
    dispatcher = LocalDispatcher(ExpertPlacement.default(1, E, 1))
    with pytest.raises(ValueError, match="topk_ids"):
        dispatcher.dispatch(
            0, torch.zeros(4, D), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3)
        )
    with pytest.raises(ValueError, match="one-rank"):
        LocalDispatcher(ExpertPlacement.default(1, E, 2))


def _dispatch_worker(groups) -> dict:
    """Every rank routes its own batch (rank 1's is empty: an idle DP rank) through each
    placement and compares with the reference on its own batch."""
    rank = groups.ep_rank
    w13, w2 = _weights()
    num_tokens = 0 if rank == 1 else 5 + 7 * rank
    x, ids, weights = _batch(num_tokens, seed=10 + rank)
    errors = []
    for placement in _placements(groups.ep_size):
        dispatcher = AllToAllDispatcher(placement, groups.ep_group)
        recorder = ExpertLoadRecorder(2, E, placement.num_slots)
        for layer in range(2):
            expected = ops.moe_experts(x, ids, weights, w13, w2, LIMIT)
            routed = dispatcher.dispatch(layer, x, ids, weights)
            local = _local_weights(placement, layer, rank, w13, w2)
            out = dispatcher.combine(run_local_experts(routed, *local, LIMIT), routed)
            errors.append(float((out - expected).abs().max()) if num_tokens else 0.0)
            assert out.shape == (num_tokens, D)
            recorder.record(layer, ids, torch.zeros_like(ids))
        recorder.next_step()
        total = recorder.logical_load(groups.ep_group)
    return {"errors": errors, "total_tokens": int(total.sum())}


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_dispatch_equals_one_rank(world_size):
    results = run_ranks(_dispatch_worker, world_size)
    tokens = sum(0 if r == 1 else 5 + 7 * r for r in range(world_size))
    for result in results:
        assert len(result["errors"]) == 6
        assert max(result["errors"]) < 1e-5
        # The load all-reduce over EP sees every rank's tokens (2 layers x k choices).
        assert result["total_tokens"] == tokens * K * 2
