"""Triton kernels that sort a MoE step's (token, slot) pairs by expert into blocks of BM rows
(``fused_moe.moe_align`` validates, sizes and launches them).

Shape legend: P (token, slot) pairs (pair p is token p // k, slot p % k), E experts, BM rows
per block, R the padded row capacity (a multiple of BM), B = R / BM blocks, S segments.

No host sync, no atomics; stable: pairs of one expert keep their order.
    ``moe_count_kernel``, grid (S,): segment s of the pairs -> counts[s, e] (only when S > 1).
    ``moe_align_kernel``, grid (S,): the expert runs, each padded to a multiple of BM:

        rows:  | e0: pairs, pad | e1 (no pairs: empty) | e2: pairs, pad | ... | unused
        block: |  0  |  1  |                          |  2  |  3  |     ...  | E, E, E

    sorted_ids[r] = the pair at padded row r, or P on a padding row; block_expert[b] = the
    expert of block b, or E for a block past the used ones (its programs exit at once).
    Segment s scatters its own pairs after the pairs of earlier segments; segment 0 also
    writes the padding rows and block_expert. With S == 1 one program counts too.
    ``moe_align_expert_kernel``, grid (E + 1,): the same layout, one program per expert
    (every program counts all P pairs, then scatters its own expert's run; program E marks
    the blocks past the used ones). For decode-sized P: the one-program align is a chain of
    [CHUNK, E] scans that took 35 us per layer at 64 tokens on the H200.
    ``align_one_token``: the same layout for one token's pairs (a decode step of one
    request), a block per pair, without the scans (``moe_routed``'s one-program path).
    ``moe_sort_kernel``, grid (S,): the unpadded layout of the grouped GEMMs (BM = 1): the
    token of each sorted row, the sorted row of each pair and each expert's end row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl_wait

_SEGMENT_ROWS = tl.constexpr(16)  # segments of counts _counts_before reads a load


@triton.jit
def _chunk_ids(ids_ptr, first, off, num_pairs, pairs_per_segment, CHUNK: tl.constexpr):
    """The chunk at ``off`` of the segment starting at pair ``first``: (pair [CHUNK], in
    the segment and the pairs, its expert id or -1)."""
    local = off + tl.arange(0, CHUNK)
    pair = first + local
    ok = (pair < num_pairs) & (local < pairs_per_segment)
    return pair, ok, tl.load(ids_ptr + pair, mask=ok, other=-1)


@triton.jit
def _segment_counts(
    ids_ptr,
    seg,
    num_pairs,
    num_experts,
    pairs_per_segment,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """counts [BLOCK_E] int32 of the pairs of segment seg with expert e (ids outside
    [0, E) are counted nowhere)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    first = seg * pairs_per_segment
    for off in range(0, pairs_per_segment, CHUNK):
        _, _, ids = _chunk_ids(ids_ptr, first, off, num_pairs, pairs_per_segment, CHUNK)
        hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)
        counts += tl.sum(hit.to(tl.int32), axis=0)
    return counts


@triton.jit
def _counts_before(counts_ptr, seg, num_segments, BLOCK_E: tl.constexpr):
    """(all pairs per expert, pairs per expert in segments before seg) [BLOCK_E] int32 from
    moe_count_kernel's [S, BLOCK_E] counts, read _SEGMENT_ROWS segments a load (one row a
    load was a chain of S dependent-latency loads: 196 at 8192 tokens, k = 6)."""
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)
    for s0 in range(0, num_segments, _SEGMENT_ROWS):
        s = s0 + tl.arange(0, _SEGMENT_ROWS)
        c = tl.load(counts_ptr + s[:, None] * BLOCK_E + experts[None, :],
                    mask=(s < num_segments)[:, None], other=0)  # fmt: skip
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((s < seg)[:, None], c, 0), axis=0)
    return total, before


@triton.jit
def _chunk_rows(ids, running, num_experts, BLOCK_E: tl.constexpr):
    """Rows of a chunk's pairs (ids [CHUNK]) given each expert's next row (running
    [BLOCK_E]), in order: (row [CHUNK], routed [CHUNK] (id in [0, E)), running after the
    chunk)."""
    experts = tl.arange(0, BLOCK_E)
    hit = ((ids[:, None] == experts[None, :]) & (experts < num_experts)[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1  # earlier same-expert pairs
    row = tl.sum(running[None, :] * hit, axis=1) + rank
    return row, tl.sum(hit, axis=1) > 0, running + tl.sum(hit, axis=0)


@triton.jit
def moe_count_kernel(
    ids_ptr,  # [P] int32/int64 expert ids, flattened topk_ids
    counts_ptr,  # [S, BLOCK_E] int32 out
    num_pairs,
    num_experts,
    pairs_per_segment,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    seg = tl.program_id(0)
    counts = _segment_counts(
        ids_ptr, seg, num_pairs, num_experts, pairs_per_segment, BLOCK_E, CHUNK
    )
    tl.store(counts_ptr + seg * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def align_pairs(
    seg,  # the segment of pairs
    ids_ptr,  # [P] expert ids
    counts_ptr,  # [S, BLOCK_E] int32 from moe_count_kernel (unused when COUNT_HERE)
    sorted_ptr,  # [R] int32 out: pair index per padded row, P on padding rows
    block_expert_ptr,  # [B] int32 out: expert per block, E past the used blocks
    num_pairs,
    num_experts,
    pairs_per_segment,
    num_segments,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    COUNT_HERE: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    expert_ok = experts < num_experts
    if COUNT_HERE:  # one segment: count in this program, nothing before it
        total = _segment_counts(
            ids_ptr, seg, num_pairs, num_experts, pairs_per_segment, BLOCK_E, CHUNK
        )
        before = tl.zeros((BLOCK_E,), tl.int32)
    else:
        total, before = _counts_before(counts_ptr, seg, num_segments, BLOCK_E)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [BLOCK_E] end row of each expert's run
    starts = ends - padded

    # This segment's pairs, in order: row = start[e] + pairs of e before this one.
    running = starts + before
    first = seg * pairs_per_segment
    for off in range(0, pairs_per_segment, CHUNK):
        pair, _, ids = _chunk_ids(ids_ptr, first, off, num_pairs, pairs_per_segment, CHUNK)
        row, routed, running = _chunk_rows(ids, running, num_experts, BLOCK_E)
        # ids outside [0, E) go nowhere
        tl.store(sorted_ptr + row, pair.to(tl.int32), mask=routed)

    if seg == 0:
        # Padding rows of each run: rows start + total .. end - 1 (fewer than BLOCK_M).
        pad_start = starts + total
        for j in range(BLOCK_M):
            row = pad_start + j
            tl.store(sorted_ptr + row, num_pairs, mask=expert_ok & (row < ends))
        # Block b belongs to the first expert whose run ends after row b * BLOCK_M: the
        # number of runs that end at or before it (empty runs included). Past the last
        # run that number is E, the "no expert" value.
        for b0 in range(0, num_blocks, BLOCK_B):
            blocks = b0 + tl.arange(0, BLOCK_B)
            done = (ends[None, :] <= blocks[:, None] * BLOCK_M) & expert_ok[None, :]
            expert = tl.sum(done.to(tl.int32), axis=1)
            tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


@triton.jit
def _no_expert_past(block_expert_ptr, used, num_blocks, num_experts, BLOCK_B: tl.constexpr):
    """Blocks [used, num_blocks): no expert (E; their programs exit at once)."""
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        mask = (blocks >= used) & (blocks < num_blocks)
        tl.store(block_expert_ptr + blocks, num_experts, mask=mask)


@triton.jit
def align_one_token(
    ids_ptr,  # [P] expert ids: one token's picks
    sorted_ptr,  # [R] int32 out: pair index per padded row, P on padding rows
    block_expert_ptr,  # [B] int32 out: expert per block, E past the used blocks
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """``align_pairs``' layout for one token's pairs, without its scans: each routed pair
    (expert in [0, E)) is a run of one block, at its rank in (expert, pair) order; the
    same layout as ``align_pairs`` when the experts are distinct (top-k picks, a hash
    table's row), and a valid one (a block per pair) when a table repeats one."""
    pair = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    routed = (ids >= 0) & (ids < num_experts)
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (
        pair[None, :] < pair[:, None]))  # fmt: skip
    rank = tl.sum((before & routed[None, :]).to(tl.int32), axis=1)  # [BLOCK_P]
    tl.store(block_expert_ptr + rank, ids.to(tl.int32), mask=routed)
    j = tl.arange(0, BLOCK_M)
    rows = rank[:, None] * BLOCK_M + j[None, :]  # the pair's block: it, then padding
    values = tl.where(j[None, :] == 0, pair[:, None], num_pairs)
    tl.store(sorted_ptr + rows, values.to(tl.int32), mask=routed[:, None])
    used = tl.sum(routed.to(tl.int32), axis=0)
    _no_expert_past(block_expert_ptr, used, num_blocks, num_experts, BLOCK_B)


@triton.jit
def moe_align_kernel(
    ids_ptr,  # [P] expert ids
    counts_ptr,  # [S, BLOCK_E] int32 from moe_count_kernel (unused when COUNT_HERE)
    sorted_ptr,  # [R] int32 out: pair index per padded row, P on padding rows
    block_expert_ptr,  # [B] int32 out: expert per block, E past the used blocks
    num_pairs,
    num_experts,
    pairs_per_segment,
    num_segments,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    COUNT_HERE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    align_pairs(
        tl.program_id(0),
        ids_ptr,
        counts_ptr,
        sorted_ptr,
        block_expert_ptr,
        num_pairs,
        num_experts,
        pairs_per_segment,
        num_segments,
        num_blocks,
        BLOCK_M,
        BLOCK_E,
        CHUNK,
        BLOCK_B,
        COUNT_HERE,
    )


@triton.jit
def moe_align_expert_kernel(
    ids_ptr,  # [P] expert ids
    sorted_ptr,  # [R] int32 out: pair index per padded row, P on padding rows
    block_expert_ptr,  # [B] int32 out: expert per block, E past the used blocks
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    pdl_wait(PDL)
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total = _segment_counts(ids_ptr, 0, num_pairs, num_experts, num_pairs, BLOCK_E, CHUNK)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if e == num_experts:  # the blocks past every run belong to no expert
        used = tl.sum(padded, axis=0) // BLOCK_M
        _no_expert_past(block_expert_ptr, used, num_blocks, num_experts, BLOCK_B)
        return
    # expert e's run: rows start .. end - 1, its count pairs first, then padding
    mine = experts == e
    end = tl.sum(tl.where(mine, tl.cumsum(padded, axis=0), 0), axis=0)
    count = tl.sum(tl.where(mine, total, 0), axis=0)
    start = end - tl.sum(tl.where(mine, padded, 0), axis=0)
    row = start
    for off in range(0, num_pairs, CHUNK):
        pair = off + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        hit = (ids == e).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1  # earlier pairs of e in this chunk
        tl.store(sorted_ptr + row + rank, pair.to(tl.int32), mask=hit > 0)
        row += tl.sum(hit, axis=0)
    pad = start + count + tl.arange(0, BLOCK_M)  # fewer than BLOCK_M padding rows
    tl.store(sorted_ptr + pad, num_pairs, mask=pad < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        tl.store(block_expert_ptr + blocks, e, mask=blocks < end // BLOCK_M)


@triton.jit
def moe_sort_kernel(
    ids_ptr,  # [P] expert ids in [0, E)
    counts_ptr,  # [S, BLOCK_E] int32 from moe_count_kernel
    token_ptr,  # [P] int32 out: the token of each sorted row
    inverse_ptr,  # [P] int32 out: the sorted row of each pair
    ends_ptr,  # [E] int32 out: the end row of each expert's run
    num_pairs,
    num_experts,
    top_k,
    pairs_per_segment,
    num_segments,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    seg = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total, before = _counts_before(counts_ptr, seg, num_segments, BLOCK_E)
    ends = tl.cumsum(total, axis=0)
    if seg == 0:
        tl.store(ends_ptr + experts, ends, mask=experts < num_experts)
    running = ends - total + before  # the next row of each expert for this segment
    first = seg * pairs_per_segment
    for off in range(0, pairs_per_segment, CHUNK):
        pair, ok, ids = _chunk_ids(ids_ptr, first, off, num_pairs, pairs_per_segment, CHUNK)
        row, _, running = _chunk_rows(ids, running, num_experts, BLOCK_E)
        tl.store(token_ptr + row, (pair // top_k).to(tl.int32), mask=ok)
        tl.store(inverse_ptr + pair, row.to(tl.int32), mask=ok)
