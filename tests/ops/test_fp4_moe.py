"""The FP4 fused MoE (``ops/triton/fused_moe_fp4.py``) against ``ops.quant.moe_experts_fp4``
(dequantize the hit experts, then the reference), and the FP4 format itself (nibble order
and values as transformers unpacks them).

Small shapes under the interpreter (E in {4, 8}, D/I in {64/32, 128/64}, T in {1, 3, 17,
64}), skewed routing (idle experts, experts with more than a block of rows), scales fp32 or
ue8m0, outputs and workspaces poisoned (NaN floats, a huge int).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import triton
import triton.language as tl

from rackserve.ops import quant

from kernel_checks import DEVICE, assert_bf16_close, assert_fp32_close

fp4_kernels = importlib.import_module("rackserve.ops.triton.fp4_tiles")

LIMIT = 7.0
POISON_INT = 1 << 29


@pytest.fixture(scope="module")
def fm4():
    return importlib.import_module("rackserve.ops.triton.fused_moe_fp4")


@pytest.fixture(autouse=True)
def poisoned_outputs(fm4, monkeypatch):
    fm = importlib.import_module("rackserve.ops.triton.fused_moe")

    def empty(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else POISON_INT
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(fm4, "_empty", empty)
    monkeypatch.setattr(fm, "_empty", empty)  # moe_align's buffers


def make_case(t, e, d, i, k, seed, dtype, ue8m0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    popularity = 0.6 ** torch.arange(e, dtype=torch.float32)
    ids = torch.stack([torch.multinomial(popularity, k, generator=g) for _ in range(t)])
    weights = torch.rand(t, k, generator=g) + 0.1
    x = torch.randn(t, d, generator=g)
    w13, s13 = quant.quantize_fp4(torch.randn(e, 2 * i, d, generator=g) * 2 / d**0.5, ue8m0)
    w2, s2 = quant.quantize_fp4(torch.randn(e, d, i, generator=g) / i**0.5, ue8m0)
    if ue8m0:
        s13, s2 = quant.float_to_ue8m0(s13), quant.float_to_ue8m0(s2)
    dev = [a.to(DEVICE) for a in (ids, weights, w13, s13, w2, s2)]
    return (x.to(DEVICE, dtype), *dev)


def check(fm4, args, tiling=None):
    got = fm4.moe_experts_fp4(*args, LIMIT, tiling=tiling)
    x = args[0]
    assert got.shape == x.shape and got.dtype == x.dtype
    ref = quant.moe_experts_fp4(*args, LIMIT)
    if x.dtype == torch.float32:
        assert_fp32_close(got, ref)
    else:
        assert_bf16_close(got, ref, quant.moe_experts_fp4(x.float(), *args[1:], LIMIT))
    return got


@pytest.mark.parametrize("t", [1, 3, 17, 64])
@pytest.mark.parametrize("e,d,i,k", [(4, 64, 32, 2), (8, 128, 64, 3)])
@pytest.mark.parametrize("dtype,ue8m0", [(torch.float32, False), (torch.bfloat16, True)])
def test_matches_reference(fm4, t, e, d, i, k, dtype, ue8m0):
    check(fm4, make_case(t, e, d, i, k, seed=t * 13 + e, dtype=dtype, ue8m0=ue8m0))


@pytest.mark.parametrize("block_k", [32, 64])
def test_tilings(fm4, block_k):
    args = make_case(9, 4, 96, 64, 2, seed=block_k, dtype=torch.float32, ue8m0=True)
    check(fm4, args, fm4.Fp4Tiling(16, 16, 32, block_k, 4, 1))  # D = 96: a ragged last step
    check(fm4, args, fm4.Fp4Tiling(32, 32, 64, block_k, 4, 1, align_segment=16))  # 2 segments
    # nibbles decoded through fp16 bit patterns: the same values, fewer ops
    check(fm4, args, fm4.Fp4Tiling(16, 16, 32, block_k, 4, 1, fp16_bits=True))
    # the next step's weights loaded before this step computes (the last prefetch masked)
    check(fm4, args, fm4.Fp4Tiling(16, 16, 32, block_k, 4, 1, prefetch=True))
    check(fm4, args, fm4.Fp4Tiling(32, 32, 64, block_k, 4, 1, fp16_bits=True, prefetch=True))


@pytest.mark.parametrize("block_k", [32, 64])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_stacked_h(fm4, block_k, ue8m0):
    """``Fp4Tiling.stack_h``: h stored as bf16 hi / lo rows per block with even inputs first;
    I = 96 leaves a ragged last step of each half; prefetch on and off, 16- and 32-row
    blocks; fp32 activations keep the fp32 h (no stacking)."""
    for t, i in ((9, 64), (17, 96)):
        args = make_case(t, 4, 96, i, 2, seed=block_k + t, dtype=torch.bfloat16, ue8m0=ue8m0)
        check(fm4, args, fm4.Fp4Tiling(16, 16, 32, block_k, 4, 1, stack_h=True))
        check(fm4, args, fm4.Fp4Tiling(32, 32, 64, block_k, 4, 1, prefetch=True, stack_h=True))
    args = make_case(9, 4, 96, 64, 2, seed=block_k, dtype=torch.float32, ue8m0=ue8m0)
    check(fm4, args, fm4.Fp4Tiling(16, 16, 32, block_k, 4, 1, stack_h=True))


def test_down_grid_with_tiles_fastest(fm4):
    """``Fp4Tiling.down_tile_fastest``: the down kernel's grid as (n-tiles, blocks); several
    blocks and n-tiles, both h layouts."""
    args = make_case(17, 4, 96, 64, 2, seed=5, dtype=torch.bfloat16, ue8m0=True)
    for stack in (False, True):
        tiling = fm4.Fp4Tiling(16, 16, 32, 32, 4, 1, stack_h=stack, down_tile_fastest=True)
        check(fm4, args, tiling)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="inline PTX: the interpreter runs none")
@pytest.mark.parametrize("t", [1, 64, 300])
def test_stacked_h_on_gpu(fm4, t):
    """The stacked h at the GPU's tilings with the inline-PTX decoder (and fp16 bits)."""
    args = make_case(t, 8, 256, 128, 3, seed=t + 1, dtype=torch.bfloat16, ue8m0=True)
    base = fm4.default_tiling(t, 3, 8, torch.device(DEVICE))
    for asm in (True, False):
        check(fm4, args, dataclasses.replace(base, dot_scaled=False, asm_decode=asm, stack_h=True))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="tl.dot_scaled: the interpreter has none")
@pytest.mark.parametrize("t", [1, 17, 64, 300])
def test_dot_scaled(fm4, t):
    """Triton's own e2m1 upcast and scaled dot (bf16 activations, ue8m0 scales)."""
    args = make_case(t, 8, 256, 128, 3, seed=t, dtype=torch.bfloat16, ue8m0=True)
    base = fm4.default_tiling(t, 3, 8, torch.device(DEVICE))
    check(fm4, args, dataclasses.replace(base, dot_scaled=True))
    check(fm4, args, dataclasses.replace(base, dot_scaled=True, block_k=64, num_stages=2))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="inline PTX: the interpreter runs none")
@pytest.mark.parametrize("t", [1, 17, 64, 300])
def test_asm_decode(fm4, t):
    """The inline-PTX decoder (two weights per bf16x2 instruction pair): within the rule
    against the reference, and bitwise the fp16-bits decoder's result (both dequantize
    exactly, and the dots are the same)."""
    args = make_case(t, 8, 256, 128, 3, seed=t, dtype=torch.bfloat16, ue8m0=True)
    base = fm4.default_tiling(t, 3, 8, torch.device(DEVICE))
    tiling = dataclasses.replace(base, dot_scaled=False, asm_decode=True)
    got = check(fm4, args, tiling)
    fp16_bits = dataclasses.replace(tiling, asm_decode=False, fp16_bits=True)
    assert torch.equal(got, fm4.moe_experts_fp4(*args, LIMIT, tiling=fp16_bits))


def test_unrouted_slots_add_nothing(fm4):
    x, ids, weights, *w = make_case(5, 4, 64, 32, 2, seed=1, dtype=torch.float32, ue8m0=True)
    ids = ids.clone()
    ids[:, 1] = 4  # outside [0, E): contributes nothing
    got = fm4.moe_experts_fp4(x, ids, weights, *w, LIMIT)
    ref = quant.moe_experts_fp4(x, ids[:, :1], weights[:, :1], *w, LIMIT)
    assert_fp32_close(got, ref)


def test_bad_inputs(fm4):
    x, ids, weights, w13, s13, w2, s2 = make_case(2, 4, 64, 32, 2, 1, torch.float32, True)
    with pytest.raises(ValueError, match="w13 must be packed uint8"):
        fm4.moe_experts_fp4(x, ids, weights, w13.float(), s13, w2, s2, LIMIT)
    with pytest.raises(ValueError, match="w2_scale must be"):
        fm4.moe_experts_fp4(x, ids, weights, w13, s13, w2, s2[:, :1], LIMIT)


# ---- the format ----------------------------------------------------------------------------
def test_nibble_order_and_values():
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)  # codes 1, 2 | 8, 15
    assert quant.unpack_fp4(packed).tolist() == [[0.5, 1.0, -0.0, -6.0]]
    values = torch.tensor(quant.E2M1_VALUES * 2).view(1, 32)  # every code, exactly
    q, s = quant.quantize_fp4(values * 4, ue8m0=True)
    assert s.item() == 4.0
    assert torch.equal(quant.dequantize_fp4(q, s, torch.float32), values * 4)


@triton.jit
def _decode_every_code(out_ptr):
    code = tl.arange(0, 16)
    tl.store(out_ptr + code, fp4_kernels._e2m1(code))
    tl.store(out_ptr + 16 + code, fp4_kernels._e2m1_bits(code))


def test_both_nibble_decoders_give_every_value():
    """``_e2m1`` (arithmetic) and ``_e2m1_bits`` (fp16 bit patterns) decode the 16 codes to
    exactly the format's values (the bits decoder keeps code 8's -0, as the reference; the
    arithmetic one gives +0 there, the same in every dot)."""
    out = torch.full((32,), float("nan"), device=DEVICE)
    _decode_every_code[(1,)](out)
    want = torch.tensor(quant.E2M1_VALUES, device=DEVICE)
    arithmetic, bits = out.view(2, 16)
    assert torch.equal(arithmetic, want) and torch.equal(bits, want)
    assert torch.equal(bits.signbit(), want.signbit())


def test_round_to_nearest():
    w = torch.tensor([[5.1, 4.9, 2.4, 0.26, -1.3, 0.0] + [6.0] + [0.0] * 25])
    q, s = quant.quantize_fp4(w, ue8m0=False)
    back = quant.dequantize_fp4(q, s, torch.float32)[0, :7].tolist()
    assert back == [6.0, 4.0, 2.0, 0.5, -1.5, 0.0, 6.0]


def test_dequantize_equals_transformers():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    q, s = quant.quantize_fp4(torch.randn(3, 64, 128), ue8m0=True)
    ref = fp8.Fp8Dequantize(None)._dequantize_one(q.view(torch.int8), s, torch.float32)
    assert torch.equal(quant.dequantize_fp4(q, quant.float_to_ue8m0(s), torch.float32), ref)
