"""Times the fused mHC ops (Triton) against their torch references on the GPU.

V4-Flash sizes (N=4 streams, D=4096, bf16 streams, fp32 mHC weights) at T in {1, 4, 16,
64, 256, 8192}; ops hc_pre, hc_post, hc_post_pre (the two fused), hc_head. Each record: op, impl
("triton" | "reference" | "triton:<tiling variant>"), T, the compulsory bytes (every input
read once, every output written once), the median time with ``triton.testing.do_bench``
(L2 flushed before each call, launch cost included) and with ``do_bench_cudagraph``
(inside a CUDA graph: what decode will see), GB/s on the graph time, and for Triton rows
the max |kernel - reference| of the bf16 output x (or the streams, for hc_post).

    from benchmarks.mhc_bench import run; records = run()      # the lead's one-call script
    python benchmarks/mhc_bench.py --output $OUT/mhc_bench.json [--tokens 2048 8192]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch
import triton

from rackserve.ops import reference
from rackserve.ops.triton import mhc

from bench_timing import stamped, time_us

N, D = 4, 4096
SINKHORN_ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6
TOKENS = (1, 4, 16, 64, 256, 8192)


def _inputs(t: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(t)
    cols = N * D
    mixes = (2 + N) * N

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    return {
        "streams": randn(t, N, D).bfloat16(),
        "block_out": randn(t, D).bfloat16(),
        "fn": randn(mixes, cols) * (1.5 / cols**0.5),
        "base": randn(mixes) * 0.5,
        "scale": torch.ones(3, device=device),
        "norm_weight": 1 + 0.2 * randn(D),
    }


def _variants(t: int, device: torch.device) -> dict[str, mhc.Tiling]:
    """A few tilings around the default (of the bf16 streams timed here: without the
    dtype, default_tiling is the fp32 one, whose K1 dot is "ieee", and every variant but
    those naming a precision carried that 3x slower K1 until 2026-12-02)."""
    base = mhc.default_tiling(t, N, D, device, torch.bfloat16)
    rep = dataclasses.replace
    variants = {
        "programs/2": rep(base, gemm_programs=max(1, base.gemm_programs // 2)),
        "programs*2": rep(base, gemm_programs=base.gemm_programs * 2),
        "gemm_d/2": rep(base, gemm_block_d=max(1, base.gemm_block_d // 2)),
        "gemm_d*2": rep(base, gemm_block_d=base.gemm_block_d * 2),
        "tf32x3": rep(base, gemm_precision="tf32x3"),
        "bf16x3": rep(base, gemm_precision="bf16x3", gemm_gemv=False, fused=False),
        "finish_d1024": rep(base, finish_block_d=1024, finish_warps=4),
        "post_d2048_w8": rep(base, post_block_d=2048, post_warps=8),
        "k1_3d": rep(base, gemm_flat=False),  # K1 in [T, N, D] tiles (before 2026-12-04)
        "k1_3d_bf16x3": rep(
            base, gemm_flat=False, gemm_precision="bf16x3", gemm_gemv=False, fused=False
        ),
        "k1_d*4": rep(base, gemm_block_d=base.gemm_block_d * 4),
        "k1_w8": rep(base, gemm_warps=8),
        "k1_t*2": rep(base, gemm_block_t=base.gemm_block_t * 2),
        "k1_t/2": rep(base, gemm_block_t=max(16, base.gemm_block_t // 2)),
        "k1_ieee": rep(base, gemm_precision="ieee"),
    }
    if not base.post_apart:  # hc_post's kernel expands, then the flat K1
        variants["apart_expand"] = rep(base, post_apart=True)
    if base.gemm_gemv:  # T <= 4: K1 one token per program, FMA row sums; the M2 K1 instead
        variants["fused" if not base.fused else "unfused"] = rep(base, fused=not base.fused)
        variants["gemv_off"] = rep(base, gemm_gemv=False, fused=False)
        variants["gemv_off_tf32x3"] = rep(
            base, gemm_gemv=False, fused=False, gemm_precision="tf32x3"
        )
    elif t <= 64:
        variants["gemv_on"] = rep(base, gemm_gemv=True)
    # hc_post_pre with the expand in K1's prologue at the bf16x3 dot in launch shapes that
    # compile without spills (``mhc.EXPAND_K1_*``)
    candidates = mhc.EXPAND_K1_DECODE if t <= 128 else mhc.EXPAND_K1_PREFILL
    for name, candidate in candidates.items():
        variants[name] = mhc.expand_k1_tiling(base, candidate)
    if t <= 128:  # the defaults' tf32x3 in tiles without spills
        variants["fused_t32_d16_w4_tf32x3"] = rep(base, gemm_block_t=32, gemm_block_d=16)
    if t >= 1024:  # prefill: wider token tiles in K1, several tokens per K2 program
        variants["gemm_t128"] = rep(base, gemm_block_t=128)
        variants["gemm_t128_w8"] = rep(base, gemm_block_t=128, gemm_warps=8)
        variants["gemm_w8"] = rep(base, gemm_warps=8)
        variants["gemm_t32"] = rep(base, gemm_block_t=32)
        variants["gemm_t16"] = rep(base, gemm_block_t=16)
        variants["finish_t16_d256_w8"] = rep(base, finish_block_t=16, finish_block_d=256,
                                             finish_warps=8)  # fmt: skip
        # K1 expands the streams (named apart from the "post_*" variants, which tile
        # hc_post alone: until session 45 this one, "post_fused", was timed on hc_post only)
        variants["k1_expands"] = rep(base, post_apart=False)
        # K2 as two launches: the mixes a token a thread (128 or 64 a program), the collapse
        variants["mixes128"] = rep(base, mixes_block_t=128)
        variants["mixes64"] = rep(base, mixes_block_t=64)
        variants["mixes32"] = rep(base, mixes_block_t=32)
        variants["mixes128_w4"] = rep(base, mixes_block_t=128, finish_warps=4)
        variants["one_k2"] = rep(base, mixes_block_t=0)  # K2 in one launch (session 11's)
        variants["k1_t64"] = rep(base, gemm_block_t=64)  # session 11's K1 tiles
        variants["s11"] = rep(base, gemm_block_t=64, mixes_block_t=0)  # both
    return variants


def _record(op: str, impl: str, t: int, nbytes: int, fn: Callable[[], object]) -> dict:
    plain, graph = time_us(fn)
    best = graph if graph is not None else plain
    return {
        "kind": "mhc_bench",
        "op": op,
        "impl": impl,
        "tokens": t,
        "streams": N,
        "hidden": D,
        "bytes": nbytes,
        "time_us": plain,
        "graph_time_us": graph,
        "gb_per_s": nbytes / best / 1e3,
    }


def _line(r: dict) -> str:
    graph = r["graph_time_us"]
    return (
        f"{r['op']:8s} T={r['tokens']:5d} {r['impl']:26s} {r['time_us']:9.1f} us "
        f"graph {graph if graph is None else round(graph, 1)} us {r['gb_per_s']:7.1f} GB/s"
        f" err {r.get('max_abs_err', float('nan')):.3g}"
    )


def run(
    device: str = "cuda",
    tokens: tuple[int, ...] = TOKENS,
    sweep: bool = True,
    variants: tuple[str, ...] | None = None,
    verbose: bool = False,
    op_names: tuple[str, ...] | None = None,
) -> list[dict]:
    """Benchmark records for hc_pre / hc_post / hc_head (see the module docstring);
    ``variants`` keeps only those tiling variants, ``op_names`` only those ops, ``verbose``
    prints each record as it is measured (a sweep at prefill sizes runs for minutes)."""
    dev = torch.device(device)
    records = []
    for t in tokens:
        a = _inputs(t, device)
        s, fn, base, scale, w = a["streams"], a["fn"], a["base"], a["scale"], a["norm_weight"]
        head = (fn[:N].contiguous(), base[:N].contiguous(), scale[:1], HC_EPS, NORM_EPS, w)
        block = (fn, base, scale, w, SINKHORN_ITERS, HC_EPS, NORM_EPS)
        _, post, comb = reference.hc_pre(s, *block)
        stream_bytes = s.numel() * s.element_size()
        x_bytes = t * D * 2
        ops = {
            "hc_pre": (
                stream_bytes + fn.numel() * 4 + x_bytes + t * (N + N * N) * 4,
                lambda tiling, s=s, block=block: mhc.hc_pre(s, *block, tiling=tiling)[0],
                lambda s=s, block=block: reference.hc_pre(s, *block)[0],
            ),
            "hc_post": (
                2 * stream_bytes + x_bytes + t * (N + N * N) * 4,
                lambda tiling, s=s, a=a, p=post, c=comb: mhc.hc_post(
                    s, a["block_out"], p, c, tiling=tiling
                ),
                lambda s=s, a=a, p=post, c=comb: reference.hc_post(s, a["block_out"], p, c),
            ),
            "hc_post_pre": (
                2 * stream_bytes + x_bytes + fn.numel() * 4 + x_bytes + t * (N + N * N) * 8,
                lambda tiling, s=s, a=a, p=post, c=comb, block=block: mhc.hc_post_pre(
                    s, a["block_out"], p, c, *block, tiling=tiling
                )[1],
                lambda s=s, a=a, p=post, c=comb, block=block: reference.hc_post_pre(
                    s, a["block_out"], p, c, *block
                )[1],
            ),
            "hc_head": (
                stream_bytes + N * N * D * 4 + x_bytes,
                lambda tiling, s=s, head=head: mhc.hc_head(s, *head, tiling=tiling),
                lambda s=s, head=head: reference.hc_head(s, *head),
            ),
        }
        tilings = {"triton": None}
        if sweep:
            tilings |= {
                f"triton:{k}": v
                for k, v in _variants(t, dev).items()
                if variants is None or k in variants
            }
        for op, (nbytes, kernel, ref) in ops.items():
            if op_names is not None and op not in op_names:
                continue
            expected = ref().float()
            for impl, tiling in tilings.items():
                if (":post" in impl) != (op == "hc_post") and impl != "triton":
                    continue  # a variant of another kernel's tiling
                try:
                    rec = _record(op, impl, t, nbytes, lambda k=kernel, ti=tiling: k(ti))
                    rec["max_abs_err"] = (kernel(tiling).float() - expected).abs().max().item()
                except triton.runtime.errors.OutOfResources as e:  # a tiling too large
                    records.append({"op": op, "impl": impl, "tokens": t, "error": str(e)[:160]})
                    continue
                records.append(rec)
                if verbose:
                    print(_line(rec), flush=True)
            records.append(_record(op, "reference", t, nbytes, ref))
            if verbose:
                print(_line(records[-1]), flush=True)
    return stamped(records, dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="default tiling only")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--variants", nargs="+", help="only these tiling variants")
    parser.add_argument("--ops", nargs="+", help="only these ops (hc_pre, hc_post, ...)")
    args = parser.parse_args()
    variants = tuple(args.variants) if args.variants else None
    op_names = tuple(args.ops) if args.ops else None
    records = run(tokens=tuple(args.tokens), sweep=not args.no_sweep, variants=variants,
                  verbose=True, op_names=op_names)  # fmt: skip
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
