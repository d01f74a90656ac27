"""Triton kernels of the paged sparse decode attention; ``sparse_attn.py`` validates, tiles
and launches.

Shape legend: S queries, H heads, Dh head dim, Wa window rows and Wb compressed rows per
query (M = Wa + Wb rows in all), R rope dims (the trailing slice of a head), P splits of
the M rows.

``sparse_attn_kernel``, grid (cdiv(H, BLOCK_H) * NUM_DV, S, P): program (hb, dv, s, p)
    walks rows [p * rows_per_split, (p + 1) * rows_per_split) of query s in tiles of
    BLOCK_N. Row j < Wa is ``kv_a[slots_a[s, j]]``, else ``kv_b[slots_b[s, j - Wa]]``; each
    tile is loaded once through its slots and used as K (scores of the BLOCK_H heads, heads
    as the dot's M) and as V (K = V). Invalid rows are never loaded (their slots may point
    at garbage, NaN, or outside the cache), so nothing non-finite reaches a dot. Online
    softmax in fp32, in the log2 domain (scale * log2(e) folded into the scores).
    FP32_DOTS: fp32 inputs get IEEE fp32 dots (the spec is fp32; no TF32). The Triton
    interpreter takes this path for every dtype, since its tl.dot multiplies the raw bits
    of bf16 operands; p is still rounded to the rows' dtype, as the tensor-core path does.
    SPLIT_P (16-bit rows): the PV product runs twice, with p rounded to the rows' dtype
    and with its rounding error: a bf16 p alone (8 bits) puts errors of ~2^-9 |v| into the
    output, more than the bf16 rule of the tests allows; hi + lo carries ~16 bits.
    With NUM_DV > 1 each program accumulates only its BLOCK_DV output columns (scores still
    use the whole head: the QK dot is repeated per dv chunk, the accumulator shrinks).
    P == 1 (SINGLE): the program adds the sink, normalises, applies the optional inverse
    RoPE and writes the output. P > 1: it writes the partial (max, sum, acc) of its split.
``sparse_attn_combine_kernel``, grid (cdiv(H, BLOCK_H) * NUM_DV, S): merges the P partials
    in a fixed order (deterministic), adds exp(sink - max) to the denominator, applies the
    optional inverse RoPE and writes the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl_wait
from rackserve.ops.triton.fp8 import widen
from rackserve.ops.triton.mhc_kernels import to_output


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to ``dtype`` (nearest even), returned as fp32. The interpreter's
    fp32 -> bf16 cast truncates, so bf16 is rounded by hand (as ``to_output`` does)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return rounded.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _load_tile(n0, row_end, s, valid_ptr, stride_vs, slots_a_ptr, stride_sa, slots_b_ptr,
               stride_sb, kv_a_ptr, stride_a, kv_b_ptr, stride_b, width_a, cols, col_ok,
               BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """Rows n0 .. n0 + BLOCK_N - 1 (< row_end) of query s: (valid [BLOCK_N], row pointers,
    rows [BLOCK_N, BLOCK_D] in DTYPE, fp8 rows widened). Invalid rows are masked before the
    load: they read as 0 whatever their slot holds (garbage, NaN, or outside the cache)."""
    rows = n0 + tl.arange(0, BLOCK_N)
    in_range = rows < row_end
    ok = tl.load(valid_ptr + s * stride_vs + rows, mask=in_range, other=0) != 0
    in_a = rows < width_a
    # slots load without waiting for ``valid`` (one dependent round trip less)
    slot_a = tl.load(slots_a_ptr + s * stride_sa + rows, mask=in_a & in_range, other=0)
    slot_b = tl.load(slots_b_ptr + s * stride_sb + (rows - width_a), mask=~in_a & in_range, other=0)
    row_ptr = tl.where(
        in_a, kv_a_ptr + slot_a.to(tl.int64) * stride_a, kv_b_ptr + slot_b.to(tl.int64) * stride_b
    )
    kv = tl.load(row_ptr[:, None] + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
    return ok, row_ptr, widen(kv, DTYPE)


@triton.jit
def _inverse_rope(o, s, col0, cos_ptr, sin_ptr, stride_cs, stride_ss, rope_start, head_dim,
                  BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    """``apply_rope(o, cos, -sin)`` on o [BLOCK_H, BLOCK_DV] fp32 (columns col0 + 0..BLOCK_DV-1
    of the head, col0 even): pairs (2i, 2i+1) at or past rope_start rotate by -angle."""
    pairs = tl.reshape(o, (BLOCK_H, BLOCK_DV // 2, 2))
    even, odd = tl.split(pairs)  # [BLOCK_H, BLOCK_DV // 2]
    even_col = col0 + 2 * tl.arange(0, BLOCK_DV // 2)
    is_rope = (even_col >= rope_start) & (even_col < head_dim)
    half = (even_col - rope_start) // 2
    # nope pairs: cos 1, sin 0 (identity)
    c = tl.load(cos_ptr + s * stride_cs + half, mask=is_rope, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + s * stride_ss + half, mask=is_rope, other=0.0).to(tl.float32)
    new_even = even * c[None, :] + odd * sn[None, :]
    new_odd = odd * c[None, :] - even * sn[None, :]
    return tl.reshape(tl.join(new_even, new_odd), (BLOCK_H, BLOCK_DV))


@triton.jit
def sparse_attn_kernel(
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
    head_dim,
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
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= Dh, power of two
    BLOCK_DV: tl.constexpr,  # output columns per program (BLOCK_D / NUM_DV)
    NUM_DV: tl.constexpr,
    SINGLE: tl.constexpr,
    ROPE: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # software pipelining of the slot loads
    PREFETCH: tl.constexpr,  # register double-buffering of the row tiles
    SPLIT_P: tl.constexpr,  # 16-bit rows: p = hi + lo, two PV dots (~16-bit p)
    FP32_DOTS: tl.constexpr,  # fp32 FMA dots: fp32 inputs, and the interpreter (see above)
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    pid_h = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    dv = pid_h % NUM_DV
    heads = (pid_h // NUM_DV) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < head_dim
    dv_cols = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = dv_cols < head_dim

    q_rows = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + cols[None, :], mask=head_ok[:, None] & col_ok[None, :], other=0.0)
    if FP32_DOTS:
        q = q.to(tl.float32)

    width = width_a + width_b
    row0 = split * rows_per_split
    row_end = tl.minimum(row0 + rows_per_split, width)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    if PREFETCH:  # registers double-buffer the rows: tile i+1 loads while tile i computes
        ok, row_ptr, kv = _load_tile(
            row0,
            row_end,
            s,
            valid_ptr,
            stride_vs,
            slots_a_ptr,
            stride_sa,
            slots_b_ptr,
            stride_sb,
            kv_a_ptr,
            stride_a,
            kv_b_ptr,
            stride_b,
            width_a,
            cols,
            col_ok,
            BLOCK_N,
            q_ptr.dtype.element_ty,
        )
    for n0 in tl.range(row0, row_end, BLOCK_N, num_stages=NUM_STAGES):
        if PREFETCH:
            # past row_end the next tile is fully masked: no memory traffic
            ok_next, row_ptr_next, kv_next = _load_tile(
                n0 + BLOCK_N,
                row_end,
                s,
                valid_ptr,
                stride_vs,
                slots_a_ptr,
                stride_sa,
                slots_b_ptr,
                stride_sb,
                kv_a_ptr,
                stride_a,
                kv_b_ptr,
                stride_b,
                width_a,
                cols,
                col_ok,
                BLOCK_N,
                q_ptr.dtype.element_ty,
            )
        else:
            ok, row_ptr, kv = _load_tile(
                n0,
                row_end,
                s,
                valid_ptr,
                stride_vs,
                slots_a_ptr,
                stride_sa,
                slots_b_ptr,
                stride_sb,
                kv_a_ptr,
                stride_a,
                kv_b_ptr,
                stride_b,
                width_a,
                cols,
                col_ok,
                BLOCK_N,
                q_ptr.dtype.element_ty,
            )
        if FP32_DOTS:
            scores = tl.dot(q, tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(kv))
        scores = tl.where(ok[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet: no NaN
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if NUM_DV == 1:
            v = kv
        else:  # this program's output columns of the same rows (cache hits)
            v_ptrs = row_ptr[:, None] + dv_cols[None, :]
            v = widen(tl.load(v_ptrs, mask=ok[:, None] & dv_ok[None, :], other=0.0),
                       q_ptr.dtype.element_ty)  # fmt: skip
        acc = acc * alpha[:, None]
        if FP32_DOTS:  # p rounded to the rows' dtype as on the tensor-core path
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
        m = m_new
        if PREFETCH:
            ok, row_ptr, kv = ok_next, row_ptr_next, kv_next

    if SINGLE:
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
        m_all = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_all)
        o = acc * (alpha / (l_sum * alpha + tl.exp2(sink - m_all)))[:, None]
        if ROPE:
            o = _inverse_rope(o, s, dv * BLOCK_DV, cos_ptr, sin_ptr, stride_cs, stride_ss,
                              rope_start, head_dim, BLOCK_H, BLOCK_DV)  # fmt: skip
        out_ptrs = out_ptr + s * stride_os + heads[:, None] * stride_oh + dv_cols[None, :]
        tl.store(out_ptrs, to_output(o, out_ptr), mask=head_ok[:, None] & dv_ok[None, :])
    else:
        num_s = tl.num_programs(1)
        ml = (split * num_s + s) * num_heads + heads
        tl.store(part_m_ptr + ml, m, mask=head_ok & (dv == 0))
        tl.store(part_l_ptr + ml, l_sum, mask=head_ok & (dv == 0))
        acc_rows = part_acc_ptr + split * stride_ps + (s * num_heads + heads[:, None]) * head_dim
        tl.store(acc_rows + dv_cols[None, :], acc, mask=head_ok[:, None] & dv_ok[None, :])


@triton.jit
def sparse_attn_combine_kernel(
    part_acc_ptr,  # [P, S, H, Dh] fp32
    part_m_ptr,  # [P, S, H] fp32
    part_l_ptr,  # [P, S, H] fp32
    sinks_ptr,  # [H] fp32
    cos_ptr,
    sin_ptr,
    out_ptr,  # [S, H, Dh]
    num_splits,
    num_heads,
    head_dim,
    rope_start,
    stride_ps,
    stride_cs,
    stride_ss,
    stride_os,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_DV: tl.constexpr,
    ROPE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    pid_h = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    num_s = tl.num_programs(1)
    dv = pid_h % NUM_DV
    heads = (pid_h // NUM_DV) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dv_cols = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = dv_cols < head_dim
    sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0) * 1.4426950408889634
    m_all = sink
    for p in range(num_splits):
        m_p = tl.load(part_m_ptr + (p * num_s + s) * num_heads + heads, mask=head_ok, other=0.0)
        m_all = tl.maximum(m_all, m_p)
    denom = tl.exp2(sink - m_all)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    acc_rows = part_acc_ptr + (s * num_heads + heads[:, None]) * head_dim + dv_cols[None, :]
    for p in range(num_splits):
        ml = (p * num_s + s) * num_heads + heads
        m_p = tl.load(part_m_ptr + ml, mask=head_ok, other=float("-inf"))
        w = tl.exp2(m_p - m_all)  # a split without valid rows: m_p = -inf, w = 0
        denom += tl.load(part_l_ptr + ml, mask=head_ok, other=0.0) * w
        part = tl.load(acc_rows + p * stride_ps, mask=head_ok[:, None] & dv_ok[None, :], other=0.0)
        acc += part * w[:, None]
    o = acc / denom[:, None]
    if ROPE:
        o = _inverse_rope(o, s, dv * BLOCK_DV, cos_ptr, sin_ptr, stride_cs, stride_ss,
                          rope_start, head_dim, BLOCK_H, BLOCK_DV)  # fmt: skip
    out_ptrs = out_ptr + s * stride_os + heads[:, None] * stride_oh + dv_cols[None, :]
    tl.store(out_ptrs, to_output(o, out_ptr), mask=head_ok[:, None] & dv_ok[None, :])
