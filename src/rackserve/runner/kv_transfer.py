"""Copy one request's KV out of / into the paged cache tensors as one packed region.

The region is the concatenation, over cache groups (spec order) and their layers, of the
rows of the request's blocks (placeholder blocks of released sliding pages skipped). P/D
transfer and the host-memory KV pool move these regions; the receiver's block ids may
differ from the sender's, only their number per group must match.
"""

from __future__ import annotations

import torch

from rackserve.device import upload
from rackserve.model.batch import KVCacheTensors

NULL_BLOCK_ID = 0


def device_index(ids: list[int], tensors: list[torch.Tensor]) -> torch.Tensor:
    """``ids`` as a long index on the tensors' device (made once per group: on a GPU each is
    a copy from host memory, made without a stream sync: ``device.upload``)."""
    index = torch.tensor(ids, dtype=torch.long)
    return upload(index, tensors[0].device) if tensors else index


def _live(block_ids: list[int], tensors: list[torch.Tensor]) -> torch.Tensor:
    """The table's live block ids, on the group's device."""
    return device_index([b for b in block_ids if b != NULL_BLOCK_ID], tensors)


def packed_numel(caches: KVCacheTensors, block_ids: tuple[list[int], ...]) -> int:
    total = 0
    for name, ids in zip(caches.groups, block_ids, strict=True):
        for t in caches.tensors[name].values():
            total += sum(b != NULL_BLOCK_ID for b in ids) * t[0].numel()
    return total


def export_blocks(caches: KVCacheTensors, block_ids: tuple[list[int], ...]) -> torch.Tensor:
    """block_ids: per group, a request's block table -> [numel] one contiguous region."""
    parts = []
    for name, ids in zip(caches.groups, block_ids, strict=True):
        tensors = list(caches.tensors[name].values())
        live = _live(ids, tensors)
        parts += [t.index_select(0, live.to(t.device)).flatten() for t in tensors]
    return torch.cat(parts)


def import_blocks(
    caches: KVCacheTensors, block_ids: tuple[list[int], ...], packed: torch.Tensor
) -> None:
    """Write a region from ``export_blocks`` into these blocks (same count per group)."""
    if packed.numel() != packed_numel(caches, block_ids):
        raise ValueError(
            f"packed KV has {packed.numel()} elements, these blocks hold "
            f"{packed_numel(caches, block_ids)}: the block counts per group differ"
        )
    offset = 0
    for name, ids in zip(caches.groups, block_ids, strict=True):
        tensors = list(caches.tensors[name].values())
        group_live = _live(ids, tensors)
        for t in tensors:
            live = group_live.to(t.device)
            n = live.numel() * t[0].numel()
            t[live] = packed[offset : offset + n].view(len(live), *t.shape[1:]).to(t.dtype)
            offset += n


class ExportedRows:
    """A request's KV copied out of the cache (P/D prefill side), addressable by table slot,
    so that its blocks can be freed at once and any subset of slots sent later.

    ``slots[g]``: the live slot indices of group g's table; ``rows[g][k]``: the k-th tensor
    (layer) of group g as [len(slots[g]), entries_per_block, entry_width].
    """

    def __init__(self, caches: KVCacheTensors, block_ids: tuple[list[int], ...]) -> None:
        self.slots: list[list[int]] = []
        self.rows: list[list[torch.Tensor]] = []
        for name, ids in zip(caches.groups, block_ids, strict=True):
            live = [i for i, b in enumerate(ids) if b != NULL_BLOCK_ID]
            self.slots.append(live)
            tensors = list(caches.tensors[name].values())
            index = device_index([ids[i] for i in live], tensors)  # one per group, not layer
            self.rows.append([t.index_select(0, index.to(t.device)) for t in tensors])
        self._position = [{slot: i for i, slot in enumerate(s)} for s in self.slots]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for group in self.rows for t in group)

    def pack(self, group_slots: list[list[int]]) -> torch.Tensor:
        """The rows of these slots (per group, in order) as one region, laid out as
        ``export_blocks`` lays out blocks: ``import_blocks`` writes it into the receiver's
        blocks for the same slots. KeyError names a slot this copy lacks."""
        if len(group_slots) != len(self.slots):
            raise KeyError(f"{len(group_slots)} groups asked, {len(self.slots)} held")
        parts = []
        for g, wanted in enumerate(group_slots):
            missing = [s for s in wanted if s not in self._position[g]]
            if missing:
                raise KeyError(f"group {g} has no rows for slots {missing[:4]}")
            index = device_index([self._position[g][s] for s in wanted], self.rows[g])
            for t in self.rows[g]:
                parts.append(t.index_select(0, index.to(t.device)).flatten())
        if not parts:
            return torch.empty(0)
        return torch.cat(parts)
