"""Times the fused MoE op (Triton) against the grouped-GEMM path and the torch reference.

V4-Flash expert sizes (E=64 experts as in the 4-layer bench preset, k=6, D=4096, I=2048,
bf16) at T in {1, 8, 64, 256, 1024}, uniform random routing (k distinct experts a token).
Each record: impl ("triton" | "triton:<tiling variant>" | "grouped" | "reference"), T, the
compulsory bytes (the hit experts' weights, 3 x D x I x 2 bytes each, plus x and the
output), the FLOPs (2 x 3 x T x k x D x I), the median time with ``triton.testing.do_bench``
(L2 flushed before each call, launch cost included) and with ``do_bench_cudagraph`` (what
decode sees), and the fraction of the H200 roofline, max(bytes / 4.8 TB/s, flops / 989
TFLOP/s) / time, on the graph time. Triton rows carry max |kernel - grouped| (bf16 both).

    from benchmarks.fused_moe_bench import run; records = run()   # the lead's one-call script
    python benchmarks/fused_moe_bench.py --output $OUT/fused_moe_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from rackserve.ops import reference
from rackserve.ops.grouped_moe import moe_experts_grouped
from rackserve.ops.triton import fused_moe

from bench_timing import stamped, time_us

E, K, D, INTER = 64, 6, 4096, 2048  # experts, top-k, hidden, expert width
LIMIT = 10.0
TOKENS = (1, 8, 64, 256, 1024)
HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS_PER_S = 989e12


def _weights(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, D, generator=g, device=device, dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(E, D, INTER, generator=g, device=device, dtype=torch.bfloat16) / INTER**0.5
    return w13, w2


def _routing(t: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, D, generator=g, device=device).bfloat16()
    ids = torch.rand(t, E, generator=g, device=device).argsort(dim=-1)[:, :K]
    weights = torch.rand(t, K, generator=g, device=device)
    return x, ids, weights / weights.sum(-1, keepdim=True)


def _variants(t: int, device: torch.device) -> dict[str, fused_moe.Tiling]:
    """A few tilings around the default, to pick defaults from the first GPU run."""
    base = fused_moe.default_tiling(t, K, E, INTER, device)
    rep = dataclasses.replace
    out = {
        "k64": rep(base, gate_up_block_k=64, down_block_k=64),
        "s3": rep(base, gate_up_stages=3, down_stages=3),
        "gu_n32": rep(base, gate_up_block_n=32),
        "gu_n64": rep(base, gate_up_block_n=64),
        "down_n32": rep(base, down_block_n=32),
        "down_n128_s3": rep(base, down_block_n=128, down_stages=3),
        "down_n128_s3_w8": rep(base, down_block_n=128, down_stages=3, down_warps=8),
        "down_k64_s5": rep(base, down_block_k=64, down_stages=5),
        "down_n256_k64_s4_w8": rep(
            base, down_block_n=256, down_block_k=64, down_stages=4, down_warps=8
        ),
        "down_n256_k64_s3": rep(base, down_block_n=256, down_block_k=64, down_stages=3),
        "w8": rep(base, gate_up_warps=8, down_warps=8),
        "seg256": rep(base, align_segment=256),
        "seg512": rep(base, align_segment=512),
    }
    if t >= 64:
        out["bm32"] = rep(base, block_m=32)
        out["bm64_w8"] = rep(
            base, block_m=64, gate_up_warps=8, down_warps=8, down_block_n=128, down_stages=3
        )
    if t <= 256:
        out["bm16"] = rep(base, block_m=16)
        out["bm16_seg256"] = rep(base, block_m=16, align_segment=256)
    return out


def _record(impl: str, t: int, nbytes: int, flops: int, fn: Callable[[], object]) -> dict:
    plain, graph = time_us(fn)
    best = graph if graph is not None else plain
    floor_us = max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S) * 1e6
    return {
        "kind": "fused_moe_bench",
        "op": "moe_experts",
        "impl": impl,
        "tokens": t,
        "experts": E,
        "top_k": K,
        "hidden": D,
        "inter": INTER,
        "bytes": nbytes,
        "flops": flops,
        "time_us": plain,
        "graph_time_us": graph,
        "gb_per_s": nbytes / best / 1e3,
        "tflops": flops / best / 1e6,
        "roofline_fraction": floor_us / best,
    }


def run(
    device: str = "cuda",
    tokens: tuple[int, ...] = TOKENS,
    sweep: bool = True,
    with_reference: bool = True,
) -> list[dict]:
    """Benchmark records for moe_experts (see the module docstring)."""
    dev = torch.device(device)
    w13, w2 = _weights(device)
    records = []
    for t in tokens:
        x, ids, weights = _routing(t, device)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * D * INTER * 2 + 2 * t * D * 2
        flops = 2 * 3 * t * K * D * INTER
        args = (x, ids, weights, w13, w2, LIMIT)
        expected = moe_experts_grouped(*args).float()
        tilings = {"triton": None}
        if sweep:
            tilings |= {f"triton:{k}": v for k, v in _variants(t, dev).items()}
        for impl, tiling in tilings.items():

            def kernel(tiling=tiling, args=args):
                return fused_moe.moe_experts(*args, tiling=tiling)

            try:
                rec = _record(impl, t, nbytes, flops, kernel)
                rec["max_abs_err"] = (kernel().float() - expected).abs().max().item()
            except Exception as exc:  # a variant the device cannot launch (shared memory)
                records.append({"impl": impl, "tokens": t, "error": str(exc)[:200]})
                continue
            rec["experts_hit"] = hit
            records.append(rec)
        records.append(_record("grouped", t, nbytes, flops, lambda a=args: moe_experts_grouped(*a)))
        if with_reference:
            records.append(
                _record("reference", t, nbytes, flops, lambda a=args: reference.moe_experts(*a))
            )
    return stamped(records, dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--no-sweep", action="store_true", help="default tiling only")
    parser.add_argument("--no-reference", action="store_true", help="skip the looped reference")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    args = parser.parse_args()
    records = run(
        tokens=tuple(args.tokens), sweep=not args.no_sweep, with_reference=not args.no_reference
    )
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)
    for r in records:
        if "error" in r:
            print(f"T={r['tokens']:5d} {r['impl']:20s} failed: {r['error']}")
            continue
        graph = r["graph_time_us"]
        print(
            f"T={r['tokens']:5d} {r['impl']:20s} {r['time_us']:9.1f} us "
            f"graph {graph if graph is None else round(graph, 1)} us {r['gb_per_s']:7.1f} GB/s "
            f"{r['roofline_fraction']:6.1%} of roofline"
        )


if __name__ == "__main__":
    main()
