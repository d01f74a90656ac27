"""Does programmatic dependent launch (PDL) work inside a CUDA graph on this stack, and what
does it save per kernel boundary?

Two chains of ``--kernels`` Triton kernels, each captured in one CUDA graph and replayed:
- ``tiny``: one program reading the previous kernel's 256 floats and writing its own (the
  cost of a boundary alone);
- ``stream``: a weight-streaming kernel (132 programs, ``--mib`` MiB of its own weights per
  kernel, beyond L2 over the chain) whose output also feeds the next kernel, as a decode
  step's GEMV chain does.
Each is timed without PDL, with PDL and ``gdc_wait`` at the top, and (``stream``) with PDL and
the weight loads issued before ``gdc_wait``. The chain's result is checked against the
eager, non-PDL run, so a PDL launch that reads its input too early fails the probe.

    python3 benchmarks/pdl_probe.py --output $OUT/pdl_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _tiny(x_ptr, y_ptr, PDL: tl.constexpr):
    offs = tl.arange(0, 256)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


@triton.jit
def _stream(w_ptr, x_ptr, y_ptr, n_per_prog, PDL: tl.constexpr, EARLY: tl.constexpr):
    """Program p sums its n_per_prog weights times x[0] and adds it to y[p]."""
    pid = tl.program_id(0)
    offs = tl.arange(0, 2048)
    base = w_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([2048], tl.float32)
    if PDL and not EARLY:
        gdc_wait()
    for start in range(0, n_per_prog, 2048):
        acc += tl.load(base + start + offs).to(tl.float32)
    if PDL and EARLY:
        gdc_wait()
    if PDL:
        gdc_launch_dependents()
    x = tl.load(x_ptr + pid)
    tl.store(y_ptr + pid, x + tl.sum(acc) * 1e-6)


def _time_graph(run, iters: int = 50) -> float:
    """Median milliseconds of one replay of the graph that captures ``run``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=64)
    p.add_argument("--mib", type=float, default=2.0)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    n = args.kernels
    record: dict = {"kernels": n, "mib_per_kernel": args.mib}

    bufs = [torch.zeros(256, device="cuda") for _ in range(n + 1)]

    def tiny(pdl: bool):
        def run():
            for i in range(n):
                _tiny[(1,)](bufs[i], bufs[i + 1], PDL=pdl, launch_pdl=pdl)

        return run

    for name, pdl in (("tiny", False), ("tiny_pdl", True)):
        for b in bufs:
            b.zero_()
        ms = _time_graph(tiny(pdl))
        ok = bool((bufs[n] == n).all()) and bool((bufs[n // 2] == n // 2).all())
        record[name] = {"replay_ms": ms, "us_per_kernel": 1e3 * ms / n, "correct": ok}

    progs = 132
    per_prog = int(args.mib * 2**20 / 2 / progs) // 2048 * 2048
    weights = [torch.randn(progs * per_prog, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    acts = [torch.zeros(progs, device="cuda") for _ in range(n + 1)]

    def stream(pdl: bool, early: bool):
        def run():
            for i in range(n):
                _stream[(progs,)](
                    weights[i], acts[i], acts[i + 1], per_prog, PDL=pdl, EARLY=early, launch_pdl=pdl
                )

        return run

    bytes_per_kernel = progs * per_prog * 2
    reference = None
    for name, pdl, early in (
        ("stream", False, False),
        ("stream_pdl", True, False),
        ("stream_pdl_early", True, True),
    ):
        for a in acts:
            a.zero_()
        ms = _time_graph(stream(pdl, early))
        out = acts[n].clone()
        if reference is None:
            reference = out
        record[name] = {
            "replay_ms": ms,
            "us_per_kernel": 1e3 * ms / n,
            "tb_per_s": bytes_per_kernel * n / (ms * 1e-3) / 1e12,
            "correct": bool(torch.allclose(out, reference, rtol=1e-5, atol=1e-5)),
        }
    print(json.dumps(record, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
