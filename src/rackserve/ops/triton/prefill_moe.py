"""The elementwise steps of the grouped-GEMM MoE (``ops/grouped_moe.py``, the prefill path)
as one pass each, instead of chains of torch ops over strided views.

Shape legend: T tokens, k experts per token, N = T * k (token, slot) pairs sorted by
expert, D hidden, I expert width, E experts.

- ``moe_sort_pairs``: topk_ids [T, k] -> the pairs' stable sort by expert as the token of
  each sorted row, the sorted row of each pair and each expert's end row: a counting sort
  in two launches over segments of pairs (``moe_align_kernels.py``), where argsort, its
  inverse scatter and the counts took ~15 small launches.
- ``moe_permute``: x [T, D], inverse [T, k] -> rows [N, D], rows[inverse[t, j]] = x[t]:
  each token's row read once and written to its k sorted rows. A gather by sorted row
  (``index_select(token_of_row)``) reads each x row k times in expert order, from DRAM once
  x outgrows L2 (67 MB at 8192 tokens): 1.15 ms for 4 layers of prefill:8192 on the H100
  (2026-12-06-s27.md), against ~0.6 for the bytes of x once and the rows; bench forward
  prefill:8192 0.2-0.7 ms faster with this kernel.
  Grid (T, cdiv(D, BLOCK_D)); a ``PermuteTiling`` with ``vector_slots``: the k rows of
  BLOCK_T tokens in one [BLOCK_T, K_PAD, BLOCK_D] store (every index loaded up front, no
  index load between row stores), grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)).
- ``swiglu_rows``: h [N, 2I] = [gate | up] (the w13 grouped GEMM's output) -> [N, I],
  silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, rounded once.
  Grid (cdiv(N, BLOCK_M), cdiv(I, BLOCK_I)); ``SwigluTiling`` picks BLOCK_M, BLOCK_I, warps.
- ``moe_unpermute``: y [N, D] (the w2 grouped GEMM's output, expert order), inverse [T, k]
  (the row of y of each (token, slot)), weights [T, k], optionally extra [T, D] (the shared
  expert run apart, a last slot of weight 1) -> out [T, D] =
  sum_j weights[t, j] * y[inverse[t, j]] (+ extra[t]), the slots summed in order in fp32
  (no atomics: deterministic), rounded once. Grid (T, cdiv(D, BLOCK_D)); with
  ``vector_slots`` one [BLOCK_T, K_PAD, BLOCK_D] gather of every row, then the same sum in
  the same order (bit for bit the loop kernel's output).

Each equals its ``ops.reference`` namesake (``moe_permute`` exactly, the others up to the
final rounding); grids depend on the shapes only (no host sync). ``tiling=None``: the
launch shapes measured in prefill (the loop kernels); the tilings are for A/B runs
(``benchmarks/prefill_bench.py --moe-only``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import round_as
from rackserve.ops.triton.fused_moe import count_pairs, scan_shape
from rackserve.ops.triton.moe_align_kernels import moe_sort_kernel

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# pairs a sort program takes: a few [CHUNK, E] scans each, many programs (8192 tokens, k 7:
# 224 segments)
SORT_SEGMENT = 256


@dataclass(frozen=True)
class PermuteTiling:
    """Launch shape of ``moe_permute`` and ``moe_unpermute`` (powers of two). The default:
    the loop kernels (one token a program, the k slots in a runtime loop, each index loaded
    just before its row)."""

    block_d: int = 2048  # columns a program (at most D's next power of two)
    block_t: int = 1  # tokens a program (vector_slots only)
    # k padded to K_PAD (a power of two, the padding masked): every index and row of
    # block_t tokens at once. Keep block_d >= 256 num_warps (16-bit): with fewer columns
    # the layout puts warps across the slots and unpermute's sum goes through shared memory
    vector_slots: bool = False
    num_warps: int = 4


@dataclass(frozen=True)
class SwigluTiling:
    """Launch shape of ``swiglu_rows`` (powers of two). None: BLOCK_I min(1024, I's next
    power of two), BLOCK_M 4096 / BLOCK_I, 4 warps."""

    block_m: int
    block_i: int
    num_warps: int = 4


# Candidates for A/B runs at the model's shapes (D 4096, I 2048, k 5, bf16;
# ``benchmarks/prefill_bench.py --moe-only``), besides the defaults (tiling=None).
# slots_*: vector_slots at block_t tokens, block_d columns, num_warps; loop_*: the loop
# kernel in larger programs. A program gathers block_t x K_PAD (8 at k 5) x block_d elements.
PERMUTE_TILINGS = {
    "slots_d1024_w4": PermuteTiling(1024, 1, True, 4),
    "slots_d2048_w4": PermuteTiling(2048, 1, True, 4),
    "slots_d2048_w8": PermuteTiling(2048, 1, True, 8),
    "slots_t2_d1024_w4": PermuteTiling(1024, 2, True, 4),
    "slots_t4_d1024_w4": PermuteTiling(1024, 4, True, 4),
    "loop_d4096_w8": PermuteTiling(4096, 1, False, 8),
}
UNPERMUTE_TILINGS = {
    "slots_d512_w2": PermuteTiling(512, 1, True, 2),
    "slots_d1024_w4": PermuteTiling(1024, 1, True, 4),
    "slots_d2048_w8": PermuteTiling(2048, 1, True, 8),
    "slots_d4096_w16": PermuteTiling(4096, 1, True, 16),
    "slots_t2_d1024_w4": PermuteTiling(1024, 2, True, 4),
    "loop_d4096_w8": PermuteTiling(4096, 1, False, 8),
}
SWIGLU_TILINGS = {  # the default at I 2048: m4_i1024_w4
    "m8_i1024_w4": SwigluTiling(8, 1024, 4),
    "m8_i1024_w8": SwigluTiling(8, 1024, 8),
    "m16_i1024_w8": SwigluTiling(16, 1024, 8),
    "m16_i512_w8": SwigluTiling(16, 512, 8),
    "m8_i2048_w8": SwigluTiling(8, 2048, 8),
}


def _check_tiling(tiling: PermuteTiling) -> None:
    if not tiling.vector_slots and tiling.block_t != 1:
        raise ValueError(f"block_t > 1 needs vector_slots: {tiling}")


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output comes from here (tests fill them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def moe_sort_pairs(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``reference.moe_sort_pairs``."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be [T, k] int, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    t, k = topk_ids.shape
    num_pairs, device = t * k, topk_ids.device
    token = torch.empty(num_pairs, dtype=torch.int32, device=device)
    inverse = torch.empty(t, k, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return token, inverse, ends.zero_()
    ids = topk_ids.contiguous().view(-1)
    block_e, chunk, segment, num_segments = scan_shape(num_pairs, num_experts, SORT_SEGMENT)
    counts = count_pairs(ids, num_experts, block_e, chunk, segment, num_segments)
    moe_sort_kernel[(num_segments,)](
        ids, counts, token, inverse, ends, num_pairs, num_experts, k, segment, num_segments,
        BLOCK_E=block_e, CHUNK=chunk,
    )  # fmt: skip
    return token, inverse, ends


def moe_permute(
    x: torch.Tensor, inverse: torch.Tensor, *, tiling: PermuteTiling | None = None
) -> torch.Tensor:
    """x: [T, D]; inverse: [T, k] int (sorted rows) -> rows [T * k, D] in x's dtype."""
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, D] in {_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if (
        inverse.dim() != 2
        or inverse.shape[0] != x.shape[0]
        or inverse.dtype
        not in (
            torch.int32,
            torch.int64,
        )
    ):
        raise ValueError(
            f"inverse must be [{x.shape[0]}, k] int, got {tuple(inverse.shape)} {inverse.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    inverse = inverse.contiguous()
    num_tokens, k = inverse.shape
    dim = x.shape[1]
    rows = _empty((num_tokens * k, dim), x.dtype, x.device)
    if rows.numel() == 0:
        return rows
    tiling = tiling or PermuteTiling()
    _check_tiling(tiling)
    block_d = min(tiling.block_d, triton.next_power_of_2(dim))
    if tiling.vector_slots:
        grid = (triton.cdiv(num_tokens, tiling.block_t), triton.cdiv(dim, block_d))
        permute_slots_kernel[grid](
            x, inverse, rows, num_tokens, dim, x.stride(0), rows.stride(0), K=k,
            K_PAD=triton.next_power_of_2(k), BLOCK_T=tiling.block_t, BLOCK_D=block_d,
            num_warps=tiling.num_warps,
        )  # fmt: skip
        return rows
    grid = (num_tokens, triton.cdiv(dim, block_d))
    permute_kernel[grid](
        x, inverse, rows, dim, k, x.stride(0), rows.stride(0), BLOCK_D=block_d,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    return rows


def swiglu_rows(
    h: torch.Tensor, limit: float, *, tiling: SwigluTiling | None = None
) -> torch.Tensor:
    """h: [N, 2I] (gate columns, then up columns) -> [N, I] in h's dtype."""
    if h.dim() != 2 or h.shape[1] % 2 or h.dtype not in _DTYPES:
        raise ValueError(f"h must be [N, 2I] in {_DTYPES}, got {tuple(h.shape)} {h.dtype}")
    if h.stride(1) != 1:
        h = h.contiguous()
    num_rows, inter = h.shape[0], h.shape[1] // 2
    out = _empty((num_rows, inter), h.dtype, h.device)
    if out.numel() == 0:
        return out
    if tiling is None:
        block_i = min(1024, triton.next_power_of_2(inter))
        tiling = SwigluTiling(max(1, 4096 // block_i), block_i)
    block_m, block_i = tiling.block_m, min(tiling.block_i, triton.next_power_of_2(inter))
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(inter, block_i))
    swiglu_kernel[grid](
        h, out, num_rows, inter, float(limit), h.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_I=block_i, num_warps=tiling.num_warps,
    )  # fmt: skip
    return out


def moe_unpermute(
    y: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    extra: torch.Tensor | None = None,
    *,
    tiling: PermuteTiling | None = None,
) -> torch.Tensor:
    """y: [N, D]; inverse: [T, k] int (rows of y); weights: [T, k] float; extra: None or
    [T, D] in y's dtype (the last slot, weight 1) -> [T, D] y.dtype."""
    if y.dim() != 2 or y.dtype not in _DTYPES:
        raise ValueError(f"y must be [N, D] in {_DTYPES}, got {tuple(y.shape)} {y.dtype}")
    if inverse.dim() != 2 or inverse.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"inverse must be [T, k] int, got {tuple(inverse.shape)} {inverse.dtype}")
    if tuple(weights.shape) != tuple(inverse.shape) or not weights.is_floating_point():
        raise ValueError(
            f"weights must be float {tuple(inverse.shape)}, got {tuple(weights.shape)} "
            f"{weights.dtype}"
        )
    num_tokens, k = inverse.shape
    dim = y.shape[1]
    if extra is not None and (tuple(extra.shape) != (num_tokens, dim) or extra.dtype != y.dtype):
        raise ValueError(
            f"extra must be [{num_tokens}, {dim}] {y.dtype}, got {tuple(extra.shape)} {extra.dtype}"
        )
    if y.stride(1) != 1:
        y = y.contiguous()
    if extra is not None and extra.stride(1) != 1:
        extra = extra.contiguous()
    inverse, weights = inverse.contiguous(), weights.to(torch.float32).contiguous()
    out = _empty((num_tokens, dim), y.dtype, y.device)
    if out.numel() == 0:
        return out
    tiling = tiling or PermuteTiling()
    _check_tiling(tiling)
    block_d = min(tiling.block_d, triton.next_power_of_2(dim))
    # no extra: out stands in for its pointer (HAS_EXTRA=False never reads it)
    extra_ptr, stride_e = (out, 0) if extra is None else (extra, extra.stride(0))
    if tiling.vector_slots:
        grid = (triton.cdiv(num_tokens, tiling.block_t), triton.cdiv(dim, block_d))
        unpermute_slots_kernel[grid](
            y, inverse, weights, out, extra_ptr, num_tokens, dim, y.stride(0),
            out.stride(0), stride_e, K=k, K_PAD=triton.next_power_of_2(k),
            HAS_EXTRA=extra is not None, BLOCK_T=tiling.block_t, BLOCK_D=block_d,
            num_warps=tiling.num_warps,
        )  # fmt: skip
        return out
    grid = (num_tokens, triton.cdiv(dim, block_d))
    unpermute_kernel[grid](
        y, inverse, weights, out, extra_ptr, dim, k, y.stride(0), out.stride(0),
        stride_e, HAS_EXTRA=extra is not None, BLOCK_D=block_d, num_warps=tiling.num_warps,
    )  # fmt: skip
    return out


@triton.jit
def swiglu_kernel(h_ptr, out_ptr, num_rows, inter, limit, stride_h, stride_o,
                  BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :]
    gate = tl.load(h_rows, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_rows + inter, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    y = gate / (1.0 + tl.exp(-gate)) * up
    out_ty = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out_ptrs, round_as(y, out_ty).to(out_ty), mask=mask)


@triton.jit
def unpermute_kernel(y_ptr, inverse_ptr, w_ptr, out_ptr, extra_ptr, dim, k, stride_y, stride_o,
                     stride_e, HAS_EXTRA: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in range(k):  # the slots in order: deterministic
        row = tl.load(inverse_ptr + t * k + j).to(tl.int64)
        w = tl.load(w_ptr + t * k + j)
        acc += w * tl.load(y_ptr + row * stride_y + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_EXTRA:  # the last slot, weight 1
        acc += tl.load(extra_ptr + t * stride_e + cols, mask=col_ok, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * stride_o + cols, round_as(acc, out_ty).to(out_ty), mask=col_ok)


@triton.jit
def permute_kernel(x_ptr, inverse_ptr, rows_ptr, dim, k, stride_x, stride_r,
                   BLOCK_D: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    x = tl.load(x_ptr + t * stride_x + cols, mask=col_ok)
    for j in range(k):
        row = tl.load(inverse_ptr + t * k + j).to(tl.int64)
        tl.store(rows_ptr + row * stride_r + cols, x, mask=col_ok)


@triton.jit
def _slot(tile, slots, j: tl.constexpr, AXIS: tl.constexpr):
    """Slot ``j`` of ``tile`` along ``AXIS`` (``slots``: tl.arange over it, broadcast to the
    tile), exactly: the other slots become -0.0, and x + -0.0 is x for every x, so on sm_90
    the select and sum fold away (a literal -0.0 reaches the IR as +0.0, whose adds stay)."""
    neg_zero = tl.full((1,), 0x80000000, tl.uint32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(slots == j, tile, neg_zero), axis=AXIS)


@triton.jit
def _slot_block(num_tokens, dim, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """A slot kernel's block: its tokens [BLOCK_T], columns [BLOCK_D] and slots [K_PAD], which
    are in range, and the (token, slot) pairs' flat index [BLOCK_T, K_PAD] into inverse."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slots = tl.arange(0, K_PAD)
    tok_ok, col_ok = tokens < num_tokens, cols < dim
    pair_ok = tok_ok[:, None] & (slots < K)[None, :]
    pairs = tokens.to(tl.int64)[:, None] * K + slots[None, :]
    return tokens, cols, slots, tok_ok, col_ok, pair_ok, pairs


@triton.jit
def permute_slots_kernel(x_ptr, inverse_ptr, rows_ptr, num_tokens, dim, stride_x, stride_r,
                         K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr):  # fmt: skip
    """``permute_kernel`` for BLOCK_T tokens: their K_PAD >= k indices as one load, then
    every row in one masked [BLOCK_T, K_PAD, BLOCK_D] store."""
    tokens, cols, _, tok_ok, col_ok, pair_ok, pairs = _slot_block(
        num_tokens, dim, K, K_PAD, BLOCK_T, BLOCK_D
    )
    row = tl.load(inverse_ptr + pairs, mask=pair_ok, other=0)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x + cols[None, :]
    x = tl.load(x_rows, mask=tok_ok[:, None] & col_ok[None, :])
    out = rows_ptr + row.to(tl.int64)[:, :, None] * stride_r + cols[None, None, :]
    mask = pair_ok[:, :, None] & col_ok[None, None, :]
    tl.store(out, tl.broadcast_to(x[:, None, :], (BLOCK_T, K_PAD, BLOCK_D)), mask=mask)


@triton.jit
def unpermute_slots_kernel(y_ptr, inverse_ptr, w_ptr, out_ptr, extra_ptr, num_tokens, dim,
                           stride_y, stride_o, stride_e, K: tl.constexpr, K_PAD: tl.constexpr,
                           HAS_EXTRA: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_D: tl.constexpr):  # fmt: skip
    """``unpermute_kernel`` for BLOCK_T tokens: their K_PAD >= k indices and weights as one
    load each, every row in one [BLOCK_T, K_PAD, BLOCK_D] gather, then the slots summed as
    the loop kernel sums them (fp32, j = 0..k-1 in order, extra last: the same bits)."""
    tokens, cols, slots, tok_ok, col_ok, pair_ok, pairs = _slot_block(
        num_tokens, dim, K, K_PAD, BLOCK_T, BLOCK_D
    )
    row = tl.load(inverse_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
    w = tl.load(w_ptr + pairs, mask=pair_ok, other=0.0)
    y_rows = y_ptr + row[:, :, None] * stride_y + cols[None, None, :]
    mask = pair_ok[:, :, None] & col_ok[None, None, :]
    y = tl.load(y_rows, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in tl.static_range(K):  # the slots in order, as unpermute_kernel
        w_j = _slot(w, slots[None, :], j, 1)
        acc += w_j[:, None] * _slot(y, slots[None, :, None], j, 1)
    tokens64 = tokens.to(tl.int64)[:, None]
    out_mask = tok_ok[:, None] & col_ok[None, :]
    if HAS_EXTRA:  # the last slot, weight 1
        extra = tl.load(extra_ptr + tokens64 * stride_e + cols[None, :], mask=out_mask, other=0.0)
        acc += extra.to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + tokens64 * stride_o + cols[None, :], round_as(acc, out_ty).to(out_ty),
             mask=out_mask)  # fmt: skip
