"""The short, latency-bound kernels of a batch-1 decode step, timed alone in a CUDA graph
over launch variants: what each one's serial chain costs and which shape shortens it.

- ``route_align``: ``moe_routed``'s one-program router + align (hash and learned routing,
  V4-Flash sizes: 64 routed experts + the shared one, k = 6), over (BLOCK_T, CHUNK, warps),
  at T = 1 with the scans' align and ``align_one_token``;
- ``router_logits``: the router's [T, 4096] x [4096, 64] logits, ``F.linear`` (cuBLAS) against
  ``ops.triton.gemv``;
- ``hc_pre``: the mHC pre (K1 + K2) over K2's warps and K1's program count (the splits K2
  reduces), with 1 Sinkhorn iteration instead of 20 (the chain's own cost), and with K2 as
  a mixes launch (a token a thread) plus a collapse launch (``mixes_block_t``);
- ``align``: the fused MoE's align past ``PER_EXPERT_ALIGN_MAX_PAIRS`` pairs (count + align
  over segments of pairs) over the segment length, against one program per expert;
- ``hc_post_pre``: the mHC after a fused MoE (its unsummed fp32 slots, k = 7 with the shared
  expert, summed in K1's prologue) over K1's token tile, columns per step, programs and
  warps, the expand as its own launch (``post_apart``) and the split K2.

    python3 benchmarks/latency_kernels.py --output $OUT/latency_kernels.json [--parts hc post align]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.nn.functional as F
import triton
import triton.testing

from rackserve.ops.reference import ExpertSlots
from rackserve.ops.triton import fused_moe, gemv, mhc
from rackserve.ops.triton.moe_routed import _route_align_kernel

D, E, K, N_STREAMS = 4096, 64, 6, 4


def _us(fn) -> float:
    return round(1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"), 2)


def route_align(
    t: int, hashed: bool, block_t: int, chunk: int, warps: int, x, w, table, bias, one=False
):
    cols = K + 1
    num_experts = E + 1
    pairs = t * cols
    tiling = fused_moe.default_tiling(t, cols, num_experts, 2048, x.device, x.dtype)
    nb = fused_moe.num_blocks_bound(pairs, num_experts, tiling.block_m)
    ids = torch.empty(t, cols, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, cols, device=x.device)
    sorted_ids = torch.empty(nb * tiling.block_m, dtype=torch.int32, device=x.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=x.device)
    logits = F.linear(x, w).contiguous()
    input_ids = torch.arange(t, device=x.device)
    align_e = max(16, triton.next_power_of_2(num_experts))

    def run():
        _route_align_kernel[(1,)](
            logits, weights if hashed else bias, table if hashed else ids, input_ids,
            ids, weights, ids, ids, sorted_ids, block_expert,
            t, 1.5, E, num_experts, pairs, nb,
            E=E, K=K, SCORING=0, HASHED=hashed, SHARED=1, COUNT=0, BLOCK_T=block_t,
            BLOCK_E=max(16, triton.next_power_of_2(E)), BLOCK_M=tiling.block_m,
            ALIGN_E=align_e, CHUNK=chunk, BLOCK_B=max(16, min(128, 8192 // align_e)),
            ONE_TOKEN=one, BLOCK_P=max(16, triton.next_power_of_2(pairs)), num_warps=warps,
            PDL=False,
        )  # fmt: skip

    return run


def _mhc_inputs(t: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A block's mHC inputs at V4-Flash sizes: streams [t, N, D] bf16, fn, base, scale and
    the norm weight."""
    dev, cols, mixes = g.device, N_STREAMS * D, (2 + N_STREAMS) * N_STREAMS
    streams = torch.randn(t, N_STREAMS, D, generator=g, device=dev).bfloat16()
    fn = torch.randn(mixes, cols, generator=g, device=dev) * (1.5 / cols**0.5)
    base = torch.randn(mixes, generator=g, device=dev) * 0.5
    norm_w = 1 + 0.2 * torch.randn(D, generator=g, device=dev)
    return streams, fn, base, torch.ones(3, device=dev), norm_w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parts = ["route", "hc", "post", "align"]
    ap.add_argument("--parts", nargs="+", default=["route", "hc"], choices=parts)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    records = []

    def add(kind: str, t: int, variant: str, us: float) -> None:
        records.append({"kernel": kind, "t": t, "variant": variant, "us": us})
        print(f"{kind:14s} T={t:<4d} {variant:34s} {us:8.2f} us", flush=True)

    w = (torch.randn(E, D, generator=g, device=dev) / D**0.5).bfloat16()
    bias = torch.randn(E, generator=g, device=dev) * 0.1
    table = torch.randint(0, E, (1024, K), generator=g, device=dev, dtype=torch.int32)
    for t in args.tokens if "route" in args.parts else ():
        x = torch.randn(t, D, generator=g, device=dev).bfloat16()
        add("router_logits", t, "F.linear", _us(lambda x=x: F.linear(x, w)))
        add("router_logits", t, "gemv", _us(lambda x=x: gemv.gemv(x, w)))
        for hashed in (True, False):
            for block_t, chunk, warps in (
                (16, 64, 4), (16, 64, 1), (16, 64, 2), (16, 16, 1), (16, 16, 2),
                (1, 16, 1), (1, 16, 2), (1, 16, 4), (8, 16, 1), (8, 16, 2), (8, 64, 2),
            ):  # fmt: skip
                if block_t < t and block_t != 16:
                    continue
                for one in (False, True) if t == 1 else (False,):
                    run = route_align(t, hashed, block_t, chunk, warps, x, w, table, bias, one)
                    name = f"{'hash' if hashed else 'learned'} bt{block_t} c{chunk} w{warps}"
                    add("route_align", t, name + (" one-token" if one else ""), _us(run))

    for t in args.tokens if "align" in args.parts else ():
        routed = torch.rand(t, E, generator=g, device=dev).argsort(dim=-1)[:, :K]
        ids = torch.cat([routed, torch.full((t, 1), E, device=dev)], 1).int().contiguous()
        tiling = fused_moe.default_tiling(t, K + 1, E + 1, 2048, dev)
        block_m = tiling.block_m
        per_expert = t * (K + 1) <= fused_moe.PER_EXPERT_ALIGN_MAX_PAIRS  # moe_align's choice
        for segment in (64, 128, 256, 512, 0):
            name = f"block_m {block_m} " + (f"segment {segment}" if segment else "per expert")
            if segment == (0 if per_expert else tiling.align_segment):
                name += " (default)"

            def run(ids=ids, segment=segment, block_m=block_m):
                return fused_moe.moe_align(ids, E + 1, block_m, segment or 64, segment == 0)

            add("moe_align", t, name, _us(run))
    for t in args.tokens if "hc" in args.parts else ():
        streams, fn, base, scale, norm_w = _mhc_inputs(t, g)
        tiling = mhc.default_tiling(t, N_STREAMS, D, dev, torch.bfloat16)
        w8, p264 = tiling.finish_warps, tiling.gemm_programs
        for iters, warps, programs, mbt in (
            (20, w8, p264, 0), (1, w8, p264, 0), (20, 2, p264, 0), (20, 4, p264, 0),
            (20, 16, p264, 0), (20, w8, p264 // 4, 0), (20, 4, p264 // 4, 0),
            (20, w8, p264 // 8, 0), (20, w8, p264, 16), (20, w8, p264, 32), (20, 4, p264, 32),
            (20, w8, p264, 64),
        ):  # fmt: skip
            if mbt and t < 16:
                continue
            hc = (streams, fn, base, scale, norm_w, iters, 1e-6, 1e-6)
            tl_ = dataclasses.replace(
                tiling, finish_warps=warps, gemm_programs=max(1, programs), mixes_block_t=mbt
            )

            def run(hc=hc, tl_=tl_):
                return mhc.hc_pre(*hc, tiling=tl_)

            mark = " (default)" if tl_ == tiling else ""
            name = f"sinkhorn {iters} finish_warps {warps} K1 programs {programs}"
            add("hc_pre", t, f"{name} mixes_block_t {mbt}{mark}", _us(run))
    for t in args.tokens if "post" in args.parts else ():
        streams, fn, base, scale, norm_w = _mhc_inputs(t, g)
        ids = torch.randint(0, E + 1, (t, K + 1), generator=g, device=dev)
        slots = ExpertSlots(
            torch.randn(t * (K + 1), D, generator=g, device=dev), ids, E + 1, torch.bfloat16
        )
        post = torch.rand(t, N_STREAMS, generator=g, device=dev) * 2
        comb = torch.rand(t, N_STREAMS, N_STREAMS, generator=g, device=dev) / N_STREAMS
        tiling = mhc.default_tiling(t, N_STREAMS, D, dev, torch.bfloat16)
        p264 = tiling.gemm_programs
        variants = [{}, {"post_apart": True}, {"mixes_block_t": 32},
                    {"post_apart": True, "mixes_block_t": 32}]  # fmt: skip
        if not tiling.gemm_gemv:
            for bt in (32, 64):
                for bd in (16, 32, 64):
                    for programs, warps in ((p264, 4), (p264 // 2, 4), (p264, 8)):
                        k1 = {"gemm_block_t": bt, "gemm_block_d": bd}
                        variants.append({**k1, "gemm_programs": programs, "gemm_warps": warps})
        for v in variants:
            tl_ = dataclasses.replace(tiling, **v)
            args_ = (streams, slots, post, comb, fn, base, scale, norm_w, 20, 1e-6, 1e-6)

            def run(args_=args_, tl_=tl_):
                return mhc.hc_post_pre(*args_, tiling=tl_)

            mark = " (default)" if tl_ == tiling else ""
            name = " ".join(f"{k} {int(x)}" for k, x in v.items()) or "default"
            try:
                add("hc_post_pre", t, name + mark, _us(run))
            except Exception as e:  # a shape this Triton cannot compile or fit
                print(f"hc_post_pre    T={t:<4d} {name}: {type(e).__name__} {str(e)[:80]}")
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
