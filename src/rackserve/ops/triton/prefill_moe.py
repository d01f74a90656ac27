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
  Grid (T, cdiv(D, BLOCK_D)).
- ``swiglu_rows``: h [N, 2I] = [gate | up] (the w13 grouped GEMM's output) -> [N, I],
  silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, rounded once.
  Grid (cdiv(N, BLOCK_M), cdiv(I, BLOCK_I)).
- ``moe_unpermute``: y [N, D] (the w2 grouped GEMM's output, expert order), inverse [T, k]
  (the row of y of each (token, slot)), weights [T, k], optionally extra [T, D] (the shared
  expert run apart, a last slot of weight 1) -> out [T, D] =
  sum_j weights[t, j] * y[inverse[t, j]] (+ extra[t]), the slots summed in order in fp32
  (no atomics: deterministic), rounded once. Grid (T, cdiv(D, BLOCK_D)).

Each equals its ``ops.reference`` namesake (``moe_permute`` exactly, the others up to the
final rounding); grids depend on the shapes only (no host sync).
"""

from __future__ import annotations

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


def moe_permute(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
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
    block_d = min(2048, triton.next_power_of_2(dim))
    grid = (num_tokens, triton.cdiv(dim, block_d))
    permute_kernel[grid](
        x, inverse, rows, dim, k, x.stride(0), rows.stride(0), BLOCK_D=block_d, num_warps=4
    )
    return rows


def swiglu_rows(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h: [N, 2I] (gate columns, then up columns) -> [N, I] in h's dtype."""
    if h.dim() != 2 or h.shape[1] % 2 or h.dtype not in _DTYPES:
        raise ValueError(f"h must be [N, 2I] in {_DTYPES}, got {tuple(h.shape)} {h.dtype}")
    if h.stride(1) != 1:
        h = h.contiguous()
    num_rows, inter = h.shape[0], h.shape[1] // 2
    out = _empty((num_rows, inter), h.dtype, h.device)
    if out.numel() == 0:
        return out
    block_i = min(1024, triton.next_power_of_2(inter))
    block_m = max(1, 4096 // block_i)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(inter, block_i))
    swiglu_kernel[grid](
        h, out, num_rows, inter, float(limit), h.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_I=block_i, num_warps=4,
    )  # fmt: skip
    return out


def moe_unpermute(
    y: torch.Tensor,
    inverse: torch.Tensor,
    weights: torch.Tensor,
    extra: torch.Tensor | None = None,
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
    block_d = min(2048, triton.next_power_of_2(dim))
    grid = (num_tokens, triton.cdiv(dim, block_d))
    unpermute_kernel[grid](
        y, inverse, weights, out, extra if extra is not None else out, dim, k, y.stride(0),
        out.stride(0), extra.stride(0) if extra is not None else 0,
        HAS_EXTRA=extra is not None, BLOCK_D=block_d, num_warps=4,
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
