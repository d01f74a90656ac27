"""Session 40: the routed experts' two GEMMs as CUTLASS's grouped GEMM (``F.grouped_mm``,
today's prefill path) against cuBLAS's batched GEMM (``torch.bmm``) over rows padded to the
largest expert's count, and a dense GEMM of the same FLOPs as the ceiling. V4-Flash shapes:
E = 64, D = 4096, I = 2048, k routed picks a token (uniform random routing, as bench forward's
random weights give). Prints one JSON line a case; --output writes them all."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def timed(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def case(tokens: int, k: int, experts: int = 64, d: int = 4096, inter: int = 2048) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(tokens, experts, device=dev, generator=g).topk(k, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    offs = counts.cumsum(0).to(torch.int32)
    rows_n = tokens * k
    rows = torch.randn(rows_n, d, device=dev, dtype=torch.bfloat16)
    act = torch.randn(rows_n, inter, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, d, device=dev, dtype=torch.bfloat16) / 64
    w2 = torch.randn(experts, d, inter, device=dev, dtype=torch.bfloat16) / 64
    w13_kn, w2_kn = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    flops_13 = 2 * rows_n * d * 2 * inter
    flops_2 = 2 * rows_n * inter * d
    out = {"tokens": tokens, "k": k, "max_count": int(counts.max()), "mean": rows_n / experts}
    ms = {}
    ms["grouped_13"] = timed(lambda: F.grouped_mm(rows, w13.transpose(1, 2), offs=offs))
    ms["grouped_2"] = timed(lambda: F.grouped_mm(act, w2.transpose(1, 2), offs=offs))
    ms["grouped_kn_13"] = timed(lambda: F.grouped_mm(rows, w13_kn, offs=offs))
    ms["grouped_kn_2"] = timed(lambda: F.grouped_mm(act, w2_kn, offs=offs))
    for pad in (64, 128):
        m = -(-int(counts.max()) // pad) * pad
        rows_p = torch.randn(experts, m, d, device=dev, dtype=torch.bfloat16)
        act_p = torch.randn(experts, m, inter, device=dev, dtype=torch.bfloat16)
        ms[f"bmm{pad}_13"] = timed(lambda a=rows_p: torch.bmm(a, w13.transpose(1, 2)))
        ms[f"bmm{pad}_2"] = timed(lambda a=act_p: torch.bmm(a, w2.transpose(1, 2)))
        out[f"bmm{pad}_rows"] = m
    dense_w13, dense_w2 = w13[0], w2[0]
    ms["dense_13"] = timed(lambda: F.linear(rows, dense_w13))
    ms["dense_2"] = timed(lambda: F.linear(act, dense_w2))
    out["ms"] = ms
    out["tflops"] = {
        key: round((flops_13 if key.endswith("13") else flops_2) / (v * 1e-3) / 1e12, 1)
        for key, v in ms.items()
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    args = parser.parse_args()
    results = []
    for tokens, k in ((8192, 5), (8192, 6), (2048, 5), (2048, 6)):
        r = case(tokens, k)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
