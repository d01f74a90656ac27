"""Times the kernels on quantized weights against their bf16 counterparts, V4-Flash sizes.

- ``fp8_linear`` (Triton, FP8 block-scaled weight) vs ``F.linear`` on the bf16 weight
  (cuBLAS), and vs ``torch._scaled_mm`` with block-wise scales where this torch has it
  (1x128 activation scales, 128x128 weight scales), for the dense projections of a layer
  (wq_a, wq_b, wo_b, shared w1, the grouped wo_a);
- ``moe_experts_fp4`` (Triton, packed e2m1 + ue8m0 scale per 32) vs the bf16 fused MoE
  (Triton) and the grouped GEMMs: E=64, k=6, D=4096, I=2048;

at T in {1, 8, 64, 256, 1024, 4096}. Each record: op, impl, T, the compulsory bytes (the
weight as stored, incl. scales; for the MoE the hit experts only; plus x and the output),
FLOPs, median times (``do_bench`` and ``do_bench_cudagraph``), and the fraction of the H200
roofline max(bytes / 4.8 TB/s, flops / 989 TFLOP/s) / time (bf16 tensor cores: the weights
are widened in registers). Quantized rows carry max |kernel - reference| / max |reference|
against the dequantize-then-fp32 reference.

    from benchmarks.quant_bench import run; records = run()
    python benchmarks/quant_bench.py --output $OUT/quant_bench.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from rackserve.ops import quant
from rackserve.ops.grouped_moe import moe_experts_grouped
from rackserve.ops.triton import fused_moe
from rackserve.ops.triton.fp8_gemm import fp8_linear
from rackserve.ops.triton.fused_moe_fp4 import moe_experts_fp4

from bench_timing import stamped, time_us

TOKENS = (1, 8, 64, 256, 1024, 4096)
LINEARS = {  # name: (N, K, groups) at V4-Flash dims
    "wq_a": (1024, 4096, 0),
    "wq_b": (32768, 1024, 0),
    "wo_a": (8 * 1024, 4096, 8),  # [G * o_lora_rank, inputs per group]
    "wo_b": (4096, 8192, 0),
    "shared_w1": (2048, 4096, 0),
}
E, K, D, INTER, LIMIT = 64, 6, 4096, 2048, 10.0
HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS_PER_S = 989e12


def _record(op: str, impl: str, t: int, nbytes: float, flops: float, fn: Callable) -> dict:
    plain, graph = time_us(fn)
    best = graph if graph is not None else plain
    floor_us = max(nbytes / HBM_BYTES_PER_S, flops / BF16_FLOPS_PER_S) * 1e6
    return {
        "kind": "quant_bench",
        "op": op,
        "impl": impl,
        "tokens": t,
        "bytes": nbytes,
        "flops": flops,
        "time_us": plain,
        "graph_time_us": graph,
        "gb_per_s": nbytes / best / 1e3,
        "tflops": flops / best / 1e6,
        "roofline_fraction": floor_us / best,
    }


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def _scaled_mm(x: torch.Tensor, w8: torch.Tensor, s: torch.Tensor) -> Callable | None:
    """torch's block-scaled FP8 GEMM (activations quantized per 1x128), if this torch has
    it; None otherwise."""
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm  # type: ignore

        def run():
            xs = x.float().unflatten(-1, (-1, 128))
            xscale = (xs.abs().amax(-1) / 448.0).clamp_min(1e-12)
            x8 = (xs / xscale[..., None]).to(torch.float8_e4m3fn).flatten(-2)
            xscale = xscale.t().contiguous().t()  # cuBLAS wants 1x128 scales M-major
            return scaled_mm(
                x8, w8.t(), xscale, ScalingType.BlockWise1x128, s, ScalingType.BlockWise128x128,
                swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE,
                output_dtype=torch.bfloat16,
            )  # fmt: skip

        run()
        return run
    except Exception as e:  # no block-wise scaled_mm on this torch / GPU: say why once
        print(f"torch scaled_mm (block-wise) unavailable: {str(e).splitlines()[0][:160]}")
        return None


def run_linears(device: str = "cuda", tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    records = []
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k, groups) in LINEARS.items():
        w = torch.randn(n, k, device=device, generator=g) / k**0.5
        w8, s = quant.quantize_fp8(w, ue8m0=True)
        wb = quant.dequantize_fp8(w8, s, torch.bfloat16)
        for t in tokens:
            shape = (t, groups, k) if groups else (t, k)  # wo_a: K inputs per group
            x = torch.randn(shape, device=device, generator=g).bfloat16()
            kin = k
            xb = x.numel() * 2
            flops = 2 * t * n * kin
            qbytes = n * kin + s.numel() * 4 + xb + t * n * 2
            ref = quant.fp8_linear(x.float(), w8, s, groups)
            got = fp8_linear(x, w8, s, groups)
            fn = partial(fp8_linear, x, w8, s, groups)
            rec = _record(name, "triton_fp8", t, qbytes, flops, fn)
            records.append(rec | {"rel_error": _rel(got, ref)})
            if groups:  # the bf16 grouped linear: an einsum over the dequantized weight
                bf16 = partial(torch.einsum, "tgi,goi->tgo", x, wb.view(groups, -1, kin))
            else:
                bf16 = partial(F.linear, x, wb)
            records.append(_record(name, "bf16", t, n * kin * 2 + xb + t * n * 2, flops, bf16))
            if not groups:
                fn = _scaled_mm(x, w8, s)
                if fn is not None:
                    rec = _record(name, "torch_scaled_mm", t, qbytes, flops, fn)
                    records.append(rec | {"rel_error": _rel(fn(), ref)})
    return records


def run_moe(device: str = "cuda", tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    records = []
    g = torch.Generator(device=device).manual_seed(1)
    w13, s13 = quant.quantize_fp4(torch.randn(E, 2 * INTER, D, device=device, generator=g) / 64)
    w2, s2 = quant.quantize_fp4(torch.randn(E, D, INTER, device=device, generator=g) / 45)
    s13, s2 = quant.float_to_ue8m0(s13), quant.float_to_ue8m0(s2)
    b13 = quant.dequantize_fp4(w13, s13, torch.bfloat16)
    b2 = quant.dequantize_fp4(w2, s2, torch.bfloat16)
    for t in tokens:
        x = torch.randn(t, D, device=device, generator=g).bfloat16()
        ids = torch.rand(t, E, device=device, generator=g).argsort(-1)[:, :K]
        weights = torch.rand(t, K, device=device, generator=g)
        hit = int(torch.unique(ids).numel())
        flops = 2 * 3 * t * K * D * INTER
        act = 2 * t * D * 2
        fp4_bytes = hit * 3 * D * INTER * (0.5 + 1 / 32) + act
        args = (ids, weights, w13, s13, w2, s2, LIMIT)
        ref = quant.moe_experts_fp4(x.float(), *args)
        fn = partial(moe_experts_fp4, x, *args)
        rec = _record("moe_experts", "triton_fp4", t, fp4_bytes, flops, fn)
        records.append(rec | {"rel_error": _rel(fn(), ref), "hit_experts": hit})
        bf16_bytes = hit * 3 * D * INTER * 2 + act
        bf16_args = (x, ids, weights, b13, b2, LIMIT)
        fn = partial(fused_moe.moe_experts, *bf16_args)
        records.append(_record("moe_experts", "triton_bf16", t, bf16_bytes, flops, fn))
        fn = partial(moe_experts_grouped, *bf16_args)
        records.append(_record("moe_experts", "grouped_bf16", t, bf16_bytes, flops, fn))
    return records


def _quantized_model(layers: int, experts: int, device: str):
    import dataclasses

    from rackserve.config import QuantConfig
    from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.model.presets import preset_config
    from rackserve.model.quant import fp8_linear_names, quantize_linears_

    cfg = preset_config("v4-flash", layers, experts)
    cfg = dataclasses.replace(cfg, quantization=QuantConfig())
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=layers == 43)
        model.cast(torch.bfloat16)
        quantize_linears_(model, fp8_linear_names(model), model.kernels)
    return model


def memory(device: str = "cuda") -> list[dict]:
    """Weight bytes in this format: the full V4-Flash (43 layers + MTP, 256 experts)
    computed, and the 4-layer 64-expert bench model computed and measured on the device."""
    from rackserve.model.quant import weight_memory

    full = weight_memory(_quantized_model(43, 256, "meta"))
    records = [{"kind": "quant_memory", "model": "v4-flash 43x256 + mtp", "computed": full}]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = _quantized_model(4, 64, device)
    torch.cuda.synchronize()
    measured = torch.cuda.memory_allocated() - before
    records.append(
        {
            "kind": "quant_memory",
            "model": "v4-flash 4x64",
            "computed": weight_memory(model),
            "measured_allocated": measured,
        }
    )
    return records


def run(device: str = "cuda", tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    """Every record (see the module docstring), stamped with the GPU and the date."""
    records = memory(device) + run_linears(device, tokens) + run_moe(device, tokens)
    return stamped(records, torch.device(device))


def _print(r: dict) -> None:
    if r["kind"] == "quant_memory":
        gb = {k: f"{v / 1e9:.2f} GB" for k, v in r["computed"].items()}
        print(r["model"], gb, "measured:", r.get("measured_allocated"), flush=True)
        return
    err = f"  err {r['rel_error']:.1e}" if "rel_error" in r else ""
    graph = r["graph_time_us"] or r["time_us"]
    print(
        f"{r['op']:>11} {r['impl']:>15} T={r['tokens']:>5}: {graph:9.1f} us  "
        f"{r['gb_per_s']:7.0f} GB/s  {r['roofline_fraction']:.2f} of roofline{err}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    records: list[dict] = []
    for part in (memory, run_linears, run_moe):  # written after each: a timeout keeps some
        new = stamped(part("cuda"), device)
        for r in new:
            _print(r)
        records += new
        if args.output:
            with open(args.output, "w") as f:
                json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
