"""Triton kernels of the fused MoE op; ``fused_moe.py`` validates inputs, tiles and launches.

Shape legend: T tokens, k experts per token, P = T*k (token, slot) pairs (pair p is token
p // k, slot p % k), E experts, D hidden, I expert width, BM rows per block, R the padded
row capacity (a multiple of BM), B = R / BM blocks, S align segments.

Align: ``moe_align_kernels.py``.
``moe_gate_up_kernel``, grid (B, cdiv(I, BN)): the gate and up tiles of x[token] @ w13[e]^T
    in one program, the clamped SwiGLU in fp32, stored as h [R, I] in the weights' type:
    16-bit weights get h rounded once (to nearest even), the precision of
    ``reference.moe_experts(h_dtype=)`` and of the grouped prefill MoE. Its errors are
    smaller than the bf16 reference's (which rounds gate, up, SiLU and product) but not
    correlated with them, so the tests compare the kernel with ``h_dtype``'s reference.
    (Keeping h's fp32 precision as bf16 hi + lo parts cost the down kernel twice the dot
    rows: 343.9 against 296.1 us at T = 256 on the H200, 2026-12-04-h200-s24.md.)
``moe_down_kernel``, grid (B, cdiv(D, BN)): h @ w2[e]^T times the routed weight, written to
    the pair's row of slots [P, D] fp32. (A persistent grid, resident programs walking the
    (block, n-tile) items with the item loop flattened into the k loop, was slower: T = 256,
    802 -> 827 us on the H200, 1,149 -> 1,154 on the H100; equal at T = 1 and 64;
    2026-12-06-s27.md.)
``store_h`` / ``STACK_H``: the FP4 MoE's gate-up epilogue (``fused_moe_fp4.py``), which
    keeps h as 16-bit hi / lo rows stacked per block.
``FP32_DOT``: IEEE fp32 dots (no TF32) for fp32 inputs, and on the interpreter for every
    dtype (its 16-bit tl.dot is wrong); 16-bit inputs on the GPU use tensor cores.
``moe_sum_kernel``, grid (T, cdiv(D, BD)): out[t] = sum over slots j = 0..k-1 in that order
    (deterministic) of slots[t*k + j]; slots whose expert id is outside [0, E) add nothing.

Blocks of the grid's first axis are the fastest-varying, so the programs of one n-tile of
one expert (its consecutive blocks) run together and share the weight tile through L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl_wait, round_as
from rackserve.ops.triton.mhc_kernels import to_output


@triton.jit
def swiglu(gate, up, limit):
    """silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def dot_acc(a, w, acc, FP32_DOT: tl.constexpr):
    """acc + a @ w with fp32 accumulation; IEEE fp32 products when FP32_DOT."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def program_block(TILE_FASTEST: tl.constexpr):
    """This program's (block of aligned rows, tile of output columns). The grid is (B,
    tiles): one column tile's programs over every block run together, so an expert's weight
    tile is read once for all its blocks. TILE_FASTEST: the grid is (tiles, B), one block's
    programs over every tile run together and re-read its activation rows while they are in
    L2 (the down kernel at many tokens: its h rows are as large as a tile round's weights)."""
    if TILE_FASTEST:
        block = tl.program_id(1)
        tile = tl.program_id(0)
    else:
        block = tl.program_id(0)
        tile = tl.program_id(1)
    return block, tile


@triton.jit
def block_tile(
    sorted_ptr, num_pairs, num_cols, block, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The program's tile of an expert GEMM (``program_block``): (rows [BLOCK_M] into the
    aligned order, pair [BLOCK_M] (token * k + slot; >= num_pairs on padding rows), row_ok,
    cols [BLOCK_N], col_ok)."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, pair, pair < num_pairs, cols, cols < num_cols


@triton.jit
def expert_rows(w_ptr, expert, cols, stride_we, stride_wn):
    """[1, BLOCK_N] pointers to rows ``cols`` of ``expert``'s weight (int64 offsets)."""
    return w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn


@triton.jit
def store_swiglu(acc_gate, acc_up, limit, h_ptr, rows, cols, col_ok, stride_ht):
    """The gate-up epilogue: clamped SwiGLU of the fp32 accumulators into h's rows, rounded
    to nearest even when h is 16-bit (padding rows store swiglu(0, 0) = 0)."""
    h = round_as(swiglu(acc_gate, acc_up, limit), h_ptr.dtype.element_ty)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + cols[None, :]
    tl.store(h_ptrs, h, mask=col_ok[None, :])


@triton.jit
def store_h(acc_gate, acc_up, limit, h_ptr, block, rows, cols, col_ok, stride_ht, inter,
            BLOCK_M: tl.constexpr, STACK_H: tl.constexpr, EVEN_ODD: tl.constexpr):  # fmt: skip
    """The gate-up epilogue into h: rows in h's type (``store_swiglu``), or STACK_H's hi / lo
    rows per block (``store_swiglu_stacked``; EVEN_ODD: even columns first)."""
    if STACK_H:
        store_swiglu_stacked(
            acc_gate,
            acc_up,
            limit,
            h_ptr,
            block,
            cols,
            col_ok,
            stride_ht,
            inter,
            BLOCK_M,
            EVEN_ODD,
        )
    else:
        store_swiglu(acc_gate, acc_up, limit, h_ptr, rows, cols, col_ok, stride_ht)


@triton.jit
def store_swiglu_stacked(acc_gate, acc_up, limit, h_ptr, block, cols, col_ok, stride_ht, inter,
                         BLOCK_M: tl.constexpr, EVEN_ODD: tl.constexpr):  # fmt: skip
    """``store_swiglu`` as h's 16-bit hi and lo parts, stacked per block (``STACK_H``);
    EVEN_ODD: each row's even columns first, then its odd ones (the FP4 down kernel's two
    dots per step read them as two contiguous tiles)."""
    h = swiglu(acc_gate, acc_up, limit)
    hi = h.to(h_ptr.dtype.element_ty)
    lo = (h - hi.to(tl.float32)).to(h_ptr.dtype.element_ty)
    hi_rows = block * (2 * BLOCK_M) + tl.arange(0, BLOCK_M)
    if EVEN_ODD:
        cols = (cols % 2) * (inter // 2) + cols // 2
    h_ptrs = h_ptr + hi_rows[:, None].to(tl.int64) * stride_ht + cols[None, :]
    tl.store(h_ptrs, hi, mask=col_ok[None, :])
    tl.store(h_ptrs + BLOCK_M * stride_ht, lo, mask=col_ok[None, :])


@triton.jit
def store_weighted(acc, weights_ptr, slots_ptr, pair, row_ok, cols, col_ok, stride_slot):
    """The down epilogue: acc times the pair's routed weight into its slot row (fp32)."""
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    out_ptrs = slots_ptr + pair[:, None].to(tl.int64) * stride_slot + cols[None, :]
    tl.store(out_ptrs, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_gate_up_kernel(
    x_ptr,  # [T, D]
    w13_ptr,  # [E, 2I, D]: gate rows 0..I-1, up rows I..2I-1
    h_ptr,  # [R, I] out in w13's type (16-bit: the store rounds)
    sorted_ptr,  # [R] int32
    block_expert_ptr,  # [B] int32
    num_pairs,
    top_k,
    hidden,
    inter,
    num_experts,
    limit,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ht,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    block, tile = program_block(False)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows, pair, row_ok, cols, col_ok = block_tile(
        sorted_ptr, num_pairs, inter, block, tile, BLOCK_M, BLOCK_N
    )
    token = tl.where(row_ok, pair // top_k, 0)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None].to(tl.int64) * stride_xt + ks[None, :]
    # [BLOCK_K, BLOCK_N]: w13[e, cols, k]^T
    gate_ptrs = expert_rows(w13_ptr, expert, cols, stride_we, stride_wn) + ks[:, None] * stride_wk
    up_ptrs = gate_ptrs + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + ks) < hidden
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate_w = tl.load(gate_ptrs, mask=w_ok, other=0.0)
        up_w = tl.load(up_ptrs, mask=w_ok, other=0.0)
        acc_gate = dot_acc(a, gate_w, acc_gate, FP32_DOT)
        acc_up = dot_acc(a, up_w, acc_up, FP32_DOT)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K * stride_wk
        up_ptrs += BLOCK_K * stride_wk
    store_swiglu(acc_gate, acc_up, limit, h_ptr, rows, cols, col_ok, stride_ht)


@triton.jit
def moe_down_kernel(
    h_ptr,  # [R, I] in w2's type
    w2_ptr,  # [E, D, I]
    weights_ptr,  # [P] fp32 routed weights, flattened topk_weights
    slots_ptr,  # [P, D] fp32 out
    sorted_ptr,  # [R] int32
    block_expert_ptr,  # [B] int32
    num_pairs,
    hidden,
    inter,
    num_experts,
    stride_ht,
    stride_we,
    stride_wn,
    stride_wk,
    stride_slot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SKIP_PAD_ROWS: tl.constexpr,  # h's padding rows not read (measured with 16-row blocks)
    TILE_FASTEST: tl.constexpr,  # grid (tiles, B): see program_block
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    block, tile = program_block(TILE_FASTEST)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows, pair, row_ok, cols, col_ok = block_tile(
        sorted_ptr, num_pairs, hidden, block, tile, BLOCK_M, BLOCK_N
    )
    ks = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + ks[None, :]
    # [BLOCK_K, BLOCK_N]: w2[e, cols, k]^T
    w_ptrs = expert_rows(w2_ptr, expert, cols, stride_we, stride_wn) + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + ks) < inter
        if SKIP_PAD_ROWS:  # padding rows hold swiglu(0, 0) = 0 (at batch 1, 15 of 16)
            a = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = dot_acc(a, w, acc, FP32_DOT)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    store_weighted(acc, weights_ptr, slots_ptr, pair, row_ok, cols, col_ok, stride_slot)


@triton.jit
def moe_sum_kernel(
    slots_ptr,  # [T*k, D] fp32
    ids_ptr,  # [T*k] expert ids
    out_ptr,  # [T, D] out, x's dtype
    top_k,
    hidden,
    num_experts,
    stride_slot,
    stride_out,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        expert = tl.load(ids_ptr + pair)
        routed = (expert >= 0) & (expert < num_experts)
        acc += tl.load(
            slots_ptr + pair.to(tl.int64) * stride_slot + cols, mask=col_ok & routed, other=0.0
        )
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, to_output(acc, out_ptr), mask=col_ok)
