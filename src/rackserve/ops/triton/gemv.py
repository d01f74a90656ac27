"""Split-K GEMV for decode-sized batches (equals ``reference.linear``: ``x @ weight.T``).

At decode sizes a projection is a weight stream: [N, K] bf16 read once, a few FLOPs per
byte. cuBLAS picks tiles for such shapes at 1-2 launches (``nvjet_*_splitK`` +
``splitKreduce_kernel`` in the H200 profiles: 1-3 extra launches per decoder layer). Here:

    gemv_kernel   grid (N / BLOCK_N, S): program (n, s) streams weight rows n of K-slice s
                  and multiplies the [T, K-slice] tokens with one tl.dot (T padded to 16
                  rows at least: tensor cores, the padding costs no bytes);
                  S = 1: writes y directly; S > 1: writes fp32 partials [S, T, N] and, with
                  ``GemvTiling.fused_reduce`` (the default), the split that arrives last at
                  its column block's int32 counter sums the partials in split order and
                  writes y, as the fused mHC does: one launch, deterministic
    gemv_reduce   (S > 1 without the fused reduce, or while a graph is captured with no
                  counters yet) sums the partials in split order: no atomics in values

A grouped projection (``reference.grouped_linear``, the attention's ``wo_a``: G blocks on the
diagonal) is the same launch: column block n reads the inputs of its group, the x columns
[g K, (g + 1) K) of g = n BLOCK_N / (N / G), where N / G is a multiple of BLOCK_N.

S is the most that keeps the launch within two programs per SM (the lm_head's 2,020 column
blocks need no split; wo_b's 64 take 4 splits of its 8,192 inputs). fp32 accumulation,
one rounding to the output dtype, like cuBLAS. Grids depend on (T, N, K) only: graph-safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import (
    arrival_counters,
    last_to_arrive,
    pdl,
    pdl_wait,
    round_as,
)

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_TOKENS = 64  # token rows one program holds (tl.dot's M: 16 at least)


@dataclass(frozen=True)
class GemvTiling:
    block_n: int
    block_k: int
    splits: int  # K slices (1: no partials, one launch)
    num_warps: int = 4
    num_stages: int = 4
    fused_reduce: bool = True  # S > 1: the last split reduces (one launch), see above


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# the programs a GPU launch may have, per SM (two of 4 x 20 KB stages fit; read at call
# time): the split count is the most that keeps N / 64 x S within them (one wave, no tail
# of a few programs after it; ceil(2 a SM / column blocks) had the HCA input projection at
# 280 programs, CSA's at 325, wo_b at 320). bench forward on the H100, two alternating
# passes of 30 runs (results/2026-12-06-s31.md): decode:1 1.558 / 1.552 -> 1.547 / 1.547 ms,
# decode:8 3.598 / 3.594 -> 3.586 / 3.588; ceil(1 a SM) 1.551 / 1.552 and 3.590 / 3.597.
PROGRAMS_PER_SM = 2


def default_tiling(n: int, k: int, device: torch.device, groups: int = 1) -> GemvTiling:
    """Block sizes and the split count from N, K and the device (host ints: graph-safe).

    GPU: 64 weight rows x 128 inputs per step (16 KB of bf16 weights in flight per stage,
    4 stages); the most splits that keep N/64 x S within ``PROGRAMS_PER_SM`` programs per
    SM, each slice at least 512 inputs. CPU (the interpreter): small tiles, few programs.
    groups > 1: the rows a step halved (to 16 at least) until they divide a group's N / G."""
    if device.type != "cuda":
        block_n, block_k, programs, min_slice = 32, 32, 4, 64
    else:
        block_n, block_k, min_slice = 64, 128, 512
        programs = PROGRAMS_PER_SM * _num_sms(device)
    while groups > 1 and block_n > 16 and (n // groups) % block_n:
        block_n //= 2
    blocks_n = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    splits = max(1, min(programs // blocks_n, k // min_slice, k_blocks))
    return GemvTiling(block_n, block_k, splits)


def k_slices(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(inputs a K-slice, slices) for ``splits`` slices of whole BLOCK_K tiles over K: no
    slice without inputs, so there may be fewer than asked."""
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
    return k_per_split, triton.cdiv(k, k_per_split)


@triton.jit
def gemv_slice(
    x_ptr,
    w_ptr,
    T,
    N,
    K,
    k_start,
    k_len,  # a multiple of BLOCK_K
    stride_x,
    stride_w,
    pid_n,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """x's K-slice [k_start, k_start + k_len) times weight rows of column block pid_n:
    (acc [BLOCK_T, BLOCK_N] fp32, t, n, mask)."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for kk in range(0, k_len, BLOCK_K):
        k = k_start + kk + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], t_ok[:, None] & k_ok[None, :], 0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :],
                    n_ok[:, None] & k_ok[None, :], 0.0)  # fmt: skip
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc, t, n, t_ok[:, None] & n_ok[None, :]


@triton.jit
def sum_partials(
    part, stride_split, num_splits, mask, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The splits' fp32 partials (split j at part + j * stride_split) summed in split order:
    the two-launch path's sum."""
    total = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for j in range(num_splits):
        total += tl.load(part + j * stride_split, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def gemv_kernel(
    x_ptr,  # [T, K], unit column stride
    w_ptr,  # [N, K], unit column stride
    part_ptr,  # SPLIT: [S, T, N] fp32 partials
    out_ptr,  # [T, N] (row stride stride_out)
    counter_ptr,  # FUSED: [>= N / BLOCK_N] int32, zero between calls
    T,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_x,
    stride_w,
    stride_out,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    FUSED: tl.constexpr,  # SPLIT: the last split of a column block reduces
    FP32_DOT: tl.constexpr,  # IEEE fp32 dots: fp32 inputs, and the interpreter
    OUT_DTYPE: tl.constexpr,
    GROUP_N: tl.constexpr,  # > 0: grouped, N / G outputs a group (a multiple of BLOCK_N)
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    if GROUP_N > 0:  # this column block's group reads its own K inputs of x's G K
        x_ptr += (pid_n * BLOCK_N // GROUP_N) * K
    acc, t, n, mask = gemv_slice(
        x_ptr, w_ptr, T, N, K, s * k_per_split, k_per_split, stride_x, stride_w, pid_n,
        BLOCK_T, BLOCK_N, BLOCK_K, FP32_DOT,
    )  # fmt: skip
    out = out_ptr + t[:, None] * stride_out + n[None, :]
    if SPLIT:
        part = part_ptr + t[:, None] * N + n[None, :]
        tl.store(part + s * T * N, acc, mask=mask)
        if FUSED:
            num_splits = tl.num_programs(1)
            if last_to_arrive(counter_ptr + pid_n, num_splits):
                total = sum_partials(part, T * N, num_splits, mask, BLOCK_T, BLOCK_N)
                tl.store(out, round_as(total, OUT_DTYPE).to(OUT_DTYPE), mask=mask)
    else:
        tl.store(out, round_as(acc, OUT_DTYPE).to(OUT_DTYPE), mask=mask)


@triton.jit
def gemv_reduce_kernel(
    part_ptr,  # [S, T, N] fp32
    out_ptr,  # [T, N]
    T,
    N,
    S,
    stride_out,
    BLOCK: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(S):  # split order: the same sum every call
        acc += tl.load(part_ptr + (s * T + t) * N + n, mask=n_ok, other=0.0)
    tl.store(out_ptr + t * stride_out + n, round_as(acc, OUT_DTYPE).to(OUT_DTYPE), mask=n_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    tiling: GemvTiling | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """``x @ weight.T``: x [T, K] with T <= ``MAX_TOKENS``, weight [N, K] (same dtype,
    fp32/bf16/fp16); returns [T, N] in ``out_dtype`` (x's by default; float32 writes the
    fp32 accumulator unrounded: the lm_head's logits), into ``out`` when given (unit column
    stride).

    groups > 1: ``reference.grouped_linear`` of x [T, G, K] (or [T, G K]) and weight
    [N, K]: group g's N / G outputs from its K inputs; N / G must be a multiple of the
    tiling's ``block_n`` (``default_tiling(n, k, device, groups)`` picks one)."""
    if groups > 1 and x.dim() == 3 and x.shape[1] == groups:
        x = x.flatten(1)
    if (
        x.dim() != 2 or weight.dim() != 2 or groups < 1
        or x.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups
    ):  # fmt: skip
        raise ValueError(
            f"gemv: x [T, G K] and weight [N, K] with G = {groups} dividing N expected, got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.shape[0] > MAX_TOKENS:
        raise ValueError(f"gemv: at most {MAX_TOKENS} tokens, got {x.shape[0]}")
    if x.dtype not in _TL_DTYPE or weight.dtype != x.dtype or x.device != weight.device:
        raise ValueError(
            f"gemv: x and weight must share a float dtype and device, got {x.dtype} on "
            f"{x.device}, {weight.dtype} on {weight.device}"
        )
    t, (n, k) = x.shape[0], weight.shape
    out_dtype = out_dtype or (out.dtype if out is not None else x.dtype)
    if out_dtype not in _TL_DTYPE:
        raise ValueError(f"gemv: out_dtype must be fp32/bf16/fp16, got {out_dtype}")
    if out is None:
        out = torch.empty(t, n, dtype=out_dtype, device=x.device)
    elif (
        out.shape != (t, n) or out.stride(1) != 1 or out.device != x.device
        or out.dtype != out_dtype
    ):  # fmt: skip
        raise ValueError(
            f"gemv: out must be [{t}, {n}] {out_dtype} with unit column stride on {x.device}, "
            f"got {tuple(out.shape)} {out.dtype} (strides {out.stride()}) on {out.device}"
        )
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    tiling = tiling or default_tiling(n, k, x.device, groups)
    if groups > 1 and (n // groups) % tiling.block_n:
        raise ValueError(
            f"gemv: {n // groups} outputs a group is not a multiple of block_n {tiling.block_n}"
        )
    k_per_split, splits = k_slices(k, tiling.block_k, tiling.splits)
    tl_out = _TL_DTYPE[out_dtype]
    part = torch.empty(splits, t, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    blocks_n = triton.cdiv(n, tiling.block_n)
    fused = splits > 1 and tiling.fused_reduce
    counters = arrival_counters("gemv", x.device, blocks_n, 4096) if fused else None
    gemv_kernel[(blocks_n, splits)](
        x, weight, part, out, counters if counters is not None else part, t, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
        SPLIT=splits > 1, FUSED=counters is not None,
        FP32_DOT=x.dtype == torch.float32 or x.device.type != "cuda",
        OUT_DTYPE=tl_out, GROUP_N=n // groups if groups > 1 else 0,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, **pdl(x.device),
    )  # fmt: skip
    if splits > 1 and counters is None:
        block = min(1024, triton.next_power_of_2(n))
        gemv_reduce_kernel[(triton.cdiv(n, block), t)](
            part, out, t, n, splits, out.stride(0), BLOCK=block, OUT_DTYPE=tl_out,
            num_warps=4, **pdl(part.device),
        )  # fmt: skip
    return out
