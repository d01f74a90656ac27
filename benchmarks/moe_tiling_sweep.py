"""The fused MoE's two expert kernels timed one by one over a grid of launch shapes, at the
decode batches (V4-Flash sizes: E=64 + 1 shared expert, k=6 + 1, D=4096, I=2048, bf16).

For each T the align runs once with the default block_m; then ``moe_gate_up_kernel`` and
``moe_down_kernel`` run alone in a CUDA graph (``do_bench_cudagraph``) at every (BLOCK_N,
BLOCK_K, warps, stages) whose shared memory fits. Each row: the kernel, T, the shape, the
time, the hit experts' weight bytes over the time (TB/s) and the fraction of 4.8 TB/s; the
default tiling's row is marked. ``--block-m`` overrides the default rows per block (the align
runs with it), e.g. 16-row blocks at T = 256 where the default takes 32; h is bf16, as the
op stores it (session 24 compared the layouts this replaced: 2026-12-04-h200-s24.md);
``--tile-fastest 0 1`` both orders of
the down kernel's grid (``fused_moe.Tiling.down_tile_fastest``). Compilation goes
first, in ``--jobs`` processes (the Triton cache on disk is shared), so the timing loop only
loads kernels.

    python3 benchmarks/moe_tiling_sweep.py --tokens 1 64 --output $OUT/moe_tiling.json
    python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 64 --kernels down
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing as mp

import torch
import triton
import triton.testing

from rackserve.ops.triton import fused_moe
from rackserve.ops.triton.fused_moe_kernels import (
    moe_down_kernel,
    moe_gate_up_kernel,
)

E, K, D, INTER = 65, 7, 4096, 2048  # the shared expert folded in as expert 64
HBM = 4.8e12
SMEM = 220 * 1024


def _shapes(kernel: str, bm: int) -> list[tuple[int, int, int, int]]:
    out = []
    widths = (16, 32, 64, 128) + ((256,) if kernel == "down" and bm > 16 else ())
    for bn, bk, warps, stages in itertools.product(widths, (64, 128, 256), (4, 8),
                                                   (3, 4, 6)):  # fmt: skip
        w_bytes = bk * bn * 2 * (2 if kernel == "gate_up" else 1)
        a_bytes = bm * bk * 2
        if stages * (w_bytes + a_bytes) > SMEM or bn * bk // (32 * warps) < 8:
            continue
        out.append((bn, bk, warps, stages))
    return out


def _problem(t: int, device: str, bm: int | None = None) -> dict:
    g = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, D, generator=g, device=device).bfloat16()
    routed = torch.rand(t, E - 1, generator=g, device=device).argsort(dim=-1)[:, : K - 1]
    ids = torch.cat([routed, torch.full((t, 1), E - 1, device=device)], 1).int().contiguous()
    weights = torch.rand(t * K, generator=g, device=device)
    base = fused_moe.default_tiling(t, K, E, INTER, torch.device(device))
    if bm is not None and bm != base.block_m:
        base = dataclasses.replace(base, block_m=bm)
    sorted_ids, block_expert = fused_moe.moe_align(ids, E, base.block_m)
    nb = block_expert.shape[0]
    return {
        "t": t, "x": x, "ids": ids, "weights": weights, "base": base,
        "sorted": sorted_ids, "block_expert": block_expert,
        "h": torch.zeros(nb * base.block_m, INTER, device=device, dtype=torch.bfloat16),
        "slots": torch.empty(t * K, D, device=device),
        "hit": len(set(ids.view(-1).tolist())),
    }  # fmt: skip


def _problem_bm(t: int, bm: int) -> int:
    """The rows per block of case (t, bm): bm, or the default tiling's when bm is 0."""
    return bm or fused_moe.default_tiling(t, K, E, INTER, torch.device("cuda")).block_m


def _weights(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(E, 2 * INTER, D, device=device, dtype=torch.bfloat16) / D**0.5
    w2 = torch.randn(E, D, INTER, device=device, dtype=torch.bfloat16) / INTER**0.5
    return w13, w2


def _launch(kernel: str, p: dict, w13, w2, shape, warmup: bool = False,
            tile_fastest: bool = False):  # fmt: skip
    bn, bk, warps, stages = shape
    bm = p["base"].block_m
    nb = p["block_expert"].shape[0]
    t = p["t"]
    if kernel == "gate_up":
        fn, n = moe_gate_up_kernel, INTER
        args = (p["x"], w13, p["h"], p["sorted"], p["block_expert"], t * K, K, D, INTER, E, 10.0,
                p["x"].stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
                p["h"].stride(0))  # fmt: skip
    else:
        fn, n = moe_down_kernel, D
        args = (p["h"], w2, p["weights"], p["slots"], p["sorted"], p["block_expert"], t * K, D,
                INTER, E, p["h"].stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
                p["slots"].stride(0))  # fmt: skip
    extra = {}
    grid = (nb, triton.cdiv(n, bn))
    if kernel == "down":  # fused_moe.Tiling.down_tile_fastest: the grid (tiles, blocks)
        extra = {"SKIP_PAD_ROWS": bm == 16, "TILE_FASTEST": tile_fastest}
        grid = grid[::-1] if tile_fastest else grid
    kw = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, FP32_DOT=False, num_warps=warps, PDL=False,
              num_stages=stages, **extra)  # fmt: skip
    if warmup:
        fn.warmup(*args, grid=grid, **kw)
    else:
        fn[grid](*args, **kw)


def _compile(jobs: list) -> int:
    """Worker: compile (no launch) each (kernel, t, shape); small stand-in weights suffice
    (the compile key is dtypes, alignment and the ints)."""
    torch.cuda.set_device(0)
    w13 = torch.empty(E, 2 * INTER, D, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(E, D, INTER, device="cuda", dtype=torch.bfloat16)
    problems: dict[tuple[int, int], dict] = {}
    done = 0
    for kernel, t, bm, shape, fast in jobs:
        if (t, bm) not in problems:
            problems[t, bm] = _problem(t, "cuda", bm)
        try:
            _launch(kernel, problems[t, bm], w13, w2, shape, True, fast)
            done += 1
        except Exception:
            pass
    return done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--kernels", nargs="+", default=["gate_up", "down"])
    ap.add_argument("--block-m", type=int, nargs="+", default=[0], help="0: the default")
    ap.add_argument("--tile-fastest", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="1: the down kernel's grid as (n-tiles, blocks)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    cases = [(t, _problem_bm(t, bm)) for t in args.tokens for bm in args.block_m]

    def orders(kernel: str) -> list[bool]:
        """The down kernel's grid orders to time (tile_fastest); one for gate-up."""
        return [bool(f) for f in args.tile_fastest] if kernel == "down" else [False]

    jobs = [(k, t, bm, s, f) for k in args.kernels for t, bm in cases
            for f in orders(k) for s in _shapes(k, bm)]  # fmt: skip
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        compiled = sum(pool.map(_compile, [jobs[i :: args.jobs] for i in range(args.jobs)]))
    print(f"compiled {compiled} of {len(jobs)}", flush=True)
    w13, w2 = _weights("cuda")
    records = []
    for t, bm in cases:
        p = _problem(t, "cuda", bm)
        for kernel in args.kernels:
            # the default's gate-up output feeds down, as in the op
            base = p["base"]
            default = (
                (base.gate_up_block_n, base.gate_up_block_k, base.gate_up_warps,
                 base.gate_up_stages) if kernel == "gate_up"
                else (base.down_block_n, base.down_block_k, base.down_warps, base.down_stages)
            )  # fmt: skip
            default_order = kernel == "down" and base.down_tile_fastest
            _launch("gate_up", p, w13, w2, (base.gate_up_block_n, base.gate_up_block_k,
                    base.gate_up_warps, base.gate_up_stages))  # fmt: skip
            per_expert = 2 * INTER * D * 2 if kernel == "gate_up" else D * INTER * 2
            nbytes = p["hit"] * per_expert
            rows = []
            variants = [(f, s) for f in orders(kernel) for s in _shapes(kernel, bm)]
            for fast, shape in variants:
                try:
                    us = 1e3 * triton.testing.do_bench_cudagraph(
                        lambda s=shape, k=kernel, q=p, f=fast: _launch(k, q, w13, w2, s, False, f),
                        rep=20, return_mode="median",
                    )  # fmt: skip
                except Exception as e:  # a shape this Triton cannot compile
                    rows.append({"shape": shape, "tile_fastest": fast, "error": str(e)[:120]})
                    continue
                rows.append({
                    "kernel": kernel, "t": t, "block_m": bm, "shape": shape,
                    "tile_fastest": fast,
                    "us": round(us, 2),
                    "tb_per_s": round(nbytes / us / 1e6, 3),
                    "of_hbm": round(nbytes / us / 1e6 / (HBM / 1e12), 3),
                    "default": shape == default and bm == _problem_bm(t, 0)
                    and fast == default_order,
                })  # fmt: skip
            ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
            records += rows
            best = ok[:5]
            dflt = [r for r in ok if r["default"]]
            print(f"== {kernel} T={t} BM={bm} ({p['hit']} experts, "
                  f"{nbytes / 1e6:.0f} MB)")  # fmt: skip
            for r in dflt + best:
                mark = "default" if r["default"] else ""
                mark += " tile-fastest" if r["tile_fastest"] else ""
                print(f"  {r['shape']} {r['us']:8.2f} us {r['tb_per_s']:.2f} TB/s {mark}")
    with open(args.output, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
