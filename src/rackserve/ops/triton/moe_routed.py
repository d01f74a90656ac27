"""The whole MoE of a decode step after the router's logits GEMM in 4 launches (equals
``reference.moe_routed``): one program routes every token (``route_tokens``: scores, top-k
or hash table, weights, the shared expert's pick, the expert counts) and, after a barrier,
sorts the pairs by expert (``align_pairs``); then the fused MoE's gate-up, down and slot
sum (``fused_moe.run_experts``).

Routing and align share one program, so it serves batches whose pairs fit one align
segment (T * (k + 1) <= 2048: every decode graph up to 256 tokens); larger ones route and
align in two launches. Grids depend on the shapes only: CUDA-graph safe.

The router's logits stay a launch of their own (the op table's ``linear``: the split-K GEMV
below 16 tokens). Computing them in the route + align launch (its K-slices one a program,
the last to arrive routing and aligning) lost on the H100 twice: decode:1@4096 1.497 / 1.495
ms against 1.480 / 1.479 (results/2026-12-07-s36.md: the one launch took 10.5 us a layer
where the GEMV and the route + align take 4.6 + 3.4), then 1.461 / 1.464 against 1.463 /
1.445 and 1.432 / 1.433 against 1.418 / 1.414 back to back in 8 slices, 1.479 / 1.479 in 32
(results/2026-12-07-s37.md); removed after the second.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.ops.reference import ExpertSlots
from rackserve.ops.side_stream import SideStream
from rackserve.ops.triton import fused_moe
from rackserve.ops.triton.common import (
    pdl,
    pdl_wait,
)
from rackserve.ops.triton.moe_align_kernels import align_one_token, align_pairs
from rackserve.ops.triton.route import _SCORING, route_fused, route_tokens

# the most (token, expert) pairs routed and aligned by one program (see moe_routed)
ONE_PROGRAM_MAX_PAIRS = 64
# One token's pairs laid out by ``align_one_token`` (a block per pair, no scans) instead of
# ``align_pairs``' chain of [CHUNK, E] scans; False: the scans (the A/B's other side)
ALIGN_ONE_TOKEN = True
# With ``shared_beside``, the order the side stream's two launches are issued in (the graph's
# dependencies are the same): True, the shared gate-up after the router's and the align's
# launches and its down after the routed experts'; False, both right after the fork, before
# the router's. If a graph's launches go out in issue order and one whose predecessor has not
# finished holds back those issued after it (results/2026-12-06-s32.md, section 3; the probe
# is benchmarks/graph_branch_probe.py), the second order starts the router only once the
# side stream's earlier work (a block's mHC comb) and the shared gate-up have run.
SHARED_ISSUED_LATE = True


@triton.jit
def _route_align_kernel(
    logits_ptr, bias_ptr, table_ptr, input_ids_ptr,
    ids_ptr,  # [T, K + SHARED] int64 out
    w_ptr,  # [T, K + SHARED] fp32 out
    counts_ptr, mask_ptr, sorted_ptr, block_expert_ptr, num_tokens, scaling, shared_id,
    num_experts,  # E of the expert weights (routed + shared)
    num_pairs, num_blocks,
    E: tl.constexpr,  # routed experts (router columns)
    K: tl.constexpr, SCORING: tl.constexpr, HASHED: tl.constexpr, SHARED: tl.constexpr,
    COUNT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    ALIGN_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
    ONE_TOKEN: tl.constexpr,  # one token's pairs: align_one_token (no scans)
    BLOCK_P: tl.constexpr,  # ONE_TOKEN: its pairs, padded
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):  # fmt: skip
    """One program: every token routed (``route_tokens``), then the pairs aligned."""
    pdl_wait(PDL)
    for block in range(0, tl.cdiv(num_tokens, BLOCK_T)):
        route_tokens(
            block, logits_ptr, bias_ptr, table_ptr, input_ids_ptr, ids_ptr, w_ptr, counts_ptr,
            mask_ptr, num_tokens, scaling, shared_id,
            E, K, SCORING, HASHED, SHARED, COUNT, BLOCK_T, BLOCK_E,
        )  # fmt: skip
    tl.debug_barrier()  # the ids this program's threads wrote, visible to all of them
    if ONE_TOKEN:
        align_one_token(
            ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
            BLOCK_M, BLOCK_P, BLOCK_B,
        )  # fmt: skip
    else:
        align_pairs(
            0, ids_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts,
            num_pairs, 1, num_blocks, BLOCK_M, ALIGN_E, CHUNK, BLOCK_B, True,
        )  # fmt: skip


def moe_routed(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    scoring_func: str,
    scaling: float,
    shared_expert: int | None,
    expert_counts: torch.Tensor | None,
    token_mask: torch.Tensor | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    defer_sum: bool = False,
    linear: Callable = F.linear,
    shared_beside: bool = False,
) -> torch.Tensor | ExpertSlots:
    """See ``reference.moe_routed``; ``defer_sum``: the unsummed :class:`ExpertSlots`
    (``hc_post`` / ``hc_post_pre`` sum them), one launch fewer, when T > 0; ``linear``: the
    router's logits projection (the op table's: the GEMV for a few tokens).
    ``shared_beside``: the shared expert (when given) runs on the side stream from the
    start, beside the router, the align and the routed experts, which are aligned without
    it (``fused_moe.shared_gate_up`` / ``shared_down``); the same values, bit for bit."""
    num_tokens = x.shape[0]
    cols = top_k + int(shared_expert is not None)
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    tiling = fused_moe.default_tiling(num_tokens, cols, num_experts, inter, x.device, x.dtype)
    num_pairs = num_tokens * cols
    routing = (x, gate_weight, bias, table, input_ids, top_k, scoring_func, scaling, shared_expert)
    if num_tokens == 0:
        ids, weights = route_fused(*routing, expert_counts, token_mask, linear)
        return fused_moe.moe_experts(x, ids, weights, w13, w2, limit, defer_sum=defer_sum)
    # One program routes and aligns only for a few tokens: its serial align is cheap there
    # (H200, decode:1: 9 us per layer for both) but at 64 tokens (448 pairs) it took 45 us
    # per layer against ~18 for the router kernel + the align kernel
    # (benchmarks/results/2026-12-01-h200-s3-final-profile.json): more go the separate way.
    one_program = num_pairs <= min(tiling.align_segment, ONE_PROGRAM_MAX_PAIRS)
    if one_program:
        _check_routing(x, gate_weight, bias, table, expert_counts, token_mask, cols, w13, w2)
    # the experts the align lays out: all, or the routed ones when the shared expert (the
    # last, E) runs apart, on the side stream from here
    apart = shared_beside and shared_expert is not None
    aligned = shared_expert if apart else num_experts
    slots = None
    if apart:
        if shared_expert != num_experts - 1:
            raise ValueError("moe_routed: shared_beside needs the shared expert stacked last")
        slots = fused_moe._empty((num_pairs, x.shape[1]), torch.float32, x.device)
        side = SideStream.of(x.device)
        side.fork()  # the shared expert may start from here, whenever its launches are issued
        if not SHARED_ISSUED_LATE:
            with side.active():
                h = fused_moe.shared_gate_up(x, w13, w2, limit, tiling, shared_expert, cols)
                fused_moe.shared_down(x, h, w2, tiling, shared_expert, cols, slots)
    if one_program:
        ids, weights, sorted_ids, block_expert = _route_align(
            routing, expert_counts, token_mask, aligned, tiling, linear
        )
    else:
        ids, weights = route_fused(*routing, expert_counts, token_mask, linear)
        fused_moe._check(x, ids, weights, w13, w2)
        ids = ids.contiguous()
        sorted_ids, block_expert = fused_moe.moe_align(
            ids, aligned, tiling.block_m, tiling.align_segment
        )
    late = apart and SHARED_ISSUED_LATE
    if late:
        with side.active():
            h = fused_moe.shared_gate_up(x, w13, w2, limit, tiling, shared_expert, cols)
    result = fused_moe.run_experts(
        x, ids, weights, sorted_ids, block_expert, w13, w2, limit, tiling, None,
        slots=slots, aligned=aligned,
    )  # fmt: skip
    if late:
        with side.active():
            fused_moe.shared_down(x, h, w2, tiling, shared_expert, cols, slots)
    if apart:
        side.join()
    if defer_sum:
        return result
    out = fused_moe._empty((num_tokens, x.shape[1]), x.dtype, x.device)
    fused_moe.sum_slots(result, out, tiling)
    return out


def _check_routing(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    table: torch.Tensor | None,
    expert_counts: torch.Tensor | None,
    token_mask: torch.Tensor | None,
    cols: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    """The one-program path's own checks (``route_fused`` makes them on the other)."""
    num_tokens, routed = x.shape[0], gate_weight.shape[0]
    if (table is None) == (bias is None):
        raise ValueError("moe_routed: give the bias (learned routing) or the table (hashed)")
    if expert_counts is not None and (
        expert_counts.dtype != torch.int64 or expert_counts.shape != (routed,)
    ):
        raise ValueError(f"moe_routed: expert_counts must be [{routed}] int64")
    if token_mask is not None and token_mask.shape != (num_tokens,):
        raise ValueError(f"moe_routed: token_mask must be [{num_tokens}]")
    fused_moe._check(x, torch.empty(num_tokens, cols, dtype=torch.int64, device=x.device),
                     torch.empty(num_tokens, cols, device=x.device), w13, w2)  # fmt: skip


def _route_align(
    routing: tuple,
    expert_counts: torch.Tensor | None,
    token_mask: torch.Tensor | None,
    aligned: int,
    tiling: fused_moe.Tiling,
    linear: Callable,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's logits, then one program routing every token and aligning the pairs of
    experts [0, aligned): (ids, weights [T, k (+ 1)], sorted_ids, block_expert).
    ``routing``: ``moe_routed``'s arguments from x to shared_expert."""
    x, gate_weight, bias, table, input_ids, top_k, scoring_func, scaling, shared_expert = routing
    num_tokens = x.shape[0]
    cols = top_k + int(shared_expert is not None)
    num_pairs = num_tokens * cols
    num_experts = aligned
    routed = gate_weight.shape[0]
    ids = torch.empty(num_tokens, cols, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, cols, dtype=torch.float32, device=x.device)
    num_blocks = fused_moe.num_blocks_bound(num_pairs, num_experts, tiling.block_m)
    sorted_ids = fused_moe._empty((num_blocks * tiling.block_m,), torch.int32, x.device)
    block_expert = fused_moe._empty((num_blocks,), torch.int32, x.device)
    count = 0 if expert_counts is None else (1 if token_mask is None else 2)
    align_e = max(16, triton.next_power_of_2(num_experts))
    # tiles no larger than the step's tokens and pairs: the program is a serial chain of
    # reductions over them (H200, T = 1: 8.3 -> 5.4 us, benchmarks/latency_kernels.py)
    chunk = max(16, min(128, 8192 // align_e, triton.next_power_of_2(num_pairs)))
    block_e = max(16, triton.next_power_of_2(routed))
    route_args = (
        bias if bias is not None else weights,
        table.contiguous() if table is not None else ids, input_ids.contiguous(),
        ids, weights,
        expert_counts if expert_counts is not None else ids,
        token_mask.contiguous() if token_mask is not None else ids,
        sorted_ids, block_expert,
        num_tokens, scaling, shared_expert if shared_expert is not None else 0,
        num_experts, num_pairs, num_blocks,
    )  # fmt: skip
    constexprs = dict(
        E=routed, K=top_k, SCORING=_SCORING[scoring_func], HASHED=table is not None,
        SHARED=int(shared_expert is not None), COUNT=count,
        BLOCK_T=min(16, triton.next_power_of_2(num_tokens)), BLOCK_E=block_e,
        BLOCK_M=tiling.block_m, ALIGN_E=align_e, CHUNK=chunk,
        BLOCK_B=max(16, min(128, 8192 // align_e)),
        ONE_TOKEN=num_tokens == 1 and ALIGN_ONE_TOKEN,
        BLOCK_P=max(16, triton.next_power_of_2(num_pairs)),
        num_warps=4 if num_pairs <= 16 or align_e < 128 else 8, **pdl(x.device),
    )  # fmt: skip
    logits = linear(x, gate_weight).contiguous()  # [T, E] in the activation dtype
    _route_align_kernel[(1,)](logits, *route_args, **constexprs)
    return ids, weights, sorted_ids, block_expert
