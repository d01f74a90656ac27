"""MoE dispatch / combine: send each token to the rank holding its chosen expert copy, and
bring the results back weighted.

Shape legend: T tokens on this rank, k experts per token, D hidden, R EP ranks, S slots,
S_r = S / R slots per rank, N rows this rank receives (sum over senders), E experts.

The model's MoE layer calls, per layer::

    routed = dispatcher.dispatch(layer, x, topk_ids, topk_weights)   # x: [T, D]
    y = run_local_experts(routed, w13_local, w2_local, limit)       # [N, D], unweighted
    out = dispatcher.combine(y, routed)                              # [T, D]

``LocalDispatcher`` is one rank (no communication); ``AllToAllDispatcher`` exchanges rows
with ``all_to_all_single`` and split sizes over the EP group (gloo or NCCL). Both take the
same placement and give the same result up to summation order. Each (token, choice) picks
one replica of its expert: replicas in turn by token index, offset by the EP rank.

    rows of (token, choice), flattened [T*k]
      -> sorted by destination rank (stable)     | rank 0 rows | rank 1 rows | ...
      -> all_to_all_single(split sizes)          received [N, D] + local slot [N]
      <- all_to_all_single(reverse split sizes)  expert outputs back, unsorted, weighted
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rackserve import ops
from rackserve.moe.placement import ExpertPlacement, choose_replicas


@dataclass(frozen=True)
class DispatchedTokens:
    """The rows this rank must run through its experts, and what combine needs.

    hidden: [N, D]; local_slot: [N] int64 in [0, S_r) (which of this rank's slots);
    order: [T*k] flat (token, choice) index of every sent row, in send order;
    topk_weights: [T, k]; send_splits / recv_splits: rows per peer rank (host ints);
    slots: [T, k] int64 global physical slot of every (token, choice) (for load statistics).
    """

    hidden: torch.Tensor
    local_slot: torch.Tensor
    order: torch.Tensor
    topk_weights: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    slots: torch.Tensor


class MoEDispatcher:
    """Routes tokens over a placement; subclasses define the exchange between ranks."""

    def __init__(self, placement: ExpertPlacement, ep_rank: int = 0) -> None:
        if not 0 <= ep_rank < placement.num_ranks:
            raise ValueError(f"ep_rank {ep_rank} outside the {placement.num_ranks} EP ranks")
        self.placement = placement
        self.ep_rank = ep_rank

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Swap the placement in (all ranks at the same step boundary)."""
        if placement.num_ranks != self.placement.num_ranks:
            raise ValueError("a new placement must keep the number of EP ranks")
        self.placement = placement

    def _exchange(
        self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        raise NotImplementedError

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dispatch(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchedTokens:
        """x: [T, D]; topk_ids: [T, k] logical ids; topk_weights: [T, k]."""
        if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"expected x [T, D] and topk_ids / topk_weights [T, k], got {list(x.shape)}, "
                f"{list(topk_ids.shape)}, {list(topk_weights.shape)}"
            )
        placement = self.placement
        chosen = choose_replicas(
            topk_ids,
            placement.logical_to_physical[layer],
            placement.replica_count[layer],
            offset=self.ep_rank,
        )  # [T, k]
        slots = chosen.flatten()  # [T*k]
        destination = slots // placement.slots_per_rank
        order = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=self.num_ranks)
        recv_counts = self._exchange_counts(send_counts)
        # The one host sync: all_to_all_single needs split sizes as Python ints.
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        top_k = topk_ids.shape[1]
        hidden = self._exchange(x[order // top_k], send_splits, recv_splits)
        local_slot = self._exchange(
            slots[order] % placement.slots_per_rank, send_splits, recv_splits
        )
        return DispatchedTokens(
            hidden, local_slot, order, topk_weights, send_splits, recv_splits, chosen
        )

    def combine(self, expert_out: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        """expert_out: [N, D] unweighted outputs of the received rows -> [T, D]: each token's
        expert outputs weighted by its top-k weights and summed."""
        if expert_out.shape[0] != dispatched.hidden.shape[0]:
            raise ValueError(
                f"combine got {expert_out.shape[0]} rows for {dispatched.hidden.shape[0]} "
                "dispatched"
            )
        rows = self._exchange(expert_out, dispatched.recv_splits, dispatched.send_splits)
        num_tokens, top_k = dispatched.topk_weights.shape
        unsorted = torch.empty_like(rows)
        unsorted[dispatched.order] = rows
        weighted = unsorted.view(num_tokens, top_k, rows.shape[-1]).float()
        weighted = weighted * dispatched.topk_weights[..., None]
        return weighted.sum(1).to(expert_out.dtype)


class LocalDispatcher(MoEDispatcher):
    """One rank holds every slot: no communication."""

    def __init__(self, placement: ExpertPlacement) -> None:
        if placement.num_ranks != 1:
            raise ValueError("LocalDispatcher needs a one-rank placement")
        super().__init__(placement, 0)

    def _exchange(
        self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        return rows

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        return send_counts


class AllToAllDispatcher(MoEDispatcher):
    """All-to-all over the EP group: ``all_to_all_single`` with uneven split sizes."""

    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup) -> None:
        size = dist.get_world_size(group)
        if size != placement.num_ranks:
            raise ValueError(
                f"the EP group has {size} ranks but the placement {placement.num_ranks}"
            )
        super().__init__(placement, dist.get_rank(group))
        self.group = group

    def _exchange(
        self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> torch.Tensor:
        received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(
            received, rows.contiguous(), recv_splits, send_splits, group=self.group
        )
        return received

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        return recv_counts


def run_local_experts(
    dispatched: DispatchedTokens,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    moe_experts: Callable[..., torch.Tensor] = ops.moe_experts,
) -> torch.Tensor:
    """This rank's experts on the received rows, unweighted (combine weights them).

    w13: [S_r, 2I, D], w2: [S_r, D, I] (this rank's slots, in slot order). Returns [N, D].
    ``moe_experts``: the op implementation (the model passes its kernels table's).
    """
    ids = dispatched.local_slot[:, None]
    ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    return moe_experts(dispatched.hidden, ids, ones, w13, w2, limit)


def run_local_experts_fp4(
    dispatched: DispatchedTokens,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
    moe_experts_fp4: Callable[..., torch.Tensor] = ops.quant.moe_experts_fp4,
) -> torch.Tensor:
    """``run_local_experts`` on FP4 experts (``ops/quant.py``): this rank's slots' packed
    weights and their scales, sharded by slot as the weights are. w13: [S_r, 2I, D / 2]
    uint8, w13_scale: [S_r, 2I, D / 32]; w2: [S_r, D, I / 2], w2_scale: [S_r, D, I / 32].
    Returns [N, D] unweighted (combine weights them)."""
    ids = dispatched.local_slot[:, None]
    ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    return moe_experts_fp4(dispatched.hidden, ids, ones, w13, w13_scale, w2, w2_scale, limit)
