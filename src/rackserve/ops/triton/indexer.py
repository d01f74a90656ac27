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
reference's stable sort. The selection: one top-k program per query (rows up to
``triton_select_max_entries``), a bitonic ``tl.topk`` of the row or, for prefill-sized
batches of rows of 1024 to 8192 entries on a GPU, the radix select of ``topk.py`` (the
k-th key by counts, then a sort of the k picks only: same answer); longer rows first go
through levels of chunk-wise bitonic top-k programs (grid S x P, each writes its chunk's
best keys), which split the work of one query over many SMs (S = 1 at E = 16384 took 92 us
in ``torch.topk``). Grids and workspaces depend on S, E and the device only: no host sync,
CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait
from rackserve.ops.triton.fp8 import FP8_KV_DTYPE, widen
from rackserve.ops.triton.select import select_entries, selection_outputs, store_selection
from rackserve.ops.triton.topk import RADIX_BITS_CHOICES, RADIX_MAX_ENTRIES, radix_topk

SELECT_ALGORITHMS = ("bitonic", "radix")
# default_tiling's radix select: prefill-sized batches (the prefill indexer's threshold,
# ops.PREFILL_ATTN_MIN_TOKENS) of rows that one program holds; decode batches keep the
# bitonic kernel
RADIX_MIN_QUERIES = 512
RADIX_MIN_ENTRIES = 1024


@dataclass(frozen=True)
class IndexerTiling:
    """Launch shape of the logits kernel (see ``default_tiling``)."""

    block_e: int  # entries per tl.dot tile (>= 16)
    tiles: int  # tiles per program: q and weights are loaded once per program
    num_warps: int
    num_stages: int
    # select with the Triton bitonic top-k kernel (one program per query, the packed row in
    # registers) up to this many entries; beyond, chunk-wise top-k levels first (below)
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


@triton.jit
def select_topk_kernel(
    packed_ptr,  # [S, E] int64 keys of ``_store_logits`` (or a previous level's picks)
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
    top-k launch (E <= ``tiling.triton_select_max_entries``) or ``torch.topk``.

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
