"""The finish of the fused mHC ops (K2) and the one-launch K1 + K2 for few tokens;
``mhc.py`` tiles, ``mhc_inputs.py`` checks the inputs, ``mhc_launch.py`` launches. Shape
legend as ``mhc_kernels.py``.

K2 ``hc_finish_kernel``, grid (cdiv(T, BLOCK_T),): the mixes (sums the S partials in a
    fixed order: deterministic, no atomics; sigmoid / softmax, the Sinkhorn iterations on
    [N, N] in registers, N = 4: 16 separate per-token values, no cross-thread sums), then
    the collapse of the streams with ``pre`` and the block RMSNorm in fp32, rounding x once.
    HEAD=True: the hyper head (pre only, no post / comb / Sinkhorn). MIXES / COLLAPSE pick
    the halves: for many tokens the mixes run as their own launch, BLOCK_T tokens a
    program (a token a thread), and store pre [T, BLOCK_N] for a collapse launch of a token
    a program (``Tiling.mixes_block_t``: a program of one token runs its Sinkhorn chain in
    every thread). ``Tiling.comb_beside`` splits it the other way for few tokens: pre and
    the collapse (the path to x: a HEAD launch, which computes pre alone), then post and
    comb (COMB_ONLY: the Sinkhorn chain, read only by the next block's mHC) in a launch of
    their own, which a captured step runs on the side stream.
``hc_fused_kernel``, grid (T, S) (one token per program, the GEMV K1): K1's split, then
    the split's program that arrives last at a per-token counter (an int32 atomic, the
    only atomic; values are summed in a fixed order, so results stay deterministic) runs
    K2 for the token and resets the counter to 0 for the next call (or graph replay). The
    other programs exit. One launch instead of two: at T = 1 the launch latency is most of
    the op's time. The partial stores are ordered before the counter by a CTA barrier and
    a release atomic (CUTLASS's split-K semaphore pattern); the finishing program reads
    them, and the streams other programs expanded, past L1 (".cg").
"""

from __future__ import annotations

import triton
import triton.language as tl

from rackserve.ops.triton.common import last_to_arrive, pdl_wait
from rackserve.ops.triton.mhc_kernels import _prenorm_partials, to_output


@triton.jit
def hc_finish_kernel(
    streams_ptr,  # [T, N, D]
    mix_ptr,  # [S, T, BLOCK_M] fp32 from K1
    sq_ptr,  # [S, T] fp32 from K1
    base_ptr,  # [M] fp32
    scale_ptr,  # [3] (block) or [1] (head) fp32
    norm_w_ptr,  # [D] fp32
    x_ptr,  # [T, D] out, the streams' dtype
    post_ptr,  # [T, N] fp32 out (unused when HEAD)
    comb_ptr,  # [T, N, N] fp32 out (unused when HEAD)
    pre_ptr,  # [T, BLOCK_N] fp32: out (mixes only), in (collapse only); else unused
    num_tokens,
    num_splits,
    hidden,
    inv_num_cols,
    hc_eps,
    norm_eps,
    sinkhorn_iters,
    stride_st,
    stride_sn,
    stride_mix_s,
    stride_mix_t,
    stride_sq_s,
    stride_xt,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    MIXES: tl.constexpr,
    COLLAPSE: tl.constexpr,
    COMB_ONLY: tl.constexpr,  # post and comb alone (``Tiling.comb_beside``)
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    if COMB_ONLY:
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        _mixes(tok, mix_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, num_tokens,
               num_splits, inv_num_cols, hc_eps, norm_eps, sinkhorn_iters, stride_mix_s,
               stride_mix_t, stride_sq_s, N, BLOCK_N, BLOCK_T, BLOCK_S, False, "")  # fmt: skip
        return
    _finish_tokens(tl.program_id(0), streams_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr,
                   norm_w_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, num_tokens, num_splits,
                   hidden, inv_num_cols, hc_eps, norm_eps, sinkhorn_iters, stride_st, stride_sn,
                   stride_mix_s, stride_mix_t, stride_sq_s, stride_xt, N, BLOCK_N, BLOCK_T,
                   BLOCK_S, BLOCK_D, HEAD, SINGLE_PASS, MIXES, COLLAPSE, "")  # fmt: skip


@triton.jit
def hc_fused_kernel(
    x_ptr,  # [T, N, D] streams (FUSE_POST: before the expand)
    w_ptr,  # [M, N*D] fp32
    mix_ptr,  # [S, T, BLOCK_M] fp32 workspace
    sq_ptr,  # [S, T] fp32 workspace
    block_out_ptr,  # [T, D]          FUSE_POST only
    prev_post_ptr,  # [T, N] fp32     FUSE_POST only
    prev_comb_ptr,  # [T, N, N] fp32  FUSE_POST only
    new_ptr,  # [T, N, D]: the streams K2 collapses (FUSE_POST: written here)
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    out_x_ptr,  # [T, D] out
    post_ptr,  # [T, N] fp32 out (unused when HEAD)
    comb_ptr,  # [T, N, N] fp32 out (unused when HEAD)
    counter_ptr,  # [>= T] int32, zero between calls
    num_tokens,
    hidden,
    num_mixes,
    d_per_split,
    inv_num_cols,
    hc_eps,
    norm_eps,
    sinkhorn_iters,
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
    stride_nt,
    stride_nn,
    stride_ot,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # K1's hidden columns per step
    FINISH_BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FUSE_POST: tl.constexpr,
    SLOTS: tl.constexpr,
    HEAD: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    _prenorm_partials(pid_t, pid_s, x_ptr, w_ptr, mix_ptr, sq_ptr, block_out_ptr,
                      prev_post_ptr, prev_comb_ptr, new_ptr, num_tokens, hidden, num_mixes,
                      d_per_split, stride_xt, stride_xn, stride_wm, stride_mix_s,
                      stride_mix_t, stride_sq_s, stride_bt, slot_ids_ptr, top_k, num_experts,
                      N, BLOCK_N, 1, BLOCK_M, BLOCK_D, FUSE_POST, SLOTS, "ieee",
                      True, False)  # fmt: skip
    if last_to_arrive(counter_ptr + pid_t, num_splits):  # the token's splits all stored
        _finish_tokens(pid_t, new_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr, norm_w_ptr,
                       out_x_ptr, post_ptr, comb_ptr, out_x_ptr, num_tokens, num_splits,
                       hidden, inv_num_cols, hc_eps, norm_eps, sinkhorn_iters, stride_nt,
                       stride_nn, stride_mix_s, stride_mix_t, stride_sq_s, stride_ot, N,
                       BLOCK_N, 1, BLOCK_S, FINISH_BLOCK_D, HEAD, SINGLE_PASS, True, True,
                       ".cg")  # fmt: skip


@triton.jit
def _finish_tokens(
    pid,
    streams_ptr,  # [T, N, D]
    mix_ptr,  # [S, T, BLOCK_M] fp32 from K1
    sq_ptr,  # [S, T] fp32 from K1
    base_ptr,  # [M] fp32
    scale_ptr,  # [3] (block) or [1] (head) fp32
    norm_w_ptr,  # [D] fp32
    x_ptr,  # [T, D] out, the streams' dtype
    post_ptr,  # [T, N] fp32 out (unused when HEAD)
    comb_ptr,  # [T, N, N] fp32 out (unused when HEAD)
    pre_ptr,  # [T, BLOCK_N] fp32: out when only MIXES, in when only COLLAPSE
    num_tokens,
    num_splits,
    hidden,
    inv_num_cols,
    hc_eps,
    norm_eps,
    sinkhorn_iters,
    stride_st,
    stride_sn,
    stride_mix_s,
    stride_mix_t,
    stride_sq_s,
    stride_xt,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    MIXES: tl.constexpr,  # compute pre (and post, comb) from K1's partials
    COLLAPSE: tl.constexpr,  # collapse the streams with pre and norm them into x
    CACHE: tl.constexpr,  # ".cg" for rows other programs of this launch wrote (fused)
):
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    n = tl.arange(0, BLOCK_N)
    tn_ok = tok_ok[:, None] & (n < N)[None, :]  # [BT, BN]
    pre_rows = pre_ptr + tok[:, None] * BLOCK_N + n[None, :]  # [BT, BN]
    s_rows = (
        streams_ptr + tok[:, None, None].to(tl.int64) * stride_st + n[None, :, None] * stride_sn
    )
    if COLLAPSE and SINGLE_PASS:  # the row loads first: they arrive while the mixes reduce
        d = tl.arange(0, BLOCK_D)
        d_ok = d < hidden
        s_all = tl.load(
            s_rows + d[None, None, :],
            mask=tn_ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
            cache_modifier=CACHE,
        )
        w_all = tl.load(norm_w_ptr + d, mask=d_ok, other=0.0)
    if MIXES:
        pre = _mixes(tok, mix_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, num_tokens,
                     num_splits, inv_num_cols, hc_eps, norm_eps, sinkhorn_iters, stride_mix_s,
                     stride_mix_t, stride_sq_s, N, BLOCK_N, BLOCK_T, BLOCK_S, HEAD,
                     CACHE)  # fmt: skip
    else:
        pre = tl.load(pre_rows, mask=tok_ok[:, None], other=0.0)
    if not COLLAPSE:
        tl.store(pre_rows, pre, mask=tok_ok[:, None])  # padded streams' lanes hold 0
    else:
        # Collapse the streams with pre, then RMSNorm over D with the block's weight (fp32).
        x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_xt
        pre3 = pre[:, :, None]
        if SINGLE_PASS:
            c = tl.sum(pre3 * s_all.to(tl.float32), axis=1)  # [BT, BD]; masked lanes are 0
            inv = tl.rsqrt(tl.sum(c * c, axis=1) / hidden + norm_eps)
            y = c * inv[:, None] * w_all[None, :]
            tl.store(x_rows + d[None, :], to_output(y, x_ptr), mask=tok_ok[:, None] & d_ok)
        else:
            ssq = tl.zeros((BLOCK_T,), tl.float32)
            for d0 in range(0, hidden, BLOCK_D):
                c = _collapsed(s_rows, pre3, tn_ok, d0, hidden, BLOCK_D, CACHE)
                ssq += tl.sum(c * c, axis=1)
            inv = tl.rsqrt(ssq / hidden + norm_eps)
            # Second pass: the program's own rows were just read, so they come from cache.
            for d0 in range(0, hidden, BLOCK_D):
                c = _collapsed(s_rows, pre3, tn_ok, d0, hidden, BLOCK_D, CACHE)
                d = d0 + tl.arange(0, BLOCK_D)
                d_ok = d < hidden
                w = tl.load(norm_w_ptr + d, mask=d_ok, other=0.0)
                y = c * inv[:, None] * w[None, :]
                tl.store(x_rows + d[None, :], to_output(y, x_ptr), mask=tok_ok[:, None] & d_ok)


@triton.jit
def _collapsed(s_rows, pre3, tn_ok, d0, hidden, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """The streams' columns [d0, d0 + BLOCK_D) collapsed with pre: [BT, BD] fp32 (0 past D)."""
    d = d0 + tl.arange(0, BLOCK_D)
    mask = tn_ok[:, :, None] & (d < hidden)[None, None, :]
    s = tl.load(s_rows + d[None, None, :], mask=mask, other=0.0, cache_modifier=CACHE)
    return tl.sum(pre3 * s.to(tl.float32), axis=1)


@triton.jit
def _mixes(
    tok,  # [BT] token ids
    mix_ptr,  # [S, T, BLOCK_M] fp32 from K1
    sq_ptr,  # [S, T] fp32 from K1
    base_ptr,
    scale_ptr,
    post_ptr,  # [T, N] fp32 out (unused when HEAD)
    comb_ptr,  # [T, N, N] fp32 out (unused when HEAD)
    num_tokens,
    num_splits,
    inv_num_cols,
    hc_eps,
    norm_eps,
    sinkhorn_iters,
    stride_mix_s,
    stride_mix_t,
    stride_sq_s,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD: tl.constexpr,
    CACHE: tl.constexpr,
):
    """pre [BT, BN] (0 in padded streams' lanes); stores post and comb unless HEAD."""
    tok_ok = tok < num_tokens
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    tn_ok = tok_ok[:, None] & n_ok[None, :]  # [BT, BN]
    jk_ok = n_ok[:, None] & n_ok[None, :]  # [BN, BN]
    tjk_ok = tok_ok[:, None, None] & jk_ok[None, :, :]  # [BT, BN, BN]
    mix_tok = mix_ptr + tok * stride_mix_t  # [BT]
    jk = n[:, None] * N + n[None, :]  # comb mix m = 2N + j*N + k

    # Reduce the split partials, BLOCK_S splits per step (one step when S <= BLOCK_S):
    # a fixed order, so results are deterministic.
    pre_acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    post_acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    comb_acc = tl.zeros((BLOCK_T, BLOCK_N * BLOCK_N), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    jk_flat = tl.arange(0, BLOCK_N * BLOCK_N)
    jk_flat_ok = (jk_flat // BLOCK_N < N) & (jk_flat % BLOCK_N < N)
    jk_flat_m = 2 * N + (jk_flat // BLOCK_N) * N + jk_flat % BLOCK_N
    for s0 in range(0, num_splits, BLOCK_S):
        split = s0 + tl.arange(0, BLOCK_S)
        ts_ok = tok_ok[:, None] & (split < num_splits)[None, :]  # [BT, BS]
        mix_ts = mix_tok[:, None] + split[None, :] * stride_mix_s  # [BT, BS]
        tsn_ok = ts_ok[:, :, None] & n_ok[None, None, :]
        part = tl.load(
            mix_ts[:, :, None] + n[None, None, :], mask=tsn_ok, other=0.0, cache_modifier=CACHE
        )
        pre_acc += tl.sum(part, axis=1)
        if not HEAD:
            part = tl.load(
                mix_ts[:, :, None] + N + n[None, None, :],
                mask=tsn_ok,
                other=0.0,
                cache_modifier=CACHE,
            )
            post_acc += tl.sum(part, axis=1)
            part = tl.load(
                mix_ts[:, :, None] + jk_flat_m[None, None, :],
                mask=ts_ok[:, :, None] & jk_flat_ok[None, None, :],
                other=0.0,
                cache_modifier=CACHE,
            )
            comb_acc += tl.sum(part, axis=1)
        sq_ts = sq_ptr + tok[:, None] + split[None, :] * stride_sq_s
        sq += tl.sum(tl.load(sq_ts, mask=ts_ok, other=0.0, cache_modifier=CACHE), axis=1)
    comb_acc3 = tl.reshape(comb_acc, (BLOCK_T, BLOCK_N, BLOCK_N))
    rms = tl.rsqrt(sq * inv_num_cols + norm_eps)  # [BT]: 1 / rms of the K columns

    scale_pre = tl.load(scale_ptr)
    base_pre = tl.load(base_ptr + n, mask=n_ok, other=0.0)
    pre = tl.sigmoid(pre_acc * rms[:, None] * scale_pre + base_pre[None, :]) + hc_eps
    pre = tl.where(n_ok[None, :], pre, 0.0)  # padded streams contribute nothing

    if not HEAD:
        scale_post = tl.load(scale_ptr + 1)
        scale_comb = tl.load(scale_ptr + 2)
        base_post = tl.load(base_ptr + N + n, mask=n_ok, other=0.0)
        post = 2.0 * tl.sigmoid(post_acc * rms[:, None] * scale_post + base_post[None, :])
        tl.store(post_ptr + tok[:, None] * N + n[None, :], post, mask=tn_ok)

        base_comb = tl.load(base_ptr + 2 * N + jk, mask=jk_ok, other=0.0)
        logits = comb_acc3 * rms[:, None, None] * scale_comb + base_comb[None, :, :]
        logits = tl.where(jk_ok[None, :, :], logits, -1e30)
        prob = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = prob / tl.sum(prob, axis=2)[:, :, None] + hc_eps
        comb = tl.where(jk_ok[None, :, :], comb, 0.0)
        # Sinkhorn as ops.sinkhorn: columns (sum over j) first, then rows / columns.
        if N == 4:  # the 16 entries as separate [BT] tensors: no cross-thread sums
            _sinkhorn4(comb, comb_ptr + tok * 16, tok_ok, hc_eps, sinkhorn_iters, BLOCK_T)
        else:
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            for _ in range(sinkhorn_iters - 1):
                comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            comb_out = comb_ptr + tok[:, None, None] * (N * N) + jk[None, :, :]
            tl.store(comb_out, comb, mask=tjk_ok)
    return pre


@triton.jit
def _quarters(x, BLOCK_T: tl.constexpr):
    """x [BT, 4] -> its columns (x_0, x_1, x_2, x_3), each [BT]."""
    even, odd = tl.split(tl.reshape(x, (BLOCK_T, 2, 2)))  # columns 0, 2 | 1, 3
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def _norm4(a, b, c, d, eps):
    """(a, b, c, d) / (a + b + c + d + eps), summed in index order like torch's 4-sum; one
    division and four products (within 2 ulp of four divisions): the chain of 20 iterations
    was most of the finish kernel at one token, 32 approximate divisions an iteration."""
    inv = 1.0 / (a + b + c + d + eps)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _sinkhorn4(comb, out_ptrs, tok_ok, eps, iters, BLOCK_T: tl.constexpr):
    """``ops.reference.sinkhorn`` of comb [BT, 4, 4] (columns first), stored to out_ptrs [BT]
    + j * 4 + k. Sums over a [BT, 4, 4] tensor cross threads (shuffles, or shared memory and
    barriers across warps) and the iterations are a serial chain: at T = 1 the 20 of them
    were most of the finish kernel. Here entry (j, k) is its own [BT] tensor, c{j}{k}."""
    flat = tl.reshape(comb, (BLOCK_T, 16))  # j * 4 + k
    even, odd = tl.split(tl.reshape(flat, (BLOCK_T, 8, 2)))  # k even | odd, by 2j + k // 2
    col0, col2 = tl.split(tl.reshape(even, (BLOCK_T, 4, 2)))  # [BT, 4] over j
    col1, col3 = tl.split(tl.reshape(odd, (BLOCK_T, 4, 2)))
    c00, c10, c20, c30 = _quarters(col0, BLOCK_T)
    c01, c11, c21, c31 = _quarters(col1, BLOCK_T)
    c02, c12, c22, c32 = _quarters(col2, BLOCK_T)
    c03, c13, c23, c33 = _quarters(col3, BLOCK_T)
    # columns (sum over j) first, then (iters - 1) x (rows, columns)
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(iters - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    tl.store(out_ptrs + 0, c00, mask=tok_ok)
    tl.store(out_ptrs + 1, c01, mask=tok_ok)
    tl.store(out_ptrs + 2, c02, mask=tok_ok)
    tl.store(out_ptrs + 3, c03, mask=tok_ok)
    tl.store(out_ptrs + 4, c10, mask=tok_ok)
    tl.store(out_ptrs + 5, c11, mask=tok_ok)
    tl.store(out_ptrs + 6, c12, mask=tok_ok)
    tl.store(out_ptrs + 7, c13, mask=tok_ok)
    tl.store(out_ptrs + 8, c20, mask=tok_ok)
    tl.store(out_ptrs + 9, c21, mask=tok_ok)
    tl.store(out_ptrs + 10, c22, mask=tok_ok)
    tl.store(out_ptrs + 11, c23, mask=tok_ok)
    tl.store(out_ptrs + 12, c30, mask=tok_ok)
    tl.store(out_ptrs + 13, c31, mask=tok_ok)
    tl.store(out_ptrs + 14, c32, mask=tok_ok)
    tl.store(out_ptrs + 15, c33, mask=tok_ok)
