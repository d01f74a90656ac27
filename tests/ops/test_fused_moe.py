"""The fused MoE op (``ops/triton/fused_moe.py``) against ``reference.moe_experts``.

CPU runs use the Triton interpreter at small shapes (E in {4, 8}, D/I in {64/32, 128/64},
T in {1, 3, 17, 64}); routing is skewed so some experts get no token and some more than a
block. Every output and workspace starts poisoned (NaN floats, a huge int), so anything
a kernel fails to write, or reads without writing, fails. Tolerances (GPU_FASTPATH.md
section 5): fp32 within 1e-4 relative; bf16 |kernel - ref_fp32| <= 2 |ref_bf16 - ref_fp32|
+ 1e-3 for at least 99.9% of the elements, where ref_bf16 rounds h once as the kernel does
(``h_dtype``), plus one bf16 spacing (two roundings of differently ordered fp32 sums).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from rackserve.ops import reference

from kernel_checks import DEVICE, assert_bf16_close, assert_fp32_close

LIMIT = 7.0
SHAPES = [(4, 64, 32, 2), (8, 128, 64, 3)]  # (E, D, I, k)
POISON_INT = 1 << 29


@pytest.fixture(scope="module")
def fm():
    # the root conftest chose the interpreter (no GPU) before anything imported Triton
    return importlib.import_module("rackserve.ops.triton.fused_moe")


@pytest.fixture(autouse=True)
def poisoned_outputs(fm, monkeypatch):
    def empty(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else POISON_INT
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(fm, "_empty", empty)


def make_case(t: int, e: int, d: int, i: int, k: int, seed: int, dtype: torch.dtype) -> tuple:
    """x, topk_ids, topk_weights, w13, w2 with skewed routing: expert popularity falls off
    geometrically, so the last experts often get nothing and the first ones many tokens."""
    g = torch.Generator().manual_seed(seed)
    popularity = 0.6 ** torch.arange(e, dtype=torch.float32)
    ids = torch.stack([torch.multinomial(popularity, k, generator=g) for _ in range(t)])
    ids = ids.reshape(t, k)
    weights = torch.rand(t, k, generator=g) + 0.1
    x = torch.randn(t, d, generator=g)
    # the weights drawn where they are used: V4-Flash's 0.8 G values took ~20 s a case on the
    # GPU machine's CPU (every GPU test of this file ran past its share of a device call)
    gw = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, d, generator=gw, device=DEVICE) * (2.0 / d**0.5)  # gates > LIMIT
    w2 = torch.randn(e, d, i, generator=gw, device=DEVICE) / i**0.5
    return (
        x.to(DEVICE, dtype),
        ids.to(DEVICE),
        weights.to(DEVICE),
        w13.to(dtype),
        w2.to(dtype),
    )


def check(fm, args: tuple, tiling=None) -> torch.Tensor:
    """The op against the reference; 16-bit inputs against the reference that rounds h once,
    as the kernel does (``h_dtype``)."""
    got = fm.moe_experts(*args, LIMIT, tiling=tiling)
    x, ids, weights, w13, w2 = args
    assert got.shape == x.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        assert_fp32_close(got, reference.moe_experts(*args, LIMIT))
    else:
        ref = reference.moe_experts(*args, LIMIT, h_dtype=x.dtype)
        ref32 = reference.moe_experts(x.float(), ids, weights, w13.float(), w2.float(), LIMIT)
        # rounding h as the kernel does, the reference's output is the kernel's own rounding
        assert_bf16_close(got, ref, ref32, ulps=1)
    return got


@pytest.mark.parametrize("t", [1, 3, 17, 64])
@pytest.mark.parametrize("e,d,i,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(fm, t, e, d, i, k, dtype):
    check(fm, make_case(t, e, d, i, k, seed=t * 31 + e, dtype=dtype))


def prefill_like_tiling(fm, block_m: int = 32) -> object:
    """Wider blocks, narrow tiles (several n- and k-steps, ragged edges) and tiny align
    segments, so the two-launch align path runs."""
    return fm.Tiling(
        block_m=block_m,
        gate_up_block_n=32,
        gate_up_block_k=64,
        gate_up_warps=4,
        gate_up_stages=2,
        down_block_n=64,
        down_block_k=32,
        down_warps=4,
        down_stages=2,
        align_segment=16,
        sum_block_d=32,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m", [16, 32])
def test_other_tilings_and_ragged_sizes(fm, dtype, block_m):
    """D=96, I=48: neither a multiple of the k- or n-tiles."""
    tiling = prefill_like_tiling(fm, block_m)
    check(fm, make_case(29, 8, 96, 48, 3, seed=block_m, dtype=dtype), tiling)


@pytest.mark.parametrize("t", [1, 29, 64])
def test_rounded_h_is_finer_than_the_bf16_reference(fm, t):
    """h rounded once to bf16 (the reference with ``h_dtype``) is no less accurate than the
    bf16 reference (which rounds gate, up, SiLU and product) against fp32 on the same
    inputs, and the kernel is that reference's up to the rule's tolerance."""
    x, ids, weights, w13, w2 = args = make_case(t, 8, 128, 64, 3, seed=t, dtype=torch.bfloat16)
    ref32 = reference.moe_experts(x.float(), ids, weights, w13.float(), w2.float(), LIMIT)
    rounded = (reference.moe_experts(*args, LIMIT, h_dtype=torch.bfloat16).float() - ref32).abs()
    bf16 = (reference.moe_experts(*args, LIMIT).float() - ref32).abs()
    assert rounded.mean() <= bf16.mean() and rounded.median() <= bf16.median()
    for block_m in (16, 32):
        check(fm, args, prefill_like_tiling(fm, block_m))


def test_down_grid_with_tiles_fastest(fm):
    """``Tiling.down_tile_fastest``: the down kernel's grid as (n-tiles, blocks), several
    blocks and n-tiles, bf16 and fp32."""
    tiling = dataclasses.replace(prefill_like_tiling(fm, 16), down_tile_fastest=True)
    for dtype in (torch.bfloat16, torch.float32):
        check(fm, make_case(29, 8, 96, 48, 3, seed=11, dtype=dtype), tiling)


@pytest.mark.parametrize(
    "segment, per_expert", [(16, False), (4096, False), (16, True), (4096, None)]
)
def test_align_layout(fm, segment, per_expert):
    """Each expert's run holds its pairs in order, padded with P to a multiple of BM;
    block_expert names each block's expert and E past the used blocks; ids outside
    [0, E) go nowhere. Segmented (several or one program) and one program per expert;
    one expert's pairs span several chunks of the per-expert scan."""
    e, bm = 8, 16
    _, ids, *_ = make_case(57, e, 64, 32, 3, seed=9, dtype=torch.float32)
    ids[3, 1] = -1
    ids[40, 0] = e
    ids[20:50, 2] = 5  # 30+ pairs of expert 5: two blocks, across the 128-pair chunks
    sorted_ids, block_expert = fm.moe_align(ids, e, bm, segment, per_expert)
    flat = ids.flatten().cpu()
    p = flat.numel()
    rows, blocks = sorted_ids.cpu(), block_expert.cpu()
    used = 0
    for expert in range(e):
        pairs = torch.nonzero(flat == expert).flatten().tolist()
        padded = -(-len(pairs) // bm) * bm
        run = rows[used : used + padded].tolist()
        assert run == pairs + [p] * (padded - len(pairs)), expert
        assert blocks[used // bm : (used + padded) // bm].tolist() == [expert] * (padded // bm)
        used += padded
    assert used <= rows.numel()
    assert (blocks[used // bm :] == e).all()


def test_one_expert_takes_every_token(fm):
    """Several blocks for one expert, every other expert empty."""
    x, ids, weights, w13, w2 = make_case(40, 4, 64, 32, 1, seed=2, dtype=torch.float32)
    ids.fill_(2)
    check(fm, (x, ids, weights, w13, w2))


def test_repeated_expert_within_a_token(fm):
    x, ids, weights, w13, w2 = make_case(9, 4, 64, 32, 3, seed=4, dtype=torch.float32)
    ids[:, 1] = ids[:, 0]
    check(fm, (x, ids, weights, w13, w2))


def test_unrouted_slots_add_nothing(fm):
    """Ids outside [0, E) (padded rows) equal a slot of weight zero."""
    x, ids, weights, w13, w2 = make_case(17, 8, 64, 32, 3, seed=5, dtype=torch.float32)
    bad = ids.clone()
    bad[0, :] = -1
    bad[5, 2] = 8
    got = fm.moe_experts(x, bad, weights, w13, w2, LIMIT)
    zeroed = weights.clone()
    zeroed[bad != ids] = 0.0
    assert_fp32_close(got, reference.moe_experts(x, ids, zeroed, w13, w2, LIMIT))
    assert (got[0] == 0).all()


def test_strided_inputs_and_determinism(fm):
    """Non-contiguous weights / activations give the contiguous result, bit for bit, and
    int32 ids equal int64 ids."""
    x, ids, weights, w13, w2 = make_case(17, 8, 64, 32, 3, seed=6, dtype=torch.bfloat16)
    first = fm.moe_experts(x, ids, weights, w13, w2, LIMIT)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # stride along D != 1
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    wide = torch.zeros(17, 80, dtype=x.dtype, device=DEVICE)
    wide[:, :64] = x
    second = fm.moe_experts(wide[:, :64], ids.int(), weights, w13_t, w2_t, LIMIT)
    assert torch.equal(first, second)
    assert torch.equal(first, fm.moe_experts(x, ids, weights, w13, w2, LIMIT))


def test_empty_batch(fm):
    _, _, _, w13, w2 = make_case(1, 4, 64, 32, 2, seed=0, dtype=torch.float32)
    x, ids, weights = torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    x, ids, weights = (t.to(w13.device) for t in (x, ids, weights))
    assert fm.moe_experts(x, ids, weights, w13, w2, LIMIT).shape == (0, 64)


def test_bad_input_raises_clear_errors(fm):
    x, ids, weights, w13, w2 = make_case(3, 4, 64, 32, 2, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        fm.moe_experts(x[0], ids, weights, w13, w2, LIMIT)
    with pytest.raises(ValueError, match="topk_ids must be"):
        fm.moe_experts(x, ids.float(), weights, w13, w2, LIMIT)
    with pytest.raises(ValueError, match="topk_weights must be"):
        fm.moe_experts(x, ids, weights[:, :1], w13, w2, LIMIT)
    with pytest.raises(ValueError, match="w13 must be"):
        fm.moe_experts(x, ids, weights, w13[:, :, :-1], w2, LIMIT)
    with pytest.raises(ValueError, match="w2 must be"):
        fm.moe_experts(x, ids, weights, w13, w2[:, :, :-1], LIMIT)
    with pytest.raises(ValueError, match="dtype"):
        fm.moe_experts(x, ids, weights, w13.bfloat16(), w2, LIMIT)
    with pytest.raises(ValueError, match="power of two"):
        fm.Tiling(24, 64, 64, 4, 1, 64, 64, 4, 1, 4096, 256)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
V4_FLASH = (64, 4096, 2048, 6)  # E, D, I, k (4-layer bench preset)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "t,dtype",
    [
        (1, torch.bfloat16),
        (64, torch.bfloat16),
        (256, torch.bfloat16),
        (1024, torch.bfloat16),
        (64, torch.float32),
    ],
)
def test_v4_flash_sizes_on_gpu(fm, t, dtype):
    """V4-Flash expert shapes with the GPU default tiling; the same tolerances."""
    check(fm, make_case(t, *V4_FLASH, seed=t, dtype=dtype))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 64, 256])
@pytest.mark.parametrize("order", ["tile_fastest", "block_fastest"])
def test_v4_flash_sizes_on_gpu_grid_orders(fm, t, order):
    """Both orders of the down kernel's grid at the GPU tiling, and bitwise the same result
    (each output element is one program's, whatever order the programs run in)."""
    x = make_case(t, *V4_FLASH, seed=t + 7, dtype=torch.bfloat16)
    default = fm.default_tiling(t, x[1].shape[1], x[3].shape[0], x[4].shape[2], x[0].device)
    tiling = dataclasses.replace(default, down_tile_fastest=order == "tile_fastest")
    got = check(fm, x, tiling)
    other = dataclasses.replace(default, down_tile_fastest=order == "block_fastest")
    assert torch.equal(got, fm.moe_experts(*x, LIMIT, tiling=other))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_is_bitwise_equal_to_eager(fm):
    """Captured once, replayed on new routing copied into the static buffers."""
    x, ids, weights, w13, w2 = make_case(64, *V4_FLASH, seed=1, dtype=torch.bfloat16)

    def step():
        return fm.moe_experts(x, ids, weights, w13, w2, LIMIT)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    new = make_case(64, *V4_FLASH, seed=2, dtype=torch.bfloat16)
    x.copy_(new[0])
    ids.copy_(new[1])
    weights.copy_(new[2])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
