"""Sparse prefill attention on Hopper's warpgroup MMA, written in Gluon (Triton's explicit-layout
dialect): the contract of ``prefill_attn.paged_sparse_attention`` for 16-bit caches, 64 heads
and Dh = 512 (V4's), the work split between the two warpgroups as FlashMLA splits it.

Why not the Triton kernel's tiles: one query's 64 heads are the M of both dots, and the
[64, 512] fp32 output accumulator needs two warpgroups (128 registers a thread each). Triton
lays a chained dot's warps along M, so both warpgroups compute the same [64, BLOCK_N] scores
(1.5x the minimal FLOPs) and every tile runs load -> QK -> softmax -> PV in series on the
SM's only program (13.8% of bf16 peak on the CSA layer, ``prefill_attn.default_tiling``).

Here, per program (one query, 8 warps = 2 warpgroups):

- QK: the scores [64, BLOCK_N] with warps [4, 2]: each warpgroup computes half the tile's
  rows against all 512 dims (no repeat). A tile's row max: each warpgroup's half reduced in
  its own warps, the halves crossing through a [2, 64] shared buffer with one barrier (the
  compiler's reduction of the whole row takes three). The denominator is kept per score
  column and summed across the warpgroups once, after the last tile (a row sum a tile would
  cross them with two barriers more). The tile loop has two barriers: the ring's and the
  row max's (SASS of the 32-row tiling; six before session 43).
- P is stored to shared memory as bf16; PV runs with warps [4, 2] over the output columns:
  each warpgroup accumulates its [64, 256] half of the output from all of P.
- The row tiles are gathered by cp.async into a ring of ``NUM_STAGES`` slots, so the
  gathers of later tiles are in flight while a tile computes (the slots of a query's rows:
  no TMA on Hopper for row gathers). p is double-buffered: p(t + 1) goes to the buffer
  PV(t - 1) read and tile t + 3 to tile t - 1's slot, both finished in both warpgroups at
  the barrier that opened the iteration, so no barrier waits for the other warpgroup's PV.
- Softmax of tile t + 1 runs while PV of tile t is on the tensor cores (FlashAttention-3's
  intra-warpgroup overlap): QK(t + 1) is issued before PV(t), and wgmma groups retire in
  order, so waiting for one outstanding group leaves PV(t) running.
- q is fetched by cp.async as the program's first instruction, in flight during the span
  scan and the first gathers (a raw q is normed and rotated in shared memory once landed);
  the refills' slot indices load at the top of their iteration; the output goes through q's
  buffer to 16-byte stores.

Measured on the H200 (``benchmarks/prefill_bench.py``, 8192 queries, 2026-12-04, session 21
calls 1-5): HCA 1,461 us and CSA 3,212 us against the Triton kernel's 1,733 / 4,551 (19.4%
of bf16 peak on CSA against 13.7%), 0.004% / 0.000% of outputs outside the bf16 rule (the
limit is 0.1%). Three ring slots with one p buffer: 1,503 / 3,263; 16-row tiles: slower
(1,851 / 4,645: the QK dot's N of 8 a warpgroup). A persistent variant (one program an SM,
the next query's first tiles gathered during the current query's last; mbarriers a slot)
was slower, 1,574 / 3,704: the loop's extra scalar work and spills around the q load and
epilogue outweighed the hidden prologue. What bounds it now: one 8-warp program an SM
(255 registers, 200 KB shared memory), whose per-query prologue (the valid-flag scan, the
first gathers, tile 0's QK) and epilogue run with nothing beside them (~10 us a query, ~40%
of an HCA query), and QK's wgmma N of 16 a warpgroup.

Session 43's rework (the row max exchange, the column sums, the span's reductions in one, the
scores' registers reused as QK's accumulator operand, q by cp.async, the early slots, the
staged output), on an H100 (8192 queries, prefill_bench.py, 2026-12-07): HCA 1,466 -> 1,250
us (32-row tiles), CSA 2,852 -> 2,340 (64-row tiles, whose 112 bytes of spills are gone);
bench forward prefill:8192 44.6-45.0 -> 43.8-43.9 ms (benchmarks/results/2026-12-07-s44.md).

Numerics are the Triton kernel's default (``pv="rows"``): fp32 scores and online softmax in
the log2 domain, p rounded to bf16 for PV and the denominator summed from the rounded p, the
sink in the denominator at the end, the inverse RoPE of the output's rope slice, one store.

Shape legend: S queries, H heads (64), Dh head dim (512), Wa window rows and Wb compressed
rows per query, R rope dims. Valid rows and the [first, last] span are read as the Triton
kernel reads them (``prefill_attn.py``); any mask is correct, one run is fastest.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from rackserve.ops.triton.prefill_attn import kernel_inputs
from rackserve.ops.triton.sparse_attn import check_inputs

HEADS = 64  # the dots' M: one query's heads
HEAD_DIM = 512
Q_NORM_HEADS = 16  # heads a program norms at a time when q arrives raw (32 fp32 a thread)
_H = gl.constexpr(HEADS)
_DH = gl.constexpr(HEAD_DIM)


@dataclass(frozen=True)
class WgmmaTiling:
    """Launch shape: rows per tile (the QK dot's N, split between the warpgroups) and the
    depth of the gather ring."""

    block_n: int = 32
    num_stages: int = 4
    p_buffers: int = 2  # 1: one p buffer, a barrier before it is rewritten


# Queries of many rows take 64-row tiles: per tile, each warpgroup's QK reads all of q (64
# KB) from shared memory for a wgmma N of BLOCK_N / 2, so 64-row tiles read q half as often
# a row; the ring then holds 2 slots with one p buffer (200 KB of shared memory). 8192
# queries on the H200 (prefill_bench.py, benchmarks/results/2026-12-06-s27.md): CSA (128 +
# 512 rows a query) 3,244 -> 2,902 us, HCA after 65,536 cached (128 + 576) 3,717 -> 3,327;
# HCA at 8192 (128 + up to 64) 1,476 -> 1,483 and at 2048 364 -> 389 keep 32-row tiles.
# bench forward prefill:8192@65536 75.6-75.8 -> 74.2-74.7 ms.
WIDE_TILING = WgmmaTiling(block_n=64, num_stages=2, p_buffers=1)
WIDE_MIN_ROWS = 384


def default_tiling(rows_per_query: int) -> WgmmaTiling:
    """The tiling for queries of up to ``rows_per_query`` rows (window + compressed)."""
    return WIDE_TILING if rows_per_query >= WIDE_MIN_ROWS else WgmmaTiling()


@functools.lru_cache(maxsize=8)
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def supported(q: torch.Tensor, kv_a: torch.Tensor) -> bool:
    """The shapes and dtypes this kernel serves (else ``prefill_attn``'s Triton kernel)."""
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and kv_a.dtype == q.dtype
        and q.shape[1] == HEADS
        and q.shape[2] == HEAD_DIM
        and _is_sm90(q.device)
    )


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The output comes from here (tests fill it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def paged_sparse_attention(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    slots_a: torch.Tensor,
    kv_b: torch.Tensor,
    slots_b: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    q_norm_eps: float | None = None,
    tiling: WgmmaTiling | None = None,
) -> torch.Tensor:
    """``prefill_attn.paged_sparse_attention`` on sm_90 for ``supported`` inputs; a raw q
    (``q_norm_eps``) is normed and rotated as each program loads it."""
    check_inputs(q, kv_a, slots_a, kv_b, slots_b, valid, sinks, cos, sin, q_norm_eps)
    if not supported(q, kv_a):
        raise ValueError("prefill_attn_wgmma: 64 heads, Dh 512, 16-bit caches on sm_90 only")
    tiling = tiling or default_tiling(slots_a.shape[1] + slots_b.shape[1])
    num_queries = q.shape[0]
    out = _empty(tuple(q.shape), q.dtype, q.device)
    if num_queries == 0:
        return out
    q, slots_a, slots_b, valid, sinks, width, rope_start, rope_args = kernel_inputs(
        q, slots_a, slots_b, valid, sinks, cos, sin, out
    )
    prefill_attn_wgmma_kernel[(num_queries,)](
        q, kv_a, slots_a, kv_b, slots_b, valid, sinks, out,
        slots_a.shape[1], width, rope_start, scale * math.log2(math.e),
        q.stride(0), q.stride(1), kv_a.stride(0), kv_b.stride(0), slots_a.stride(0),
        slots_b.stride(0), valid.stride(0), out.stride(0), out.stride(1), *rope_args,
        q_norm_eps or 0.0,
        BLOCK_N=tiling.block_n,
        BLOCK_V=min(1024, max(16, triton.next_power_of_2(max(width, 1)))),
        ROPE=cos is not None,
        NUM_STAGES=tiling.num_stages,
        P_BUFFERS=tiling.p_buffers,
        Q_NORM=q_norm_eps is not None,
        Q_HEADS=Q_NORM_HEADS,
        num_warps=8,
    )  # fmt: skip
    return out


@gluon.jit
def _tile_rows(t, a_tiles, first, a_stop, b_start, b_stop, valid_row, width_a, contiguous, live,
               BLOCK_N: gl.constexpr, layout):  # fmt: skip
    """Tile t's row indices [BLOCK_N] (in ``layout``) into its list, the list's end, whether
    the tile is a window tile (tiles [0, a_tiles)) or a compressed one, and which rows count
    (in the list and valid: the flags are read only for a mask with holes, and only when
    ``live``)."""
    in_a = t < a_tiles
    rows = gl.where(in_a, first + t * BLOCK_N, b_start + (t - a_tiles) * BLOCK_N)
    rows = rows + gl.arange(0, BLOCK_N, layout=layout)
    stop = gl.where(in_a, a_stop, b_stop)
    ok = rows < stop
    flags = gl.where(in_a, valid_row, valid_row + width_a) + rows
    ok = ok & (gl.load(flags, mask=ok & ~contiguous & live, other=1) != 0)
    return rows, stop, in_a, ok


@gluon.jit
def _gather_rows(t, total, a_tiles, first, a_stop, b_start, b_stop, contiguous, valid_row,
                 width_a, slots_a_row, slots_b_row, safe_a, safe_b, BLOCK_N: gl.constexpr,
                 layout: gl.constexpr):  # fmt: skip
    """Tile t's slots [BLOCK_N] (``layout``'s row slice). A row past its list's end or in a
    hole of the mask takes a valid row of the list instead (its score is masked): no invalid
    slot is followed."""
    rows, stop, in_a, ok = _tile_rows(
        t, a_tiles, first, a_stop, b_start, b_stop, valid_row, width_a, contiguous, t < total,
        BLOCK_N, gl.SliceLayout(1, layout),
    )  # fmt: skip
    slot = gl.load(gl.where(in_a, slots_a_row, slots_b_row) + gl.minimum(rows, stop - 1),
                   mask=t < total, other=0)  # fmt: skip
    return gl.where(ok, slot, gl.where(in_a, safe_a, safe_b))


@gluon.jit
def _gather_issue(slot_smem, slot, t, total, a_tiles, kv_a_ptr, kv_b_ptr, stride_a, stride_b,
                  layout: gl.constexpr):  # fmt: skip
    """cp.async of tile t's rows, at ``slot`` [BLOCK_N], into ``slot_smem`` (nothing past
    the last tile)."""
    in_a = t < a_tiles
    row_ptr = gl.where(in_a, kv_a_ptr, kv_b_ptr) + slot.to(gl.int64) * gl.where(
        in_a, stride_a, stride_b
    )
    cols = gl.arange(0, _DH, layout=gl.SliceLayout(0, layout))
    live = (slot * 0 + t) < total
    cp.async_copy_global_to_shared(
        slot_smem, row_ptr[:, None] + cols[None, :], mask=live[:, None] & (cols < _DH)[None, :]
    )


@gluon.jit
def _gather(slot_smem, t, total, a_tiles, first, a_stop, b_start, b_stop, contiguous,
            valid_row, width_a, slots_a_row, slots_b_row, safe_a, safe_b, kv_a_ptr, kv_b_ptr,
            stride_a, stride_b, BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """cp.async of tile t's rows [BLOCK_N, Dh] into ``slot_smem``."""
    slot = _gather_rows(t, total, a_tiles, first, a_stop, b_start, b_stop, contiguous,
                        valid_row, width_a, slots_a_row, slots_b_row, safe_a, safe_b, BLOCK_N,
                        layout)  # fmt: skip
    _gather_issue(slot_smem, slot, t, total, a_tiles, kv_a_ptr, kv_b_ptr, stride_a, stride_b,
                  layout)  # fmt: skip


@gluon.jit
def _span_combine(first_a, last_a, count_a, first_b, last_b, count_b):
    return gl.minimum(first_a, first_b), gl.maximum(last_a, last_b), count_a + count_b


@gluon.jit
def _row_max(sc, buf, BLOCK_N: gl.constexpr):
    """The row max [H] of the scores sc [H, BLOCK_N] (warps [4, 2]: each warpgroup holds
    half the columns), in sc's row slice: each half reduced in its warpgroup's own warps, then
    crossed through ``buf`` ([2, H] fp32) with one barrier (the compiler's reduction of the
    whole row takes three)."""
    halves = gl.max(gl.reshape(sc, [_H, 2, BLOCK_N // 2]), axis=2)  # [H, 2]
    buf.store(gl.permute(halves, (1, 0)))
    gl.thread_barrier()
    rows: gl.constexpr = gl.SliceLayout(1, sc.type.layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    each = buf._reinterpret(gl.float32, [2, _H], flat)  # a row a half
    return gl.maximum(each.index(0).load(rows), each.index(1).load(rows))


@gluon.jit
def _scores_mask(t, a_tiles, first, a_stop, b_start, b_stop, valid_row, width_a, contiguous,
                 BLOCK_N: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """0 / -inf per row of tile t [BLOCK_N] (``layout``: the scores' column slice)."""
    _, _, _, ok = _tile_rows(t, a_tiles, first, a_stop, b_start, b_stop, valid_row, width_a,
                             contiguous, True, BLOCK_N, layout)  # fmt: skip
    return gl.where(ok, 0.0, float("-inf"))


@gluon.jit
def prefill_attn_wgmma_kernel(
    q_ptr,  # [S, H, Dh] bf16 / fp16
    kv_a_ptr,  # [Na, >= Dh] window rows by slot (unit column stride)
    slots_a_ptr,  # [S, Wa] int
    kv_b_ptr,  # [Nb, >= Dh] compressed entries by slot
    slots_b_ptr,  # [S, Wb] int
    valid_ptr,  # [S, Wa + Wb] uint8 (bool viewed)
    sinks_ptr,  # [H] fp32
    out_ptr,  # [S, H, Dh]
    width_a,
    width,  # Wa + Wb
    rope_start,
    qk_scale,  # scale * log2(e)
    stride_qs,
    stride_qh,
    stride_a,
    stride_b,
    stride_sa,
    stride_sb,
    stride_vs,
    stride_os,
    stride_oh,
    cos_ptr,  # [S, R/2] (ROPE only)
    sin_ptr,
    stride_cs,
    stride_ss,
    q_eps,  # Q_NORM only
    BLOCK_N: gl.constexpr,
    BLOCK_V: gl.constexpr,  # valid flags scanned at a time for the row span
    ROPE: gl.constexpr,
    NUM_STAGES: gl.constexpr,  # >= 2 + P_BUFFERS - 1: tiles t and t + 1 read, later ones land
    P_BUFFERS: gl.constexpr,  # 1: a barrier before p is rewritten; 2: none (a gather fewer)
    Q_NORM: gl.constexpr,  # q arrives raw: the unweighted norm (q_eps) + RoPE on its load
    Q_HEADS: gl.constexpr,  # Q_NORM: heads normed at a time (registers)
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # layouts (8 warps): loads in 16-byte vectors; both dots with warps [4, 2] (each
    # warpgroup: half the score columns, then half the output columns)
    load_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    flag_l: gl.constexpr = gl.BlockedLayout([4], [32], [8], [0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_l: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, _DH // 2, 16]
    )
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_H, _DH], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, _DH], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_H, BLOCK_N], dtype)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_l)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)

    s = gl.program_id(0).to(gl.int64)
    valid_row = valid_ptr + s * stride_vs
    heads_l = gl.arange(0, _H, layout=gl.SliceLayout(1, load_l))
    cols_l = gl.arange(0, _DH, layout=gl.SliceLayout(0, load_l))
    q_row = q_ptr + s * stride_qs
    # q's fetch first, in flight during the span scan and the first gathers (a raw q is normed
    # in shared memory once it has landed)
    q_smem = gl.allocate_shared_memory(dtype, [_H, _DH], q_sl)
    cp.async_copy_global_to_shared(q_smem, q_row + heads_l[:, None] * stride_qh
                                   + cols_l[None, :])  # fmt: skip
    cp.commit_group()

    # the span [first, last] of valid rows (prefill_attn.py), its three reductions in one
    first = width + 0
    last = width * 0 - 1
    count = width * 0
    for v0 in range(0, width, BLOCK_V):
        idx = v0 + gl.arange(0, BLOCK_V, layout=flag_l)
        ok = gl.load(valid_row + idx, mask=idx < width, other=0) != 0
        f, lt, c = gl.reduce(
            (gl.where(ok, idx, width), gl.where(ok, idx, -1), ok.to(gl.int32)), 0, _span_combine
        )
        first = gl.minimum(first, f)
        last = gl.maximum(last, lt)
        count += c
    contiguous = count == last - first + 1
    a_stop = gl.minimum(last + 1, width_a)
    b_start = gl.maximum(first, width_a) - width_a
    b_stop = last + 1 - width_a
    a_tiles = gl.cdiv(gl.maximum(a_stop - first, 0), BLOCK_N)
    b_tiles = gl.cdiv(gl.maximum(b_stop - b_start, 0), BLOCK_N)
    total = a_tiles + b_tiles
    slots_a_row = slots_a_ptr + s * stride_sa
    slots_b_row = slots_b_ptr + s * stride_sb
    safe_a = gl.load(slots_a_row + first, mask=a_tiles > 0, other=0)
    safe_b = gl.load(slots_b_row + (last - width_a), mask=b_tiles > 0, other=0)

    # shared memory beside q's: the ring of row tiles, p, a tile's row max halves
    kv_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, _DH], kv_sl)
    p_smem = gl.allocate_shared_memory(dtype, [P_BUFFERS, _H, BLOCK_N], p_sl)
    # [half, head] (rewritten by the next tile past the ring's barrier)
    max_smem = gl.allocate_shared_memory(
        gl.float32, [2, _H], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    )
    # P_BUFFERS 2: one slot stays free for the loop's first gather (tile NUM_STAGES - 1)
    for i in gl.static_range(NUM_STAGES - P_BUFFERS + 1):
        _gather(kv_smem.index(i), i, total, a_tiles, first, a_stop, b_start, b_stop,
                contiguous, valid_row, width_a, slots_a_row, slots_b_row, safe_a, safe_b,
                kv_a_ptr, kv_b_ptr, stride_a, stride_b, BLOCK_N, load_l)  # fmt: skip
        cp.commit_group()

    m = gl.full([_H], float("-inf"), gl.float32, rows_s)
    # the softmax denominator per score column, summed across the warpgroups once, after the
    # last tile (a tile's row sum would cross them through shared memory: two barriers)
    l_cols = gl.zeros([_H, BLOCK_N], gl.float32, s_l)
    acc = gl.zeros([_H, _DH], gl.float32, o_l)
    sc = gl.zeros([_H, BLOCK_N], gl.float32, s_l)  # QK's accumulator operand (use_acc=False)

    # tile 0: its scores and p (stored), before the loop
    cp.wait_group(NUM_STAGES - P_BUFFERS)
    gl.thread_barrier()
    if Q_NORM:  # the raw q in place: each block read by all, then rewritten
        for h0 in gl.static_range(0, _H, Q_HEADS):
            x = q_smem.slice(h0, Q_HEADS).load(load_l)
            x = _norm_rope_q(x, cos_ptr + s * stride_cs, sin_ptr + s * stride_ss, rope_start,
                             q_eps, Q_HEADS)  # fmt: skip
            gl.thread_barrier()
            q_smem.slice(h0, Q_HEADS).store(x)
        gl.thread_barrier()
    fence_async_shared()
    if total > 0:
        sc = warpgroup_mma(q_smem, kv_smem.index(0).permute((1, 0)), sc, use_acc=False,
                           is_async=True)  # fmt: skip
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        bias = _scores_mask(0, a_tiles, first, a_stop, b_start, b_stop, valid_row, width_a,
                            contiguous, BLOCK_N, cols_s)  # fmt: skip
        sc = sc * qk_scale + bias[None, :]
        m = _row_max(sc, max_smem, BLOCK_N)
        m_ref = gl.where(m == float("-inf"), 0.0, m)
        p = gl.exp2(sc - m_ref[:, None]).to(dtype)
        l_cols = p.to(gl.float32)
        p_smem.index(0).store(p)
        fence_async_shared()
        gl.thread_barrier()

    for t in range(total - 1):
        # invariant: p(t) is in p_smem and acc holds tiles < t, scaled to m(t); tiles t and
        # t + 1 have landed (the NUM_STAGES - 1 - P_BUFFERS later ones may be in flight)
        refill = t + NUM_STAGES + 1 - P_BUFFERS
        # the refill's slots: their load in flight during this iteration's dots; int32
        # across them (fewer registers; a slot is a cache row, < 2**31)
        slot = _gather_rows(refill, total, a_tiles, first, a_stop, b_start, b_stop,
                            contiguous, valid_row, width_a, slots_a_row, slots_b_row,
                            safe_a, safe_b, BLOCK_N, load_l).to(gl.int32)  # fmt: skip
        cp.wait_group(NUM_STAGES - 1 - P_BUFFERS)
        gl.thread_barrier()
        fence_async_shared()
        # QK(t + 1) first, then PV(t): waiting for one group leaves PV(t) running. Its
        # accumulator operand is tile t's scores (dead by now; use_acc=False ignores it), not
        # a zero tile live through the loop (registers: no spills in the 64-row tiling)
        sc = warpgroup_mma(q_smem, kv_smem.index((t + 1) % NUM_STAGES).permute((1, 0)), sc,
                           use_acc=False, is_async=True)  # fmt: skip
        acc = warpgroup_mma(p_smem.index(t % P_BUFFERS), kv_smem.index(t % NUM_STAGES), acc,
                            is_async=True)  # fmt: skip
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        bias = _scores_mask(t + 1, a_tiles, first, a_stop, b_start, b_stop, valid_row, width_a,
                            contiguous, BLOCK_N, cols_s)  # fmt: skip
        sc = sc * qk_scale + bias[None, :]
        m_new = gl.maximum(m, _row_max(sc, max_smem, BLOCK_N))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m - m_ref)
        p = gl.exp2(sc - m_ref[:, None]).to(dtype)
        l_cols = l_cols * alpha[:, None] + p.to(gl.float32)
        m = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if P_BUFFERS == 1:  # wait until both warpgroups are done with p and tile t's slot
            gl.thread_barrier()
        # P_BUFFERS 2: p(t + 1) into the buffer PV(t - 1) read and tile t + NUM_STAGES - 1
        # into tile t - 1's slot, both done in both warpgroups (this iteration's barrier)
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        p_smem.index((t + 1) % P_BUFFERS).store(p)
        _gather_issue(kv_smem.index(refill % NUM_STAGES), slot, refill, total, a_tiles,
                      kv_a_ptr, kv_b_ptr, stride_a, stride_b, load_l)  # fmt: skip
        cp.commit_group()
        fence_async_shared()
    if total > 0:  # the last tile's PV
        gl.thread_barrier()
        last = total - 1
        acc = warpgroup_mma(p_smem.index(last % P_BUFFERS), kv_smem.index(last % NUM_STAGES),
                            acc, is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)

    heads = gl.arange(0, _H, layout=rows_o)
    sink = gl.load(sinks_ptr + heads) * 1.4426950408889634
    m_o = gl.convert_layout(m, rows_o)
    l_o = gl.convert_layout(gl.sum(l_cols, axis=1), rows_o)
    m_all = gl.maximum(m_o, sink)
    alpha = gl.exp2(m_o - m_all)
    o = acc * (alpha / (l_o * alpha + gl.exp2(sink - m_all)))[:, None]
    if ROPE:
        o = _inverse_rope(o, cos_ptr + s * stride_cs, sin_ptr + s * stride_ss, rope_start, o_l)
    # through q's buffer (free: every QK is done, the barrier before the last PV) to 16-byte
    # stores, not from the MMA's accumulator layout
    q_smem.store(o.to(dtype))
    gl.thread_barrier()
    o16 = q_smem.load(load_l)
    gl.store(out_ptr + s * stride_os + heads_l[:, None] * stride_oh + cols_l[None, :], o16)


@gluon.jit
def _norm_rope_q(x, cos_row, sin_row, rope_start, q_eps, ROWS: gl.constexpr):
    """A block of raw q heads [ROWS, Dh] (16-bit) normed (unweighted) and rotated, in q's
    dtype: ``reference.rms_norm`` (the factor rounded to q's dtype, then the product)."""
    dtype: gl.constexpr = x.dtype
    x = x.to(gl.float32)
    factor = (1.0 / gl.sqrt_rn(gl.sum(x * x, axis=1) / _DH + q_eps)).to(dtype)
    x = (x * factor.to(gl.float32)[:, None]).to(dtype).to(gl.float32)
    return _rotate(x, cos_row, sin_row, rope_start, ROWS, False).to(dtype)


@gluon.jit
def _rotate(x, cos_row, sin_row, rope_start, ROWS: gl.constexpr, INVERSE: gl.constexpr):
    """``apply_rope(x, cos, sin)`` (INVERSE: with -sin) on x [ROWS, Dh] fp32, one query's
    angles: pairs (2i, 2i + 1) at or past rope_start rotate (the rope slice is the head's
    last R columns; the others pass through exactly). The result's layout is the join's."""
    even, odd = gl.split(gl.reshape(x, [ROWS, _DH // 2, 2]))
    pair_l: gl.constexpr = gl.SliceLayout(0, even.type.layout)
    even_col = 2 * gl.arange(0, _DH // 2, layout=pair_l)
    is_rope = even_col >= rope_start
    half = (even_col - rope_start) // 2
    c = gl.load(cos_row + half, mask=is_rope, other=1.0).to(gl.float32)
    sn = gl.load(sin_row + half, mask=is_rope, other=0.0).to(gl.float32)
    if INVERSE:
        sn = -sn
    new_even = even * c[None, :] - odd * sn[None, :]
    new_odd = odd * c[None, :] + even * sn[None, :]
    return gl.reshape(gl.join(new_even, new_odd), [ROWS, _DH])


@gluon.jit
def _inverse_rope(o, cos_row, sin_row, rope_start, o_l: gl.constexpr):
    """``apply_rope(o, cos, -sin)`` on o [H, Dh] fp32, in o's layout."""
    return gl.convert_layout(_rotate(o, cos_row, sin_row, rope_start, _H, True), o_l)
