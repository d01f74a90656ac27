"""The "wide" paged sparse attention kernel: every head of a query in one program, so each
gathered row tile is read from HBM once for all heads (MQA: K = V, one row per entry).
``sparse_attn.py`` picks it (``Tiling.kernel == "wide"``), tiles and launches it; partials
go through ``sparse_attn_combine_kernel`` as with the head-blocked kernel.

Shape legend as ``sparse_attn_kernels.py``: S queries, H heads (all in one program,
BLOCK_H = next_pow2(H)), Dh = 2 * HALF head dim, M = Wa + Wb rows, P splits of the rows.

``sparse_attn_wide_kernel``, grid (NUM_DV, S, P): the head dim is handled as two halves
(wgmma's N stops at 256, and a [64, 256] fp32 accumulator is 64 registers per thread at 8
warps). Program (dv, s, p) loads, per tile of BLOCK_N rows, the half it owns (columns
dv * HALF ..) and the other half, computes the scores from both (q . k = q_own . k_own +
q_oth . k_oth) and accumulates PV for the halves it owns: both when NUM_DV == 1 (one
program, a [H, Dh] accumulator as two [H, HALF] tiles), its own when NUM_DV == 2 (two
programs: twice the programs for small batches, the second reads the rows from L2 and
repeats the QK dots). The tile loads are pipelined by ``tl.range(num_stages=...)`` into
shared memory (no register double-buffering: the registers hold the accumulators).
Numerics as the head-blocked kernel: online softmax in the log2 domain, invalid rows never
loaded, SPLIT_P (p = hi + lo for 16-bit rows), FP32_DOTS (IEEE fp32 dots for fp32 inputs
and in the interpreter). PV_FP16 (16-bit rows, ``sparse_attn_wide_kernel`` only) replaces
SPLIT_P's two PV dots by one of p and the rows in fp16, as the prefill kernel's default:
11 bits of p, and bf16 -> fp16 is exact for rows in fp16's normal range (|v| in [2^-14,
65504]; smaller values keep 10 bits past 2^-24, larger ones would overflow, and KV rows
come out of RMSNorm'd projections, far inside it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl_wait
from rackserve.ops.triton.fp8 import widen
from rackserve.ops.triton.mhc_kernels import to_output
from rackserve.ops.triton.sparse_attn_kernels import _inverse_rope, _round_to


@triton.jit
def _pv(p, v, acc, SPLIT_P: tl.constexpr, FP32_DOTS: tl.constexpr, PV_FP16: tl.constexpr):
    """acc + p @ v for p [BH, BN] fp32, v [BN, HALF] in the rows' dtype (see the module doc)."""
    if PV_FP16:  # p and the rows in fp16: one dot with 11 bits of p
        if FP32_DOTS:
            v16 = _round_to(v.to(tl.float32), tl.float16)
            acc = tl.dot(_round_to(p, tl.float16), v16, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
    elif FP32_DOTS:  # p rounded to the rows' dtype as on the tensor-core path
        v32 = v.to(tl.float32)
        p_hi = _round_to(p, v.dtype)
        acc = tl.dot(p_hi, v32, acc, input_precision="ieee")
        if SPLIT_P:
            acc = tl.dot(_round_to(p - p_hi, v.dtype), v32, acc, input_precision="ieee")
    else:
        p_hi = p.to(v.dtype)
        acc = tl.dot(p_hi, v, acc)
        if SPLIT_P:  # the rounding error of p as a second 16-bit operand
            acc = tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
    return acc


@triton.jit
def _finish_half(acc, m, l_sum, sink, s, col0, heads, head_ok, cos_ptr, sin_ptr, stride_cs,
                 stride_ss, rope_start, out_ptr, stride_os, stride_oh, HEAD_DIM: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr):  # fmt: skip
    """Normalise one [BH, HALF] accumulator with the sink, inverse RoPE, store."""
    m_all = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_all)
    o = acc * (alpha / (l_sum * alpha + tl.exp2(sink - m_all)))[:, None]
    if ROPE:
        o = _inverse_rope(o, s, col0, cos_ptr, sin_ptr, stride_cs, stride_ss, rope_start,
                          HEAD_DIM, BLOCK_H, HALF)  # fmt: skip
    cols = col0 + tl.arange(0, HALF)
    out_ptrs = out_ptr + s * stride_os + heads[:, None] * stride_oh + cols[None, :]
    tl.store(out_ptrs, to_output(o, out_ptr), mask=head_ok[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def sparse_attn_wide_kernel(
    q_ptr,  # [S, H, Dh]
    kv_a_ptr,  # [Na, >= Dh] rows addressed by slot (column stride 1)
    slots_a_ptr,  # [S, Wa] int
    kv_b_ptr,  # [Nb, >= Dh]
    slots_b_ptr,  # [S, Wb] int
    valid_ptr,  # [S, Wa + Wb] uint8 (bool viewed)
    sinks_ptr,  # [H] fp32
    cos_ptr,  # [S, R/2] (ROPE only)
    sin_ptr,
    out_ptr,  # [S, H, Dh] (SINGLE)
    part_acc_ptr,  # [P, S, H, Dh] fp32 (not SINGLE)
    part_m_ptr,  # [P, S, H] fp32, log2 domain
    part_l_ptr,  # [P, S, H] fp32
    num_heads,
    width_a,
    width_b,
    rows_per_split,
    rope_start,
    qk_scale,  # scale * log2(e)
    stride_qs,
    stride_qh,
    stride_a,
    stride_b,
    stride_sa,
    stride_sb,
    stride_vs,
    stride_cs,
    stride_ss,
    stride_os,
    stride_oh,
    stride_ps,  # partials: per split (acc); m / l use S * H
    HEAD_DIM: tl.constexpr,  # Dh (constexpr: the column masks fold away, loads vectorise)
    HALF: tl.constexpr,  # next_pow2(Dh) // 2
    BLOCK_H: tl.constexpr,  # next_pow2(H): every head
    BLOCK_N: tl.constexpr,
    NUM_DV: tl.constexpr,  # 1: one program owns both halves; 2: one program per half
    SINGLE: tl.constexpr,
    ROPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_P: tl.constexpr,
    PV_FP16: tl.constexpr,  # 16-bit rows: one fp16 PV dot instead of SPLIT_P's two
    FP32_DOTS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    dv = tl.program_id(0)  # the half this program owns (0 when NUM_DV == 1)
    s = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    half = tl.arange(0, HALF)
    own = dv * HALF + half  # column ids of the owned half ...
    oth = (1 - dv) * HALF + half  # ... and of the other one
    own_ok = own < HEAD_DIM
    oth_ok = oth < HEAD_DIM

    q_rows = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q_own = tl.load(q_rows + own[None, :], mask=head_ok[:, None] & own_ok[None, :], other=0.0)
    q_oth = tl.load(q_rows + oth[None, :], mask=head_ok[:, None] & oth_ok[None, :], other=0.0)
    if FP32_DOTS:
        q_own = q_own.to(tl.float32)
        q_oth = q_oth.to(tl.float32)

    width = width_a + width_b
    row0 = split * rows_per_split
    row_end = tl.minimum(row0 + rows_per_split, width)
    valid_row = valid_ptr + s * stride_vs
    slot_a_row = slots_a_ptr + s * stride_sa
    slot_b_row = slots_b_ptr + s * stride_sb - width_a
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc_own = tl.zeros((BLOCK_H, HALF), tl.float32)
    acc_oth = tl.zeros((BLOCK_H, HALF), tl.float32)  # NUM_DV == 1 only
    for n0 in tl.range(row0, row_end, BLOCK_N, num_stages=NUM_STAGES):
        rows = n0 + tl.arange(0, BLOCK_N)
        in_range = rows < row_end
        ok = tl.load(valid_row + rows, mask=in_range, other=0) != 0
        in_a = rows < width_a
        slot_a = tl.load(slot_a_row + rows, mask=in_a & in_range, other=0)
        slot_b = tl.load(slot_b_row + rows, mask=~in_a & in_range, other=0)
        row_ptr = tl.where(
            in_a,
            kv_a_ptr + slot_a.to(tl.int64) * stride_a,
            kv_b_ptr + slot_b.to(tl.int64) * stride_b,
        )
        # invalid rows are masked before the load: whatever their slot holds stays unread
        k_own = tl.load(row_ptr[:, None] + own[None, :], mask=ok[:, None] & own_ok[None, :],
                        other=0.0)  # fmt: skip
        k_oth = tl.load(row_ptr[:, None] + oth[None, :], mask=ok[:, None] & oth_ok[None, :],
                        other=0.0)  # fmt: skip
        k_own = widen(k_own, q_ptr.dtype.element_ty)  # fp8 rows: upcast in registers
        k_oth = widen(k_oth, q_ptr.dtype.element_ty)
        if FP32_DOTS:
            scores = tl.dot(q_own, tl.trans(k_own.to(tl.float32)), input_precision="ieee")
            scores = tl.dot(q_oth, tl.trans(k_oth.to(tl.float32)), scores, input_precision="ieee")
        else:
            scores = tl.dot(q_own, tl.trans(k_own))
            scores = tl.dot(q_oth, tl.trans(k_oth), scores)
        scores = tl.where(ok[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: no NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc_own = _pv(p, k_own, acc_own * alpha[:, None], SPLIT_P, FP32_DOTS, PV_FP16)
        if NUM_DV == 1:
            acc_oth = _pv(p, k_oth, acc_oth * alpha[:, None], SPLIT_P, FP32_DOTS, PV_FP16)
        m = m_new

    if SINGLE:
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
        _finish_half(acc_own, m, l_sum, sink, s, dv * HALF, heads, head_ok, cos_ptr, sin_ptr,
                     stride_cs, stride_ss, rope_start, out_ptr, stride_os, stride_oh, HEAD_DIM,
                     HALF, BLOCK_H, ROPE)  # fmt: skip
        if NUM_DV == 1:
            _finish_half(acc_oth, m, l_sum, sink, s, HALF, heads, head_ok, cos_ptr, sin_ptr,
                         stride_cs, stride_ss, rope_start, out_ptr, stride_os, stride_oh,
                         HEAD_DIM, HALF, BLOCK_H, ROPE)  # fmt: skip
    else:
        num_s = tl.num_programs(1)
        ml = (split * num_s + s) * num_heads + heads
        tl.store(part_m_ptr + ml, m, mask=head_ok & (dv == 0))
        tl.store(part_l_ptr + ml, l_sum, mask=head_ok & (dv == 0))
        acc_rows = part_acc_ptr + split * stride_ps + (s * num_heads + heads[:, None]) * HEAD_DIM
        tl.store(acc_rows + own[None, :], acc_own, mask=head_ok[:, None] & own_ok[None, :])
        if NUM_DV == 1:
            tl.store(acc_rows + oth[None, :], acc_oth, mask=head_ok[:, None] & oth_ok[None, :])
