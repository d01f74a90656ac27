"""Expert placement: which logical expert every physical slot holds, per MoE layer.

Shape legend: L MoE layers, E logical experts, S physical slots (E plus redundant copies),
R expert-parallel ranks, M most replicas any expert has in a layer, T tokens, k top-k.

Slots are rank-major: rank r holds slots ``[r * S / R, (r + 1) * S / R)``. The inverse map
``logical_to_physical`` has no sentinel value: row ``[l, e]`` lists the expert's
``replica_count[l, e]`` slots first and then repeats them cyclically up to M columns, so
every entry is a real slot and a wrong count can never index out of range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Placement of E logical experts on S slots over R ranks, for L layers.

    physical_to_logical: [L, S] int64; logical_to_physical: [L, E, M] int64 (padded by
    cycling the replicas); replica_count: [L, E] int64, >= 1 everywhere.
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor
    num_ranks: int

    def __post_init__(self) -> None:
        p2l = self.physical_to_logical
        if p2l.dim() != 2 or p2l.dtype != torch.int64:
            raise ValueError(
                f"physical_to_logical must be int64 [L, S], got {p2l.dtype} {list(p2l.shape)}"
            )
        if self.num_ranks < 1 or p2l.shape[1] % self.num_ranks:
            raise ValueError(
                f"{p2l.shape[1]} physical slots do not split evenly over {self.num_ranks} "
                "ranks; choose a number of redundant experts that makes E + R a multiple "
                "of the expert-parallel size"
            )

    @classmethod
    def from_physical_to_logical(
        cls, physical_to_logical: torch.Tensor, num_experts: int, num_ranks: int
    ) -> ExpertPlacement:
        """Build the inverse maps. physical_to_logical: [L, S] (any integer dtype); the
        result lives on its device (the maps are computed on the CPU)."""
        device = physical_to_logical.device
        p2l = physical_to_logical.to("cpu", torch.int64)
        if p2l.dim() != 2:
            raise ValueError(f"physical_to_logical must be [L, S], got {list(p2l.shape)}")
        if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_experts):
            raise ValueError(f"physical_to_logical holds ids outside [0, {num_experts})")
        logical_to_physical, replica_count = invert_placement(p2l, num_experts)
        return cls(p2l.contiguous(), logical_to_physical, replica_count, num_ranks).to(device)

    @classmethod
    def default(
        cls, num_layers: int, num_experts: int, num_ranks: int, num_slots: int | None = None
    ) -> ExpertPlacement:
        """The placement before any rebalance: slot s holds expert ``s % E`` (contiguous
        experts per rank; redundant slots, if any, hold the first experts again)."""
        num_slots = num_experts if num_slots is None else num_slots
        if num_slots < num_experts:
            raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
        row = torch.arange(num_slots, dtype=torch.int64) % num_experts
        return cls.from_physical_to_logical(
            row.expand(num_layers, num_slots), num_experts, num_ranks
        )

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_experts(self) -> int:
        return self.replica_count.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def with_layer(self, layer: int, physical_to_logical: torch.Tensor) -> ExpertPlacement:
        """A copy whose layer ``layer`` holds the new map [S] (the rest unchanged)."""
        p2l = self.physical_to_logical.clone()
        p2l[layer] = physical_to_logical
        return ExpertPlacement.from_physical_to_logical(p2l, self.num_experts, self.num_ranks)

    def to(self, device: torch.device | str) -> ExpertPlacement:
        if self.physical_to_logical.device == torch.device(device):
            return self
        return ExpertPlacement(
            self.physical_to_logical.to(device),
            self.logical_to_physical.to(device),
            self.replica_count.to(device),
            self.num_ranks,
        )


def invert_placement(
    physical_to_logical: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """physical_to_logical [L, S] -> (logical_to_physical [L, E, M], replica_count [L, E]).

    Raises ValueError when a logical expert has no slot in some layer (its tokens would have
    nowhere to go)."""
    physical_to_logical = physical_to_logical.cpu()
    num_layers, num_slots = physical_to_logical.shape
    replica_count = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    replica_count.scatter_add_(1, physical_to_logical, torch.ones_like(physical_to_logical))
    if bool((replica_count == 0).any()):
        layer, expert = (replica_count == 0).nonzero()[0].tolist()
        raise ValueError(f"logical expert {expert} has no physical slot in layer {layer}")
    max_replicas = int(replica_count.max()) if num_slots else 1
    # Slots grouped by expert (stable: replicas keep slot order); expert e's replicas start
    # at the running sum of the counts before it.
    order = torch.argsort(physical_to_logical, dim=1, stable=True)
    start = torch.cumsum(replica_count, dim=1) - replica_count
    column = torch.arange(max_replicas, dtype=torch.int64)
    index = start[:, :, None] + column % replica_count[:, :, None]  # [L, E, M]
    logical_to_physical = order.gather(1, index.view(num_layers, -1)).view(index.shape)
    return logical_to_physical, replica_count


def choose_replicas(
    topk_ids: torch.Tensor,
    logical_to_physical: torch.Tensor,
    replica_count: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """Physical slot for every (token, choice): replicas taken in turn by token index.

    topk_ids: [T, k] logical ids of one layer; logical_to_physical: [E, M];
    replica_count: [E]; offset (e.g. the DP rank) shifts the turn so that small batches on
    different ranks do not all pick replica 0. Returns [T, k] int64. No host sync.
    """
    ids = topk_ids.long()
    token = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)[:, None] + offset
    replica = token % replica_count[ids]
    return logical_to_physical[ids, replica]
