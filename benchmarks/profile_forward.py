"""Where a forward's GPU time goes: torch.profiler over the eager fast path of one batch.

Prints the kernels by total GPU time (name, calls, total, share) and the number of kernel
launches per forward and per layer; writes the table as JSON.
Usage: python3 benchmarks/profile_forward.py --batch decode:64@4096 [--layers 4 --experts 64]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.step_buffers import StepBuffers


def _forward(model, input_ids, meta, caches, logits_indices) -> None:
    hidden, _ = model(input_ids, meta, caches)
    model.compute_logits(hidden[logits_indices])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", action="append", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    cfg = preset_config("v4-flash", args.layers, args.experts)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    model.eval()
    report = {}
    for text in args.batch:
        s = synthetic_step(model, BatchSpec.parse(text))
        buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cuda")
        with torch.inference_mode():
            input_ids, meta, idx = buffers.eager_step(s.step.inputs, s.step.table_writes)

            for _ in range(3):
                _forward(model, input_ids, meta, s.caches, idx)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _forward(model, input_ids, meta, s.caches, idx)
                torch.cuda.synchronize()
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name][0] += 1
                totals[e.name][1] += e.device_time_total
        launches = sum(c for c, _ in totals.values())
        busy = sum(t for _, t in totals.values())
        rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
        print(
            f"== {text}: {launches} kernels ({launches / cfg.num_hidden_layers:.0f} per "
            f"layer), {busy / 1e3:.3f} ms of kernel time"
        )
        for name, (calls, t) in rows[: args.top]:
            print(f"{t / 1e3:8.3f} ms {100 * t / busy:5.1f}% {calls:5d}x  {name[:110]}")
        report[text] = {
            "kernels": launches,
            "kernel_ms": busy / 1e3,
            "top": [{"name": n, "calls": c, "us": t} for n, (c, t) in rows[: args.top]],
        }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
