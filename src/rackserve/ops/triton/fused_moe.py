"""Fused routed experts: ``moe_experts``, equal to ``ops.reference.moe_experts``.

Shape legend: T tokens, k experts per token, P = T*k (token, slot) pairs, E experts,
D hidden, I expert width, BM rows per block.

    align      (1 launch, 2 when P > one segment) -> sorted_ids [R], block_expert [B]
    gate_up    x[token] @ w13[e]^T, clamped SwiGLU  -> h [R, I] in the weights' type
    down       h @ w2[e]^T * routed weight          -> slots [P, D] fp32
    sum        the k slots of each token, in order  -> out [T, D]

(kernels and the align layout in ``fused_moe_kernels.py``). Every buffer and grid depends
on T, k, E, D, I and the tiling only: no host syncs, so the op can be captured in a CUDA
graph, and no float atomics, so a replay is bitwise equal to an eager call. Decode reads
only the hit experts' weights, each once per n-tile (BM=16 rows hold all of an expert's
tokens up to 16). Under TRITON_INTERPRET=1 (CPU tests) the same kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from rackserve.ops.reference import ExpertSlots
from rackserve.ops.triton.common import pdl
from rackserve.ops.triton.fused_moe_kernels import (
    moe_down_kernel,
    moe_gate_up_kernel,
    moe_sum_kernel,
)
from rackserve.ops.triton.moe_align_kernels import (
    moe_align_expert_kernel,
    moe_align_kernel,
    moe_count_kernel,
)

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# up to this many pairs the align runs one program per expert (moe_align_expert_kernel).
# H200, E=64 (benchmarks/results/2026-12-01-h200-s6.md): 448 pairs 9 us per layer (the one
# segmented program: 35 us); 1792 pairs 30 us, where 256-pair segments took 27 us
PER_EXPERT_ALIGN_MAX_PAIRS = 1024


@dataclass(frozen=True)
class Tiling:
    """Launch shapes of the four kernels (powers of two; see ``default_tiling``)."""

    block_m: int  # rows per block (>= 16: tl.dot's minimum); every expert run pads to it
    gate_up_block_n: int  # I columns per gate_up program (it computes gate and up: 2x)
    gate_up_block_k: int
    gate_up_warps: int
    gate_up_stages: int
    down_block_n: int  # D columns per down program
    down_block_k: int
    down_warps: int
    down_stages: int
    align_segment: int  # pairs per align program above PER_EXPERT_ALIGN_MAX_PAIRS pairs
    sum_block_d: int
    # the down kernel's grid as (n-tiles, blocks) (``fused_moe_kernels.program_block``): a
    # block's programs run together and read its h rows from L2 while they are hot
    down_tile_fastest: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "gate_up_block_n", "gate_up_block_k", "down_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiling(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    inter: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> Tiling:
    """Launch shapes from T, k, E, I and the device (host ints only: graph-safe).

    Decode (few tokens per expert) streams weights: BM=16, narrow n-tiles so the hit
    experts' tiles make at least ~3 programs per SM, 4 stages of loads in flight. Prefill
    (T >= 1024, many tokens per expert) is compute-bound: 64-row blocks, wider tiles.
    On CPU (the interpreter) wide tiles keep the number of interpreted programs small.
    """
    if device.type != "cuda":
        return Tiling(16, 64, 64, 4, 1, 64, 64, 4, 1, 4096, 256, down_tile_fastest=True)
    pairs = num_tokens * top_k
    if pairs >= 16 * num_experts * 4:  # >= 64 rows per expert on average: prefill-like
        return Tiling(64, 64, 64, 8, 3, 128, 64, 8, 3, 2048, 1024)
    block_m = 16 if pairs <= 16 * num_experts else 32
    hit_experts = min(num_experts, pairs)
    narrow = hit_experts * triton.cdiv(inter, 64) < 3 * _num_sms(device)
    block_k = 64 if dtype == torch.float32 else 128  # 3 stages of fp32 tiles fill the SMEM
    # moe_tiling_sweep.py, H200, the down kernel alone: 16-bit h (rounded once) in 128 x 128
    # tiles, 3 stages, against h kept at fp32 precision as stacked bf16 hi / lo rows in
    # 128 x 64 (2026-12-04-h200-s24.md): 343.9 -> 296.1 us at T = 256, 279.8 -> 261.5 at
    # T = 64, 32.0 -> 30.5 at T = 1; fp32 h split in registers was slower still (446.9 us at
    # T = 256, 2026-12-03-h200-s17.md). Gate-up at T = 1: 3 stages, 69.3 -> 61.8 us
    # (session 16).
    sixteen_bit = dtype != torch.float32
    return Tiling(
        block_m=block_m,
        gate_up_block_n=32 if narrow else 64,
        gate_up_block_k=block_k,
        gate_up_warps=4,
        gate_up_stages=3 if narrow else 4,
        down_block_n=128,
        down_block_k=128 if sixteen_bit else 64,  # fp32 h: 64 (3 stages fill the SMEM)
        down_warps=4,
        down_stages=3 if sixteen_bit or not (narrow and block_m == 16) else 4,
        # a block's programs over all n-tiles together, its h rows re-read from L2: ncu at
        # 256 tokens read 1.37 GB of DRAM for 1.09 GB of weights in block order; the down
        # kernel alone 347.6 -> 324.9 us at T = 256, 263.3 -> 259.3 at T = 64 (H200,
        # moe_tiling_sweep.py, 2026-12-04-h200-s19.md)
        down_tile_fastest=True,
        # past PER_EXPERT_ALIGN_MAX_PAIRS: 64-pair segments counted in parallel (H200, 256
        # tokens, 1,792 pairs: 11.4 us, against 24.4 with 256-pair segments and 28.5 with a
        # program per expert; latency_kernels.py)
        align_segment=64,
        sum_block_d=1024,
    )


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN / garbage)."""
    return torch.empty(shape, dtype=dtype, device=device)


def num_blocks_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks the padded expert runs can use: sum_e cdiv(count_e, BM) is at most
    (number of hit experts) + P // BM, and never more than cdiv(P + E*(BM-1), BM)."""
    worst = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    return min(worst, min(num_experts, num_pairs) + num_pairs // block_m)


def scan_shape(num_pairs: int, num_experts: int, segment: int) -> tuple[int, int, int, int]:
    """(BLOCK_E, CHUNK, pairs a segment, segments) of the align kernels' scans over P
    pairs: [CHUNK, BLOCK_E] one-hot tiles, segments of whole chunks, none longer than the
    pairs there are (a decode step's few pairs are one chunk)."""
    block_e = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, min(128, 8192 // block_e))
    segment = max(chunk, triton.cdiv(min(segment, num_pairs), chunk) * chunk)
    return block_e, chunk, segment, max(1, triton.cdiv(num_pairs, segment))


def count_pairs(
    ids: torch.Tensor, num_experts: int, block_e: int, chunk: int, segment: int, num_segments: int
) -> torch.Tensor:
    """ids [P] -> [S, BLOCK_E] int32: the pairs of each segment per expert."""
    counts = _empty((num_segments, block_e), torch.int32, ids.device)
    moe_count_kernel[(num_segments,)](
        ids, counts, ids.numel(), num_experts, segment, BLOCK_E=block_e, CHUNK=chunk,
        **pdl(ids.device),
    )  # fmt: skip
    return counts


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    segment: int = 2048,
    per_expert: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert into blocks of ``block_m`` rows.

    topk_ids: [T, k] int (contiguous). Returns sorted_ids [B * BM] int32 (the pair index
    t*k + j at each row of each expert's run, P on the padding rows that fill a run to a
    multiple of BM; rows past the used blocks are not written) and block_expert [B] int32
    (the expert of each block; E for a block past the used ones). Pairs whose id is
    outside [0, E) are left out. Stable: one expert's pairs keep their order.
    ``per_expert``: one program per expert (None: when P <= PER_EXPERT_ALIGN_MAX_PAIRS),
    else segments of ``segment`` pairs.
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    num_blocks = num_blocks_bound(num_pairs, num_experts, block_m)
    sorted_ids = _empty((num_blocks * block_m,), torch.int32, device)
    block_expert = _empty((num_blocks,), torch.int32, device)
    block_e, chunk, segment, num_segments = scan_shape(num_pairs, num_experts, segment)
    ids = topk_ids.view(-1)
    if per_expert is None:
        per_expert = num_pairs <= PER_EXPERT_ALIGN_MAX_PAIRS
    if per_expert:
        moe_align_expert_kernel[(num_experts + 1,)](
            ids, sorted_ids, block_expert, num_pairs, num_experts, num_blocks,
            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, BLOCK_B=128,
            num_warps=8 if block_e >= 128 else 4, **pdl(ids.device),
        )  # fmt: skip
        return sorted_ids, block_expert
    counts = sorted_ids  # unread when one program counts
    if num_segments > 1:
        counts = count_pairs(ids, num_experts, block_e, chunk, segment, num_segments)
    moe_align_kernel[(num_segments,)](
        ids,
        counts,
        sorted_ids,
        block_expert,
        num_pairs,
        num_experts,
        segment,
        num_segments,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=chunk,
        BLOCK_B=max(16, min(128, 8192 // block_e)),
        COUNT_HERE=num_segments == 1,
        num_warps=8 if block_e >= 128 else 4,
        **pdl(ids.device),
    )
    return sorted_ids, block_expert


def _check(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    if x.dim() != 2 or x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"x must be [T, D] in {_ACTIVATION_DTYPES}, got {x.dtype} {x.shape}")
    t, d = x.shape
    id_dtypes = (torch.int32, torch.int64)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype not in id_dtypes:
        raise ValueError(
            f"topk_ids must be [{t}, k] int32/int64, got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights must be {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}"
        )
    if w13.dim() != 3 or w13.shape[2] != d or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, {d}], got {tuple(w13.shape)}")
    e, two_i, _ = w13.shape
    if tuple(w2.shape) != (e, d, two_i // 2):
        raise ValueError(f"w2 must be [{e}, {d}, {two_i // 2}], got {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 / w2 dtype ({w13.dtype} / {w2.dtype}) must be x's ({x.dtype})")
    for name, t_ in (
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
        ("w13", w13),
        ("w2", w2),
    ):
        if t_.device != x.device:
            raise ValueError(f"{name} is on {t_.device}, x on {x.device}")


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    *,
    tiling: Tiling | None = None,
    defer_sum: bool = False,
) -> torch.Tensor | ExpertSlots:
    """Fused ``ops.reference.moe_experts``: 4 launches (5 for large batches).

    x: [T, D] (fp32/bf16/fp16); topk_ids: [T, k] int; topk_weights: [T, k]; w13: [E, 2I, D]
    (gate rows then up rows); w2: [E, D, I], both in x's dtype (any strides). Returns
    [T, D] in x's dtype. A slot whose id is outside [0, E) contributes nothing (the
    reference rejects it). ``defer_sum``: one launch fewer, the slots returned unsummed
    (``ExpertSlots``) when T and k are not 0.
    """
    _check(x, topk_ids, topk_weights, w13, w2)
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    out = _empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    tiling = tiling or default_tiling(num_tokens, top_k, num_experts, inter, x.device, x.dtype)
    topk_ids = topk_ids.contiguous()
    sorted_ids, block_expert = moe_align(
        topk_ids, num_experts, tiling.block_m, tiling.align_segment
    )
    slots = run_experts(
        x, topk_ids, topk_weights, sorted_ids, block_expert, w13, w2, limit, tiling,
        None if defer_sum else out,
    )  # fmt: skip
    return out if slots is None else slots


def run_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    tiling: Tiling,
    out: torch.Tensor | None,
    *,
    slots: torch.Tensor | None = None,
    aligned: int | None = None,
) -> ExpertSlots | None:
    """The 3 launches after the align (gate-up, down, slot sum) into ``out`` [T, D]:
    arguments as ``moe_experts``, with the align's ``sorted_ids`` / ``block_expert``.
    ``out`` None: 2 launches, and the slots returned unsummed (their consumer sums them).
    ``slots``: the [T * k, D] fp32 rows to write (None: new ones); ``aligned``: the align
    laid out the pairs of experts [0, aligned) only (None: all of w13's), and another
    launch writes the others' rows (``shared_down``) before ``out`` is summed."""
    num_experts = w13.shape[0]
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    num_pairs = topk_ids.numel()
    if slots is None:
        slots = _empty((num_pairs, x.shape[1]), torch.float32, x.device)
    weights = topk_weights.to(torch.float32).contiguous().view(-1)
    _gate_up_down(
        x, w13, w2, weights, slots, sorted_ids, block_expert, topk_ids.shape[1],
        num_experts if aligned is None else aligned, limit, tiling,
    )  # fmt: skip
    result = ExpertSlots(slots, topk_ids, num_experts, x.dtype)
    if out is None:
        return result
    sum_slots(result, out, tiling)
    return None


# (T, top_k, BM, shared expert, device) -> the shared expert's layout (``_shared_layout``)
_SHARED_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _shared_layout(
    num_tokens: int, top_k: int, block_m: int, shared: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, weights) of the shared expert's layout: pair
    t * top_k + top_k - 1 at row t, one block per BM tokens, weight 1. Constants of the
    shapes, made once per shape outside a graph capture (a captured step's warm-up run
    makes them first), so the side stream's chain is its two GEMM launches only."""
    key = (num_tokens, top_k, block_m, shared, device)
    layout = _SHARED_LAYOUTS.get(key)
    if layout is not None:
        return layout
    num_blocks = triton.cdiv(num_tokens, block_m)
    rows = num_blocks * block_m
    # rows past T hold pairs >= num_pairs: padding, which the kernels mask
    sorted_ids = torch.arange(top_k - 1, rows * top_k, top_k, dtype=torch.int32, device=device)
    block_expert = torch.full((num_blocks,), shared, dtype=torch.int32, device=device)
    weights = torch.ones(num_tokens * top_k, dtype=torch.float32, device=device)
    layout = sorted_ids, block_expert, weights
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _SHARED_LAYOUTS[key] = layout  # (made in a capture, they would be the graph's)
    return layout


def shared_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    tiling: Tiling,
    shared: int,
    top_k: int,
) -> torch.Tensor:
    """The shared expert's gate-up launch (the first half of its slot, ``shared_down``
    the second): h [rows, I]. Split so that a caller running it on a side stream can issue
    its own kernels between the two (``moe_routed``: the router's, beside it)."""
    sorted_ids, block_expert, _ = _shared_layout(
        x.shape[0], top_k, tiling.block_m, shared, x.device
    )
    return _gate_up(x.contiguous(), w13, w2.dtype, sorted_ids, block_expert, top_k,
                    x.shape[0] * top_k, w13.shape[0], limit, tiling)  # fmt: skip


def shared_down(
    x: torch.Tensor,
    h: torch.Tensor,
    w2: torch.Tensor,
    tiling: Tiling,
    shared: int,
    top_k: int,
    slots: torch.Tensor,
) -> None:
    """The shared expert's slot (the last of each token's ``top_k``, weight 1) into
    ``slots`` [T * top_k, D] from ``shared_gate_up``'s h (x: its input), over a layout that
    needs no align. With the routed experts aligned apart (``run_experts(aligned=shared)``)
    the two run on a side stream beside the router and align: nothing they read is written
    there."""
    num_tokens = slots.shape[0] // top_k
    sorted_ids, block_expert, weights = _shared_layout(
        num_tokens, top_k, tiling.block_m, shared, h.device
    )
    _down(h, w2, weights, slots, sorted_ids, block_expert, w2.shape[0], tiling, _fp32_dot(x))


def _gate_up_down(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    num_experts: int,
    limit: float,
    tiling: Tiling,
) -> None:
    """The gate-up and down launches over an aligned layout: each pair's weighted expert
    output into its row of ``slots``; blocks of experts >= ``num_experts`` are skipped."""
    h = _gate_up(x, w13, w2.dtype, sorted_ids, block_expert, top_k, slots.shape[0],
                 num_experts, limit, tiling)  # fmt: skip
    _down(h, w2, weights, slots, sorted_ids, block_expert, num_experts, tiling, _fp32_dot(x))


def _fp32_dot(x: torch.Tensor) -> bool:
    """The expert kernels' dots in fp32 (fp32 activations, or the CPU's interpreter)."""
    return x.dtype == torch.float32 or x.device.type == "cpu"


def _gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    h_dtype: torch.dtype,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    num_pairs: int,
    num_experts: int,
    limit: float,
    tiling: Tiling,
) -> torch.Tensor:
    """SwiGLU(x @ w13[e]^T) of each aligned row: h [blocks * BM, I] in ``h_dtype`` (w2's;
    16-bit: rounded by the store)."""
    hidden, inter = x.shape[1], w13.shape[1] // 2
    bm = tiling.block_m
    num_blocks = block_expert.shape[0]
    h = _empty((num_blocks * bm, inter), h_dtype, x.device)
    grid = (num_blocks, triton.cdiv(inter, tiling.gate_up_block_n))
    moe_gate_up_kernel[grid](
        x, w13, h, sorted_ids, block_expert,
        num_pairs, top_k, hidden, inter, num_experts, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        BLOCK_M=bm,
        BLOCK_N=tiling.gate_up_block_n,
        BLOCK_K=tiling.gate_up_block_k,
        FP32_DOT=_fp32_dot(x),
        num_warps=tiling.gate_up_warps,
        num_stages=tiling.gate_up_stages, **pdl(x.device),
    )  # fmt: skip
    return h


def _down(
    h: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_experts: int,
    tiling: Tiling,
    fp32_dot: bool,
) -> None:
    """Each aligned row's weighted h @ w2[e]^T into its pair's row of ``slots``."""
    hidden, inter = slots.shape[1], h.shape[1]
    num_pairs = slots.shape[0]
    bm = tiling.block_m
    grid = (block_expert.shape[0], triton.cdiv(hidden, tiling.down_block_n))
    moe_down_kernel[grid[::-1] if tiling.down_tile_fastest else grid](
        h, w2, weights, slots, sorted_ids, block_expert,
        num_pairs, hidden, inter, num_experts,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), slots.stride(0),
        BLOCK_M=bm,
        BLOCK_N=tiling.down_block_n,
        BLOCK_K=tiling.down_block_k,
        FP32_DOT=fp32_dot,
        SKIP_PAD_ROWS=bm == 16,
        TILE_FASTEST=tiling.down_tile_fastest,
        num_warps=tiling.down_warps,
        num_stages=tiling.down_stages, **pdl(h.device),
    )  # fmt: skip


def sum_slots(slots: ExpertSlots, out: torch.Tensor, tiling: Tiling) -> None:
    """Each token's routed slots summed in slot order into ``out`` [T, D] (one launch)."""
    num_tokens, top_k = slots.ids.shape
    hidden = out.shape[1]
    block_d = min(tiling.sum_block_d, triton.next_power_of_2(hidden))
    moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        slots.slots, slots.ids.view(-1), out, top_k, hidden, slots.num_experts,
        slots.slots.stride(0), out.stride(0),
        BLOCK_D=block_d,
        num_warps=4, **pdl(out.device),
    )  # fmt: skip
