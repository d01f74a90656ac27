"""Every Triton kernel the fast path launches compiles for the H200 (sm_90), checked on CPU.

The launches come from interpreted bf16 steps of the bench model's layer schedule at tiny
sizes: decode and prefill-sized steps (the prefill kernels' thresholds lowered so that a
32-token chunk takes them), bf16 and fp8 KV caches, plus the quantized kernels (FP8 GEMM,
FP4 fused MoE with both nibble decoders and the prefetch) and the GEMV. Each distinct
launch is compiled with the real JIT kernels through Triton's ptxas (``sm90.py``). This is
what the H200 found on 2026-12-01 and the interpreter could not: every fp8-KV reader failed
to compile.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest
import torch

import rackserve.ops as ops
from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import default_layer_types, tiny_config
from rackserve.ops import quant
from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.step_buffers import StepBuffers

from sm90 import compile_for_sm90, compile_report, gpu_variants, recorded_launches

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches"
)


def _model() -> DeepseekV4ForCausalLM:
    cfg = dataclasses.replace(
        tiny_config(4, 8),
        layer_types=default_layer_types(4),
        mlp_layer_types=("hash_moe",) * 3 + ("moe",),
    )
    model = DeepseekV4ForCausalLM(cfg, with_mtp=False, kernels="triton")
    init_model_(model.cast(torch.bfloat16), seed=0)
    return model.eval()


@torch.inference_mode()
def _record_fast_path() -> list[dict]:
    from rackserve.ops.triton import (
        fp8_gemm,
        fused_moe,
        fused_moe_fp4,
        gemv,
        indexer,
        indexer_tiling,
        mhc,
    )

    model = _model()
    g = torch.Generator().manual_seed(0)
    with recorded_launches() as specs:
        # decode:1: the one-token MoE align (moe_routed's ONE_TOKEN)
        for batch in ("decode:1@40", "decode:2@40", "prefill:32@20"):
            for kv_dtype in (None, torch.float8_e4m3fn):
                s = synthetic_step(model, BatchSpec.parse(batch), kv_dtype=kv_dtype)
                buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cpu")
                ids, meta, idx = buffers.eager_step(s.step.inputs, s.step.table_writes)
                hidden, _ = model(ids, meta, s.caches)
                model.compute_logits(hidden[idx])
                if batch.startswith("decode") and kv_dtype is None:  # a graph's metadata
                    graphs = DecodeGraphs(model, s.caches, buffers, s.groups, [2], [64])
                    key = graphs.key_for(s.step.inputs)
                    graphs.stage(key, s.step.inputs, s.step.table_writes)
                    graphs.metadata(*key)
        # the GPU's top-k: bitonic levels, the last one selecting (the CPU takes torch.topk);
        # the radix select (prefill rows), selecting and writing ids, counted bits and digits
        keys = torch.randn(40, 32, generator=g).bfloat16()
        slots = torch.randperm(40, generator=g)[None, :].repeat(2, 1)
        for limit, algorithm, bits in ((64, "bitonic", 1), (16, "bitonic", 1),
                                       (64, "radix", 1), (64, "radix", 5)):  # fmt: skip
            tiling = indexer_tiling.IndexerTiling(
                16, 1, 4, 1, limit, select_chunk=16, select_algorithm=algorithm, radix_bits=bits
            )
            args = (torch.randn(2, 4, 32, generator=g).bfloat16(), keys, slots,
                    torch.randn(2, 4, generator=g), 0.2, torch.tensor([40, 9]), 8)  # fmt: skip
            indexer.paged_indexer_select(*args, torch.ones(2, 5, dtype=torch.bool), tiling=tiling)
            if algorithm == "radix":
                indexer.paged_indexer_topk(*args, tiling=tiling)
        # K1's bf16x3 dots (mhc.BF16_DOT_PRECISION's alternative): tensor-core bf16 on sm_90
        streams = torch.randn(20, 4, 64, generator=g).bfloat16()
        fn, base = torch.randn(24, 256, generator=g) / 16, torch.randn(24, generator=g)
        tiling = dataclasses.replace(
            mhc.default_tiling(20, 4, 64, streams.device), gemm_precision="bf16x3"
        )
        mhc.hc_pre(streams, fn, base, torch.ones(3), torch.ones(64), 3, 1e-6, 1e-6, tiling=tiling)
        # the wide attention kernel at V4-Flash's heads (64 x 512), split p and fp16 PV, as
        # the GPU tiles it and at its earlier 32-row tiles in 3 stages (the sweep's
        # wide_bn32_st3)
        gpu_wide = _gpu_wide_tiling()
        for tiling in (gpu_wide, dataclasses.replace(gpu_wide, block_n=32, num_stages=3)):
            for fp16 in (False, True):
                _wide_attention(dataclasses.replace(tiling, pv_fp16=fp16), g)
        x = torch.randn(3, 256, generator=g).bfloat16()
        w, scale = quant.quantize_fp8(torch.randn(128, 256, generator=g) / 16)
        fp8_gemm.fp8_linear(x, w, scale)
        gemv.gemv(x, torch.randn(64, 256, generator=g).bfloat16())
        gemv.gemv(torch.randn(64, 256, generator=g).bfloat16(), torch.randn(64, 256).bfloat16())
        w13, s13 = quant.quantize_fp4(torch.randn(4, 128, 256, generator=g) / 16, True)
        w2, s2 = quant.quantize_fp4(torch.randn(4, 256, 64, generator=g) / 8, True)
        s13, s2 = quant.float_to_ue8m0(s13), quant.float_to_ue8m0(s2)
        ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
        weights = torch.rand(3, 2, generator=g)
        for bits, prefetch in ((False, False), (True, False), (True, True)):
            tiling = dataclasses.replace(
                fused_moe_fp4.default_tiling(3, 2, 4, x.device), fp16_bits=bits, prefetch=prefetch
            )
            args = (x, ids, weights, w13, s13, w2, s2, 7.0)
            fused_moe_fp4.moe_experts_fp4(*args, tiling=tiling)
        # the FP4 kernels on stacked h (hi / lo rows, even / odd columns) at the GPU's tiles
        for block_m, bn, prefetch in ((16, 32, False), (32, 64, True)):
            tiling = fused_moe_fp4.Fp4Tiling(
                block_m, bn, 128, 128, 4, 3, fp16_bits=True, prefetch=prefetch, stack_h=True
            )
            fused_moe_fp4.moe_experts_fp4(*args, tiling=tiling)
        # the bf16 fused MoE (h rounded to bf16) at the GPU's tiles
        w13 = torch.randn(4, 128, 256, generator=g).bfloat16() / 16
        w2 = torch.randn(4, 256, 64, generator=g).bfloat16() / 8
        for block_m in (16, 32):
            tiling = fused_moe.Tiling(block_m, 64, 128, 4, 3, 128, 128, 4, 3, 4096, 256)
            fused_moe.moe_experts(x, ids, weights, w13, w2, 7.0, tiling=tiling)
    return specs


def _gpu_wide_tiling():
    """``sparse_attn.wide_tiling`` as it tiles 256 queries over CSA's 640 rows on an H200."""
    from rackserve.ops.triton import sparse_attn

    with mock.patch.object(sparse_attn, "_num_sms", lambda device: 132):
        return sparse_attn.wide_tiling(256, 64, 512, 640, torch.device("cuda"))


def _wide_attention(tiling, g: torch.Generator) -> None:
    """One interpreted launch of the wide attention kernel at V4-Flash's heads (64 x 512)."""
    from rackserve.ops.triton import sparse_attn

    q = torch.randn(1, 64, 512, generator=g).bfloat16()
    kv, rows = torch.randn(40, 512, generator=g).bfloat16(), torch.arange(32)[None, :]
    sparse_attn.paged_sparse_attention(
        q, kv, rows[:, :16], kv, rows[:, 16:], torch.ones(1, 32, dtype=torch.bool),
        torch.zeros(64), 0.04, tiling=tiling,
    )  # fmt: skip


@torch.inference_mode()
def test_wide_attention_overlaps_gathers_at_two_programs_per_sm():
    """The wide decode attention as the GPU tiles it keeps later row tiles' gathers in
    flight while a tile computes, in shared memory that fits two programs on an SM (228 KB,
    1 KB reserved per program). Triton 3.6 waits for every copy at the top of each
    iteration below 5 stages, and 32-row tiles at 5 stages need 164 KB: either alone gave
    back most of the gain on the H200 (CSA at 256 queries 163 us against 201-242 us,
    2026-12-03-h200-s18.md)."""
    tiling = _gpu_wide_tiling()
    with recorded_launches() as specs:
        _wide_attention(tiling, torch.Generator().manual_seed(0))
    specs = [s for s in gpu_variants(specs) if s["constexprs"].get("FP32_DOTS") is False]
    assert specs and all(s["kernel"] == "sparse_attn_wide_kernel" for s in specs)
    report = compile_report(specs)
    assert not report["failures"], report["failures"]
    for r in report["resources"]:
        assert r["options"]["num_stages"] == tiling.num_stages
        assert 2 * (r["shared"] + 1024) <= 228 * 1024, r["shared"]
        assert max(r["async_waits"]) > 0, r["async_waits"]


def test_fast_path_kernels_compile_for_sm90(monkeypatch):
    from rackserve.ops.triton import mhc

    # prefill kernels (attention, indexer, grouped MoE) from 24 tokens instead of 512 / 257
    monkeypatch.setattr(ops, "PREFILL_ATTN_MIN_TOKENS", 24)
    monkeypatch.setattr(ops, "PREFILL_ATTENTION_MIN_TOKENS", 24)
    monkeypatch.setattr(ops, "FUSED_MOE_MAX_TOKENS", 24)
    monkeypatch.setattr(mhc, "MIXES_APART_MIN_TOKENS", 24)  # K2 as two launches
    specs = gpu_variants(_record_fast_path())
    kernels = {s["kernel"] for s in specs}
    # the step's kernels, both attention paths, the fp8 writers, the quantized kernels
    for name in ("sparse_attn_kernel", "prefill_attn_kernel", "_compress_kernel",
                 "moe_gate_up_fp4_kernel", "fp8_gemm_kernel", "gemv_kernel",
                 "select_topk_kernel", "radix_topk_kernel", "_step_meta_kernel",
                 "_embed_streams_kernel", "_route_align_kernel"):  # fmt: skip
        assert any(name in k for k in kernels), (name, sorted(kernels))
    halves = {(s["constexprs"]["MIXES"], s["constexprs"]["COLLAPSE"]) for s in specs
              if s["kernel"] == "hc_finish_kernel"}  # fmt: skip
    assert halves == {(True, True), (True, False), (False, True)}, halves
    assert any(
        s["kernel"] == "prenorm_gemm_kernel" and s["constexprs"]["PRECISION"] == "bf16x3"
        and s["constexprs"]["NATIVE_BF16"] for s in specs
    )  # fmt: skip
    assert any(
        s["kernel"] == "sparse_attn_wide_kernel" and s["constexprs"]["PV_FP16"] for s in specs
    )
    for name in ("moe_down_fp4_kernel", "moe_gate_up_fp4_kernel"):
        assert any(s["kernel"] == name and s["constexprs"]["STACK_H"] for s in specs), name
    assert any(s["kernel"] == "moe_down_kernel" and s["constexprs"]["BLOCK_K"] == 128
               for s in specs)  # fmt: skip
    # the opt-in PDL path ($RACKSERVE_PDL=1): each kernel once with PDL on
    with_pdl: dict[str, dict] = {}
    for s in specs:
        if "PDL" in s["constexprs"]:
            with_pdl.setdefault(s["kernel"], s | {"constexprs": s["constexprs"] | {"PDL": True}})
    assert {"gemv_kernel", "moe_down_kernel", "hc_finish_kernel"} <= with_pdl.keys()
    failures = compile_for_sm90(specs + list(with_pdl.values()))
    assert not failures, "\n".join(
        f"{f['kernel']} {f['constexprs']}: {f['error']}" for f in failures
    )


@torch.inference_mode()
def test_quantized_weights_load_as_vectors():
    """The FP4 experts' packed bytes and the FP8 weights load as 16-byte vectors on sm_90,
    at the tilings the GPU picks. On 2026-12-02 the FP4 kernels loaded them a byte at a
    time (34 to 68 ld.global.b8 per thread and step: the K mask's alignment was unknown)
    and streamed at 3-12% of the HBM roofline; what is left are the ue8m0 scale bytes."""
    from rackserve.ops.triton import fp8_gemm, fused_moe_fp4

    g = torch.Generator().manual_seed(0)
    gpu = torch.device("cuda")
    with recorded_launches() as specs:
        x = torch.randn(3, 256, generator=g).bfloat16()
        w, scale = quant.quantize_fp8(torch.randn(256, 256, generator=g) / 16)
        fp8_gemm.fp8_linear(x, w, scale)
        w13, s13 = quant.quantize_fp4(torch.randn(4, 128, 256, generator=g) / 16, True)
        w2, s2 = quant.quantize_fp4(torch.randn(4, 256, 64, generator=g) / 8, True)
        s13, s2 = quant.float_to_ue8m0(s13), quant.float_to_ue8m0(s2)
        ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2, generator=g)
        for tokens in (1, 64, 256):  # the decode, middle and prefill-sized GPU tilings
            tiling = fused_moe_fp4.default_tiling(tokens, 6, 64, gpu)
            for bits in (False, True):
                fused_moe_fp4.moe_experts_fp4(
                    x, ids, weights, w13, s13, w2, s2, 7.0,
                    tiling=dataclasses.replace(tiling, fp16_bits=bits, block_k=128),
                )  # fmt: skip
    specs = [s for s in gpu_variants(specs) if s["constexprs"].get("IEEE") is False]
    assert {s["kernel"] for s in specs} >= {"fp8_gemm_kernel", "moe_down_fp4_kernel"}
    report = compile_report(specs)
    assert not report["failures"], report["failures"]
    # ue8m0 scales: BLOCK_K / 32 bytes of each of the tile's rows, a few per thread
    too_many = [r for r in report["byte_loads"] if r["count"] > 8]
    assert not too_many, too_many
