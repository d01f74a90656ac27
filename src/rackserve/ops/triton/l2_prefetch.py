"""Pull the head of the next weight stream into L2 beside a decode step's latency-bound
kernels.

At batch 1 a decode step alternates weight streams (projections, the lm_head) with chains
of latency-bound kernels (the mHC, norms, the attention), during which HBM idles, and each
stream starts cold. The H200 probe (``benchmarks/l2_prefetch_probe.py``,
2026-12-04-h200-s24.md): a 64 MB GEMV took 26.1 us cold and 22.9 us with its first 16 MB in
L2 beforehand (on a second stream beside a ~20 us chain: 23.2 us); L2 keeps about 16-20 MB
of a stream for the next kernel.

``l2_prefetch(weight, nbytes)`` launches one program a LANES x CHUNK bytes of the weight's
head; each lane issues one Hopper bulk L2 prefetch (``cp.async.bulk.prefetch.L2.global``)
of CHUNK bytes and the program exits: no loads, stores or shared memory. The op table
(``Kernels.prefetch``) issues it on a stream of its own (``SideStream.of(device,
"prefetch")``) forked from the current one, so it starts after the kernels before it (the
previous weight stream) and runs beside the chain after it; nothing waits for it until the
end of the forward (``Kernels.settle_prefetch``): it changes no value. Session 28's version
was one program on the step's own stream, which the next kernel waited for until its 16 MB
had drained (~60 us: decode:1 0.58 ms slower on the H100).

sm_90 and newer only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 16 << 10  # bytes one lane prefetches with one instruction (a multiple of 16)
LANES = 32  # lanes (one warp) a program


@functools.cache
def supported(device: torch.device) -> bool:
    """The bulk prefetch exists from sm_90 (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(weight: torch.Tensor, nbytes: int) -> None:
    """Start prefetching the first ``nbytes`` (rounded down to 16) of ``weight``'s storage
    (contiguous: the bytes its kernel streams first) into L2, on the current stream."""
    if not weight.is_contiguous():
        raise ValueError("l2_prefetch: a contiguous weight (the bytes its GEMM reads first)")
    size = min(nbytes, weight.numel() * weight.element_size()) // 16 * 16
    if size <= 0 or weight.data_ptr() % 16 or not supported(weight.device):
        return
    raw = weight.view(-1).view(torch.uint8)
    grid = (triton.cdiv(size, LANES * CHUNK),)
    l2_prefetch_kernel[grid](raw, size, CHUNK=CHUNK, LANES=LANES, num_warps=LANES // 32)


@triton.jit
def l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    lane = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES).to(tl.int64)
    offset = lane * CHUNK
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
