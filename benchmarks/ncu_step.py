"""One eager forward of a synthetic batch, for Nsight Compute to profile kernel by kernel.

The forward runs twice: the first compiles every Triton kernel, the second is the one to
profile (``ncu --launch-skip`` past the first forward's launches, or a kernel-name filter
with ``--launch-count``). NVTX ranges mark the two forwards, so ``ncu --nvtx
--nvtx-include "profiled/"`` selects the second alone.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" -k regex:"moe_down|prenorm" \\
        --launch-count 4 --section SpeedOfLight python3 benchmarks/ncu_step.py \\
        --batch decode:256@4096
"""

from __future__ import annotations

import argparse

import torch

from bench_timing import bench_model, eager_step


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    args = p.parse_args()
    run, _ = eager_step(bench_model(args.layers, args.experts), args.batch)
    for name in ("warm-up", "profiled"):
        torch.cuda.nvtx.range_push(name)
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
