"""The Gluon wgmma sparse prefill attention (``ops/triton/prefill_attn_wgmma.py``) against the
reference (``reference.paged_sparse_attention``) and the Triton prefill kernel.

Gluon kernels do not run in Triton's interpreter: on CPU the kernel is compiled for sm_90
through Triton's ptxas (every tiling: wgmma used, at most 16 bytes of spills, shared memory
within the H200's 227 KB); on a GPU (``gpu`` mark) it runs at V4-Flash sizes (H 64, Dh 512
with 64 rope dims, Wa 128) on prefill masks (HCA and CSA, a prompt after a cached prefix, a mixed
step) and on masks with holes, outputs poisoned with NaN, under the bf16 rule of the kernel
tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from rackserve.ops import reference
from rackserve.ops.triton import prefill_attn, prefill_attn_wgmma

from attn_cases import any_mask, make_case, prefill_mask
from kernel_checks import DEVICE, as_fp32, assert_bf16_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sass_resources import resources

_POINTERS = {
    "slots_a_ptr": "*i64", "slots_b_ptr": "*i64", "valid_ptr": "*u8", "sinks_ptr": "*fp32",
}  # fmt: skip
_CONSTEXPRS = ("BLOCK_N", "BLOCK_V", "ROPE", "NUM_STAGES", "P_BUFFERS", "Q_NORM", "Q_HEADS")


def compile_sm90(tiling: prefill_attn_wgmma.WgmmaTiling, dtype: str = "bf16", q_norm: bool = False):
    """The kernel compiled for sm_90 as the launch specializes it (pointers and strides
    divisible by 16), with the inverse RoPE on (``q_norm``: q arriving raw)."""
    fn = prefill_attn_wgmma.prefill_attn_wgmma_kernel
    names = list(fn.arg_names)
    sig = {}
    for n in names:
        if n in _CONSTEXPRS:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = _POINTERS.get(n, f"*{dtype}")
        else:
            sig[n] = "fp32" if n in ("qk_scale", "q_eps") else "i32"
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    consts = {"BLOCK_N": tiling.block_n, "BLOCK_V": 1024, "ROPE": True}
    consts |= {"NUM_STAGES": tiling.num_stages, "P_BUFFERS": tiling.p_buffers}
    consts |= {"Q_NORM": q_norm, "Q_HEADS": prefill_attn_wgmma.Q_NORM_HEADS}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


TILINGS = [
    prefill_attn_wgmma.WgmmaTiling(),
    prefill_attn_wgmma.WgmmaTiling(32, 3, p_buffers=1),
    prefill_attn_wgmma.WgmmaTiling(16, 6),
    prefill_attn_wgmma.WIDE_TILING,
]
# ptxas' stack bytes a tiling may keep: a few spilled registers (CPU compile, 2026-12-07: 0-16
# bytes; the 64-row tiling's 112 before the barrier rework of session 43)
STACK_BYTES = 16


def _tiling_id(t: prefill_attn_wgmma.WgmmaTiling) -> str:
    return f"bn{t.block_n}_s{t.num_stages}_p{t.p_buffers}"


def compile_report(block_n: int, num_stages: int, p_buffers: int, q_norm: int = 0) -> dict:
    """What decides the kernel's speed before a GPU runs it (this file as a script)."""
    tiling = prefill_attn_wgmma.WgmmaTiling(block_n, num_stages, p_buffers)
    kernel = compile_sm90(tiling, q_norm=bool(q_norm))
    ptx = kernel.asm["ptx"]
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "shared_bytes": kernel.metadata.shared,
        "stack_bytes": resources(kernel)["stack_bytes"],
    }


@pytest.mark.parametrize(
    "tiling, q_norm",
    [(t, False) for t in TILINGS] + [(t, True) for t in (TILINGS[0], *TILINGS[3:])],
    ids=[_tiling_id(t) for t in TILINGS]
    + [f"{_tiling_id(t)}_qnorm" for t in (TILINGS[0], *TILINGS[3:])],
)
def test_compiles_for_sm90_with_wgmma_and_no_spills(tiling, q_norm):
    # in a process of its own: the interpreter (TRITON_INTERPRET=1) cannot compile Gluon
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, __file__, str(tiling.block_n), str(tiling.num_stages)]
    args += [str(tiling.p_buffers), str(int(q_norm))]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["wgmma"] > 0 and report["mma_sync"] == 0
    assert report["shared_bytes"] <= 227 * 1024
    assert report["stack_bytes"] <= STACK_BYTES


def test_default_tiling_by_rows_a_query():
    """64-row tiles from WIDE_MIN_ROWS rows a query (a CSA layer's 128 + 512), 32-row ones
    below (an HCA layer's 128 + 64 at 8192 tokens)."""
    wide = prefill_attn_wgmma.default_tiling(128 + 512)
    assert wide == prefill_attn_wgmma.WIDE_TILING and wide.block_n == 64
    assert prefill_attn_wgmma.default_tiling(128 + 64) == prefill_attn_wgmma.WgmmaTiling()


gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(prefill_attn_wgmma, "_empty", empty)


def _check(args: tuple, tiling=None) -> torch.Tensor:
    got = prefill_attn_wgmma.paged_sparse_attention(*args, tiling=tiling)
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    ref32 = reference.paged_sparse_attention(*as_fp32(args))
    assert_bf16_close(got, reference.paged_sparse_attention(*args), ref32)
    return got


V4 = {"dh": 512, "rope_dim": 64, "wa": 128}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tiling", TILINGS, ids=_tiling_id)
@pytest.mark.parametrize(
    "lengths, wb, ratio",
    [
        ([(1024, 1024)], 16, 128),  # HCA after a cached prefix
        ([(0, 700)], 176, 4),  # CSA-like prefix of picks, early queries see none
        ([(300, 1), (0, 257), (40, 3)], 80, 4),  # a mixed step
    ],
)
def test_prefill_masks_at_v4_flash_sizes(tiling, lengths, wb, ratio):
    valid = prefill_mask(lengths, 128, wb, ratio)
    _check(make_case(valid, 64, torch.bfloat16, seed=len(lengths) + wb, **V4), tiling)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masks_with_holes_and_empty_rows(dtype):
    g = torch.Generator().manual_seed(5)
    valid = any_mask(96, 128, 40, g)
    valid[3] = False  # a query with no row: the sink alone (zero output)
    got = _check(make_case(valid, 64, dtype, seed=7, **V4))
    assert torch.count_nonzero(got[3]) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "tiling", [None, *TILINGS], ids=lambda t: _tiling_id(t) if t else "default"
)
@pytest.mark.parametrize("lengths, wb, ratio", [([(1024, 300)], 16, 128), ([(0, 700)], 176, 4)])
def test_raw_q_normed_and_rotated_on_load(lengths, wb, ratio, tiling):
    """q_norm_eps: the kernel takes wq_b's raw q and applies the prologue's unweighted norm +
    RoPE as it loads it: the kernel's output on the prologue's q (checked against the
    reference), up to a q element rounded the other way (the norm's sum of squares runs in
    another order)."""
    valid = prefill_mask(lengths, 128, wb, ratio)
    args = make_case(valid, 64, torch.bfloat16, seed=11, **V4)
    raw = (args[0].float() * 5 + 1).to(torch.bfloat16)  # not unit-RMS, a nonzero mean
    got = prefill_attn_wgmma.paged_sparse_attention(raw, *args[1:], q_norm_eps=1e-6, tiling=tiling)
    assert not got.isnan().any()
    normed = reference.rms_norm_rope(raw, None, 1e-6, args[-2], args[-1])
    want = _check((normed, *args[1:]), tiling)  # the same tiling: the same summation order
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * want.abs().max().item()
    assert (got != want).float().mean().item() <= 0.01


@pytest.mark.gpu
@gpu
def test_agrees_with_the_triton_prefill_kernel():
    valid = prefill_mask([(0, 512)], 128, 128, 4)
    args = make_case(valid, 64, torch.bfloat16, seed=3, **V4)
    got = prefill_attn_wgmma.paged_sparse_attention(*args).float()
    want = prefill_attn.paged_sparse_attention(*args).float()
    # same numerics (bf16 p, its rounded sum), different summation order
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_supported_names_the_shapes_it_serves():
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    assert not prefill_attn_wgmma.supported(q, q[0])  # CPU tensors
    with pytest.raises(ValueError, match="sm_90 only"):
        args = make_case(prefill_mask([(0, 2)], 4, 0, 4), 4, torch.bfloat16, seed=0, wa=4)
        prefill_attn_wgmma.paged_sparse_attention(*(a.cpu() if torch.is_tensor(a) else a
                                                    for a in args))  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(compile_report(*map(int, sys.argv[1:]))))
