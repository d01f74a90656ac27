"""The FP4 fused MoE (``ops/triton/fused_moe_fp4.py``) at V4-Flash sizes (E=64, k=6,
D=4096, I=2048) over a few tilings, both nibble decoders and ``tl.dot_scaled``, graph-timed,
against its compulsory bytes (the hit experts at 4.25 bits a weight, plus x and the
output): which knob moves it off its 3-8% of roofline (session 7's quant_bench). One JSON
line per timing, the file rewritten as it goes.

    python benchmarks/fp4_moe_sweep.py --output $OUT/fp4_sweep.json [--tokens 1 64 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import partial

import torch
import triton

from rackserve.ops import quant
from rackserve.ops.triton import fused_moe_fp4 as fp4

E, K, D, INTER, LIMIT = 64, 6, 4096, 2048, 10.0
BANDWIDTH = 4.8e12


def variants(t: int) -> dict[str, fp4.Fp4Tiling]:
    base = fp4.default_tiling(t, K, E, torch.device("cuda"))
    return {
        "default": base,  # the fp16-bits decoder since 2026-12-02
        "arith_decode": dataclasses.replace(base, fp16_bits=False),
        "bn64": dataclasses.replace(base, gate_up_block_n=64),
        "bk256": dataclasses.replace(base, block_k=256),
        "stages2": dataclasses.replace(base, num_stages=2),
        "prefetch": dataclasses.replace(base, prefetch=True),
        "prefetch_stages1": dataclasses.replace(base, prefetch=True, num_stages=1),
        "dot_scaled": dataclasses.replace(base, dot_scaled=True),
        "scaled_bk256": dataclasses.replace(base, dot_scaled=True, block_k=256),
        "scaled_bn64": dataclasses.replace(
            base, dot_scaled=True, gate_up_block_n=64, down_block_n=128
        ),
        # two weights per instruction pair in inline PTX (``fp4_tiles.fp4_decode_bf16``)
        # (fp32 h, as before stacked h became the decode default)
        "asm": dataclasses.replace(base, dot_scaled=False, asm_decode=True, stack_h=False),
        "asm_bn64": dataclasses.replace(
            base,
            dot_scaled=False,
            asm_decode=True,
            stack_h=False,
            gate_up_block_n=64,
            down_block_n=128,
        ),
        "asm_bk256": dataclasses.replace(
            base, dot_scaled=False, asm_decode=True, stack_h=False, block_k=256
        ),
        # h stacked as bf16 hi / lo rows, even inputs first: two dots per down step, not four
        "asm_stack": dataclasses.replace(base, dot_scaled=False, asm_decode=True, stack_h=True),
        "asm_stack_bn64": dataclasses.replace(
            base, dot_scaled=False, asm_decode=True, stack_h=True, gate_up_block_n=64
        ),
        # the down kernel's grid as (n-tiles, blocks): a block's h rows re-read from L2
        "tile_fastest": dataclasses.replace(base, down_tile_fastest=True),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--output", default=None)
    p.add_argument("--variants", nargs="+", help="these variants only (default first)")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(1)
    w13, s13 = quant.quantize_fp4(torch.randn(E, 2 * INTER, D, device="cuda", generator=g) / 64)
    w2, s2 = quant.quantize_fp4(torch.randn(E, D, INTER, device="cuda", generator=g) / 45)
    s13, s2 = quant.float_to_ue8m0(s13), quant.float_to_ue8m0(s2)
    records = []
    for t in args.tokens:
        x = torch.randn(t, D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(t, E, device="cuda", generator=g).argsort(-1)[:, :K]
        weights = torch.rand(t, K, device="cuda", generator=g)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * D * INTER * (0.5 + 1 / 32) + 4 * t * D
        ref = None
        for name, tiling in variants(t).items():
            if args.variants and name != "default" and name not in args.variants:
                continue
            fn = partial(
                fp4.moe_experts_fp4, x, ids, weights, w13, s13, w2, s2, LIMIT, tiling=tiling
            )
            got = fn().float()
            ref = got if ref is None else ref
            us = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
            rec = {
                "tokens": t, "variant": name, "tiling": dataclasses.asdict(tiling), "us": us,
                "bytes": nbytes, "fraction_of_roofline": nbytes / BANDWIDTH / (us * 1e-6),
                "max_diff_vs_default": (got - ref).abs().max().item(),
            }  # fmt: skip
            frac = rec["fraction_of_roofline"]
            print(f"T={t:4d} {name:13s} {us:9.1f} us  {frac:.2f}", flush=True)
            records.append(rec)
            if args.output:  # rewritten after each timing: a cut call keeps what ran
                with open(args.output, "w") as f:
                    json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
