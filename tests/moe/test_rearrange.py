"""Rearrangement: the transfer plan (exact), and moving weights layer by layer over 2 gloo
processes while dispatch keeps giving the one-rank result at every step."""

import pytest
import torch
import torch.distributed as dist

from rackserve import ops
from rackserve.moe.dispatch import AllToAllDispatcher, LocalDispatcher, run_local_experts
from rackserve.moe.eplb import rebalance_experts
from rackserve.moe.placement import ExpertPlacement
from rackserve.moe.rearrange import ExpertRearranger, Transfer, plan_layer
from rackserve.parallel.launch import run_ranks

E, D, WIDTH, K, LIMIT, LAYERS = 8, 16, 8, 2, 7.0, 3


def test_plan_known_answer():
    # Ranks hold slots {0, 1, 2} and {3, 4, 5}.
    old = torch.tensor([0, 1, 2, 3, 4, 5])
    new = torch.tensor([0, 3, 1, 3, 4, 0])
    assert plan_layer(old, new, 2) == [
        Transfer(3, 1),  # expert 3 is only on rank 1: a remote copy
        Transfer(1, 2),  # expert 1 is already on rank 0: a local copy
        Transfer(0, 5),  # expert 0 comes from rank 0
    ]
    with pytest.raises(ValueError, match="no copy"):
        plan_layer(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 2, 1, 1]), 2)


def test_remote_copies_spread_over_replicas():
    old = torch.tensor([0, 0, 1, 2])  # expert 0 twice on rank 0, rank 1 holds {1, 2}
    new = torch.tensor([1, 2, 0, 0])  # rank 0 wants 1, 2; rank 1 wants two copies of 0
    assert plan_layer(old, new, 2) == [
        Transfer(2, 0),
        Transfer(3, 1),
        Transfer(0, 2),
        Transfer(1, 3),
    ]


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(LAYERS, E, 2 * WIDTH, D, generator=gen) * 0.3,
        torch.randn(LAYERS, E, D, WIDTH, generator=gen) * 0.3,
    )


def _local(placement: ExpertPlacement, rank: int, w13, w2) -> list[list[torch.Tensor]]:
    layers = []
    for layer in range(placement.num_layers):
        slots = placement.physical_to_logical[layer].view(placement.num_ranks, -1)[rank]
        layers.append([w13[layer, slots].clone(), w2[layer, slots].clone()])
    return layers


def _target(num_ranks: int) -> ExpertPlacement:
    load = torch.tensor([[50.0, 1, 1, 30, 2, 2, 9, 5], [1.0] * 8, [1.0, 1, 1, 1, 1, 1, 1, 40]])
    return rebalance_experts(load, E + 2 * num_ranks, 1, 1, num_ranks)


def test_single_rank_rearrangement():
    w13, w2 = _weights()
    current = ExpertPlacement.default(LAYERS, E, 1, E + 2)
    target = _target(1)
    dispatcher = LocalDispatcher(current)
    weights = _local(current, 0, w13, w2)
    rearranger = ExpertRearranger(weights, dispatcher)
    rearranger.start(target)
    while rearranger.step():
        pass
    assert torch.equal(dispatcher.placement.physical_to_logical, target.physical_to_logical)
    assert all(
        torch.equal(a, b)
        for la, lb in zip(weights, _local(target, 0, w13, w2), strict=True)
        for a, b in zip(la, lb, strict=True)
    )


def _rearrange_worker(groups) -> dict:
    rank, num_ranks = groups.ep_rank, groups.ep_size
    move_group = dist.new_group(list(range(num_ranks)))  # transfers beside the dispatch
    w13, w2 = _weights()
    current = ExpertPlacement.default(LAYERS, E, num_ranks, E + 2 * num_ranks)
    target = _target(num_ranks)
    dispatcher = AllToAllDispatcher(current, groups.ep_group)
    weights = _local(current, rank, w13, w2)
    rearranger = ExpertRearranger(weights, dispatcher, move_group)
    gen = torch.Generator().manual_seed(rank)
    errors, busy = [], []
    for step in range(6):
        x = torch.randn(6, D, generator=gen)
        ids = torch.rand(6, E, generator=gen).topk(K, dim=1).indices
        topk_weights = torch.rand(6, K, generator=gen)
        for layer in range(LAYERS):
            expected = ops.moe_experts(x, ids, topk_weights, w13[layer], w2[layer], LIMIT)
            routed = dispatcher.dispatch(layer, x, ids, topk_weights)
            y = run_local_experts(routed, *weights[layer], LIMIT)
            errors.append(float((dispatcher.combine(y, routed) - expected).abs().max()))
        if step == 1:
            rearranger.start(target)
        busy.append(rearranger.step())
    final = _local(target, rank, w13, w2)
    return {
        "errors": errors,
        "busy": busy,
        "placement_done": torch.equal(
            dispatcher.placement.physical_to_logical, target.physical_to_logical
        ),
        "weights_done": all(
            torch.equal(a, b)
            for la, lb in zip(weights, final, strict=True)
            for a, b in zip(la, lb, strict=True)
        ),
    }


def test_rearrangement_over_two_ranks_keeps_outputs():
    for result in run_ranks(_rearrange_worker, 2):
        assert max(result["errors"]) < 1e-5
        # Started at step 1: one layer lands per step, three layers -> done at step 4.
        assert result["busy"] == [False, True, True, False, False, False]
        assert result["placement_done"] and result["weights_done"]
