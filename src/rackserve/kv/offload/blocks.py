"""Blocks of one cache group between the paged cache tensors and per-block pool values,
through runner/kv_transfer.py's packed regions.

``export_blocks`` packs a group's blocks layer-major (``[L, n, row]``); a pool value is one
block over all layers (``[L * row]`` elements, as bytes), so both directions transpose::

    packed (export/import)   [L, n, row]  <-- permute -->  [n, L, row]  per-block values
"""

from __future__ import annotations

import torch

from rackserve.model.batch import KVCacheTensors
from rackserve.runner.kv_transfer import export_blocks, import_blocks


def _group_ids(caches: KVCacheTensors, group: str, block_ids: list[int]) -> tuple[list[int], ...]:
    return tuple(block_ids if name == group else [] for name in caches.groups)


def _row_shape(caches: KVCacheTensors, group: str) -> tuple[int, int]:
    """(layers L, elements per block and layer)."""
    tensors = caches.tensors[group]
    first = next(iter(tensors.values()))
    return len(tensors), first[0].numel()


def gather_blocks(caches: KVCacheTensors, group: str, block_ids: list[int]) -> torch.Tensor:
    """Blocks of ``group`` -> ``[n, L * row]`` (cache dtype, on the cache's device), one row
    per block; a fresh tensor, so later writes to the blocks do not change it."""
    num_layers, row = _row_shape(caches, group)
    packed = export_blocks(caches, _group_ids(caches, group, block_ids))
    packed = packed.view(num_layers, len(block_ids), row).transpose(0, 1)
    return packed.reshape(len(block_ids), num_layers * row)


def scatter_blocks(
    caches: KVCacheTensors, group: str, block_ids: list[int], values: torch.Tensor
) -> None:
    """``values`` [n, L * row] (any device) -> blocks ``block_ids`` of ``group``."""
    num_layers, row = _row_shape(caches, group)
    if values.shape != (len(block_ids), num_layers * row):
        raise ValueError(
            f"group {group}: {len(block_ids)} blocks need values of shape "
            f"{(len(block_ids), num_layers * row)}, got {tuple(values.shape)}"
        )
    packed = values.view(len(block_ids), num_layers, row).transpose(0, 1).reshape(-1)
    import_blocks(caches, _group_ids(caches, group, block_ids), packed)


def block_nbytes(caches: KVCacheTensors, group: str) -> int:
    num_layers, row = _row_shape(caches, group)
    return num_layers * row * next(iter(caches.tensors[group].values())).element_size()
