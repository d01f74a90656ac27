"""Compiles the prefill attention kernel for sm_90 on a machine without a GPU (Triton's
bundled ptxas) and prints, per tiling, what decides its speed before any measurement:
registers, spill bytes (the stack) and spill instructions, shared memory, and whether the
dots became wgmma (or fell back to mma.sync).

Integer arguments are given the divisibility-by-16 that Triton specializes on at launch
(v4-flash strides), so loads vectorize as they do on the device.

    python benchmarks/prefill_ptxas.py                      # the default and the sweep
    python benchmarks/prefill_ptxas.py 64,32,2,8,3,fp16     # block_h,block_n,num_dv,warps,stages,pv
"""

from __future__ import annotations

import argparse

import triton
from sass_resources import resources
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rackserve.ops.triton import prefill_attn

_PV = {"rows": 0, "split": 1, "fp16": 2}
_INTS = ("num_heads", "head_dim", "width_a", "width", "rope_start")
_STRIDES = ("qs", "qh", "a", "b", "sa", "sb", "vs", "os", "oh")


def signature(dtype: str) -> dict[str, str]:
    """The kernel's argument types (pointers, ints, the fp32 scale, constexprs)."""
    ptrs = {"q_ptr": dtype, "kv_a_ptr": dtype, "slots_a_ptr": "i64", "kv_b_ptr": dtype}
    ptrs |= {"slots_b_ptr": "i64", "valid_ptr": "u8", "sinks_ptr": "fp32", "out_ptr": dtype}
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig |= {name: "i32" for name in _INTS} | {"qk_scale": "fp32"}
    sig |= {f"stride_{s}": "i32" for s in _STRIDES}
    sig |= {"cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}", "stride_cs": "i32", "stride_ss": "i32"}
    consts = ("BLOCK_H", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "NUM_DV", "BLOCK_V", "ROPE")
    return sig | {c: "constexpr" for c in (*consts, "EVEN_D", "NUM_STAGES", "PV", "FP32_DOTS")}


def compile_tiling(t: prefill_attn.PrefillTiling, dtype: str = "bf16", head_dim: int = 512):
    """The compiled kernel for tiling ``t`` at Dh ``head_dim`` with the inverse RoPE on."""
    sig = signature(dtype)
    names = list(sig)
    aligned = [n for n in names if sig[n].startswith("*") or n.startswith("stride")]
    aligned += ["head_dim", "width_a", "width"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    block_d = triton.next_power_of_2(head_dim)
    consts = {
        "BLOCK_H": t.block_h,
        "BLOCK_N": t.block_n,
        "BLOCK_D": block_d,
        "BLOCK_DV": block_d // t.num_dv,
        "NUM_DV": t.num_dv,
        "BLOCK_V": 1024,
        "ROPE": True,
        "NUM_STAGES": t.num_stages,
        "PV": _PV[t.pv] if dtype != "fp32" else 0,
        "FP32_DOTS": dtype == "fp32",
        "EVEN_D": head_dim == triton.next_power_of_2(head_dim),
    }
    src = ASTSource(
        fn=prefill_attn.prefill_attn_kernel, signature=sig, constexprs=consts, attrs=attrs
    )
    options = {"num_warps": t.num_warps, "num_stages": t.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tilings", nargs="*", help="block_h,block_n,num_dv,warps,stages,pv")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = parser.parse_args()
    if args.tilings:
        tilings = {}
        for text in args.tilings:
            *ints, pv = text.split(",")
            tilings[text] = prefill_attn.PrefillTiling(*map(int, ints), pv=pv)
    else:
        import torch
        from prefill_bench import variants

        dev = torch.device("cuda")
        tilings = {"default": prefill_attn.default_tiling(64, 512, torch.bfloat16, dev)}
        tilings |= variants(dev)
    for name, tiling in tilings.items():
        try:
            print(
                f"{name:16s} {tiling} {resources(compile_tiling(tiling, args.dtype))}", flush=True
            )
        except Exception as e:  # a tiling that does not compile
            print(f"{name:16s} {tiling} ERROR {repr(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
