"""Top-k of packed indexer rows: ``topk_packed`` (entry ids) and ``select_packed`` (the
picks' slots and [window | picks] validity, as ``select_entries`` returns them).

Shape legend: S queries, E entries per query (the row), K picks (k), W window, P chunks of a
row.

The rows are the packed int64 keys of ``indexer._store_logits`` (``reference.topk_earliest``
packing: (order-preserving fp32 bits << 32) | (2^31 - 1 - e)), all distinct, so every top-k
of them is the reference's stable sort: the same ids, in the same order. The selection (its
path chosen in ``_last_level``): one top-k program per query (rows up to
``IndexerTiling.triton_select_max_entries``), a bitonic ``tl.topk`` of the row
(``select_topk_kernel``) or, for prefill-sized batches of rows of 1024 to 8192 entries on a
GPU, the radix select of ``topk.py`` (the k-th key by counts, then a sort of the k picks
only: same answer); longer rows first go through levels of chunk-wise bitonic top-k
programs (grid S x P, each writes its chunk's best keys), which split the work of one query
over many SMs (S = 1 at E = 16384 took 92 us in ``torch.topk``). Grids and workspaces
depend on S, E and the device only: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait
from rackserve.ops.triton.indexer_tiling import IndexerTiling, default_tiling
from rackserve.ops.triton.select import select_entries, selection_outputs, store_selection
from rackserve.ops.triton.topk import RADIX_MAX_ENTRIES, radix_topk


@triton.jit
def select_topk_kernel(
    packed_ptr,  # [S, E] int64 keys of ``indexer._store_logits`` (or a previous level's picks)
    out_ptr,  # [S, k] int64 entry ids, best first; OUT_KEYS: [S, P * BLOCK_K] keys
    num_entries,
    k,
    chunk,  # entries per program along axis 1 (E when one program holds the row)
    stride_ps,
    stride_os,
    # SELECT: the picks as ``select_entries`` returns them (out_ptr: their slots [S, k])
    slots_ptr,  # [S, E] int64 entry slots
    num_visible_ptr,  # [S] int
    window_ptr,  # [S, W] uint8 (bool) window mask
    valid_ptr,  # [S, W + k] uint8 (bool) out
    stride_ss,
    stride_window,
    W,
    BLOCK_N: tl.constexpr,  # next_pow2(chunk)
    BLOCK_K: tl.constexpr,  # next_pow2(k) <= BLOCK_N
    OUT_KEYS: tl.constexpr,
    SELECT: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    """Bitonic top-BLOCK_K of entries [p * chunk, (p + 1) * chunk) of one query's packed
    row; the keys are distinct, so the sorted answer is ``torch.topk``'s, and the entry id
    is recovered from the low 32 bits. OUT_KEYS: write the BLOCK_K best keys (padding
    included: it sorts after every real key) to slot p of a candidate row, for a merge
    level: the top k of the union of the chunks' top k is the top k of the row. SELECT (the
    last level): the picks' slots and the [window | picks] validity instead of the ids."""
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    e = part * chunk + tl.arange(0, BLOCK_N)
    ok = (e < num_entries) & (tl.arange(0, BLOCK_N) < chunk)
    lowest = -9223372036854775807 - 1  # padding sorts after every real key
    keys = tl.load(packed_ptr + s * stride_ps + e, mask=ok, other=lowest)
    best = tl.topk(keys, BLOCK_K)  # [BLOCK_K] descending
    pick = tl.arange(0, BLOCK_K)
    if OUT_KEYS:
        tl.store(out_ptr + s * stride_os + part * BLOCK_K + pick, best)
    else:
        ids = 0x7FFFFFFF - (best & 0xFFFFFFFF)
        if SELECT:
            store_selection(
                s, ids, pick, pick < k, slots_ptr, stride_ss, num_visible_ptr, window_ptr,
                stride_window, out_ptr, valid_ptr, k, W, BLOCK_W,
            )  # fmt: skip
        else:
            tl.store(out_ptr + s * stride_os + pick, ids, mask=pick < k)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN / a sentinel)."""
    return torch.empty(shape, dtype=dtype, device=device)


def topk_packed(packed: torch.Tensor, k: int, tiling: IndexerTiling | None = None) -> torch.Tensor:
    """The ``k`` largest packed earliest-tie keys of each row, best first, as entry ids:
    one top-k launch (E <= ``tiling.triton_select_max_entries``: bitonic or radix),
    chunk-wise levels for longer rows, or ``torch.topk``. packed: [S, E] int64 -> [S, k]
    int64."""
    last = _last_level(packed, k, tiling)
    if last is None:
        return packed.topk(k, dim=-1).indices
    ids = _empty((packed.shape[0], k), torch.int64, packed.device)
    _select_last(last, ids, k)
    return ids


def select_packed(
    packed: torch.Tensor,
    k: int,
    slots: torch.Tensor,
    num_visible: torch.Tensor,
    window_valid: torch.Tensor,
    tiling: IndexerTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_entries(topk_packed(packed, k), slots, num_visible, window_valid)``, the
    selection done by the last top-k level itself (one launch fewer)."""
    num_queries = packed.shape[0]
    last = _last_level(packed, k, tiling) if num_queries else None
    if last is None:
        ids = packed.topk(k, dim=-1).indices
        return select_entries(ids, slots, num_visible, window_valid)
    out_slots, valid = selection_outputs(num_queries, k, slots, num_visible, window_valid)
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    window = window_valid if window_valid.stride(1) == 1 else window_valid.contiguous()
    selection = (slots, num_visible.contiguous(), window.view(torch.uint8), valid.view(torch.uint8))
    _select_last(last, out_slots, k, selection)
    return out_slots, valid


class _LastLevel(NamedTuple):
    """What the one-program-per-query level selects from, and how."""

    keys: torch.Tensor  # [S, num_entries] int64: the row, or the chunk-wise levels' picks
    num_entries: int
    block_k: int  # next_pow2(k), >= 2
    tiling: IndexerTiling
    radix: bool  # topk.radix_topk (the keys are the row itself), else the bitonic kernel


def _last_level(packed: torch.Tensor, k: int, tiling: IndexerTiling | None) -> _LastLevel | None:
    """Runs the chunk-wise levels a row too long for one program needs; returns what the
    last (one program per query) level selects from, or None when ``torch.topk`` does the
    selection."""
    num_queries, num_entries = packed.shape
    tiling = tiling or default_tiling(num_queries, num_entries, packed.device)
    limit = tiling.triton_select_max_entries
    if k == 0 or num_queries == 0 or (num_entries > limit and tiling.select_chunk <= 0):
        return None
    if limit < max(2, triton.next_power_of_2(k)):  # one program must hold k candidates
        return None
    block_k = max(2, triton.next_power_of_2(k))  # tl.topk needs k >= 2
    if tiling.select_algorithm == "radix" and k <= num_entries <= min(limit, RADIX_MAX_ENTRIES):
        return _LastLevel(packed, num_entries, block_k, tiling, radix=True)
    # rows longer than the limit: a level of chunk-wise top-k programs (grid S x P) writes
    # the P x BLOCK_K best keys, until one program can hold what is left
    chunk = max(2 * block_k, triton.next_power_of_2(tiling.select_chunk))  # each level halves
    while num_entries > tiling.triton_select_max_entries:
        parts = triton.cdiv(num_entries, chunk)
        picks = _empty((num_queries, parts * block_k), torch.int64, packed.device)
        _select(packed, picks, num_entries, k, chunk, block_k, (num_queries, parts), True)
        packed, num_entries = picks, parts * block_k
        if parts == 1:
            break
    return _LastLevel(packed, num_entries, block_k, tiling, radix=False)


def _select_last(
    last: _LastLevel, out: torch.Tensor, k: int, selection: tuple[torch.Tensor, ...] | None = None
) -> None:
    """The last level's launch into ``out`` (ids, or with ``selection`` the picks' slots)."""
    keys, num_entries, block_k, tiling, radix = last
    if not radix:
        grid = (keys.shape[0], 1)
        _select(keys, out, num_entries, k, num_entries, block_k, grid, False, selection)
        return
    # the picks' keys wait in out itself when it is int64 (no extra HBM write)
    work = out if out.dtype == torch.int64 else _empty(out.shape, torch.int64, out.device)
    radix_topk(keys, out, work, k, tiling.radix_bits, tiling.radix_warps, selection)


def _select(
    packed: torch.Tensor,
    out: torch.Tensor,
    num_entries: int,
    k: int,
    chunk: int,
    block_k: int,
    grid: tuple[int, int],
    out_keys: bool,
    selection: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """One ``select_topk_kernel`` launch over chunks of ``chunk`` entries; ``selection``:
    (slots, num_visible, window uint8, valid uint8 out) for a selecting last level."""
    block_n = max(block_k, triton.next_power_of_2(chunk))
    slots, num_visible, window, valid = selection or (packed, packed, packed, packed)
    width = window.shape[1] if selection else 0
    select_topk_kernel[grid](
        packed,
        out,
        num_entries,
        k,
        chunk,
        packed.stride(0),
        out.stride(0),
        slots,
        num_visible,
        window,
        valid,
        slots.stride(0),
        window.stride(0),
        width,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        OUT_KEYS=out_keys,
        SELECT=selection is not None,
        BLOCK_W=max(2, triton.next_power_of_2(width)),
        num_warps=4 if block_n <= 1024 else 8 if block_n <= 4096 else 16,
        **pdl(packed.device),
    )
