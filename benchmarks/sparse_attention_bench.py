"""Times the paged sparse attention kernel (Triton) against its torch reference on the GPU.

V4-Flash sizes: H = 64 heads, Dh = 512 (64 rope dims), Wa = 128 window rows, Wb = 32
(HCA at 4096 context: 4096 / 128 entries, 512-wide rows) or 512 (CSA top-k: 640-wide rows,
[kv | indexer key]), every row valid, bf16, S in {1, 64, 256} queries; the inverse RoPE
epilogue on. Rows are scattered over caches of 8x the rows read (paged slots). Each
record: impl ("triton" | "reference" | "triton:<tiling variant>"), S, Wb, the compulsory
bytes (gathered rows x Dh x 2 + q + out), FLOPs (QK and PV: 4 S H M Dh), the median time
with ``triton.testing.do_bench`` and inside a CUDA graph, and the fraction of the H200
roofline (4.8 TB/s, 989 TFLOP/s) on the graph time; Triton rows add max |kernel - ref|.

    from benchmarks.sparse_attention_bench import run; records = run()   # one-call script
    python benchmarks/sparse_attention_bench.py --output $OUT/sparse_attention_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from rackserve.ops import reference
from rackserve.ops.triton import sparse_attn

from bench_timing import stamped, time_us

H, DH, ROPE, WA = 64, 512, 64, 128
QUERIES = (1, 64, 256)
COMPRESSED = {32: DH, 512: DH + 128}  # Wb -> entry row width (HCA, CSA)
PEAK_BYTES, PEAK_FLOPS = 4.8e12, 989e12


def _inputs(s: int, wb: int, device: str) -> tuple:
    g = torch.Generator(device=device).manual_seed(s * 1000 + wb)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    na, nb = 8 * s * WA, max(8 * s * wb, 1)
    kv_a = randn(na, DH).bfloat16()
    kv_b = randn(nb, COMPRESSED[wb]).bfloat16()
    slots_a = torch.randperm(na, generator=g, device=device)[: s * WA].view(s, WA)
    slots_b = torch.randperm(nb, generator=g, device=device)[: s * wb].view(s, wb)
    valid = torch.ones(s, WA + wb, dtype=torch.bool, device=device)
    angle = torch.rand(s, ROPE // 2, generator=g, device=device) * 6.3
    q = (2 * randn(s, H, DH)).bfloat16()
    sinks = randn(H)
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    return q, kv_a, slots_a, kv_b, slots_b, valid, sinks, DH**-0.5, cos, sin


def _variants(s: int, wb: int, device: torch.device) -> dict[str, sparse_attn.Tiling]:
    """Tilings around the default, to pick the heuristic from the first GPU run."""
    base = sparse_attn.default_tiling(s, H, DH, WA + wb, device)
    rep = dataclasses.replace
    return {
        "bf16_p": rep(base, split_p=False),
        "bn64": rep(base, block_n=64),
        "bn16": rep(base, block_n=16),
        "bh32": rep(base, block_h=32),
        "bh16": rep(base, block_h=16),
        "no_prefetch_w4_stages3": rep(base, prefetch=False, num_warps=4, num_stages=3),
        "no_prefetch_w8_stages3": rep(base, prefetch=False, num_stages=3),
        "splits*2": rep(base, num_splits=base.num_splits * 2),
        "splits/2": rep(base, num_splits=max(1, base.num_splits // 2)),
        "bh64_dv2": rep(base, block_h=64, num_dv=2, num_warps=8),
    } | _wide_variants(s, wb, device)


def _wide_variants(s: int, wb: int, device: torch.device) -> dict[str, sparse_attn.Tiling]:
    """The "wide" kernel (every head per program; $RACKSERVE_SPARSE_ATTN=wide makes it the
    default) around ``wide_tiling``: tile rows, pipeline stages, splits, bf16 p."""
    wide = sparse_attn.wide_tiling(s, H, DH, WA + wb, device)
    rep = dataclasses.replace
    return {
        "wide": wide,
        # the default until 2026-12-03: 32-row tiles, 3 stages (132 KB: one program per SM;
        # no gather in flight during a tile's dots)
        "wide_bn32_st3": rep(wide, block_n=32, num_stages=3),
        "wide_bn32_st5": rep(wide, block_n=32, num_stages=5),  # 164 KB
        "wide_st6": rep(wide, num_stages=6),  # the same buffers as 5 stages (112 KB)
        "wide_st3": rep(wide, num_stages=3),  # 98 KB, nothing in flight
        "wide_st7": rep(wide, num_stages=7),  # 131 KB: one program per SM
        "wide_bf16_p": rep(wide, split_p=False),
        "wide_fp16_pv": rep(wide, pv_fp16=True),  # one PV dot of fp16 p and rows
        "wide_splits*2": rep(wide, num_splits=wide.num_splits * 2),
        "wide_splits*4": rep(wide, num_splits=wide.num_splits * 4),
        "wide_splits/2": rep(wide, num_splits=max(1, wide.num_splits // 2)),
    }


def _line(r: dict) -> str:
    if "error" in r:
        return f"S={r['queries']:4d} Wb={r['wb']:4d} {r['impl']:24s} {r['error']}"
    graph = r["graph_time_us"]
    return (
        f"S={r['queries']:4d} Wb={r['wb']:4d} {r['impl']:24s} {r['time_us']:8.1f} us "
        f"graph {graph if graph is None else round(graph, 1)} us "
        f"{r['gb_per_s']:7.1f} GB/s {100 * r['roofline_fraction']:5.1f}%"
    )


def run(
    device: str = "cuda",
    queries: tuple[int, ...] = QUERIES,
    sweep: bool = True,
    variants: tuple[str, ...] | None = None,
    verbose: bool = False,
) -> list[dict]:
    """Benchmark records (see the module docstring); ``variants`` keeps only those tiling
    variants, ``verbose`` prints each record as it is measured."""
    dev = torch.device(device)
    records = []
    for wb in COMPRESSED:
        for s in queries:
            args = _inputs(s, wb, device)
            rows = WA + wb
            nbytes = s * rows * DH * 2 + 2 * s * H * DH * 2
            flops = 4 * s * H * rows * DH
            expected = reference.paged_sparse_attention(*args).float()
            tilings: dict[str, sparse_attn.Tiling | None] = {"triton": None}
            if sweep:
                tilings |= {
                    f"triton:{k}": v
                    for k, v in _variants(s, wb, dev).items()
                    if variants is None or k in variants
                }
            impls: dict[str, Callable[[], torch.Tensor]] = {
                name: lambda t=t, a=args: sparse_attn.paged_sparse_attention(*a, tiling=t)
                for name, t in tilings.items()
            }
            impls["reference"] = lambda a=args: reference.paged_sparse_attention(*a)
            for impl, fn in impls.items():
                try:
                    err = (fn().float() - expected).abs().max().item()
                    plain, graph = time_us(fn)
                except Exception as e:  # a variant that does not compile (smem, registers)
                    records.append({"impl": impl, "queries": s, "wb": wb, "error": repr(e)[:300]})
                    if verbose:
                        print(_line(records[-1]), flush=True)
                    continue
                best = graph if graph is not None else plain
                records.append(
                    {
                        "kind": "sparse_attention_bench",
                        "impl": impl,
                        "queries": s,
                        "heads": H,
                        "head_dim": DH,
                        "wa": WA,
                        "wb": wb,
                        "bytes": nbytes,
                        "flops": flops,
                        "time_us": plain,
                        "graph_time_us": graph,
                        "gb_per_s": nbytes / best / 1e3,
                        "roofline_fraction": max(nbytes / PEAK_BYTES, flops / PEAK_FLOPS)
                        / (best * 1e-6),
                        "max_abs_err": None if impl == "reference" else err,
                    }
                )
                if verbose:
                    print(_line(records[-1]), flush=True)
    return stamped(records, dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="default tiling only")
    parser.add_argument("--queries", type=int, nargs="+", default=list(QUERIES))
    parser.add_argument("--variants", nargs="+", help="only these tiling variants")
    args = parser.parse_args()
    variants = tuple(args.variants) if args.variants else None
    records = run(queries=tuple(args.queries), sweep=not args.no_sweep, variants=variants,
                  verbose=True)  # fmt: skip
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
