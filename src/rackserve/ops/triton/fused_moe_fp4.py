"""Fused routed experts on FP4 weights: ``moe_experts_fp4``, equal to
``ops.quant.moe_experts_fp4`` (dequantize the hit experts, then ``moe_experts``).

Shape legend: T tokens, k experts per token, P = T*k pairs, E experts, D hidden, I expert
width, BM rows per block, BK inputs per K step.

    align      (fused_moe.moe_align)  -> sorted_ids [R], block_expert [B]
    gate_up    x[token] @ dq(w13[e])^T, clamped SwiGLU  -> h [R, I] fp32
    down       h @ dq(w2[e])^T * routed weight          -> slots [P, D] fp32
    sum        (fused_moe's kernel) the k slots of each token, in order -> out [T, D]

Weights are read packed: [E, N, K / 2] bytes and one scale per 32 inputs of a row
([E, N, K / 32], fp32 or ue8m0 bytes). Each K step loads BK / 2 bytes per row, decodes
both nibbles to values in registers (``fp4_tiles.py``) and runs two dots: even inputs
against the low nibbles, odd ones against the high nibbles. An FP4 decode step moves a
quarter of the bf16 bytes. No host syncs, no float atomics: CUDA-graph safe and
replay-deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl
from rackserve.ops.triton.fp4_tiles import fp4_decode, fp4_decode_bf16, step_raw
from rackserve.ops.triton.fused_moe import moe_align
from rackserve.ops.triton.fused_moe_kernels import (
    block_tile,
    expert_rows,
    moe_sum_kernel,
    program_block,
    store_h,
    store_weighted,
)

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp4Tiling:
    block_m: int  # >= 16 (tl.dot)
    gate_up_block_n: int
    down_block_n: int
    block_k: int  # inputs per step: a multiple of 32, >= 32
    num_warps: int
    num_stages: int
    align_segment: int = 2048  # pairs per align program (fused_moe.moe_align)
    fp16_bits: bool = False  # decode nibbles through fp16 bit patterns (see _e2m1_bits)
    # load step k+1's weights before computing step k (the compiled kernels showed no
    # pipelining of the packed loads: 2 KB of shared memory at 4 stages, sm_90 ptxas)
    prefetch: bool = False
    # Triton's tl.dot_scaled (e2m1 weights, ue8m0 scales per 32 inputs: the MX layout ours
    # already is): the compiler's own nibble upcast, then the dot. GPU with ue8m0 scales
    # only (the interpreter has no dot_scaled); ignored elsewhere.
    dot_scaled: bool = False
    # decode two weights per 32-bit register in inline PTX (``fp4_tiles.fp4_decode_bf16``): bf16
    # activations and ue8m0 scales on a GPU only (the interpreter runs no PTX); ignored
    # elsewhere, and under ``dot_scaled``
    asm_decode: bool = False
    # 16-bit activations, not under dot_scaled: the gate-up stores h as bf16 hi / lo rows per
    # block with each row's even inputs before its odd ones, so the down kernel's K step is
    # two dots of 2 x block_m rows on contiguous tiles (no fp32 loads, no even / odd split,
    # no hi / lo conversion: four dots before); fused_moe.Tiling.stack_h's layout for FP4
    stack_h: bool = False  # default_tiling turns it on for decode on a GPU
    # the down kernel's grid as (n-tiles, blocks): a block's programs run together and read
    # its h rows from L2 (fused_moe_kernels.program_block)
    down_tile_fastest: bool = False


def default_tiling(num_tokens: int, top_k: int, num_experts: int, device: torch.device):
    """Host ints only. Decode: 16-row blocks (an expert's few tokens in one), narrow N
    tiles so the hit experts' tiles fill the SMs; prefill-sized batches: 64-row blocks."""
    if device.type != "cuda":
        return Fp4Tiling(16, 64, 64, 128, 4, 1)
    pairs = num_tokens * top_k
    # as fused_moe measured on the H200: one align launch up to 512 pairs, then 256-pair
    # segments; 128-wide down tiles once blocks hold 32 rows (half the re-reads of h)
    segment = 512 if pairs <= 512 else 256
    # V4-Flash sizes on the H200 (fp4_moe_sweep.py): the fp16-bits decoder took T = 1 from
    # 192 to 111 us (2026-12-02); the inline-PTX decoder (where it applies: bf16, ue8m0) from
    # 110 to 89 us, T = 64 from 954 to 683, T = 256 from 1,167 (tl.dot_scaled) to 1,075
    # (2026-12-03); prefill-sized blocks keep tl.dot_scaled (the PTX decoder is not timed
    # there). Stacked h in both decode tiers: T = 1 from 88.9 to 72.9 us, T = 64 from 679.1
    # to 593.8, T = 256 from 1,071.5 to 851.7 (2026-12-03-h200-s18.md). The down kernel's
    # grid with the n-tiles fastest, as fused_moe's: the whole op at T = 64 610.5 -> 599.9 us,
    # T = 256 849.1 -> 845.2 (2026-12-04-h200-s19.md)
    if pairs >= 64 * num_experts:
        return Fp4Tiling(64, 64, 128, 128, 8, 3, segment, fp16_bits=True, dot_scaled=True)
    decode = dict(fp16_bits=True, asm_decode=True, stack_h=True, down_tile_fastest=True)
    if pairs <= 16 * num_experts:
        return Fp4Tiling(16, 32, 64, 128, 4, 4, segment, **decode)
    return Fp4Tiling(32, 64, 128, 128, 4, 3, segment, **decode)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN / garbage)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _even_odd(ptrs, mask, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A contiguous [BM, BK] activation tile (one load the pipeliner can stage) split into
    its even and odd inputs, [BM, BK / 2] each."""
    a = tl.load(ptrs, mask=mask, other=0.0)
    return tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))


@triton.jit
def _dot2(a_even, a_odd, w_even, w_odd, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a_even.to(tl.float32), w_even, acc, input_precision="ieee")
        acc = tl.dot(a_odd.to(tl.float32), w_odd, acc, input_precision="ieee")
    else:  # the dequantized weight rounded to the activations' type, as the reference does
        acc = tl.dot(a_even, w_even.to(a_even.dtype), acc)
        acc = tl.dot(a_odd, w_odd.to(a_odd.dtype), acc)
    return acc


@triton.jit
def moe_gate_up_fp4_kernel(
    x_ptr,  # [T, D]
    w_ptr,  # [E, 2I, D / 2] uint8: gate rows 0..I-1, up rows I..2I-1
    s_ptr,  # [E, 2I, D / 32] fp32 or uint8 (ue8m0)
    h_ptr,  # [R, I] fp32 out
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
    stride_se,
    stride_sn,
    stride_ht,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    FP16_BITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    ASM_DECODE: tl.constexpr,  # bf16 x, ue8m0 scales on a GPU: the inline-PTX decoder
    STACK_H: tl.constexpr,  # h [2R, I] 16-bit: hi / lo rows per block, even / odd columns
):
    block, tile = program_block(False)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows, pair, row_ok, cols, col_ok = block_tile(
        sorted_ptr, num_pairs, inter, block, tile, BLOCK_M, BLOCK_N
    )
    token = tl.where(row_ok, pair // top_k, 0)
    kk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + token[:, None].to(tl.int64) * stride_xt
    w_gate = expert_rows(w_ptr, expert, cols, stride_we, stride_wn)  # [1, BN] row starts
    s_gate = expert_rows(s_ptr, expert, cols, stride_se, stride_sn)
    w_up, s_up = w_gate + inter * stride_wn, s_gate + inter * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if DOT_SCALED:
        for k0 in range(0, hidden, BLOCK_K):
            a_mask = row_ok[:, None] & (k0 + kk < hidden)[None, :]
            a = tl.load(x_row + k0 + kk[None, :], mask=a_mask, other=0.0)
            gate_w, gate_s = step_raw(w_gate, s_gate, k0, hidden, col_ok, BLOCK_K)
            acc_gate = tl.dot_scaled(a, None, "bf16", gate_w, tl.trans(gate_s), "e2m1", acc_gate)
            up_w, up_s = step_raw(w_up, s_up, k0, hidden, col_ok, BLOCK_K)
            acc_up = tl.dot_scaled(a, None, "bf16", up_w, tl.trans(up_s), "e2m1", acc_up)
    else:
        if PREFETCH:  # the next step's weights load while this one computes
            gate_w, gate_s = step_raw(w_gate, s_gate, 0, hidden, col_ok, BLOCK_K)
            up_w, up_s = step_raw(w_up, s_up, 0, hidden, col_ok, BLOCK_K)
        for k0 in range(0, hidden, BLOCK_K):
            a_mask = row_ok[:, None] & (k0 + kk < hidden)[None, :]
            a_even, a_odd = _even_odd(x_row + k0 + kk[None, :], a_mask, BLOCK_M, BLOCK_K)
            if PREFETCH:
                cur_gate_w, cur_gate_s, cur_up_w, cur_up_s = gate_w, gate_s, up_w, up_s
                gate_w, gate_s = step_raw(w_gate, s_gate, k0 + BLOCK_K, hidden, col_ok, BLOCK_K)
                up_w, up_s = step_raw(w_up, s_up, k0 + BLOCK_K, hidden, col_ok, BLOCK_K)
            else:
                cur_gate_w, cur_gate_s = step_raw(w_gate, s_gate, k0, hidden, col_ok, BLOCK_K)
                cur_up_w, cur_up_s = step_raw(w_up, s_up, k0, hidden, col_ok, BLOCK_K)
            if ASM_DECODE:
                even, odd = fp4_decode_bf16(cur_gate_w, cur_gate_s, BLOCK_K, BLOCK_N)
            else:
                even, odd = fp4_decode(cur_gate_w, cur_gate_s, BLOCK_K, BLOCK_N, FP16_BITS)
            acc_gate = _dot2(a_even, a_odd, even, odd, acc_gate, IEEE)
            if ASM_DECODE:
                even, odd = fp4_decode_bf16(cur_up_w, cur_up_s, BLOCK_K, BLOCK_N)
            else:
                even, odd = fp4_decode(cur_up_w, cur_up_s, BLOCK_K, BLOCK_N, FP16_BITS)
            acc_up = _dot2(a_even, a_odd, even, odd, acc_up, IEEE)
    store_h(acc_gate, acc_up, limit, h_ptr, block, rows, cols, col_ok, stride_ht, inter,
            BLOCK_M, STACK_H, True)  # fmt: skip


@triton.jit
def _down_weights(
    w_base, s_base, k0, inter, col_ok, next_w, next_s,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, FP16_BITS: tl.constexpr,
    PREFETCH: tl.constexpr, ASM_DECODE: tl.constexpr,
):  # fmt: skip
    """The down kernel's K step k0 of weights, decoded: (even, odd [BK / 2, BN], and the
    prefetched raw step carried to the next one; with PREFETCH the step loaded last time
    is decoded and step k0 + BK loaded, else step k0 is loaded now)."""
    if PREFETCH:
        cur_w, cur_s = next_w, next_s
        next_w, next_s = step_raw(w_base, s_base, k0 + BLOCK_K, inter, col_ok, BLOCK_K)
    else:
        cur_w, cur_s = step_raw(w_base, s_base, k0, inter, col_ok, BLOCK_K)
    if ASM_DECODE:
        even, odd = fp4_decode_bf16(cur_w, cur_s, BLOCK_K, BLOCK_N)
    else:
        even, odd = fp4_decode(cur_w, cur_s, BLOCK_K, BLOCK_N, FP16_BITS)
    return even, odd, next_w, next_s


@triton.jit
def moe_down_fp4_kernel(
    h_ptr,  # [R, I] fp32 (STACK_H: [2R, I] in the activations' type)
    w_ptr,  # [E, D, I / 2] uint8
    s_ptr,  # [E, D, I / 32]
    weights_ptr,  # [P] fp32 routed weights
    slots_ptr,  # [P, D] fp32 out
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    num_experts,
    stride_ht,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_slot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    ACT_DTYPE: tl.constexpr,  # the dots' input type (bf16 / fp16 on a GPU)
    FP16_BITS: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_SCALED: tl.constexpr,
    ASM_DECODE: tl.constexpr,
    STACK_H: tl.constexpr,
    TILE_FASTEST: tl.constexpr,  # grid (tiles, B): see fused_moe_kernels.program_block
):
    block, tile = program_block(TILE_FASTEST)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows, pair, row_ok, cols, col_ok = block_tile(
        sorted_ptr, num_pairs, hidden, block, tile, BLOCK_M, BLOCK_N
    )
    kk = tl.arange(0, BLOCK_K)
    h_row = h_ptr + rows[:, None].to(tl.int64) * stride_ht
    w_base = expert_rows(w_ptr, expert, cols, stride_we, stride_wn)  # [1, BN] row starts
    s_base = expert_rows(s_ptr, expert, cols, stride_se, stride_sn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PREFETCH and (STACK_H or not DOT_SCALED):  # the loops below that prefetch: K step 0
        next_w, next_s = step_raw(w_base, s_base, 0, inter, col_ok, BLOCK_K)
    else:  # carried through the loop unread
        next_w, next_s = w_base, s_base
    if STACK_H:
        # [hi; lo] rows of the block, even inputs at [0, I/2), odd ones at [I/2, I)
        r2 = tl.arange(0, 2 * BLOCK_M)
        h2 = h_ptr + (block * (2 * BLOCK_M) + r2)[:, None].to(tl.int64) * stride_ht
        kh = tl.arange(0, BLOCK_K // 2)
        half = inter // 2
        acc2 = tl.zeros((2 * BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = (k0 // 2 + kh < half)[None, :]
            a_even = tl.load(h2 + k0 // 2 + kh[None, :], mask=k_ok, other=0.0)
            a_odd = tl.load(h2 + half + k0 // 2 + kh[None, :], mask=k_ok, other=0.0)
            even, odd, next_w, next_s = _down_weights(
                w_base, s_base, k0, inter, col_ok, next_w, next_s, BLOCK_K, BLOCK_N, FP16_BITS,
                PREFETCH, ASM_DECODE,
            )  # fmt: skip
            acc2 = _dot2(a_even, a_odd, even, odd, acc2, IEEE)
        acc = tl.sum(tl.reshape(acc2, (2, BLOCK_M, BLOCK_N)), axis=0)
    elif DOT_SCALED:
        for k0 in range(0, inter, BLOCK_K):  # h = hi + lo in bf16, as below
            a = tl.load(h_row + k0 + kk[None, :], mask=(k0 + kk < inter)[None, :], other=0.0)
            hi = a.to(tl.bfloat16)
            lo = (a - hi.to(tl.float32)).to(tl.bfloat16)
            w, s = step_raw(w_base, s_base, k0, inter, col_ok, BLOCK_K)
            acc = tl.dot_scaled(hi, None, "bf16", w, tl.trans(s), "e2m1", acc)
            acc = tl.dot_scaled(lo, None, "bf16", w, tl.trans(s), "e2m1", acc)
    else:
        for k0 in range(0, inter, BLOCK_K):
            a_even, a_odd = _even_odd(
                h_row + k0 + kk[None, :], (k0 + kk < inter)[None, :], BLOCK_M, BLOCK_K
            )
            even, odd, next_w, next_s = _down_weights(
                w_base, s_base, k0, inter, col_ok, next_w, next_s, BLOCK_K, BLOCK_N, FP16_BITS,
                PREFETCH, ASM_DECODE,
            )  # fmt: skip
            if IEEE:
                acc = _dot2(a_even, a_odd, even, odd, acc, IEEE)
            else:  # h = hi + lo in the 16-bit type: two dots keep h's fp32 precision
                hi_even, hi_odd = a_even.to(ACT_DTYPE), a_odd.to(ACT_DTYPE)
                acc = _dot2(hi_even, hi_odd, even, odd, acc, IEEE)
                lo_even = (a_even - hi_even.to(tl.float32)).to(ACT_DTYPE)
                lo_odd = (a_odd - hi_odd.to(tl.float32)).to(ACT_DTYPE)
                acc = _dot2(lo_even, lo_odd, even, odd, acc, IEEE)
    store_weighted(acc, weights_ptr, slots_ptr, pair, row_ok, cols, col_ok, stride_slot)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _shape(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"


def _check(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale) -> None:
    if x.dim() != 2 or x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"x must be [T, D] in {_ACTIVATION_DTYPES}, got {_shape(x)}")
    t, d = x.shape
    ids_ok = topk_ids.dtype in (torch.int32, torch.int64)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or not ids_ok:
        raise ValueError(f"topk_ids must be [{t}, k] int32/int64, got {_shape(topk_ids)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must be shaped as topk_ids, got {_shape(topk_weights)}")
    if w13.dtype != torch.uint8 or w13.dim() != 3 or w13.shape[2] * 2 != d or w13.shape[1] % 2:
        raise ValueError(f"w13 must be packed uint8 [E, 2I, {d // 2}], got {_shape(w13)}")
    e, two_i, _ = w13.shape
    i = two_i // 2
    if d % 32 or i % 32:
        raise ValueError(f"D ({d}) and I ({i}) must be multiples of 32 for FP4 experts")
    if w2.dtype != torch.uint8 or tuple(w2.shape) != (e, d, i // 2):
        raise ValueError(f"w2 must be packed uint8 [{e}, {d}, {i // 2}], got {_shape(w2)}")
    scales = (
        ("w13_scale", w13_scale, (e, two_i, d // 32)),
        ("w2_scale", w2_scale, (e, d, i // 32)),
    )
    for name, scale, want in scales:
        if tuple(scale.shape) != want or scale.dtype not in (torch.float32, torch.uint8):
            raise ValueError(f"{name} must be fp32 or ue8m0 uint8 {want}, got {_shape(scale)}")
    if w13_scale.dtype != w2_scale.dtype:
        raise ValueError("w13_scale and w2_scale must have one dtype")


def moe_experts_fp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
    *,
    tiling: Fp4Tiling | None = None,
) -> torch.Tensor:
    """x: [T, D]; topk_ids/topk_weights: [T, k]; w13: uint8 [E, 2I, D / 2], w13_scale:
    [E, 2I, D / 32]; w2: uint8 [E, D, I / 2], w2_scale: [E, D, I / 32] (scales fp32, or
    uint8 ue8m0). Returns [T, D] in x's dtype; a slot whose id is outside [0, E) adds 0."""
    _check(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = _empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    t = tiling or default_tiling(num_tokens, top_k, num_experts, x.device)
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    w13_scale, w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    num_pairs = num_tokens * top_k
    bm = t.block_m
    sorted_ids, block_expert = moe_align(topk_ids, num_experts, bm, t.align_segment)
    num_blocks = block_expert.shape[0]
    ieee = x.dtype == torch.float32 or x.device.type == "cpu"
    dot_scaled = t.dot_scaled and not ieee and x.dtype == torch.bfloat16
    dot_scaled = dot_scaled and w13_scale.dtype == torch.uint8
    asm_decode = t.asm_decode and not dot_scaled and not ieee and x.dtype == torch.bfloat16
    asm_decode = asm_decode and w13_scale.dtype == torch.uint8
    stack_h = t.stack_h and not dot_scaled and x.dtype != torch.float32

    if stack_h:  # hi and lo rows of each block, even columns before odd ones
        h = _empty((2 * num_blocks * bm, inter), x.dtype, x.device)
    else:
        h = _empty((num_blocks * bm, inter), torch.float32, x.device)
    moe_gate_up_fp4_kernel[(num_blocks, triton.cdiv(inter, t.gate_up_block_n))](
        x, w13, w13_scale, h, sorted_ids, block_expert,
        num_pairs, top_k, hidden, inter, num_experts, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        h.stride(0),
        BLOCK_M=bm, BLOCK_N=t.gate_up_block_n, BLOCK_K=t.block_k, IEEE=ieee,
        FP16_BITS=t.fp16_bits, PREFETCH=t.prefetch, DOT_SCALED=dot_scaled,
        ASM_DECODE=asm_decode, STACK_H=stack_h, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    slots = _empty((num_pairs, hidden), torch.float32, x.device)
    grid = (num_blocks, triton.cdiv(hidden, t.down_block_n))
    moe_down_fp4_kernel[grid[::-1] if t.down_tile_fastest else grid](
        h, w2, w2_scale, weights, slots, sorted_ids, block_expert,
        num_pairs, hidden, inter, num_experts,
        h.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        slots.stride(0),
        BLOCK_M=bm, BLOCK_N=t.down_block_n, BLOCK_K=t.block_k, IEEE=ieee,
        ACT_DTYPE=_TL_DTYPES[x.dtype], FP16_BITS=t.fp16_bits, PREFETCH=t.prefetch,
        DOT_SCALED=dot_scaled, ASM_DECODE=asm_decode, STACK_H=stack_h,
        TILE_FASTEST=t.down_tile_fastest, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    block_d = min(1024, triton.next_power_of_2(hidden))
    moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        slots, topk_ids.view(-1), out, top_k, hidden, num_experts, slots.stride(0),
        out.stride(0), BLOCK_D=block_d, num_warps=4, **pdl(slots.device),
    )  # fmt: skip
    return out
