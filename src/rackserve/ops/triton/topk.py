"""Radix top-k of packed indexer rows, one program per query: ``radix_topk``.

Launched by ``select_topk.py``, where it and the bitonic kernel are chosen
(``IndexerTiling.select_algorithm``). Shape legend: S queries, E entries per query (the
row), K picks (k), W window.

The rows are the packed int64 keys of ``indexer._store_logits`` (``reference.topk_earliest``
packing): entry e's key, (order-preserving fp32 bits of its logit) << 32 | (2^31 - 1 - e),
sits at position e. The answer equals ``select_topk.select_topk_kernel``'s (the bitonic
``tl.topk`` of the row) and ``torch.topk`` of the keys: the k largest keys, best first, as
entry ids, or with SELECT the picks' slots and [window | picks] validity. A program::

    1. loads its row; hi = the keys' upper halves (int32, the logits' order)
    2. finds hi of the k-th largest key, t, a few bits a pass (RADIX_BITS): the bucket of
       entries that agree with t on the bits found so far, `need` of its `count` entries
       picks, every entry above it a pick. RADIX_BITS = 1 (the default): one count over the
       row, tl.sum(hi >= the bucket's upper half), halves the bucket. 4..8: tl.histogram
       of the bucket's next digit, its reverse cumsum, one sum for the k-th's digit and the
       counts. Passes stop once the bucket is all picks (need == count): the k-th key is
       then the bucket's least, and no further bit changes the picks
    3. one cumsum over the row of [above the bucket | in it] (two 16-bit counters in an
       int32) places each pick; the bucket's picks are its `need` earliest entries, which
       is the keys' tie rule because position e holds entry e (so this kernel takes rows as
       the logits kernels store them, never a chunk-wise level's candidates)
    4. scatters the k picks' keys to ``work`` ([S, >= K] int64: the ids output itself
       when that is int64), a barrier, loads them back and tl.sort's the k, descending

Roofline (H200, prefill S = 8192, E = 2048, k = 512): the keys are S * E * 8 B = 128 MiB,
28 us at 4.8 TB/s (the ids, 32 MiB, 7 us more). Neither kernel comes near it: both hold the
row in registers and are bound by instruction issue and by the MIO pipe (shuffles and
shared memory, a warp-instruction a cycle per SM, 2 cycles for 64-bit LDS/STS). Compiled
for sm_90 (``benchmarks/topk_ptxas.py``), per warp of an 8-warp program (8 keys a thread):

    bitonic tl.topk   4168 instructions: 45 int64 compare-exchange steps over 2048 keys,
                      2 x 9 over 1024 and 512; 800 SHFL + 364 LDS/STS, 46 barriers
    this kernel       448 fixed (load, the scan, the scatter, the stores) + 872 (tl.sort
                      of the 512 picks: 192 SHFL + LDS/STS) + 56 a counted bit (8 compares
                      + 8 adds, a butterfly, 7 SHFL + LDS/STS, 3 barriers) x 32 bits, or
                      ~18 for distinct logits (the early stop): 2.3 k to 3.2 k instructions,
                      ~300 to 480 SHFL + LDS/STS, 64 registers
    histogram digits  392 a 5-bit pass (78 a bit, 80 registers), 808 an 8-bit pass (101 a
                      bit, 105 registers): Triton's ballot histogram lowers to 50-100
                      instructions a key and pass, a counted bit to 7 (2, and the sum's)

Per row (x 8 warps): bitonic 33 k issues (8.3 k cycles on 4 schedulers) and 9.3 k MIO
operations, measured 1.22 ms = ~39 k cycles a row on an SM, i.e. stalled (MIO queue, the
barriers' latency), not issue-bound. Radix: 18-26 k issues (4.7-6.5 k cycles), 2.4-3.8 k
MIO, about twice the cross-warp barriers (each pass reduces across warps) but 64 registers
against 60 and 8 KB of shared memory against 16 KB, so as many programs an SM. Expected:
between 1.5x (both issue-bound) and ~8x (the bitonic's MIO stall gone, ~150 us) faster;
``benchmarks/indexer_bench.py --select-only`` measures it. After the search, tl.sort of the
picks is the largest part. Rows whose k-th key is -inf (fewer visible entries than k: the
first 2048 queries of an 8192-token prefill) tie at the threshold and take all 32 passes.

Registers (``default_warps``, 4 to 16 warps): 64 at E = 2048 (8 warps, 8 keys a thread, 4
programs an SM), 71 at 4096 (16 warps), 102 at 8192 (16 warps, 16 keys a thread; 32 warps
take 64 but were slower on the H200: 1,236 against 1,025 us at S = 8192). 16 keys a thread
at E = 2048: 107. Rows over ``RADIX_MAX_ENTRIES`` take the chunk-wise bitonic
levels of ``select_topk``; the histogram digits spill at E = 8192 (8 bits, 32 warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import pdl, pdl_wait
from rackserve.ops.triton.select import store_selection

RADIX_MAX_ENTRIES = 8192  # one program holds the row in registers (16 warps at 8192)
RADIX_BITS_CHOICES = (1, 4, 5, 6, 7, 8)  # 1: one count a bit; else a histogram a digit


def default_warps(num_entries: int) -> int:
    """Warps of a program for a row of ``num_entries``: 8 keys a thread, 4 to 16 warps. On the
    H200 (S = 8192, k = 512, 2026-12-04): E = 2048 at 8 warps 270 us (4: 299, 16: 407);
    E = 8192 at 16 warps (16 keys a thread) 1,025 us, at 32 warps 1,236 us."""
    return min(16, max(4, triton.next_power_of_2(num_entries) // 256))


@triton.jit
def _count_bit(hi, kth, need, count, k, shift: tl.constexpr):
    """One bit of the k-th's u by one count over the row: of hi >= the bucket's upper half
    (padding, INT32_MIN, never counts: the half's u is >= 1). Returns (kth, need, count)."""
    half = kth | (tl.full((), 1, tl.int32) << shift)
    at_least = tl.sum((hi >= (half ^ (-2147483647 - 1))).to(tl.int32))
    upper = at_least - (k - need)  # the upper half's entries (above the bucket: k - need)
    take = upper >= need  # the k-th lies in the upper half
    kth = tl.where(take, half, kth)
    count = tl.where(take, upper, count - upper)
    need = tl.where(take, need, need - upper)
    return kth, need, count


@triton.jit
def _count_digits(
    hi, real, kth, need, count, known: tl.constexpr, shift: tl.constexpr,
    RADIX_BITS: tl.constexpr, FIRST: tl.constexpr,
):  # fmt: skip
    """RADIX_BITS bits of the k-th's u by a histogram of the bucket's next digit. Returns
    (kth, need, count)."""
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    u = hi ^ (-2147483647 - 1)
    digit = (u >> shift) & (NUM_BINS - 1)
    bucket = real if FIRST else real & ((u >> known) == (kth >> known))
    hist = tl.histogram(digit, NUM_BINS, mask=bucket)
    at_least = tl.cumsum(hist, 0, reverse=True)  # bucket entries with digit >= bin
    # the k-th's digit d: at_least[d] >= need > at_least[d + 1]; the entries above d are
    # picks. d, hist[d] and the count above d in one sum (counts < 2^20)
    take = at_least >= need
    is_kth = take & (at_least - hist < need)
    bins = tl.arange(0, NUM_BINS).to(tl.int64)
    fields = tl.where(is_kth, (bins << 40) | (hist.to(tl.int64) << 20), 0)
    summary = tl.sum(fields | tl.where(take, 0, hist).to(tl.int64))
    kth = kth | ((summary >> 40).to(tl.int32) << shift)
    count = ((summary >> 20) & 0xFFFFF).to(tl.int32)
    need = need - (summary & 0xFFFFF).to(tl.int32)
    return kth, need, count


@triton.jit
def radix_topk_kernel(
    packed_ptr,  # [S, E] int64 keys, entry e's at position e
    out_ptr,  # [S, K] int64 entry ids, best first; SELECT: the picks' slots [S, K]
    work_ptr,  # [S, >= K] int64: the picks' keys, unordered (may be out_ptr)
    num_entries,
    k,
    stride_ps,
    stride_os,
    stride_ws,
    # SELECT: the picks as ``select_entries`` returns them
    slots_ptr,  # [S, E] int entry slots
    num_visible_ptr,  # [S] int
    window_ptr,  # [S, W] uint8 (bool) window mask
    valid_ptr,  # [S, W + K] uint8 (bool) out
    stride_ss,
    stride_window,
    W,
    BLOCK_N: tl.constexpr,  # next_pow2(E)
    BLOCK_K: tl.constexpr,  # next_pow2(k), >= 2
    RADIX_BITS: tl.constexpr,  # bits of hi resolved per pass
    SELECT: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl)
):
    """The k largest keys of query ``s``'s row (0 < k <= E): see the module docstring."""
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_N)
    real = e < num_entries
    lowest = -9223372036854775807 - 1  # padding: sorts after every real key, hi never counts
    keys = tl.load(packed_ptr + s * stride_ps + e, mask=real, other=lowest)
    hi = (keys >> 32).to(tl.int32)  # the logit's order (padding: INT32_MIN)
    NUM_PASSES: tl.constexpr = (32 + RADIX_BITS - 1) // RADIX_BITS
    # the bucket: the entries whose hi, as unsigned bits u = hi ^ INT32_MIN (which order
    # like hi), equals kth above bit `known`; it holds the k-th largest key. `need` of its
    # `count` entries are picks, and every entry above it.
    kth = tl.zeros((), tl.int32)
    low_mask = kth - 1  # nothing resolved: the bucket is the row
    need = k + kth
    count = num_entries + kth
    for p in tl.static_range(NUM_PASSES):
        # pass p resolves bits [shift, known) of the k-th's u (the last pass may overlap
        # the one before: those bits are equal over the bucket)
        known = 32 - p * RADIX_BITS
        shift = known - RADIX_BITS if known > RADIX_BITS else 0
        if need < count:  # else the whole bucket is picks: stop early
            if RADIX_BITS == 1:
                kth, need, count = _count_bit(hi, kth, need, count, k, shift)
            else:
                kth, need, count = _count_digits(
                    hi, real, kth, need, count, known, shift, RADIX_BITS, p == 0
                )
            low_mask = (1 << shift) - 1
    # the bucket [least, most] in hi's order: the picks are all above it and its `need`
    # earliest entries (all of it when the passes stopped early)
    most = (kth | low_mask) ^ (-2147483647 - 1)
    least = kth ^ (-2147483647 - 1)
    above = real & (hi > most)
    tie = real & (hi >= least) & (hi <= most)
    # one scan, two counters (E < 2^16): picks above the bucket, bucket entries, up to e
    upto = tl.cumsum(above.to(tl.int32) * 65536 + tie.to(tl.int32), 0)
    ties_upto = upto & 0xFFFF
    chosen = above | (tie & (ties_upto <= need))
    place = (upto >> 16) + tl.minimum(ties_upto, need) - 1
    work_row = work_ptr + s * stride_ws
    tl.store(work_row + place, keys, mask=chosen)
    tl.debug_barrier()  # the picks' keys, scattered by every thread, visible to all
    pick = tl.arange(0, BLOCK_K)
    best = tl.sort(tl.load(work_row + pick, mask=pick < k, other=lowest), descending=True)
    ids = 0x7FFFFFFF - (best & 0xFFFFFFFF)
    tl.debug_barrier()  # every key read before the outputs (work may be out) overwrite them
    if SELECT:
        store_selection(
            s, ids, pick, pick < k, slots_ptr, stride_ss, num_visible_ptr, window_ptr,
            stride_window, out_ptr, valid_ptr, k, W, BLOCK_W,
        )  # fmt: skip
    else:
        tl.store(out_ptr + s * stride_os + pick, ids, mask=pick < k)


def radix_topk(
    packed: torch.Tensor,
    out: torch.Tensor,
    work: torch.Tensor,
    k: int,
    radix_bits: int = 1,
    num_warps: int = 0,
    selection: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """One ``radix_topk_kernel`` launch, grid S. packed: [S, E] int64 (entry e's key at
    column e, unit column stride), 0 < k <= E <= ``RADIX_MAX_ENTRIES``; out: [S, K] int64
    ids (contiguous rows), or with ``selection`` = (slots, num_visible, window uint8,
    valid uint8 out) the picks' slots; work: [S, >= K] int64 scratch (may be ``out``);
    num_warps 0: ``default_warps``."""
    num_queries, num_entries = packed.shape
    if not 0 < k <= num_entries <= RADIX_MAX_ENTRIES or radix_bits not in RADIX_BITS_CHOICES:
        raise ValueError(
            f"radix top-k: 0 < k={k} <= E={num_entries} <= {RADIX_MAX_ENTRIES} and "
            f"radix_bits={radix_bits} in {RADIX_BITS_CHOICES} needed"
        )
    slots, num_visible, window, valid = selection or (packed, packed, packed, packed)
    width = window.shape[1] if selection else 0
    block_n = triton.next_power_of_2(num_entries)
    radix_topk_kernel[(num_queries,)](
        packed,
        out,
        work,
        num_entries,
        k,
        packed.stride(0),
        out.stride(0),
        work.stride(0),
        slots,
        num_visible,
        window,
        valid,
        slots.stride(0),
        window.stride(0),
        width,
        BLOCK_N=block_n,
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        RADIX_BITS=radix_bits,
        SELECT=selection is not None,
        BLOCK_W=max(2, triton.next_power_of_2(width)),
        num_warps=num_warps or default_warps(num_entries),
        **pdl(packed.device),
    )
