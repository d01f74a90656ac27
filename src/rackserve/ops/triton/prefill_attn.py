"""Sparse prefill attention: ``paged_sparse_attention`` for many queries (prefill and mixed
steps), the same contract as ``ops.reference.paged_sparse_attention`` and the decode kernel
(``sparse_attn.py``), tiled for throughput instead of latency.

Shape legend: S queries (the flat varlen batch: every request's new tokens back to back),
H heads, Dh head dim, Wa window rows and Wb compressed rows per query (M = Wa + Wb),
R rope dims (the trailing slice of a head).

Each query has its own index lists (``slots_a``: its window, oldest first; ``slots_b``: the
visible HCA entries or the indexer's top-k CSA entries) and ``valid`` [S, M] over
[window | compressed]. The visible rows of a prefill query are one contiguous run: the
window is valid from max(0, W - 1 - p) on (a suffix), the compressed rows up to the number
visible or picked (a prefix). So a program first scans its query's ``valid`` row for the
first and last valid row and walks only that span: early queries of a long prompt skip the
window rows before position 0 and the entries not yet closed, with no tile wasted on them.

``prefill_attn_kernel``, grid (cdiv(H, BLOCK_H) * NUM_DV, S): program (hb, dv, s) holds the
query's BLOCK_H heads (the dots' M: with H = 64 one program holds every head, so each
gathered row tile feeds all heads of the query once: MQA, K = V) and walks row tiles of
BLOCK_N through the slots, software-pipelined (``NUM_STAGES``: the gathers of later tiles
are in flight while a tile computes). Online softmax in fp32, log2 domain; the sink joins
the denominator at the end; the optional inverse RoPE rotates the output's rope slice back;
the output is written once. No splits, no combine, no workspace: a prefill has enough
queries to fill the GPU (S x cdiv(H, BLOCK_H) programs). Grids depend on the shapes only:
no host syncs, CUDA-graph safe, deterministic.

Numerics: FP32_DOTS (fp32 inputs, and the interpreter, whose tl.dot mishandles bf16) uses
IEEE fp32 dots, rounding p (and v) as the tensor-core path would. The PV product of 16-bit
rows (``PV``): 0 "rows": p in the rows' dtype (bf16 p: 8 bits; normalised by the sum of the
rounded p, still ~0.09% of outputs fall outside the bf16 rule of the tests at Dh 64, whose
limit is 0.1%); 1 "split": p = hi + lo, two dots carrying ~16 bits of
p, as the decode kernel does (on sm_90 the chained dots take a warp layout that spills the
[64, 512] accumulator); 2 "fp16": p and the row tile in fp16 (11 bits of p; bf16 -> fp16 is
exact for normalised rows, |v| < 65504), one dot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import round_as
from rackserve.ops.triton.fp8 import widen
from rackserve.ops.triton.sparse_attn import check_inputs, normed_q

_PV_MODES = {"rows": 0, "split": 1, "fp16": 2}

# The Gluon wgmma kernel (``prefill_attn_wgmma.py``: the work split between the warpgroups,
# the gathers in a ring, softmax beside PV) serves what it supports (64 heads, Dh 512,
# 16-bit caches, sm_90) when no tiling is asked for: 1.2x (HCA) to 1.4x (CSA) faster at 8192
# queries on the H200, prefill:8192 49.6 -> 47.3 ms in bench forward (2026-12-04).
WGMMA = True


@dataclass(frozen=True)
class PrefillTiling:
    """Launch shape (powers of two; see ``default_tiling``)."""

    block_h: int  # heads per program: the dots' M (>= 16)
    block_n: int  # rows per tile (>= 16)
    num_dv: int  # programs per head block, each owning Dh / num_dv output columns
    num_warps: int
    num_stages: int  # software-pipelining depth of the row gathers
    pv: str = "fp16"  # 16-bit rows: the PV operands, "fp16" | "split" | "rows" (docstring)


def default_tiling(
    num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> PrefillTiling:
    """Launch shape from H, Dh, the dtype and the device (host ints only).

    16-bit on a GPU: every head of a query in a program (64 heads: the M of the wgmma) and
    the whole Dh in it, so each gathered row tile feeds QK and PV once, 32-row tiles, 2
    stages, a bf16 p (``pv="rows"``, as FlashAttention rounds P: the row tile feeds both
    dots as loaded, no conversion). On the H200 (``benchmarks/prefill_bench.py
    --attention-only``, 8192 queries, 2026-12-03) the HCA layer takes 1.73 ms (1.94 with
    64-row tiles), CSA 4.53 ms (4.60); 0.004% (HCA) and 0.000% (CSA) of the outputs fall
    outside the bf16 rule (the limit is 0.1%). The kernel is latency-bound, not
    issue-bound: cutting the 64-row loop's instructions by a quarter (this version) left
    its time where it was. ncu of the CSA layer: one 8-warp program per SM (255 registers),
    1.22 instructions a cycle, ALU the busiest pipe at 32% (13.8% of bf16 peak in FLOPs).
    At the interpreter tests' Dh 64 a bf16 p leaves 0.04-0.39% outside, which is why PV in
    fp16 ("fp16": 11 bits of p) was the default until 2026-12-02. fp32 (IEEE dots, no
    tensor cores): 32 heads, 16-row tiles, 2 stages (117 KB).
    On CPU (the interpreter): small programs. ``benchmarks/prefill_bench.py`` sweeps the
    alternatives.
    """
    block_h = min(64, max(16, triton.next_power_of_2(max(num_heads, 1))))
    if device.type != "cuda":
        return PrefillTiling(block_h, 32, 1, 4, 1)
    if dtype == torch.float32:
        return PrefillTiling(min(block_h, 32), 16, 2, 8, 2)
    return PrefillTiling(block_h, 32, 1, 8, 2, pv="rows")


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
    tiling: PrefillTiling | None = None,
) -> torch.Tensor:
    """``ops.reference.paged_sparse_attention`` in one launch, tiled for many queries.

    q: [S, H, Dh] (fp32/bf16/fp16); kv_a: [Na, >= Dh], kv_b: [Nb, >= Dh] cache views in
    q's dtype or both float8 e4m3 (widened in registers), unit column stride; slots_a:
    [S, Wa], slots_b: [S, Wb] int32/int64 (Wb may be 0); valid: [S, Wa + Wb] bool (invalid
    rows are never read); sinks: [H]; cos, sin: [S, R/2] or None (the inverse RoPE of the
    output's last R channels); q_norm_eps: q arrives raw, and is normed (unweighted) and
    rotated first (the wgmma kernel does it on its q load, this one with ``normed_q``).
    Fastest when each query's valid rows form one run (a prefill's always do); any mask
    is correct. Returns [S, H, Dh] in q's dtype.
    """
    if WGMMA and tiling is None and q.is_cuda:
        from rackserve.ops.triton import prefill_attn_wgmma

        if prefill_attn_wgmma.supported(q, kv_a):
            return prefill_attn_wgmma.paged_sparse_attention(
                q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale, cos, sin,
                q_norm_eps=q_norm_eps,
            )  # fmt: skip
    check_inputs(q, kv_a, slots_a, kv_b, slots_b, valid, sinks, cos, sin, q_norm_eps)
    q = normed_q(q, q_norm_eps, cos, sin)
    num_queries, num_heads, head_dim = q.shape
    out = _empty((num_queries, num_heads, head_dim), q.dtype, q.device)
    if num_queries == 0 or num_heads == 0:
        return out
    tiling = tiling or default_tiling(num_heads, head_dim, q.dtype, q.device)
    q, slots_a, slots_b, valid, sinks, width, rope_start, rope_args = kernel_inputs(
        q, slots_a, slots_b, valid, sinks, cos, sin, out
    )
    rope = cos is not None
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_dv = max(1, min(tiling.num_dv, block_d // 16))
    grid = (triton.cdiv(num_heads, tiling.block_h) * num_dv, num_queries)
    prefill_attn_kernel[grid](
        q, kv_a, slots_a, kv_b, slots_b, valid, sinks, out,
        num_heads, head_dim, slots_a.shape[1], width, rope_start, scale * math.log2(math.e),
        q.stride(0), q.stride(1), kv_a.stride(0), kv_b.stride(0), slots_a.stride(0),
        slots_b.stride(0), valid.stride(0), out.stride(0), out.stride(1), *rope_args,
        BLOCK_H=tiling.block_h,
        BLOCK_N=tiling.block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_d // num_dv,
        NUM_DV=num_dv,
        BLOCK_V=min(1024, max(16, triton.next_power_of_2(max(width, 1)))),
        ROPE=rope,
        EVEN_D=head_dim == block_d,
        NUM_STAGES=tiling.num_stages,
        PV=_PV_MODES[tiling.pv] if q.dtype != torch.float32 else 0,
        FP32_DOTS=q.dtype == torch.float32 or q.device.type != "cuda",
        num_warps=tiling.num_warps,
    )  # fmt: skip
    return out


def kernel_inputs(
    q: torch.Tensor,
    slots_a: torch.Tensor,
    slots_b: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple:
    """The prefill kernels' launch inputs (this one's and ``prefill_attn_wgmma``'s): q with
    unit column stride, contiguous slot lists, ``valid`` as uint8, fp32 sinks, the number of
    rows a query lists (Wa + Wb), where the rope slice starts, and the rope arguments
    (cos, sin, their row strides; ``out`` stands in for both without RoPE). Returns
    (q, slots_a, slots_b, valid, sinks, width, rope_start, rope_args)."""
    if q.stride(2) != 1:
        q = q.contiguous()
    rope = cos is not None
    if rope:
        cos, sin = cos.contiguous(), sin.contiguous()
    rope_start = q.shape[2] - (cos.shape[1] * 2 if rope else 0)
    rope_args = (cos, sin, cos.stride(0), sin.stride(0)) if rope else (out, out, 0, 0)
    width = slots_a.shape[1] + slots_b.shape[1]
    slots = (slots_a.contiguous(), slots_b.contiguous())
    flags = valid.contiguous().view(torch.uint8)
    return q, *slots, flags, sinks.to(torch.float32).contiguous(), width, rope_start, rope_args


@triton.jit
def _inverse_rope(o, cos_row, sin_row, col0, rope_start, head_dim,
                  BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    """``apply_rope(o, cos, -sin)`` on o [BLOCK_H, BLOCK_DV] fp32, the head's columns
    col0 + 0..BLOCK_DV-1 (col0 even): pairs (2i, 2i+1) at or past rope_start rotate back."""
    even, odd = tl.split(tl.reshape(o, (BLOCK_H, BLOCK_DV // 2, 2)))
    even_col = col0 + 2 * tl.arange(0, BLOCK_DV // 2)
    is_rope = (even_col >= rope_start) & (even_col < head_dim)
    half = (even_col - rope_start) // 2
    c = tl.load(cos_row + half, mask=is_rope, other=1.0).to(tl.float32)  # nope: identity
    sn = tl.load(sin_row + half, mask=is_rope, other=0.0).to(tl.float32)
    new_even = even * c[None, :] + odd * sn[None, :]
    new_odd = odd * c[None, :] - even * sn[None, :]
    return tl.reshape(tl.join(new_even, new_odd), (BLOCK_H, BLOCK_DV))


@triton.jit
def prefill_attn_kernel(
    q_ptr,  # [S, H, Dh]
    kv_a_ptr,  # [Na, >= Dh] window rows by slot (unit column stride)
    slots_a_ptr,  # [S, Wa] int
    kv_b_ptr,  # [Nb, >= Dh] compressed entries by slot
    slots_b_ptr,  # [S, Wb] int
    valid_ptr,  # [S, Wa + Wb] uint8 (bool viewed)
    sinks_ptr,  # [H] fp32
    out_ptr,  # [S, H, Dh]
    num_heads,
    head_dim,
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
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= Dh, power of two
    BLOCK_DV: tl.constexpr,  # output columns per program (BLOCK_D / NUM_DV)
    NUM_DV: tl.constexpr,
    BLOCK_V: tl.constexpr,  # valid flags scanned at a time for the row span
    ROPE: tl.constexpr,
    EVEN_D: tl.constexpr,  # Dh = BLOCK_D: row loads without a column mask
    NUM_STAGES: tl.constexpr,
    PV: tl.constexpr,  # 0 p in the rows' dtype, 1 p = hi + lo, 2 p and rows in fp16
    FP32_DOTS: tl.constexpr,
):
    pid_h = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    dv = pid_h % NUM_DV
    heads = (pid_h // NUM_DV) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < head_dim
    dv_cols = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = dv_cols < head_dim
    valid_row = valid_ptr + s * stride_vs

    # the span [first, last] of valid rows: tiles outside it hold no valid row; when every
    # row in it is valid (a prefill's always are) the tiles load no flags
    first = tl.full((), 0, tl.int32) + width  # int32 scalars (loop-carried)
    last = tl.full((), -1, tl.int32)
    count = tl.full((), 0, tl.int32)
    for v0 in range(0, width, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        ok = tl.load(valid_row + idx, mask=idx < width, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(ok, idx, width), axis=0))
        last = tl.maximum(last, tl.max(tl.where(ok, idx, -1), axis=0))
        count += tl.sum(ok.to(tl.int32), axis=0)
    contiguous = count == last - first + 1

    q_rows = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + cols[None, :], mask=head_ok[:, None] & col_ok[None, :], other=0.0)
    if FP32_DOTS:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    # the window's rows [first, min(last + 1, Wa)) in tiles, then the compressed rows from Wa
    # on: each tile reads one slot list and one cache, chosen per tile (scalars). Rows are
    # loaded unmasked: a row past the span or in a hole of the mask reads a valid row of its
    # list instead (the first valid row for the window, the last for the compressed entries:
    # each list with a tile holds that row) and its score is -inf, so no invalid slot is
    # ever followed and no flag or mask is evaluated per element
    a_stop = tl.minimum(last + 1, width_a)
    b_start = tl.maximum(first, width_a) - width_a
    b_stop = last + 1 - width_a
    a_tiles = tl.cdiv(tl.maximum(a_stop - first, 0), BLOCK_N)
    b_tiles = tl.cdiv(tl.maximum(b_stop - b_start, 0), BLOCK_N)
    slots_a_row = slots_a_ptr + s * stride_sa
    slots_b_row = slots_b_ptr + s * stride_sb
    safe_a = tl.load(slots_a_row + first, mask=a_tiles > 0, other=0)
    safe_b = tl.load(slots_b_row + (last - width_a), mask=b_tiles > 0, other=0)
    for t in tl.range(0, a_tiles + b_tiles, num_stages=NUM_STAGES):
        in_a = t < a_tiles
        rows = tl.where(in_a, first + t * BLOCK_N, b_start + (t - a_tiles) * BLOCK_N)
        rows += tl.arange(0, BLOCK_N)
        stop = tl.where(in_a, a_stop, b_stop)
        ok = rows < stop
        # a mask with holes: its flags (no load at all for one run of valid rows)
        flags = tl.where(in_a, valid_row, valid_row + width_a) + rows
        ok = ok & (tl.load(flags, mask=ok & ~contiguous, other=1) != 0)
        slot = tl.load(tl.where(in_a, slots_a_row, slots_b_row) + tl.minimum(rows, stop - 1))
        slot = tl.where(ok, slot, tl.where(in_a, safe_a, safe_b))
        row_ptr = tl.where(in_a, kv_a_ptr, kv_b_ptr) + slot.to(tl.int64) * tl.where(
            in_a, stride_a, stride_b
        )
        m, l_sum, acc = _attend(q, m, l_sum, acc, row_ptr, ok, cols, col_ok, dv_cols, dv_ok,
                                qk_scale, q_ptr.dtype.element_ty, EVEN_D, NUM_DV, PV,
                                FP32_DOTS)  # fmt: skip

    sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
    m_all = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_all)
    o = acc * (alpha / (l_sum * alpha + tl.exp2(sink - m_all)))[:, None]
    if ROPE:
        o = _inverse_rope(o, cos_ptr + s * stride_cs, sin_ptr + s * stride_ss, dv * BLOCK_DV,
                          rope_start, head_dim, BLOCK_H, BLOCK_DV)  # fmt: skip
    out_ty = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + s * stride_os + heads[:, None] * stride_oh + dv_cols[None, :]
    tl.store(out_ptrs, round_as(o, out_ty).to(out_ty), mask=head_ok[:, None] & dv_ok[None, :])


@triton.jit
def _widen_16(x):
    """A 16-bit float tensor as fp32 by its bits (bf16: the high half of the fp32 pattern;
    fp16 through the cast): the compiler folds ``x.to(fp32)`` of a just-rounded value into
    an integer rounding of the fp32 input, ~5 instructions an element on sm_90."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _attend(q, m, l_sum, acc, row_ptr, ok, cols, col_ok, dv_cols, dv_ok, qk_scale,
            dtype: tl.constexpr, EVEN_D: tl.constexpr, NUM_DV: tl.constexpr, PV: tl.constexpr,
            FP32_DOTS: tl.constexpr):  # fmt: skip
    """One tile of rows into the online softmax: ``row_ptr`` [BLOCK_N] (every one a valid
    row of the cache), ``ok`` [BLOCK_N] the rows that count. Returns (m, l_sum, acc)."""
    if EVEN_D:  # Dh = BLOCK_D: no mask
        kv = tl.load(row_ptr[:, None] + cols[None, :])
    else:
        kv = tl.load(row_ptr[:, None] + cols[None, :], mask=col_ok[None, :], other=0.0)
    kv = widen(kv, dtype)  # fp8 rows: upcast in registers
    if FP32_DOTS:
        scores = tl.dot(q, tl.trans(kv.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(kv))
    scores = scores * qk_scale + tl.where(ok, 0.0, float("-inf"))[None, :]  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: no NaN
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    if NUM_DV == 1:
        v = kv
    else:  # this program's output columns of the same rows (L2 hits)
        v = tl.load(row_ptr[:, None] + dv_cols[None, :], mask=dv_ok[None, :], other=0.0)
        v = widen(v, dtype)
    acc = acc * alpha[:, None]
    if FP32_DOTS:  # p (and v) rounded as on the tensor-core path
        if PV == 2:
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v32 = round_as(v.to(tl.float32), tl.float16)
            acc = tl.dot(round_as(p, tl.float16), v32, acc, input_precision="ieee")
        else:
            p_hi = round_as(p, v.dtype)
            if PV == 0:  # normalised by the weights PV uses: the rounded p sum to 1
                l_sum = l_sum * alpha + tl.sum(p_hi, axis=1)
            else:
                l_sum = l_sum * alpha + tl.sum(p, axis=1)
            v32 = v.to(tl.float32)
            acc = tl.dot(p_hi, v32, acc, input_precision="ieee")
            if PV == 1:
                acc = tl.dot(round_as(p - p_hi, v.dtype), v32, acc, input_precision="ieee")
    elif PV == 2:
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
    else:
        p_hi = p.to(v.dtype)  # the hardware's round-to-nearest-even
        if PV == 0:  # the sum of the weights PV uses (one conversion serves both)
            l_sum = l_sum * alpha + tl.sum(_widen_16(p_hi), axis=1)
        else:
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p_hi, v, acc)
        if PV == 1:  # the rounding error of p as a second 16-bit operand
            acc = tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
    return m_new, l_sum, acc
