"""EPLB placement policy (DeepSeek's expert-parallel load balancer, our own code).

Shape legend: L MoE layers, E logical experts, S physical slots, G expert groups, N nodes,
R ranks (GPUs), X rows of a batched problem (layers, or layers x nodes).

Pure functions on CPU tensors. From the measured logical load [L, E] they choose how many
replicas every expert gets (the hottest expert per copy gets the next slot) and which rank
holds every copy (heaviest first, onto the lightest rank with room). The hierarchical policy
first packs whole expert groups onto nodes, so that with group-limited routing a token's
experts stay within few nodes and replicas never cross a node; the global policy (one group,
one node) packs every copy over every rank.
"""

from __future__ import annotations

import torch

from rackserve.moe.placement import ExpertPlacement


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split n items into ``num_packs`` packs of exactly n / num_packs items each.

    Items in decreasing weight (ties: lower index first) go to the lightest pack that still
    has room (ties: lower pack). weight: [X, n]. Returns pack_index [X, n] and
    rank_in_pack [X, n] (the order in which items entered their pack), both int64.
    """
    num_rows, num_items = weight.shape
    if num_packs < 1 or num_items % num_packs:
        raise ValueError(f"{num_items} items do not split evenly into {num_packs} packs")
    per_pack = num_items // num_packs
    pack_index = torch.empty(num_rows, num_items, dtype=torch.int64)
    rank_in_pack = torch.empty(num_rows, num_items, dtype=torch.int64)
    order = torch.sort(weight.double(), dim=1, descending=True, stable=True).indices.tolist()
    values = weight.double().tolist()
    for row in range(num_rows):
        loads = [0.0] * num_packs
        sizes = [0] * num_packs
        for item in order[row]:
            pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=loads.__getitem__)
            pack_index[row, item] = pack
            rank_in_pack[row, item] = sizes[pack]
            loads[pack] += values[row][item]
            sizes[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give n experts ``num_slots`` slots: one each, then every extra slot to the expert with
    the highest load per copy (ties: lower index).

    weight: [X, n]. Returns slot_to_expert [X, num_slots] (slot i < n holds expert i) and
    replica_count [X, n], both int64.
    """
    num_rows, num_experts = weight.shape
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
    slot_to_expert = torch.empty(num_rows, num_slots, dtype=torch.int64)
    slot_to_expert[:, :num_experts] = torch.arange(num_experts)
    replica_count = torch.ones(num_rows, num_experts, dtype=torch.int64)
    rows = torch.arange(num_rows)
    weight = weight.double()
    for slot in range(num_experts, num_slots):
        # argmax returns the first maximum, which gives the documented tie rule.
        expert = (weight / replica_count).argmax(dim=1)
        slot_to_expert[:, slot] = expert
        replica_count[rows, expert] += 1
    return slot_to_expert, replica_count


def _inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """perm: [X, n] rows of permutations -> their inverses [X, n]."""
    inverse = torch.empty_like(perm)
    inverse.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))
    return inverse


def _check_load(load: torch.Tensor) -> torch.Tensor:
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, experts], got shape {list(load.shape)}")
    if load.is_floating_point() and not bool(torch.isfinite(load).all()):
        raise ValueError("load holds NaN or infinite values")
    if bool((load < 0).any()):
        raise ValueError("load must be non-negative (token counts)")
    return load.detach().to("cpu", torch.float64)


def rebalance_hierarchical(
    load: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """Hierarchical EPLB: groups onto nodes, replicas within a node, copies onto its ranks.

    load: [L, E] tokens per logical expert. Returns physical_to_logical [L, S] (rank-major
    slots). Needs E % G == 0, G % N == 0, R % N == 0 and S % R == 0.
    """
    load = _check_load(load)
    num_layers, num_experts = load.shape
    _check_shape(num_experts, num_slots, num_groups, num_nodes, num_ranks)
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_slots // num_nodes
    slots_per_rank = num_slots // num_ranks

    # 1. Whole groups onto nodes. "Node-major" order lists node 0's experts, then node 1's.
    group_load = load.view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_pos = balanced_packing(group_load, num_nodes)  # [L, G]
    groups_per_node = num_groups // num_nodes
    group_start = (group_node * groups_per_node + group_pos) * group_size  # [L, G]
    node_major_of_logical = (group_start[:, :, None] + torch.arange(group_size)).view(
        num_layers, num_experts
    )
    logical_of_node_major = _inverse_permutation(node_major_of_logical)

    # 2. Replicas within each node: its E/N experts over its S/N slots.
    node_load = load.gather(1, logical_of_node_major).view(-1, experts_per_node)
    slot_to_local, local_count = replicate_experts(node_load, slots_per_node)

    # 3. The node's copies onto its R/N ranks, each copy carrying load / replica count.
    copy_load = (node_load / local_count).gather(1, slot_to_local)  # [L*N, S/N]
    rank_in_node, pos_in_rank = balanced_packing(copy_load, num_ranks // num_nodes)
    position = rank_in_node * slots_per_rank + pos_in_rank  # slot within the node
    node_offset = torch.arange(num_nodes).repeat(num_layers)[:, None] * experts_per_node
    local_of_position = torch.empty_like(slot_to_local)
    local_of_position.scatter_(1, position, slot_to_local + node_offset)
    return logical_of_node_major.gather(1, local_of_position.view(num_layers, num_slots))


def _check_shape(
    num_experts: int, num_slots: int, num_groups: int, num_nodes: int, num_ranks: int
) -> None:
    if min(num_groups, num_nodes, num_ranks) < 1:
        raise ValueError("groups, nodes and ranks must be positive")
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not form {num_groups} equal groups")
    if num_groups % num_nodes:
        raise ValueError(f"{num_groups} groups do not split evenly over {num_nodes} nodes")
    if num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks do not split evenly over {num_nodes} nodes")
    if num_slots % num_ranks:
        raise ValueError(
            f"{num_slots} slots do not split evenly over {num_ranks} ranks; choose the number "
            "of redundant experts so that experts + redundant is a multiple of the EP size"
        )
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")


def rebalance_global(load: torch.Tensor, num_slots: int, num_ranks: int) -> torch.Tensor:
    """Global EPLB: replicas over all slots, then copies over all ranks (no node structure).

    load: [L, E]. Returns physical_to_logical [L, S]."""
    return rebalance_hierarchical(load, num_slots, 1, 1, num_ranks)


def rebalance_experts(
    load: torch.Tensor,
    num_slots: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
) -> ExpertPlacement:
    """DeepSeek's entry point: hierarchical when the groups split evenly over the nodes,
    global otherwise. load: [L, E]. Returns the full placement (both maps and counts)."""
    if num_groups >= 1 and num_nodes >= 1 and num_groups % num_nodes == 0:
        p2l = rebalance_hierarchical(load, num_slots, num_groups, num_nodes, num_ranks)
    else:
        p2l = rebalance_global(load, num_slots, num_ranks)
    return ExpertPlacement.from_physical_to_logical(p2l, load.shape[1], num_ranks)


def rank_load(
    load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    """Expected tokens per rank when every expert's tokens split evenly over its replicas.

    load: [L, E]; physical_to_logical: [L, S]. Returns [L, R] float64."""
    load = load.double()
    count = torch.zeros_like(load).scatter_add_(
        1, physical_to_logical, torch.ones_like(physical_to_logical, dtype=torch.float64)
    )
    copy_load = (load / count.clamp(min=1)).gather(1, physical_to_logical)
    return copy_load.view(load.shape[0], num_ranks, -1).sum(-1)
