"""Times the sparse prefill attention kernel (``ops/triton/prefill_attn.py``) against the
decode kernel (``sparse_attn.py``) on prefill-shaped inputs, on the GPU.

V4-Flash sizes: H = 64 heads, Dh = 512 (64 rope dims), Wa = 128 window rows, bf16. One
request of S new tokens after C cached ones (S, C) in {(2048, 0), (8192, 0), (8192, 65536)}:
query at position p sees window positions max(0, p-127)..p and, per layer kind,
- HCA: entries 0..(p+1)//128 - 1 of the request (Wb = (C + S) / 128, a valid prefix);
- CSA: the indexer's top-512 of the (p+1)//4 visible entries (Wb = 512, a valid prefix).
Rows are scattered over the caches (paged slots). Each record: impl ("prefill" |
"prefill:<variant>" | "decode"), case, S, C, kind, the useful FLOPs (4 H Dh x valid rows,
QK and PV), the gathered bytes (valid rows x Dh x 2 + q + out), the do_bench median time,
the fraction of 989 TFLOP/s, and max |out - decode kernel's out|.

The wgmma kernel (``prefill_attn_wgmma.py``, Gluon) is timed beside them ("wgmma" and
"wgmma:<variant>"), with its fraction of outputs outside the bf16 rule.

``run_indexer`` times the prefill indexer (``prefill_indexer.py``, query tiles sharing key
tiles) against the decode indexer (``indexer.py``) on one request's S queries over its
(C + S) / 4 CSA entries (64 heads x 128, top-512, bf16).

``run_phases`` (``--phases``) splits the wgmma kernel's time a query by what it does: the q
norm and RoPE on load, the output's inverse RoPE, the rows (``phase_inputs``).

``run_moe`` (``--moe-only``) times the grouped-GEMM MoE (``ops/grouped_moe.py``: T tokens,
64 experts, top-6, D 4096, I 2048) whole, and its elementwise steps at k = 5 routed picks
(``ops/triton/prefill_moe.py``: ``moe_permute``, ``swiglu_rows``, ``moe_unpermute`` with and
without the shared expert's output as ``extra``) in their default tilings and the
candidates (``PERMUTE_TILINGS``, ``SWIGLU_TILINGS``, ``UNPERMUTE_TILINGS``) at 8192 tokens,
each with its GB/s and fraction of a 4.24 TB/s copy, beside the torch chains replaced.

    from benchmarks.prefill_bench import run; records = run()   # one-call GPU script
    python benchmarks/prefill_bench.py --output $OUT/prefill_bench.json
    python benchmarks/prefill_bench.py --moe-only --output $OUT/prefill_moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
from collections.abc import Callable

import torch
import triton.testing

from rackserve.ops import reference
from rackserve.ops.grouped_moe import moe_experts_grouped
from rackserve.ops.triton import (
    indexer,
    prefill_attn,
    prefill_attn_wgmma,
    prefill_indexer,
    prefill_moe,
    sparse_attn,
)

from bench_timing import stamped

H, DH, ROPE, WA, TOPK = 64, 512, 64, 128, 512
CASES = ((2048, 0), (8192, 0), (8192, 65536))  # (new tokens S, cached tokens C)
PEAK_FLOPS = 989e12
COPY_BYTES_PER_S = 4.24e12  # H200 device-to-device copy: the elementwise MoE ops' roofline
MOE_ROUTED = 5  # routed picks a token of the elementwise MoE ops (the shared expert apart)


def _inputs(s: int, cached: int, kind: str, device: str) -> tuple:
    """``paged_sparse_attention`` arguments of one request's S queries (module docstring)."""
    g = torch.Generator(device=device).manual_seed(s + cached + len(kind))
    total = cached + s
    pos = torch.arange(cached, total, device=device)
    window = pos[:, None] - torch.arange(WA - 1, -1, -1, device=device)  # [S, Wa]
    page_a = torch.randperm(total, generator=g, device=device)  # position -> swa slot
    slots_a = page_a[window.clamp(min=0)]
    visible = (pos + 1) // (128 if kind == "hca" else 4)
    if kind == "hca":
        wb = total // 128
        slots_b = torch.randperm(wb, generator=g, device=device).expand(s, wb)
        picked = torch.arange(wb, device=device)[None, :] < visible[:, None]
    else:  # top-512 of the visible entries: random distinct entries, a valid prefix
        num_entries = total // 4
        wb = min(TOPK, num_entries)
        keys = torch.rand(s, num_entries, generator=g, device=device)
        slots_b = keys.topk(wb, dim=1).indices  # any distinct entries (rows by slot)
        picked = torch.arange(wb, device=device)[None, :] < visible[:, None].clamp(max=wb)
    width_b = DH + (128 if kind == "csa" else 0)
    kv_a = torch.randn(total, DH, generator=g, device=device).bfloat16()
    kv_b = torch.randn(max(total // 4, 1), width_b, generator=g, device=device).bfloat16()
    valid = torch.cat([window >= 0, picked], dim=1)
    q = (2 * torch.randn(s, H, DH, generator=g, device=device)).bfloat16()
    sinks = torch.randn(H, generator=g, device=device)
    angle = torch.rand(s, ROPE // 2, generator=g, device=device) * 6.3
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    return q, kv_a, slots_a, kv_b, slots_b.contiguous(), valid, sinks, DH**-0.5, cos, sin


def variants(device: torch.device) -> dict[str, prefill_attn.PrefillTiling]:
    """Tilings around the default, to pick the heuristic from the first GPU run (ptxas
    spills noted where sm_90 has them at Dh 512)."""
    base = prefill_attn.default_tiling(H, DH, torch.bfloat16, device)
    rep = dataclasses.replace
    return {
        "dv2": rep(base, num_dv=2),  # the default until 2026-12-02: QK repeated per half
        "rows": rep(base, pv="rows"),  # bf16 p: outside the bf16 rule on 0.04-0.39%
        "stages2": rep(base, num_stages=2),
        "bn16_stages4": rep(base, block_n=16, num_stages=4),
        "bn64_stages2": rep(base, block_n=64, num_stages=2),
        # one warpgroup per program, the output columns in two programs (QK repeated): two
        # programs per SM, no exchange between warpgroups inside a tile
        "dv2_w4": rep(base, num_dv=2, num_warps=4, num_stages=2),
        "dv2_w4_rows": rep(base, num_dv=2, num_warps=4, num_stages=2, pv="rows"),
        "dv2_w4_bn64": rep(base, num_dv=2, num_warps=4, block_n=64, num_stages=2),
        "rows_bn64": rep(base, block_n=64, num_stages=2, pv="rows"),
        "rows_bn16_stages4": rep(base, block_n=16, num_stages=4, pv="rows"),
        "rows_bn32": rep(base, block_n=32, num_stages=2, pv="rows"),
        "rows_bn32_stages3": rep(base, block_n=32, num_stages=3, pv="rows"),
        # from 5 stages the pipeliner keeps later tiles' gathers in flight during a tile's
        # dots (async_wait num > 0 in the sm_90 TTGIR); 2-4 stages wait for each tile's rows
        # right after issuing them
        "rows_stages5": rep(base, num_stages=5, pv="rows"),  # 164 KB of shared memory
        "rows_stages6": rep(base, num_stages=6, pv="rows"),
        "rows_bn16_stages5": rep(base, block_n=16, num_stages=5, pv="rows"),  # 115 KB
        "rows_bn16_stages7": rep(base, block_n=16, num_stages=7, pv="rows"),  # 131 KB
        # two programs per SM (112 KB of shared memory and 128 x 255 registers each): the
        # output columns in two programs of one warpgroup, QK repeated in each
        "dv2_w4_bn16": rep(base, num_dv=2, num_warps=4, block_n=16, num_stages=2),
        "dv2_w4_bn16_stages3": rep(base, num_dv=2, num_warps=4, block_n=16, num_stages=3),
    }


def wgmma_variants() -> dict[str, prefill_attn_wgmma.WgmmaTiling]:
    """The Gluon wgmma kernel's tilings: rows per tile and gather-ring depth (SMEM: q 64 KB
    + stages x rows x 1 KB + p)."""
    tile = prefill_attn_wgmma.WgmmaTiling
    # bn64_s2_p1: 64-row tiles read q from shared memory half as often a row (QK's wgmma N
    # of 32 a warpgroup); 2 slots, one p buffer (200 KB)
    return {
        "bn32_s4_p2": tile(32, 4, p_buffers=2),  # the tiling below WIDE_MIN_ROWS rows
        "bn32_s3_p1": tile(32, 3, p_buffers=1),
        "bn16_s6": tile(16, 6),
        "bn64_s2_p1": tile(64, 2, p_buffers=1),
    }


def outside_bf16_rule(out: torch.Tensor, args: tuple, num: int = 256) -> float:
    """Fraction of outputs outside the bf16 rule of the kernel tests (|out - ref_fp32| <=
    2 |ref_bf16 - ref_fp32| + 1e-3) over the last ``num`` queries (the most rows)."""
    q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale, cos, sin = args
    sub = slice(q.shape[0] - num, None)
    part = (slots_a[sub], kv_b, slots_b[sub], valid[sub], sinks, scale, cos[sub], sin[sub])
    ref16 = reference.paged_sparse_attention(q[sub], kv_a, *part).float()
    part32 = (slots_a[sub], kv_b.float(), *part[2:])
    ref32 = reference.paged_sparse_attention(q[sub].float(), kv_a.float(), *part32)
    err = (out[sub].float() - ref32).abs()
    return (err > 2 * (ref16 - ref32).abs() + 1e-3).float().mean().item()


def run(device: str = "cuda", cases=CASES, sweep: bool = True) -> list[dict]:
    """Every record of this module: attention, indexer and MoE (``all_kernels.py`` calls
    this), each stamped; a part that fails leaves an error record."""
    records = run_attention(device, cases, sweep)
    parts = (
        ("indexer", lambda: run_indexer(device, cases)),
        ("moe", lambda: run_moe(device, sweep=sweep)),
    )
    for name, part in parts:
        try:
            records += part()
        except Exception as e:  # out of memory, a kernel that does not compile
            records.append({"kind": f"prefill_bench_{name}", "error": repr(e)[:300]})
    return records


def run_attention(
    device: str = "cuda", cases=CASES, sweep: bool = True, only: list[str] | None = None
) -> list[dict]:
    """Attention records (see the module docstring); ``only``: these variants (and the
    default, the decode kernel), each with its fraction outside the bf16 rule."""
    dev = torch.device(device)
    records = []
    for s, cached in cases:
        for kind in ("hca", "csa"):
            args = _inputs(s, cached, kind, device)
            rows = int(args[5].sum())
            flops = 4 * H * DH * rows
            nbytes = rows * DH * 2 + 2 * s * H * DH * 2
            expected = sparse_attn.paged_sparse_attention(*args).float()
            tilings = {"prefill": prefill_attn.default_tiling(H, DH, torch.bfloat16, dev)}
            if sweep:
                tilings |= {
                    f"prefill:{k}": v for k, v in variants(dev).items() if not only or k in only
                }
            impls: dict[str, Callable[[], torch.Tensor]] = {
                name: lambda t=t, a=args: prefill_attn.paged_sparse_attention(*a, tiling=t)
                for name, t in tilings.items()
            }
            impls["decode"] = lambda a=args: sparse_attn.paged_sparse_attention(*a)
            wgmma = {"wgmma": None}
            if sweep:
                wgmma |= {
                    f"wgmma:{k}": v for k, v in wgmma_variants().items() if not only or k in only
                }
            for name, t in wgmma.items():
                impls[name] = lambda t=t, a=args: prefill_attn_wgmma.paged_sparse_attention(
                    *a, tiling=t
                )
            base = {"kind": "prefill_bench", "op": f"prefill_attention_{kind}", "layer": kind}
            base |= {"queries": s, "T": s, "cached": cached}
            for impl, fn in impls.items():
                try:
                    got = fn()
                    err = (got.float() - expected).abs().max().item()
                    checked = only or impl.startswith("wgmma")
                    rule = outside_bf16_rule(got, args) if checked else None
                    plain = _plain_us(fn)
                except Exception as e:  # a variant that does not compile (smem, registers)
                    records.append(base | {"impl": impl, "error": repr(e)[:300]})
                    continue
                records.append(
                    base
                    | {
                        "impl": impl,
                        "valid_rows": rows,
                        "bytes": nbytes,
                        "flops": flops,
                        "time_us": plain,
                        "us": plain,
                        "tflop_per_s": flops / plain / 1e6,
                        "peak_fraction": flops / PEAK_FLOPS / (plain * 1e-6),
                        "max_abs_err_vs_decode": err,
                        "outside_bf16_rule": rule,
                    }
                )
    return stamped(records, dev)


def phase_inputs(args: tuple, phase: str) -> tuple[tuple, dict]:
    """``paged_sparse_attention`` arguments (and keywords) of one phase case of
    ``run_phases``: "model" (q raw: its norm and RoPE on the kernel's load, the output's
    inverse RoPE), "no_qnorm" (q normed and rotated before), "no_rope" (no RoPE at all: no
    epilogue rotation), "rows_<n>" ("no_rope" with each query's last n window rows valid
    only, no compressed rows: the per-query cost that does not scale with rows)."""
    q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale = args[:8]
    if phase == "model":
        return args, {"q_norm_eps": 1e-6}
    if phase == "no_qnorm":
        return args, {}
    rope_free = (q, kv_a, slots_a, kv_b, slots_b, valid, sinks, scale, None, None)
    if phase == "no_rope":
        return rope_free, {}
    n = int(phase.removeprefix("rows_"))
    keep = torch.zeros_like(valid)
    keep[:, WA - n : WA] = valid[:, WA - n : WA]
    return (*rope_free[:5], keep, *rope_free[6:]), {}


PHASES = ("model", "no_qnorm", "no_rope", "rows_128", "rows_32", "rows_1")


def run_phases(device: str = "cuda", s: int = 8192, only: list[str] | None = None) -> list[dict]:
    """The wgmma kernel's time at S queries (HCA and CSA shapes, nothing cached) split by
    what each query does (``phase_inputs``): differences of the phases give the q norm and
    RoPE on load, the output's inverse RoPE, and the per-row cost against the fixed cost a
    query (rows_1: one tile of one valid row). ``us_per_query_sm``: time x SMs / S.
    ``only``: these ``wgmma_variants`` ("default": the default tiling), each phase of each."""
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tilings = {"default": None} | wgmma_variants()
    records = []
    for kind in ("hca", "csa"):
        args = _inputs(s, 0, kind, device)
        for phase, impl in itertools.product(PHASES, only or ["default"]):
            call_args, kwargs = phase_inputs(args, phase)

            def attend(a=call_args, k=kwargs | {"tiling": tilings[impl]}) -> torch.Tensor:
                return prefill_attn_wgmma.paged_sparse_attention(*a, **k)

            us = _plain_us(attend)
            records.append(
                {
                    "kind": "prefill_bench_phases", "layer": kind, "queries": s, "impl": impl,
                    "phase": phase, "valid_rows": int(call_args[5].sum()), "time_us": us,
                    "us_per_query_sm": us * sms / s,
                }
            )  # fmt: skip
    return stamped(records, dev)


def run_indexer(device: str = "cuda", cases=CASES) -> list[dict]:
    """Indexer records: impl ("prefill" | "decode"), S, C, entries, time_us, the FLOPs of
    the visible logits (2 x 64 x 128 per visible (query, entry)), agreement of the picks."""
    dev = torch.device(device)
    hi, di = 64, 128
    records = []
    for s, cached in cases:
        g = torch.Generator(device=device).manual_seed(s + cached)
        total = cached + s
        num_entries = total // 4
        pos = torch.arange(cached, total, device=device)
        num_visible = (pos + 1) // 4
        rows = torch.randperm(2 * num_entries, generator=g, device=device)[:num_entries]
        args = (
            torch.randn(s, hi, di, generator=g, device=device).bfloat16(),
            torch.randn(2 * num_entries, 640, generator=g, device=device).bfloat16()[:, 512:],
            rows.expand(s, num_entries).contiguous(),
            torch.randn(s, hi, generator=g, device=device),
            di**-0.5,
            num_visible,
            min(TOPK, num_entries),
        )
        flops = 2 * hi * di * int(num_visible.clamp(max=num_entries).sum())
        expected = indexer.paged_indexer_topk(*args)
        impls = {
            "prefill": lambda a=args: prefill_indexer.paged_indexer_topk(*a),
            "decode": lambda a=args: indexer.paged_indexer_topk(*a),
        }
        for impl, fn in impls.items():
            same = (fn().sort(dim=1).values == expected.sort(dim=1).values).float().mean()
            us = _plain_us(fn)
            records.append(
                {
                    "kind": "prefill_bench_indexer",
                    "op": "prefill_indexer",
                    "impl": impl,
                    "T": s,
                    "queries": s,
                    "cached": cached,
                    "entries": num_entries,
                    "time_us": us,
                    "us": us,
                    "flops": flops,
                    "peak_fraction": flops / PEAK_FLOPS / (us * 1e-6),
                    "same_picks": same.item(),
                }
            )
    return stamped(records, dev)


def _moe_ops(t: int, sweep: bool, g: torch.Generator, device: str) -> list[tuple]:
    """The elementwise MoE ops at T tokens, k = ``MOE_ROUTED`` (``run_moe``): (op, impl, fn,
    bytes) for each default (``<op>:default``), tiling candidate (``<op>:<name>``, with
    ``sweep``) and torch chain replaced."""
    kr, d, inter = MOE_ROUTED, 4096, 2048
    n = t * kr
    x = torch.randn(t, d, generator=g, device=device).bfloat16()
    h = torch.randn(n, 2 * inter, generator=g, device=device).bfloat16()
    y = torch.randn(n, d, generator=g, device=device).bfloat16()
    shared = torch.randn(t, d, generator=g, device=device).bfloat16()  # the shared expert's
    weights = torch.rand(t, kr, generator=g, device=device)
    order = torch.randperm(n, generator=g, device=device)  # sorted row -> pair
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=device))
    inverse = inverse.view(t, kr).int()

    def old_unpermute(y=y, order=order, weights=weights):
        y = (y * weights.flatten()[order, None]).to(torch.bfloat16)
        unsorted = torch.empty_like(y)
        unsorted[order] = y
        return unsorted.view(t, kr, -1).sum(dim=1)

    def tilings(candidates: dict) -> dict:
        return {"default": None} | (candidates if sweep else {})

    row = 2 * d  # bytes of a bf16 [D] row
    ops = []
    for name, tiling in tilings(prefill_moe.PERMUTE_TILINGS).items():
        fn = functools.partial(prefill_moe.moe_permute, x, inverse, tiling=tiling)
        ops.append(("moe_permute", name, fn, t * row + n * row))
    for name, tiling in tilings(prefill_moe.SWIGLU_TILINGS).items():
        fn = functools.partial(prefill_moe.swiglu_rows, h, 10.0, tiling=tiling)
        ops.append(("swiglu_rows", name, fn, n * 3 * inter * 2))
    chain = functools.partial(reference.swiglu, *h.chunk(2, dim=-1), 10.0)
    ops.append(("swiglu_rows", "torch_chain", chain, n * 3 * inter * 2))
    unpermute = tilings(prefill_moe.UNPERMUTE_TILINGS)
    for op, extra in (("moe_unpermute", None), ("moe_unpermute_extra", shared)):
        for name, tiling in unpermute.items():
            fn = functools.partial(
                prefill_moe.moe_unpermute, y, inverse, weights, extra, tiling=tiling
            )
            ops.append((op, name, fn, n * row + t * row * (2 if extra is None else 3)))
    ops.append(("moe_unpermute", "torch_chain", old_unpermute, n * row + t * row))
    return ops


def run_moe(
    device: str = "cuda",
    tokens: tuple[int, ...] = (2048, 8192),
    sweep: bool = True,
    sweep_tokens: tuple[int, ...] = (8192,),
) -> list[dict]:
    """Grouped MoE records (see the module docstring): op, impl ("<op>:<name>"), tokens,
    time_us; for the whole MoE its FLOPs and fraction of 989 TFLOP/s; for the elementwise
    ops (k = 5 routed picks) bytes, GB/s, fraction of ``COPY_BYTES_PER_S`` and, for a
    tiling, whether the output equals the default's bit for bit. ``sweep``: the tiling
    candidates too, at ``sweep_tokens`` (the default tilings at every T)."""
    dev = torch.device(device)
    e, k, d, inter = 64, 6, 4096, 2048
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, d, generator=g, device=device) / d**0.5).bfloat16()
    w2 = (torch.randn(e, d, inter, generator=g, device=device) / inter**0.5).bfloat16()
    records = []
    for t in tokens:
        base = {"kind": "prefill_bench_moe", "tokens": t, "T": t}
        x = torch.randn(t, d, generator=g, device=device).bfloat16()
        ids = torch.rand(t, e, generator=g, device=device).topk(k, dim=1).indices
        weights = torch.rand(t, k, generator=g, device=device)
        us = _plain_us(lambda x=x, i=ids, w=weights: moe_experts_grouped(x, i, w, w13, w2, 10.0))
        flops = 2 * t * k * 3 * d * inter
        records.append(
            base
            | {"op": "grouped_moe", "impl": "grouped_moe", "k": k, "time_us": us, "us": us}
            | {"flops": flops, "peak_fraction": flops / PEAK_FLOPS / (us * 1e-6)}
        )
        del x, ids, weights
        records += _moe_op_records(base, _moe_ops(t, sweep and t in sweep_tokens, g, device))
    return stamped(records, dev)


def _moe_op_records(base: dict, ops: list[tuple]) -> list[dict]:
    """A record of each of ``_moe_ops``' impls: timed, its bytes' rate, and whether its
    output is the default's bit for bit (a tiling's; None for the default and the chains)."""
    records, defaults = [], {}
    for op, name, fn, nbytes in ops:
        rec = base | {"op": op, "impl": f"{op}:{name}", "k": MOE_ROUTED, "bytes": nbytes}
        try:
            out = fn()
            if name == "default":
                defaults[op] = out
            same = None
            if name not in ("default", "torch_chain") and op in defaults:
                same = torch.equal(out, defaults[op])
            del out
            us = _plain_us(fn)
        except Exception as exc:  # a tiling that does not compile
            records.append(rec | {"error": repr(exc)[:300]})
            continue
        rec |= {"time_us": us, "us": us, "gb_per_s": nbytes / us / 1e3}
        rec |= {"fraction_of_copy": nbytes / COPY_BYTES_PER_S / (us * 1e-6)}
        records.append(rec | {"same_as_default": same})
    return records


def run_once(spec: str, device: str = "cuda") -> None:
    """``KIND:S:C:VARIANT`` (VARIANT "default" or a key of ``variants``): two launches of one
    tiling on one case, for a profiler (``ncu --launch-skip 1 --launch-count 1``)."""
    kind, s, cached, name = spec.split(":")
    args = _inputs(int(s), int(cached), kind, device)
    tiling = None if name == "default" else variants(torch.device(device))[name]
    for _ in range(2):
        prefill_attn.paged_sparse_attention(*args, tiling=tiling)
    torch.cuda.synchronize()


def _plain_us(fn: Callable[[], object]) -> float:
    """do_bench median in microseconds (prefill runs eager: no graph timing)."""
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def _print_moe(r: dict) -> None:
    """One ``run_moe`` record as a line."""
    if "tokens" not in r:  # the whole part failed (``run``)
        print(r["kind"], r.get("error"))
        return
    head = f"moe T={r['tokens']:5d} {r['impl']:38s}"
    if "error" in r:
        print(head, r["error"])
    elif "gb_per_s" in r:
        same = {None: "", True: " same as default", False: " DIFFERS from default"}
        print(
            f"{head} {r['time_us']:9.1f} us {r['gb_per_s']:7.0f} GB/s "
            f"{100 * r['fraction_of_copy']:5.1f}% of copy{same[r['same_as_default']]}"
        )
    else:
        print(f"{head} {r['time_us']:9.1f} us {100 * r['peak_fraction']:5.1f}% of bf16 peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output")
    parser.add_argument("--no-sweep", action="store_true", help="default tiling only")
    parser.add_argument("--once", metavar="KIND:S:C:VARIANT", help="two launches (run_once)")
    parser.add_argument(
        "--attention-only", metavar="VARIANTS", help="attention alone: these variants"
    )
    parser.add_argument(
        "--cases", default="8192:0", help="S:C,... queries and cached tokens (--attention-only)"
    )
    parser.add_argument("--phases", action="store_true", help="the wgmma kernel's phases alone")
    parser.add_argument(
        "--moe-only", action="store_true", help="run_moe alone (tilings swept at the largest T)"
    )
    parser.add_argument("--moe-tokens", default="2048,8192", help="T,... (--moe-only)")
    args = parser.parse_args()
    if args.once:
        return run_once(args.once)
    if not args.output:
        parser.error("--output is required")
    if args.phases:
        records = run_phases(only=args.attention_only.split(",") if args.attention_only else None)
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)
        for r in records:
            head = f"{r['layer']} {r['impl']:18s} {r['phase']:9s} rows {r['valid_rows']:9d}"
            print(f"{head} {r['time_us']:9.1f} us, {r['us_per_query_sm']:6.2f} a query an SM")
        return None
    if args.moe_only:
        tokens = tuple(int(v) for v in args.moe_tokens.split(","))
        records = run_moe(tokens=tokens, sweep=not args.no_sweep, sweep_tokens=(max(tokens),))
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)
        for r in records:
            _print_moe(r)
        return None
    if args.attention_only:
        only = args.attention_only.split(",")
        cases = [tuple(int(v) for v in case.split(":")) for case in args.cases.split(",")]
        everything = run_attention(cases=cases, only=only)
    else:
        everything = run(sweep=not args.no_sweep)
    with open(args.output, "w") as f:
        json.dump(everything, f, indent=1)
    records = [r for r in everything if r["kind"] == "prefill_bench"]
    for r in everything:
        if r["kind"] not in ("prefill_bench", "prefill_bench_moe") and "error" in r:
            print(r["kind"], r["error"])
    for r in (r for r in everything if r["kind"] == "prefill_bench_moe"):
        _print_moe(r)
    for r in (r for r in everything if r["kind"] == "prefill_bench_indexer" and "error" not in r):
        print(
            f"indexer S={r['queries']:5d} C={r['cached']:6d} E={r['entries']:6d} "
            f"{r['impl']:8s} {r['time_us']:9.1f} us {100 * r['peak_fraction']:5.1f}% "
            f"same picks {r['same_picks']:.4f}"
        )
    for r in records:
        head = f"{r['layer']} S={r['queries']:5d} C={r['cached']:6d} {r['impl']:22s}"
        if "error" in r:
            print(head, r["error"])
            continue
        print(
            f"{head} {r['time_us']:9.1f} us {r['tflop_per_s']:6.1f} TFLOP/s "
            f"{100 * r['peak_fraction']:5.1f}% err {r['max_abs_err_vs_decode']:.3g}"
            + (
                ""
                if r.get("outside_bf16_rule") is None
                else f" outside bf16 rule {100 * r['outside_bf16_rule']:.3f}%"
            )
        )


if __name__ == "__main__":
    main()
