"""Find which compress_pool case faults on the GPU (run with CUDA_LAUNCH_BLOCKING=1)."""

import sys

import torch

from rackserve.ops import reference
from rackserve.ops.triton.compress import compress_pool

inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
for name, ratio, overlap, width in (("csa", 4, True, 512), ("hca", 128, False, 512)):
    for with_missing in (False, True):
        for n in (1, 64, 2048):
            row = 2 * width if overlap else width
            span = 2 * ratio if overlap else ratio
            slots = n * span * 2
            state = torch.randn(slots, 2 * row, device="cuda").bfloat16()
            src = torch.randperm(slots, device="cuda")[: n * span].view(n, span)
            missing = None
            if with_missing:
                missing = torch.zeros(n, span, dtype=torch.bool, device="cuda")
                if overlap:
                    missing[::2, :ratio] = True
            ape = torch.randn(ratio, row, device="cuda")
            nw = torch.ones(width, device="cuda")
            pos = torch.arange(n, device="cuda") * ratio
            args = (state, src, missing, 0, ape, nw, 1e-6, pos, inv_freq, 1.0)
            print(name, with_missing, n, flush=True, end=" ")
            got = compress_pool(*args)
            torch.cuda.synchronize()
            ref = reference.compress_pool(*args)
            print("max err", (got.float() - ref.float()).abs().max().item(), flush=True)
sys.exit(0)
