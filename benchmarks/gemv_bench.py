"""Times the split-K Triton GEMV (``ops/triton/gemv.py``) against cuBLAS (``torch.matmul``
through ``F.linear``) at the V4-Flash projection sizes, bf16, 1..64 tokens.

Shapes (N outputs x K inputs): the fused input projections of an HCA layer (2560 x 4096)
and a CSA layer (4160 x 4096), wq_b (32768 x 1024) and CSA's fused wq_b + indexer wq_b
(40960 x 1024), wo_b (4096 x 8192), the lm_head (129280 x 4096). Each record: shape, impl
("triton" | "triton:<variant>" | "cublas"), tokens, the compulsory bytes (weights + x + y),
FLOPs, the median time from ``triton.testing.do_bench`` and ``do_bench_cudagraph``, and the
fraction of the H200's 4.8 TB/s the graph time reaches (weights dominate the bytes). The
op table (ops/__init__.py) takes the GEMV below ``GEMV_MAX_TOKENS`` where it splits K.

    from benchmarks.gemv_bench import run; records = run()      # the one-call GPU script
    python benchmarks/gemv_bench.py --output $OUT/gemv_bench.json [--no-sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from rackserve.ops import reference
from rackserve.ops.triton import gemv

from bench_timing import stamped, time_us

SHAPES = {  # name -> (N, K)
    "x_proj_hca": (2560, 4096),
    "x_proj_csa": (4160, 4096),
    "wq_b": (32768, 1024),
    "wq_b_csa": (40960, 1024),
    "wo_b": (4096, 8192),
    "lm_head": (129280, 4096),
}
TOKENS = (1, 2, 4, 8, 15, 16)
SWEEP_TOKENS = (1, 8)
HBM_BYTES_PER_S = 4.8e12
PEAK_FLOPS = 989e12


def _variants(n: int, k: int, device: torch.device) -> dict[str, gemv.GemvTiling]:
    """A few tilings around the default, to pick defaults from the first GPU run."""
    base = gemv.default_tiling(n, k, device)
    rep = dataclasses.replace
    return {
        "splits/2": rep(base, splits=max(1, base.splits // 2)),
        "splits*2": rep(base, splits=base.splits * 2),
        "n32": rep(base, block_n=32, splits=base.splits * 2),
        "n128": rep(base, block_n=128),
        "k64": rep(base, block_k=64),
        "k256_w8": rep(base, block_k=256, num_warps=8),
        "stages3": rep(base, num_stages=3),
        "warps8": rep(base, num_warps=8),
        "splits*4": rep(base, splits=base.splits * 4),
        # more programs in flight an SM, each a deeper ring of smaller stages (the default's
        # 4 x 20 KB leaves two an SM: each waits out its first loads alone)
        "n32_stages6": rep(base, block_n=32, num_stages=6, splits=base.splits * 2),
        "k64_stages8": rep(base, block_k=64, num_stages=8),
        "two_launch": rep(base, fused_reduce=False),  # the reduce in a launch of its own
    }


def _record(shape: str, impl: str, t: int, n: int, k: int, fn) -> dict:
    plain, graph = time_us(fn)
    best = graph if graph is not None else plain
    nbytes = 2 * (n * k + t * k + t * n)
    flops = 2 * t * n * k
    return {
        "kind": "gemv_bench",
        "shape": shape,
        "impl": impl,
        "tokens": t,
        "n": n,
        "k": k,
        "bytes": nbytes,
        "flops": flops,
        "time_us": plain,
        "graph_time_us": graph,
        "tb_per_s": nbytes / best / 1e6,
        "roofline_fraction": nbytes / (best * 1e-6) / HBM_BYTES_PER_S,
        "flops_fraction": flops / (best * 1e-6) / PEAK_FLOPS,
    }


def run(
    device: str = "cuda",
    tokens: tuple[int, ...] = TOKENS,
    sweep: bool = True,
    shapes: tuple[str, ...] = tuple(SHAPES),
    sweep_tokens: tuple[int, ...] = SWEEP_TOKENS,
) -> list[dict]:
    """Benchmark records (see the module docstring); each Triton record carries its max
    |GEMV - cuBLAS| and whether it passes the bf16 rule against the fp32 product. The
    tilings are swept at ``sweep_tokens``."""
    dev = torch.device(device)
    records = []
    for name in shapes:
        n, k = SHAPES[name]
        g = torch.Generator(device=device).manual_seed(n + k)
        w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)
        for t in tokens:
            x = torch.randn(t, k, generator=g, device=device).to(torch.bfloat16)
            expected = reference.linear(x, w)
            truth = reference.linear(x.float(), w.float())
            allowed = 2 * (expected.float() - truth).abs() + 1e-3
            tilings: dict[str, gemv.GemvTiling | None] = {"triton": None}
            if sweep and t in sweep_tokens:
                tilings |= {f"triton:{v}": ti for v, ti in _variants(n, k, dev).items()}
            for impl, tiling in tilings.items():
                rec = _record(
                    name, impl, t, n, k, lambda ti=tiling, x=x, w=w: gemv.gemv(x, w, tiling=ti)
                )
                got = gemv.gemv(x, w, tiling=tiling).float()
                rec["max_abs_err_vs_cublas"] = (got - expected.float()).abs().max().item()
                rec["bf16_rule_ok"] = bool(((got - truth).abs() > allowed).float().mean() <= 1e-3)
                rec["splits"] = (tiling or gemv.default_tiling(n, k, dev)).splits
                records.append(rec)
            records.append(
                _record(name, "cublas", t, n, k, lambda x=x, w=w: reference.linear(x, w))
            )
    return stamped(records, dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="default tiling only")
    parser.add_argument(
        "--tokens", help="comma-separated token counts, each swept (default: 1..16, swept at 1, 8)"
    )
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS
    shapes = tuple(args.shapes.split(",")) if args.shapes else tuple(SHAPES)
    sweep_tokens = tokens if args.tokens else SWEEP_TOKENS
    records = run(tokens=tokens, sweep=not args.no_sweep, shapes=shapes, sweep_tokens=sweep_tokens)
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)
    for r in records:
        graph = r["graph_time_us"]
        print(
            f"{r['shape']:11s} T={r['tokens']:3d} {r['impl']:18s} {r['time_us']:8.1f} us "
            f"graph {graph if graph is None else round(graph, 1)} us "
            f"{100 * r['roofline_fraction']:5.1f}% of 4.8 TB/s"
        )


if __name__ == "__main__":
    main()
