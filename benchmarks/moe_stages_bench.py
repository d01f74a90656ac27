"""Where the prefill MoE's time goes: each stage of ``ops/grouped_moe.moe_experts_grouped``
timed alone at V4-Flash expert sizes (E experts, k = 6, D = 4096, I = 2048, bf16, uniform
random routing), next to a dense cuBLAS GEMM of the same FLOPs (what the tensor cores give
one big problem) and ``F.grouped_mm`` with the weights stored K-major ([E, K, N]) instead
of transposed views.

Stages: routing metadata (argsort, counts; ``sort_counting``: the counting sort that
replaced them), gather (``index_select`` of the sorted rows),
gate-up grouped GEMM, SwiGLU, down grouped GEMM, unpermute. Each record: stage, T, the
median time (``triton.testing.do_bench``, L2 flushed, launch included) and, for the GEMMs,
TFLOP/s and the share of 989 TFLOP/s. Then the Triton path (``ops/triton/prefill_experts.py``)
over ``TILINGS``: its align, gate-up and down GEMMs alone and the whole op, with the whole
grouped path beside it and the largest difference between the two outputs.

    python3 benchmarks/moe_stages_bench.py --tokens 2048 8192 --output $OUT/moe_stages.json
"""

# ruff: noqa: B023  (every lambda is timed inside the iteration that binds its names)
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from rackserve.ops.grouped_moe import moe_experts_grouped
from rackserve.ops.triton import prefill_experts as tiled
from rackserve.ops.triton.fused_moe import moe_align
from rackserve.ops.triton.prefill_moe import moe_sort_pairs, moe_unpermute, swiglu_rows

from bench_timing import stamped

PEAK_TFLOPS = 989.0
# (block_m, gate-up BN (per half), BK, warps, stages, down BN, BK, warps, stages)
TILINGS = [
    (128, 128, 64, 8, 4, 128, 64, 8, 4),
    (128, 128, 64, 8, 3, 256, 64, 8, 3),
    (128, 64, 64, 4, 4, 128, 64, 4, 4),
    (64, 128, 64, 4, 4, 256, 64, 8, 4),
    (128, 128, 64, 8, 4, 256, 64, 8, 4),
    (128, 64, 128, 8, 3, 128, 128, 8, 3),
]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median")


def run(tokens=(2048, 8192), experts: int = 64, k: int = 6, dim: int = 4096, inter: int = 2048):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    w13 = torch.randn(experts, 2 * inter, dim, device=device, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(experts, dim, inter, device=device, dtype=dt, generator=gen) * 0.02
    w13_kn, w2_kn = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    records = []
    for t in tokens:
        x = torch.randn(t, dim, device=device, dtype=dt, generator=gen)
        ids = torch.rand(t, experts, device=device, generator=gen).topk(k, dim=1).indices
        weights = torch.rand(t, k, device=device, generator=gen)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=device))
        counts = torch.bincount(flat, minlength=experts).to(torch.int32)
        offs = counts.cumsum(0, dtype=torch.int32)
        rows = x.index_select(0, order // k)
        h = F.grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        act = swiglu_rows(h, 10.0)
        y = F.grouped_mm(act, w2.transpose(1, 2), offs=offs)
        n = t * k
        dense_a = torch.randn(n, dim, device=device, dtype=dt, generator=gen)
        dense_b = torch.randn(dim, 2 * inter, device=device, dtype=dt, generator=gen)

        def meta():
            o = torch.argsort(flat, stable=True)
            torch.empty_like(o).scatter_(0, o, torch.arange(t * k, device=device))
            torch.bincount(flat, minlength=experts).cumsum(0, dtype=torch.int32)

        flops_13, flops_2 = 2 * n * dim * 2 * inter, 2 * n * inter * dim
        stages = [
            ("metadata", meta, 0),
            ("sort_counting", lambda: moe_sort_pairs(ids, experts), 0),
            ("gather", lambda: x.index_select(0, order // k), 0),
            ("gate_up", lambda: F.grouped_mm(rows, w13.transpose(1, 2), offs=offs), flops_13),
            ("gate_up_kmajor", lambda: F.grouped_mm(rows, w13_kn, offs=offs), flops_13),
            ("swiglu", lambda: swiglu_rows(h, 10.0), 0),
            ("down", lambda: F.grouped_mm(act, w2.transpose(1, 2), offs=offs), flops_2),
            ("down_kmajor", lambda: F.grouped_mm(act, w2_kn, offs=offs), flops_2),
            ("unpermute", lambda: moe_unpermute(y, inverse.view(t, k), weights), 0),
            ("dense_gate_up_shape", lambda: dense_a @ dense_b, flops_13),
        ]
        for name, fn, flops in stages:
            fn()
            ms = _ms(fn)
            r = {"stage": name, "tokens": t, "ms": ms}
            if flops:
                r["tflops"] = flops / ms / 1e9
                r["share_of_peak"] = r["tflops"] / PEAK_TFLOPS
            records.append(r)
            extra = f"  {r['tflops']:.0f} TF/s ({r['share_of_peak']:.1%})" if flops else ""
            print(f"T={t:5d} {name:20s} {ms * 1e3:9.1f} us{extra}", flush=True)
        records += _tiled(x, ids, weights, w13, w2, flops_13, flops_2)
    return stamped(records, device)


def _tiled(x, ids, weights, w13, w2, flops_13, flops_2) -> list[dict]:
    t, k = ids.shape
    whole = moe_experts_grouped(x, ids, weights, w13, w2, 10.0)
    grouped_ms = _ms(lambda: moe_experts_grouped(x, ids, weights, w13, w2, 10.0))
    print(f"T={t:5d} grouped path, whole  {grouped_ms * 1e3:9.1f} us", flush=True)
    records = [{"stage": "grouped_whole", "tokens": t, "ms": grouped_ms}]
    for shape in TILINGS:
        tiling = tiled.Tiling(*shape)
        try:
            sorted_ids, block_expert = moe_align(ids, w13.shape[0], tiling.block_m)
            h = tiled.gate_up(x, w13, sorted_ids, block_expert, k, 10.0, tiling)
            tiled.down(h, w2, sorted_ids, block_expert, t * k, tiling)
            out = tiled.moe_experts_tiled(x, ids, weights, w13, w2, 10.0, tiling)
        except Exception as e:  # a tiling past the shared memory: say so, go on
            print(f"T={t:5d} tiled {shape}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        r = {
            "stage": "tiled",
            "tokens": t,
            "tiling": shape,
            "align_ms": _ms(lambda: moe_align(ids, w13.shape[0], tiling.block_m)),
            "gate_up_ms": _ms(
                lambda: tiled.gate_up(x, w13, sorted_ids, block_expert, k, 10.0, tiling)
            ),
            "down_ms": _ms(lambda: tiled.down(h, w2, sorted_ids, block_expert, t * k, tiling)),
            "ms": _ms(lambda: tiled.moe_experts_tiled(x, ids, weights, w13, w2, 10.0, tiling)),
            "max_abs_diff_vs_grouped": (out.float() - whole.float()).abs().max().item(),
        }
        r["gate_up_tflops"] = flops_13 / r["gate_up_ms"] / 1e9
        r["down_tflops"] = flops_2 / r["down_ms"] / 1e9
        records.append(r)
        print(
            f"T={t:5d} tiled {shape}: align {r['align_ms'] * 1e3:.1f} gate_up "
            f"{r['gate_up_ms'] * 1e3:.1f} ({r['gate_up_tflops']:.0f} TF/s) down "
            f"{r['down_ms'] * 1e3:.1f} ({r['down_tflops']:.0f} TF/s) whole {r['ms'] * 1e3:.1f} "
            f"us, max |diff| {r['max_abs_diff_vs_grouped']:.3g}",
            flush=True,
        )
    return records


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--output", default=None)
    a = p.parse_args()
    records = run(tuple(a.tokens), a.experts)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
