"""Lightning-indexer top-k for prefill: ``paged_indexer_topk`` (the contract of
``ops.reference.paged_indexer_topk`` and of the decode kernel in ``indexer.py``) with query
tiles that share each key tile.

Shape legend: S queries, Hi index heads, Di index head dim, E entry slots per query, Q
queries per program (BLOCK_Q), N cache rows.

The queries of one prefill request read the same entries (``slots`` rows are equal), so a
program takes Q consecutive queries and, per tile of BLOCK_E entries, loads the keys once
for all of them: one dot [BLOCK_E, Di] x [Di, Q * Hi] (the Q queries' heads side by side as
the dot's N), relu, weighted by head, summed per query. Keys cross L2 once per Q queries
instead of once per query, which is what bounds the decode kernel at long cached contexts::

    entries   0 ........ visible to the tile's last query ........ E
              |- keys loaded once, masked per query (causal) -|- -inf, no loads -|

A tile whose queries disagree on a visible entry's slot (it straddles two requests) takes
the exact fallback: each query's own keys, one dot per query, the other columns discarded.
Logits are stored as the packed int64 keys of ``reference.topk_earliest`` (ties to the
earliest entry), then selected by ``select_topk.topk_packed`` on a GPU (bitonic top-k, in
chunk-wise levels for long rows), ``torch.topk`` on the CPU. Grids depend on shapes only:
no host sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.fp8 import widen
from rackserve.ops.triton.indexer import check_inputs
from rackserve.ops.triton.select_topk import topk_packed


@dataclass(frozen=True)
class PrefillIndexerTiling:
    """Launch shape of the logits kernel (see ``default_tiling``)."""

    block_q: int  # queries per program sharing a key tile (block_q * Hi is the dot's N)
    block_e: int  # entries per tile (the dot's M, >= 16)
    tiles: int  # entry tiles per program
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiling(
    num_queries: int, num_entries: int, num_heads: int, device: torch.device
) -> PrefillIndexerTiling:
    """Launch shape from S, E, Hi and the device (host ints only).

    GPU: N = Q * Hi = 256 (4 queries of 64 heads: the [64, 256] fp32 accumulator is 64
    registers a thread at 8 warps), 64-entry tiles, enough tiles per program that the grid
    still gives ~4 programs per SM. CPU (the interpreter): small programs.
    """
    block_h = max(16, triton.next_power_of_2(max(num_heads, 1)))
    block_q = max(1, 256 // block_h)
    if device.type != "cuda":
        return PrefillIndexerTiling(min(block_q, 4), 32, 4, 4, 1)
    per_query = triton.cdiv(max(num_entries, 1), 64)
    want = max(1, triton.cdiv(num_queries, block_q) * per_query // (4 * _num_sms(device)))
    tiles = min(16, per_query, 1 << (want.bit_length() - 1))
    return PrefillIndexerTiling(block_q, 64, tiles, 8, 3)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(q, key_cache, slots, weights, num_visible, k) -> None:
    check_inputs(q, key_cache, slots, weights, num_visible)  # the decode op's contract
    _, hi, di = q.shape
    if not 0 <= k <= slots.shape[1]:
        raise ValueError(f"k={k} must be in [0, E={slots.shape[1]}]")
    if hi > 256 or di > 512:
        raise ValueError(f"Hi={hi} > 256 or Di={di} > 512: one program holds its queries' q")


def indexer_logits(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    *,
    tiling: PrefillIndexerTiling | None = None,
) -> torch.Tensor:
    """Packed int64 keys [S, E] of sum_h w[s,h] * relu(q[s,h] . key[slots[s,e]]) * scale
    (-inf for e >= num_visible[s]), whose top-k is ``reference.topk_earliest`` of the
    scores. Inputs as ``paged_indexer_topk``."""
    _check(q, key_cache, slots, weights, num_visible, 0)
    num_queries, num_heads, head_dim = q.shape
    num_entries = slots.shape[1]
    out = _empty((num_queries, num_entries), torch.int64, q.device)
    if num_queries == 0 or num_entries == 0:
        return out
    if key_cache.stride(1) != 1:
        key_cache = key_cache.contiguous()
    q = q if q.stride(2) == 1 else q.contiguous()
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    weights = weights.float().contiguous()
    tiling = tiling or default_tiling(num_queries, num_entries, num_heads, q.device)
    programs = triton.cdiv(triton.cdiv(num_entries, tiling.block_e), tiling.tiles)
    prefill_indexer_logits_kernel[(triton.cdiv(num_queries, tiling.block_q), programs)](
        q, key_cache, slots, weights, num_visible, out, num_queries, num_entries, scale,
        q.stride(0), q.stride(1), key_cache.stride(0), slots.stride(0), weights.stride(0),
        out.stride(0),
        HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_Q=tiling.block_q,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_E=tiling.block_e,
        TILES=tiling.tiles,
        # fp32 inputs: IEEE fp32 dots; the interpreter upcasts 16-bit inputs too (its bf16
        # tl.dot multiplies raw bits): exact products, fp32 sums
        DOT_FP32=torch.float32 in (q.dtype, key_cache.dtype) or q.device.type != "cuda",
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )  # fmt: skip
    return out


def paged_indexer_topk(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    k: int,
    *,
    tiling: PrefillIndexerTiling | None = None,
) -> torch.Tensor:
    """``ops.reference.paged_indexer_topk`` for many queries: the shared-key logits launch,
    then the selection. q: [S, Hi, Di]; key_cache: [N, >= Di] (unit column stride);
    slots: [S, E] int; weights: [S, Hi]; num_visible: [S] int; 0 <= k <= E. Returns [S, k]
    int64 entry ids, best first, ties to the earliest (ids >= num_visible[s] only when
    fewer than k are visible: the caller masks them)."""
    _check(q, key_cache, slots, weights, num_visible, k)
    packed = indexer_logits(q, key_cache, slots, weights, scale, num_visible, tiling=tiling)
    if q.device.type != "cuda":  # the interpreted bitonic sort is slow
        return packed.topk(k, dim=-1).indices
    return topk_packed(packed, k)


@triton.jit
def _pack(logit, e):
    """The keys of ``reference.topk_earliest``: order-preserving fp32 bits above, 2^31 - 1 - e
    below (-0.0 packed as 0.0)."""
    logit = tl.where(logit == 0.0, 0.0, logit)
    bits = logit.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed-int order
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - e).to(tl.int64)


@triton.jit
def prefill_indexer_logits_kernel(
    q_ptr,  # [S, Hi, Di]
    key_ptr,  # [N, >= Di] rows, unit column stride
    slots_ptr,  # [S, E] int rows
    w_ptr,  # [S, Hi] fp32
    num_visible_ptr,  # [S] int
    out_ptr,  # [S, E] int64 packed keys
    num_queries,
    num_entries,
    scale,
    stride_qs,
    stride_qh,
    stride_kn,
    stride_ss,
    stride_ws,
    stride_os,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILES: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    s0 = tl.program_id(0).to(tl.int64) * BLOCK_Q  # row offsets past 2^31 at long contexts
    first_tile = tl.program_id(1) * TILES
    # the dot's N: column r is head r % BLOCK_H of query s0 + r // BLOCK_H
    r = tl.arange(0, BLOCK_Q * BLOCK_H)
    col_query = r // BLOCK_H
    col_head = r % BLOCK_H
    col_s = s0 + col_query
    col_ok = (col_s < num_queries) & (col_head < HEADS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + col_s[:, None] * stride_qs + col_head[:, None] * stride_qh + dims[None, :],
        mask=col_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qt = tl.trans(q)  # [BLOCK_D, BLOCK_Q * BLOCK_H]
    w = tl.load(w_ptr + col_s * stride_ws + col_head, mask=col_ok, other=0.0) * scale
    queries = s0 + tl.arange(0, BLOCK_Q)
    query_ok = queries < num_queries
    nv = tl.load(num_visible_ptr + queries, mask=query_ok, other=0)
    nv = tl.minimum(tl.maximum(nv, 0), num_entries).to(tl.int32)
    max_visible = tl.max(nv, axis=0)
    num_tiles = (num_entries + BLOCK_E - 1) // BLOCK_E
    last_tile = tl.minimum(first_tile + TILES, num_tiles)
    scored_end = tl.minimum(last_tile, (max_visible + BLOCK_E - 1) // BLOCK_E)
    out_rows = out_ptr + queries[None, :] * stride_os  # [1, BLOCK_Q]
    for tile in range(first_tile, scored_end):
        e = tile * BLOCK_E + tl.arange(0, BLOCK_E)
        seen = e[:, None] < nv[None, :]  # [BLOCK_E, BLOCK_Q] causal visibility
        lead = tl.load(slots_ptr + s0 * stride_ss + e, mask=e < max_visible, other=0)
        own = tl.load(
            slots_ptr + queries[None, :] * stride_ss + e[:, None],
            mask=seen,
            other=0,
        )
        differ = tl.max(tl.max((seen & (own != lead[:, None])).to(tl.int32), axis=1), axis=0)
        if differ == 0:  # one request: every query reads the lead query's keys
            keys = tl.load(
                key_ptr + lead.to(tl.int64)[:, None] * stride_kn + dims[None, :],
                mask=(e < max_visible)[:, None] & dim_ok[None, :],
                other=0.0,
            )
            keys = widen(keys, q_ptr.dtype.element_ty)  # fp8 keys: upcast in registers
            if DOT_FP32:
                dot = tl.dot(keys.to(tl.float32), qt, input_precision="ieee")
            else:
                dot = tl.dot(keys, qt)  # [BLOCK_E, BLOCK_Q * BLOCK_H], fp32 accumulation
        else:  # the tile straddles requests: each query's own keys, its own columns kept
            dot = tl.zeros((BLOCK_E, BLOCK_Q * BLOCK_H), tl.float32)
            for j in range(BLOCK_Q):
                vis_j = e < tl.load(num_visible_ptr + s0 + j, mask=s0 + j < num_queries, other=0)
                rows_j = tl.load(slots_ptr + (s0 + j) * stride_ss + e, mask=vis_j, other=0)
                keys_j = tl.load(
                    key_ptr + rows_j.to(tl.int64)[:, None] * stride_kn + dims[None, :],
                    mask=vis_j[:, None] & dim_ok[None, :],
                    other=0.0,
                )
                keys_j = widen(keys_j, q_ptr.dtype.element_ty)
                if DOT_FP32:
                    dot_j = tl.dot(keys_j.to(tl.float32), qt, input_precision="ieee")
                else:
                    dot_j = tl.dot(keys_j, qt)
                dot = tl.where((col_query == j)[None, :], dot_j, dot)
        part = tl.maximum(dot, 0.0) * w[None, :]
        logit = tl.sum(tl.reshape(part, (BLOCK_E, BLOCK_Q, BLOCK_H)), axis=2)  # [E, Q]
        logit = tl.where(seen, logit, float("-inf"))
        store_ok = query_ok[None, :] & (e < num_entries)[:, None]
        tl.store(out_rows + e[:, None], _pack(logit, e[:, None]), mask=store_ok)
    for tile in range(tl.maximum(scored_end, first_tile), last_tile):
        e = tile * BLOCK_E + tl.arange(0, BLOCK_E)
        hidden = tl.full((BLOCK_E, BLOCK_Q), float("-inf"), tl.float32)
        store_ok = query_ok[None, :] & (e < num_entries)[:, None]
        tl.store(out_rows + e[:, None], _pack(hidden, e[:, None]), mask=store_ok)
