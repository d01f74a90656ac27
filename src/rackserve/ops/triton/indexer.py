"""Lightning-indexer logits over paged keys, then the top-k: ``paged_indexer_topk``.

Equals ``ops.reference.paged_indexer_topk`` (entry ids, ties to the earliest entry). Shape
legend: S queries, Hi index heads, Di index head dim, E entry slots per query (the context
bucket / r), N cache rows, C cache row stride.

One logits kernel, grid (S, cdiv(E, BLOCK_E * TILES)). A program loads its query's
[Hi, Di] q and weights once, then walks TILES tiles of BLOCK_E entries::

    entries   0 ........ num_visible ............ E
              |- scored --|- written -inf, no loads -|

For a tile it gathers key rows through ``slots`` (int64 row ids into the 2-D key cache),
``tl.dot`` [BLOCK_E, Di] x [Di, Hi] with fp32 accumulation (IEEE fp32 when an input is
fp32), relu, the weighted sum over heads. It stores either fp32 logits or, by default, the
packed int64 keys of ``reference.topk_earliest`` ((order-preserving fp32 bits << 32) |
(2^31 - 1 - e)), so every top-k of them is unique: the same ids, in the same order, as the
reference's stable sort. ``select_topk.py`` selects from them (``topk_packed``,
``select_packed``: bitonic or radix top-k, chunk-wise levels for long rows);
``indexer_tiling.py`` holds the launch shape of both (``IndexerTiling``, ``default_tiling``).
Grids and workspaces depend on S, E and the device only: no host sync, CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait
from rackserve.ops.triton.fp8 import FP8_KV_DTYPE, widen
from rackserve.ops.triton.indexer_tiling import IndexerTiling, default_tiling
from rackserve.ops.triton.select_topk import select_packed, topk_packed


@triton.jit
def indexer_logits_kernel(
    q_ptr,  # [S, Hi, Di]
    key_ptr,  # [N, >= Di] rows, unit column stride
    slots_ptr,  # [S, E] int64 row ids
    w_ptr,  # [S, Hi] fp32
    num_visible_ptr,  # [S] int
    out_ptr,  # [S, E] fp32 logits or int64 packed keys
    num_entries,
    scale,
    stride_qs,
    stride_qh,
    stride_kn,
    stride_ss,
    stride_ws,
    stride_os,
    HEADS: tl.constexpr,  # Hi; constexpr so the masks along Di are known per vector
    HEAD_DIM: tl.constexpr,  # Di (loads of whole 16-byte vectors need that)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TILES: tl.constexpr,
    PACKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    first_tile = tl.program_id(1) * TILES
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < HEADS
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + s * stride_qs + heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    qt = tl.trans(q)  # [BLOCK_D, BLOCK_H]
    w = tl.load(w_ptr + s * stride_ws + heads, mask=head_ok, other=0.0).to(tl.float32) * scale
    num_visible = tl.minimum(tl.maximum(tl.load(num_visible_ptr + s), 0), num_entries)
    num_tiles = (num_entries + BLOCK_E - 1) // BLOCK_E
    last_tile = tl.minimum(first_tile + TILES, num_tiles)
    scored_end = tl.minimum(last_tile, (num_visible + BLOCK_E - 1) // BLOCK_E)
    slot_row = slots_ptr + s * stride_ss
    out_row = out_ptr + s * stride_os
    for tile in range(first_tile, scored_end):
        e = tile * BLOCK_E + tl.arange(0, BLOCK_E)
        visible = e < num_visible
        rows = tl.load(slot_row + e, mask=visible, other=0).to(tl.int64)
        keys = tl.load(
            key_ptr + rows[:, None] * stride_kn + dims[None, :],
            mask=visible[:, None] & dim_ok[None, :],
            other=0.0,
        )
        keys = widen(keys, q_ptr.dtype.element_ty)  # fp8 keys: upcast in registers
        if DOT_FP32:
            dot = tl.dot(keys.to(tl.float32), qt, input_precision="ieee")
        else:
            dot = tl.dot(keys, qt)  # [BLOCK_E, BLOCK_H], fp32 accumulation
        logit = tl.sum(tl.maximum(dot, 0.0) * w[None, :], axis=1)
        logit = tl.where(visible, logit, float("-inf"))
        _store_logits(out_row, e, logit, num_entries, PACKED)
    for tile in range(tl.maximum(scored_end, first_tile), last_tile):
        e = tile * BLOCK_E + tl.arange(0, BLOCK_E)
        _store_logits(
            out_row, e, tl.full((BLOCK_E,), float("-inf"), tl.float32), num_entries, PACKED
        )


@triton.jit
def _store_logits(out_row, e, logit, num_entries, PACKED: tl.constexpr):
    """fp32 logits, or the packed keys of ``reference.topk_earliest`` (-0.0 packed as 0.0)."""
    if PACKED:
        logit = tl.where(logit == 0.0, 0.0, logit)
        bits = logit.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed-int order
        key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - e).to(tl.int64)
        tl.store(out_row + e, key, mask=e < num_entries)
    else:
        tl.store(out_row + e, logit, mask=e < num_entries)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN / a sentinel)."""
    return torch.empty(shape, dtype=dtype, device=device)


_KEY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    num_visible: torch.Tensor,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [S, Hi, Di], got shape {tuple(q.shape)}")
    s, hi, di = q.shape
    if key_cache.dim() != 2 or key_cache.shape[1] < di:
        raise ValueError(f"key_cache must be [N, >= {di}], got shape {tuple(key_cache.shape)}")
    if slots.dim() != 2 or slots.shape[0] != s or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be [{s}, E] int64, got {tuple(slots.shape)} {slots.dtype}")
    if tuple(weights.shape) != (s, hi):
        raise ValueError(f"weights must be [{s}, {hi}], got {tuple(weights.shape)}")
    if tuple(num_visible.shape) != (s,) or num_visible.is_floating_point():
        raise ValueError(f"num_visible must be [{s}] int, got {tuple(num_visible.shape)}")
    for name, t in (("key_cache", key_cache), ("slots", slots), ("weights", weights)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if num_visible.device != q.device:
        raise ValueError(f"num_visible is on {num_visible.device}, q on {q.device}")
    # e4m3 keys (--kv-cache-dtype fp8) are widened to q's dtype in registers
    if q.dtype not in _KEY_DTYPES or key_cache.dtype not in (*_KEY_DTYPES, FP8_KV_DTYPE):
        raise ValueError(f"q / key_cache dtypes {q.dtype} / {key_cache.dtype} not supported")
    if key_cache.dtype == FP8_KV_DTYPE:
        pass
    elif q.dtype != key_cache.dtype and torch.float32 not in (q.dtype, key_cache.dtype):
        raise ValueError(f"q {q.dtype} and key_cache {key_cache.dtype}: no common dot type")
    if hi > 256 or di > 512:
        raise ValueError(f"Hi={hi} > 256 or Di={di} > 512: one program holds all of q")


def indexer_logits(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    *,
    packed: bool = False,
    tiling: IndexerTiling | None = None,
) -> torch.Tensor:
    """Indexer scores [S, E]: sum_h w[s,h] * relu(q[s,h] . key[slots[s,e]]) * scale, -inf
    for e >= num_visible[s]. float32, or with ``packed`` the int64 keys whose top-k is
    ``reference.topk_earliest`` of the scores. Inputs as ``paged_indexer_topk``.
    """
    check_inputs(q, key_cache, slots, weights, num_visible)
    num_queries, num_heads, head_dim = q.shape
    num_entries = slots.shape[1]
    out = _empty((num_queries, num_entries), torch.int64 if packed else torch.float32, q.device)
    if num_queries == 0 or num_entries == 0:
        return out
    if key_cache.stride(1) != 1:
        key_cache = key_cache.contiguous()
    q = q if q.stride(2) == 1 else q.contiguous()
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    weights = weights.float()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    tiling = tiling or default_tiling(num_queries, num_entries, q.device)
    programs = triton.cdiv(triton.cdiv(num_entries, tiling.block_e), tiling.tiles)
    indexer_logits_kernel[(num_queries, programs)](
        q,
        key_cache,
        slots,
        weights,
        num_visible,
        out,
        num_entries,
        scale,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        slots.stride(0),
        weights.stride(0),
        out.stride(0),
        HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_E=tiling.block_e,
        TILES=tiling.tiles,
        PACKED=packed,
        # fp32 inputs: IEEE fp32 dots. On CPU (the interpreter, whose bf16 tl.dot multiplies
        # the raw uint16 bits) 16-bit inputs are upcast too: exact products, fp32 sums.
        DOT_FP32=torch.float32 in (q.dtype, key_cache.dtype) or q.device.type != "cuda",
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
        **pdl(q.device),
    )
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
    tiling: IndexerTiling | None = None,
) -> torch.Tensor:
    """Fused ``ops.reference.paged_indexer_topk``: the logits launch, then one bitonic
    top-k launch (E <= ``tiling.triton_select_max_entries``) or ``torch.topk``
    (``select_topk.topk_packed``).

    q: [S, Hi, Di] (fp32/bf16/fp16); key_cache: [N, C >= Di], the index keys in its first
    Di columns (row stride C, unit column stride); slots: [S, E] int64 rows of each query's
    entries 0..E-1; weights: [S, Hi] float32; num_visible: [S] int; 0 <= k <= E. Returns
    [S, k] int64 entry ids, best first, ties to the earliest; ids >= num_visible[s] come
    only when fewer than k are visible (the caller masks them).
    """
    if not 0 <= k <= slots.shape[-1]:
        raise ValueError(f"k={k} must be in [0, E={slots.shape[-1]}]")
    tiling = tiling or default_tiling(q.shape[0], slots.shape[-1], q.device)
    packed = indexer_logits(
        q, key_cache, slots, weights, scale, num_visible, packed=True, tiling=tiling
    )
    return topk_packed(packed, k, tiling)


def paged_indexer_select(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    num_visible: torch.Tensor,
    k: int,
    window_valid: torch.Tensor,
    *,
    tiling: IndexerTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``ops.reference.paged_indexer_select``: the logits launch, then one top-k
    launch that also writes the picks' slots and the [window | picks] validity (rows that
    fit one program; longer rows add their chunk-wise levels first). Inputs as
    ``paged_indexer_topk``, plus window_valid [S, W] bool; returns (slots [S, k], valid
    [S, W + k] bool), as ``select_entries``."""
    if not 0 <= k <= slots.shape[-1]:
        raise ValueError(f"k={k} must be in [0, E={slots.shape[-1]}]")
    tiling = tiling or default_tiling(q.shape[0], slots.shape[-1], q.device)
    packed = indexer_logits(
        q, key_cache, slots, weights, scale, num_visible, packed=True, tiling=tiling
    )
    return select_packed(packed, k, slots, num_visible, window_valid, tiling)
