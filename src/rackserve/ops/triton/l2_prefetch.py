"""Pull the head of the next weight stream into L2 beside a decode step's latency-bound
kernels (``Kernels.prefetch``; off unless ``ops.L2_PREFETCH_MAX_TOKENS`` is set).

At a few tokens a decode step alternates weight streams (projections, experts, the lm_head)
with chains of latency-bound kernels (the mHC, norms, routing, the attention's small
kernels), during which HBM idles; each stream then starts cold. The H200 probe
(``benchmarks/l2_prefetch_probe.py``, results/2026-12-04-h200-s24.md): a 64 MB GEMV took
26.1 us cold and 22.9 us with its first 16 MB read into L2 before it, by a kernel of many
programs on a side stream beside a latency-bound chain as well as in line; L2 keeps about
16-20 MB of a stream for the next kernel.

``l2_prefetch(weight, nbytes)`` launches that kernel: programs of ``BLOCK * STEPS`` int32
words each read the first ``nbytes`` of the weight's storage with ``evict_last`` loads and
fold them into one value, stored only when a runtime flag the host always passes as 0 is
set: the compiler keeps the loads and nothing is ever written. (Session 27's form, one
program of bulk L2 prefetches in line, held the stream ~60 us per 16 MB: session 28.)
The caller launches it on a stream of its own (``Kernels.prefetch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # int32 words a program reads per step (4 KB)
STEPS = 8  # steps a program: 32 KB, 512 programs for 16 MB


@triton.jit(do_not_specialize=["never"])
def l2_prefetch_kernel(w_ptr, numel, never, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), tl.int32)
    for s in tl.static_range(STEPS):
        offs = start + s * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < numel, other=0, eviction_policy="evict_last")
    if never != 0:  # the host passes 0: the loads stay, nothing is written
        tl.store(w_ptr + start, tl.xor_sum(acc, axis=0))


def l2_prefetch(weight: torch.Tensor, nbytes: int) -> None:
    """Read the first ``nbytes`` (rounded down to 4) of ``weight``'s storage into L2 on the
    current stream; changes nothing. ``weight``: contiguous (the bytes its GEMM streams
    first)."""
    if not weight.is_contiguous():
        raise ValueError("l2_prefetch: a contiguous weight (the bytes its GEMM reads first)")
    words = min(nbytes, weight.numel() * weight.element_size()) // 4
    if words <= 0:
        return
    raw = weight.view(-1).view(torch.uint8)[: words * 4].view(torch.int32)
    grid = (triton.cdiv(words, BLOCK * STEPS),)
    l2_prefetch_kernel[grid](raw, words, 0, BLOCK=BLOCK, STEPS=STEPS, num_warps=4)
