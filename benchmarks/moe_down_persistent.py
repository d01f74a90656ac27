"""The fused MoE's expert kernels (gate-up + down, ``fused_moe.run_experts`` after one align)
with the one-program-an-item down kernel against the persistent one
(``fused_moe.Tiling.down_programs``), at V4-Flash's decode sizes (E = 64 + 1 shared expert,
k = 6 + 1, D = 4096, I = 2048, bf16), each variant alone in a CUDA graph
(``do_bench_cudagraph``, medians), sides in alternating rounds. The gate-up is the same in
every variant, so the differences are the down kernel's.

    python3 benchmarks/moe_down_persistent.py --tokens 1 64 256 --output $OUT/moe_down.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton.testing
from moe_tiling_sweep import INTER, E, K, _problem, _weights

from rackserve.ops.triton import fused_moe


def _variants(base: fused_moe.Tiling, sms: int) -> dict[str, fused_moe.Tiling]:
    return {
        "default": base,
        f"persistent_{sms}": dataclasses.replace(base, down_programs=sms),
        f"persistent_{2 * sms}": dataclasses.replace(base, down_programs=2 * sms),
        f"persistent_{sms}_4stages": dataclasses.replace(base, down_programs=sms, down_stages=4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w13, w2 = _weights("cuda")
    records = []
    for t in args.tokens:
        p = _problem(t, "cuda")
        weights = p["weights"].view(t, K)
        variants = _variants(p["base"], sms)

        def run(tiling: fused_moe.Tiling, p=p, weights=weights) -> None:
            fused_moe.run_experts(
                p["x"], p["ids"], weights, p["sorted"], p["block_expert"], w13, w2, 10.0,
                tiling, None,
            )  # fmt: skip

        outs = {}
        for name, tiling in variants.items():
            run(tiling)  # compile
            slots = fused_moe.run_experts(
                p["x"], p["ids"], weights, p["sorted"], p["block_expert"], w13, w2, 10.0,
                tiling, None,
            )  # fmt: skip
            outs[name] = slots.slots.clone()
        same = {n: bool(torch.equal(o, outs["default"])) for n, o in outs.items()}
        times: dict[str, list[float]] = {n: [] for n in variants}
        for _ in range(args.rounds):
            for name, tiling in variants.items():
                us = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda tiling=tiling: run(tiling), rep=30, return_mode="median"
                )
                times[name].append(round(us, 2))
        nbytes = p["hit"] * 3 * INTER * 4096 * 2  # the hit experts' gate, up and down weights
        print(f"== T={t} ({p['hit']} of {E} experts, {nbytes / 1e6:.0f} MB)", flush=True)
        for name, us in times.items():
            best = min(us)
            print(f"  {name:24s} {us} us  best {nbytes / best / 1e6:.2f} TB/s"
                  f"  bitwise equal: {same[name]}", flush=True)  # fmt: skip
            tiling = dataclasses.asdict(variants[name])
            records.append({"t": t, "variant": name, "us": us, "bitwise_equal": same[name],
                            "bytes": nbytes, "tiling": tiling})  # fmt: skip
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
