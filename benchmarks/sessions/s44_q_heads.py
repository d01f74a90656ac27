"""Session 44: the wgmma prefill attention's q norm in blocks of ``Q_NORM_HEADS`` heads (16,
the default: 32 fp32 a thread) against 32 and 64 (one pass: load, norm and rotate, one
barrier, store). Compiled for sm_90 on the CPU (ptxas, nvdisasm), 64 heads at once keeps
0 bytes of stack on the 32-row tiling (8 on the 64-row one, as 16 does) and takes the kernel
from 24 barriers, 4536 instructions and 229 global loads to 18, 4304 and 181 (cos and sin
loaded once, not once a block).

The model's path (q raw, ``prefill_bench.phase_inputs(..., "model")``) at 8192 queries, HCA
and CSA shapes: each block size timed twice, alternating; every output must equal the
16-head one bit for bit (a head's sum of squares runs in the same order in every block).
Prints one JSON record per (layer, heads, round). Usage on a GPU:
python3 benchmarks/sessions/s44_q_heads.py
"""

from __future__ import annotations

import json

import torch
from prefill_bench import _inputs, _plain_us, phase_inputs

from rackserve.ops.triton import prefill_attn_wgmma

HEADS = (16, 32, 64)


def main() -> None:
    for layer in ("hca", "csa"):
        args, kwargs = phase_inputs(_inputs(8192, 0, layer, "cuda"), "model")
        want = None
        for rnd in (1, 2):
            for heads in HEADS:
                prefill_attn_wgmma.Q_NORM_HEADS = heads
                out = prefill_attn_wgmma.paged_sparse_attention(*args, **kwargs)
                if want is None:
                    want = out
                us = _plain_us(
                    lambda a=args, k=kwargs: prefill_attn_wgmma.paged_sparse_attention(*a, **k)
                )
                rec = {"layer": layer, "q_norm_heads": heads, "round": rnd, "time_us": us}
                rec["same_as_16"] = bool(torch.equal(out, want))
                print(json.dumps(rec), flush=True)
    prefill_attn_wgmma.Q_NORM_HEADS = HEADS[0]


if __name__ == "__main__":
    main()
