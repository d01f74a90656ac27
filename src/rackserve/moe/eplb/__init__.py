"""Expert-parallel load balancer: placement policies (pure functions on CPU tensors)."""

from rackserve.moe.eplb.incremental import num_moves, rebalance_with_move_cap
from rackserve.moe.eplb.policy import (
    balanced_packing,
    rank_load,
    rebalance_experts,
    rebalance_global,
    rebalance_hierarchical,
    replicate_experts,
)

__all__ = [
    "balanced_packing",
    "num_moves",
    "rank_load",
    "rebalance_experts",
    "rebalance_global",
    "rebalance_hierarchical",
    "rebalance_with_move_cap",
    "replicate_experts",
]
