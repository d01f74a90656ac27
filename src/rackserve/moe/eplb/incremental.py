"""Placement-aware EPLB: move at most a given number of experts per layer per rebalance.

Shape legend: L MoE layers, E logical experts, S physical slots, R ranks, N nodes.

A rebalance copies one expert's weights for every slot whose logical expert changes, so the
number of changed slots is the cost. The steps, per layer:

1. Compute the unconstrained target (``rebalance_experts``).
2. Align it with the current placement: the target's ranks are relabelled (nodes to nodes,
   then ranks within a node, greedily by how many experts they share) and, within a rank,
   an expert that stays keeps its slot. Balance is unchanged; the number of moves drops.
3. Apply the differing slots one move at a time, always the one leaving the lowest (max
   rank load, sum of squared rank loads), and stop at the cap or when no move improves. A
   move that would take an expert's last copy away is only applied together with the moves
   that bring that expert back (a chain), counted in full against the cap. If the whole
   aligned target fits the cap, keep whichever of it and the stepped result is better.
"""

from __future__ import annotations

import torch

from rackserve.moe.eplb.policy import _check_load, rebalance_experts
from rackserve.moe.placement import ExpertPlacement


def _overlap(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """a: [P, n], b: [Q, n] logical ids -> [P, Q] experts in common (multiset overlap)."""
    count_a = torch.zeros(a.shape[0], num_experts, dtype=torch.int64).scatter_add_(
        1, a, torch.ones_like(a)
    )
    count_b = torch.zeros(b.shape[0], num_experts, dtype=torch.int64).scatter_add_(
        1, b, torch.ones_like(b)
    )
    return torch.minimum(count_a[:, None, :], count_b[None, :, :]).sum(-1)


def _greedy_match(overlap: torch.Tensor) -> list[int]:
    """overlap: [P, P] -> match[target] = current, taking the largest overlaps first."""
    size = overlap.shape[0]
    score = overlap.clone().double()
    match = [0] * size
    for _ in range(size):
        flat = int(score.argmax())
        target, current = divmod(flat, size)
        match[target] = current
        score[target, :] = -1.0
        score[:, current] = -1.0
    return match


def align_to_current(
    target: torch.Tensor, current: torch.Tensor, num_experts: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """Relabel target ranks (within node structure) and order slots within each rank so that
    as many slots as possible keep their expert. target, current: [S] -> aligned [S]."""
    slots_per_rank = target.shape[0] // num_ranks
    ranks_per_node = num_ranks // num_nodes
    target_ranks = target.view(num_ranks, slots_per_rank)
    current_ranks = current.view(num_ranks, slots_per_rank)
    node_match = _greedy_match(
        _overlap(target.view(num_nodes, -1), current.view(num_nodes, -1), num_experts)
    )
    aligned = torch.empty_like(current_ranks)
    for target_node, current_node in enumerate(node_match):
        t_ranks = range(target_node * ranks_per_node, (target_node + 1) * ranks_per_node)
        c_ranks = range(current_node * ranks_per_node, (current_node + 1) * ranks_per_node)
        rank_match = _greedy_match(
            _overlap(target_ranks[list(t_ranks)], current_ranks[list(c_ranks)], num_experts)
        )
        for t_local, c_local in enumerate(rank_match):
            aligned[c_ranks[c_local]] = _align_slots(
                target_ranks[t_ranks[t_local]].tolist(), current_ranks[c_ranks[c_local]].tolist()
            )
    return aligned.view(-1)


def _align_slots(target: list[int], current: list[int]) -> torch.Tensor:
    """One rank: keep every current expert the target also wants at its slot; fill the rest
    of the slots with the remaining target experts in order."""
    remaining = list(target)
    result: list[int | None] = []
    for expert in current:
        if expert in remaining:
            remaining.remove(expert)
            result.append(expert)
        else:
            result.append(None)
    fill = iter(remaining)
    return torch.tensor([e if e is not None else next(fill) for e in result], dtype=torch.int64)


def _objective(
    load: torch.Tensor, states: torch.Tensor, num_experts: int, num_ranks: int
) -> torch.Tensor:
    """load: [E] float64; states: [C, S] candidate placements -> [C, 2] (max rank load, sum of
    squares); +inf for a candidate that leaves an expert without a slot."""
    count = torch.zeros(states.shape[0], num_experts, dtype=torch.float64).scatter_add_(
        1, states, torch.ones_like(states, dtype=torch.float64)
    )
    copy_load = (load / count.clamp(min=1)).gather(1, states)
    ranks = copy_load.view(states.shape[0], num_ranks, -1).sum(-1)
    result = torch.stack([ranks.max(-1).values, (ranks * ranks).sum(-1)], dim=1)
    result[(count == 0).any(-1)] = float("inf")
    return result


def _chain(state: list[int], target: list[int], start: int, pending: set[int]) -> list[int]:
    """The slots to move together with ``start`` so that no expert loses its last copy:
    follow each lost expert to a pending slot that brings it back."""
    chain = [start]
    trial = list(state)
    trial[start] = target[start]
    while True:
        present = set(trial)
        lost = [e for e in (state[s] for s in chain) if e not in present]
        if not lost:
            return chain
        source = next((s for s in sorted(pending) if target[s] == lost[0] and s not in chain), None)
        if source is None:
            return []
        chain.append(source)
        trial[source] = target[source]


def _capped_layer(
    load: torch.Tensor, current: torch.Tensor, target: torch.Tensor, max_moves: int, num_ranks: int
) -> torch.Tensor:
    num_experts = load.shape[0]
    state = current.tolist()
    goal = target.tolist()
    pending = {s for s in range(len(state)) if state[s] != goal[s]}
    budget = max_moves
    best = _objective(load, current[None], num_experts, num_ranks)[0]
    while pending and budget > 0:
        moves = [c for s in sorted(pending) if (c := _chain(state, goal, s, pending))]
        moves = [m for m in moves if len(m) <= budget]
        if not moves:
            break
        states = torch.tensor(state, dtype=torch.int64).repeat(len(moves), 1)
        for row, move in enumerate(moves):
            states[row, move] = torch.tensor([goal[s] for s in move])
        scores = _objective(load, states, num_experts, num_ranks)
        # Lexicographic minimum: the max rank load, then the sum of squares.
        order = sorted(range(len(moves)), key=lambda i: (*scores[i].tolist(), len(moves[i])))
        pick = order[0]
        if tuple(scores[pick].tolist()) >= tuple(best.tolist()):
            break
        best = scores[pick]
        for s in moves[pick]:
            state[s] = goal[s]
            pending.discard(s)
        budget -= len(moves[pick])
    return torch.tensor(state, dtype=torch.int64)


def rebalance_with_move_cap(
    load: torch.Tensor,
    current: ExpertPlacement,
    max_moves_per_layer: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> ExpertPlacement:
    """A new placement that changes at most ``max_moves_per_layer`` slots of each layer.

    load: [L, E] measured tokens per logical expert; current: the placement in use (its
    slot count and rank count are kept). Returns the new placement; slots it does not move
    hold the same expert as before.
    """
    load = _check_load(load)
    if load.shape != (current.num_layers, current.num_experts):
        raise ValueError(
            f"load {list(load.shape)} does not match the placement's "
            f"[{current.num_layers}, {current.num_experts}]"
        )
    if max_moves_per_layer < 0:
        raise ValueError("max_moves_per_layer must be >= 0")
    num_ranks = current.num_ranks
    if num_groups % num_nodes:  # the global policy, as rebalance_experts falls back to
        num_groups, num_nodes = 1, 1
    target = rebalance_experts(load, current.num_slots, num_groups, num_nodes, num_ranks)
    layers = []
    for layer in range(current.num_layers):
        now = current.physical_to_logical[layer].cpu()
        aligned = align_to_current(
            target.physical_to_logical[layer], now, current.num_experts, num_nodes, num_ranks
        )
        stepped = _capped_layer(load[layer], now, aligned, max_moves_per_layer, num_ranks)
        if int((aligned != now).sum()) <= max_moves_per_layer:
            # The greedy packing is not optimal: a few moves can beat the whole target.
            scores = _objective(
                load[layer], torch.stack([aligned, stepped]), current.num_experts, num_ranks
            )
            stepped = aligned if tuple(scores[0].tolist()) <= tuple(scores[1].tolist()) else stepped
        layers.append(stepped)
    return ExpertPlacement.from_physical_to_logical(
        torch.stack(layers), current.num_experts, num_ranks
    )


def num_moves(old: ExpertPlacement, new: ExpertPlacement) -> torch.Tensor:
    """Slots per layer whose expert changes between two placements: [L] int64."""
    return (old.physical_to_logical.cpu() != new.physical_to_logical.cpu()).sum(-1)
