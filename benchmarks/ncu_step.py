"""One eager forward of a synthetic batch, for Nsight Compute to profile kernel by kernel.

The forward runs twice: the first compiles every Triton kernel, the second is the one to
profile (``ncu --launch-skip`` past the first forward's launches, or a kernel-name filter
with ``--launch-count``). NVTX ranges mark the two forwards, so ``ncu --nvtx
--nvtx-include "profiled/"`` selects the second alone.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" -k regex:"moe_down|prenorm" \\
        --launch-count 4 --section SpeedOfLight python3 benchmarks/ncu_step.py \\
        --batch decode:256@4096
"""

from __future__ import annotations

import argparse

import torch

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.step_buffers import StepBuffers


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    args = p.parse_args()
    cfg = preset_config("v4-flash", args.layers, args.experts)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    model.eval()
    s = synthetic_step(model, BatchSpec.parse(args.batch))
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cuda")
    input_ids, meta, logits_indices = buffers.eager_step(s.step.inputs, s.step.table_writes)
    for name in ("warm-up", "profiled"):
        torch.cuda.nvtx.range_push(name)
        hidden, _ = model(input_ids, meta, s.caches)
        model.compute_logits(hidden[logits_indices])
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
