"""Compiles the indexer's one-program-per-query top-k kernels
(``select_topk.select_topk_kernel``, bitonic; ``topk.radix_topk_kernel``) for sm_90 on a
machine without a GPU (Triton's bundled ptxas) and prints, per row length, what bounds them
before any measurement: registers, spills, shared memory, and per warp the SASS
instructions, barriers, shuffles and shared-memory operations (the MIO pipe). The kernels
have no loops: each warp of a program issues each instruction once at most (the radix
passes after an early stop not at all), so warps x instructions is a row's issue count (the
"warp-issues/row" column, all passes run).

    python benchmarks/topk_ptxas.py                        # E 2048 / 4096 / 8192, k 512
    python benchmarks/topk_ptxas.py --entries 2048 --k 512 --bits 1 5 8
"""

from __future__ import annotations

import argparse

import triton
from sass_resources import resources
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rackserve.ops.triton import select_topk, topk

_COMMON = {"slots_ptr": "*i64", "num_visible_ptr": "*i64", "window_ptr": "*u8"}
_COMMON |= {"valid_ptr": "*u8", "stride_ss": "i32", "stride_window": "i32", "W": "i32"}


def compile_bitonic(entries: int, k: int, warps: int):
    """``select_topk_kernel`` as the last level runs it: one program holds the row."""
    sig = {"packed_ptr": "*i64", "out_ptr": "*i64", "num_entries": "i32", "k": "i32"}
    sig |= {"chunk": "i32", "stride_ps": "i32", "stride_os": "i32"} | _COMMON
    consts = {"BLOCK_N": triton.next_power_of_2(entries), "BLOCK_K": max(2, k)}
    consts |= {"OUT_KEYS": False, "SELECT": False, "BLOCK_W": 2, "PDL": False}
    return _compile(select_topk.select_topk_kernel, sig, consts, warps)


def compile_radix(entries: int, k: int, warps: int, bits: int):
    sig = {"packed_ptr": "*i64", "out_ptr": "*i64", "work_ptr": "*i64", "num_entries": "i32"}
    sig |= {"k": "i32", "stride_ps": "i32", "stride_os": "i32", "stride_ws": "i32"} | _COMMON
    consts = {"BLOCK_N": triton.next_power_of_2(entries), "BLOCK_K": max(2, k)}
    consts |= {"RADIX_BITS": bits, "SELECT": False, "BLOCK_W": 2, "PDL": False}
    return _compile(topk.radix_topk_kernel, sig, consts, warps)


def _compile(fn, sig: dict, consts: dict, warps: int):
    sig = sig | dict.fromkeys(consts, "constexpr")
    names = list(sig)
    # pointers and strides divisible by 16, as the JIT specializes them at launch
    aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride")]
    aligned += ["num_entries", "k"]  # 2048, 512
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": 1}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, nargs="*", default=[2048, 4096, 8192])
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--bits", type=int, nargs="*", default=[5, 6, 8])
    args = parser.parse_args()
    for e in (e for e in args.entries if e >= args.k):
        rows = {f"bitonic w{w}": (compile_bitonic, (e, args.k, w)) for w in (8, 16)}
        for bits in args.bits:
            for w in sorted({topk.default_warps(e) // 2, topk.default_warps(e)}):
                rows[f"radix b{bits} w{w}"] = (compile_radix, (e, args.k, w, bits))
        for name, (fn, fn_args) in rows.items():
            try:
                info = resources(fn(*fn_args))
                issues = info["sass"] * fn_args[2]
                print(f"E={e:5d} k={args.k} {name:14s} {info} warp-issues/row {issues}", flush=True)
            except Exception as err:  # a shape that does not compile
                print(f"E={e:5d} k={args.k} {name:14s} ERROR {repr(err)[:300]}", flush=True)


if __name__ == "__main__":
    main()
