"""Copy one request's KV out of / into the paged cache tensors as one packed region.

The region is the concatenation, over cache groups (spec order) and their layers, of the
rows of the request's blocks (placeholder blocks of released sliding pages skipped). P/D
transfer and the host-memory KV pool move these regions; the receiver's block ids may
differ from the sender's, only their number per group must match.
"""

from __future__ import annotations

import torch

from rackserve.model.batch import KVCacheTensors

NULL_BLOCK_ID = 0


def _live(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(
        [b for b in block_ids if b != NULL_BLOCK_ID], dtype=torch.long, device=device
    )


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
        for t in caches.tensors[name].values():
            parts.append(t[_live(ids, t.device)].flatten())
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
        for t in caches.tensors[name].values():
            live = _live(ids, t.device)
            n = live.numel() * t[0].numel()
            t[live] = packed[offset : offset + n].view(len(live), *t.shape[1:]).to(t.dtype)
            offset += n
