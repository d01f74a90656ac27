"""Moving expert weights to a new placement, one layer per step boundary, on all ranks.

Shape legend: L MoE layers, S slots, R EP ranks, S_r = S / R slots per rank, F the
flattened size of one expert's weights (all its tensors together).

Each rank keeps its slots' weights as tensors with a leading [S_r] dimension (for example
``w13`` [S_r, 2I, D] and ``w2`` [S_r, D, I]). For one layer, every new slot gets its
expert from, in order of preference: the same slot (unchanged), another slot of the same
rank (a local copy), or a copy on another rank (replicas of the source taken in turn, so
a hot expert's sends spread over its copies). The remote rows travel in one
``all_to_all_single``; all ranks compute the same plan from the two placements, so no
metadata is exchanged.

``ExpertRearranger.step()`` is called by every rank at the same step boundary: it swaps in
the layer whose transfer finished (weights copied in place, then that layer's placement
row) and starts the next layer's transfer (``async_op``), which proceeds during the next
forward; decode never stops and every layer is always consistent with its placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rackserve.moe.dispatch import MoEDispatcher
from rackserve.moe.placement import ExpertPlacement


@dataclass(frozen=True)
class Transfer:
    """Expert weights for new slot ``dst_slot`` come from old slot ``src_slot`` (global
    slot ids; ranks are ``slot // S_r``)."""

    src_slot: int
    dst_slot: int


def plan_layer(old: torch.Tensor, new: torch.Tensor, num_ranks: int) -> list[Transfer]:
    """One layer's moves: old, new: [S] physical_to_logical. Slots that keep their expert
    need nothing; the rest copy locally when their rank already holds the expert, else from
    a remote copy. Returns the transfers sorted by destination slot."""
    old_list, new_list = old.tolist(), new.tolist()
    if len(old_list) != len(new_list) or len(old_list) % num_ranks:
        raise ValueError("old and new placements must have the same slots, split over ranks")
    slots_per_rank = len(old_list) // num_ranks
    copies: dict[int, list[int]] = {}
    for slot, expert in enumerate(old_list):
        copies.setdefault(expert, []).append(slot)
    missing = set(new_list) - set(copies)
    if missing:
        raise ValueError(f"experts {sorted(missing)} have no copy in the old placement")
    turn: dict[int, int] = {}
    transfers = []
    for slot, expert in enumerate(new_list):
        if old_list[slot] == expert:
            continue
        rank = slot // slots_per_rank
        local = [s for s in copies[expert] if s // slots_per_rank == rank]
        if local:
            source = local[0]
        else:
            index = turn.get(expert, 0)
            turn[expert] = index + 1
            source = copies[expert][index % len(copies[expert])]
        transfers.append(Transfer(source, slot))
    return transfers


def _mixed(weights: list[torch.Tensor]) -> bool:
    """Whether a slot's tensors differ in dtype (FP4 packed bytes with fp32 scales): then
    the rows travel as raw bytes."""
    return len({w.dtype for w in weights}) > 1


def _width(tensor: torch.Tensor, as_bytes: bool) -> int:
    return tensor[0].numel() * (tensor.element_size() if as_bytes else 1)


def _rows(weights: list[torch.Tensor], local_slots: list[int]) -> torch.Tensor:
    """[len(local_slots), F]: every listed slot's tensors flattened side by side (as uint8
    bytes when their dtypes differ)."""
    as_bytes = _mixed(weights)
    if not local_slots:
        width = sum(_width(w, as_bytes) for w in weights)
        dtype = torch.uint8 if as_bytes else weights[0].dtype
        return torch.empty((0, width), dtype=dtype, device=weights[0].device)
    index = torch.tensor(local_slots, device=weights[0].device)
    rows = [w[index].flatten(1) for w in weights]
    if as_bytes:
        rows = [r.contiguous().view(torch.uint8) for r in rows]
    return torch.cat(rows, dim=1)


class _LayerTransfer:
    """One layer's transfer in flight on this rank: what to write where once it lands."""

    def __init__(
        self,
        weights: list[torch.Tensor],
        plan: list[Transfer],
        rank: int,
        num_ranks: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        slots_per_rank = weights[0].shape[0]

        def rank_of(slot: int) -> int:
            return slot // slots_per_rank

        # Local copies read the old weights now: the in-place swap must not see half-new rows.
        local = [t for t in plan if rank_of(t.dst_slot) == rank == rank_of(t.src_slot)]
        self.local_dst = [t.dst_slot % slots_per_rank for t in local]
        self.local_rows = _rows(weights, [t.src_slot % slots_per_rank for t in local])
        remote = [t for t in plan if rank_of(t.src_slot) != rank_of(t.dst_slot)]
        sends = [
            [t for t in remote if rank_of(t.src_slot) == rank and rank_of(t.dst_slot) == peer]
            for peer in range(num_ranks)
        ]
        receives = [
            [t for t in remote if rank_of(t.dst_slot) == rank and rank_of(t.src_slot) == peer]
            for peer in range(num_ranks)
        ]
        send_rows = _rows(weights, [t.src_slot % slots_per_rank for ts in sends for t in ts])
        self.recv_dst = [t.dst_slot % slots_per_rank for ts in receives for t in ts]
        self.received = send_rows.new_empty((len(self.recv_dst), send_rows.shape[1]))
        self.work = None
        if remote and group is None:
            raise ValueError("moving experts between ranks needs the EP process group")
        if remote:
            self.work = dist.all_to_all_single(
                self.received,
                send_rows,
                [len(ts) for ts in receives],
                [len(ts) for ts in sends],
                group=group,
                async_op=True,
            )

    def finish_into(self, weights: list[torch.Tensor]) -> None:
        """Wait for the rows and write them into the layer's tensors in place."""
        if self.work is not None:
            self.work.wait()
        for dst, rows in ((self.local_dst, self.local_rows), (self.recv_dst, self.received)):
            if not dst:
                continue
            index = torch.tensor(dst, device=weights[0].device)
            as_bytes, offset = _mixed(weights), 0
            for tensor in weights:
                width = _width(tensor, as_bytes)
                part = rows[:, offset : offset + width]
                if as_bytes:
                    part = part.contiguous().view(tensor.dtype)
                tensor[index] = part.view(-1, *tensor.shape[1:])
                offset += width


class ExpertRearranger:
    """Moves a model's expert weights to a new placement, one layer per ``step()``.

    layer_weights[l]: this rank's tensors of MoE layer l, each [S_r, ...] (updated in
    place). The dispatcher's placement is updated layer by layer as each layer lands.
    ``group`` should be a process group of its own over the EP ranks, so the background
    transfer does not queue behind (or block) the dispatch all-to-all.
    """

    def __init__(
        self,
        layer_weights: list[list[torch.Tensor]],
        dispatcher: MoEDispatcher,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layer_weights = layer_weights
        self.dispatcher = dispatcher
        self.group = group
        self.target: ExpertPlacement | None = None
        self.next_layer = 0
        self.in_flight: tuple[int, _LayerTransfer] | None = None

    @property
    def busy(self) -> bool:
        return self.target is not None

    def start(self, target: ExpertPlacement) -> None:
        """Begin moving to ``target`` (every rank, the same target, the same step)."""
        current = self.dispatcher.placement
        if target.physical_to_logical.shape != current.physical_to_logical.shape:
            raise ValueError("the new placement must keep the layers and slots")
        if target.num_ranks != current.num_ranks:
            raise ValueError("the new placement must keep the number of EP ranks")
        if self.busy:
            raise ValueError("a rearrangement is already running; wait until it finishes")
        self.target = target
        self.next_layer = 0
        self._launch_next()

    def _launch_next(self) -> None:
        assert self.target is not None
        current = self.dispatcher.placement
        while self.next_layer < current.num_layers:
            layer = self.next_layer
            self.next_layer += 1
            old = current.physical_to_logical[layer].cpu()
            new = self.target.physical_to_logical[layer].cpu()
            if torch.equal(old, new):
                continue  # nothing moves in this layer
            plan = plan_layer(old, new, current.num_ranks)
            transfer = _LayerTransfer(
                self.layer_weights[layer],
                plan,
                self.dispatcher.ep_rank,
                current.num_ranks,
                self.group,
            )
            self.in_flight = (layer, transfer)
            return
        self.in_flight = None
        self.target = None

    def step(self) -> bool:
        """At a step boundary: swap in the layer that was in flight and start the next.
        Returns True while layers remain."""
        if self.in_flight is None:
            return False
        layer, transfer = self.in_flight
        transfer.finish_into(self.layer_weights[layer])
        assert self.target is not None
        placement = self.dispatcher.placement.with_layer(
            layer, self.target.physical_to_logical[layer]
        )
        self.dispatcher.set_placement(placement)
        self._launch_next()
        return self.busy
