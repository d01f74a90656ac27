"""Triton kernels of the fused mHC ops; ``mhc.py`` tiles (``mhc_inputs.py`` checks the
inputs, ``mhc_launch.py`` launches).

Shape legend: T tokens, N streams, D hidden, K = N*D input columns, M mixes per token
((2+N)N for a block, N for the head), S splits of the K columns.

K1 ``prenorm_gemm_kernel``, grid (cdiv(T, BLOCK_T), S): split s of the K columns writes
    mix[s, t, m] = sum_k streams[t, k] * fn[m, k] and sq[s, t] = sum_k streams[t, k]^2.
    FLAT (no expand in the prologue): a split is a run of the streams' [T, N*D] columns,
    read as 2D tiles; else a split is a run of hidden columns of all N streams (the expand
    mixes the N streams of a column).
    The dot runs in fp32 with input_precision "ieee" (FMA, no TF32: the mixes feed a softmax
    and 20 Sinkhorn steps, and the spec is fp32) or "tf32x3", or ("bf16x3", bf16 streams)
    as three bf16 dots of the streams' own tiles against fn split into bf16 pieces
    hi + mid + lo (``split_bf16x3``: 24 bits of fn, exact bf16 products, fp32 accumulation,
    so fp32 accuracy with no conversion of the streams' tile); GEMV (one token per program,
    for T <= 4): fp32 products summed per mix, without a 16-row dot tile of which 15 rows
    would be padding. Dividing by the rms after the GEMM equals
    the reference's GEMM of the normalized rows, so the streams are read once.
K2 ``hc_finish_kernel`` and the one-launch ``hc_fused_kernel``: ``mhc_finish_kernels.py``.
``hc_post_kernel``, grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)): the elementwise expand.
``split_bf16x3_kernel``: fn's three bf16 pieces for the "bf16x3" K1 (elementwise).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl_wait, round_as


@triton.jit
def to_output(y, out_ptr):
    """y (fp32) in the element type of out_ptr, rounded to nearest even (``round_as``)."""
    return round_as(y, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)


@triton.jit
def load_block_out(
    block_out_ptr, slot_ids_ptr, tok, tok_ok, d, td_ok, stride_bt, top_k, num_experts, out_ptr,
    SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A block output's [BLOCK_T, BLOCK_D] tile in fp32: loaded, or (SLOTS: an unsummed
    ``ExpertSlots``, rows [T * k, D] fp32 and ids [T * k]) summed over each token's routed
    slots in slot order and rounded to out_ptr's type, as the fused MoE's sum kernel does."""
    tok64 = tok.to(tl.int64)
    if SLOTS:
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for j in range(top_k):
            pair = tok64 * top_k + j
            expert = tl.load(slot_ids_ptr + pair, mask=tok_ok, other=-1)
            routed = (expert >= 0) & (expert < num_experts)
            acc += tl.load(
                block_out_ptr + pair[:, None] * stride_bt + d[None, :],
                mask=td_ok & routed[:, None],
                other=0.0,
            )
        return to_output(acc, out_ptr).to(tl.float32)
    else:
        rows = block_out_ptr + tok64[:, None] * stride_bt + d[None, :]
        return tl.load(rows, mask=td_ok, other=0.0).to(tl.float32)


@triton.jit
def prenorm_gemm_kernel(
    x_ptr,  # [T, N, D] streams (FUSE_POST: the streams before the expand; FLAT: contiguous)
    w_ptr,  # [M, N*D] fp32 ("bf16x3": [3, M, N*D] bf16, hi / mid / lo)
    mix_ptr,  # [S, T, BLOCK_M] fp32 out: partial mixes
    sq_ptr,  # [S, T] fp32 out: partial sums of squares
    block_out_ptr,  # [T, D]     FUSE_POST only
    post_ptr,  # [T, N] fp32     FUSE_POST only
    comb_ptr,  # [T, N, N] fp32  FUSE_POST only
    new_ptr,  # [T, N, D] out    FUSE_POST only: the expanded streams
    num_tokens,
    hidden,
    num_mixes,
    d_per_split,  # hidden columns of a split (FLAT: columns of the [T, N*D] rows)
    stride_xt,
    stride_xn,
    stride_wm,
    stride_mix_s,
    stride_mix_t,
    stride_sq_s,
    stride_bt,
    slot_ids_ptr,  # [T * k] SLOTS only: block_out_ptr is [T * k, D] fp32 expert slots
    top_k,
    num_experts,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # hidden columns a step (FLAT: BLOCK_N * BLOCK_D flat ones)
    FUSE_POST: tl.constexpr,
    SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
    GEMV: tl.constexpr,  # BLOCK_T = 1: elementwise FMA + row sums instead of tl.dot
    NATIVE_BF16: tl.constexpr,  # "bf16x3" dots on the tensor cores (else fp32 ones: CPU)
    FLAT: tl.constexpr,  # the streams as [T, N*D] rows, splits of those K columns (no FUSE_POST)
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
    PER_STREAM: tl.constexpr = False,  # FUSE_POST, a stream at a time (no [T, N, D] tile)
):
    pdl_wait(PDL)
    if PER_STREAM:
        _prenorm_partials_per_stream(
            tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, mix_ptr, sq_ptr, block_out_ptr,
            post_ptr, comb_ptr, new_ptr, num_tokens, hidden, num_mixes, d_per_split, stride_xt,
            stride_xn, stride_wm, stride_mix_s, stride_mix_t, stride_sq_s, stride_bt,
            slot_ids_ptr, top_k, num_experts, N, BLOCK_T, BLOCK_M, BLOCK_D, SLOTS, PRECISION,
            NATIVE_BF16,
        )  # fmt: skip
    elif FLAT:
        _prenorm_partials_flat(
            tl.program_id(0), tl.program_id(1), x_ptr, w_ptr, mix_ptr, sq_ptr, num_tokens,
            N * hidden, num_mixes, d_per_split, stride_xt, stride_wm, stride_mix_s,
            stride_mix_t, stride_sq_s, BLOCK_T, BLOCK_M, BLOCK_N * BLOCK_D, PRECISION, GEMV,
            NATIVE_BF16,
        )  # fmt: skip
    else:
        _prenorm_partials(
            tl.program_id(0),
            tl.program_id(1),
            x_ptr,
            w_ptr,
            mix_ptr,
            sq_ptr,
            block_out_ptr,
            post_ptr,
            comb_ptr,
            new_ptr,
            num_tokens,
            hidden,
            num_mixes,
            d_per_split,
            stride_xt,
            stride_xn,
            stride_wm,
            stride_mix_s,
            stride_mix_t,
            stride_sq_s,
            stride_bt,
            slot_ids_ptr,
            top_k,
            num_experts,
            N,
            BLOCK_N,
            BLOCK_T,
            BLOCK_M,
            BLOCK_D,
            FUSE_POST,
            SLOTS,
            PRECISION,
            GEMV,
            NATIVE_BF16,
        )


@triton.jit
def _prenorm_partials(
    pid_t,
    pid_s,
    x_ptr,  # [T, N, D] streams (FUSE_POST: the streams before the expand)
    w_ptr,  # [M, N*D] fp32
    mix_ptr,  # [S, T, BLOCK_M] fp32 out: partial mixes
    sq_ptr,  # [S, T] fp32 out: partial sums of squares
    block_out_ptr,  # [T, D]     FUSE_POST only
    post_ptr,  # [T, N] fp32     FUSE_POST only
    comb_ptr,  # [T, N, N] fp32  FUSE_POST only
    new_ptr,  # [T, N, D] out    FUSE_POST only: the expanded streams
    num_tokens,
    hidden,
    num_mixes,
    d_per_split,
    stride_xt,
    stride_xn,
    stride_wm,
    stride_mix_s,
    stride_mix_t,
    stride_sq_s,
    stride_bt,
    slot_ids_ptr,
    top_k,
    num_experts,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FUSE_POST: tl.constexpr,
    SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
    GEMV: tl.constexpr,  # BLOCK_T = 1: elementwise FMA + row sums instead of tl.dot
    NATIVE_BF16: tl.constexpr,
):
    # A split owns hidden columns [d_start, d_start + d_per_split) of all N streams, so the
    # FUSE_POST prologue (which mixes the streams per column) has everything it needs.
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    tok64 = tok.to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    tn_ok = tok_ok[:, None] & n_ok[None, :]
    m = tl.arange(0, BLOCK_M)
    mn_ok = (m < num_mixes)[:, None] & n_ok[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_M), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    if FUSE_POST:
        post = tl.load(post_ptr + tok[:, None] * N + n[None, :], mask=tn_ok, other=0.0)
    d_start = pid_s * d_per_split
    for k in range(0, d_per_split, BLOCK_D):
        d = d_start + k + tl.arange(0, BLOCK_D)
        d_ok = d < hidden
        td_ok = tok_ok[:, None] & d_ok[None, :]
        tnd_ok = tn_ok[:, :, None] & d_ok[None, None, :]
        if FUSE_POST:
            # new[t, k, d] = post[t, k] * block_out[t, d] + sum_j comb[t, j, k] * x[t, j, d]
            bo = load_block_out(
                block_out_ptr, slot_ids_ptr, tok, tok_ok, d, td_ok, stride_bt, top_k,
                num_experts, new_ptr, SLOTS, BLOCK_T, BLOCK_D,
            )  # fmt: skip
            x = post[:, :, None] * bo[:, None, :]
            for j in tl.static_range(N):
                x_j = tl.load(
                    x_ptr + tok64[:, None] * stride_xt + j * stride_xn + d[None, :],
                    mask=td_ok,
                    other=0.0,
                )
                c_j = tl.load(
                    comb_ptr + tok[:, None] * (N * N) + j * N + n[None, :], mask=tn_ok, other=0.0
                )
                x += c_j[:, :, None] * x_j.to(tl.float32)[:, None, :]
            new = to_output(x, new_ptr)
            new_rows = new_ptr + tok64[:, None, None] * (N * hidden) + n[None, :, None] * hidden
            tl.store(new_rows + d[None, None, :], new, mask=tnd_ok)
            x16 = tl.where(tnd_ok, new, 0.0)  # the GEMM sees the stored streams
        else:
            x_rows = x_ptr + tok64[:, None, None] * stride_xt + n[None, :, None] * stride_xn
            x16 = tl.load(x_rows + d[None, None, :], mask=tnd_ok, other=0.0)
        x = x16.to(tl.float32)
        w_rows = w_ptr + m[:, None, None] * stride_wm + n[None, :, None] * hidden + d[None, None, :]
        w_ok = mn_ok[:, :, None] & d_ok[None, None, :]
        # [BT, BN, BD] . [BM, BN, BD] over (n, d): one dot with K = BN * BD
        x16_2d = tl.reshape(x16, (BLOCK_T, BLOCK_N * BLOCK_D))
        x_2d = tl.reshape(x, (BLOCK_T, BLOCK_N * BLOCK_D))
        acc = _k1_dot(
            acc, x16_2d, x_2d, w_rows, w_ok, num_mixes * stride_wm, BLOCK_M, BLOCK_N * BLOCK_D,
            PRECISION, GEMV, NATIVE_BF16,
        )  # fmt: skip
        sq += tl.sum(tl.sum(x * x, axis=2), axis=1)
    mix_out = mix_ptr + pid_s * stride_mix_s + tok[:, None] * stride_mix_t + m[None, :]
    tl.store(mix_out, acc, mask=tok_ok[:, None])
    tl.store(sq_ptr + pid_s * stride_sq_s + tok, sq, mask=tok_ok)


@triton.jit
def _prenorm_partials_per_stream(
    pid_t, pid_s, x_ptr, w_ptr, mix_ptr, sq_ptr, block_out_ptr, post_ptr, comb_ptr, new_ptr,
    num_tokens, hidden, num_mixes, d_per_split, stride_xt, stride_xn, stride_wm, stride_mix_s,
    stride_mix_t, stride_sq_s, stride_bt, slot_ids_ptr, top_k, num_experts,
    N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr, PRECISION: tl.constexpr, NATIVE_BF16: tl.constexpr,
):  # fmt: skip
    """K1 with the expand in its prologue (``_prenorm_partials``' FUSE_POST), a stream at a
    time: new stream n's [BLOCK_T, BLOCK_D] tile from the N old ones (their loads after
    the first stream's come from L1), stored, then its own dot against fn's columns of
    stream n. Every tile is 2D, so the dot takes the tile as computed: no [T, N, D] tile
    reshaped to [T, N * D] through shared memory. The same values in the same order as
    ``hc_post_kernel``."""
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    tok64 = tok.to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < num_mixes
    acc = tl.zeros((BLOCK_T, BLOCK_M), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    x_rows = x_ptr + tok64[:, None] * stride_xt
    new_rows = new_ptr + tok64[:, None] * (N * hidden)
    d_start = pid_s * d_per_split
    for k in range(0, d_per_split, BLOCK_D):
        d = d_start + k + tl.arange(0, BLOCK_D)
        d_ok = d < hidden
        td_ok = tok_ok[:, None] & d_ok[None, :]
        bo = load_block_out(
            block_out_ptr, slot_ids_ptr, tok, tok_ok, d, td_ok, stride_bt, top_k, num_experts,
            new_ptr, SLOTS, BLOCK_T, BLOCK_D,
        )  # fmt: skip
        for n in tl.static_range(N):
            # new[t, n, d] = post[t, n] * block_out[t, d] + sum_j comb[t, j, n] * x[t, j, d]
            post_n = tl.load(post_ptr + tok * N + n, mask=tok_ok, other=0.0)
            x = post_n[:, None] * bo
            for j in tl.static_range(N):
                x_j = tl.load(x_rows + j * stride_xn + d[None, :], mask=td_ok, other=0.0)
                c_jn = tl.load(comb_ptr + tok * (N * N) + j * N + n, mask=tok_ok, other=0.0)
                x += c_jn[:, None] * x_j.to(tl.float32)
            new = to_output(x, new_ptr)
            tl.store(new_rows + n * hidden + d[None, :], new, mask=td_ok)
            x16 = tl.where(td_ok, new, 0.0)  # the GEMM sees the stored streams
            x = x16.to(tl.float32)
            w_rows = w_ptr + m[:, None] * stride_wm + n * hidden + d[None, :]
            w_ok = m_ok[:, None] & d_ok[None, :]
            acc = _k1_dot(
                acc, x16, x, w_rows, w_ok, num_mixes * stride_wm, BLOCK_M, BLOCK_D, PRECISION,
                False, NATIVE_BF16,
            )  # fmt: skip
            sq += tl.sum(x * x, axis=1)
    mix_out = mix_ptr + pid_s * stride_mix_s + tok[:, None] * stride_mix_t + m[None, :]
    tl.store(mix_out, acc, mask=tok_ok[:, None])
    tl.store(sq_ptr + pid_s * stride_sq_s + tok, sq, mask=tok_ok)


@triton.jit
def _prenorm_partials_flat(
    pid_t,
    pid_s,
    x_ptr,  # [T, K] streams, K = N*D contiguous columns a row
    w_ptr,  # [M, K] fp32 ("bf16x3": [3, M, K] bf16, hi / mid / lo)
    mix_ptr,  # [S, T, BLOCK_M] fp32 out: partial mixes
    sq_ptr,  # [S, T] fp32 out: partial sums of squares
    num_tokens,
    num_cols,
    num_mixes,
    cols_per_split,  # a multiple of BLOCK_K
    stride_xt,
    stride_wm,
    stride_mix_s,
    stride_mix_t,
    stride_sq_s,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    GEMV: tl.constexpr,
    NATIVE_BF16: tl.constexpr,
):
    """K1 without the expand: split s owns columns [s * cols_per_split, ...) of the streams
    read as [T, N*D] rows, a [BLOCK_T, BLOCK_K] tile of contiguous columns a step (the
    [BLOCK_T, N, BLOCK_D] tiles of ``_prenorm_partials`` read N short runs a row)."""
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    m = tl.arange(0, BLOCK_M)
    m_ok = m < num_mixes
    acc = tl.zeros((BLOCK_T, BLOCK_M), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
    c_start = pid_s * cols_per_split
    for k in range(0, cols_per_split, BLOCK_K):
        c = c_start + k + tl.arange(0, BLOCK_K)
        c_ok = c < num_cols
        x16 = tl.load(x_rows + c[None, :], mask=tok_ok[:, None] & c_ok[None, :], other=0.0)
        x = x16.to(tl.float32)
        w_rows = w_ptr + m[:, None] * stride_wm + c[None, :]
        w_ok = m_ok[:, None] & c_ok[None, :]
        acc = _k1_dot(
            acc, x16, x, w_rows, w_ok, num_mixes * stride_wm, BLOCK_M, BLOCK_K, PRECISION, GEMV,
            NATIVE_BF16,
        )  # fmt: skip
        sq += tl.sum(x * x, axis=1)
    mix_out = mix_ptr + pid_s * stride_mix_s + tok[:, None] * stride_mix_t + m[None, :]
    tl.store(mix_out, acc, mask=tok_ok[:, None])
    tl.store(sq_ptr + pid_s * stride_sq_s + tok, sq, mask=tok_ok)


@triton.jit
def _k1_dot(
    acc,  # [BT, BLOCK_M] fp32
    x16,  # [BT, K] the streams' tile as loaded (bf16 for "bf16x3")
    x,  # [BT, K] the same in fp32
    w_rows,  # pointers to fn's [BLOCK_M, K] tile (any shape of that many; "bf16x3": piece 0)
    w_ok,
    piece_stride,  # elements from one bf16x3 piece of fn to the next
    BLOCK_M: tl.constexpr,
    K: tl.constexpr,
    PRECISION: tl.constexpr,
    GEMV: tl.constexpr,
    NATIVE_BF16: tl.constexpr,
):
    """acc + x . fn_tile^T in K1's precision: "bf16x3" (the bf16 tile against fn's three
    bf16 pieces, lo, mid, hi: the small pieces' sums first), a dot in ``PRECISION``, or with
    GEMV fp32 FMA products summed per mix (few tokens: no dot tile of 16 rows)."""
    if PRECISION == "bf16x3":
        for piece in tl.static_range(2, -1, -1):
            w = tl.load(w_rows + piece * piece_stride, mask=w_ok, other=0.0)
            w = tl.reshape(w, (BLOCK_M, K))
            if NATIVE_BF16:
                acc = tl.dot(x16, tl.trans(w), acc)
            else:  # the same exact products, summed in fp32
                acc = tl.dot(x, tl.trans(w).to(tl.float32), acc, input_precision="ieee")
    else:
        w = tl.reshape(tl.load(w_rows, mask=w_ok, other=0.0), (BLOCK_M, K))
        if GEMV:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def hc_post_kernel(
    streams_ptr,  # [T, N, D]
    block_out_ptr,  # [T, D]
    post_ptr,  # [T, N] fp32
    comb_ptr,  # [T, N, N] fp32
    out_ptr,  # [T, N, D] contiguous
    num_tokens,
    hidden,
    stride_st,
    stride_sn,
    stride_bt,
    stride_pt,
    stride_ct,
    slot_ids_ptr,  # [T * k] SLOTS only: block_out_ptr is [T * k, D] fp32 expert slots
    top_k,
    num_experts,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    tok64 = tok.to(tl.int64)
    k = tl.arange(0, BLOCK_N)
    k_ok = k < N
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < hidden
    td_ok = tok_ok[:, None] & d_ok[None, :]
    tk_ok = tok_ok[:, None] & k_ok[None, :]
    # out[t, k, d] = post[t, k] * block_out[t, d] + sum_j comb[t, j, k] * streams[t, j, d]
    post = tl.load(post_ptr + tok[:, None] * stride_pt + k[None, :], mask=tk_ok, other=0.0)
    bo = load_block_out(
        block_out_ptr, slot_ids_ptr, tok, tok_ok, d, td_ok, stride_bt, top_k, num_experts,
        out_ptr, SLOTS, BLOCK_T, BLOCK_D,
    )  # fmt: skip
    acc = post[:, :, None] * bo[:, None, :]  # [BT, BN, BD]
    for j in tl.static_range(N):
        s_j = tl.load(
            streams_ptr + tok64[:, None] * stride_st + j * stride_sn + d[None, :],
            mask=td_ok,
            other=0.0,
        )
        c_j = tl.load(
            comb_ptr + tok[:, None] * stride_ct + j * N + k[None, :], mask=tk_ok, other=0.0
        )
        acc += c_j[:, :, None] * s_j.to(tl.float32)[:, None, :]
    out = (
        out_ptr + tok64[:, None, None] * (N * hidden) + k[None, :, None] * hidden + d[None, None, :]
    )
    mask = tk_ok[:, :, None] & d_ok[None, None, :]
    tl.store(out, to_output(acc, out_ptr), mask=mask)


@triton.jit
def split_bf16x3_kernel(fn_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """out [3, numel] bf16 = ``ops.reference.split_bf16x3`` of fn [numel] fp32."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    w = tl.load(fn_ptr + offs, mask=ok, other=0.0)
    hi = round_as(w, tl.bfloat16)
    rest = w - hi  # exact: hi is the nearest bf16
    mid = round_as(rest, tl.bfloat16)
    lo = round_as(rest - mid, tl.bfloat16)
    tl.store(out_ptr + offs, hi.to(tl.bfloat16), mask=ok)
    tl.store(out_ptr + numel + offs, mid.to(tl.bfloat16), mask=ok)
    tl.store(out_ptr + 2 * numel + offs, lo.to(tl.bfloat16), mask=ok)
