"""Launch shape of the paged indexer's two launches: ``IndexerTiling``, ``default_tiling``.

One frozen dataclass configures both: the logits kernel's tiles (``indexer.py``) and the
top-k selection's algorithm and limits (``select_topk.py``), so ``paged_indexer_topk`` takes
one ``tiling``; the selection alone (``select_topk.topk_packed``, the prefill indexer's) takes
it too. It lives apart from both so that neither imports the other's module for it.
``default_tiling`` picks both from S queries, E entries per query and the device: host ints
only, CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from rackserve.ops.triton.topk import RADIX_BITS_CHOICES, RADIX_MAX_ENTRIES

SELECT_ALGORITHMS = ("bitonic", "radix")
# default_tiling's radix select: prefill-sized batches (the prefill indexer's threshold,
# ops.PREFILL_ATTN_MIN_TOKENS) of rows that one program holds; decode batches keep the
# bitonic kernel
RADIX_MIN_QUERIES = 512
RADIX_MIN_ENTRIES = 1024


@dataclass(frozen=True)
class IndexerTiling:
    """Launch shape of the logits kernel and the selection (see ``default_tiling``)."""

    block_e: int  # entries per tl.dot tile (>= 16)
    tiles: int  # tiles per program: q and weights are loaded once per program
    num_warps: int
    num_stages: int
    # select with the Triton bitonic top-k kernel (one program per query, the packed row in
    # registers) up to this many entries; beyond, chunk-wise top-k levels first (select_topk)
    triton_select_max_entries: int = 2048
    # entries per program of a chunk-wise level (raised to 2 next_pow2(k)); 0: torch.topk
    # for rows over the limit (the first M2 path)
    select_chunk: int = 2048
    # the one-program-per-query level of rows up to the limit, with no chunk-wise level
    # before: "bitonic" (tl.topk of the row) or "radix" (topk.radix_topk, E <= 8192)
    select_algorithm: str = "bitonic"
    radix_bits: int = 1  # bits of the k-th key found a pass (topk.RADIX_BITS_CHOICES)
    radix_warps: int = 0  # 0: topk.default_warps (8 keys a thread)

    def __post_init__(self) -> None:
        if self.select_algorithm not in SELECT_ALGORITHMS:
            raise ValueError(
                f"select_algorithm={self.select_algorithm!r}: use one of {SELECT_ALGORITHMS}"
            )
        if self.radix_bits not in RADIX_BITS_CHOICES:
            raise ValueError(f"radix_bits={self.radix_bits}: use one of {RADIX_BITS_CHOICES}")
        if self.radix_warps not in (0, 1, 2, 4, 8, 16, 32):
            raise ValueError(f"radix_warps={self.radix_warps}: use 0 (by E) or 1, 2 .. 32")


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiling(num_queries: int, num_entries: int, device: torch.device) -> IndexerTiling:
    """Launch shape from S, E and the device (host ints only: graph-safe).

    A program re-reads its query's 16 KB q (Hi=64, Di=128, bf16): with 64-entry tiles
    that is as many bytes as the keys of one tile, so a program walks several tiles; few
    queries or short contexts keep one tile per program to fill the SMs (~4 programs per
    SM). On CPU (the interpreter) big programs keep the interpreted loop short.
    """
    if device.type != "cuda":
        # the interpreted bitonic top-k is slow: tests select with it explicitly
        return IndexerTiling(64, tiles=8, num_warps=4, num_stages=1, triton_select_max_entries=0)
    # select: torch.topk on int64 is a radix select (8 digit passes) + a sort of the k
    # picks, 2+ launches; a bitonic top-k of a 1024-entry row in one program is a few us
    block_e = 64
    tiles_per_query = triton.cdiv(max(num_entries, 1), block_e)
    want = max(1, num_queries * tiles_per_query // (4 * _num_sms(device)))
    tiles = min(16, tiles_per_query, 1 << (want.bit_length() - 1))  # floor to a power of 2
    tiling = IndexerTiling(block_e=block_e, tiles=tiles, num_warps=4, num_stages=3)
    # many long rows: the radix select, every row in one program (topk.py: against the
    # bitonic top-k, which took 1.22 ms at S = 8192, E = 2048, ~2.5x fewer shuffle and
    # shared-memory operations and ~1.5x fewer instructions a row, compiled for sm_90)
    if num_queries >= RADIX_MIN_QUERIES and RADIX_MIN_ENTRIES <= num_entries <= RADIX_MAX_ENTRIES:
        return replace(
            tiling, select_algorithm="radix", triton_select_max_entries=RADIX_MAX_ENTRIES
        )
    return tiling
