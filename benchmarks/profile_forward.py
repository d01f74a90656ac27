"""Where a forward's GPU time goes: torch.profiler over the eager fast path of one batch.

Prints the kernels by total GPU time (name, calls, total, share) and the number of kernel
launches per forward and per decoder layer; writes the table as JSON. A kernel belongs to
the layer whose ``record_function`` range (its GPU span in the trace) holds its start;
the rest (embedding, RoPE tables, hc_head, lm_head) is "outside". As in
``ops/launches.count_layer_launches``, a layer's range holds the next layer's mHC pre.
Usage: python3 benchmarks/profile_forward.py --batch decode:64@4096 [--layers 4 --experts 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_timing import bench_model, eager_step


def layer_launches(model, run) -> tuple[dict[str, int], object]:
    """Kernels per decoder layer of one profiled ``run()``: {"<i>:<kind>": n, ..., "outside":
    n}, and the profiler (for the per-kernel table)."""
    names = [f"{i}:{layer.attn.kind}" for i, layer in enumerate(model.model.layers)]

    def scoped(fn, name):
        def call(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return call

    for layer, name in zip(model.model.layers, names, strict=True):
        layer.run = scoped(layer.run, name)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    finally:
        for layer in model.model.layers:
            del layer.run
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    finally:
        os.remove(path)

    # a kernel's owner: the layer range (CPU side) holding its launch call, found by the
    # correlation id; else the layer's GPU span (gpu_user_annotation) holding its start
    def spans(cat: str) -> list[tuple[float, float, str]]:
        return [
            (e["ts"], e["ts"] + e["dur"], e["name"])
            for e in trace
            if e.get("cat") == cat and e.get("name") in names
        ]

    cpu, gpu = spans("user_annotation"), spans("gpu_user_annotation")
    launch_ts = {
        e["args"]["correlation"]: e["ts"]
        for e in trace
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    counts = Counter({name: 0 for name in names})
    for e in trace:
        if e.get("cat") != "kernel":
            continue
        ts = launch_ts.get(e.get("args", {}).get("correlation"))
        where = (cpu, ts) if ts is not None else (gpu, e["ts"])
        counts[next((n for a, b, n in where[0] if a <= where[1] < b), "outside")] += 1
    return dict(counts), prof


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", action="append", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    model = bench_model(args.layers, args.experts)
    report = {}
    for text in args.batch:
        with torch.inference_mode():
            run, _ = eager_step(model, text)
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            per_layer, prof = layer_launches(model, run)
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name][0] += 1
                totals[e.name][1] += e.device_time_total
        launches = sum(c for c, _ in totals.values())
        busy = sum(t for _, t in totals.values())
        rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
        layers = [n for n in per_layer if n != "outside"]
        print(
            f"== {text}: {launches} kernels, {busy / 1e3:.3f} ms of kernel time; per layer "
            f"(max {max(per_layer[n] for n in layers)}): {per_layer}"
        )
        for name, (calls, t) in rows[: args.top]:
            print(f"{t / 1e3:8.3f} ms {100 * t / busy:5.1f}% {calls:5d}x  {name[:110]}")
        report[text] = {
            "kernels": launches,
            "kernels_per_layer": per_layer,
            "max_kernels_per_layer": max(per_layer[n] for n in layers),
            "kernel_ms": busy / 1e3,
            "top": [{"name": n, "calls": c, "us": t} for n, (c, t) in rows[: args.top]],
        }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
