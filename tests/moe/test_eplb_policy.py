"""EPLB policy: exact answers on hand-worked cases, invariants on random loads."""

import pytest
import torch

from rackserve.moe.eplb import (
    balanced_packing,
    num_moves,
    rank_load,
    rebalance_experts,
    rebalance_global,
    rebalance_hierarchical,
    rebalance_with_move_cap,
    replicate_experts,
)
from rackserve.moe.placement import ExpertPlacement, choose_replicas, invert_placement


def test_balanced_packing_known_answer():
    # 4 -> p0, 3 -> p1, 2 -> p1 (3 < 4), 1 -> p0 (p1 is full): both packs weigh 5.
    pack, rank = balanced_packing(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1]]


def test_balanced_packing_ties_and_rows():
    pack, rank = balanced_packing(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 5.0, 1.0]]), 2)
    assert pack.tolist() == [[0, 1, 0, 1], [1, 0, 0, 1]]
    assert rank.tolist() == [[0, 0, 1, 1], [1, 1, 0, 0]]


def test_replicate_experts_known_answer():
    # Extra slots: 7 > 2 -> expert 0 (3.5 each); 3.5 > 2 -> expert 0 again (2.33 each).
    slots, count = replicate_experts(torch.tensor([[7.0, 2.0, 1.0]]), 5)
    assert slots.tolist() == [[0, 1, 2, 0, 0]]
    assert count.tolist() == [[3, 1, 1]]


def test_global_known_answer():
    # Replicas: expert 0 gets both extra slots (9 -> 4.5 -> 3 per copy). Copies weigh
    # [3, 4, 2, 1, 3, 3]; packing them onto 2 ranks of 3 gives 8 and 8.
    p2l = rebalance_global(torch.tensor([[9.0, 4.0, 2.0, 1.0]]), num_slots=6, num_ranks=2)
    assert p2l.tolist() == [[1, 0, 3, 0, 0, 2]]
    loads = rank_load(torch.tensor([[9.0, 4.0, 2.0, 1.0]]), p2l, 2)
    assert loads.tolist() == [[8.0, 8.0]]


def test_hierarchical_known_answer():
    # Groups {0,1} and {2,3} weigh 6 and 6 -> nodes 0 and 1. Node 0 replicates expert 0
    # (5 > 1), node 1 expert 2 (tie 3 = 3: the lower index). Copies within a rank are
    # ordered heaviest first.
    p2l = rebalance_hierarchical(
        torch.tensor([[5.0, 1.0, 3.0, 3.0]]), num_slots=6, num_groups=2, num_nodes=2, num_ranks=2
    )
    assert p2l.tolist() == [[0, 0, 1, 3, 2, 2]]


def test_placement_maps_have_no_sentinel():
    placement = ExpertPlacement.from_physical_to_logical(
        torch.tensor([[1, 0, 3, 0, 0, 2]]), num_experts=4, num_ranks=2
    )
    assert placement.replica_count.tolist() == [[3, 1, 1, 1]]
    # Expert 0's copies are slots 1, 3, 4; the single-copy experts repeat their slot.
    assert placement.logical_to_physical.tolist() == [[[1, 3, 4], [0, 0, 0], [5, 5, 5], [2, 2, 2]]]
    assert placement.slots_per_rank == 3


def test_choose_replicas_round_robin_by_token():
    placement = ExpertPlacement.from_physical_to_logical(
        torch.tensor([[1, 0, 3, 0, 0, 2]]), num_experts=4, num_ranks=2
    )
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]])
    slots = choose_replicas(ids, placement.logical_to_physical[0], placement.replica_count[0])
    assert slots.tolist() == [[1, 0], [3, 5], [4, 2], [1, 0]]
    shifted = choose_replicas(ids, placement.logical_to_physical[0], placement.replica_count[0], 1)
    assert shifted[:, 0].tolist() == [3, 4, 1, 3]


@pytest.mark.parametrize("groups,nodes,ranks,slots", [(1, 1, 4, 20), (4, 2, 4, 24), (8, 4, 8, 32)])
def test_random_loads_invariants(groups, nodes, ranks, slots):
    torch.manual_seed(0)
    num_experts = 16
    load = torch.rand(3, num_experts) ** 4 * 1000  # skewed
    placement = rebalance_experts(load, slots, groups, nodes, ranks)
    p2l = placement.physical_to_logical
    assert p2l.shape == (3, slots)
    assert (placement.replica_count >= 1).all()
    assert placement.replica_count.sum(-1).tolist() == [slots] * 3
    # The map and its inverse agree.
    for layer in range(3):
        for expert in range(num_experts):
            copies = placement.logical_to_physical[layer, expert]
            assert (p2l[layer, copies] == expert).all()
    balanced = rank_load(load, p2l, ranks)
    naive = rank_load(
        load, ExpertPlacement.default(3, num_experts, ranks, slots).physical_to_logical, ranks
    )
    assert (balanced.max(-1).values <= naive.max(-1).values + 1e-9).all()
    if nodes > 1 and groups > 1:
        # Hierarchical: every node holds whole groups, and every copy stays in its node.
        group_size = num_experts // groups
        per_node = p2l.view(3, nodes, -1) // group_size
        for layer in range(3):
            node_groups = [set(per_node[layer, n].tolist()) for n in range(nodes)]
            assert all(len(g) == groups // nodes for g in node_groups)
            assert len(set().union(*node_groups)) == groups


def test_eplb_balances_zipf_load():
    num_experts, ranks = 64, 8
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    load = popularity[torch.randperm(num_experts, generator=torch.Generator().manual_seed(1))]
    load = load[None] * 1e4
    before = rank_load(
        load, ExpertPlacement.default(1, num_experts, ranks).physical_to_logical, ranks
    )
    after = rank_load(load, rebalance_global(load, num_experts + ranks, ranks), ranks)
    assert (before.mean() / before.max()).item() < 0.6
    assert (after.mean() / after.max()).item() > 0.95


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of the EP size"):
        rebalance_experts(torch.ones(1, 8), 10, 1, 1, 4)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-torch.ones(1, 8), 8, 1, 1, 4)
    with pytest.raises(ValueError, match=r"\[layers, experts\]"):
        rebalance_experts(torch.ones(8), 8, 1, 1, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        rebalance_experts(torch.ones(1, 8), 4, 1, 1, 4)
    with pytest.raises(ValueError, match="no physical slot"):
        invert_placement(torch.tensor([[0, 0, 1, 1]]), 3)


def test_move_cap_zero_keeps_placement_and_large_cap_reaches_target():
    torch.manual_seed(2)
    load = torch.rand(2, 16) ** 4 * 100
    current = ExpertPlacement.default(2, 16, 4, 20)
    same = rebalance_with_move_cap(load, current, 0)
    assert torch.equal(same.physical_to_logical, current.physical_to_logical)
    full = rebalance_with_move_cap(load, current, 20)
    target = rank_load(load, rebalance_global(load, 20, 4), 4)
    assert torch.allclose(
        rank_load(load, full.physical_to_logical, 4).max(-1).values, target.max(-1).values
    )


def test_move_cap_is_respected_and_improves():
    torch.manual_seed(3)
    load = torch.rand(4, 32) ** 6 * 1000
    current = ExpertPlacement.default(4, 32, 8, 40)
    before = rank_load(load, current.physical_to_logical, 8).max(-1).values
    for cap in (2, 4, 8):
        new = rebalance_with_move_cap(load, current, cap)
        assert (num_moves(current, new) <= cap).all()
        after = rank_load(load, new.physical_to_logical, 8).max(-1).values
        assert (after < before).all()  # every layer gains from the first moves


def test_move_cap_alignment_needs_no_moves_for_a_relabelled_placement():
    # The current placement is the target with ranks swapped: no expert needs to move.
    load = torch.tensor([[9.0, 4.0, 2.0, 1.0]])
    target = rebalance_global(load, 6, 2)
    swapped = torch.cat([target[:, 3:], target[:, :3]], dim=1)
    current = ExpertPlacement.from_physical_to_logical(swapped, 4, 2)
    new = rebalance_with_move_cap(load, current, 0)
    assert num_moves(current, new).tolist() == [0]
    assert rebalance_with_move_cap(load, current, 6).physical_to_logical.tolist() == [
        swapped[0].tolist()
    ]
