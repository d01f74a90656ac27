"""Would prefetching a projection's weights into L2 beside a decode step's latency-bound
kernels pay? (issue 14's decode:1 at ~54% of its roofline: ~80 us a layer of small kernels
that read little, between GEMVs that stream 20-235 MB each.)

For a bf16 weight W [N, K] and one token x [1, K], on a cold L2 (a 256 MB buffer rewritten
first), the GEMV's own graph timed by events around its replay, right after a graph of:

- ``cold``: ``x @ W.T`` alone;
- ``warm P MB``: a prefetch kernel first reads W's first P MB (``evict_last`` loads, one
  store per program that never fires), then the GEMV;
- ``beside``: the prefetch on a second stream while the first runs a ~20 us latency-bound
  chain (64 one-program kernels), then the GEMV after both: what a layer could overlap.

    python3 benchmarks/l2_prefetch_probe.py --n 8192 --k 4096 --mb 0 16 32 48 --output out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_kernel(w_ptr, num_elements, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Read BLOCK * STEPS elements a program into L2 (evict_last); the sum is stored only
    if it is exactly 12345 (never for weights of this probe), so the loads stay."""
    start = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(STEPS):
        offs = start + s * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(w_ptr + offs, mask=offs < num_elements, other=0.0, eviction_policy="evict_last")
        acc += v.to(tl.float32)
    total = tl.sum(acc, axis=0)
    if total == 12345.0:
        tl.store(out_ptr, total)


@triton.jit
def tiny_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def prefetch(w: torch.Tensor, nbytes: int, sink: torch.Tensor) -> None:
    n = min(w.numel(), nbytes // w.element_size())
    if n == 0:
        return
    block, steps = 2048, 8
    prefetch_kernel[(triton.cdiv(n, block * steps),)](w, n, sink, BLOCK=block, STEPS=steps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--mb", type=int, nargs="+", default=[0, 16, 32, 48])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    w = torch.randn(args.n, args.k, device=dev, dtype=torch.bfloat16) / 64
    x = torch.randn(1, args.k, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    sink = torch.zeros(1, device=dev)
    counter = torch.zeros(1, device=dev)
    side = torch.cuda.Stream()
    results = []
    gemv = torch.cuda.CUDAGraph()
    y = torch.empty(1, args.n, device=dev, dtype=torch.bfloat16)
    torch.mm(x, w.t(), out=y)
    with torch.cuda.graph(gemv):
        torch.mm(x, w.t(), out=y)
    for mb in args.mb:
        for mode in ("warm", "beside") if mb else ("cold",):

            def before(mode=mode, mb=mb) -> None:
                """A cold L2, then (warm) the prefetch, or (beside) the prefetch on a side
                stream beside a chain of small kernels."""
                flush.fill_(1)
                if mode == "warm":
                    prefetch(w, mb << 20, sink)
                elif mode == "beside":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        prefetch(w, mb << 20, sink)
                    for _ in range(64):
                        tiny_kernel[(1,)](counter)
                    torch.cuda.current_stream().wait_stream(side)

            before()  # compiles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                before()
            times = []
            # events outside the graphs: the GEMV graph's replay right after the other's
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(args.reps):
                graph.replay()
                start.record()
                gemv.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            times.sort()
            row = {"mode": mode, "prefetch_mb": mb, "gemv_us": times[len(times) // 2],
                   "weight_mb": w.numel() * 2 / 2**20}  # fmt: skip
            results.append(row)
            mb_of = f"{mb:3d} MB of {row['weight_mb']:.0f}"
            print(f"{mode:6s} prefetch {mb_of}: GEMV {row['gemv_us']:.1f} us")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
