"""Where a decode graph step's time goes beyond its kernels: the replay alone (CUDA events
around ``graph.replay()`` only), the same with the runner's input upload, and the summed
kernel time inside the replay (torch.profiler), for one batch.

    python3 benchmarks/graph_gap.py --batch decode:1@4096 --output $OUT/graph_gap.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from rackserve.bench.forward import BatchSpec, synthetic_step
from rackserve.model.create import init_model_
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.presets import preset_config
from rackserve.runner.cuda_graph import DecodeGraphs
from rackserve.runner.step_buffers import StepBuffers


def _events(fn, iters: int = 30) -> float:
    """Median milliseconds of ``fn`` between two CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def measure(batch: str) -> dict:
    cfg = preset_config("v4-flash", 4, 64)
    with torch.device("cuda"):
        model = DeepseekV4ForCausalLM(cfg, with_mtp=False)
    init_model_(model.cast(torch.bfloat16), seed=0)
    s = synthetic_step(model.eval(), BatchSpec.parse(batch))
    inputs, writes = s.step.inputs, s.step.table_writes
    buffers = StepBuffers(s.groups, s.input_batch.block_tables, "cuda")
    graphs = DecodeGraphs(
        model, s.caches, buffers, s.groups, [len(inputs.rows)], [inputs.max_seq_len]
    )
    buffers.apply_writes(*buffers.upload(list(writes)))
    graphs.capture(log=False)
    key = graphs.key_for(inputs)
    empty = (writes[0][:0], writes[1][:0])
    graph, _ = graphs.graphs[key]
    for _ in range(3):
        graphs.run(key, inputs, empty)
    with_upload = _events(lambda: graphs.run(key, inputs, empty))
    replay = _events(graph.replay)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in kernels) / 1e3
    return {
        "batch": batch,
        "step_with_upload_ms": with_upload,
        "replay_ms": replay,
        "kernel_ms_in_replay": busy,
        "kernels_in_replay": len(kernels),
        "gap_ms": replay - busy,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", action="append", required=True)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    records = [measure(b) for b in args.batch]
    for r in records:
        print(json.dumps(r))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
