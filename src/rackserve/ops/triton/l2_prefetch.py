"""Pull the head of the next weight stream into L2 ahead of it (decode at a few tokens).

At batch 1 a decode step alternates weight streams (projections, experts, the lm_head)
with chains of latency-bound kernels (the mHC, norms, routing, the attention), during which
HBM idles. Each stream then starts cold: its first bytes arrive a DRAM latency after its
programs start, and it reaches full bandwidth only once enough loads are in flight. The
H200 probe (``benchmarks/l2_prefetch_probe.py``, 2026-12-04-h200-s24.md): a 64 MB GEMV took
26.1 us cold and 22.9 us with its first 16 MB in L2 beforehand; L2 keeps about 16-20 MB of
a stream for the next kernel.

``l2_prefetch(weight, nbytes)`` launches one program whose lanes issue Hopper's bulk L2
prefetch (``cp.async.bulk.prefetch.L2.global``) over the first ``nbytes`` of the weight's
storage in CHUNK-byte pieces and exit: no registers, shared memory or stores, so the
program ends in a few microseconds and the memory system fills L2 while the latency-bound
kernels after it run. It changes no value (the tests check replay bit for bit).
sm_90 and newer only; the op table calls it (``Kernels.prefetch``) only there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 64 << 10  # bytes one lane prefetches with one instruction (a multiple of 16)
LANES = 256


@functools.cache
def supported(device: torch.device) -> bool:
    """The bulk prefetch exists from sm_90 (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(weight: torch.Tensor, nbytes: int) -> None:
    """Start prefetching the first ``nbytes`` (rounded down to 16) of ``weight``'s storage
    (contiguous: the bytes its kernel streams first) into L2; returns at once."""
    if not weight.is_contiguous():
        raise ValueError("l2_prefetch: a contiguous weight (the bytes its GEMM reads first)")
    size = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    if size <= 0 or not supported(weight.device):
        return
    raw = weight.view(-1).view(torch.uint8)
    l2_prefetch_kernel[(1,)](raw, size, CHUNK=CHUNK, LANES=LANES, num_warps=LANES // 32)


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    lane = tl.arange(0, LANES).to(tl.int64) * CHUNK
    for start in range(0, nbytes, LANES * CHUNK):
        offset = start + lane
        size = tl.minimum(tl.maximum(nbytes - offset, 0), CHUNK).to(tl.int32)
        # a lane past the end has size 0 and issues nothing
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            constraints="=r,l,r",
            args=[ptr + offset, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
