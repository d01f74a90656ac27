"""mHC's K1 (``prenorm_gemm_kernel``) compiled for sm_90 (no GPU: Triton's bundled ptxas)
as hc_post_pre launches it for V4-Flash's streams (N 4, D 4096, bf16), in the defaults'
launch shapes and in the expand-fused candidates an A/B times (``mhc.EXPAND_K1_*``): no
spills. The launches are recorded through the op itself on fake CUDA tensors
(``benchmarks/sass_audit.py``: Triton's own argument binder, so the integer
specializations are the real ones).

Session 45 found the defaults' expand-fused K1 at 5-127 tokens (tf32x3) spilling: at 64
tokens 888 bytes of stack after an attention block and 672 after a fused MoE's slots. At
decode:64 on an H100 it took 18 us a call where the flat K1 without the expand took 5
(session 43's replay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rackserve.ops.triton import mhc

AUDIT = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_audit.py"
STACK_BYTES = 16  # ptxas' stack bytes K1 may keep (sass_audit's bound)
SHARED_BYTES = 227 * 1024


@pytest.fixture(scope="module")
def k1_reports() -> dict[tuple[str, int], dict]:
    """K1's record of each audited case (``sass_audit.py --json``), by (case, tokens)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(AUDIT), "--json", "hc_post_pre", "k1 "], env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.splitlines()[-1])
    assert not [r for r in records if "skipped" in r], records
    return {(r["case"], r["tokens"]): r for r in records if r["kernel"] == "prenorm_gemm_kernel"}


SPILLS = "the defaults' expand-fused K1 at 5-127 tokens, tf32x3 (session 45; A/B pending)"
DEFAULTS = [("hc_post_pre", t) for t in (1, 16, 64, 256, 8192)]
DEFAULTS += [("hc_post_pre slots", t) for t in (16, 64, 256)]


@pytest.mark.parametrize(
    "case, tokens",
    [pytest.param(c, t, marks=pytest.mark.xfail(strict=True, reason=SPILLS))
     if t in (16, 64) else (c, t) for c, t in DEFAULTS],
)  # fmt: skip
def test_default_k1_compiles_for_sm90_without_spills(case, tokens, k1_reports):
    """hc_post_pre's K1 (the expand in its prologue below ``POST_APART_MIN_TOKENS``, else
    the flat K1 after hc_post's own expand) at the default launch shapes, after an attention
    block and after a fused MoE ("slots")."""
    report = k1_reports[(case, tokens)]
    assert report["stack_bytes"] <= STACK_BYTES, report
    assert report["shared_bytes"] <= SHARED_BYTES, report


CANDIDATES = [(f"k1 {n}{s}", 64) for n in mhc.EXPAND_K1_DECODE for s in ("", " slots")]
CANDIDATES += [(f"k1 {n}", 8192) for n in mhc.EXPAND_K1_PREFILL]


@pytest.mark.parametrize("case, tokens", CANDIDATES)
def test_expand_k1_candidates_compile_for_sm90_without_spills(case, tokens, k1_reports):
    """Each expand-fused candidate an A/B times (at 64 tokens after either block, at 8192
    after a plain block output) compiles without spills and within shared memory."""
    report = k1_reports[(case, tokens)]
    assert "FUSE_POST=1" in report["constexprs"] and "PRECISION=bf16x3" in report["constexprs"]
    assert report["stack_bytes"] <= STACK_BYTES, report
    assert report["shared_bytes"] <= SHARED_BYTES, report
