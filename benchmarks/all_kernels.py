"""Every kernel microbenchmark in one run (GPU): each ``benchmarks/*_bench.py`` module that
has a ``run(device=...)`` returning records, plus the router and window-compression kernels
(timed here), written to one JSON file and summarised as a table.

    python3 benchmarks/all_kernels.py --output $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import triton.testing

from rackserve.ops import reference

HBM = 4.8e12


def _bench(fn) -> float:
    """Median microseconds inside a CUDA graph (what decode sees)."""
    return triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3


def _route_records() -> list[dict]:
    from rackserve.ops.triton.route import route

    out = []
    d, e, k = 4096, 64, 6
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(e, d, generator=g, device="cuda") / 64).bfloat16()
    bias = 0.1 * torch.randn(e, generator=g, device="cuda")
    for t in (1, 64, 256, 8192):
        x = torch.randn(t, d, generator=g, device="cuda").bfloat16()
        ids = torch.zeros(t, dtype=torch.int64, device="cuda")
        args = (x, w, bias, None, ids, k, "sqrtsoftplus", 1.5)
        nbytes = x.numel() * 2 + w.numel() * 2 + t * k * 12
        for impl, fn in (("triton", route), ("reference", reference.route)):
            us = _bench(lambda fn=fn, args=args: fn(*args))
            out.append(
                {
                    "op": "route",
                    "impl": impl,
                    "T": t,
                    "bytes": nbytes,
                    "us": us,
                    "fraction_of_hbm": nbytes / HBM / (us * 1e-6),
                }
            )
    return out


def _compress_records() -> list[dict]:
    from rackserve.ops.triton.compress import compress_pool

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    for name, ratio, overlap, width in (("csa", 4, True, 512), ("hca", 128, False, 512)):
        row = 2 * width if overlap else width
        span = 2 * ratio if overlap else ratio
        for n in (1, 64, 2048):
            slots = n * span * 2
            state = torch.randn(slots, 2 * row, generator=g, device="cuda").bfloat16()
            src = torch.randperm(slots, device="cuda")[: n * span].view(n, span)
            ape = torch.randn(ratio, row, generator=g, device="cuda")
            nw = torch.ones(width, device="cuda")
            pos = torch.arange(n, device="cuda") * ratio
            args = (state, src, None, 0, ape, nw, 1e-6, pos, inv_freq, 1.0)
            nbytes = n * span * 2 * row * 2 + n * width * 2
            for impl, fn in (("triton", compress_pool), ("reference", reference.compress_pool)):
                us = _bench(lambda fn=fn, args=args: fn(*args))
                out.append(
                    {
                        "op": f"compress_{name}",
                        "impl": impl,
                        "T": n,
                        "bytes": nbytes,
                        "us": us,
                        "fraction_of_hbm": nbytes / HBM / (us * 1e-6),
                    }
                )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output", required=True)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    records: dict[str, list] = {"route": [], "compress": []}
    for name, fn in (("route", _route_records), ("compress", _compress_records)):
        try:
            records[name] = fn()
        except Exception:
            traceback.print_exc()
    # each module in its own process: a kernel fault poisons the CUDA context it runs in
    for path in sorted(Path(__file__).parent.glob("*_bench.py")):
        code = (
            f"import json, sys; sys.path.insert(0, {str(path.parent)!r}); "
            f"import {path.stem} as m; print('@@' + json.dumps(m.run(device='cuda'), default=str))"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("@@")]
        if done.returncode or not lines:
            print(f"{path.stem} failed:\n{done.stderr[-3000:]}", flush=True)
            continue
        records[path.stem] = json.loads(lines[-1][2:])
    Path(args.output).write_text(json.dumps(records, indent=1, default=str))
    for name, rows in records.items():
        for r in rows:
            keys = ("op", "impl", "T", "us", "graph_us", "fraction_of_hbm", "fraction_of_roofline")
            print(name, {k: r[k] for k in keys if k in r})


if __name__ == "__main__":
    main()
