"""Per-op-kind efficiency on the GPU: the planner's calibration input.

For V4-Flash shapes, time with CUDA events (warm-up, median of N) and compare with the
roofline (bytes / measured-ceiling bandwidth, FLOPs / datasheet rate):
  gemm   dense bf16 projections, [T, 4096] x [4096, N] for T in 1..8192
  moe    one expert's gate/up + down at decode token counts (weight-read bound)
  hbm    a device-to-device copy (the bandwidth ceiling)
Writes one JSON list of records {"kind": "op_efficiency", "op_kind", "shape",
"measured_s", "roofline_s", "efficiency", ...}.

    python benchmarks/h200_ops.py --output $OUT/h200_ops.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch

from bench_timing import events_ms

PEAK_BF16 = 989e12  # H200 SXM datasheet, dense
PEAK_HBM = 4.8e12  # H200 SXM datasheet


def cuda_time(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median seconds of ``fn`` between CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(events_ms(fn, iters)) / 1e3


def record(kind: str, shape: str, measured: float, flops: float, nbytes: float) -> dict:
    roof = max(flops / PEAK_BF16, nbytes / PEAK_HBM)
    return {
        "kind": "op_efficiency",
        "op_kind": kind,
        "shape": shape,
        "measured_s": measured,
        "roofline_s": roof,
        "efficiency": roof / measured,
        "flops": flops,
        "bytes": nbytes,
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    dev, bf16 = "cuda", torch.bfloat16
    out = []
    n = 1 << 30  # 1 GiB copy
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    out.append(record("hbm", "copy 1GiB", t, 0.0, 2 * n))
    for tokens in (1, 64, 512, 4096, 8192):
        for k, nn in ((4096, 1024), (1024, 32768), (4096, 4096)):
            a = torch.randn(tokens, k, device=dev, dtype=bf16)
            w = torch.randn(nn, k, device=dev, dtype=bf16)
            t = cuda_time(lambda a=a, w=w: torch.nn.functional.linear(a, w))
            nbytes = 2 * (tokens * k + nn * k + tokens * nn)
            out.append(record("gemm", f"T={tokens} K={k} N={nn}", t, 2 * tokens * k * nn, nbytes))
    # one routed expert (V4-Flash: D 4096, I 2048), a few tokens each: weight-read bound
    w13 = torch.randn(64, 4096, 4096, device=dev, dtype=bf16)  # 64 experts' gate+up
    w2 = torch.randn(64, 4096, 2048, device=dev, dtype=bf16)
    for tokens in (1, 8, 32, 128):
        x = torch.randn(64, tokens, 4096, device=dev, dtype=bf16)

        def experts(x=x) -> None:
            h = torch.bmm(x, w13.transpose(1, 2))
            gate, up = h.chunk(2, dim=-1)
            torch.bmm(torch.nn.functional.silu(gate) * up, w2.transpose(1, 2))

        t = cuda_time(experts)
        flops = 64 * 2 * tokens * 4096 * (4096 + 2048)
        nbytes = 2 * (w13.numel() + w2.numel()) + 2 * 64 * tokens * (4096 * 3 + 4096)
        out.append(record("moe", f"64 experts x {tokens} tokens", t, flops, nbytes))
    for r in out:
        print(
            f"{r['op_kind']:5s} {r['shape']:28s} {r['measured_s'] * 1e6:9.1f} us "
            f"eff {100 * r['efficiency']:5.1f}%"
        )
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
